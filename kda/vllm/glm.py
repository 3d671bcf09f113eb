"""GLM-5.3-Flash's KDA ops on kda, with vLLM's signatures (``vllm.models.glm5next.nvidia.ops.third_party.kda``
and ``vllm.model_executor.layers.mamba.ops.scatter_states`` of vLLM 0.32).

GLM-5.3-Flash's KDA layer (``Glm5NextLinearAttention``, ``vllm/models/glm5next/common/kda.py``) has
ops of its own, with other signatures than Kimi Linear's (:mod:`kda.vllm.ops`):

- ``fused_recurrent_kda(q, k, v, g, beta, ...)`` serves both plain decode (1-D
  ``ssm_state_indices``, one token per request) and speculative verify (2-D indices with
  ``num_accepted_tokens``); the gate is computed in the kernel only with ``compute_gate=True``
  (then the bounded gate ``lower_bound * sigmoid(exp(a_log) * (g + g_bias))``), ``g`` is the log
  decay otherwise; ``beta`` is sigmoided in the kernel only with ``sigmoid_beta=True``;
- ``chunk_kda_with_fused_gate(q, k, v, raw_g, beta, A_log, g_bias, ...)`` takes ``beta`` already
  sigmoided, and ``safe_gate`` chooses the bounded gate (with ``lower_bound``) over
  ``-exp(A_log) * softplus(g + g_bias)``;
- the prefill's final states go back to the pool through ``scatter_states(state, src, indices)``
  (``state[indices] = src``), which asserts a CUDA tensor; ``gather_initial_states`` is
  :func:`kda.vllm.ops.gather_initial_states`.

The pool is vLLM's (V-major ``[slots, HV, V, K]``, float32 or bfloat16, each slot dense, the slot
stride possibly padded), read and written in place; slot 0 (and -1) is padding. These functions
need torch only: ``tests/adapters/test_vllm_glm_ops.py`` checks them without vLLM.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from .. import torch as _kt
from .._errors import InvalidTypeError, refuse
from .._options.arguments import c_contiguous
from .ops import PAD_SLOT_ID, _check_pool, _finish, _shape

__all__ = ["chunk_kda_with_fused_gate", "fused_recurrent_kda", "scatter_states"]


def _recurrent_gate(
    compute_gate: bool, a_log: Any, g_bias: Any, lower_bound: float | None, H: int, K: int
) -> dict[str, Any]:
    if not compute_gate:  # g is the log decay: vLLM's kernel reads neither a_log nor g_bias
        return {}
    if a_log is None or g_bias is None:
        refuse("compute_gate=True needs a_log and g_bias (vLLM's GLM-5.3-Flash kernel asserts both)")
    if lower_bound is None:
        refuse("compute_gate=True computes the bounded gate only: lower_bound must be set (a float < 0)")
    if a_log.numel() != H or g_bias.numel() != H * K:
        got = (a_log.numel(), g_bias.numel())
        refuse(f"a_log must have H = {H} and g_bias H * K = {H * K} elements; got {got[0]} and {got[1]}")
    return {"use_gate_in_kernel": True, "A_log": a_log, "dt_bias": g_bias, "lower_bound": lower_bound}


def _check_recurrent(q: Any, v: Any, beta: Any, initial_state: Any, inplace_final_state: bool,
                     ssm_state_indices: Any, cu_seqlens: Any) -> None:  # fmt: skip
    if not isinstance(q, torch.Tensor) or q.ndim != 4:
        refuse(f"q must have shape [B, T, H, K]; got {_shape(q)}")
    if not isinstance(v, torch.Tensor) or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        refuse(f"v must have shape [B, T, H, V] with q's B and T; got {_shape(v)}")
    if cu_seqlens is not None and q.shape[0] != 1:
        refuse(f"q must have batch size 1 with cu_seqlens (packed requests); got {_shape(q)}")
    if not isinstance(beta, torch.Tensor) or tuple(beta.shape) != tuple(v.shape[:3]):
        want = tuple(v.shape[:3])
        refuse(f"beta must have shape [B, T, HV] = {want} (one step size a head); got {_shape(beta)}")
    if not inplace_final_state:
        refuse(
            "inplace_final_state must be True: GLM-5.3-Flash's layer updates the state pool in place; "
            "kda does not return the per-token states of inplace_final_state=False"
        )
    if initial_state is None or ssm_state_indices is None:
        refuse("initial_state (the state pool) and ssm_state_indices must be given (both are read)")


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    inplace_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sigmoid_beta: bool = False,
    a_log: torch.Tensor | None = None,
    g_bias: torch.Tensor | None = None,
    compute_gate: bool = False,
    lower_bound: float | None = -5.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5.3-Flash's recurrent KDA from a state pool (plain decode and speculative verify), on
    :func:`kda.torch.fused_recurrent_kda`'s pool call.

    ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H, K]`` (the raw gate with
    ``compute_gate``, else the log decay), ``beta [B, T, H]`` (logits with ``sigmoid_beta``);
    row-strided views (column slices of the fused projection) allowed. ``B == 1`` with
    ``cu_seqlens [N + 1]`` (packed requests), else ``N = B`` requests of ``T`` tokens.
    ``ssm_state_indices``: ``[>= N]`` one slot a request (one token each), or ``[>= N, W]`` a
    slot per step, of which the first ``N`` rows are read; ``num_accepted_tokens [>= N]``:
    request ``n`` starts from slot ``[n, num_accepted_tokens[n] - 1]``. The state after each step
    goes to that step's slot of the pool ``initial_state [slots, H, V, K]`` in place (not where
    the slot is ``<= 0``; a request starting from such a slot is padding: zero output, nothing
    read or written). ``compute_gate=True`` needs ``a_log`` (``H`` elements), ``g_bias``
    (``H * K``) and ``lower_bound``; q and k are l2-normalised with ``use_qk_l2norm_in_kernel``
    (vLLM's default here: True); ``scale`` defaults to ``K ** -0.5``. Returns ``(out [B, T, H,
    V] in k's dtype, initial_state)``; tokens past ``cu_seqlens[-1]`` get no output (zeros in a
    new one). vLLM's ``**kwargs`` are accepted and unused, as vLLM's kernel ignores them.
    """
    _check_recurrent(q, v, beta, initial_state, inplace_final_state, ssm_state_indices, cu_seqlens)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV != H:  # vLLM's kernel reads a_log and g_bias per q head and sizes its output as k
        refuse(f"v must have the H = {H} heads of q and k (GLM-5.3-Flash's layout); got {_shape(v)}")
    _check_pool(initial_state, HV, K, V)
    indices, accepted, used = ssm_state_indices, num_accepted_tokens, T
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
            refuse(f"cu_seqlens must be a 1-D tensor [N + 1]; got {_shape(cu_seqlens)}")
        offsets = cu_seqlens.tolist()
        N, used = len(offsets) - 1, offsets[-1]
        if not 0 <= used <= T:
            refuse(f"cu_seqlens must end within the T = {T} tokens of q; got {used}")
        one_each = all(b - a <= 1 for a, b in itertools.pairwise(offsets))
    else:
        N, one_each = B, T == 1
    if indices.ndim not in (1, 2) or indices.shape[0] < N:
        refuse(
            f"ssm_state_indices must be [N, W] or [N] with at least N = {N} rows (one per request); got "
            f"{_shape(indices)}"
        )
    if indices.ndim == 1 and (accepted is not None or not one_each):
        refuse(
            "ssm_state_indices must be 2-D [N, W] (a slot per step) with num_accepted_tokens or with "
            "requests of more than one token; 1-D names one slot a request of one token"
        )
    gate = _recurrent_gate(compute_gate, a_log, g_bias, lower_bound, H, K)
    indices = indices[:N]
    accepted = None if accepted is None else accepted[:N]
    if used != T:  # tokens past the requests' (vLLM's padding): no output written there
        q, k, v, g, beta = (x[:, :used] for x in (q, k, v, g, beta))
    o, _ = _kt.fused_recurrent_kda(
        q, k, v, g, beta,
        initial_state=initial_state, inplace_final_state=True, ssm_state_indices=indices,
        num_accepted_tokens=accepted, cu_seqlens=cu_seqlens, state_v_first=True, pad_slot_id=PAD_SLOT_ID,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, scale=K**-0.5 if scale is None else scale,
        use_beta_sigmoid_in_kernel=sigmoid_beta, **gate,
    )  # fmt: skip
    o = o.to(k.dtype)
    if used != T:
        full = torch.zeros((B, T, HV, V), dtype=k.dtype) if out is None else out
        if tuple(full.shape) != (B, T, HV, V):
            refuse(f"out must have shape {(B, T, HV, V)}; got {tuple(full.shape)}")
        full[:, :used].copy_(o)
        return full, initial_state
    return _finish(o, out), initial_state


def chunk_kda_with_fused_gate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    g_bias: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float = -5.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GLM-5.3-Flash's chunked prefill from the raw gate, on :func:`kda.torch.chunk_kda`.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``raw_g [B, T, HV, K]``, ``beta [B, T, HV]`` the
    step sizes (already sigmoided: this kernel does not), ``A_log`` (``HV`` elements),
    ``g_bias`` (``HV * K`` or None); ``B == 1`` with ``cu_seqlens``. The gate is
    ``lower_bound * sigmoid(exp(A_log) * (g + g_bias))`` with ``safe_gate=True``, else
    ``-exp(A_log) * softplus(g + g_bias)`` (``lower_bound`` unused). ``initial_state [N, HV, V,
    K]`` is V-major (as :func:`kda.vllm.ops.gather_initial_states` returns it, any of the pool's
    dtypes). Returns ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, V, K] float32 or
    None)``. vLLM's kernel writes ``o`` over (a contiguous copy of) ``v``; this returns a new
    tensor and leaves ``v`` as it is. vLLM's ``**kwargs`` are accepted and unused.
    """
    gate: dict[str, Any] = {"A_log": A_log, "dt_bias": g_bias, "use_gate_in_kernel": True}
    if safe_gate:
        gate["lower_bound"] = lower_bound
    o, final = _kt.chunk_kda(
        q, k, v, raw_g, beta,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, state_v_first=True, **gate,
    )  # fmt: skip
    return o.to(v.dtype), final


class _ScatterStates:
    """``scatter_states(state, src, indices)``: ``state[indices[n]] = src[n]`` in place (vLLM's
    ``scatter_states``, on CPU tensors); ``register_warmup`` is accepted (vLLM's layers call it at
    construction) and does nothing: there is no Triton kernel to warm up."""

    __name__ = __qualname__ = "scatter_states"

    def __call__(self, state: torch.Tensor, src: torch.Tensor, indices: torch.Tensor) -> None:
        """``state [slots, ...]`` (each row dense, the row stride possibly padded), ``src [N,
        *state.shape[1:]]`` (cast to ``state``'s dtype, rounded to nearest even), ``indices [N]``
        int32 or int64 in ``[-1, slots)``, ``-1`` skipped (padding: vLLM's kernel would write out
        of bounds); rows no index names are left bitwise as they are."""
        for name, t in (("state", state), ("src", src), ("indices", indices)):
            if not isinstance(t, torch.Tensor):
                msg = f"scatter_states: {name} must be a torch.Tensor; got {type(t).__name__}"
                raise InvalidTypeError(msg)
        if state.ndim < 2 or indices.ndim != 1 or src.ndim != state.ndim:
            refuse(
                "scatter_states: state must be [slots, ...], src [N, ...] of as many dims, indices 1-D; got "
                f"{_shape(state)}, {_shape(src)}, {_shape(indices)}"
            )
        if tuple(src.shape) != (indices.shape[0], *state.shape[1:]):
            want = (indices.shape[0], *state.shape[1:])
            refuse(f"scatter_states: src must have shape {want} (a row per index); got {_shape(src)}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise InvalidTypeError(f"scatter_states: indices must be int32 or int64; got {indices.dtype}")
        if not (state.device == src.device == indices.device):
            refuse("scatter_states: state, src and indices must be on one device")
        if not c_contiguous(state[0]):
            refuse(f"scatter_states: each row of state must be dense; got strides {state.stride()}")
        idx = indices.long()
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= state.shape[0]):
            refuse(f"scatter_states: indices must be -1 (padding) or rows of state [0, {state.shape[0]})")
        keep = (idx >= 0).nonzero().squeeze(1)
        if keep.numel() != idx.numel():
            idx, src = idx.index_select(0, keep), src.index_select(0, keep)
        if idx.numel():
            if idx.unique().numel() != idx.numel():
                refuse("scatter_states: indices name a row twice (vLLM's slots are unique per request)")
            state.index_copy_(0, idx, src.to(state.dtype))

    def register_warmup(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's warmup registration: nothing to warm up on the CPU."""


#: vLLM's ``scatter_states`` on CPU tensors (an instance: vLLM calls ``scatter_states.register_warmup``)
scatter_states = _ScatterStates()
