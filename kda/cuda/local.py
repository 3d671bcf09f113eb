"""The per-chunk kernels: the state-free work of every chunk and its gradient, one block per chunk.

Kernels (one builder each, on shared device functions) and their launchers (:func:`chunk_local`,
:func:`chunk_local_backward`).
Padded chunks longer than :data:`MAX_CHUNK` do not fit a block; the dispatch runs them on the
reference backend (:func:`kda._backend.resolve`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from array_api_compat import array_namespace
from numba import cuda

from .._backend import ChunkLocal, LocalGradients
from ._device import SCALAR, Family, Kernel, constants, inline, offset_functions
from ._launch import _check_ndim, _check_shape, _common_dtype, _empty, launcher

__all__ = ["MAX_CHUNK", "chunk_local", "chunk_local_backward"]

# channels per tile of chunk_local's pairwise products (shared memory: 2 Cp rows of them, each
# padded to LOCAL_TILE_K + 1 elements so that lanes reading consecutive rows hit distinct banks)
LOCAL_TILE_K = 16
LOCAL_TILE_ROW = LOCAL_TILE_K + 1
# threads of chunk_local's block and of chunk_local_backward's (one block per chunk)
LOCAL_THREADS = 128
LOCAL_BACKWARD_THREADS = 64
# chunk_local_backward's products over V and K (phases 1 and 3) run by output tiles of TILE_ROWS
# rows x TILE_COLS columns (a warp's lanes across the columns, each thread TILE_ROWS / 2 rows), the
# operands staged in shared memory TILE_DEPTH terms at a time by coalesced loads, at row stride
# TILE_DEPTH + 1 (conflict-free)
TILE_ROWS = 16
TILE_COLS = 32
TILE_DEPTH = 16
# lanes per row of phase 4's per-row sums (dbeta)
ROW_LANES = 16
# a tile's rows in groups, one group per warp of the block, each thread ROWS_PER_THREAD of them
ROW_GROUPS = LOCAL_BACKWARD_THREADS // TILE_COLS
ROWS_PER_THREAD = TILE_ROWS // ROW_GROUPS
# a staged row's stride in shared memory, and the elements of a staged left operand tile (TILE_ROWS
# rows) and of a right one (TILE_COLS rows)
STAGED_STRIDE = TILE_DEPTH + 1
LEFT_TILE = TILE_ROWS * STAGED_STRIDE
RIGHT_TILE = TILE_COLS * STAGED_STRIDE
if LOCAL_BACKWARD_THREADS % TILE_COLS or TILE_ROWS % ROW_GROUPS:
    raise AssertionError("chunk_local_backward's tiles must divide its block")
# the longest padded chunk whose work fits chunk_local's and chunk_local_backward's blocks in
# SHARED_LIMIT, in float32 and float64 (float32 at 128 steps needs 49 KiB in chunk_local);
# longer chunks run on the array-API reference backend (kda._backend.resolve)
MAX_CHUNK = 64


@functools.cache
def _forward_factors(dtype: str, index: str) -> tuple:
    """``(factors, pairs)``: phases 1 and 2 of ``chunk_local``, as device functions."""
    _, _, zero, one = constants(dtype)
    at2, at3, _ = offset_functions(index)

    @inline
    def factors(q, k, g, scale, qg, kg, k_suffix, total, n, Cp, K):
        """Decay factors as running products of ``exp(g)``, one thread per channel."""
        for d in range(cuda.threadIdx.x, K, cuda.blockDim.x):
            p = one
            for i in range(Cp):
                o = at3(n, i, d, Cp, K)
                p *= math.exp(g[o])
                qg[o] = scale * q[o] * p
                kg[o] = k[o] * p
            total[at2(n, d, K)] = p
            s = one
            for i in range(Cp - 1, -1, -1):
                o = at3(n, i, d, Cp, K)
                k_suffix[o] = k[o] * s
                s *= math.exp(g[o])

    @inline
    def pairs(q, k, g, scale, A, L, P, Q, n, Cp, K):
        """``A`` and ``L``: the diagonal and the upper triangle, then level by level of the halving,
        by tiles of ``LOCAL_TILE_K`` channels staged in ``P`` and ``Q`` (rows ``LOCAL_TILE_ROW`` apart)."""
        tid = cuda.threadIdx.x
        nth = cuda.blockDim.x
        tile_k = LOCAL_TILE_K
        row_stride = LOCAL_TILE_ROW  # lanes on consecutive rows (the pair loop's j) read distinct banks
        for idx in range(tid, Cp * Cp, nth):
            i = idx // Cp
            j = idx % Cp
            if j >= i:
                a = zero
                if j == i:
                    for d in range(K):
                        a += q[at3(n, i, d, Cp, K)] * k[at3(n, i, d, Cp, K)]
                A[at3(n, i, j, Cp, Cp)] = scale * a
                L[at3(n, i, j, Cp, Cp)] = zero
        h = 1
        while h < Cp:
            nb = Cp // (2 * h)
            for d0 in range(0, K, tile_k):
                for item in range(tid, nb * tile_k, nth):
                    start = (item // tile_k) * 2 * h
                    dd = item % tile_k
                    d = d0 + dd
                    mid = start + h
                    c = one
                    r = one
                    for m in range(h):
                        j = mid - 1 - m
                        i = mid + m
                        if d < K:
                            P[j * row_stride + dd] = k[at3(n, j, d, Cp, K)] * c
                            c *= math.exp(g[at3(n, j, d, Cp, K)])
                            r *= math.exp(g[at3(n, i, d, Cp, K)])
                            P[i * row_stride + dd] = q[at3(n, i, d, Cp, K)] * r
                            Q[i * row_stride + dd] = k[at3(n, i, d, Cp, K)] * r
                        else:
                            P[j * row_stride + dd] = zero
                            P[i * row_stride + dd] = zero
                            Q[i * row_stride + dd] = zero
                cuda.syncthreads()
                for pair in range(tid, nb * h * h, nth):
                    start = (pair // (h * h)) * 2 * h
                    i = start + h + (pair // h) % h
                    j = start + pair % h
                    sa = zero
                    sl = zero
                    for dd in range(tile_k):
                        c = P[j * row_stride + dd]
                        sa += P[i * row_stride + dd] * c
                        sl += Q[i * row_stride + dd] * c
                    if d0 == 0:
                        A[at3(n, i, j, Cp, Cp)] = scale * sa
                        L[at3(n, i, j, Cp, Cp)] = sl
                    else:
                        A[at3(n, i, j, Cp, Cp)] += scale * sa
                        L[at3(n, i, j, Cp, Cp)] += sl
                cuda.syncthreads()
            h *= 2

    return factors, pairs


@functools.cache
def _forward_solve(dtype: str, index: str) -> tuple:
    """``(inverse, outputs)``: phases 3 and 4 of ``chunk_local``, as device functions."""
    _, _, zero, one = constants(dtype)
    at2, at3, _ = offset_functions(index)

    @inline
    def inverse(L, beta, bsh, T, tmp, n, Cp):
        """``T = (I + diag(beta) L)^-1`` into ``T`` (packed lower triangle, ``T[i, j]`` at
        ``i (i + 1) / 2 + j``) by blocks, ``T21 = -T22 (beta L21) T11`` level by level; ``beta``
        in ``bsh``."""
        tid = cuda.threadIdx.x
        nth = cuda.blockDim.x
        for i in range(tid, Cp, nth):
            bsh[i] = beta[at2(n, i, Cp)]
        for idx in range(tid, Cp * Cp, nth):
            i = idx // Cp
            j = idx % Cp
            if j <= i:
                T[i * (i + 1) // 2 + j] = one if j == i else zero
        cuda.syncthreads()
        h = 1
        while h < Cp:
            nb = Cp // (2 * h)
            for pair in range(tid, nb * h * h, nth):
                start = (pair // (h * h)) * 2 * h
                ii = (pair // h) % h
                jj = pair % h
                i = start + h + ii
                acc = zero
                for m in range(jj, h):
                    row = (start + m) * (start + m + 1) // 2
                    acc += L[at3(n, i, start + m, Cp, Cp)] * T[row + start + jj]
                tmp[pair] = bsh[i] * acc
            cuda.syncthreads()
            for pair in range(tid, nb * h * h, nth):
                b = pair // (h * h)
                start = b * 2 * h
                ii = (pair // h) % h
                jj = pair % h
                i = start + h + ii
                row = i * (i + 1) // 2
                acc = zero
                for m in range(ii + 1):
                    acc += T[row + start + h + m] * tmp[b * h * h + m * h + jj]
                T[row + start + jj] = -acc
            cuda.syncthreads()
            h *= 2

    @inline
    def outputs(T, bsh, kg, v, Minv, w, u0, n, Cp, K, V):
        """``T`` itself (for the backward), ``W = T diag(beta) kg`` and ``U0 = T diag(beta) v``."""
        tid = cuda.threadIdx.x
        nth = cuda.blockDim.x
        for idx in range(tid, Cp * Cp, nth):
            i = idx // Cp
            j = idx % Cp
            Minv[at3(n, i, j, Cp, Cp)] = T[i * (i + 1) // 2 + j] if j <= i else zero
        for idx in range(tid, Cp * K, nth):
            i = idx // K
            d = idx % K
            row = i * (i + 1) // 2
            acc = zero
            for m in range(i + 1):
                acc += T[row + m] * (bsh[m] * kg[at3(n, m, d, Cp, K)])
            w[at3(n, i, d, Cp, K)] = acc
        for idx in range(tid, Cp * V, nth):
            i = idx // V
            c = idx % V
            row = i * (i + 1) // 2
            acc = zero
            for m in range(i + 1):
                acc += T[row + m] * (bsh[m] * v[at3(n, m, c, Cp, V)])
            u0[at3(n, i, c, Cp, V)] = acc

    return inverse, outputs


def _chunk_local_kernel(dtype: str, index: str) -> Callable:
    """The Python function of ``chunk_local`` for ``dtype`` and ``index``."""
    _, nbtype, _, _ = constants(dtype)
    factors, pairs = _forward_factors(dtype, index)
    inverse, outputs = _forward_solve(dtype, index)

    def chunk_local(q, k, g, v, beta, scale, qg, kg, k_suffix, total, A, L, Minv, w, u0, dims):
        """One block per chunk ``n``: all of its state-free work, without any factor array.

        1. decay factors as running products of ``exp(g)`` (one thread per channel): ``qg``,
           ``kg``, ``k_suffix`` and ``total``;
        2. ``A`` and ``L`` level by level of the halving, by tiles of ``LOCAL_TILE_K`` channels:
           the tile's row factors (products over each block's second half up to the row) and
           column factors (over its first half after the column) are built in shared memory,
           then every pair of the level is a dot product over the tile, accumulated in ``A``
           and ``L`` (each pair belongs to one thread across the tiles);
        3. ``T = (I + diag(beta) L)^-1`` in shared memory (packed lower triangle) by blocks:
           ``T21 = -T22 (beta L21) T11`` level by level;
        4. ``T`` (written out for the backward), ``W = T diag(beta) kg`` and ``U0 = T diag(beta) v``.

        Dynamic shared memory: ``Cp + Cp (Cp + 1) / 2 + max(2 Cp (LOCAL_TILE_K + 1), Cp^2 / 4)``
        elements (the tiles' rows padded against bank conflicts).
        """
        n = cuda.blockIdx.x
        Cp, K, V = dims
        shared = cuda.shared.array(0, nbtype)
        bsh = shared[:Cp]
        tri = Cp * (Cp + 1) // 2
        T = shared[Cp : Cp + tri]
        work = shared[Cp + tri :]
        P = work[: Cp * LOCAL_TILE_ROW]  # column sides (first halves) and q rows (second halves)
        Q = work[Cp * LOCAL_TILE_ROW : 2 * Cp * LOCAL_TILE_ROW]  # k rows (second halves)
        factors(q, k, g, scale, qg, kg, k_suffix, total, n, Cp, K)
        pairs(q, k, g, scale, A, L, P, Q, n, Cp, K)
        inverse(L, beta, bsh, T, work, n, Cp)
        outputs(T, bsh, kg, v, Minv, w, u0, n, Cp, K, V)

    return chunk_local


@functools.cache
def _backward_tiles(dtype: str, index: str) -> tuple:
    """``(stage, tril_product)``: the staged tiles of ``chunk_local_backward``'s products."""
    _, nbtype, zero, _ = constants(dtype)
    _, at3, _ = offset_functions(index)

    @inline
    def stage(dst, src, base, r0, x0, tile_rows, rows, D):
        """Stage rows ``r0 ..`` (``tile_rows`` of them) and terms ``x0 .. x0 + TILE_DEPTH`` of
        ``src[base]``, a ``[., rows, D]`` array, into ``dst`` at row stride ``STAGED_STRIDE`` (zero
        outside ``rows`` and ``D``)."""
        for e in range(cuda.threadIdx.x, tile_rows * TILE_DEPTH, cuda.blockDim.x):
            r = e // TILE_DEPTH
            cc = e % TILE_DEPTH
            i = r0 + r
            x = x0 + cc
            dst[r * STAGED_STRIDE + cc] = src[at3(base, i, x, rows, D)] if i < rows and x < D else zero

    @inline
    def accumulate(acc, sa, sd, left, right, n, i0, j0, Cp, D):
        """``acc[m] += left[i] . right[j]`` over ``D`` terms for the thread's rows ``i`` and column
        ``j`` of the tile at ``(i0, j0)``; ``left, right: [., Cp, D]``, staged through ``sa, sd``."""
        lane = cuda.threadIdx.x % TILE_COLS
        grp = cuda.threadIdx.x // TILE_COLS
        for x0 in range(0, D, TILE_DEPTH):
            cuda.syncthreads()  # the previous tiles are read
            stage(sa, left, n, i0, x0, TILE_ROWS, Cp, D)
            stage(sd, right, n, j0, x0, TILE_COLS, Cp, D)
            cuda.syncthreads()
            for xx in range(TILE_DEPTH):
                u = sd[lane * STAGED_STRIDE + xx]
                for m in range(ROWS_PER_THREAD):
                    acc[m] += sa[(grp + ROW_GROUPS * m) * STAGED_STRIDE + xx] * u

    @inline
    def tril_product(dst, l1, r1, D1, l2, r2, D2, strict, n, Cp, F):
        """``dst = tril(l1 r1^T + l2 r2^T)`` by tiles of ``TILE_ROWS`` rows x ``TILE_COLS`` columns;
        with ``strict``, ``-tril(..., -1)``; ``F``: the block's shared memory (the staged tiles)."""
        tid = cuda.threadIdx.x
        lane = tid % TILE_COLS
        grp = tid // TILE_COLS
        sa = F[:LEFT_TILE]
        sd = F[3 * LEFT_TILE : 3 * LEFT_TILE + RIGHT_TILE]
        acc = cuda.local.array(ROWS_PER_THREAD, nbtype)
        for idx in range(tid, Cp * Cp, cuda.blockDim.x):
            i = idx // Cp
            j = idx % Cp
            if j > i or (strict and j == i):
                dst[at3(n, i, j, Cp, Cp)] = zero
        for i0 in range(0, Cp, TILE_ROWS):
            for j0 in range(0, min(i0 + TILE_ROWS, Cp), TILE_COLS):
                for m in range(ROWS_PER_THREAD):
                    acc[m] = zero
                accumulate(acc, sa, sd, l1, r1, n, i0, j0, Cp, D1)
                accumulate(acc, sa, sd, l2, r2, n, i0, j0, Cp, D2)
                j = j0 + lane
                for m in range(ROWS_PER_THREAD):
                    i = i0 + grp + ROW_GROUPS * m
                    if i < Cp and j < i:
                        dst[at3(n, i, j, Cp, Cp)] = -acc[m] if strict else acc[m]
                    elif i < Cp and j == i and not strict:
                        dst[at3(n, i, j, Cp, Cp)] = acc[m]
        cuda.syncthreads()

    return stage, tril_product


@functools.cache
def _backward_state_products(dtype: str, index: str) -> Callable:
    """Phase 1 of ``chunk_local_backward`` (the products with the states), a device function."""
    _, nbtype, zero, _ = constants(dtype)
    at2, at3, _ = offset_functions(index)
    stage, _ = _backward_tiles(dtype, index)

    @inline
    def state_products(do, U, dU, S, dS, dqg, dk_suffix, dg, dtot, n, sn, Cp, K, V, F):
        """``dqg = dO S^T``, ``dk_suffix = U dS^T``, ``dW = -dU S^T`` (into ``dg``) and ``dtotal``, by
        output tiles of ``TILE_ROWS`` rows x ``TILE_COLS`` channels: ``dO, U, dU [TILE_ROWS,
        TILE_DEPTH]`` and ``S, dS [TILE_COLS, TILE_DEPTH]`` (``S[sn], dS[sn]``: ``[K, V]``) staged
        by coalesced loads at row stride ``STAGED_STRIDE``."""
        tid = cuda.threadIdx.x
        lane = tid % TILE_COLS  # a row of the output tile's right side (channel d)
        grp = tid // TILE_COLS  # rows i0 + grp + ROW_GROUPS m of the tile's left side, m < ROWS_PER_THREAD
        sa = F[:LEFT_TILE]  # three left tiles, then two right ones
        sb = F[LEFT_TILE : 2 * LEFT_TILE]
        sc = F[2 * LEFT_TILE : 3 * LEFT_TILE]
        sd = F[3 * LEFT_TILE : 3 * LEFT_TILE + RIGHT_TILE]
        se = F[3 * LEFT_TILE + RIGHT_TILE : 3 * LEFT_TILE + 2 * RIGHT_TILE]
        acc_a = cuda.local.array(ROWS_PER_THREAD, nbtype)
        acc_b = cuda.local.array(ROWS_PER_THREAD, nbtype)
        acc_e = cuda.local.array(ROWS_PER_THREAD, nbtype)
        for i0 in range(0, Cp, TILE_ROWS):
            for d0 in range(0, K, TILE_COLS):
                for m in range(ROWS_PER_THREAD):
                    acc_a[m] = zero
                    acc_b[m] = zero
                    acc_e[m] = zero
                tacc = zero
                for x0 in range(0, V, TILE_DEPTH):
                    cuda.syncthreads()  # the previous tiles are read
                    stage(sa, do, n, i0, x0, TILE_ROWS, Cp, V)
                    stage(sb, U, n, i0, x0, TILE_ROWS, Cp, V)
                    stage(sc, dU, n, i0, x0, TILE_ROWS, Cp, V)
                    stage(sd, S, sn, d0, x0, TILE_COLS, K, V)
                    stage(se, dS, sn, d0, x0, TILE_COLS, K, V)
                    cuda.syncthreads()
                    for xx in range(TILE_DEPTH):
                        s = sd[lane * STAGED_STRIDE + xx]
                        ds = se[lane * STAGED_STRIDE + xx]
                        tacc += s * ds
                        for m in range(ROWS_PER_THREAD):
                            o = (grp + ROW_GROUPS * m) * STAGED_STRIDE + xx
                            acc_a[m] += sa[o] * s
                            acc_b[m] += sb[o] * ds
                            acc_e[m] += sc[o] * s
                d = d0 + lane
                if d < K:
                    for m in range(ROWS_PER_THREAD):
                        i = i0 + grp + ROW_GROUPS * m
                        if i < Cp:
                            o = at3(n, i, d, Cp, K)
                            dqg[o] = acc_a[m]
                            dk_suffix[o] = acc_b[m]
                            dg[o] = -acc_e[m]
                    if i0 == 0 and grp == 0:
                        dtot[at2(n, d, K)] = tacc

    return state_products


@functools.cache
def _backward_rows(dtype: str, index: str) -> tuple:
    """``(transposed, row_sums)``: phases 2 and 4 of ``chunk_local_backward``, device functions."""
    _, _, zero, _ = constants(dtype)
    at2, at3, _ = offset_functions(index)

    @inline
    def transposed(Minv, dW, dU, dkw, dku, n, Cp, K, V):
        """``dkw = T^T dW``, ``dku = T^T dU``."""
        tid = cuda.threadIdx.x
        nth = cuda.blockDim.x
        for idx in range(tid, Cp * K, nth):
            i = idx // K
            d = idx % K
            a = zero
            for m in range(i, Cp):
                a += Minv[at3(n, m, i, Cp, Cp)] * dW[at3(n, m, d, Cp, K)]
            dkw[at3(n, i, d, Cp, K)] = a
        for idx in range(tid, Cp * V, nth):
            i = idx // V
            x = idx % V
            a = zero
            for m in range(i, Cp):
                a += Minv[at3(n, m, i, Cp, Cp)] * dU[at3(n, m, x, Cp, V)]
            dku[at3(n, i, x, Cp, V)] = a

    @inline
    def row_sums(beta, L, kg, v, dX, dkw, dku, dv, dbeta, n, Cp, K, V, F):
        """Per row: ``dbeta`` (``ROW_LANES`` lanes of a row's group over ``j``, ``d`` and ``x``,
        partial sums in ``F`` at row stride ``ROW_LANES + 1``), then ``dL = beta dX`` in place;
        ``dv = beta dku``."""
        tid = cuda.threadIdx.x
        nth = cuda.blockDim.x
        red = F[: Cp * (ROW_LANES + 1)]
        rl = tid % ROW_LANES
        for i in range(tid // ROW_LANES, Cp, nth // ROW_LANES):
            bi = beta[at2(n, i, Cp)]
            a = zero
            for j in range(rl, i, ROW_LANES):
                ij = at3(n, i, j, Cp, Cp)
                x = dX[ij]
                a += x * L[ij]
                dX[ij] = bi * x
            for d in range(rl, K, ROW_LANES):
                o = at3(n, i, d, Cp, K)
                a += kg[o] * dkw[o]
            for x in range(rl, V, ROW_LANES):
                ix = at3(n, i, x, Cp, V)
                a += v[ix] * dku[ix]
            red[i * (ROW_LANES + 1) + rl] = a
        for idx in range(tid, Cp * V, nth):
            i = idx // V
            x = idx % V
            ix = at3(n, i, x, Cp, V)
            dv[ix] = beta[at2(n, i, Cp)] * dku[ix]
        cuda.syncthreads()
        for i in range(tid, Cp, nth):
            a = zero
            for p in range(ROW_LANES):
                a += red[i * (ROW_LANES + 1) + p]
            dbeta[at2(n, i, Cp)] = a
        cuda.syncthreads()  # red is read: phase 5 reuses F

    return transposed, row_sums


@functools.cache
def _backward_channels(dtype: str, index: str) -> tuple:
    """``(pair_gradients, factor_gradients)``: phase 5 of ``chunk_local_backward`` for one channel."""
    _, _, zero, one = constants(dtype)
    at2, at3, _ = offset_functions(index)

    @inline
    def pair_gradients(q, k, g, scale, dA, dL, dq, dk, dg, d, n, Cp, K, F):
        """The pairwise gradients of channel ``d`` level by level, the level's decay factors built
        as running products in this thread's column of ``F`` (``Cp * blockDim.x`` elements)."""
        tid = cuda.threadIdx.x
        nth = cuda.blockDim.x
        h = 1
        while h < Cp:
            for start in range(0, Cp, 2 * h):
                mid = start + h
                f = one
                r = one
                for m in range(h):
                    F[(mid - 1 - m) * nth + tid] = f
                    f *= math.exp(g[at3(n, mid - 1 - m, d, Cp, K)])
                    r *= math.exp(g[at3(n, mid + m, d, Cp, K)])
                    F[(mid + m) * nth + tid] = r
                run = zero
                for i in range(start + 2 * h - 1, mid - 1, -1):
                    fi = F[i * nth + tid]
                    acc_q = zero
                    acc_k = zero
                    for j in range(start, mid):
                        cj = k[at3(n, j, d, Cp, K)] * F[j * nth + tid] * fi
                        ij = at3(n, i, j, Cp, Cp)
                        acc_q += scale * dA[ij] * cj
                        acc_k += dL[ij] * cj
                    o = at3(n, i, d, Cp, K)
                    run += q[o] * acc_q + k[o] * acc_k
                    dg[o] += run
                    dq[o] += acc_q
                    dk[o] += acc_k
                run = zero
                for j in range(start, mid):
                    acc = zero
                    for i in range(mid, start + 2 * h):
                        ij = at3(n, i, j, Cp, Cp)
                        o = at3(n, i, d, Cp, K)
                        acc += (scale * dA[ij] * q[o] + dL[ij] * k[o]) * F[i * nth + tid]
                    fj = F[j * nth + tid]
                    o = at3(n, j, d, Cp, K)
                    dg[o] += run
                    run += k[o] * fj * acc
                    dk[o] += acc * fj
            h *= 2

    @inline
    def factor_gradients(
        g, beta, scale, qg, kg, k_suffix, total, dqg, dk_suffix, dkw, dtot, dq, dk, dg, d, n, Cp, K
    ):
        """The factor gradients of channel ``d`` (as ``chunk_gate_gradient``): suffix sums down,
        prefix sums up, and the total's term."""
        tterm = total[at2(n, d, K)] * dtot[at2(n, d, K)]
        run = zero
        s = one
        for i in range(Cp - 1, -1, -1):
            o = at3(n, i, d, Cp, K)
            dkg = beta[at2(n, i, Cp)] * dkw[o]
            run += qg[o] * dqg[o] + kg[o] * dkg
            dg[o] += run + tterm
            dk[o] += s * dk_suffix[o]
            s *= math.exp(g[o])
        run = zero
        p = one
        for i in range(Cp):
            o = at3(n, i, d, Cp, K)
            p *= math.exp(g[o])
            dg[o] += run
            run += k_suffix[o] * dk_suffix[o]
            dq[o] += scale * p * dqg[o]
            dk[o] += p * beta[at2(n, i, Cp)] * dkw[o]

    return pair_gradients, factor_gradients


def _chunk_local_backward_kernel(dtype: str, index: str) -> Callable:
    """The Python function of ``chunk_local_backward`` for ``dtype`` and ``index``."""
    _, nbtype, zero, _ = constants(dtype)
    at2, at3, _ = offset_functions(index)
    _, tril_product = _backward_tiles(dtype, index)
    state_products = _backward_state_products(dtype, index)
    transposed, row_sums = _backward_rows(dtype, index)
    pair_gradients, factor_gradients = _backward_channels(dtype, index)

    def chunk_local_backward(
        q, k, g, v, beta, scale, qg, kg, k_suffix, total, L, Minv, w, u0, S, dS, U, dU, do,
        dqg, dk_suffix, dkw, dku, dA, dX, dtot, dq, dk, dv, dg, dbeta, dims,
    ):  # fmt: skip
        """One block per chunk: every gradient of its state-free work (see ``chunk_local``).

        Block ``n`` is chunk ``n % NT`` of head ``n // NT``; ``S`` and ``dS`` are the states at
        its start and the gradients at its end, ``[NT, BH, K, V]``. Phases, with a barrier
        between them (the intermediates ``dqg, dk_suffix, dkw, dku, dA, dX, dtot`` go to the
        caller's scratch arrays, which stay in L2):

        1. ``dqg = dO S^T``, ``dk_suffix = U dS^T``, ``dW = -dU S^T`` (in ``dg``), ``dtotal``,
           ``dA = tril(dO U^T)``;
        2. ``dkw = T^T dW``, ``dku = T^T dU``;
        3. ``dX = tril(-(dkw W^T + dku U0^T), -1)``;
        4. per row: ``dbeta``, then ``dL = beta dX`` in place; ``dv = beta dku``;
        5. per channel (one thread): the pairwise gradients level by level, the level's decay
           factors built as running products in this thread's column of shared memory
           (``Cp * blockDim.x`` elements); then the factor gradients, as in
           ``chunk_gate_gradient``, in two sweeps (suffix sums down, prefix sums up).

        The products of phases 1 and 3 stage their operands at the front of the block's shared
        memory (phases 4 and 5 reuse it).
        """
        n = cuda.blockIdx.x
        BH, NT, Cp, K, V = dims
        F = cuda.shared.array(0, nbtype)
        sn = at2(n % NT, n // NT, BH)  # the chunk's [K, V] state in S and dS
        state_products(do, U, dU, S, dS, dqg, dk_suffix, dg, dtot, n, sn, Cp, K, V, F)
        tril_product(dA, do, U, V, do, U, 0, False, n, Cp, F)
        transposed(Minv, dg, dU, dkw, dku, n, Cp, K, V)
        tril_product(dX, dkw, w, K, dku, u0, V, True, n, Cp, F)
        row_sums(beta, L, kg, v, dX, dkw, dku, dv, dbeta, n, Cp, K, V, F)
        for d in range(cuda.threadIdx.x, K, cuda.blockDim.x):  # 5. dL is in dX now
            for i in range(Cp):
                a = scale * dA[at3(n, i, i, Cp, Cp)]
                o = at3(n, i, d, Cp, K)
                dq[o] = a * k[o]
                dk[o] = a * q[o]
                dg[o] = zero
            pair_gradients(q, k, g, scale, dA, dX, dq, dk, dg, d, n, Cp, K, F)
            factor_gradients(
                g, beta, scale, qg, kg, k_suffix, total, dqg, dk_suffix, dkw, dtot, dq, dk, dg, d, n, Cp, K
            )

    return chunk_local_backward


CHUNK_LOCAL = Kernel("chunk_local", _chunk_local_kernel, dims=3, types={"scale": SCALAR})
CHUNK_LOCAL_BACKWARD = Kernel(
    "chunk_local_backward", _chunk_local_backward_kernel, dims=5, types={"scale": SCALAR}
)
KERNELS = Family("local", (CHUNK_LOCAL, CHUNK_LOCAL_BACKWARD))
_launch = launcher(KERNELS)


def _local_shared(Cp: int, itemsize: int) -> int:
    """Bytes of dynamic shared memory of :func:`chunk_local`'s block."""
    return (Cp + Cp * (Cp + 1) // 2 + max(2 * Cp * LOCAL_TILE_ROW, Cp * Cp // 4)) * itemsize


def _local_backward_shared(Cp: int, itemsize: int) -> int:
    """Bytes of dynamic shared memory of :func:`chunk_local_backward`'s block: the largest of
    phase 5's factor columns, phases 1 and 3's staged tiles and phase 4's partial row sums."""
    tiles = 3 * LEFT_TILE + 2 * RIGHT_TILE
    return max(Cp * LOCAL_BACKWARD_THREADS, tiles, Cp * (ROW_LANES + 1)) * itemsize


def chunk_local(q: Any, k: Any, v: Any, g: Any, beta: Any, *, scale: float) -> ChunkLocal:
    """The state-free work of every chunk in one kernel, one block per chunk (no factor array).

    ``q, k, g: [..., Cp, K]``, ``v: [..., Cp, V]``, ``beta: [..., Cp]``, ``Cp <= MAX_CHUNK``
    (longer chunks run on the reference backend: :func:`kda._backend.resolve`).
    """
    name = "chunk_local"
    xp = array_namespace(q, k, g, v, beta)
    dtype = _common_dtype(name, q, k, g, v, beta)
    _check_ndim(name, "q", q, 5)
    *lead, Cp, K = q.shape
    V = v.shape[-1]
    _check_shape(name, "k", k, q.shape)
    _check_shape(name, "g", g, q.shape)
    _check_shape(name, "v", v, (*lead, Cp, V))
    _check_shape(name, "beta", beta, (*lead, Cp))
    if Cp & (Cp - 1):
        msg = f"{name}: the padded chunk size must be a power of two; got {Cp}"
        raise ValueError(msg)
    shared = _local_shared(Cp, q.dtype.itemsize)
    if Cp > MAX_CHUNK:
        msg = f"{name}: padded chunks of at most {MAX_CHUNK} steps fit a block; got {Cp}"
        raise ValueError(msg)
    N = math.prod(lead)
    qg, kg, k_suffix, w = (_empty(xp, q, (N, Cp, K)) for _ in range(4))
    total = _empty(xp, q, (N, K))
    A, L, Minv = (_empty(xp, q, (N, Cp, Cp)) for _ in range(3))
    u0 = _empty(xp, q, (N, Cp, V))
    args = (q, k, g, v, beta, q.dtype.type(scale), qg, kg, k_suffix, total, A, L, Minv, w, u0)
    _launch(CHUNK_LOCAL, dtype, N, LOCAL_THREADS, *args, shared=shared, dims=(Cp, K, V))
    pairs = (*lead, Cp, Cp)
    return ChunkLocal(
        qg=xp.reshape(qg, q.shape),
        kg=xp.reshape(kg, q.shape),
        k_suffix=xp.reshape(k_suffix, q.shape),
        total=xp.reshape(total, (*lead, K)),
        A=xp.reshape(A, pairs),
        L=xp.reshape(L, pairs),
        Minv=xp.reshape(Minv, pairs),
        w=xp.reshape(w, q.shape),
        u0=xp.reshape(u0, v.shape),
    )


def chunk_local_backward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    boundaries: Any,
    *,
    scale: float,
    local: ChunkLocal,
    dends: Any,
    u: Any,
    du: Any,
    grad_output: Any,
) -> LocalGradients:
    """Gradients of every chunk's state-free work in one kernel, one block per chunk.

    Returns ``dq, dk, dv, dg, dbeta`` (see :mod:`kda._backend`); ``Cp <= MAX_CHUNK``.
    """
    name = "chunk_local_backward"
    xp = array_namespace(q, k, g, v, beta, boundaries, dends, u, du, grad_output)
    _check_ndim(name, "q", q, 5)
    B, H, NT, Cp, K = q.shape
    V = v.shape[-1]
    for arg, x, shape in (
        ("k", k, q.shape),
        ("g", g, q.shape),
        ("v", v, (B, H, NT, Cp, V)),
        ("beta", beta, (B, H, NT, Cp)),
        ("boundaries", boundaries, (NT, B, H, K, V)),
        ("dends", dends, (NT, B, H, K, V)),
        ("u", u, v.shape),
        ("du", du, v.shape),
        ("grad_output", grad_output, v.shape),
    ):
        _check_shape(name, arg, x, shape)
    fields = (local.qg, local.kg, local.k_suffix, local.total, local.L, local.Minv, local.w, local.u0)
    dtype = _common_dtype(name, q, k, g, v, beta, boundaries, dends, u, du, grad_output, *fields)
    shared = _local_backward_shared(Cp, q.dtype.itemsize)
    if Cp > MAX_CHUNK:
        msg = f"{name}: padded chunks of at most {MAX_CHUNK} steps fit a block; got {Cp}"
        raise ValueError(msg)
    N = B * H * NT
    dqg, dk_suffix, dkw, dq, dk, dg = (_empty(xp, q, (N, Cp, K)) for _ in range(6))
    dku, dv = (_empty(xp, q, (N, Cp, V)) for _ in range(2))
    dA, dX = (_empty(xp, q, (N, Cp, Cp)) for _ in range(2))
    dtot = _empty(xp, q, (N, K))
    dbeta = _empty(xp, q, (N, Cp))
    args = (q, k, g, v, beta, q.dtype.type(scale), *fields, boundaries, dends, u, du, grad_output)
    scratch = (dqg, dk_suffix, dkw, dku, dA, dX, dtot)
    outs = (dq, dk, dv, dg, dbeta)
    dims = (B * H, NT, Cp, K, V)
    _launch(
        CHUNK_LOCAL_BACKWARD,
        dtype,
        N,
        LOCAL_BACKWARD_THREADS,
        *args,
        *scratch,
        *outs,
        shared=shared,
        dims=dims,
    )
    return LocalGradients(
        dq=xp.reshape(dq, q.shape),
        dk=xp.reshape(dk, q.shape),
        dv=xp.reshape(dv, v.shape),
        dg=xp.reshape(dg, q.shape),
        dbeta=xp.reshape(dbeta, beta.shape),
    )
