"""The solve of a chunk for ``U = (I + diag(beta) L)^-1 Y`` and its transpose: the inverse of
the unit lower triangular matrix, forward substitution, and the solve by blocks of
:data:`SOLVE_BLOCK <kda.cpu._compile.SOLVE_BLOCK>` rows."""

from __future__ import annotations

from . import _compile as cfg
from ._compile import jit
from ._products import _mm


@jit(inner=True)
def _inverse(L, beta, Minv):
    """``Minv = (I + diag(beta) L)^-1`` row by row: ``Minv[i, :i] = -beta[i] sum_m L[i, m] Minv[m, :i]``.

    Each row's sums run over a whole number of 16-column groups (``T[m, j] = 0`` for ``j > m``, so
    the extra terms add zeros): the loop then has no scalar remainder (measured 2x faster).
    """
    Cp = L.shape[0]
    Minv[:, :] = 0.0
    for i in range(Cp):
        n = min(Cp, (i + 15) // 16 * 16)
        for m in range(i):
            c = L[i, m]
            for j in range(n):
                Minv[i, j] += c * Minv[m, j]
        for j in range(i):
            Minv[i, j] = -beta[i] * Minv[i, j]
        for j in range(i, n):
            Minv[i, j] = 0.0
        Minv[i, i] = 1.0


@jit(inner=True)
def _substitute(L, beta, Y, U):
    """``U = (I + diag(beta) L)^-1 Y`` by forward substitution (``U[i] = Y[i] - beta[i] sum_m
    L[i, m] U[m]``, which does not form the inverse's growth: for few key channels)."""
    Cp, V = Y.shape
    for i in range(Cp):
        for c in range(V):
            U[i, c] = Y[i, c]
        for m in range(i):
            x = beta[i] * L[i, m]
            for c in range(V):
                U[i, c] -= x * U[m, c]


@jit(inner=True)
def _solve_blocks(L, beta, Y, U, Td, W):
    """``U = (I + diag(beta) L)^-1 Y`` by blocks of :data:`SOLVE_BLOCK` rows: ``U_I = T_II (Y_I -
    diag(beta_I) L[I, :I] U[:I])``, ``T_II`` the diagonal block's inverse (:func:`_inverse`, kept in
    ``Td[I]`` for :func:`_solve_blocks_t`), so neither ``Minv``'s off-diagonal blocks nor a product
    with them are formed (and, as in forward substitution, no growth of ``Minv`` enters ``U``).
    ``Td: [Cp, c]``, ``W: [c, V]`` scratch (``c = min(SOLVE_BLOCK, Cp)``)."""
    Cp, V = Y.shape
    c = min(cfg.SOLVE_BLOCK, Cp)
    W = W[:c]
    for a0 in range(0, Cp, c):
        T = Td[a0 : a0 + c, :c]
        _inverse(L[a0 : a0 + c, a0 : a0 + c], beta[a0 : a0 + c], T)
        if a0 == 0:
            _mm(T, False, Y[:c], False, U[:c], 0.0)
            continue
        _mm(L[a0 : a0 + c, :a0], False, U[:a0], False, W, 0.0)
        for i in range(c):
            x = beta[a0 + i]
            for d in range(V):
                W[i, d] = Y[a0 + i, d] - x * W[i, d]
        _mm(T, False, W, False, U[a0 : a0 + c], 0.0)


@jit(inner=True)
def _solve_blocks_t(L, beta, Td, dU, dY, dR, W):
    """The transposed solve, ``dY = (I + diag(beta) L)^-T dU``, last block first, with the diagonal
    inverses ``Td`` of :func:`_solve_blocks`: ``dY_I = T_II^T (dU_I + L[J, I]^T dR_J)`` over the
    later rows ``J``, ``dR = -beta dY`` (both written)."""
    Cp, V = dU.shape
    c = min(cfg.SOLVE_BLOCK, Cp)
    W = W[:c]
    for a0 in range(Cp - c, -1, -c):
        a1 = a0 + c
        for i in range(c):
            for d in range(V):
                W[i, d] = dU[a0 + i, d]
        if a1 < Cp:
            _mm(L[a1:, a0:a1], True, dR[a1:], False, W, 1.0)
        _mm(Td[a0:a1, :c], True, W, False, dY[a0:a1], 0.0)
        for i in range(a0, a1):
            x = -beta[i]
            for d in range(V):
                dR[i, d] = x * dY[i, d]
