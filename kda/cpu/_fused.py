"""The fused chunked passes of the CPU backend (imported on first use: this imports numba).

One worker runs one head from its first chunk to its last (the backward: from the last to the
first): each chunk's inputs are copied into zero-padded ``[Cp, *]`` scratch arrays, its
state-free work (:func:`~kda.cpu._kernels._local_one`) and its state step follow at once, so the
chunk's data and the ``[K, V]`` state stay in the cache and nothing of size ``T`` is written but
the results. Inputs are read in place with whatever strides they have (time-major views
included). Dense products call BLAS through Numba's ``np.dot`` (pinned to one thread by the
caller). No sum crosses heads, so results do not depend on how heads are split over threads.
"""

from __future__ import annotations

import numpy as np

from ._kernels import _jit, _local_backward_one, _local_one

__all__ = ["backward_heads", "forward_heads"]


@_jit()
def _load(x, b, h, t0, m, buf):
    """Rows ``t0 .. t0 + m`` of ``x[b, h]`` into ``buf[:m]``; rows ``m ..`` of ``buf`` zeroed."""
    D = buf.shape[1]
    for i in range(m):
        for d in range(D):
            buf[i, d] = x[b, h, t0 + i, d]
    for i in range(m, buf.shape[0]):
        for d in range(D):
            buf[i, d] = 0.0


@_jit()
def _load_beta(beta, b, h, t0, m, buf):
    for i in range(m):
        buf[i] = beta[b, h, t0 + i]
    for i in range(m, buf.shape[0]):
        buf[i] = 0.0


@_jit()
def forward_heads(q, k, v, g, beta, scale, state, C, with_output, with_bounds, out, bounds, final, lo, hi):
    """Heads ``[lo, hi)`` of ``B * H``: the chunked forward.

    ``q, k, g: [B, H, T, K]``, ``v, out: [B, H, T, V]``, ``beta: [B, H, T]`` (any strides),
    ``state, final: [B, H, K, V]``, ``bounds: [NT, B, H, K, V]`` (the chunk-start states, written
    with ``with_bounds``); ``out`` is written with ``with_output``.
    """
    _B, H, T, K = q.shape
    V = v.shape[3]
    Cp = 1
    while Cp < C:
        Cp *= 2
    NT = (T + C - 1) // C
    s = scale[0]
    dt = q.dtype
    qc, kc, gc = np.empty((Cp, K), dt), np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    vc, bc = np.empty((Cp, V), dt), np.empty(Cp, dt)
    WQ = np.empty((2 * Cp, K), dt)  # [w; qg]: one product with the state
    w, qg = WQ[:Cp], WQ[Cp:]
    kg, kt = np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    total = np.empty(K, dt)
    A, L, Tinv = np.empty((Cp, Cp), dt), np.empty((Cp, Cp), dt), np.empty((Cp, Cp), dt)
    u0 = np.empty((Cp, V), dt)
    pre, suf, bk = np.empty((Cp, K), dt), np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    kd, bv = np.empty(K, dt), np.empty((Cp, V), dt)
    R = np.empty((2 * Cp, V), dt)
    U = np.empty((Cp, V), dt)
    O = np.empty((Cp, V), dt)
    X = np.empty((K, V), dt)
    S = np.empty((K, V), dt)
    for bh in range(lo, hi):
        b = bh // H
        h = bh - b * H
        S[:, :] = state[b, h]
        for n in range(NT):
            t0 = n * C
            m = min(C, T - t0)
            _load(q, b, h, t0, m, qc)
            _load(k, b, h, t0, m, kc)
            _load(g, b, h, t0, m, gc)
            _load(v, b, h, t0, m, vc)
            _load_beta(beta, b, h, t0, m, bc)
            _local_one(qc, kc, gc, vc, bc, s, qg, kg, kt, total, A, L, Tinv, w, u0, pre, suf, kd, bk, bv)
            if with_bounds:
                bounds[n, b, h] = S
            np.dot(WQ, S, R)
            for i in range(Cp):
                for c in range(V):
                    U[i, c] = u0[i, c] - R[i, c]
            if with_output:
                np.dot(A, U, O)  # A is lower triangular with zeros above
                for i in range(m):
                    for c in range(V):
                        out[b, h, t0 + i, c] = R[Cp + i, c] + O[i, c]
            np.dot(kt.T, U, X)
            for d in range(K):
                t = total[d]
                for c in range(V):
                    S[d, c] = t * S[d, c] + X[d, c]
        final[b, h] = S


@_jit()
def backward_heads(
    q, k, v, g, beta, scale, bounds, dO, dstate, C, dq, dk, dv, dg, dbeta, dinit, lo, hi
):  # fmt: skip
    """Heads ``[lo, hi)`` of ``B * H``: the chunked backward, last chunk first.

    Per chunk: its state-free work again, ``U = u0 - w S``, ``dU = A^T dO + kt dS``, the
    gradients of its state-free work (:func:`~kda.cpu._kernels._local_backward_one`), then
    ``dS <- total * dS + qg^T dO - w^T dU``. Shapes as :func:`forward_heads`; ``dO`` and the
    gradients like their inputs, ``bounds: [NT, B, H, K, V]``, ``dstate, dinit: [B, H, K, V]``.
    """
    _B, H, T, K = q.shape
    V = v.shape[3]
    Cp = 1
    while Cp < C:
        Cp *= 2
    NT = (T + C - 1) // C
    s = scale[0]
    dt = q.dtype
    qc, kc, gc = np.empty((Cp, K), dt), np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    vc, bc, dOc = np.empty((Cp, V), dt), np.empty(Cp, dt), np.empty((Cp, V), dt)
    w, qg = np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    kg, kt = np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    total = np.empty(K, dt)
    A, L, Tinv = np.empty((Cp, Cp), dt), np.empty((Cp, Cp), dt), np.empty((Cp, Cp), dt)
    u0 = np.empty((Cp, V), dt)
    pre, suf, bk = np.empty((Cp, K), dt), np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    kd, bv = np.empty(K, dt), np.empty((Cp, V), dt)
    U, dU = np.empty((Cp, V), dt), np.empty((Cp, V), dt)
    X, Y = np.empty((K, V), dt), np.empty((K, V), dt)
    S, dS, dSend = np.empty((K, V), dt), np.empty((K, V), dt), np.empty((K, V), dt)
    gq, gk, gg = np.empty((Cp, K), dt), np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    gv, gb = np.empty((Cp, V), dt), np.empty(Cp, dt)
    for bh in range(lo, hi):
        b = bh // H
        h = bh - b * H
        dS[:, :] = dstate[b, h]
        for n in range(NT - 1, -1, -1):
            t0 = n * C
            m = min(C, T - t0)
            _load(q, b, h, t0, m, qc)
            _load(k, b, h, t0, m, kc)
            _load(g, b, h, t0, m, gc)
            _load(v, b, h, t0, m, vc)
            _load(dO, b, h, t0, m, dOc)
            _load_beta(beta, b, h, t0, m, bc)
            _local_one(qc, kc, gc, vc, bc, s, qg, kg, kt, total, A, L, Tinv, w, u0, pre, suf, kd, bk, bv)
            S[:, :] = bounds[n, b, h]
            dSend[:, :] = dS
            np.dot(w, S, U)
            for i in range(Cp):
                for c in range(V):
                    U[i, c] = u0[i, c] - U[i, c]
            np.dot(kt, dS, dU)
            dU += np.dot(A.T, dOc)
            np.dot(qg.T, dOc, X)
            np.dot(w.T, dU, Y)
            for d in range(K):
                t = total[d]
                for c in range(V):
                    dS[d, c] = (t * dS[d, c] + X[d, c]) - Y[d, c]
            _local_backward_one(
                qc, kc, gc, vc, bc, s, kg, w, u0, L, Tinv, S, dSend, U, dU, dOc, gq, gk, gv, gg, gb
            )
            for i in range(m):
                for d in range(K):
                    dq[b, h, t0 + i, d] = gq[i, d]
                    dk[b, h, t0 + i, d] = gk[i, d]
                    dg[b, h, t0 + i, d] = gg[i, d]
                for c in range(V):
                    dv[b, h, t0 + i, c] = gv[i, c]
                dbeta[b, h, t0 + i] = gb[i]
        dinit[b, h] = dS
