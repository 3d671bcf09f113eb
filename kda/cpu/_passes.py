"""The unfused passes of the CPU backend (``chunk_local``, the two state passes,
``chunk_local_backward``) and the step recurrence (forward and backward).

Each kernel computes the items ``[lo, hi)`` of its independent chunks or heads (``nogil``); no sum
crosses items, so the results do not depend on how the caller splits them over threads.
"""

from __future__ import annotations

import numpy as np

from . import _compile as cfg
from ._compile import jit
from ._pairs import _factor_grads, _factors, _local_pairs, _sum_products
from ._products import copy2


@jit(inner=True)
def _local_one(q, k, g, v, beta, s, qg, kg, k_suffix, total, A, L, Minv, w, u0, pre, suf, kd, bk, bv):
    Cp, K = q.shape
    V = v.shape[1]
    inverse = bool(True)  # noqa: UP018  (a run-time bool: one compiled _local_pairs for every caller)
    e = _local_pairs(q, k, g, beta, s, qg, kg, k_suffix, total, A, L, Minv, pre, suf, kd, inverse)
    # [w, u0] = Minv diag(beta) [kg, v]: by BLAS, or by forward substitution for few channels
    # (w[i] = beta[i] (kg[i] - sum_m L[i, m] w[m]), which does not form T's growth into w)
    if K >= cfg.SUBSTITUTE_BELOW:
        for i in range(Cp):
            for d in range(K):
                bk[i, d] = beta[i] * kg[i, d]
        np.dot(Minv, bk, w)
        for i in range(Cp):
            for d in range(V):
                bv[i, d] = beta[i] * v[i, d]
        np.dot(Minv, bv, u0)
    else:
        for i in range(Cp):
            for d in range(K):
                bk[0, d] = kg[i, d]
            for c in range(V):
                bv[0, c] = v[i, c]
            for m in range(i):
                x = L[i, m]
                for d in range(K):
                    bk[0, d] -= x * w[m, d]
                for c in range(V):
                    bv[0, c] -= x * u0[m, c]
            for d in range(K):
                w[i, d] = beta[i] * bk[0, d]
            for c in range(V):
                u0[i, c] = beta[i] * bv[0, c]
    return e


@jit()
def local_forward(q, k, g, v, beta, scale, qg, kg, k_suffix, total, A, L, Minv, w, u0, lo, hi):
    """``chunk_local`` of ``N`` chunks: ``q, k, g: [N, Cp, K]``, ``v: [N, Cp, V]``, ``beta: [N, Cp]``."""
    _N, Cp, K = q.shape
    V = v.shape[2]
    s = scale[0]
    for n in range(lo, hi):
        pre = np.empty((Cp, K), q.dtype)
        suf = np.empty((Cp, K), q.dtype)
        kd = np.empty(K, q.dtype)
        bk = np.empty((Cp, K), q.dtype)
        bv = np.empty((Cp, V), q.dtype)
        _local_one(
            q[n],
            k[n],
            g[n],
            v[n],
            beta[n],
            s,
            qg[n],
            kg[n],
            k_suffix[n],
            total[n],
            A[n],
            L[n],
            Minv[n],
            w[n],
            u0[n],
            pre,
            suf,
            kd,
            bk,
            bv,
        )


# --------------------------------------------------------------------------------------------
# state passes


@jit()
def state_pass(w, u0, k_suffix, total, state, qg, A, with_output, boundaries, out, final, lo, hi):
    """Per head ``bh`` of ``w: [BH, NT, Cp, K]``: the state recurrence; ``boundaries: [NT, BH, K, V]``."""
    _BH, NT, Cp, K = w.shape
    V = u0.shape[3]
    for bh in range(lo, hi):
        S = state[bh].copy()
        U = np.empty((Cp, V), w.dtype)
        X = np.empty((K, V), w.dtype)
        At = np.empty((Cp, Cp), w.dtype)
        for n in range(NT):
            copy2(S, boundaries[n, bh])
            np.dot(w[bh, n], S, U)
            for i in range(Cp):
                for c in range(V):
                    U[i, c] = u0[bh, n, i, c] - U[i, c]
            if with_output:
                for i in range(Cp):
                    for j in range(Cp):
                        At[i, j] = A[bh, n, i, j] if j <= i else 0.0
                O = out[bh, n]
                np.dot(qg[bh, n], S, O)
                O += np.dot(At, U)
            np.dot(k_suffix[bh, n].T, U, X)
            for d in range(K):
                t = total[bh, n, d]
                for c in range(V):
                    S[d, c] = t * S[d, c] + X[d, c]
        copy2(S, final[bh])


@jit()
def state_grad_pass(w, u0, k_suffix, total, qg, A, dO, boundaries, dfinal, ends, u, du, dinit, lo, hi):
    """Per head, last chunk first: ``dU = A^T dO + k_suffix dS``, ``dS <- total dS + qg^T dO - w^T dU``."""
    _BH, NT, Cp, K = w.shape
    V = u0.shape[3]
    for bh in range(lo, hi):
        dS = dfinal[bh].copy()
        X = np.empty((K, V), w.dtype)
        At = np.empty((Cp, Cp), w.dtype)
        for n in range(NT - 1, -1, -1):
            copy2(dS, ends[n, bh])
            U = u[bh, n]
            np.dot(w[bh, n], boundaries[n, bh], U)
            for i in range(Cp):
                for c in range(V):
                    U[i, c] = u0[bh, n, i, c] - U[i, c]
            for i in range(Cp):
                for j in range(Cp):
                    At[i, j] = A[bh, n, j, i] if i <= j else 0.0
            dU = du[bh, n]
            np.dot(k_suffix[bh, n], dS, dU)
            dU += np.dot(At, dO[bh, n])
            np.dot(qg[bh, n].T, dO[bh, n], X)
            Y = np.dot(w[bh, n].T, dU)
            for d in range(K):
                t = total[bh, n, d]
                for c in range(V):
                    dS[d, c] = (t * dS[d, c] + X[d, c]) - Y[d, c]
        copy2(dS, dinit[bh])


# --------------------------------------------------------------------------------------------
# chunk_local_backward


@jit(inner=True)
def _local_backward_one(q, k, g, v, beta, s, kg, w, u0, L, Minv, S, dS, U, dU, dO, dq, dk, dv, dg, dbeta):
    Cp, K = q.shape
    pre = np.empty((Cp, K), q.dtype)
    suf = np.empty((Cp, K), q.dtype)
    e = _factors(g, pre, suf)
    _local_backward_core(
        q, k, e, pre, suf, v, beta, s, kg, w, u0, L, Minv, S, dS, U, dU, dO, dq, dk, dv, dg, dbeta
    )
    return e


@jit(inner=True)
def _local_backward_core(
    q, k, e, pre, suf, v, beta, s, kg, w, u0, L, Minv, S, dS, U, dU, dO, dq, dk, dv, dg, dbeta
):
    """Gradients of one chunk's state-free work given its factors ``e = exp(g)``, ``pre``, ``suf``."""
    Cp, K = q.shape
    V = v.shape[1]
    # O = qg S + A U and S' = total S + k_suffix^T U
    dqg = np.dot(dO, S.T)  # [Cp, K]
    dA = np.dot(dO, U.T)  # [Cp, Cp], lower triangle read
    dk_suffix = np.dot(U, dS.T)  # [Cp, K]
    # U = U0 - W S, [W, U0] = Minv beta [kg, v]
    TT = Minv.T
    dkw = np.dot(TT, np.dot(dU, S.T))
    dkw *= -1.0
    dku = np.dot(TT, dU)
    dX = np.dot(dkw, w.T)
    dX += np.dot(dku, u0.T)
    # dX <- strictly lower part of -dX; dbeta; dL = beta dX
    for i in range(Cp):
        acc = _sum_products(kg[i], dkw[i]) + _sum_products(v[i], dku[i])
        if i > 0:
            acc -= _sum_products(dX[i, :i], L[i, :i])
        for j in range(i):
            dX[i, j] = -beta[i] * dX[i, j]
        for c in range(V):
            dv[i, c] = beta[i] * dku[i, c]
        dbeta[i] = acc
    for i in range(Cp):
        for d in range(K):
            dkw[i, d] *= beta[i]  # now the gradient of kg
    _factor_grads(q, k, e, pre, suf, s, S, dS, dA, dX, dqg, dkw, dk_suffix, dq, dk, dg)


@jit()
def local_backward(
    q, k, g, v, beta, scale, kg, w, u0, L, Minv, boundaries, ends, u, du, dO, dq, dk, dv, dg, dbeta, lo, hi
):
    """``chunk_local_backward`` of ``N = BH * NT`` chunks (``boundaries, ends: [NT, BH, K, V]``)."""
    q.shape[0]
    NT = boundaries.shape[0]
    s = scale[0]
    for n in range(lo, hi):
        bh = n // NT
        t = n - bh * NT
        _local_backward_one(
            q[n],
            k[n],
            g[n],
            v[n],
            beta[n],
            s,
            kg[n],
            w[n],
            u0[n],
            L[n],
            Minv[n],
            boundaries[t, bh],
            ends[t, bh],
            u[n],
            du[n],
            dO[n],
            dq[n],
            dk[n],
            dv[n],
            dg[n],
            dbeta[n],
        )


# --------------------------------------------------------------------------------------------
# the step recurrence


@jit(inner=True)
def _recurrence_step(S, q, k, v, g, b, s, o, pred):
    """One step on ``S: [K, V]`` in place; writes ``o: [V]``; ``pred: [V]`` scratch."""
    K, V = S.shape
    for c in range(V):
        pred[c] = 0.0
        o[c] = 0.0
    for d in range(K):
        e = np.exp(g[d])
        kd = k[d]
        for c in range(V):
            x = S[d, c] * e
            S[d, c] = x
            pred[c] += kd * x
    for c in range(V):
        pred[c] = b * (v[c] - pred[c])  # u
    for d in range(K):
        kd = k[d]
        qd = q[d]
        for c in range(V):
            x = S[d, c] + kd * pred[c]
            S[d, c] = x
            o[c] += qd * x
    for c in range(V):
        o[c] *= s


@jit()
def recurrent_forward(q, k, v, g, beta, scale, state, out, final, lo, hi):
    """Per head of ``q: [BH, T, K]``: the recurrence from ``state [BH, K, V]``."""
    _BH, T, _K = q.shape
    V = v.shape[2]
    s = scale[0]
    for bh in range(lo, hi):
        S = final[bh]
        copy2(state[bh], S)
        pred = np.empty(V, q.dtype)
        for t in range(T):
            _recurrence_step(S, q[bh, t], k[bh, t], v[bh, t], g[bh, t], beta[bh, t], s, out[bh, t], pred)


@jit()
def recurrent_backward(q, k, v, g, beta, scale, state, do, dfinal, dq, dk, dv, dg, dbeta, dinit, lo, hi):
    """Gradients of the recurrence per head; states kept every ``ceil(sqrt(T))`` steps."""
    _BH, T, K = q.shape
    V = v.shape[2]
    s = scale[0]
    stride = 1
    while stride * stride < T:
        stride += 1
    nchk = (T + stride - 1) // stride if T > 0 else 0
    zero = np.zeros(1, q.dtype)[0]
    for bh in range(lo, hi):
        chk = np.empty((max(nchk, 1), K, V), q.dtype)
        seg = np.empty((stride, K, V), q.dtype)
        S = state[bh].copy()
        o = np.empty(V, q.dtype)
        pred = np.empty(V, q.dtype)
        for t in range(T):
            if t % stride == 0:
                copy2(S, chk[t // stride])
            _recurrence_step(S, q[bh, t], k[bh, t], v[bh, t], g[bh, t], beta[bh, t], s, o, pred)
        dS = dfinal[bh].copy()
        Sd = np.empty((K, V), q.dtype)
        r = np.empty(V, q.dtype)
        du = np.empty(V, q.dtype)
        e = np.empty(K, q.dtype)
        for c0 in range(nchk - 1, -1, -1):
            start = c0 * stride
            stop = min(start + stride, T)
            copy2(chk[c0], seg[0])
            for t in range(start, stop - 1):
                copy2(seg[t - start], seg[t - start + 1])
                _recurrence_step(
                    seg[t - start + 1], q[bh, t], k[bh, t], v[bh, t], g[bh, t], beta[bh, t], s, o, pred
                )
            for t in range(stop - 1, start - 1, -1):
                P = seg[t - start]
                qt, k_suffix, vt, gt, dot = q[bh, t], k[bh, t], v[bh, t], g[bh, t], do[bh, t]
                b = beta[bh, t]
                for d in range(K):
                    e[d] = np.exp(gt[d])
                # Sd = e P; r = v - Sd^T k
                for c in range(V):
                    r[c] = vt[c]
                for d in range(K):
                    for c in range(V):
                        x = e[d] * P[d, c]
                        Sd[d, c] = x
                        r[c] -= k_suffix[d] * x
                # dq = s (Sd + k u^T) do; dS += s q do^T
                for d in range(K):
                    acc = zero
                    for c in range(V):
                        acc += (Sd[d, c] + k_suffix[d] * b * r[c]) * dot[c]
                    dq[bh, t, d] = s * acc
                    for c in range(V):
                        dS[d, c] += s * qt[d] * dot[c]
                # du = dS^T k; dk = dS u - Sd dr
                for c in range(V):
                    du[c] = 0.0
                for d in range(K):
                    for c in range(V):
                        du[c] += k_suffix[d] * dS[d, c]
                db = zero
                for c in range(V):
                    db += du[c] * r[c]
                    du[c] = b * du[c]  # dr
                dbeta[bh, t] = db
                for d in range(K):
                    acc = zero
                    acc2 = acc
                    for c in range(V):
                        acc += dS[d, c] * b * r[c] - Sd[d, c] * du[c]
                        x = dS[d, c] - k_suffix[d] * du[c]  # dSd
                        acc2 += x * Sd[d, c]
                        dS[d, c] = e[d] * x
                    dk[bh, t, d] = acc
                    dg[bh, t, d] = acc2
                for c in range(V):
                    dv[bh, t, c] = du[c]
        copy2(dS, dinit[bh])
