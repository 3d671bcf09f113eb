"""Decoding from a state pool: a few recurrent steps of many requests, states updated in place.

Request ``n`` owns row ``indices[n]`` of ``pool: [P, HV, K, V]`` (``-1``: a padding request, whose
output is zeros and which reads and writes no state). Each step of a value head, with its state
``S`` (``[K, V]``) and ``e = exp(g_t)``::

    P   = [k_t * e, q_t * e]^T S        # one read of S: the prediction and the decayed query part
    u   = beta_t * (v_t - P[0])
    o_t = scale * (P[1] + (q_t . k_t) u)  # = scale * S_t^T q_t
    S   = e[:, None] * S + k_t u^T         # S_t, written back into the pool row

so the state is read once per step for both products and updated in place (NumPy), a block of
heads at a time small enough to stay in the cache between the read and the update.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
from array_api_compat import array_namespace

__all__ = ["BLOCK_ELEMENTS", "decode_forward"]

# elements of the states of one block of heads (2**17 float32 = 512 KiB, half of a 1 MiB L2)
BLOCK_ELEMENTS = 1 << 17


def _step(xp: Any, S: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float) -> tuple[Any, Any]:
    """One step of a block of heads: ``S: [h, K, V]``, ``q, k, g: [h, K]``, ``v: [h, V]``, ``beta: [h]``.

    Returns the new state and the output ``[h, V]``; on NumPy ``S`` is updated in place.
    """
    e = xp.exp(g)
    P = xp.matmul(xp.stack([k * e, q * e], axis=1), S)  # [h, 2, V]
    u = beta[:, None] * (v - P[:, 0, :])
    o = scale * (P[:, 1, :] + xp.sum(q * k, axis=-1)[:, None] * u)
    update = k[:, :, None] * u[:, None, :]
    if array_api_compat.is_numpy_array(S):
        S *= e[:, :, None]
        S += update
        return S, o
    return e[:, :, None] * S + update, o


def decode_forward(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, pool: Any, indices: Any) -> Any:
    """Run ``T`` steps of every request from its pool row, and write the new states back.

    Parameters
    ----------
    q, k, g : ``[N, HV, T, K]``; v : ``[N, HV, T, V]``; beta : ``[N, HV, T]``, all in the pool's
        dtype (q and k already expanded to the value heads).
    scale : float
    pool : ``[P, HV, K, V]``, writable; rows named by ``indices`` are updated in place.
    indices : sequence of ``N`` Python ints, each ``-1`` or a distinct row of ``pool``.

    Returns
    -------
    output : ``[N, HV, T, V]``, zeros for padding requests.
    """
    xp = array_namespace(q, k, v, g, beta, pool)
    N, HV, T, V = v.shape
    K = q.shape[-1]
    out = xp.zeros((N, HV, T, V), dtype=v.dtype, device=v.device)
    per_block = max(1, BLOCK_ELEMENTS // max(K * V, 1))
    for n, row in enumerate(indices):
        if row < 0:
            continue
        for h0 in range(0, HV, per_block):
            hs = slice(h0, min(h0 + per_block, HV))
            S = pool[row, hs, ...]
            for t in range(T):
                step = (x[n, hs, t, ...] for x in (q, k, v, g, beta))
                S, out[n, hs, t, :] = _step(xp, S, *step, scale)
            if not array_api_compat.is_numpy_array(S):
                pool[row, hs, ...] = S
    return out
