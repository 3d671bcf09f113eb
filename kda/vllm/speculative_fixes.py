"""vLLM-CPU's fixes for speculative decoding (:mod:`kda.vllm.cpu_fixes`' ``spec_conv`` and
``spec_align``): where Kimi Linear's layer and vLLM's align-mode state copies call Triton kernels or
a C++ kernel that ignores the speculative arguments, the calls go to :mod:`kda.vllm.speculative`'s
torch functions. Each installer is given the vLLM module it patches (its import hook) and patches
through :mod:`kda.vllm._patch`.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

from .._errors import InvalidInputError
from . import _patch

__all__ = ["CONV_OPS", "MAMBA_UTILS", "align_copies", "conv_update"]

CONV_OPS = "vllm.model_executor.layers.mamba.ops.causal_conv1d"
CONV_USER = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"  # binds causal_conv1d_update
CONV_SIGNATURE = (  # vLLM-CPU's causal_conv1d_update_cpu: num_accepted_tokens only in **kwargs
    "(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, query_start_loc=None, "
    "pad_slot_id=None, **kwargs)"
)
MAMBA_UTILS = "vllm.v1.worker.mamba_utils"
INIT_FROM_CONTEXT = (  # MambaSpecDecodeGPUContext.initialize_from_forward_context
    "(self, kv_cache_config, forward_context, mamba_state_copy_funcs, block_tables, "
    "aligned_index_block_tables=None)"
)


def conv_update(module: types.ModuleType) -> None:
    """``causal_conv1d_update`` in ``module`` (and in Kimi Linear's layer if that has bound it):
    :func:`_conv_dispatch`."""
    _patch.wrap(module, "causal_conv1d_update", _conv_dispatch, signature=CONV_SIGNATURE)
    user = sys.modules.get(CONV_USER)
    if user is not None and hasattr(user, "causal_conv1d_update"):
        _patch.wrap(user, "causal_conv1d_update", _conv_dispatch, signature=CONV_SIGNATURE)


def _accepted_tokens(signature: inspect.Signature) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """The ``num_accepted_tokens`` a call's arguments bind to under ``signature``: a parameter of
    its own (by position or keyword), or an entry of its ``**kwargs``."""
    names = list(signature.parameters)
    param = signature.parameters.get("num_accepted_tokens")
    if param is not None and param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
        index = names.index("num_accepted_tokens")
        return lambda args, kwargs: args[index] if len(args) > index else kwargs.get("num_accepted_tokens")
    return lambda args, kwargs: kwargs.get("num_accepted_tokens")


def _conv_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (vLLM-CPU's ``causal_conv1d_update``) for calls whose arguments, bound to its
    signature, carry no ``num_accepted_tokens``; the others (the speculative path) to
    :func:`kda.vllm.speculative.causal_conv1d_update_spec`, with the arguments by name."""
    signature = inspect.signature(original)
    accepted = _accepted_tokens(signature)

    def causal_conv1d_update(*args: Any, **kwargs: Any) -> Any:
        if accepted(args, kwargs) is None:
            return original(*args, **kwargs)
        from .speculative import causal_conv1d_update_spec

        named: dict[str, Any] = {}
        for name, value in signature.bind(*args, **kwargs).arguments.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[name] = value
        pad = named.pop("pad_slot_id", None)  # vLLM-CPU's name of the null block id
        if pad is not None and named.get("null_block_id") is None:
            named["null_block_id"] = pad
        return causal_conv1d_update_spec(**named)

    return causal_conv1d_update


def _full_rows(t: Any) -> Any:
    """The whole persistent tensor a row slice (``block_table.gpu[:num_reqs]``) views."""
    base = getattr(t, "_base", None)
    return t if base is None else base


def align_copies(module: types.ModuleType) -> None:
    """``MambaSpecDecodeGPUContext``: record the state tensors and block tables when it binds to
    them, and run the align-mode precopy and postprocess on them in torch."""
    Ctx = module.MambaSpecDecodeGPUContext

    def make(init: Callable[..., None]) -> Callable[..., None]:
        def initialize_from_forward_context(
            self: Any,
            kv_cache_config: Any,
            forward_context: Any,
            mamba_state_copy_funcs: Any,
            block_tables: Any,
            aligned_index_block_tables: Any = None,
        ) -> None:
            from vllm.model_executor.layers.mamba.mamba_utils import (
                get_conv_copy_spec,
                is_conv_state_dim_first,
            )

            from .speculative import MambaState

            if self.is_initialized:
                return
            init(
                self,
                kv_cache_config,
                forward_context,
                mamba_state_copy_funcs,
                block_tables,
                aligned_index_block_tables,
            )
            states = []
            for g, gid in enumerate(self.mamba_group_ids):
                group = kv_cache_config.kv_cache_groups[gid]
                for name in group.layer_names:
                    spec = module._get_mamba_spec_for_layer(group, name)
                    caches = forward_context[name].kv_cache
                    for tensor, fn in zip(caches, mamba_state_copy_funcs[spec.mamba_type]):
                        conv = fn is get_conv_copy_spec
                        states.append(MambaState(tensor, conv, conv and is_conv_state_dim_first(), g))
            self._kda_states = states
            self._kda_block_tables = [_full_rows(t) for t in block_tables]

        return initialize_from_forward_context

    def run_fused_precopy(
        self: Any, num_reqs: int, state_idx_gpu: Any, src_col_gpu: Any, token_bias_gpu: Any, idx_mapping: Any
    ) -> None:
        from .speculative import precopy_align

        if num_reqs == 0 or not self.is_initialized:
            return
        if idx_mapping is not None:
            raise InvalidInputError(
                "kda.vllm's align precopy runs vLLM's V1 model runner only (idx_mapping given)"
            )
        precopy_align(
            self._kda_states, self._kda_block_tables, state_idx_gpu, src_col_gpu, token_bias_gpu, num_reqs
        )

    def run_fused_postprocess(
        self: Any,
        num_reqs: int,
        num_accepted_tokens_gpu: Any,
        mamba_state_idx_gpu: Any,
        num_scheduled_tokens_gpu: Any,
        num_computed_tokens_gpu: Any,
        num_draft_tokens_gpu: Any,
    ) -> None:
        from .speculative import postprocess_align

        if num_reqs == 0 or not self.is_initialized:
            return
        self.num_accepted_tokens_out[:num_reqs].copy_(num_accepted_tokens_gpu[:num_reqs])
        postprocess_align(
            self._kda_states,
            self._kda_block_tables,
            num_accepted_tokens_gpu,
            mamba_state_idx_gpu,
            num_scheduled_tokens_gpu,
            num_computed_tokens_gpu,
            num_draft_tokens_gpu,
            num_reqs,
            self.block_size,
            self.num_accepted_tokens_out,
        )

    _patch.wrap(Ctx, "initialize_from_forward_context", make, signature=INIT_FROM_CONTEXT)
    for fn in (run_fused_precopy, run_fused_postprocess):
        _patch.replace(Ctx, fn.__name__, fn, signature=fn)
