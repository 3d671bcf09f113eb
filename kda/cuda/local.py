"""The per-chunk kernels: the state-free work of every chunk and its gradient, one block per chunk.

Kernels (:func:`build`) and their launchers (:func:`chunk_local`, :func:`chunk_local_backward`).
Padded chunks longer than :data:`MAX_CHUNK` do not fit a block; the dispatch runs them on the
reference backend (:func:`kda._backend.resolve`).
"""

from __future__ import annotations

import math
from typing import Any

from array_api_compat import array_namespace
from numba import cuda

from .._backend import ChunkLocal
from ._device import Family, constants, offset_functions
from ._launch import _check_ndim, _check_shape, _dtype_name, _empty, launcher

__all__ = ["MAX_CHUNK", "chunk_local", "chunk_local_backward"]

# channels per tile of chunk_local's pairwise products (shared memory: 2 Cp rows of them, each
# padded to LOCAL_TILE_K + 1 elements so that lanes reading consecutive rows hit distinct banks)
LOCAL_TILE_K = 16
LOCAL_TILE_ROW = LOCAL_TILE_K + 1
# threads of chunk_local's block and of chunk_local_backward's (one block per chunk)
LOCAL_THREADS = 128
LOCAL_BACKWARD_THREADS = 64
# chunk_local_backward's products over V and K (phases 1 and 3) run by output tiles of
# BACKWARD_TILE_ROWS rows x BACKWARD_TILE_COLS columns (a warp's lanes across the columns, each
# thread BACKWARD_TILE_ROWS / 2 rows), the operands staged in shared memory BACKWARD_TILE_DEPTH
# terms at a time by coalesced loads, at row stride BACKWARD_TILE_DEPTH + 1 (conflict-free)
BACKWARD_TILE_ROWS = 16
BACKWARD_TILE_COLS = 32
BACKWARD_TILE_DEPTH = 16
# lanes per row of phase 4's per-row sums (dbeta)
BACKWARD_ROW_LANES = 16
_GROUPS = LOCAL_BACKWARD_THREADS // BACKWARD_TILE_COLS
if LOCAL_BACKWARD_THREADS % BACKWARD_TILE_COLS or BACKWARD_TILE_ROWS % _GROUPS:
    raise AssertionError("chunk_local_backward's tiles must divide its block")
# the longest padded chunk whose work fits chunk_local's and chunk_local_backward's blocks in
# SHARED_LIMIT, in float32 and float64 (float32 at 128 steps needs 49 KiB in chunk_local);
# longer chunks run on the array-API reference backend (kda._backend.resolve)
MAX_CHUNK = 64


def build(dtype: str, index: str = "uint32") -> dict:
    """The Python functions of the per-chunk kernels, specialised to ``dtype`` and ``index``."""
    _, nbtype, zero, one = constants(dtype)
    at2, at3, at4 = offset_functions(index)
    TI, TJ, TX = BACKWARD_TILE_ROWS, BACKWARD_TILE_COLS, BACKWARD_TILE_DEPTH
    TR = TX + 1  # a staged row's stride
    RS = LOCAL_BACKWARD_THREADS // TJ  # row groups of a tile (the warps of the block)
    RI = TI // RS  # rows of a tile per thread
    RL = BACKWARD_ROW_LANES

    def chunk_local(q, k, g, v, beta, scale, qg, kg, kt, total, A, L, Tinv, w, u0, dims):
        """One block per chunk ``n``: all of its state-free work, without any factor array.

        1. decay factors as running products of ``exp(g)`` (one thread per channel): ``qg``,
           ``kg``, ``kt`` and ``total``;
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
        tid = cuda.threadIdx.x
        nth = cuda.blockDim.x
        Cp, K, V = dims
        TK = LOCAL_TILE_K
        TR = LOCAL_TILE_ROW  # a tile row's stride in shared memory: lanes on consecutive rows
        # (the pair loop's j) then read distinct banks, not two (a 16-way conflict at stride 16)
        shared = cuda.shared.array(0, nbtype)
        bsh = shared[:Cp]
        tri = Cp * (Cp + 1) // 2
        T = shared[Cp : Cp + tri]  # T[i, j] at i (i + 1) / 2 + j
        work = shared[Cp + tri :]
        P = work[: Cp * TR]  # column sides (first halves) and q rows (second halves)
        Q = work[Cp * TR : 2 * Cp * TR]  # k rows (second halves)
        # 1. factors
        for d in range(tid, K, nth):
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
                kt[o] = k[o] * s
                s *= math.exp(g[o])
        # 2. pairs: the diagonal and the upper triangle, then each level
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
            for d0 in range(0, K, TK):
                for item in range(tid, nb * TK, nth):
                    start = (item // TK) * 2 * h
                    dd = item % TK
                    d = d0 + dd
                    mid = start + h
                    c = one
                    r = one
                    for m in range(h):
                        j = mid - 1 - m
                        i = mid + m
                        if d < K:
                            P[j * TR + dd] = k[at3(n, j, d, Cp, K)] * c
                            c *= math.exp(g[at3(n, j, d, Cp, K)])
                            r *= math.exp(g[at3(n, i, d, Cp, K)])
                            P[i * TR + dd] = q[at3(n, i, d, Cp, K)] * r
                            Q[i * TR + dd] = k[at3(n, i, d, Cp, K)] * r
                        else:
                            P[j * TR + dd] = zero
                            P[i * TR + dd] = zero
                            Q[i * TR + dd] = zero
                cuda.syncthreads()
                for pair in range(tid, nb * h * h, nth):
                    start = (pair // (h * h)) * 2 * h
                    i = start + h + (pair // h) % h
                    j = start + pair % h
                    sa = zero
                    sl = zero
                    for dd in range(TK):
                        c = P[j * TR + dd]
                        sa += P[i * TR + dd] * c
                        sl += Q[i * TR + dd] * c
                    if d0 == 0:
                        A[at3(n, i, j, Cp, Cp)] = scale * sa
                        L[at3(n, i, j, Cp, Cp)] = sl
                    else:
                        A[at3(n, i, j, Cp, Cp)] += scale * sa
                        L[at3(n, i, j, Cp, Cp)] += sl
                cuda.syncthreads()
            h *= 2
        # 3. the inverse, by blocks
        for i in range(tid, Cp, nth):
            bsh[i] = beta[at2(n, i, Cp)]
        for idx in range(tid, Cp * Cp, nth):
            i = idx // Cp
            j = idx % Cp
            if j <= i:
                T[i * (i + 1) // 2 + j] = one if j == i else zero
        cuda.syncthreads()
        tmp = work
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
        # 4. T itself (for the backward), W = T diag(beta) kg and U0 = T diag(beta) v
        for idx in range(tid, Cp * Cp, nth):
            i = idx // Cp
            j = idx % Cp
            Tinv[at3(n, i, j, Cp, Cp)] = T[i * (i + 1) // 2 + j] if j <= i else zero
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

    def chunk_local_backward(
        q,
        k,
        g,
        v,
        beta,
        scale,
        qg,
        kg,
        kt,
        total,
        L,
        Tinv,
        w,
        u0,
        S,
        dS,
        U,
        dU,
        do,
        dqg,
        dkt,
        dkw,
        dku,
        dA,
        dX,
        dtot,
        dq,
        dk,
        dv,
        dg,
        dbeta,
        dims,
    ):
        """One block per chunk: every gradient of its state-free work (see ``chunk_local``).

        Block ``n`` is chunk ``n % NT`` of head ``n // NT``; ``S`` and ``dS`` are the states at
        its start and the gradients at its end, ``[NT, BH, K, V]``. Phases, with a barrier
        between them (the intermediates ``dqg, dkt, dkw, dku, dA, dX, dtot`` go to the
        caller's scratch arrays, which stay in L2):

        1. ``dqg = dO S^T``, ``dkt = U dS^T``, ``dW = -dU S^T`` (in ``dg``), ``dtotal``,
           ``dA = tril(dO U^T)``;
        2. ``dkw = T^T dW``, ``dku = T^T dU``;
        3. ``dX = tril(-(dkw W^T + dku U0^T), -1)``;
        4. per row: ``dbeta``, then ``dL = beta dX`` in place; ``dv = beta dku``;
        5. per channel (one thread): the pairwise gradients level by level, the level's decay
           factors built as running products in this thread's column of shared memory
           (``Cp * blockDim.x`` elements); then the factor gradients, as in
           ``chunk_gate_gradient``, in two sweeps (suffix sums down, prefix sums up).
        """
        n = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nth = cuda.blockDim.x
        BH, NT, Cp, K, V = dims
        bh = n // NT
        c = n % NT
        F = cuda.shared.array(0, nbtype)
        # the tiles of phases 1 and 3 (at the front of F; phase 5 reuses it): rows of TX
        # elements padded to TR, so that lanes on consecutive rows read distinct banks
        lane = tid % TJ  # a row of the output tile's right side (channel d, or column j)
        grp = tid // TJ  # rows i0 + grp + RS m of the tile's left side, m < RI
        sa = F[: TI * TR]
        sb = F[TI * TR : 2 * TI * TR]
        sc = F[2 * TI * TR : 3 * TI * TR]
        sd = F[3 * TI * TR : 3 * TI * TR + TJ * TR]
        se = F[3 * TI * TR + TJ * TR : 3 * TI * TR + 2 * TJ * TR]
        acc_a = cuda.local.array(RI, nbtype)
        acc_b = cuda.local.array(RI, nbtype)
        acc_e = cuda.local.array(RI, nbtype)
        # 1. dqg = dO S^T, dkt = U dS^T, dW = -dU S^T (into dg) and dtotal, by output tiles of
        # TI rows x TJ channels: dO, U, dU [TI, TX] and S, dS [TJ, TX] staged by coalesced loads
        for i0 in range(0, Cp, TI):
            for d0 in range(0, K, TJ):
                for m in range(RI):
                    acc_a[m] = zero
                    acc_b[m] = zero
                    acc_e[m] = zero
                tacc = zero
                for x0 in range(0, V, TX):
                    cuda.syncthreads()  # the previous tiles are read
                    for e in range(tid, TI * TX, nth):
                        r = e // TX
                        cc = e % TX
                        i = i0 + r
                        x = x0 + cc
                        o = r * TR + cc
                        if i < Cp and x < V:
                            ix = at3(n, i, x, Cp, V)
                            sa[o] = do[ix]
                            sb[o] = U[ix]
                            sc[o] = dU[ix]
                        else:
                            sa[o] = zero
                            sb[o] = zero
                            sc[o] = zero
                    for e in range(tid, TJ * TX, nth):
                        r = e // TX
                        cc = e % TX
                        d = d0 + r
                        x = x0 + cc
                        o = r * TR + cc
                        if d < K and x < V:
                            dx = at4(c, bh, d, x, BH, K, V)
                            sd[o] = S[dx]
                            se[o] = dS[dx]
                        else:
                            sd[o] = zero
                            se[o] = zero
                    cuda.syncthreads()
                    for xx in range(TX):
                        s = sd[lane * TR + xx]
                        ds = se[lane * TR + xx]
                        tacc += s * ds
                        for m in range(RI):
                            o = (grp + RS * m) * TR + xx
                            acc_a[m] += sa[o] * s
                            acc_b[m] += sb[o] * ds
                            acc_e[m] += sc[o] * s
                d = d0 + lane
                if d < K:
                    for m in range(RI):
                        i = i0 + grp + RS * m
                        if i < Cp:
                            o = at3(n, i, d, Cp, K)
                            dqg[o] = acc_a[m]
                            dkt[o] = acc_b[m]
                            dg[o] = -acc_e[m]
                    if i0 == 0 and grp == 0:
                        dtot[at2(n, d, K)] = tacc
        # dA = tril(dO U^T): tiles of TI rows x TJ columns j <= i, dO [TI, TX] and U [TJ, TX] staged
        for idx in range(tid, Cp * Cp, nth):
            i = idx // Cp
            j = idx % Cp
            if j > i:
                dA[at3(n, i, j, Cp, Cp)] = zero
        for i0 in range(0, Cp, TI):
            for j0 in range(0, min(i0 + TI, Cp), TJ):
                for m in range(RI):
                    acc_a[m] = zero
                for x0 in range(0, V, TX):
                    cuda.syncthreads()
                    for e in range(tid, TI * TX, nth):
                        r = e // TX
                        cc = e % TX
                        i = i0 + r
                        x = x0 + cc
                        sa[r * TR + cc] = do[at3(n, i, x, Cp, V)] if i < Cp and x < V else zero
                    for e in range(tid, TJ * TX, nth):
                        r = e // TX
                        cc = e % TX
                        j = j0 + r
                        x = x0 + cc
                        sd[r * TR + cc] = U[at3(n, j, x, Cp, V)] if j < Cp and x < V else zero
                    cuda.syncthreads()
                    for xx in range(TX):
                        u = sd[lane * TR + xx]
                        for m in range(RI):
                            acc_a[m] += sa[(grp + RS * m) * TR + xx] * u
                j = j0 + lane
                for m in range(RI):
                    i = i0 + grp + RS * m
                    if i < Cp and j <= i:
                        dA[at3(n, i, j, Cp, Cp)] = acc_a[m]
        cuda.syncthreads()
        # 2.
        for idx in range(tid, Cp * K, nth):
            i = idx // K
            d = idx % K
            a = zero
            for m in range(i, Cp):
                a += Tinv[at3(n, m, i, Cp, Cp)] * dg[at3(n, m, d, Cp, K)]
            dkw[at3(n, i, d, Cp, K)] = a
        for idx in range(tid, Cp * V, nth):
            i = idx // V
            x = idx % V
            a = zero
            for m in range(i, Cp):
                a += Tinv[at3(n, m, i, Cp, Cp)] * dU[at3(n, m, x, Cp, V)]
            dku[at3(n, i, x, Cp, V)] = a
        # 3. dX = tril(-(dkw W^T + dku U0^T), -1): tiles of TI rows x TJ columns j < i, over the
        # channels (dkw [TI, TX] and W [TJ, TX] staged) and then the value columns (dku, U0)
        for idx in range(tid, Cp * Cp, nth):
            i = idx // Cp
            j = idx % Cp
            if j >= i:
                dX[at3(n, i, j, Cp, Cp)] = zero
        for i0 in range(0, Cp, TI):
            for j0 in range(0, min(i0 + TI, Cp), TJ):
                for m in range(RI):
                    acc_a[m] = zero
                for part in range(2):
                    D = K if part == 0 else V
                    for x0 in range(0, D, TX):
                        cuda.syncthreads()  # the previous tiles are read (phase 2 is written)
                        for e in range(tid, TI * TX, nth):
                            r = e // TX
                            cc = e % TX
                            i = i0 + r
                            x = x0 + cc
                            a = zero
                            if i < Cp and x < D:
                                a = dkw[at3(n, i, x, Cp, K)] if part == 0 else dku[at3(n, i, x, Cp, V)]
                            sa[r * TR + cc] = a
                        for e in range(tid, TJ * TX, nth):
                            r = e // TX
                            cc = e % TX
                            j = j0 + r
                            x = x0 + cc
                            a = zero
                            if j < Cp and x < D:
                                a = w[at3(n, j, x, Cp, K)] if part == 0 else u0[at3(n, j, x, Cp, V)]
                            sd[r * TR + cc] = a
                        cuda.syncthreads()
                        for xx in range(TX):
                            u = sd[lane * TR + xx]
                            for m in range(RI):
                                acc_a[m] += sa[(grp + RS * m) * TR + xx] * u
                j = j0 + lane
                for m in range(RI):
                    i = i0 + grp + RS * m
                    if i < Cp and j < i:
                        dX[at3(n, i, j, Cp, Cp)] = -acc_a[m]
        cuda.syncthreads()
        # 4. per row: dbeta (RL lanes of a row's group over j, d and x, partial sums in shared
        # memory at row stride RL + 1), then dL = beta dX in place; dv = beta dku
        red = F[: Cp * (RL + 1)]
        rl = tid % RL
        for i in range(tid // RL, Cp, nth // RL):
            bi = beta[at2(n, i, Cp)]
            a = zero
            for j in range(rl, i, RL):
                ij = at3(n, i, j, Cp, Cp)
                x = dX[ij]
                a += x * L[ij]
                dX[ij] = bi * x
            for d in range(rl, K, RL):
                o = at3(n, i, d, Cp, K)
                a += kg[o] * dkw[o]
            for x in range(rl, V, RL):
                ix = at3(n, i, x, Cp, V)
                a += v[ix] * dku[ix]
            red[i * (RL + 1) + rl] = a
        for idx in range(tid, Cp * V, nth):
            i = idx // V
            x = idx % V
            ix = at3(n, i, x, Cp, V)
            dv[ix] = beta[at2(n, i, Cp)] * dku[ix]
        cuda.syncthreads()
        for i in range(tid, Cp, nth):
            a = zero
            for p in range(RL):
                a += red[i * (RL + 1) + p]
            dbeta[at2(n, i, Cp)] = a
        cuda.syncthreads()  # red is read: phase 5 reuses F
        # 5. dL is in dX now
        for d in range(tid, K, nth):
            for i in range(Cp):
                a = scale * dA[at3(n, i, i, Cp, Cp)]
                o = at3(n, i, d, Cp, K)
                dq[o] = a * k[o]
                dk[o] = a * q[o]
                dg[o] = zero
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
                            acc_k += dX[ij] * cj
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
                            acc += (scale * dA[ij] * q[o] + dX[ij] * k[o]) * F[i * nth + tid]
                        fj = F[j * nth + tid]
                        o = at3(n, j, d, Cp, K)
                        dg[o] += run
                        run += k[o] * fj * acc
                        dk[o] += acc * fj
                h *= 2
            # the factor gradients: prefix and suffix terms, total
            tterm = total[at2(n, d, K)] * dtot[at2(n, d, K)]
            run = zero
            s = one
            for i in range(Cp - 1, -1, -1):
                o = at3(n, i, d, Cp, K)
                dkg = beta[at2(n, i, Cp)] * dkw[o]
                run += qg[o] * dqg[o] + kg[o] * dkg
                dg[o] += run + tterm
                dk[o] += s * dkt[o]
                s *= math.exp(g[o])
            run = zero
            p = one
            for i in range(Cp):
                o = at3(n, i, d, Cp, K)
                p *= math.exp(g[o])
                dg[o] += run
                run += kt[o] * dkt[o]
                dq[o] += scale * p * dqg[o]
                dk[o] += p * beta[at2(n, i, Cp)] * dkw[o]

    return {
        "chunk_local": chunk_local,
        "chunk_local_backward": chunk_local_backward,
    }


KERNELS = Family(
    "local",
    build,
    {
        "chunk_local": "aaaaasaaaaaaaaa:3",
        "chunk_local_backward": "aaaaasaaaaaaaaaaaaaaaaaaaaaaaaa:5",
    },
)


_launch = launcher(KERNELS)


def _local_shared(Cp: int, itemsize: int) -> int:
    """Bytes of dynamic shared memory of :func:`chunk_local`'s block."""
    return (Cp + Cp * (Cp + 1) // 2 + max(2 * Cp * LOCAL_TILE_ROW, Cp * Cp // 4)) * itemsize


def _local_backward_shared(Cp: int, itemsize: int) -> int:
    """Bytes of dynamic shared memory of :func:`chunk_local_backward`'s block: the largest of
    phase 5's factor columns, phases 1 and 3's staged tiles and phase 4's partial row sums."""
    rows = BACKWARD_TILE_DEPTH + 1
    tiles = (3 * BACKWARD_TILE_ROWS + 2 * BACKWARD_TILE_COLS) * rows
    return max(Cp * LOCAL_BACKWARD_THREADS, tiles, Cp * (BACKWARD_ROW_LANES + 1)) * itemsize


def chunk_local(q: Any, k: Any, g: Any, v: Any, beta: Any, scale: float) -> ChunkLocal:
    """The state-free work of every chunk in one kernel, one block per chunk (no factor array).

    ``q, k, g: [..., Cp, K]``, ``v: [..., Cp, V]``, ``beta: [..., Cp]``, ``Cp <= MAX_CHUNK``
    (longer chunks run on the reference backend: :func:`kda._backend.resolve`).
    """
    name = "chunk_local"
    xp = array_namespace(q, k, g, v, beta)
    dtype = _dtype_name(name, q, k, g, v, beta)
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
    qg, kg, kt, w = (_empty(xp, q, (N, Cp, K)) for _ in range(4))
    total = _empty(xp, q, (N, K))
    A, L, Tinv = (_empty(xp, q, (N, Cp, Cp)) for _ in range(3))
    u0 = _empty(xp, q, (N, Cp, V))
    args = (q, k, g, v, beta, q.dtype.type(scale), qg, kg, kt, total, A, L, Tinv, w, u0)
    _launch(name, dtype, N, LOCAL_THREADS, *args, shared=shared, dims=(Cp, K, V))
    return ChunkLocal(
        *(xp.reshape(x, q.shape) for x in (qg, kg, kt)),
        xp.reshape(total, (*lead, K)),
        *(xp.reshape(x, (*lead, Cp, Cp)) for x in (A, L, Tinv)),
        xp.reshape(w, q.shape),
        xp.reshape(u0, v.shape),
    )


def chunk_local_backward(
    q: Any, k: Any, g: Any, v: Any, beta: Any, scale: float, loc: ChunkLocal, boundaries: Any, dends: Any,
    u: Any, du: Any, grad_output: Any,
) -> tuple[Any, Any, Any, Any, Any]:  # fmt: skip
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
    fields = (loc.qg, loc.kg, loc.kt, loc.total, loc.L, loc.Tinv, loc.w, loc.u0)
    dtype = _dtype_name(name, q, k, g, v, beta, boundaries, dends, u, du, grad_output, *fields)
    shared = _local_backward_shared(Cp, q.dtype.itemsize)
    if Cp > MAX_CHUNK:
        msg = f"{name}: padded chunks of at most {MAX_CHUNK} steps fit a block; got {Cp}"
        raise ValueError(msg)
    N = B * H * NT
    dqg, dkt, dkw, dq, dk, dg = (_empty(xp, q, (N, Cp, K)) for _ in range(6))
    dku, dv = (_empty(xp, q, (N, Cp, V)) for _ in range(2))
    dA, dX = (_empty(xp, q, (N, Cp, Cp)) for _ in range(2))
    dtot = _empty(xp, q, (N, K))
    dbeta = _empty(xp, q, (N, Cp))
    args = (q, k, g, v, beta, q.dtype.type(scale), *fields, boundaries, dends, u, du, grad_output)
    scratch = (dqg, dkt, dkw, dku, dA, dX, dtot)
    outs = (dq, dk, dv, dg, dbeta)
    dims = (B * H, NT, Cp, K, V)
    _launch(name, dtype, N, LOCAL_BACKWARD_THREADS, *args, *scratch, *outs, shared=shared, dims=dims)
    return (
        *(xp.reshape(x, q.shape) for x in (dq, dk)),
        xp.reshape(dv, v.shape),
        xp.reshape(dg, q.shape),
        xp.reshape(dbeta, beta.shape),
    )
