"""The state passes: the sequential recurrence over chunks (output fused in) and its gradient.

Two cuts of each pass, because each serves chunks the other cannot: the "staged" cut (the chunk's
rows on the lanes; ``w``, ``qg``, ``k_suffix``, ``A`` staged in shared memory) holds padded chunks of at
most 128 steps whose tiles fit :data:`SHARED_LIMIT`; the "broadcast" cut (value columns on the
lanes, tiles read through L1) serves the rest (float64 at ``K = 128``, ``Cp = 64``, for one).
:data:`STATE_PASS` picks the cut where both fit. Kernels (one builder each, on shared device
functions) and their launchers
(:func:`chunk_state_pass`, :func:`chunk_state_grad_pass`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from array_api_compat import array_namespace
from numba import cuda

from .._backend import StateGradPass, StatePass
from ._device import INT32, Family, Kernel, constants, inline, offset_functions
from ._launch import (
    SHARED_LIMIT,
    _check_ndim,
    _check_shape,
    _common_dtype,
    _empty,
    _zeros,
    launcher,
)

__all__ = ["STATE_PASS", "chunk_state_grad_pass", "chunk_state_pass"]

# rows of the state passes that one thread accumulates at once (registers)
ROW_GROUP = 4
# chunk_state_pass_staged: value columns per block, columns per thread, channels per staged slice
STAGED_TILE_V = 16
STAGED_COLUMNS = 8
STAGED_SLICE = 16
# the broadcast passes: blocks of STATE_THREADS threads, STATE_TILE_V value columns (threads x) by
# STATE_THREADS / STATE_TILE_V row threads (y); B * H * V / 16 blocks (128 at B=1, H=16, V=128).
# The same block shape runs under the simulator (the tests exercise the real layout).
STATE_TILE_V = 16
STATE_THREADS = 256
# "staged" or "broadcast" where both cuts fit: staged by the PTX's instruction counts
# (docs/gpu.md); not measured on a GPU yet: scripts/gpu_bench.py times both
STATE_PASS = "staged"


@functools.cache
def _staging(dtype: str, index: str) -> tuple:
    """``(tile_in, tile_out, slice_transposed, pair_begin, pair_end)``: the staged passes' tiles."""
    _, _, zero, _ = constants(dtype)
    at2, at3, _ = offset_functions(index)

    @inline
    def tile_in(dst, src, base, rows, pad, v0, V):
        """Stage the block's ``[rows, STAGED_TILE_V]`` tile (columns ``v0..``, zero past ``V``) of
        ``src[base]``, a ``[., rows, V]`` array, into ``dst`` with rows ``STAGED_TILE_V + pad`` apart."""
        TV = STAGED_TILE_V
        for e in range(cuda.threadIdx.x, rows * TV, cuda.blockDim.x):
            r = e // TV
            c = e % TV
            dst[at2(r, c, TV + pad)] = src[at3(base, r, v0 + c, rows, V)] if v0 + c < V else zero

    @inline
    def tile_out(dst, src, base, rows, pad, v0, V):
        """The inverse of ``tile_in``: write the tile back to ``dst[base]`` (columns below ``V``)."""
        TV = STAGED_TILE_V
        for e in range(cuda.threadIdx.x, rows * TV, cuda.blockDim.x):
            r = e // TV
            c = e % TV
            if v0 + c < V:
                dst[at3(base, r, v0 + c, rows, V)] = src[at2(r, c, TV + pad)]

    @inline
    def slice_transposed(dst, src, base, k0, rows, width):
        """Stage columns ``k0 .. k0 + STAGED_SLICE`` (zero past ``width``) of ``src[base]``, a
        ``[., rows, width]`` array, transposed: ``dst[k * (rows + 1) + r]`` (padded rows: no bank
        conflicts when consecutive lanes read consecutive rows)."""
        KS = STAGED_SLICE
        for e in range(cuda.threadIdx.x, KS * rows, cuda.blockDim.x):
            r = e // KS
            dk = e % KS
            inside = k0 + dk < width
            dst[at2(dk, r, rows + 1)] = src[at3(base, r, k0 + dk, rows, width)] if inside else zero

    @inline
    def pair_begin(e, K, chunk, total, tile, acc, acc2):
        """Start work item ``e`` of a staged state update: channels ``kk`` and ``k2 = kk +
        ceil(K / 2)`` (``two``: whether ``k2 < K``), columns ``g0 ..`` of the ``[K, TV]`` tile;
        ``acc, acc2 = total * tile`` rows ``kk, k2``. Returns ``(kk, k2, two, row, row2, g0)``."""
        KP = (K + 1) // 2
        kk = e % KP
        k2 = kk + KP
        two = k2 < K
        g0 = (e // KP) * STAGED_COLUMNS
        row = at2(kk, g0, STAGED_TILE_V)
        row2 = at2(k2 if two else kk, g0, STAGED_TILE_V)
        t1 = total[at2(chunk, kk, K)]
        t2 = total[at2(chunk, k2, K)] if two else zero
        for cc in range(STAGED_COLUMNS):
            acc[cc] = t1 * tile[at2(row, cc, 1)]
            acc2[cc] = t2 * tile[at2(row2, cc, 1)]
        return kk, k2, two, row, row2, g0

    @inline
    def pair_end(tile, row, row2, two, acc, acc2):
        """Write work item's accumulators back to its rows of the tile (see ``pair_begin``)."""
        for cc in range(STAGED_COLUMNS):
            tile[at2(row, cc, 1)] = acc[cc]
            if two:
                tile[at2(row2, cc, 1)] = acc2[cc]

    return tile_in, tile_out, slice_transposed, pair_begin, pair_end


@functools.cache
def _staged_steps(dtype: str, index: str) -> tuple:
    """``(staged_output, staged_update)``: steps 2 and 3 of ``chunk_state_pass_staged``."""
    _, _, zero, _ = constants(dtype)
    at2, at3, _ = offset_functions(index)
    _, _, slice_transposed, pair_begin, pair_end = _staging(dtype, index)

    @inline
    def staged_output(A, Wt, Us, Os, chunk, Cp, accp):
        """``O = qg S + A U`` (``qg S`` in ``accp``) for the thread's row and columns into ``Os``:
        the lower triangle of ``A`` staged transposed into ``Wt`` by slices of rows ``j``."""
        TV = STAGED_TILE_V
        CC = STAGED_COLUMNS
        KS = STAGED_SLICE
        i = cuda.threadIdx.x % Cp
        c0 = (cuda.threadIdx.x // Cp) * CC
        for j0 in range(0, Cp, KS):
            slice_transposed(Wt, A, chunk, j0, Cp, Cp)
            cuda.syncthreads()
            for dj in range(min(KS, i + 1 - j0)):
                a = Wt[at2(dj, i, Cp + 1)]
                urow = at2(j0 + dj, c0, TV + 1)
                for cc in range(CC):
                    accp[cc] += a * Us[at2(urow, cc, 1)]
            cuda.syncthreads()
        for cc in range(CC):
            Os[at2(i, c0 + cc, TV + 1)] = accp[cc]

    @inline
    def staged_update(S, Us, k_suffix, total, chunk, Cp, K, accu, accp):
        """``S' = total S + k_suffix^T U`` in ``S`` with the channels on the lanes, two per thread
        (channels ``kk`` and ``kk + KP`` share every broadcast ``U`` load)."""
        TV = STAGED_TILE_V
        CC = STAGED_COLUMNS
        t = cuda.threadIdx.x
        nth = cuda.blockDim.x
        for e in range(t, (K + 1) // 2 * (TV // CC), nth):
            kk, k2, two, row, row2, g0 = pair_begin(e, K, chunk, total, S, accu, accp)
            for r in range(Cp):
                a = k_suffix[at3(chunk, r, kk, Cp, K)]
                b = k_suffix[at3(chunk, r, k2, Cp, K)] if two else zero
                urow = at2(r, g0, TV + 1)
                for cc in range(CC):
                    x = Us[at2(urow, cc, 1)]
                    accu[cc] += a * x
                    accp[cc] += b * x
            pair_end(S, row, row2, two, accu, accp)

    return staged_output, staged_update


@functools.cache
def _grad_staged_steps(dtype: str, index: str) -> tuple:
    """``(staged_u_du, staged_grad_update)``: steps 2 and 3 of ``chunk_state_grad_pass_staged``."""
    _, _, zero, _ = constants(dtype)
    at2, at3, _ = offset_functions(index)
    _, _, slice_transposed, pair_begin, pair_end = _staging(dtype, index)

    @inline
    def staged_u_du(A, w, k_suffix, S, dS, dOs, Us, Wt, Kt, chunk, Cp, K, accu, accd):
        """``U = u0 - w S`` (``u0`` in ``Us``) into ``accu`` and ``dU = A^T dO + k_suffix dS`` into
        ``accd`` for the thread's row and columns: ``w`` and ``k_suffix`` staged transposed into ``Wt``
        and ``Kt`` by slices of channels; ``A[j, i]`` for consecutive rows read coalesced."""
        TV = STAGED_TILE_V
        CC = STAGED_COLUMNS
        KS = STAGED_SLICE
        i = cuda.threadIdx.x % Cp
        c0 = (cuda.threadIdx.x // Cp) * CC
        for cc in range(CC):
            accu[cc] = Us[at2(i, c0 + cc, TV + 1)]
            accd[cc] = zero
        for j in range(i, Cp):
            a = A[at3(chunk, j, i, Cp, Cp)]
            orow = at2(j, c0, TV + 1)
            for cc in range(CC):
                accd[cc] += a * dOs[at2(orow, cc, 1)]
        for k0 in range(0, K, KS):
            slice_transposed(Wt, w, chunk, k0, Cp, K)
            slice_transposed(Kt, k_suffix, chunk, k0, Cp, K)
            cuda.syncthreads()
            for dk in range(min(KS, K - k0)):
                wi = at2(dk, i, Cp + 1)
                a = -Wt[wi]
                b = Kt[wi]
                srow = at2(k0 + dk, c0, TV)
                for cc in range(CC):
                    accu[cc] = cuda.fma(a, S[at2(srow, cc, 1)], accu[cc])  # LLVM would unfuse -=
                    accd[cc] += b * dS[at2(srow, cc, 1)]
            cuda.syncthreads()

    @inline
    def staged_grad_update(dS, dOs, dUs, qg, w, total, chunk, Cp, K, accu, accd):
        """``dS_start = total dS + qg^T dO - w^T dU`` in ``dS``, the channels on the lanes, two per
        thread (channels ``kk`` and ``kk + KP`` share every broadcast ``dO`` and ``dU`` load)."""
        TV = STAGED_TILE_V
        CC = STAGED_COLUMNS
        t = cuda.threadIdx.x
        nth = cuda.blockDim.x
        for e in range(t, (K + 1) // 2 * (TV // CC), nth):
            kk, k2, two, row, row2, g0 = pair_begin(e, K, chunk, total, dS, accu, accd)
            for r in range(Cp):
                rk = at3(chunk, r, kk, Cp, K)
                a = qg[rk]
                b = -w[rk]
                a2 = zero
                b2 = zero
                if two:
                    rk2 = at3(chunk, r, k2, Cp, K)
                    a2 = qg[rk2]
                    b2 = -w[rk2]
                urow = at2(r, g0, TV + 1)
                for cc in range(CC):
                    x = dOs[at2(urow, cc, 1)]
                    y = dUs[at2(urow, cc, 1)]
                    accu[cc] = cuda.fma(b, y, accu[cc] + a * x)  # LLVM would unfuse -=
                    accd[cc] = cuda.fma(b2, y, accd[cc] + a2 * x)
            pair_end(dS, row, row2, two, accu, accd)

    return staged_u_du, staged_grad_update


def _state_pass_kernel(dtype: str, index: str) -> Callable:
    """The Python function of ``chunk_state_pass`` for ``dtype`` and ``index``."""
    _, nbtype, zero, _ = constants(dtype)
    at2, at3, at4 = offset_functions(index)

    def chunk_state_pass(qg, A, w, u0, k_suffix, total, state, emit, out, boundaries, final, dims):
        """One block per (head, tile of ``blockDim.x`` value columns), looping over every chunk.

        ``dims = (BH, NT, Cp, K, V)``; the arrays are flattened ``[BH, NT, Cp, K]`` (``qg, w,
        k_suffix``), ``[BH, NT, Cp, Cp]`` (``A``), ``[BH, NT, Cp, V]`` (``u0, out``), ``[BH, NT, K]``
        (``total``), ``[BH, K, V]`` (``state, final``) and ``[NT, BH, K, V]`` (``boundaries``).
        The block keeps its ``[K, TV]`` tile of the state in shared memory for the whole
        sequence (``TV = blockDim.x``). Per chunk, thread ``(x, y)`` owns value column ``x`` of
        the tile and rows ``y, y + blockDim.y, ...``:

        1. ``U = u0 - w S`` and, when ``emit``, the partial output ``qg S`` (one pass over ``K``:
           each ``S[k, x]`` read from shared memory serves ``ROW_GROUP`` rows of both);
        2. after a barrier, ``O = qg S + A U`` (written to ``out``) and ``S' = total S + k_suffix^T U``.

        ``w``, ``qg``, ``k_suffix`` and ``A`` are read by all lanes of a row at once (one broadcast
        load). Dynamic shared memory: ``(K + 2 Cp) * blockDim.x`` elements.
        """
        BH, NT, Cp, K, V = dims
        TV = cuda.blockDim.x
        tiles = (V + TV - 1) // TV
        bh = cuda.blockIdx.x // tiles
        tx = cuda.threadIdx.x
        v = (cuda.blockIdx.x % tiles) * TV + tx
        ty = cuda.threadIdx.y
        ny = cuda.blockDim.y
        active = v < V
        shared = cuda.shared.array(0, nbtype)
        S = shared[: K * TV]  # S[k * TV + tx]
        Us = shared[K * TV : (K + Cp) * TV]  # U[i * TV + tx]
        Os = shared[(K + Cp) * TV : (K + 2 * Cp) * TV]  # qg S, then O
        acc = cuda.local.array(ROW_GROUP, nbtype)
        acco = cuda.local.array(ROW_GROUP, nbtype)
        for kk in range(ty, K, ny):
            S[at2(kk, tx, TV)] = state[at3(bh, kk, v, K, V)] if active else zero
        cuda.syncthreads()
        for n in range(NT):
            chunk = at2(bh, n, NT)
            for i0 in range(ty, Cp, ny * ROW_GROUP):
                for r in range(ROW_GROUP):
                    i = i0 + r * ny
                    acc[r] = u0[at3(chunk, i, v, Cp, V)] if i < Cp and active else zero
                    acco[r] = zero
                for kk in range(K):
                    s = S[at2(kk, tx, TV)]
                    for r in range(ROW_GROUP):
                        i = i0 + r * ny
                        if i < Cp:
                            ik = at3(chunk, i, kk, Cp, K)
                            acc[r] = cuda.fma(-w[ik], s, acc[r])  # a -= b c is not fused
                            if emit:
                                acco[r] += qg[ik] * s
                for r in range(ROW_GROUP):
                    i = i0 + r * ny
                    if i < Cp:
                        Us[at2(i, tx, TV)] = acc[r]
                        Os[at2(i, tx, TV)] = acco[r]
            if active:
                for kk in range(ty, K, ny):
                    boundaries[at4(n, bh, kk, v, BH, K, V)] = S[at2(kk, tx, TV)]
            cuda.syncthreads()
            if emit:
                for i in range(ty, Cp, ny):
                    o = Os[at2(i, tx, TV)]
                    for j in range(i + 1):
                        o += A[at3(chunk, i, j, Cp, Cp)] * Us[at2(j, tx, TV)]
                    if active:
                        out[at3(chunk, i, v, Cp, V)] = o
            for kk in range(ty, K, ny):
                s = total[at2(chunk, kk, K)] * S[at2(kk, tx, TV)]
                for i in range(Cp):
                    s += k_suffix[at3(chunk, i, kk, Cp, K)] * Us[at2(i, tx, TV)]
                S[at2(kk, tx, TV)] = s
            cuda.syncthreads()
        if active:
            for kk in range(ty, K, ny):
                final[at3(bh, kk, v, K, V)] = S[at2(kk, tx, TV)]

    return chunk_state_pass


def _state_pass_staged_kernel(dtype: str, index: str) -> Callable:
    """The Python function of ``chunk_state_pass_staged`` for ``dtype`` and ``index``."""
    _, nbtype, zero, _ = constants(dtype)
    at2, _, _ = offset_functions(index)
    tile_in, tile_out, slice_transposed, _, _ = _staging(dtype, index)
    staged_output, staged_update = _staged_steps(dtype, index)

    def chunk_state_pass_staged(qg, A, w, u0, k_suffix, total, state, emit, out, boundaries, final, dims):
        """``chunk_state_pass`` re-cut with the chunk's rows on the lanes (docs/gpu.md, "What is open").

        Same arguments and layouts. One block of ``2 * Cp`` threads per (head, tile
        of ``STAGED_TILE_V`` value columns); thread ``t`` owns row ``i = t % Cp`` and the
        ``STAGED_COLUMNS`` columns of group ``t // Cp``. Per chunk:

        1. ``U = u0 - w S`` and ``qg S``: ``w`` and ``qg`` are staged into shared memory
           transposed, ``STAGED_SLICE`` channels at a time, so that per channel a warp reads
           consecutive rows (one wavefront) and broadcasts ``S[k, c..]``;
        2. ``O = qg S + A U``, with ``A`` staged transposed the same way;
        3. ``S' = total S + k_suffix^T U`` with the channels on the lanes (``k_suffix`` read coalesced).

        ``u0`` and ``O`` go through shared memory so that their global accesses are coalesced.
        Dynamic shared memory: ``K TV + 2 Cp (TV + 1) + 2 SLICE (Cp + 1)`` elements.
        """
        BH, NT, Cp, K, V = dims
        TV = STAGED_TILE_V
        CC = STAGED_COLUMNS
        KS = STAGED_SLICE
        tiles = (V + TV - 1) // TV
        bh = cuda.blockIdx.x // tiles
        v0 = (cuda.blockIdx.x % tiles) * TV
        t = cuda.threadIdx.x
        i = t % Cp  # this thread's row (steps 1 and 2)
        c0 = (t // Cp) * CC  # and its first column in the tile
        shared = cuda.shared.array(0, nbtype)
        S = shared[: K * TV]  # S[k * TV + c]
        Us = shared[K * TV : K * TV + Cp * (TV + 1)]  # u0, then U: [i * (TV + 1) + c]
        Os = shared[K * TV + Cp * (TV + 1) : K * TV + 2 * Cp * (TV + 1)]  # O: [i * (TV + 1) + c]
        base = K * TV + 2 * Cp * (TV + 1)
        Wt = shared[base : base + KS * (Cp + 1)]  # w (then A) slices: [k * (Cp + 1) + i]
        Qt = shared[base + KS * (Cp + 1) : base + 2 * KS * (Cp + 1)]  # qg slices
        accu = cuda.local.array(STAGED_COLUMNS, nbtype)
        accp = cuda.local.array(STAGED_COLUMNS, nbtype)
        tile_in(S, state, bh, K, 0, v0, V)
        cuda.syncthreads()
        for n in range(NT):
            chunk = at2(bh, n, NT)
            tile_out(boundaries, S, at2(n, bh, BH), K, 0, v0, V)
            tile_in(Us, u0, chunk, Cp, 1, v0, V)
            for cc in range(CC):
                accp[cc] = zero
            # 1. U = u0 - w S and qg S, by slices of KS channels
            for k0 in range(0, K, KS):
                slice_transposed(Wt, w, chunk, k0, Cp, K)
                if emit:
                    slice_transposed(Qt, qg, chunk, k0, Cp, K)
                cuda.syncthreads()
                if k0 == 0:
                    for cc in range(CC):
                        accu[cc] = Us[at2(i, c0 + cc, TV + 1)]
                for dk in range(min(KS, K - k0)):
                    wi = at2(dk, i, Cp + 1)
                    a = -Wt[wi]
                    srow = at2(k0 + dk, c0, TV)
                    if emit:
                        b = Qt[wi]
                        for cc in range(CC):
                            x = S[at2(srow, cc, 1)]
                            accu[cc] = cuda.fma(a, x, accu[cc])  # LLVM would unfuse a -= b c
                            accp[cc] += b * x
                    else:
                        for cc in range(CC):
                            accu[cc] = cuda.fma(a, S[at2(srow, cc, 1)], accu[cc])
                cuda.syncthreads()
            for cc in range(CC):
                Us[at2(i, c0 + cc, TV + 1)] = accu[cc]
            cuda.syncthreads()
            # 2. O = qg S + A U (lower triangle of A), A staged transposed by slices of rows j
            if emit:
                staged_output(A, Wt, Us, Os, chunk, Cp, accp)
            # 3. S' = total S + k_suffix^T U, the channels on the lanes, two per thread
            staged_update(S, Us, k_suffix, total, chunk, Cp, K, accu, accp)
            cuda.syncthreads()
            if emit:
                tile_out(out, Os, chunk, Cp, 1, v0, V)
        tile_out(final, S, bh, K, 0, v0, V)

    return chunk_state_pass_staged


def _state_grad_pass_kernel(dtype: str, index: str) -> Callable:
    """The Python function of ``chunk_state_grad_pass`` for ``dtype`` and ``index``."""
    _, nbtype, zero, _ = constants(dtype)
    at2, at3, at4 = offset_functions(index)

    def chunk_state_grad_pass(
        qg, A, w, u0, k_suffix, total, do, boundaries, dfinal, dends, U, dU, dinitial, dims
    ):
        """The state-gradient recurrence, last chunk first; blocks, threads and layouts as the state pass.

        ``do, U, dU`` are ``[BH, NT, Cp, V]``, ``dfinal, dinitial`` ``[BH, K, V]`` and ``dends``
        ``[NT, BH, K, V]``. The block keeps its tile of ``dS`` (the gradient of the state at the
        end of the chunk) in shared memory. Per chunk: stage the chunk-start state ``S`` and
        ``dO``; then ``U = u0 - w S`` and ``dU = A^T dO + k_suffix dS`` (one pass over ``K`` for both);
        after a barrier ``dS_start = total dS + qg^T dO - w^T dU``. Dynamic shared memory:
        ``(2 K + 2 Cp) * blockDim.x`` elements.
        """
        BH, NT, Cp, K, V = dims
        TV = cuda.blockDim.x
        tiles = (V + TV - 1) // TV
        bh = cuda.blockIdx.x // tiles
        tx = cuda.threadIdx.x
        v = (cuda.blockIdx.x % tiles) * TV + tx
        ty = cuda.threadIdx.y
        ny = cuda.blockDim.y
        active = v < V
        shared = cuda.shared.array(0, nbtype)
        dS = shared[: K * TV]
        S = shared[K * TV : 2 * K * TV]
        dOs = shared[2 * K * TV : (2 * K + Cp) * TV]
        dUs = shared[(2 * K + Cp) * TV : (2 * K + 2 * Cp) * TV]
        acc = cuda.local.array(ROW_GROUP, nbtype)
        accd = cuda.local.array(ROW_GROUP, nbtype)
        for kk in range(ty, K, ny):
            dS[at2(kk, tx, TV)] = dfinal[at3(bh, kk, v, K, V)] if active else zero
        for n in range(NT - 1, -1, -1):
            chunk = at2(bh, n, NT)
            for kk in range(ty, K, ny):
                S[at2(kk, tx, TV)] = boundaries[at4(n, bh, kk, v, BH, K, V)] if active else zero
            for i in range(ty, Cp, ny):
                dOs[at2(i, tx, TV)] = do[at3(chunk, i, v, Cp, V)] if active else zero
            cuda.syncthreads()
            if active:
                for kk in range(ty, K, ny):
                    dends[at4(n, bh, kk, v, BH, K, V)] = dS[at2(kk, tx, TV)]
            for i0 in range(ty, Cp, ny * ROW_GROUP):
                for r in range(ROW_GROUP):
                    i = i0 + r * ny
                    acc[r] = u0[at3(chunk, i, v, Cp, V)] if i < Cp and active else zero
                    accd[r] = zero
                    if i < Cp:
                        for j in range(i, Cp):
                            accd[r] += A[at3(chunk, j, i, Cp, Cp)] * dOs[at2(j, tx, TV)]
                for kk in range(K):
                    s = S[at2(kk, tx, TV)]
                    ds = dS[at2(kk, tx, TV)]
                    for r in range(ROW_GROUP):
                        i = i0 + r * ny
                        if i < Cp:
                            ik = at3(chunk, i, kk, Cp, K)
                            acc[r] = cuda.fma(-w[ik], s, acc[r])  # a -= b c is not fused
                            accd[r] += k_suffix[ik] * ds
                for r in range(ROW_GROUP):
                    i = i0 + r * ny
                    if i < Cp:
                        dUs[at2(i, tx, TV)] = accd[r]
                        if active:
                            U[at3(chunk, i, v, Cp, V)] = acc[r]
                            dU[at3(chunk, i, v, Cp, V)] = accd[r]
            cuda.syncthreads()
            for kk in range(ty, K, ny):
                s = total[at2(chunk, kk, K)] * dS[at2(kk, tx, TV)]
                for i in range(Cp):
                    ik = at3(chunk, i, kk, Cp, K)
                    s = cuda.fma(qg[ik], dOs[at2(i, tx, TV)], s)
                    s = cuda.fma(-w[ik], dUs[at2(i, tx, TV)], s)
                dS[at2(kk, tx, TV)] = s
            cuda.syncthreads()
        if active:
            for kk in range(ty, K, ny):
                dinitial[at3(bh, kk, v, K, V)] = dS[at2(kk, tx, TV)]

    return chunk_state_grad_pass


def _state_grad_pass_staged_kernel(dtype: str, index: str) -> Callable:
    """The Python function of ``chunk_state_grad_pass_staged`` for ``dtype`` and ``index``."""
    _, nbtype, _, _ = constants(dtype)
    at2, _, _ = offset_functions(index)
    tile_in, tile_out, _, _, _ = _staging(dtype, index)
    staged_u_du, staged_grad_update = _grad_staged_steps(dtype, index)

    def chunk_state_grad_pass_staged(
        qg, A, w, u0, k_suffix, total, do, boundaries, dfinal, dends, U, dU, dinitial, dims
    ):
        """``chunk_state_grad_pass`` re-cut as ``chunk_state_pass_staged``: rows on the lanes.

        Same arguments and layouts; blocks and threads as ``chunk_state_pass_staged``. The block
        keeps its tile of ``dS`` in shared memory. Per chunk, last first:

        1. stage the chunk-start state ``S`` (from the boundaries), ``dO`` and ``u0``;
        2. ``U = u0 - w S`` and ``dU = A^T dO + k_suffix dS`` (thread: one row, ``STAGED_COLUMNS``
           columns): ``w`` and ``k_suffix`` staged transposed by slices of channels as in the state
           pass; ``A[j, i]`` for consecutive rows ``i`` is read coalesced from global memory;
        3. ``dS_start = total dS + qg^T dO - w^T dU`` with the channels on the lanes (``qg`` and
           ``w`` read coalesced), ``dO`` and ``dU`` broadcast from shared memory.

        Dynamic shared memory: ``2 K TV + 3 Cp (TV + 1) + 2 SLICE (Cp + 1)`` elements.
        """
        BH, NT, Cp, K, V = dims
        TV = STAGED_TILE_V
        CC = STAGED_COLUMNS
        KS = STAGED_SLICE
        tiles = (V + TV - 1) // TV
        bh = cuda.blockIdx.x // tiles
        v0 = (cuda.blockIdx.x % tiles) * TV
        t = cuda.threadIdx.x
        i = t % Cp
        c0 = (t // Cp) * CC
        shared = cuda.shared.array(0, nbtype)
        dS = shared[: K * TV]  # [k * TV + c]
        S = shared[K * TV : 2 * K * TV]
        rows = Cp * (TV + 1)  # [i * (TV + 1) + c]
        dOs = shared[2 * K * TV : 2 * K * TV + rows]
        Us = shared[2 * K * TV + rows : 2 * K * TV + 2 * rows]  # u0, then U
        dUs = shared[2 * K * TV + 2 * rows : 2 * K * TV + 3 * rows]
        base = 2 * K * TV + 3 * rows
        Wt = shared[base : base + KS * (Cp + 1)]  # [k * (Cp + 1) + i]
        Kt = shared[base + KS * (Cp + 1) : base + 2 * KS * (Cp + 1)]
        accu = cuda.local.array(STAGED_COLUMNS, nbtype)
        accd = cuda.local.array(STAGED_COLUMNS, nbtype)
        tile_in(dS, dfinal, bh, K, 0, v0, V)
        for n in range(NT - 1, -1, -1):
            chunk = at2(bh, n, NT)
            # 1.
            tile_in(S, boundaries, at2(n, bh, BH), K, 0, v0, V)
            tile_in(dOs, do, chunk, Cp, 1, v0, V)
            tile_in(Us, u0, chunk, Cp, 1, v0, V)
            cuda.syncthreads()
            tile_out(dends, dS, at2(n, bh, BH), K, 0, v0, V)
            # 2. U = u0 - w S and dU = A^T dO + k_suffix dS
            staged_u_du(A, w, k_suffix, S, dS, dOs, Us, Wt, Kt, chunk, Cp, K, accu, accd)
            for cc in range(CC):
                Us[at2(i, c0 + cc, TV + 1)] = accu[cc]
                dUs[at2(i, c0 + cc, TV + 1)] = accd[cc]
            cuda.syncthreads()
            tile_out(U, Us, chunk, Cp, 1, v0, V)
            tile_out(dU, dUs, chunk, Cp, 1, v0, V)
            # 3. dS_start = total dS + qg^T dO - w^T dU, the channels on the lanes, two per thread
            staged_grad_update(dS, dOs, dUs, qg, w, total, chunk, Cp, K, accu, accd)
            cuda.syncthreads()
        tile_out(dinitial, dS, bh, K, 0, v0, V)

    return chunk_state_grad_pass_staged


# the state pass and its gradient pass: (broadcast kernel, staged kernel) each
STATE_PASSES = (
    Kernel("chunk_state_pass", _state_pass_kernel, dims=5, types={"emit": INT32}),
    Kernel("chunk_state_pass_staged", _state_pass_staged_kernel, dims=5, types={"emit": INT32}),
)
STATE_GRAD_PASSES = (
    Kernel("chunk_state_grad_pass", _state_grad_pass_kernel, dims=5),
    Kernel("chunk_state_grad_pass_staged", _state_grad_pass_staged_kernel, dims=5),
)
KERNELS = Family("state_pass", (*STATE_PASSES, *STATE_GRAD_PASSES))
_launch = launcher(KERNELS)


def _state_block(name: str, K: int, Cp: int, itemsize: int, rows: int) -> tuple[tuple[int, int], int]:
    """Block shape and dynamic shared memory of a state pass keeping ``rows`` rows of ``TV`` columns.

    ``TV = STATE_TILE_V`` value columns unless the tiles would not fit in :data:`SHARED_LIMIT`;
    then fewer columns (and more row threads), down to one.
    """
    tv = STATE_TILE_V
    while tv > 1 and rows * tv * itemsize > SHARED_LIMIT:
        tv //= 2
    if rows * tv * itemsize > SHARED_LIMIT:
        from .._errors import InvalidInputError

        msg = (
            f"{name}: K={K} with a padded chunk of {Cp} steps needs {rows * itemsize} bytes of shared "
            f"memory per value column, over the {SHARED_LIMIT} a block has; use a smaller chunk_size "
            "or backend='reference'"
        )
        raise InvalidInputError(msg)
    return (tv, STATE_THREADS // tv), rows * tv * itemsize


def _state_kernel(
    BH: int, NT: int, Cp: int, K: int, V: int, itemsize: int, backward: bool = False
) -> tuple[Kernel, int, Any, int]:
    """``(kernel, grid, block, shared)`` of a state pass (its gradient pass with ``backward``).

    The staged kernel where :data:`STATE_PASS` asks for it and its tiles fit (at most 1024
    threads, :data:`SHARED_LIMIT`); otherwise the broadcast kernel (:data:`STATE_PASSES`,
    :data:`STATE_GRAD_PASSES`).
    """
    broadcast, staged = STATE_GRAD_PASSES if backward else STATE_PASSES
    work = NT and K * V  # else an empty grid: nothing to launch
    threads = Cp * (STAGED_TILE_V // STAGED_COLUMNS)
    tiles, rows = (2, 3) if backward else (1, 2)  # [K, TV] state tiles and [Cp, TV + 1] row tiles
    elements = tiles * K * STAGED_TILE_V + rows * Cp * (STAGED_TILE_V + 1) + 2 * STAGED_SLICE * (Cp + 1)
    if STATE_PASS == "staged" and threads <= 1024 and elements * itemsize <= SHARED_LIMIT:
        grid = BH * -(-V // STAGED_TILE_V) if work else 0
        return staged, grid, threads, elements * itemsize
    block, shared = _state_block(broadcast.name, K, Cp, itemsize, 2 * K + 2 * Cp if backward else K + 2 * Cp)
    return broadcast, BH * -(-V // block[0]) if work else 0, block, shared


def chunk_state_pass(
    w: Any, u0: Any, k_suffix: Any, total: Any, state: Any, qg: Any = None, A: Any = None
) -> StatePass:
    """The state recurrence over every chunk with the output ``O = qg S + A U``, in one kernel.

    Returns ``boundaries [NT, B, H, K, V]``, ``output [B, H, NT, Cp, V]`` (``None`` without
    ``qg`` and ``A``: the states alone) and the final state.
    """
    name = "chunk_state_pass"
    xp = array_namespace(w, u0, k_suffix, total, state)
    emit = qg is not None
    dtype = _common_dtype(name, w, u0, k_suffix, total, state, *((qg, A) if emit else ()))
    _check_ndim(name, "w", w, 5)
    _check_ndim(name, "u0", u0, 5)
    B, H, NT, Cp, K = w.shape
    V = u0.shape[-1]
    _check_shape(name, "u0", u0, (B, H, NT, Cp, V))
    _check_shape(name, "k_suffix", k_suffix, w.shape)
    _check_shape(name, "total", total, (B, H, NT, K))
    _check_shape(name, "state", state, (B, H, K, V))
    if emit:
        _check_shape(name, "qg", qg, w.shape)
        _check_shape(name, "A", A, (B, H, NT, Cp, Cp))
    BH = B * H
    boundaries = _empty(xp, w, (NT, BH, K, V))
    final = _empty(xp, w, (BH, K, V))
    out = _empty(xp, w, (BH, NT, Cp, V) if emit else (1, 1, 1, 1))
    if NT == 0 or K * V == 0:
        final = xp.asarray(state, copy=True)
        out = _zeros(xp, w, out.shape)
    kernel, grid, block, shared = _state_kernel(BH, NT, Cp, K, V, w.dtype.itemsize)
    if emit:
        dense = (qg, A)
    else:
        dense = (_empty(xp, w, (1, 1, 1, K)), _empty(xp, w, (1, 1, 1, 1)))
    args = (*dense, w, u0, k_suffix, total, state, np.int32(emit), out, boundaries, final)
    _launch(kernel, dtype, grid, block, *args, shared=shared, dims=(BH, NT, Cp, K, V))
    output = xp.reshape(out, u0.shape) if emit else None
    return StatePass(
        boundaries=xp.reshape(boundaries, (NT, B, H, K, V)),
        output=output,
        final_state=xp.reshape(final, state.shape),
    )


def chunk_state_grad_pass(
    w: Any,
    u0: Any,
    k_suffix: Any,
    total: Any,
    qg: Any,
    A: Any,
    grad_output: Any,
    boundaries: Any,
    dfinal: Any,
) -> StateGradPass:
    """The state-gradient recurrence over every chunk, last first, in one kernel.

    Returns ``dends [NT, B, H, K, V]``, ``U`` and ``dU`` (``[B, H, NT, Cp, V]``) and the
    initial-state gradient (see :mod:`kda.reference`).
    """
    name = "chunk_state_grad_pass"
    arrays = (w, u0, k_suffix, total, qg, A, grad_output, boundaries, dfinal)
    xp = array_namespace(*arrays)
    dtype = _common_dtype(name, *arrays)
    _check_ndim(name, "w", w, 5)
    _check_ndim(name, "u0", u0, 5)
    B, H, NT, Cp, K = w.shape
    V = u0.shape[-1]
    _check_shape(name, "u0", u0, (B, H, NT, Cp, V))
    _check_shape(name, "k_suffix", k_suffix, w.shape)
    _check_shape(name, "qg", qg, w.shape)
    _check_shape(name, "total", total, (B, H, NT, K))
    _check_shape(name, "A", A, (B, H, NT, Cp, Cp))
    _check_shape(name, "grad_output", grad_output, u0.shape)
    _check_shape(name, "boundaries", boundaries, (NT, B, H, K, V))
    _check_shape(name, "dfinal", dfinal, (B, H, K, V))
    BH = B * H
    dends = _empty(xp, w, (NT, BH, K, V))
    U, dU = (_empty(xp, w, (BH, NT, Cp, V)) for _ in range(2))
    dinitial = _empty(xp, w, (BH, K, V))
    if NT == 0 or K * V == 0:
        dinitial = xp.asarray(dfinal, copy=True)
        U, dU = (_zeros(xp, w, (BH, NT, Cp, V)) for _ in range(2))
    kernel, grid, block, shared = _state_kernel(BH, NT, Cp, K, V, w.dtype.itemsize, backward=True)
    args = (qg, A, w, u0, k_suffix, total, grad_output, boundaries, dfinal, dends, U, dU, dinitial)
    _launch(kernel, dtype, grid, block, *args, shared=shared, dims=(BH, NT, Cp, K, V))
    shape = (NT, B, H, K, V)
    return StateGradPass(
        dends=xp.reshape(dends, shape),
        u=xp.reshape(U, u0.shape),
        du=xp.reshape(dU, u0.shape),
        dstart=xp.reshape(dinitial, dfinal.shape),
    )
