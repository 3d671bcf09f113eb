"""Numba-compiled kernels of the CPU backend (imported on first use: this imports numba).

Every kernel takes arrays of one floating dtype (float32 or float64; C-contiguous, except the
inputs of the fused passes, read in place with any strides) and writes its results into output
arrays the caller allocated. Each kernel computes the items ``[lo, hi)`` of its independent
chunks or heads and releases the GIL (``nogil``), so the caller runs ranges on threads of its
own; no sum crosses items, so the results do not depend on how they are split. Dense products of
a chunk (``[Cp, K] x [K, V]`` and the like) call BLAS through Numba's ``np.dot``; the pairwise
decayed products run as matrix products across sub-blocks of a chunk and as hand loops inside
them (see :func:`_pairs`). Every sum over channels runs in a loop that stores nothing, so it is
compiled once (see :func:`_pairs_within`) and the order of its terms never depends on addresses.

Decay factors are products of ``exp(g)`` over exactly the steps they span (running products from
one end, or products of such partial products), so ``g = -inf`` gives an exact 0 and no NaN arises.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic
from numba.np.linalg import check_blas_return, ensure_blas, get_blas_kind

__all__ = [
    "backward_heads",
    "forward_heads",
    "local_backward",
    "local_forward",
    "recurrent_backward",
    "recurrent_forward",
    "state_grad_pass",
    "state_pass",
]

# No nnan/ninf: -inf gates must stay exact. Reassociation lets channel loops vectorise; the
# compiled order is fixed, so results are deterministic.
_FASTMATH = {"reassoc", "contract"}


CACHING = True  # False when no cache directory is writable (a read-only install)

# Key sizes below this form [W, U0] by forward substitution (more accurate there), above by BLAS
SUBSTITUTE_BELOW = 16


def _avx512() -> bool:
    """Whether the kernels are compiled for AVX-512: Numba's target features (the host's unless
    ``NUMBA_CPU_FEATURES`` says otherwise). Numba's cache keys on them, so a cached kernel always
    carries the block sizes chosen here for its target."""
    features = numba.config.CPU_FEATURES
    if features is None:
        from llvmlite import binding

        features = binding.get_host_cpu_features().flatten()
    return "+avx512f" in features.split(",")


# The block sizes are measured per kind of core (docs/speed.md, "Block sizes by kind of core").
# With AVX-512, OpenBLAS takes products up to [64, k] @ [k, 64] through its small-matrix kernels
# (no packing) and the hand loops run 16 float32 lanes: small products are cheap, so sub-blocks
# and solve blocks of 8 steps, and larger products cut into 64 x 64 blocks. With AVX2 (Zen 3
# here), every BLAS call packs its operands (an 8 x 128 x 64 product costs ~8 us, a 128 x 128 x
# 128 one 68 us as one call, 84 as four): fewer and larger calls, blocks of 16, products whole.
def block_sizes(wide: bool) -> tuple[int, int, int]:
    """``(GEMM_BLOCK, SUB_BLOCK, SOLVE_BLOCK)`` for AVX-512 (``wide``) or narrower vectors:
    the rows and columns of one BLAS call's result (a larger product is cut into such blocks), the
    steps of a sub-block of a chunk (pairs inside one by running products, across them by matrix
    products: :func:`_pairs`) and the rows of a block of the solve for ``U`` (:func:`_solve_blocks`)."""
    return (64, 8, 8) if wide else (1 << 20, 16, 16)


WIDE = _avx512()
GEMM_BLOCK, SUB_BLOCK, SOLVE_BLOCK = block_sizes(WIDE)


def _jit(fastmath=_FASTMATH):
    """``numba.njit`` with caching, or without it where no cache directory is writable."""

    def decorate(fn):
        global CACHING
        options = {"nogil": True, "fastmath": fastmath, "error_model": "numpy"}
        try:
            return numba.njit(cache=True, **options)(fn)
        except (RuntimeError, OSError):  # numba: "no locator available" for a read-only tree
            CACHING = False
            return numba.njit(cache=False, **options)(fn)

    return decorate


# --------------------------------------------------------------------------------------------
# matrix products, in blocks of GEMM_BLOCK rows and columns of the result


@intrinsic
def _xxgemm(typingctx, ta, tb, m, n, k, a, ia, lda, b, ib, ldb, beta, c, ic, ldc):
    """Column-major BLAS ``gemm`` (Numba's own ``numba_xxgemm``, as ``np.dot`` calls it) on the
    buffers of arrays ``a, b, c`` from the flat element offsets ``ia, ib, ic``, ``alpha = 1``;
    ``ta, tb`` are the characters' codes (``ord("n")``, ``ord("t")``)."""
    ensure_blas()
    sig = types.void(ta, tb, m, n, k, a, ia, lda, b, ib, ldb, beta, c, ic, ldc)

    def codegen(context, builder, signature, args):
        char, void_p = ir.IntType(8), ir.IntType(8).as_pointer()
        intp = context.get_value_type(types.intp)
        fnty = ir.FunctionType(
            ir.IntType(32),
            [char, char, char, intp, intp, intp, void_p, void_p, intp, void_p, intp, void_p, void_p, intp],
        )
        fn = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")
        vta, vtb, vm, vn, vk, _, via, vlda, _, vib, vldb, vbeta, _, vic, vldc = args
        tys = signature.args
        dtype = tys[5].dtype

        def at(i, offset):
            data = context.make_array(tys[i])(context, builder, args[i]).data
            return builder.bitcast(builder.gep(data, [offset]), void_p)

        def slot(value, ty):
            cell = cgutils.alloca_once_value(builder, context.cast(builder, value, ty, dtype))
            return builder.bitcast(cell, void_p)

        call = (
            ir.Constant(char, ord(get_blas_kind(dtype))), builder.trunc(vta, char), builder.trunc(vtb, char),
            vm, vn, vk, slot(ir.Constant(context.get_value_type(dtype), 1.0), dtype), at(5, via), vlda,
            at(8, vib), vldb, slot(vbeta, tys[11]), at(12, vic), vldc,
        )  # fmt: skip
        check_blas_return(context, builder, builder.call(fn, call))

    return sig, codegen


@_jit()
def _mm(A, ta, B, tb, C, beta):
    """``C = op(A) @ op(B) + beta C`` (row-major; ``op(X) = X.T`` where ``tX``) in blocks of
    :data:`GEMM_BLOCK` rows and columns of ``C``. Arrays are 2-D with unit inner stride (row
    strides are passed to BLAS, so row-strided views work). A block's sums run over the whole
    inner dimension in one call, so cutting ``C`` into blocks leaves every element's sum whole."""
    m, n = C.shape
    k = A.shape[0] if ta else A.shape[1]
    lda, ldb, ldc = A.strides[0] // A.itemsize, B.strides[0] // B.itemsize, C.strides[0] // C.itemsize
    # row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T
    fa, fb = 116 if ta else 110, 116 if tb else 110  # ord("t"), ord("n")
    for i0 in range(0, m, GEMM_BLOCK):
        mi = min(GEMM_BLOCK, m - i0)
        ia = i0 if ta else i0 * lda
        for j0 in range(0, n, GEMM_BLOCK):
            nj = min(GEMM_BLOCK, n - j0)
            ib = j0 * ldb if tb else j0
            _xxgemm(fb, fa, nj, mi, k, B, ib, ldb, A, ia, lda, beta, C, i0 * ldc + j0, ldc)


# --------------------------------------------------------------------------------------------
# chunk_local


_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that m * _LN2_HI is exact for |m| < 2**20
_LN2_LO = 1.90821492927058770002e-10
_ROUND = 6755399441055744.0  # 1.5 * 2**52: (x + _ROUND) - _ROUND rounds x to an integer
_EXP_MIN = -708.39  # exp below this is under the smallest normal float64: returned as 0


@_jit(fastmath={"contract"})
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


@_jit()
def _exp(g):
    """``exp(g)`` of a ``[Cp, K]`` array of log decays (``g <= 0``), row by row (:func:`_exp_row`)."""
    Cp, K = g.shape
    e = np.empty((Cp, K), g.dtype)
    work = np.empty(K, np.float64)
    for i in range(Cp):
        _exp_row(g[i], e[i], work)
    return e


@_jit()
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


@_jit()
def _sum(x):
    """``sum(x)`` in a loop that stores nothing (one compiled order).

    The loop starts from a zero over every element: started from ``x[0]``, its ``K - 1`` steps
    left a scalar remainder after the vector body, 2-3x slower for ``K = 128`` (measured).
    """
    acc = x[:0].sum()  # a zero of x's dtype: the loop then runs over all of x
    for d in range(x.shape[0]):
        acc += x[d]
    return acc


@_jit()
def _sum_products(x, y):
    """``sum(x * y)`` in a loop that stores nothing (one compiled order)."""
    acc = x[:0].sum()  # a zero of x's dtype: the loop then runs over all of x
    for d in range(x.shape[0]):
        acc += x[d] * y[d]
    return acc


@_jit()
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


@_jit()
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


@_jit()
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
    c = min(SUB_BLOCK, Cp)
    dt = q.dtype
    A[:, :] = 0.0
    L[:, :] = 0.0
    for a0 in range(0, Cp, c):
        _pairs_within(q, k, e, s, A, L, kd, a0, a0 + c)
    if c == Cp:
        return
    P, Q = np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    _block_factors(e, c, P, Q)
    left = np.empty((2 * c, K), dt)
    right = np.empty((Cp - c, K), dt)
    AL = np.empty((2 * c, Cp - c), dt)  # [A; L] rows of a sub-block: one product for both
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


@_jit()
def _local_pairs(q, k, g, beta, s, qg, kg, kt, total, A, L, Tinv, pre, suf, kd, with_inverse):
    """A chunk's decay factors, ``qg, kg, kt, total``, its pairs ``A, L`` and, ``with_inverse``,
    ``Tinv = (I + diag(beta) L)^-1``; returns ``exp(g)``."""
    Cp, K = q.shape
    e = _factors(g, pre, suf)
    for i in range(Cp):
        for d in range(K):
            qg[i, d] = s * q[i, d] * pre[i, d]
            kg[i, d] = k[i, d] * pre[i, d]
            kt[i, d] = k[i, d] * suf[i, d]
    for d in range(K):
        total[d] = pre[Cp - 1, d]
    _pairs(q, k, e, s, A, L, kd)
    if with_inverse:
        _inverse(L, beta, Tinv)
    return e


@_jit()
def _inverse(L, beta, Tinv):
    """``Tinv = (I + diag(beta) L)^-1`` row by row: ``T[i, :i] = -beta[i] sum_m L[i, m] T[m, :i]``.

    Each row's sums run over a whole number of 16-column groups (``T[m, j] = 0`` for ``j > m``, so
    the extra terms add zeros): the loop then has no scalar remainder (measured 2x faster).
    """
    Cp = L.shape[0]
    Tinv[:, :] = 0.0
    for i in range(Cp):
        n = min(Cp, (i + 15) // 16 * 16)
        for m in range(i):
            c = L[i, m]
            for j in range(n):
                Tinv[i, j] += c * Tinv[m, j]
        for j in range(i):
            Tinv[i, j] = -beta[i] * Tinv[i, j]
        for j in range(i, n):
            Tinv[i, j] = 0.0
        Tinv[i, i] = 1.0


@_jit()
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


@_jit()
def _solve_blocks(L, beta, Y, U, Td, W):
    """``U = (I + diag(beta) L)^-1 Y`` by blocks of :data:`SOLVE_BLOCK` rows: ``U_I = T_II (Y_I -
    diag(beta_I) L[I, :I] U[:I])``, ``T_II`` the diagonal block's inverse (:func:`_inverse`, kept in
    ``Td[I]`` for :func:`_solve_blocks_t`), so neither ``Tinv``'s off-diagonal blocks nor a product
    with them are formed (and, as in forward substitution, no growth of ``Tinv`` enters ``U``).
    ``Td: [Cp, c]``, ``W: [c, V]`` scratch (``c = min(SOLVE_BLOCK, Cp)``)."""
    Cp, V = Y.shape
    c = min(SOLVE_BLOCK, Cp)
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


@_jit()
def _solve_blocks_t(L, beta, Td, dU, dY, dR, W):
    """The transposed solve, ``dY = (I + diag(beta) L)^-T dU``, last block first, with the diagonal
    inverses ``Td`` of :func:`_solve_blocks`: ``dY_I = T_II^T (dU_I + L[J, I]^T dR_J)`` over the
    later rows ``J``, ``dR = -beta dY`` (both written)."""
    Cp, V = dU.shape
    c = min(SOLVE_BLOCK, Cp)
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


@_jit()
def _local_one(q, k, g, v, beta, s, qg, kg, kt, total, A, L, Tinv, w, u0, pre, suf, kd, bk, bv):
    Cp, K = q.shape
    V = v.shape[1]
    e = _local_pairs(q, k, g, beta, s, qg, kg, kt, total, A, L, Tinv, pre, suf, kd, True)
    # [w, u0] = T diag(beta) [kg, v]: by BLAS, or by forward substitution for few channels
    # (w[i] = beta[i] (kg[i] - sum_m L[i, m] w[m]), which does not form T's growth into w)
    if K >= SUBSTITUTE_BELOW:
        for i in range(Cp):
            for d in range(K):
                bk[i, d] = beta[i] * kg[i, d]
        np.dot(Tinv, bk, w)
        for i in range(Cp):
            for d in range(V):
                bv[i, d] = beta[i] * v[i, d]
        np.dot(Tinv, bv, u0)
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


@_jit()
def local_forward(q, k, g, v, beta, scale, qg, kg, kt, total, A, L, Tinv, w, u0, lo, hi):
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
            q[n], k[n], g[n], v[n], beta[n], s, qg[n], kg[n], kt[n], total[n], A[n], L[n], Tinv[n],
            w[n], u0[n], pre, suf, kd, bk, bv,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# state passes


@_jit()
def state_pass(w, u0, kt, total, state, qg, A, with_output, bounds, out, final, lo, hi):
    """Per head ``bh`` of ``w: [BH, NT, Cp, K]``: the state recurrence; ``bounds: [NT, BH, K, V]``."""
    _BH, NT, Cp, K = w.shape
    V = u0.shape[3]
    for bh in range(lo, hi):
        S = state[bh].copy()
        U = np.empty((Cp, V), w.dtype)
        X = np.empty((K, V), w.dtype)
        At = np.empty((Cp, Cp), w.dtype)
        for n in range(NT):
            bounds[n, bh] = S
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
            np.dot(kt[bh, n].T, U, X)
            for d in range(K):
                t = total[bh, n, d]
                for c in range(V):
                    S[d, c] = t * S[d, c] + X[d, c]
        final[bh] = S


@_jit()
def state_grad_pass(w, u0, kt, total, qg, A, dO, bounds, dstate, ends, u, du, dinit, lo, hi):
    """Per head, last chunk first: ``dU = A^T dO + kt dS``, ``dS <- total dS + qg^T dO - w^T dU``."""
    _BH, NT, Cp, K = w.shape
    V = u0.shape[3]
    for bh in range(lo, hi):
        dS = dstate[bh].copy()
        X = np.empty((K, V), w.dtype)
        At = np.empty((Cp, Cp), w.dtype)
        for n in range(NT - 1, -1, -1):
            ends[n, bh] = dS
            U = u[bh, n]
            np.dot(w[bh, n], bounds[n, bh], U)
            for i in range(Cp):
                for c in range(V):
                    U[i, c] = u0[bh, n, i, c] - U[i, c]
            for i in range(Cp):
                for j in range(Cp):
                    At[i, j] = A[bh, n, j, i] if i <= j else 0.0
            dU = du[bh, n]
            np.dot(kt[bh, n], dS, dU)
            dU += np.dot(At, dO[bh, n])
            np.dot(qg[bh, n].T, dO[bh, n], X)
            Y = np.dot(w[bh, n].T, dU)
            for d in range(K):
                t = total[bh, n, d]
                for c in range(V):
                    dS[d, c] = (t * dS[d, c] + X[d, c]) - Y[d, c]
        dinit[bh] = dS


# --------------------------------------------------------------------------------------------
# chunk_local_backward


@_jit()
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


@_jit()
def _pairs_backward(q, k, e, s, dA, dX, DQ, DK, COL):
    """Sums over the pairs ``j < i`` of a chunk with decay ``D = decay(j..i]``, given the
    gradients ``dA`` (of ``A / scale``'s pairs: ``c = scale dA``) and ``dX`` (of ``L``):
    ``DQ[i] = sum_j c k_j D``, ``DK[i] = sum_j dX k_j D``, ``COL[j] = sum_i (c q_i + dX k_i) D``.

    Cut into sub-blocks as :func:`_pairs`: pairs across them as matrix products of the same
    partial-product factors, ``[DQ; DK]_J += P_J * ([c; dX]_J @ (k Q M))`` and
    ``COL_I += Q M * ([c; dX]_J^T @ [q P; k P]_J)``.
    """
    Cp, K = q.shape
    c = min(SUB_BLOCK, Cp)
    dt = q.dtype
    DQ[:, :] = 0.0
    DK[:, :] = 0.0
    COL[:, :] = 0.0
    for a0 in range(0, Cp, c):
        _pairs_backward_within(q, k, e, s, dA, dX, DQ, DK, COL, a0, a0 + c)
    if c == Cp:
        return
    P, Q = np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    _block_factors(e, c, P, Q)
    left = np.empty((2 * c, K), dt)
    right, qm = np.empty((Cp - c, K), dt), np.empty((Cp - c, K), dt)
    G, rows, cols = np.empty((2 * c, Cp - c), dt), np.empty((2 * c, K), dt), np.empty((Cp - c, K), dt)
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


@_jit()
def _local_backward_one(
    q, k, g, v, beta, s, kg, w, u0, L, Tinv, S, dS, U, dU, dO, dq, dk, dv, dg, dbeta
):  # fmt: skip
    Cp, K = q.shape
    pre = np.empty((Cp, K), q.dtype)
    suf = np.empty((Cp, K), q.dtype)
    e = _factors(g, pre, suf)
    _local_backward_core(
        q, k, e, pre, suf, v, beta, s, kg, w, u0, L, Tinv, S, dS, U, dU, dO, dq, dk, dv, dg, dbeta
    )
    return e


@_jit()
def _local_backward_core(
    q, k, e, pre, suf, v, beta, s, kg, w, u0, L, Tinv, S, dS, U, dU, dO, dq, dk, dv, dg, dbeta
):  # fmt: skip
    """Gradients of one chunk's state-free work given its factors ``e = exp(g)``, ``pre``, ``suf``."""
    Cp, K = q.shape
    V = v.shape[1]
    # O = qg S + A U and S' = total S + kt^T U
    dqg = np.dot(dO, S.T)  # [Cp, K]
    dA = np.dot(dO, U.T)  # [Cp, Cp], lower triangle read
    dkt = np.dot(U, dS.T)  # [Cp, K]
    # U = U0 - W S, [W, U0] = T beta [kg, v]
    TT = Tinv.T
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
    _factor_grads(q, k, e, pre, suf, s, S, dS, dA, dX, dqg, dkw, dkt, dq, dk, dg)


@_jit()
def _factor_grads(q, k, e, pre, suf, s, S, dS, dA, dL, dqg, dkg, dkt, dq, dk, dg):
    """``dq, dk, dg`` of a chunk from the gradients of its pairs (``dA``: of ``A / scale``'s pairs;
    ``dL``: of ``L``, strictly lower), of ``qg, kg, kt`` and of ``total`` (from the chunk-start
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
    DQ, DK, COL = np.empty((Cp, K), q.dtype), np.empty((Cp, K), q.dtype), np.empty((Cp, K), q.dtype)
    _pairs_backward(q, k, e, s, dA, dL, DQ, DK, COL)
    rowP = np.empty((Cp, K), q.dtype)
    colP = np.empty((Cp, K), q.dtype)
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
            dk[i, d] += pre[i, d] * dkg[i, d] + suf[i, d] * dkt[i, d]
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
            acc[d] += k[i, d] * suf[i, d] * dkt[i, d]


@_jit()
def local_backward(
    q, k, g, v, beta, scale, kg, w, u0, L, Tinv, bounds, ends, u, du, dO, dq, dk, dv, dg, dbeta, lo, hi
):
    """``chunk_local_backward`` of ``N = BH * NT`` chunks (``bounds, ends: [NT, BH, K, V]``)."""
    q.shape[0]
    NT = bounds.shape[0]
    s = scale[0]
    for n in range(lo, hi):
        bh = n // NT
        t = n - bh * NT
        _local_backward_one(
            q[n], k[n], g[n], v[n], beta[n], s, kg[n], w[n], u0[n], L[n], Tinv[n], bounds[t, bh],
            ends[t, bh], u[n], du[n], dO[n], dq[n], dk[n], dv[n], dg[n], dbeta[n],
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# the fused passes: one head per worker, chunk after chunk
#
# Each chunk's inputs are copied into zero-padded [Cp, *] scratch arrays, its state-free work
# (_local_one) and its state step follow at once, so the chunk's data and the [K, V] state stay
# in the cache and nothing of size T is written but the results. Inputs are read in place with
# whatever strides they have (time-major views included). They live in this file, not one of
# their own: Numba's cache checks only the file that defines a kernel, so a kernel in another
# file would keep running stale copies of the helpers here after they change.


@_jit()
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


@_jit()
def _decays_screen(x):
    """0 where every element of a 2-D array is ``<= 0`` (``-inf`` included), NaN where one is not
    (positive or NaN): the fused passes screen each chunk's ``g`` for the call's gate check (a
    count of such elements: the order of its terms cannot change it)."""
    bad = 0
    for i in range(x.shape[0]):
        for d in range(x.shape[1]):
            bad += not x[i, d] <= 0.0
    return 0.0 if bad == 0 else np.nan


@_jit()
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


@_jit()
def _is_zero(x):
    """Whether every element of a 2-D array is 0 (stops at the first that is not)."""
    for i in range(x.shape[0]):
        for d in range(x.shape[1]):
            if x[i, d] != 0.0:
                return False
    return True


@_jit()
def _transpose(x, out):
    """``out = x.T`` (2-D), written row by row of ``out``."""
    n, m = x.shape
    for j in range(m):
        for i in range(n):
            out[j, i] = x[i, j]


@_jit()
def _load_beta(beta, b, h, t0, m, buf):
    for i in range(m):
        buf[i] = beta[b, h, t0 + i]
    for i in range(m, buf.shape[0]):
        buf[i] = 0.0


@_jit()
def forward_heads(
    q, k, v, g, beta, scale, state, C, with_output, with_bounds, out, bounds, final, screen, lo, hi
):  # fmt: skip
    """Heads ``[lo, hi)`` of ``B * H``: the chunked forward.

    Per chunk: its decay factors and pairs (:func:`_local_pairs`), then with the chunk-start
    state ``S``: ``[kg; qg] @ S`` as one product, ``U = (I + diag(beta) L)^-1 (beta (v - kg S))``
    (the same as ``u0 - w S``, one product with ``Tinv`` fewer), ``O = qg S + A U``,
    ``S <- total S + kt^T U``.

    ``q, k, g: [B, H, T, K]``, ``v, out: [B, H, T, V]``, ``beta: [B, H, T]`` (any strides),
    ``state, final: [B, H, K, V]``, ``bounds: [NT, B, H, K, V]`` (the chunk-start states, written
    with ``with_bounds``); ``out`` is written with ``with_output``. ``screen: [B * H, 2]`` (float64;
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
    by_inverse = K >= SUBSTITUTE_BELOW
    qc, kc, gc = np.empty((Cp, K), dt), np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    vc, bc = np.empty((Cp, V), dt), np.empty(Cp, dt)
    KQ = np.empty((2 * Cp, K), dt)  # [kg; qg]: one product with the state
    kg, qg = KQ[:Cp], KQ[Cp:]
    kt = np.empty((Cp, K), dt)
    total = np.empty(K, dt)
    A, L, Tinv = np.empty((Cp, Cp), dt), np.empty((Cp, Cp), dt), np.empty((Cp, Cp), dt)
    pre, suf, kd = np.empty((Cp, K), dt), np.empty((Cp, K), dt), np.empty(K, dt)
    R = np.empty((2 * Cp, V), dt)  # [kg S; qg S]
    QS = R[Cp:]
    Y, U = np.empty((Cp, V), dt), np.empty((Cp, V), dt)
    Td, Wb = np.empty((Cp, SOLVE_BLOCK), dt), np.empty((SOLVE_BLOCK, V), dt)
    S = np.empty((K, V), dt)
    with_screen = screen.shape[0] > 0
    for bh in range(lo, hi):
        b = bh // H
        h = bh - b * H
        S[:, :] = state[b, h]
        seen_in = seen_out = 0.0
        for n in range(NT):
            t0 = n * C
            m = min(C, T - t0)
            seen_in += _load(q, b, h, t0, m, qc) + _load(k, b, h, t0, m, kc) + _load(v, b, h, t0, m, vc)
            _load(g, b, h, t0, m, gc)
            seen_in += _decays_screen(gc)  # its padding rows are zeros
            _load_beta(beta, b, h, t0, m, bc)
            _local_pairs(qc, kc, gc, bc, s, qg, kg, kt, total, A, L, Tinv, pre, suf, kd, False)
            if with_bounds:
                bounds[n, b, h] = S
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
            _mm(kt, True, U, False, S, 1.0)  # S <- total S + kt^T U
        final[b, h] = S
        if with_screen:
            screen[bh, 0] = seen_in
            screen[bh, 1] = seen_out + _zeros_of(S)


@_jit()
def backward_heads(
    q, k, v, g, beta, scale, bounds, dO, dstate, C, dq, dk, dv, dg, dbeta, dinit, screen, lo, hi
):  # fmt: skip
    """Heads ``[lo, hi)`` of ``B * H``: the chunked backward, last chunk first.

    Per chunk, with its chunk-start state ``S`` (from ``bounds``) and the gradient ``dS`` of its
    end state: its state-free work again and ``U`` as in :func:`forward_heads`, ``dU = A^T dO +
    kt dS``, ``dY = Tinv^T dU`` and ``dR = -beta dY`` (the gradient of ``kg S``), the state step
    ``dS <- total dS + [kg; qg]^T [dR; dO]`` (one product), then the chunk's local gradients
    (:func:`_fused_local_backward`). ``[dR; dO]`` and ``U`` are kept transposed (``ROT``, ``UT``):
    OpenBLAS's small-matrix products of a row-major ``X @ Y.T`` are the slow ones here (128 x 128
    x 128: 28 us against 18.5 for ``X.T @ Y.T``, one core; ``docs/speed.md``), and with these
    layouts no product of the backward has that form. Shapes as :func:`forward_heads`; ``dO``
    and the gradients like their inputs, ``bounds: [NT, B, H, K, V]``, ``dstate, dinit: [B, H,
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
    by_inverse = K >= SUBSTITUTE_BELOW
    qc, kc, gc = np.empty((Cp, K), dt), np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    vc, bc = np.empty((Cp, V), dt), np.empty(Cp, dt)
    KQ = np.empty((2 * Cp, K), dt)  # [kg; qg]
    kg, qg = KQ[:Cp], KQ[Cp:]
    ROT = np.empty((V, 2 * Cp), dt)  # [dR; dO]^T: the gradients of [kg; qg] S, transposed
    dRT, dOT = ROT[:, :Cp], ROT[:, Cp:]
    kt = np.empty((Cp, K), dt)
    total = np.empty(K, dt)
    A, L, Tinv = np.empty((Cp, Cp), dt), np.empty((Cp, Cp), dt), np.empty((Cp, Cp), dt)
    pre, suf, kd = np.empty((Cp, K), dt), np.empty((Cp, K), dt), np.empty(K, dt)
    Rk, Z, Y = np.empty((Cp, V), dt), np.empty((Cp, V), dt), np.empty((Cp, V), dt)
    U, dU, dY = np.empty((Cp, V), dt), np.empty((Cp, V), dt), np.empty((Cp, V), dt)
    dR, dOc, UT = np.empty((Cp, V), dt), np.empty((Cp, V), dt), np.empty((V, Cp), dt)
    Td, Wb = np.empty((Cp, SOLVE_BLOCK), dt), np.empty((SOLVE_BLOCK, V), dt)
    S, dS, dSend = np.empty((K, V), dt), np.empty((K, V), dt), np.empty((K, V), dt)
    gq, gk, gg = np.empty((Cp, K), dt), np.empty((Cp, K), dt), np.empty((Cp, K), dt)
    gv, gb = np.empty((Cp, V), dt), np.empty(Cp, dt)
    with_screen = screen.shape[0] > 0
    for bh in range(lo, hi):
        b = bh // H
        h = bh - b * H
        dS[:, :] = dstate[b, h]
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
            e = _local_pairs(qc, kc, gc, bc, s, qg, kg, kt, total, A, L, Tinv, pre, suf, kd, not by_inverse)
            S[:, :] = bounds[n, b, h]
            if with_screen:
                seen_in += _zeros_of(S)
            dSend[:, :] = dS
            zero_s = n == 0 and _is_zero(S)  # no initial state: kg S and dR S^T are zero
            zero_ds = n == NT - 1 and _is_zero(dS)  # no final state gradient: kt dS, U dS^T are zero
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
                _mm(kt, False, dS, False, dU, 1.0)
            if by_inverse:
                _solve_blocks_t(L, bc, Td, dU, dY, dR, Wb)
            else:
                np.dot(Tinv.T, dU, dY)
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
                qc, kc, e, pre, suf, vc, bc, s, L, S, dSend, ROT, Z, UT, dY, gq, gk, gv, gg, gb,
                zero_s, zero_ds,
            )  # fmt: skip
            seen_out += _store(gq, dq, b, h, t0, m) + _store(gk, dk, b, h, t0, m)
            seen_out += _store(gg, dg, b, h, t0, m) + _store(gv, dv, b, h, t0, m)
            for i in range(m):
                dbeta[b, h, t0 + i] = gb[i]
                seen_out += gb[i] * 0.0
        dinit[b, h] = dS
        if with_screen:
            screen[bh, 0] = seen_in
            screen[bh, 1] = seen_out + _zeros_of(dS)


@_jit()
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


@_jit()
def _fused_local_backward(
    q, k, e, pre, suf, v, beta, s, L, S, dS, ROT, Z, UT, dY, dq, dk, dv, dg, dbeta, zero_s, zero_ds
):  # fmt: skip
    """A chunk's local gradients in :func:`backward_heads` (``U = Tinv beta Z``, ``Z = v - kg S``;
    ``UT = U^T``).

    Given ``ROT = [dR; dO]^T`` (``dR = -beta dY``, ``dY = Tinv^T dU``) and the gradient ``dS`` of
    the chunk's end state: ``[dkg; dqg] = RO S^T`` (one product), ``dA = dO U^T``, ``dkt = U dS^T``,
    ``dM = -dY U^T`` (``M = I + diag(beta) L``), so ``dL = beta dM`` and ``dbeta = dY . Z + dM .
    L`` by rows; then ``dq, dk, dg`` through the decay factors (:func:`_factor_grads`, shared with
    :func:`_local_backward_core`). ``zero_s`` / ``zero_ds``: ``S`` / ``dS`` is all zeros (the
    products with it are zeros and are not formed).
    """
    Cp, K = q.shape
    V = v.shape[1]
    G = np.empty((2 * Cp, K), q.dtype)  # [dkg; dqg]
    if zero_s:
        G[:, :] = 0.0
    else:
        _mm(ROT, True, S, True, G, 0.0)
    dA, dX = np.empty((Cp, Cp), q.dtype), np.empty((Cp, Cp), q.dtype)
    _mm(ROT[:, Cp:], True, UT, False, dA, 0.0)  # dO U^T, lower triangle read
    _mm(dY, False, UT, False, dX, 0.0)  # dY U^T = -dM
    dkt = np.empty((Cp, K), q.dtype)
    if zero_ds:
        dkt[:, :] = 0.0
    else:
        _mm(UT, True, dS, True, dkt, 0.0)
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
    _factor_grads(q, k, e, pre, suf, s, S, dS, dA, dX, G[Cp:], G[:Cp], dkt, dq, dk, dg)


# --------------------------------------------------------------------------------------------
# the step recurrence and decoding


@_jit()
def _step(S, q, k, v, g, b, s, o, pred):
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


@_jit()
def recurrent_forward(q, k, v, g, beta, scale, state, out, final, lo, hi):
    """Per head of ``q: [BH, T, K]``: the recurrence from ``state [BH, K, V]``."""
    _BH, T, _K = q.shape
    V = v.shape[2]
    s = scale[0]
    for bh in range(lo, hi):
        S = final[bh]
        S[:, :] = state[bh]
        pred = np.empty(V, q.dtype)
        for t in range(T):
            _step(S, q[bh, t], k[bh, t], v[bh, t], g[bh, t], beta[bh, t], s, out[bh, t], pred)


@_jit()
def recurrent_backward(q, k, v, g, beta, scale, state, do, dstate, dq, dk, dv, dg, dbeta, dinit, lo, hi):
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
                chk[t // stride] = S
            _step(S, q[bh, t], k[bh, t], v[bh, t], g[bh, t], beta[bh, t], s, o, pred)
        dS = dstate[bh].copy()
        Sd = np.empty((K, V), q.dtype)
        r = np.empty(V, q.dtype)
        du = np.empty(V, q.dtype)
        e = np.empty(K, q.dtype)
        for c0 in range(nchk - 1, -1, -1):
            start = c0 * stride
            stop = min(start + stride, T)
            seg[0] = chk[c0]
            for t in range(start, stop - 1):
                seg[t - start + 1] = seg[t - start]
                _step(seg[t - start + 1], q[bh, t], k[bh, t], v[bh, t], g[bh, t], beta[bh, t], s, o, pred)
            for t in range(stop - 1, start - 1, -1):
                P = seg[t - start]
                qt, kt, vt, gt, dot = q[bh, t], k[bh, t], v[bh, t], g[bh, t], do[bh, t]
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
                        r[c] -= kt[d] * x
                # dq = s (Sd + k u^T) do; dS += s q do^T
                for d in range(K):
                    acc = zero
                    for c in range(V):
                        acc += (Sd[d, c] + kt[d] * b * r[c]) * dot[c]
                    dq[bh, t, d] = s * acc
                    for c in range(V):
                        dS[d, c] += s * qt[d] * dot[c]
                # du = dS^T k; dk = dS u - Sd dr
                for c in range(V):
                    du[c] = 0.0
                for d in range(K):
                    for c in range(V):
                        du[c] += kt[d] * dS[d, c]
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
                        x = dS[d, c] - kt[d] * du[c]  # dSd
                        acc2 += x * Sd[d, c]
                        dS[d, c] = e[d] * x
                    dk[bh, t, d] = acc
                    dg[bh, t, d] = acc2
                for c in range(V):
                    dv[bh, t, c] = du[c]
        dinit[bh] = dS
