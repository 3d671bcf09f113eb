"""Speculative decoding on vLLM-CPU: the short convolution's speculative update and the align-mode
state copies, in torch (vLLM 0.32 has them as Triton kernels only; ``docs/vllm.md``).

These functions need torch only (not vLLM): :mod:`kda.vllm.cpu_fixes` installs them in vLLM's
loaded modules on the CPU platform, and ``tests/adapters/test_vllm_speculative.py`` checks each
against a plain loop without vLLM.

- :func:`causal_conv1d_update_spec` stands in for ``causal_conv1d_update`` with
  ``num_accepted_tokens`` (``vllm/model_executor/layers/mamba/ops/causal_conv1d.py``'s Triton
  ``_causal_conv1d_update_kernel`` with ``IS_SPEC_DECODING``): vLLM-CPU routes every
  ``causal_conv1d_update`` to its C++ ``causal_conv1d_update_cpu``, which ignores
  ``num_accepted_tokens`` and ``max_query_len`` and crashes on the speculative call.
- :func:`precopy_align` and :func:`postprocess_align` stand in for ``precopy_mamba_align_fused_kernel``
  and ``postprocess_mamba_fused_kernel`` (``vllm/v1/worker/mamba_utils.py``): the state copies
  between block columns that prefix caching's ``align`` mode makes around a speculative step.

The speculative convolution state of a request (one slot, ``state_len >= width - 1 + draft``
tokens, SD layout ``[slots, state_len, dim]`` or its transpose): before a step it holds
``[h_1, ..., h_M]`` and the step's history starts at token ``num_accepted - 1`` (the previous step
accepted that many tokens); the step convolves ``h[a - 1 : a + width - 2]`` followed by its ``n``
tokens, and leaves ``[h[a], ..., h[a + width - 3], x_1, ..., x_n]`` at the slot's start (``width - 2
+ n`` tokens), so that the next step, accepting ``a'``, starts from token ``a' - 1``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .._errors import refuse

__all__ = [
    "MambaState",
    "causal_conv1d_update_spec",
    "copy_state_block",
    "postprocess_align",
    "precopy_align",
]

NULL_BLOCK_ID = 0  # vLLM's null block: a request whose slot is 0 is padding


def _ints(t: Any, name: str) -> list[int]:
    if isinstance(t, torch.Tensor):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            refuse(f"{name} must be an integer tensor; got {t.dtype}")
        return [int(v) for v in t.reshape(-1).tolist()]
    return [int(v) for v in t]


def causal_conv1d_update_spec(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    null_block_id: int | None = NULL_BLOCK_ID,
    out: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """vLLM's speculative short-convolution update (``causal_conv1d_update`` with
    ``num_accepted_tokens`` and ``query_start_loc``), in torch.

    ``x [tokens, dim]`` packs the requests (``query_start_loc [N + 1]``); ``conv_state [slots, dim,
    state_len]`` (any strides: vLLM passes the SD pool transposed), ``state_len >= width - 1 +
    max_query_len - 1``; ``weight [dim, width]``; ``conv_state_indices [N]`` a slot per request
    (``null_block_id``: padding, nothing read, written or output); ``num_accepted_tokens [N]``.
    Request ``n``'s window starts at state token ``num_accepted_tokens[n] - 1``; the slot is
    updated in place (module docstring). Returns the output ``[tokens, dim]`` (``out`` when given,
    else ``x`` overwritten, as vLLM's kernel), activation ``"silu"``/``"swish"``/``True`` or none.
    ``validate_data`` and vLLM's other keywords are accepted; prefix caching's per-block indices
    (``block_idx_last_scheduled_token``, ``initial_state_idx``) are refused.
    """
    for name in ("block_idx_last_scheduled_token", "initial_state_idx"):
        if kwargs.get(name) is not None:
            refuse(
                f"causal_conv1d_update_spec: {name} (per-block conv states) is not supported; got a tensor"
            )
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    if activation not in (None, "silu", "swish"):
        refuse(f"activation must be None, 'silu' or 'swish'; got {activation!r}")
    if query_start_loc is None or conv_state_indices is None or num_accepted_tokens is None:
        refuse("causal_conv1d_update_spec needs query_start_loc, conv_state_indices and num_accepted_tokens")
    if x.ndim != 2 or conv_state.ndim != 3 or weight.ndim != 2:
        refuse(
            "x must be [tokens, dim], conv_state [slots, dim, state_len], weight [dim, width]; got shapes "
            f"{tuple(x.shape)}, {tuple(conv_state.shape)}, {tuple(weight.shape)}"
        )
    dim, width = weight.shape
    if x.shape[1] != dim or conv_state.shape[1] != dim:
        refuse(f"x and conv_state must have dim = {dim} channels; got {x.shape[1]} and {conv_state.shape[1]}")
    if out is not None and tuple(out.shape) != tuple(x.shape):
        refuse(f"out must have x's shape {tuple(x.shape)}; got {tuple(out.shape)}")
    offsets = _ints(query_start_loc, "query_start_loc")
    slots = _ints(conv_state_indices.reshape(-1), "conv_state_indices")
    accepted = _ints(num_accepted_tokens, "num_accepted_tokens")
    n_req = len(offsets) - 1
    if len(slots) < n_req or len(accepted) < n_req:
        refuse(
            f"conv_state_indices and num_accepted_tokens need N = {n_req} entries (query_start_loc); "
            f"got {len(slots)} and {len(accepted)}"
        )
    state_len = conv_state.shape[2]
    seqlen = max(max_query_len, max((b - a for a, b in itertools.pairwise(offsets)), default=0))
    plan = []
    for n in range(n_req):
        bos, eos, slot, a = offsets[n], offsets[n + 1], slots[n], accepted[n]
        if eos == bos or (null_block_id is not None and slot == null_block_id):
            continue
        if not 0 <= slot < conv_state.shape[0]:
            refuse(
                f"conv_state_indices[{n}] must be a slot of conv_state, in [0, {conv_state.shape[0]}); "
                f"got {slot}"
            )
        if not 1 <= a or a - 1 + width - 1 > state_len or width - 2 + seqlen > state_len:
            refuse(
                f"num_accepted_tokens[{n}] = {a} with width {width} and {seqlen} tokens needs a conv "
                f"state of at least {max(a + width - 2, width - 2 + seqlen)} tokens; got {state_len}"
            )
        plan.append((bos, eos, slot, a))
    result = x if out is None else out
    w = weight.unsqueeze(1)
    for bos, eos, slot, a in plan:  # every read before this request's write; requests own their slots
        hist = conv_state[slot, :, a - 1 : a - 1 + width - 1]  # [dim, width - 1]
        seq = torch.cat([hist.to(weight.dtype), x[bos:eos].t().to(weight.dtype)], dim=1)  # [dim, W-1+n]
        y = F.conv1d(seq.unsqueeze(0), w, bias, groups=dim)[0]  # [dim, n]
        if activation is not None:
            y = F.silu(y)
        new = seq[:, 1:]  # [h_a .. h_{a+W-3}, x_1 .. x_n]: width - 2 + n tokens
        conv_state[slot, :, : new.shape[1]] = new.to(conv_state.dtype)
        result[bos:eos] = y.t().to(result.dtype)
    return result


class MambaState(NamedTuple):
    """One state tensor of a mamba layer, as the align-mode copies see it: ``tensor`` the pool
    (``[blocks, ...]``), ``conv`` whether it is a short-convolution state (shifted by the accepted
    tokens) or a temporal one (copied whole from the accepted column), ``dim_first`` the conv
    state's layout (``[blocks, dim, width]``; else ``[blocks, width, dim]``), ``group`` the index of
    its mamba group's block table."""

    tensor: torch.Tensor
    conv: bool
    dim_first: bool = False
    group: int = 0


def copy_state_block(
    state: MambaState, row: torch.Tensor, src_col: int, dst_col: int, token_bias: int
) -> None:
    """vLLM's ``_copy_mamba_state_block`` for one request and one state: with ``row`` the request's
    block-table row, a conv state shifts ``state[row[src_col], token_bias:]`` to
    ``state[row[dst_col], :width - token_bias]`` (along its token axis); a temporal state copies
    ``state[row[src_col + token_bias]]`` to ``state[row[dst_col]]``. The source is read whole
    before the write (same-block shifts)."""
    t = state.tensor
    dst = int(row[dst_col])
    if state.conv:
        src = int(row[src_col])
        width = t.shape[2] if state.dim_first else t.shape[1]
        if not 0 <= token_bias < width:
            refuse(f"token_bias must be in [0, {width}) for a conv state of {width} tokens; got {token_bias}")
        if state.dim_first:
            t[dst, :, : width - token_bias] = t[src, :, token_bias:].clone()
        else:
            t[dst, : width - token_bias] = t[src, token_bias:].clone()
        return
    src = int(row[src_col + token_bias])
    if src != dst:
        t[dst] = t[src]


def precopy_align(
    states: Sequence[MambaState],
    block_tables: Sequence[torch.Tensor],
    state_idx: torch.Tensor,
    src_col: torch.Tensor,
    token_bias: torch.Tensor,
    num_reqs: int,
) -> None:
    """``precopy_mamba_align_fused_kernel`` (V1 order, no index mapping): for each request ``r <
    num_reqs`` whose state moves to a new block column (``src_col[r] >= 0`` and ``!= state_idx[r]``),
    copy each state from column ``src_col[r]`` (shifted by ``token_bias[r]``, the previous step's
    accepted tokens minus one) to column ``state_idx[r]`` of its block-table row."""
    dst_cols = _ints(state_idx, "state_idx")[:num_reqs]
    src_cols = _ints(src_col, "src_col")[:num_reqs]
    biases = _ints(token_bias, "token_bias")[:num_reqs]
    for r in range(num_reqs):
        if src_cols[r] < 0 or src_cols[r] == dst_cols[r]:
            continue
        for s in states:
            copy_state_block(s, block_tables[s.group][r], src_cols[r], dst_cols[r], biases[r])


def postprocess_align(
    states: Sequence[MambaState],
    block_tables: Sequence[torch.Tensor],
    num_accepted: torch.Tensor,
    state_idx: torch.Tensor,
    num_scheduled: torch.Tensor,
    num_computed: torch.Tensor,
    num_draft: torch.Tensor,
    num_reqs: int,
    block_size: int,
    num_accepted_out: torch.Tensor,
) -> None:
    """``postprocess_mamba_fused_kernel`` (V1 order): after a speculative step, where the accepted
    tokens complete a block (``aligned = (computed after the step // block_size) * block_size`` at or
    past the step's running state), save the state at that block boundary to the block's column
    (``aligned // block_size - 1``) for prefix caching: from the running column ``state_idx[r]``,
    shifted by ``aligned - running``; where that column is the running one, ``num_accepted_out[r]``
    becomes 1 (the state is now at the column's start). ``num_accepted_out`` is written for those
    requests only (vLLM fills it with ``num_accepted`` first)."""
    acc, src, sched, comp, draft = (_ints(t, n)[:num_reqs] for t, n in (
        (num_accepted, "num_accepted"), (state_idx, "state_idx"), (num_scheduled, "num_scheduled"),
        (num_computed, "num_computed"), (num_draft, "num_draft")))  # fmt: skip
    for r in range(num_reqs):
        running = comp[r] + sched[r] - draft[r]
        new_computed = running + acc[r] - 1
        aligned = (new_computed // block_size) * block_size
        if aligned < running:
            continue
        bias, dst = aligned - running, aligned // block_size - 1
        if src[r] == dst:
            num_accepted_out[r] = 1
            if bias == 0:
                continue
        for s in states:
            copy_state_block(s, block_tables[s.group][r], src[r], dst, bias)
