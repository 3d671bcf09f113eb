"""vLLM's KDA ops on kda, with vLLM's signatures (``vllm.models.kimi_k3.nvidia.ops.third_party.kda``
and ``vllm.model_executor.layers.mamba.ops.gather_initial_states`` of vLLM 0.32).

These functions need torch only (not vLLM): the plugin (:func:`kda.vllm.register`) installs them in
vLLM's modules, and ``tests/adapters/test_vllm_ops.py`` checks them without vLLM installed.

vLLM's conventions, kept here:

- the recurrent state pool is V-major, ``[slots, H, V, K]`` (float32, or bfloat16 with
  ``mamba_ssm_cache_dtype="bfloat16"``), each slot dense but ``stride(0)`` possibly padded (Mamba
  pages); it is read and written in place (``state_v_first=True``, no copy of the pool);
- slot (block) 0 is padding: an index ``<= 0`` (vLLM uses 0 and -1) gives a zero output and reads
  and writes nothing (``pad_slot_id=0``);
- the gate is computed from the raw projection: ``-exp(A_log) * softplus(g + dt_bias)``, or
  ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` with ``lower_bound``; ``beta =
  sigmoid(raw_beta)``; ``q`` and ``k`` are l2-normalised (``x / sqrt(sum(x**2) + 1e-6)``); the query
  scale is ``K ** -0.5`` unless given;
- outputs have the input dtype; indices are int32 (or int64), possibly row-strided views.

vLLM's Triton softplus switches to the identity above 20; kda's softplus is exact everywhere
(``max(x, 0) + log1p(exp(-|x|))``); they differ by ``log1p(exp(-x)) < 2.1e-9`` there.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import torch as _kt
from .._errors import InvalidTypeError, refuse
from .._options.arguments import c_contiguous

__all__ = [
    "chunk_kda_with_fused_gate",
    "fused_recurrent_kda",
    "fused_recurrent_kda_packed_decode",
    "gather_initial_states",
]

PAD_SLOT_ID = 0  # vLLM's KDA layers: block 0 is the null block; -1 is padding as well (kda's own)


def _check_pool(initial_state: Any, H: int, K: int, V: int) -> None:
    if not isinstance(initial_state, torch.Tensor) or initial_state.ndim != 4:
        refuse(f"initial_state (the state pool) must be [slots, H, V, K]; got {_shape(initial_state)}")
    if tuple(initial_state.shape[1:]) != (H, V, K):
        refuse(
            f"initial_state (the state pool) must have shape [slots, H, V, K] = [slots, {H}, {V}, {K}] "
            f"(vLLM's V-major pool); got {tuple(initial_state.shape)}"
        )
    if initial_state.shape[0] and not c_contiguous(initial_state[0]):
        refuse(
            "initial_state (the state pool) must be contiguous within each slot (strides "
            f"[*, {V * K}, {K}, 1]); got strides {initial_state.stride()}"
        )


def _shape(x: Any) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _finish(o: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return o
    if tuple(out.shape) != tuple(o.shape):
        refuse(f"out must have shape {tuple(o.shape)}; got {tuple(out.shape)}")
    out.copy_(o)
    return out


def _gate_keywords(A_log: Any, dt_bias: Any, lower_bound: float | None) -> dict[str, Any]:
    return {
        "A_log": A_log,
        "dt_bias": dt_bias,
        "lower_bound": lower_bound,
        "use_gate_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
    }


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    fuse_gate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's recurrent KDA from raw gates (speculative verify; ``fused_recurrent_kda`` of vLLM's
    ``kimi_k3`` ops), on :func:`kda.torch.fused_recurrent_kda`'s pool call.

    ``q, k [1, T, H, K]``, ``v [1, T, H, V]``, ``raw_g [1, T, H, K]``, ``raw_beta [1, T, H]``
    (row-strided views allowed); ``cu_seqlens [N + 1]`` packs the requests; ``ssm_state_indices``
    ``[>= N, W]`` a slot per step (or ``[>= N]`` with one token per request), of which the first
    ``N`` rows are read; ``num_accepted_tokens [>= N]``: request ``n`` starts from slot
    ``[n, num_accepted_tokens[n] - 1]`` (slot ``[n, 0]`` without it; a start past the request's
    steps, after a step shorter than the accepted count, is first copied to slot ``[n, 0]``, which
    step 0 overwrites). The state after step ``t`` is
    written to slot ``[n, t]`` of the pool ``initial_state [slots, H, V, K]`` in place (not where
    that slot is ``<= 0``). Returns ``(out [1, T, H, V] in v's dtype, initial_state)``.
    ``fuse_gate`` (whether vLLM's kernel applies the gate itself) does not change the result.
    """
    if q.ndim != 4 or q.shape[0] != 1:
        refuse(f"q must have shape [1, T, H, K] (packed requests); got {_shape(q)}")
    _, T, H, K = q.shape
    V = v.shape[-1]
    _check_pool(initial_state, H, K, V)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        refuse(f"cu_seqlens must be a 1-D tensor [N + 1]; got {_shape(cu_seqlens)}")
    offsets = cu_seqlens.tolist()
    N, used = len(offsets) - 1, offsets[-1]
    if ssm_state_indices.ndim not in (1, 2) or ssm_state_indices.shape[0] < N:
        refuse(
            f"ssm_state_indices must be [N, W] or [N] with at least N = {N} rows (one per request of "
            f"cu_seqlens); got {_shape(ssm_state_indices)}"
        )
    if ssm_state_indices.ndim == 1 and num_accepted_tokens is not None:
        refuse("num_accepted_tokens needs 2-D ssm_state_indices [N, W] (a slot per step)")
    indices = ssm_state_indices[:N]
    accepted = None if num_accepted_tokens is None else num_accepted_tokens[:N]
    if accepted is not None:
        accepted = _start_past_the_step(initial_state, indices, accepted, offsets)
    if used != T:  # tokens past the requests' (vLLM's padding): no output written there
        if not 0 <= used <= T:
            refuse(f"cu_seqlens must end within the T = {T} tokens of q; got {offsets[-1]}")
        q, k, v, raw_g, raw_beta = (x[:, :used] for x in (q, k, v, raw_g, raw_beta))
    o, _ = _kt.fused_recurrent_kda(
        q, k, v, raw_g, raw_beta,
        initial_state=initial_state, inplace_final_state=True, ssm_state_indices=indices,
        num_accepted_tokens=accepted, cu_seqlens=cu_seqlens, state_v_first=True, pad_slot_id=PAD_SLOT_ID,
        use_qk_l2norm_in_kernel=True, scale=K**-0.5, **_gate_keywords(A_log, dt_bias, lower_bound),
    )  # fmt: skip
    if used != T:
        full = torch.zeros((1, T, H, V), dtype=o.dtype) if out is None else out
        full[:, :used].copy_(o)
        return full, initial_state
    return _finish(o, out), initial_state


def _start_past_the_step(
    pool: torch.Tensor, indices: torch.Tensor, accepted: torch.Tensor, offsets: list[int]
) -> torch.Tensor:
    """vLLM starts request ``n`` from slot ``[n, num_accepted_tokens[n] - 1]`` of its row whatever
    this step's length: after a step that accepted ``a`` tokens, a step with fewer than ``a``
    tokens (no draft found) starts past its own steps, which kda's verify refuses (``1..T``). Such a
    request's start state is copied to its first slot, ``[n, 0]`` (which its first step overwrites
    in any case), and it starts there (count 1). Returns the counts kda gets (a new tensor where
    one changed; vLLM's is not modified)."""
    counts = accepted.tolist()
    moved = []
    for n, a in enumerate(counts):
        t = offsets[n + 1] - offsets[n]
        if 0 < t < a <= indices.shape[1]:
            src, dst = int(indices[n, a - 1]), int(indices[n, 0])
            if src > 0 and dst > 0:
                moved.append((n, src, dst))
    if not moved:
        return accepted
    counts = accepted.clone()
    for n, src, dst in moved:
        if src != dst:
            pool[dst].copy_(pool[src])
        counts[n] = 1
    return counts


def fused_recurrent_kda_packed_decode(
    mixed_qkv: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    initial_state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's one-token decode from packed post-convolution ``mixed_qkv [B, 2 H K + H V]`` (``q``,
    ``k``, ``v`` in consecutive channels; the row stride may be larger), ``raw_g [1, B, H, K]``,
    ``raw_beta [1, B, H]``; request ``b`` continues slot ``state_indices[b]`` of the pool
    ``initial_state [slots, H, V, K]`` in place (``<= 0``: padding, zero output). Returns ``(out
    [1, B, H, V] in mixed_qkv's dtype, initial_state)``."""
    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.ndim != 2 or mixed_qkv.stride(-1) != 1:
        refuse(f"mixed_qkv must be 2-D and contiguous in its last dim; got {_shape(mixed_qkv)}")
    if not isinstance(initial_state, torch.Tensor) or initial_state.ndim != 4:
        refuse(f"initial_state must have shape [cache, H, V, K]; got {_shape(initial_state)}")
    _, H, V, K = initial_state.shape
    _check_pool(initial_state, H, K, V)
    B = mixed_qkv.shape[0]
    if mixed_qkv.shape[1] != 2 * H * K + H * V:
        want = (B, 2 * H * K + H * V)
        refuse(f"mixed_qkv must have shape [B, 2 H K + H V] = {list(want)}; got {_shape(mixed_qkv)}")
    if tuple(raw_g.shape) != (1, B, H, K):
        refuse(f"raw_g must have shape [1, B, H, K] = {(1, B, H, K)}; got {_shape(raw_g)}")
    if tuple(raw_beta.shape) != (1, B, H):
        refuse(f"raw_beta must have shape [1, B, H] = {(1, B, H)}; got {_shape(raw_beta)}")
    if state_indices.ndim != 1 or state_indices.shape[0] != B:
        refuse(f"state_indices must be 1-D with one entry per token ({B}); got {_shape(state_indices)}")
    if A_log.numel() != H or dt_bias.numel() != H * K:
        got = (A_log.numel(), dt_bias.numel())
        refuse(f"A_log must have H = {H} and dt_bias H * K = {H * K} elements; got {got[0]} and {got[1]}")
    hk = H * K
    q = mixed_qkv[:, :hk].unflatten(1, (1, H, K))  # [B, 1, H, K]: B requests of one step, views
    k = mixed_qkv[:, hk : 2 * hk].unflatten(1, (1, H, K))
    v = mixed_qkv[:, 2 * hk :].unflatten(1, (1, H, V))
    o, _ = _kt.fused_recurrent_kda(
        q, k, v, raw_g.transpose(0, 1), raw_beta.transpose(0, 1),
        initial_state=initial_state, inplace_final_state=True, ssm_state_indices=state_indices,
        state_v_first=True, pad_slot_id=PAD_SLOT_ID, use_qk_l2norm_in_kernel=True,
        scale=K**-0.5 if scale is None else scale, **_gate_keywords(A_log, dt_bias, lower_bound),
    )  # fmt: skip
    return _finish(o.view(1, B, H, V), out), initial_state


def chunk_kda_with_fused_gate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    g_bias: torch.Tensor | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's chunked prefill from raw gates, on :func:`kda.torch.chunk_kda`: ``q, k [B, T, H, K]``
    (``B == 1`` with ``cu_seqlens``), ``initial_state [N, H, V, K]`` (V-major, as
    :func:`gather_initial_states` returns it, any of the pool's dtypes); returns ``(o [B, T, H, V]
    in q's dtype, final_state [N, H, V, K] float32 or None)``. vLLM's ``**kwargs`` are accepted
    and unused, as vLLM's kernel ignores them."""
    o, final = _kt.chunk_kda(
        q, k, v, raw_g, raw_beta,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, state_v_first=True,
        **_gate_keywords(A_log, g_bias, lower_bound),
    )  # fmt: skip
    return _finish(o, out), final


def gather_initial_states(
    state: torch.Tensor, indices: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """Rows ``state[indices[n]]`` as a new dense ``[N, *state.shape[1:]]`` tensor, zeros where
    ``has_initial_state[n]`` is False (vLLM's ``gather_initial_states``, on CPU tensors)."""
    for name, t in (("state", state), ("indices", indices), ("has_initial_state", has_initial_state)):
        if not isinstance(t, torch.Tensor):
            msg = f"gather_initial_states: {name} must be a torch.Tensor; got {type(t).__name__}"
            raise InvalidTypeError(msg)
    if state.ndim < 2 or indices.ndim != 1 or tuple(has_initial_state.shape) != tuple(indices.shape):
        refuse(
            "gather_initial_states: state must be [slots, ...], indices and has_initial_state 1-D of one "
            f"length; got {_shape(state)}, {_shape(indices)}, {_shape(has_initial_state)}"
        )
    if indices.dtype not in (torch.int32, torch.int64) or has_initial_state.dtype != torch.bool:
        msg = (
            "gather_initial_states: indices must be int32 or int64 and has_initial_state bool; got "
            f"{indices.dtype} and {has_initial_state.dtype}"
        )
        raise InvalidTypeError(msg)
    if not (state.device == indices.device == has_initial_state.device):
        refuse("gather_initial_states: state, indices and has_initial_state must be on one device")
    output = state.new_zeros((indices.shape[0], *state.shape[1:]))
    rows = has_initial_state.nonzero().squeeze(1)
    if rows.numel():
        slots = indices.index_select(0, rows).long()
        if int(slots.min()) < 0 or int(slots.max()) >= state.shape[0]:
            refuse(f"gather_initial_states: indices must be rows of state, in [0, {state.shape[0]})")
        output.index_copy_(0, rows, state.index_select(0, slots))
    return output
