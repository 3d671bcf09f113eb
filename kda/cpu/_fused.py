"""The fused passes of the CPU backend: one head per worker, chunk after chunk.

Each chunk's inputs are copied into zero-padded ``[Cp, *]`` scratch arrays, its state-free work
and its state step follow at once, so the chunk's data and the ``[K, V]`` state stay in the cache
and nothing of size ``T`` is written but the results. Inputs are read in place with whatever
strides they have (time-major views included).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _compile as cfg
from ._compile import jit
from ._pairs import _factor_grads, _local_pairs, _sum_products
from ._products import _mm, copy2, empty2
from ._solve import _solve_blocks, _solve_blocks_t, _substitute


@jit(inner=True)
def _load(x, b, h, t0, m, buf):
    """Rows ``t0 .. t0 + m`` of ``x[b, h]`` into ``buf[:m]``; rows ``m ..`` of ``buf`` zeroed.

    Returns ``sum(x * 0)`` over the rows copied (float64): 0 where they are finite, NaN where not;
    the order of the terms cannot change that, so a loop that stores and sums is safe here.
    """
    D = buf.shape[1]
    acc = 0.0
    for i in range(m):
        row = buf[i, :0].sum()
        for d in range(D):
            y = x[b, h, t0 + i, d]
            buf[i, d] = y
            row += y * 0.0
        acc += row
    for i in range(m, buf.shape[0]):
        for d in range(D):
            buf[i, d] = 0.0
    return acc


@jit(inner=True)
def _decays_screen(x):
    """0 where every element of a 2-D array is ``<= 0`` (``-inf`` included), NaN where one is not
    (positive or NaN): the fused passes screen each chunk's ``g`` for the call's gate check (a
    count of such elements: the order of its terms cannot change it)."""
    bad = 0
    for i in range(x.shape[0]):
        for d in range(x.shape[1]):
            bad += not x[i, d] <= 0.0
    return 0.0 if bad == 0 else np.nan


@jit(inner=True)
def _zeros_of(x):
    """``sum(x * 0)`` of a 2-D array as float64: 0 where every element is finite, NaN where one
    is not (``inf * 0`` is NaN); the order of the terms cannot change that."""
    acc = 0.0
    for i in range(x.shape[0]):
        row = x[i, :0].sum()
        for d in range(x.shape[1]):
            row += x[i, d] * 0.0
        acc += row
    return acc


@jit(inner=True)
def _is_zero(x):
    """Whether every element of a 2-D array is 0 (stops at the first that is not)."""
    for i in range(x.shape[0]):
        for d in range(x.shape[1]):
            if x[i, d] != 0.0:
                return False
    return True


@jit(inner=True)
def _transpose(x, out):
    """``out = x.T`` (2-D), written row by row of ``out``."""
    n, m = x.shape
    for j in range(m):
        for i in range(n):
            out[j, i] = x[i, j]


@jit(inner=True)
def _load_beta(beta, b, h, t0, m, buf):
    for i in range(m):
        buf[i] = beta[b, h, t0 + i]
    for i in range(m, buf.shape[0]):
        buf[i] = 0.0


class ChunkScratch(NamedTuple):
    """The scratch arrays of one chunk that both fused passes use (:func:`_chunk_scratch`), of the
    inputs' dtype."""

    q: Any  # [Cp, K]: the chunk's inputs, zero-padded
    k: Any  # [Cp, K]
    g: Any  # [Cp, K]
    v: Any  # [Cp, V]
    beta: Any  # [Cp]
    KQ: Any  # [2 Cp, K]: [kg; qg] (one product with the state)
    k_suffix: Any  # [Cp, K]
    total: Any  # [K]
    A: Any  # [Cp, Cp]
    L: Any  # [Cp, Cp]
    Minv: Any  # [Cp, Cp]
    pre: Any  # [Cp, K]: the decay prefixes (:func:`_local_pairs`)
    suf: Any  # [Cp, K]: the decay suffixes
    kd: Any  # [K]
    Td: Any  # [Cp, SOLVE_BLOCK]: the solve's (:func:`_solve_blocks`)
    Wb: Any  # [SOLVE_BLOCK, V]
    S: Any  # [K, V]: the state


@jit(inner=True)
def _chunk_scratch(x, Cp, K, V):
    """The :class:`ChunkScratch` of a chunk of ``Cp`` steps, ``K`` key and ``V`` value channels,
    of ``x``'s dtype (every 2-D array from :func:`empty2`: 64-byte aligned)."""
    dt = x.dtype
    qc, kc, gc = _three(x, Cp, K)
    A, L, Minv = _three(x, Cp, Cp)
    pre, suf, k_suffix = _three(x, Cp, K)
    return ChunkScratch(
        q=qc,
        k=kc,
        g=gc,
        v=empty2(Cp, V, dt),
        beta=np.empty(Cp, dt),
        KQ=empty2(2 * Cp, K, dt),
        k_suffix=k_suffix,
        total=np.empty(K, dt),
        A=A,
        L=L,
        Minv=Minv,
        pre=pre,
        suf=suf,
        kd=np.empty(K, dt),
        Td=empty2(Cp, cfg.SOLVE_BLOCK, dt),
        Wb=empty2(cfg.SOLVE_BLOCK, V, dt),
        S=empty2(K, V, dt),
    )


@jit(inner=True)
def _three(x, rows, cols):
    """Three scratch arrays ``[rows, cols]`` of ``x``'s dtype."""
    dt = x.dtype
    return empty2(rows, cols, dt), empty2(rows, cols, dt), empty2(rows, cols, dt)


@jit()
def forward_heads(
    q, k, v, g, beta, scale, state, C, with_output, with_boundaries, out, boundaries, final, screen, lo, hi
):
    """Heads ``[lo, hi)`` of ``B * H``: the chunked forward.

    Per chunk: its decay factors and pairs (:func:`_local_pairs`), then with the chunk-start
    state ``S``: ``[kg; qg] @ S`` as one product, ``U = (I + diag(beta) L)^-1 (beta (v - kg S))``
    (the same as ``u0 - w S``, one product with ``Minv`` fewer), ``O = qg S + A U``,
    ``S <- total S + k_suffix^T U``.

    ``q, k, g: [B, H, T, K]``, ``v, out: [B, H, T, V]``, ``beta: [B, H, T]`` (any strides),
    ``state, final: [B, H, K, V]``, ``boundaries: [NT, B, H, K, V]`` (the chunk-start states, written
    with ``with_boundaries``); ``out`` is written with ``with_output``. ``screen: [B * H, 2]`` (float64;
    ``[0, 2]`` for none) receives, per head, ``sum(x * 0)`` over its ``q, k, v`` and over its
    output and final state: 0 where they are finite, NaN where not (taken while the chunks are
    copied in and out, instead of in passes over the whole arrays); the first is NaN too where an
    element of the head's ``g`` is not ``<= 0`` (:func:`_decays_screen`).
    """
    _B, H, T, K = q.shape
    V = v.shape[3]
    Cp = 1
    while Cp < C:
        Cp *= 2
    NT = (T + C - 1) // C
    s = scale[0]
    dt = q.dtype
    by_inverse = K >= cfg.SUBSTITUTE_BELOW
    sc = _chunk_scratch(q, Cp, K, V)
    qc, kc, gc, vc, bc, S = sc.q, sc.k, sc.g, sc.v, sc.beta, sc.S
    KQ, k_suffix, total, A, L, Minv = sc.KQ, sc.k_suffix, sc.total, sc.A, sc.L, sc.Minv
    pre, suf, kd, Td, Wb = sc.pre, sc.suf, sc.kd, sc.Td, sc.Wb
    kg, qg = KQ[:Cp], KQ[Cp:]  # [kg; qg]: one product with the state
    R = empty2(2 * Cp, V, dt)  # [kg S; qg S]
    QS = R[Cp:]
    Y, U = empty2(Cp, V, dt), empty2(Cp, V, dt)
    with_screen = screen.shape[0] > 0
    for bh in range(lo, hi):
        b = bh // H
        h = bh - b * H
        copy2(state[b, h], S)
        seen_in = seen_out = 0.0
        for n in range(NT):
            t0 = n * C
            m = min(C, T - t0)
            seen_in += _load(q, b, h, t0, m, qc) + _load(k, b, h, t0, m, kc) + _load(v, b, h, t0, m, vc)
            _load(g, b, h, t0, m, gc)
            seen_in += _decays_screen(gc)  # its padding rows are zeros
            _load_beta(beta, b, h, t0, m, bc)
            # bool(False): a run-time bool; a literal False would compile _local_pairs once more
            no_inverse = bool(False)  # noqa: UP018
            _local_pairs(qc, kc, gc, bc, s, qg, kg, k_suffix, total, A, L, Minv, pre, suf, kd, no_inverse)
            if with_boundaries:
                copy2(S, boundaries[n, b, h])
            if n == 0 and _is_zero(S):
                R[:, :] = 0.0  # no initial state: [kg; qg] S is zero, skip the product
            else:
                _mm(KQ, False, S, False, R, 0.0)
            for i in range(Cp):
                x = bc[i]
                for c in range(V):
                    Y[i, c] = x * (vc[i, c] - R[i, c])
            if by_inverse:
                _solve_blocks(L, bc, Y, U, Td, Wb)
            else:
                _substitute(L, bc, Y, U)
            if with_output:
                _mm(A, False, U, False, QS, 1.0)  # O = qg S + A U (A: zeros above the diagonal)
                seen_out += _store(QS, out, b, h, t0, m)
            for d in range(K):
                t = total[d]
                for c in range(V):
                    S[d, c] *= t
            _mm(k_suffix, True, U, False, S, 1.0)  # S <- total S + k_suffix^T U
        copy2(S, final[b, h])
        if with_screen:
            screen[bh, 0] = seen_in
            screen[bh, 1] = seen_out + _zeros_of(S)


@jit()
def backward_heads(
    q, k, v, g, beta, scale, boundaries, dO, dfinal, C, dq, dk, dv, dg, dbeta, dinit, screen, lo, hi
):
    """Heads ``[lo, hi)`` of ``B * H``: the chunked backward, last chunk first.

    Per chunk, with its chunk-start state ``S`` (from ``boundaries``) and the gradient ``dS`` of its
    end state: its state-free work again and ``U`` as in :func:`forward_heads`, ``dU = A^T dO +
    k_suffix dS``, ``dY = Minv^T dU`` and ``dR = -beta dY`` (the gradient of ``kg S``), the state step
    ``dS <- total dS + [kg; qg]^T [dR; dO]`` (one product), then the chunk's local gradients
    (:func:`_fused_local_backward`). ``[dR; dO]`` and ``U`` are kept transposed (``ROT``, ``UT``):
    OpenBLAS's small-matrix products of a row-major ``X @ Y.T`` are the slow ones here (128 x 128
    x 128: 28 us against 18.5 for ``X.T @ Y.T``, one core; ``docs/speed.md``), and with these
    layouts no product of the backward has that form. Shapes as :func:`forward_heads`; ``dO``
    and the gradients like their inputs, ``boundaries: [NT, B, H, K, V]``, ``dfinal, dinit: [B, H,
    K, V]``. ``screen: [B * H, 2]`` as in :func:`forward_heads`: ``sum(x * 0)`` over the head's
    ``q, k, v, dO`` and boundaries (NaN too for a ``g`` not ``<= 0``), and over its six
    gradients.
    """
    _B, H, T, K = q.shape
    V = v.shape[3]
    Cp = 1
    while Cp < C:
        Cp *= 2
    NT = (T + C - 1) // C
    s = scale[0]
    dt = q.dtype
    by_inverse = K >= cfg.SUBSTITUTE_BELOW
    sc = _chunk_scratch(q, Cp, K, V)
    qc, kc, gc, vc, bc, S = sc.q, sc.k, sc.g, sc.v, sc.beta, sc.S
    KQ, k_suffix, total, A, L, Minv = sc.KQ, sc.k_suffix, sc.total, sc.A, sc.L, sc.Minv
    pre, suf, kd, Td, Wb = sc.pre, sc.suf, sc.kd, sc.Td, sc.Wb
    kg, qg = KQ[:Cp], KQ[Cp:]  # [kg; qg]
    ROT = empty2(V, 2 * Cp, dt)  # [dR; dO]^T: the gradients of [kg; qg] S, transposed
    dRT, dOT = ROT[:, :Cp], ROT[:, Cp:]
    Rk, Z, Y = _three(q, Cp, V)
    U, dU, dY = _three(q, Cp, V)
    dR, dOc, gv = _three(q, Cp, V)
    UT = empty2(V, Cp, dt)
    dS, dSend = empty2(K, V, dt), empty2(K, V, dt)
    gq, gk, gg = _three(q, Cp, K)
    gb = np.empty(Cp, dt)
    with_screen = screen.shape[0] > 0
    for bh in range(lo, hi):
        b = bh // H
        h = bh - b * H
        copy2(dfinal[b, h], dS)
        seen_in = seen_out = 0.0
        for n in range(NT - 1, -1, -1):
            t0 = n * C
            m = min(C, T - t0)
            seen_in += _load(q, b, h, t0, m, qc) + _load(k, b, h, t0, m, kc) + _load(v, b, h, t0, m, vc)
            seen_in += _load(dO, b, h, t0, m, dOc)
            _transpose(dOc, dOT)
            _load(g, b, h, t0, m, gc)
            seen_in += _decays_screen(gc)  # its padding rows are zeros
            _load_beta(beta, b, h, t0, m, bc)
            e = _local_pairs(
                qc, kc, gc, bc, s, qg, kg, k_suffix, total, A, L, Minv, pre, suf, kd, not by_inverse
            )
            copy2(boundaries[n, b, h], S)
            if with_screen:
                seen_in += _zeros_of(S)
            copy2(dS, dSend)
            zero_s = n == 0 and _is_zero(S)  # no initial state: kg S and dR S^T are zero
            zero_ds = n == NT - 1 and _is_zero(dS)  # no final state gradient: k_suffix dS, U dS^T are zero
            if zero_s:
                Rk[:, :] = 0.0
            else:
                _mm(kg, False, S, False, Rk, 0.0)
            for i in range(Cp):
                x = bc[i]
                for c in range(V):
                    z = vc[i, c] - Rk[i, c]
                    Z[i, c] = z
                    Y[i, c] = x * z
            if by_inverse:
                _solve_blocks(L, bc, Y, U, Td, Wb)
            else:
                _substitute(L, bc, Y, U)
            _transpose(U, UT)
            _mm(A, True, dOT, True, dU, 0.0)
            if not zero_ds:
                _mm(k_suffix, False, dS, False, dU, 1.0)
            if by_inverse:
                _solve_blocks_t(L, bc, Td, dU, dY, dR, Wb)
            else:
                _mm(Minv, True, dU, False, dY, 0.0)
                for i in range(Cp):
                    x = -bc[i]
                    for c in range(V):
                        dR[i, c] = x * dY[i, c]
            _transpose(dR, dRT)
            for d in range(K):
                t = total[d]
                for c in range(V):
                    dS[d, c] *= t
            _mm(KQ, True, ROT, True, dS, 1.0)  # dS <- total dS + [kg; qg]^T [dR; dO]
            _fused_local_backward(
                qc,
                kc,
                e,
                pre,
                suf,
                vc,
                bc,
                s,
                L,
                S,
                dSend,
                ROT,
                Z,
                UT,
                dY,
                gq,
                gk,
                gv,
                gg,
                gb,
                zero_s,
                zero_ds,
            )
            seen_out += _store(gq, dq, b, h, t0, m) + _store(gk, dk, b, h, t0, m)
            seen_out += _store(gg, dg, b, h, t0, m) + _store(gv, dv, b, h, t0, m)
            for i in range(m):
                dbeta[b, h, t0 + i] = gb[i]
                seen_out += gb[i] * 0.0
        copy2(dS, dinit[b, h])
        if with_screen:
            screen[bh, 0] = seen_in
            screen[bh, 1] = seen_out + _zeros_of(dS)


def backward_own_helpers(dt: Any) -> tuple[tuple[Any, tuple[Any, ...]], ...]:
    """The helpers that :func:`backward_heads` calls and :func:`forward_heads` does not, each with
    the argument types ``backward_heads`` passes them for its dtype ``dt`` (a Numba type): its
    scratch arrays (C-contiguous) and scalars, so they depend on ``dt`` alone. The second process
    that compiles ``backward_heads`` beside a first forward (:mod:`._ahead`) compiles these first,
    while the forward's process compiles the helpers both kernels call, instead of waiting for
    those (a test checks these are the signatures ``backward_heads``' typing asks for)."""
    from numba import types

    m, r, b = types.Array(dt, 2, "C"), types.Array(dt, 1, "C"), types.boolean
    return (
        (_fused_local_backward, (m, m, m, m, m, m, r, dt, m, m, m, m, m, m, m, m, m, m, m, r, b, b)),
        (_solve_blocks_t, (m, r, m, m, m, m, m)),
    )


@jit(inner=True)
def _store(x, out, b, h, t0, m):
    """``out[b, h, t0 + i] = x[i]`` for ``i < m``; returns ``sum(x * 0)`` of what it wrote."""
    D = x.shape[1]
    acc = 0.0
    for i in range(m):
        row = x[i, :0].sum()
        for d in range(D):
            y = x[i, d]
            out[b, h, t0 + i, d] = y
            row += y * 0.0
        acc += row
    return acc


@jit(inner=True)
def _fused_local_backward(
    q, k, e, pre, suf, v, beta, s, L, S, dS, ROT, Z, UT, dY, dq, dk, dv, dg, dbeta, zero_s, zero_ds
):
    """A chunk's local gradients in :func:`backward_heads` (``U = Minv beta Z``, ``Z = v - kg S``;
    ``UT = U^T``).

    Given ``ROT = [dR; dO]^T`` (``dR = -beta dY``, ``dY = Minv^T dU``) and the gradient ``dS`` of
    the chunk's end state: ``[dkg; dqg] = RO S^T`` (one product), ``dA = dO U^T``, ``dk_suffix = U dS^T``,
    ``dM = -dY U^T`` (``M = I + diag(beta) L``), so ``dL = beta dM`` and ``dbeta = dY . Z + dM .
    L`` by rows; then ``dq, dk, dg`` through the decay factors (:func:`_factor_grads`, shared with
    :func:`_local_backward_core`). ``zero_s`` / ``zero_ds``: ``S`` / ``dS`` is all zeros (the
    products with it are zeros and are not formed).
    """
    Cp, K = q.shape
    V = v.shape[1]
    G = empty2(2 * Cp, K, q.dtype)  # [dkg; dqg]
    if zero_s:
        G[:, :] = 0.0
    else:
        _mm(ROT, True, S, True, G, 0.0)
    dA, dX = empty2(Cp, Cp, q.dtype), empty2(Cp, Cp, q.dtype)
    _mm(ROT[:, Cp:], True, UT, False, dA, 0.0)  # dO U^T, lower triangle read
    _mm(dY, False, UT, False, dX, 0.0)  # dY U^T = -dM
    dk_suffix = empty2(Cp, K, q.dtype)
    if zero_ds:
        dk_suffix[:, :] = 0.0
    else:
        _mm(UT, True, dS, True, dk_suffix, 0.0)
    # dX <- dL = beta dM (strictly lower); dbeta; dv = beta dY
    for i in range(Cp):
        acc = _sum_products(Z[i], dY[i])
        if i > 0:
            acc -= _sum_products(dX[i, :i], L[i, :i])
        for j in range(i):
            dX[i, j] = -beta[i] * dX[i, j]
        for c in range(V):
            dv[i, c] = beta[i] * dY[i, c]
        dbeta[i] = acc
    _factor_grads(q, k, e, pre, suf, s, S, dS, dA, dX, G[Cp:], G[:Cp], dk_suffix, dq, dk, dg)
