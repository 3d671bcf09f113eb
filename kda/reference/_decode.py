"""Decoding from a state pool: a few recurrent steps of many requests, states written by slot.

Request ``n`` starts from row ``start[n]`` of ``pool: [P, HV, K, V]`` (``-1``: a padding request,
whose output is zeros and which reads and writes no state) and writes its state after step ``t``
into row ``dest[n, t]`` of the final pool (``dest: [N, 1]``: the final state into ``dest[n, 0]``;
``-1``: not written). Each step of a block of value heads is :func:`._recurrent.step` with
``read_once=True``: with its state ``S`` (``[h, K, V]``) and ``e = exp(g_t)``::

    P   = [k_t * e, q_t * e]^T S        # one read of S: the prediction and the decayed query part
    u   = beta_t * (v_t - P[0])
    o_t = scale * (P[1] + (q_t . k_t) u)  # = scale * S_t^T q_t
    S   = e[:, None] * S + k_t u^T         # S_t

so the state is read once per step for both products, a block of heads at a time small enough
to stay in the cache between the read and the update. A block's start state is read before any
of its slots is written, so a request may write the row it started from.
"""

from __future__ import annotations

from typing import Any

from array_api_compat import array_namespace

from ._recurrent import step

__all__ = ["BLOCK_ELEMENTS", "decode_forward"]

# elements of the states of one block of heads (2**17 float32 = 512 KiB, half of a 1 MiB L2)
BLOCK_ELEMENTS = 1 << 17


def _stored(xp: Any, S: Any, dtype: Any, v_first: bool) -> Any:
    """The state ``S [h, K, V]`` as a pool holds it: in its layout, rounded to its dtype."""
    return xp.astype(xp.matrix_transpose(S) if v_first else S, dtype)


def _spans(N: int, T: int, offsets: Any) -> list[tuple[int, int, int]]:
    """``(batch row, first step, steps)`` of each request."""
    if offsets is None:
        return [(n, 0, T) for n in range(N)]
    offs = [int(x) for x in offsets]
    return [(0, offs[n], offs[n + 1] - offs[n]) for n in range(N)]


def decode_forward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    pool: Any,
    start: Any,
    dest: Any,
    *,
    scale: float,
    offsets: Any = None,
    final_pool: Any = None,
    out: Any = None,
    v_first: bool = False,
) -> Any:
    """Run every request's steps from its start row and write its states to its slots.

    Parameters
    ----------
    q, k, g : ``[B, HV, T, K]``; v : ``[B, HV, T, V]``; beta : ``[B, HV, T]``, all in the pool's
        dtype (q and k already expanded to the value heads). Request ``n`` is batch row ``n``, or
        with ``offsets`` (``[N + 1]`` host ints, ``B == 1``) steps ``offsets[n]:offsets[n + 1]``.
    pool : ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``v_first``); rows ``start`` are read. Of
        the inputs' dtype, or a 16-bit float dtype with float32 inputs: a row is read as it is,
        computed in the inputs' dtype, and rounded to the pool's dtype where it is stored.
    start : ``[N]`` host ints (NumPy), ``-1`` for padding.
    dest : ``[N, W]`` host ints: ``W == 1`` the row of the final state, else the row of the state
        after each step (``-1``: not written). Distinct across the call (the caller checks).
    scale : float
    final_pool : ``[P', HV, K, V]`` receiving the written rows (``pool``'s dtype and layout);
        None: ``pool`` (in place).
    out : ``[B, HV, T, V]`` buffer receiving the output, or None.
    v_first : whether the pools are V-major.

    Returns
    -------
    output : ``[B, HV, T, V]``, zeros for padding requests.
    """
    xp = array_namespace(q, k, v, g, beta, pool)
    B, HV, T, V = v.shape
    K = q.shape[-1]
    dst = pool if final_pool is None else final_pool
    if out is None:
        out = xp.zeros((B, HV, T, V), dtype=v.dtype, device=v.device)
    else:
        out[...] = 0
    per_block = max(1, BLOCK_ELEMENTS // max(K * V, 1))
    starts, slots = start.tolist(), dest.tolist()
    spans = _spans(len(starts), T, offsets)
    for n, (b, t0, steps) in enumerate(spans):
        if starts[n] < 0:
            continue
        final_only = len(slots[n]) == 1
        for h0 in range(0, HV, per_block):
            hs = slice(h0, min(h0 + per_block, HV))
            row = pool[starts[n], hs, ...]  # read before this block of heads writes
            S = xp.astype(xp.matrix_transpose(row) if v_first else row, v.dtype)
            for t in range(steps):
                inputs = (x[b, hs, t0 + t, ...] for x in (q, k, v, g, beta))
                S, out[b, hs, t0 + t, :], *_ = step(xp, S, *inputs, scale, read_once=True)
                slot = slots[n][0] if final_only else slots[n][t]
                if slot >= 0 and (t == steps - 1 or not final_only):
                    dst[slot, hs, ...] = _stored(xp, S, dst.dtype, v_first)
            if steps == 0 and final_only and slots[n][0] >= 0:
                dst[slots[n][0], hs, ...] = row
    return out
