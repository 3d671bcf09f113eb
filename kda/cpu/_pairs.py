"""The pairs of a chunk and their gradients: decay factors ``exp(g)`` and their running
products, the decayed pairwise products ``A`` and ``L`` (hand loops inside sub-blocks of a chunk,
matrix products across them) and ``dq, dk, dg`` from the gradients of the pairs and factors.

Decay factors are products of ``exp(g)`` over exactly the steps they span (running products from
one end, or products of such partial products), so ``g = -inf`` gives an exact 0 and no NaN arises.
Every sum over channels runs in a loop that stores nothing, so it is compiled once (see
:func:`_pairs_within`) and the order of its terms never depends on addresses.
"""

from __future__ import annotations

import numpy as np

from . import _compile as cfg
from ._compile import jit
from ._products import _mm, empty2
from ._solve import _inverse

_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that m * _LN2_HI is exact for |m| < 2**20
_LN2_LO = 1.90821492927058770002e-10
_ROUND = 6755399441055744.0  # 1.5 * 2**52: (x + _ROUND) - _ROUND rounds x to an integer
_EXP_MIN = -708.39  # exp below this is under the smallest normal float64: returned as 0


@jit(fastmath={"contract"}, inner=True)
def _exp_row(x, out, work):
    """``out = exp(x)`` for ``x <= 0`` (1-D, float32 or float64), computed in float64.

    ``exp(x) = 2**m exp(r)``, ``m = round(x / ln 2)``, ``|r| <= ln(2) / 2`` by a degree-13 Taylor
    polynomial (within 1 ulp in float64, correctly rounded to float32), ``2**m`` from its bits in
    ``work`` (float64 scratch of the same length). ``exp(0) = 1`` and ``exp(-inf) = 0`` exactly.
    Branch-free, so it vectorises: ~1.3 ns an element here, where Numba's ``np.exp`` takes ~4 ns
    (float32) and ~20 ns (float64). Compiled without reassociation: the range reduction and the
    rounding must run in the order written.
    """
    bits = work.view(np.int64)
    for i in range(x.shape[0]):
        xi = np.float64(x[i])
        xi = xi if xi > _EXP_MIN else _EXP_MIN
        m = (xi * _LOG2E + _ROUND) - _ROUND
        r = (xi - m * _LN2_HI) - m * _LN2_LO
        p = 1.0 / 6227020800.0
        p = p * r + 1.0 / 479001600.0
        p = p * r + 1.0 / 39916800.0
        p = p * r + 1.0 / 3628800.0
        p = p * r + 1.0 / 362880.0
        p = p * r + 1.0 / 40320.0
        p = p * r + 1.0 / 5040.0
        p = p * r + 1.0 / 720.0
        p = p * r + 1.0 / 120.0
        p = p * r + 1.0 / 24.0
        p = p * r + 1.0 / 6.0
        p = p * r + 0.5
        p = p * r + 1.0
        p = p * r + 1.0
        bits[i] = (np.int64(m) + 1023) << 52
        out[i] = p
    for i in range(x.shape[0]):
        out[i] = out[i] * work[i] if x[i] >= _EXP_MIN else 0.0


@jit(inner=True)
def _exp(g):
    """``exp(g)`` of a ``[Cp, K]`` array of log decays (``g <= 0``), row by row (:func:`_exp_row`)."""
    Cp, K = g.shape
    e = empty2(Cp, K, g.dtype)
    work = np.empty(K, np.float64)
    for i in range(Cp):
        _exp_row(g[i], e[i], work)
    return e


@jit(inner=True)
def _factors(g, pre, suf):
    """``pre[i] = prod(exp(g[l]), l <= i)``, ``suf[j] = prod(exp(g[l]), l > j)``; returns exp(g)."""
    Cp, K = g.shape
    e = _exp(g)
    for d in range(K):
        pre[0, d] = e[0, d]
        suf[Cp - 1, d] = 1.0
    for i in range(1, Cp):
        for d in range(K):
            pre[i, d] = pre[i - 1, d] * e[i, d]
    for j in range(Cp - 2, -1, -1):
        for d in range(K):
            suf[j, d] = suf[j + 1, d] * e[j + 1, d]
    return e


@jit(inner=True)
def _sum(x):
    """``sum(x)`` in a loop that stores nothing (one compiled order).

    The loop starts from a zero over every element: started from ``x[0]``, its ``K - 1`` steps
    left a scalar remainder after the vector body, 2-3x slower for ``K = 128`` (measured).
    """
    acc = x[:0].sum()  # a zero of x's dtype: the loop then runs over all of x
    for d in range(x.shape[0]):
        acc += x[d]
    return acc


@jit(inner=True)
def _sum_products(x, y):
    """``sum(x * y)`` in a loop that stores nothing (one compiled order)."""
    acc = x[:0].sum()  # a zero of x's dtype: the loop then runs over all of x
    for d in range(x.shape[0]):
        acc += x[d] * y[d]
    return acc


@jit(inner=True)
def _block_factors(e, c, P, Q):
    """Per sub-block of ``c`` steps: ``P[i] = prod(e[l], block start <= l <= i)`` and
    ``Q[j] = prod(e[l], j < l <= block end)`` (both in ``[0, 1]``)."""
    Cp, K = e.shape
    for a0 in range(0, Cp, c):
        a1 = a0 + c
        for d in range(K):
            P[a0, d] = e[a0, d]
            Q[a1 - 1, d] = 1.0
        for i in range(a0 + 1, a1):
            for d in range(K):
                P[i, d] = P[i - 1, d] * e[i, d]
        for j in range(a1 - 2, a0 - 1, -1):
            for d in range(K):
                Q[j, d] = Q[j + 1, d] * e[j + 1, d]


@jit(inner=True)
def _pairs_within(q, k, e, s, A, L, kd, a0, a1):
    """Pairs ``a0 <= j <= i < a1`` of one sub-block by running products over ``i``:
    ``kd = k[j] * prod(e[l], j < l <= i)``. Every sum over channels runs in a loop of its own
    that stores nothing (a loop that both stores and sums is compiled twice, vectorised or not
    behind a run-time overlap check of its arrays' addresses, and the two sum in different
    orders: the results would depend on where scratch arrays were allocated)."""
    K = q.shape[1]
    pa, pb = np.empty(K, q.dtype), np.empty(K, q.dtype)
    for j in range(a0, a1):
        for d in range(K):
            kd[d] = k[j, d]
        A[j, j] = s * _sum_products(q[j], kd)
        for i in range(j + 1, a1):
            for d in range(K):
                x = kd[d] * e[i, d]
                kd[d] = x
                pa[d] = q[i, d] * x
                pb[d] = k[i, d] * x
            A[i, j] = s * _sum(pa)
            L[i, j] = _sum(pb)


@jit(inner=True)
def _pairs(q, k, e, s, A, L, kd):
    """``A`` (lower, ``scale q_i . k_j decay(j..i]``) and ``L`` (strictly lower, ``k_i . k_j
    decay(j..i]``) of one chunk, zeros above.

    The chunk is cut into sub-blocks of :data:`SUB_BLOCK` steps. Pairs inside a sub-block run as
    running products (:func:`_pairs_within`); the pairs of a later sub-block ``J`` with all
    earlier ones are one matrix product ``[s q P; k P]_J @ (k Q M)^T`` whose factors are partial
    products of ``exp(g)`` (``P``: from the start of ``J`` through ``i``; ``Q``: after ``j`` to the
    end of its block; ``M``: the whole blocks between), so each decay is the product over exactly
    the steps it spans, every factor in ``[0, 1]``, no division.
    """
    Cp, K = q.shape
    c = min(cfg.SUB_BLOCK, Cp)
    dt = q.dtype
    A[:, :] = 0.0
    L[:, :] = 0.0
    for a0 in range(0, Cp, c):
        _pairs_within(q, k, e, s, A, L, kd, a0, a0 + c)
    if c == Cp:
        return
    P, Q = empty2(Cp, K, dt), empty2(Cp, K, dt)
    _block_factors(e, c, P, Q)
    left = empty2(2 * c, K, dt)
    right = empty2(Cp - c, K, dt)
    AL = empty2(2 * c, Cp - c, dt)  # [A; L] rows of a sub-block: one product for both
    M = np.empty(K, dt)
    for a0 in range(c, Cp, c):
        for r in range(c):
            for d in range(K):
                x = P[a0 + r, d]
                left[r, d] = s * q[a0 + r, d] * x
                left[c + r, d] = k[a0 + r, d] * x
        for d in range(K):
            M[d] = 1.0
        for b0 in range(a0 - c, -1, -c):  # earlier blocks, nearest first
            if b0 < a0 - c:
                for d in range(K):
                    M[d] *= P[b0 + 2 * c - 1, d]  # the whole block after b0's
            for j in range(b0, b0 + c):
                for d in range(K):
                    right[j, d] = k[j, d] * Q[j, d] * M[d]
        _mm(left, False, right[:a0], True, AL[:, :a0], 0.0)
        for r in range(c):
            for j in range(a0):
                A[a0 + r, j] = AL[r, j]
                L[a0 + r, j] = AL[c + r, j]


@jit(inner=True)
def _local_pairs(q, k, g, beta, s, qg, kg, k_suffix, total, A, L, Minv, pre, suf, kd, with_inverse):
    """A chunk's decay factors, ``qg, kg, k_suffix, total``, its pairs ``A, L`` and, ``with_inverse``,
    ``Minv = (I + diag(beta) L)^-1``; returns ``exp(g)``."""
    Cp, K = q.shape
    e = _factors(g, pre, suf)
    for i in range(Cp):
        for d in range(K):
            qg[i, d] = s * q[i, d] * pre[i, d]
            kg[i, d] = k[i, d] * pre[i, d]
            k_suffix[i, d] = k[i, d] * suf[i, d]
    for d in range(K):
        total[d] = pre[Cp - 1, d]
    _pairs(q, k, e, s, A, L, kd)
    if with_inverse:
        _inverse(L, beta, Minv)
    return e


@jit(inner=True)
def _pairs_backward_within(q, k, e, s, dA, dX, DQ, DK, COL, a0, a1):
    """:func:`_pairs_backward` for the pairs ``a0 <= j < i < a1`` of one sub-block (running
    products over ``i``; every loop over channels is elementwise)."""
    K = q.shape[1]
    Dv = np.empty(K, q.dtype)
    for j in range(a0, a1):
        for d in range(K):
            Dv[d] = 1.0
        for i in range(j + 1, a1):
            c = s * dA[i, j]
            b = dX[i, j]
            for d in range(K):
                D = Dv[d] * e[i, d]
                Dv[d] = D
                kd = k[j, d] * D
                DQ[i, d] += c * kd
                DK[i, d] += b * kd
                COL[j, d] += (c * q[i, d] + b * k[i, d]) * D


@jit(inner=True)
def _pairs_backward(q, k, e, s, dA, dX, DQ, DK, COL):
    """Sums over the pairs ``j < i`` of a chunk with decay ``D = decay(j..i]``, given the
    gradients ``dA`` (of ``A / scale``'s pairs: ``c = scale dA``) and ``dX`` (of ``L``):
    ``DQ[i] = sum_j c k_j D``, ``DK[i] = sum_j dX k_j D``, ``COL[j] = sum_i (c q_i + dX k_i) D``.

    Cut into sub-blocks as :func:`_pairs`: pairs across them as matrix products of the same
    partial-product factors, ``[DQ; DK]_J += P_J * ([c; dX]_J @ (k Q M))`` and
    ``COL_I += Q M * ([c; dX]_J^T @ [q P; k P]_J)``.
    """
    Cp, K = q.shape
    c = min(cfg.SUB_BLOCK, Cp)
    dt = q.dtype
    DQ[:, :] = 0.0
    DK[:, :] = 0.0
    COL[:, :] = 0.0
    for a0 in range(0, Cp, c):
        _pairs_backward_within(q, k, e, s, dA, dX, DQ, DK, COL, a0, a0 + c)
    if c == Cp:
        return
    P, Q = empty2(Cp, K, dt), empty2(Cp, K, dt)
    _block_factors(e, c, P, Q)
    left = empty2(2 * c, K, dt)
    right, qm = empty2(Cp - c, K, dt), empty2(Cp - c, K, dt)
    G, rows, cols = empty2(2 * c, Cp - c, dt), empty2(2 * c, K, dt), empty2(Cp - c, K, dt)
    M = np.empty(K, dt)
    for a0 in range(c, Cp, c):
        for r in range(c):
            for d in range(K):
                x = P[a0 + r, d]
                left[r, d] = q[a0 + r, d] * x
                left[c + r, d] = k[a0 + r, d] * x
        for d in range(K):
            M[d] = 1.0
        for b0 in range(a0 - c, -1, -c):
            if b0 < a0 - c:
                for d in range(K):
                    M[d] *= P[b0 + 2 * c - 1, d]
            for j in range(b0, b0 + c):
                for d in range(K):
                    x = Q[j, d] * M[d]
                    qm[j, d] = x
                    right[j, d] = k[j, d] * x
        for r in range(c):
            for j in range(a0):
                G[r, j] = s * dA[a0 + r, j]
                G[c + r, j] = dX[a0 + r, j]
        _mm(G[:, :a0], False, right[:a0], False, rows, 0.0)  # [2c, K]
        _mm(G[:, :a0], True, left, False, cols[:a0], 0.0)  # [a0, K]
        for r in range(c):
            for d in range(K):
                x = P[a0 + r, d]
                DQ[a0 + r, d] += x * rows[r, d]
                DK[a0 + r, d] += x * rows[c + r, d]
        for j in range(a0):
            for d in range(K):
                COL[j, d] += qm[j, d] * cols[j, d]


@jit(inner=True)
def _factor_grads(q, k, e, pre, suf, s, S, dS, dA, dL, dqg, dkg, dk_suffix, dq, dk, dg):
    """``dq, dk, dg`` of a chunk from the gradients of its pairs (``dA``: of ``A / scale``'s pairs;
    ``dL``: of ``L``, strictly lower), of ``qg, kg, k_suffix`` and of ``total`` (from the chunk-start
    state ``S`` and the end state's gradient ``dS``), through the decay factors ``e = exp(g)``,
    ``pre``, ``suf``."""
    Cp, K = q.shape
    V = S.shape[1]
    zero = np.zeros(1, q.dtype)[0]
    dtotal = np.zeros(K, q.dtype)
    for d in range(K):
        acc = dtotal[d]
        for c in range(V):
            acc += S[d, c] * dS[d, c]
        dtotal[d] = acc
    # pairs: gradients of A (scale q_i . k_j D) and L (k_i . k_j D), D = prod exp(g) over (j, i]
    DQ, DK, COL = empty2(Cp, K, q.dtype), empty2(Cp, K, q.dtype), empty2(Cp, K, q.dtype)
    _pairs_backward(q, k, e, s, dA, dL, DQ, DK, COL)
    rowP = empty2(Cp, K, q.dtype)
    colP = empty2(Cp, K, q.dtype)
    for j in range(Cp):
        c0 = s * dA[j, j]  # the pair (j, j): no decay
        for d in range(K):
            dq[j, d] = c0 * k[j, d] + DQ[j, d]
            dk[j, d] = c0 * q[j, d] + DK[j, d] + COL[j, d]
            rowP[j, d] = q[j, d] * DQ[j, d] + k[j, d] * DK[j, d]
            colP[j, d] = k[j, d] * COL[j, d]
    # dq, dk through the factors; dg from every factor's gradient
    for i in range(Cp):
        for d in range(K):
            dq[i, d] += s * pre[i, d] * dqg[i, d]
            dk[i, d] += pre[i, d] * dkg[i, d] + suf[i, d] * dk_suffix[i, d]
    # dg[l] = sum_{i >= l} (prefix terms + pair rows - pair cols)[i] + sum_{j < l} suffix terms[j]
    #         + total * dtotal
    #         (running sums over rows, a row of channels at a time: the loops vectorise)
    acc = np.zeros(K, q.dtype)
    for i in range(Cp - 1, -1, -1):
        for d in range(K):
            x = acc[d] + (s * q[i, d] * dqg[i, d] + k[i, d] * dkg[i, d]) * pre[i, d]
            x += rowP[i, d] - colP[i, d]
            acc[d] = x
            dg[i, d] = x
    for d in range(K):
        acc[d] = zero
    for i in range(Cp):
        for d in range(K):
            dg[i, d] += acc[d] + pre[Cp - 1, d] * dtotal[d]
            acc[d] += k[i, d] * suf[i, d] * dk_suffix[i, d]
