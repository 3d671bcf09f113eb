"""Numba-CUDA kernels of the chunked and recurrent KDA primitives.

Each kernel is written once as a plain Python function by :func:`build_kernels`, closed over
the constants of one floating dtype (so float32 work stays float32: no Python float literal
ever promotes it to float64) and the offset functions of one index type, and compiled lazily,
once per (dtype, index type), with an explicit signature (:func:`compiled`). :data:`SIGNATURES`
names every kernel with the kinds of its arguments; the PTX test compiles every entry for both
dtypes, and the 64-bit offsets in float32.

Layouts: every array is C-contiguous and passed flattened; a kernel indexes it by offsets
(``at2``, ``at3``, ``at4``: unsigned, 32-bit where the launch's sizes allow) from the dimensions
in its trailing ``dims`` tuple. ``N = B * H * NT`` chunks, ``BH = B * H`` heads, ``Cp`` padded chunk
steps, ``K`` key and ``V`` value channels, ``NL`` halving levels. The forward and backward of
the chunked algorithm run four of these kernels (``chunk_local``, ``chunk_state_pass``,
``chunk_state_grad_pass``, ``chunk_local_backward``; docs/gpu.md); the finer ones serve chunks
too large for the fused kernels' shared memory.

Numerical contract (``docs/design.md``): every decay is a running product of ``exp(g)`` over
exactly the steps it spans, so it lies in ``[0, 1]``, a hard reset (``g = -inf``) gives an
exact 0 and no difference of cumulative sums is ever formed.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import cuda

__all__ = [
    "DTYPES",
    "INDEX32_LIMIT",
    "INDEX_TYPES",
    "SIGNATURES",
    "build_kernels",
    "compiled",
    "offset_functions",
    "signature",
]

# rows of the state passes that one thread accumulates at once (registers)
ROW_GROUP = 4

# chunk_state_pass_staged: value columns per block, columns per thread, channels per staged slice
STAGED_TILE_V = 16
STAGED_COLUMNS = 8
STAGED_SLICE = 16

# channels per tile of chunk_local's pairwise products (shared memory: 2 Cp of them)
LOCAL_TILE_K = 16

# floating dtypes the kernels are compiled for
DTYPES = ("float32", "float64")

# index types: every array is passed flattened, and the kernels compute their offsets into it
# in 32 bits (unsigned: no negative-index fix-ups) wherever every array and every dimension of
# the launch has fewer than INDEX32_LIMIT elements, in 64 bits otherwise; the launch wrapper
# picks (kda.cuda._launch.index_type)
# index type -> the type of the dimensions passed with it (signed in 64 bits: Numba types a mix
# of uint64 and signed integers as float64)
INDEX_TYPES = {"uint32": "uint32", "uint64": "int64"}
INDEX32_LIMIT = 2**32

# kernel name -> argument kinds: "a" a C-contiguous 1-D array of the floating dtype (a flattened
# C-contiguous array), "s" a floating scalar, "i" an int64 scalar, "j" an int32 scalar, "f" a
# C-contiguous 1-D int32 array, then ":n" for the trailing tuple of n dimensions
SIGNATURES = {
    "chunk_local": "aaaaasaaaaaaaaa:3",
    "chunk_local_backward": "aaaaasaaaaaaaaaaaaaaaaaaaaaaaaa:5",
    "chunk_state_pass": "aaaaaaajaaa:5",
    "chunk_state_pass_staged": "aaaaaaajaaa:5",
    "chunk_state_grad_pass": "aaaaaaaaaaaaa:5",
    "chunk_state_grad_pass_staged": "aaaaaaaaaaaaa:5",
    "recurrent_forward": "aaaaasaaa:4",
    "recurrent_backward": "aaaaasaaaiaaaaaaaa:4",
    "gate_flags": "af:1",
}


def signature(name: str, dtype: str, index: str = "uint32") -> str:
    """The explicit Numba signature of kernel ``name`` for the floating ``dtype`` and ``index`` type.

    Every array is C-contiguous and one-dimensional (a flattened view): an element is an offset
    computed in ``index`` arithmetic from the trailing tuple of dimensions, with no stride loads
    and no negative-index selects.
    """
    spec, ndims = SIGNATURES[name].split(":")
    kinds = {"a": f"{dtype}[::1]", "s": dtype, "i": "int64", "j": "int32", "f": "int32[::1]"}
    args = [kinds[c] for c in spec] + [f"UniTuple({INDEX_TYPES[index]}, {int(ndims)})"]
    return f"void({', '.join(args)})"


def _offset_function(ix):
    """``at2(i, j, J)``: the offset ``i * J + j`` in the index type ``ix``, as an inline device function.

    Under Numba's CUDA simulator a plain function of Python integers instead: there a device
    call is a switch of thread context and a Numba cast a microsecond, which made the offsets 30
    times slower than the arithmetic they hold. A negative offset (which the unsigned type would
    wrap far out of bounds on a GPU) raises there.
    """
    if numba.config.ENABLE_CUDASIM:

        def at2(i, j, J):
            offset = i * J + j
            if offset < 0:
                msg = f"negative array offset {i} * {J} + {j}"
                raise IndexError(msg)
            return offset

        return at2

    @cuda.jit(device=True, inline="always")
    def at2(i, j, J):
        return ix(ix(i) * ix(J) + ix(j))

    return at2


def _inline(func):
    """An inline device function on a GPU; the plain function under the simulator."""
    if numba.config.ENABLE_CUDASIM:
        return func
    return cuda.jit(device=True, inline="always")(func)


def offset_functions(index: str) -> tuple:
    """``(at2, at3, at4)``: the offsets of elements of C-contiguous arrays in the ``index`` type.

    ``at2(i, j, J)`` is element ``[i, j]`` of a ``[., J]`` array, ``at3(i, j, m, J, M)`` element
    ``[i, j, m]`` of a ``[., J, M]`` one and ``at4(i, j, m, r, J, M, R)`` element ``[i, j, m, r]``
    of a ``[., J, M, R]`` one: inline device functions on a GPU, plain functions under the
    simulator (:func:`_offset_function`).
    """
    at2 = _offset_function(getattr(numba, index))

    @_inline
    def at3(i, j, m, J, M):
        """The offset of element ``[i, j, m]`` of a C-contiguous ``[., J, M]`` array."""
        return at2(at2(i, j, J), m, M)

    @_inline
    def at4(i, j, m, r, J, M, R):
        """The offset of element ``[i, j, m, r]`` of a C-contiguous ``[., J, M, R]`` array."""
        return at2(at3(i, j, m, J, M), r, R)

    return at2, at3, at4


def build_kernels(dtype: str, index: str = "uint32") -> dict:
    """The Python functions of every kernel, specialised to ``dtype`` and ``index`` by their constants."""
    fl = np.dtype(dtype).type
    nbtype = numba.from_dtype(np.dtype(dtype))
    zero = fl(0)
    one = fl(1)

    at2, at3, at4 = offset_functions(index)

    @_inline
    def at1(i):
        """The offset ``i`` in the index type."""
        return at2(0, i, 1)

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

        Dynamic shared memory: ``Cp + Cp (Cp + 1) / 2 + max(2 Cp LOCAL_TILE_K, Cp^2 / 4)``
        elements.
        """
        n = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nth = cuda.blockDim.x
        Cp, K, V = dims
        TK = LOCAL_TILE_K
        shared = cuda.shared.array(0, nbtype)
        bsh = shared[:Cp]
        tri = Cp * (Cp + 1) // 2
        T = shared[Cp : Cp + tri]  # T[i, j] at i (i + 1) / 2 + j
        work = shared[Cp + tri :]
        P = work[: Cp * TK]  # column sides (first halves) and q rows (second halves)
        Q = work[Cp * TK : 2 * Cp * TK]  # k rows (second halves)
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
                            P[j * TK + dd] = k[at3(n, j, d, Cp, K)] * c
                            c *= math.exp(g[at3(n, j, d, Cp, K)])
                            r *= math.exp(g[at3(n, i, d, Cp, K)])
                            P[i * TK + dd] = q[at3(n, i, d, Cp, K)] * r
                            Q[i * TK + dd] = k[at3(n, i, d, Cp, K)] * r
                        else:
                            P[j * TK + dd] = zero
                            P[i * TK + dd] = zero
                            Q[i * TK + dd] = zero
                cuda.syncthreads()
                for pair in range(tid, nb * h * h, nth):
                    start = (pair // (h * h)) * 2 * h
                    i = start + h + (pair // h) % h
                    j = start + pair % h
                    sa = zero
                    sl = zero
                    for dd in range(TK):
                        c = P[j * TK + dd]
                        sa += P[i * TK + dd] * c
                        sl += Q[i * TK + dd] * c
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
        # 1.
        for idx in range(tid, Cp * K, nth):
            i = idx // K
            d = idx % K
            a = zero
            b = zero
            e = zero
            for x in range(V):
                dx = at4(c, bh, d, x, BH, K, V)
                ix = at3(n, i, x, Cp, V)
                s = S[dx]
                a += do[ix] * s
                e += dU[ix] * s
                b += U[ix] * dS[dx]
            o = at3(n, i, d, Cp, K)
            dqg[o] = a
            dkt[o] = b
            dg[o] = -e
        for d in range(tid, K, nth):
            a = zero
            for x in range(V):
                dx = at4(c, bh, d, x, BH, K, V)
                a += S[dx] * dS[dx]
            dtot[at2(n, d, K)] = a
        for idx in range(tid, Cp * Cp, nth):
            i = idx // Cp
            j = idx % Cp
            a = zero
            if j <= i:
                for x in range(V):
                    a += do[at3(n, i, x, Cp, V)] * U[at3(n, j, x, Cp, V)]
            dA[at3(n, i, j, Cp, Cp)] = a
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
        cuda.syncthreads()
        # 3.
        for idx in range(tid, Cp * Cp, nth):
            i = idx // Cp
            j = idx % Cp
            a = zero
            if j < i:
                for d in range(K):
                    a += dkw[at3(n, i, d, Cp, K)] * w[at3(n, j, d, Cp, K)]
                for x in range(V):
                    a += dku[at3(n, i, x, Cp, V)] * u0[at3(n, j, x, Cp, V)]
            dX[at3(n, i, j, Cp, Cp)] = -a
        cuda.syncthreads()
        # 4.
        for i in range(tid, Cp, nth):
            bi = beta[at2(n, i, Cp)]
            a = zero
            for j in range(i):
                ij = at3(n, i, j, Cp, Cp)
                a += dX[ij] * L[ij]
                dX[ij] = bi * dX[ij]
            for d in range(K):
                o = at3(n, i, d, Cp, K)
                a += kg[o] * dkw[o]
            for x in range(V):
                ix = at3(n, i, x, Cp, V)
                a += v[ix] * dku[ix]
            dbeta[at2(n, i, Cp)] = a
        for idx in range(tid, Cp * V, nth):
            i = idx // V
            x = idx % V
            ix = at3(n, i, x, Cp, V)
            dv[ix] = beta[at2(n, i, Cp)] * dku[ix]
        cuda.syncthreads()
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

    def chunk_state_pass(qg, A, w, u0, kt, total, state, emit, out, boundaries, final, dims):
        """One block per (head, tile of ``blockDim.x`` value columns), looping over every chunk.

        ``dims = (BH, NT, Cp, K, V)``; the arrays are flattened ``[BH, NT, Cp, K]`` (``qg, w,
        kt``), ``[BH, NT, Cp, Cp]`` (``A``), ``[BH, NT, Cp, V]`` (``u0, out``), ``[BH, NT, K]``
        (``total``), ``[BH, K, V]`` (``state, final``) and ``[NT, BH, K, V]`` (``boundaries``).
        The block keeps its ``[K, TV]`` tile of the state in shared memory for the whole
        sequence (``TV = blockDim.x``). Per chunk, thread ``(x, y)`` owns value column ``x`` of
        the tile and rows ``y, y + blockDim.y, ...``:

        1. ``U = u0 - w S`` and, when ``emit``, the partial output ``qg S`` (one pass over ``K``:
           each ``S[k, x]`` read from shared memory serves ``ROW_GROUP`` rows of both);
        2. after a barrier, ``O = qg S + A U`` (written to ``out``) and ``S' = total S + kt^T U``.

        ``w``, ``qg``, ``kt`` and ``A`` are read by all lanes of a row at once (one broadcast
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
                    s += kt[at3(chunk, i, kk, Cp, K)] * Us[at2(i, tx, TV)]
                S[at2(kk, tx, TV)] = s
            cuda.syncthreads()
        if active:
            for kk in range(ty, K, ny):
                final[at3(bh, kk, v, K, V)] = S[at2(kk, tx, TV)]

    @_inline
    def tile_in(dst, src, base, rows, pad, v0, V):
        """Stage the block's ``[rows, STAGED_TILE_V]`` tile (columns ``v0..``, zero past ``V``) of
        ``src[base]``, a ``[., rows, V]`` array, into ``dst`` with rows ``STAGED_TILE_V + pad`` apart."""
        TV = STAGED_TILE_V
        for e in range(cuda.threadIdx.x, rows * TV, cuda.blockDim.x):
            r = e // TV
            c = e % TV
            dst[at2(r, c, TV + pad)] = src[at3(base, r, v0 + c, rows, V)] if v0 + c < V else zero

    @_inline
    def tile_out(dst, src, base, rows, pad, v0, V):
        """The inverse of ``tile_in``: write the tile back to ``dst[base]`` (columns below ``V``)."""
        TV = STAGED_TILE_V
        for e in range(cuda.threadIdx.x, rows * TV, cuda.blockDim.x):
            r = e // TV
            c = e % TV
            if v0 + c < V:
                dst[at3(base, r, v0 + c, rows, V)] = src[at2(r, c, TV + pad)]

    @_inline
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

    @_inline
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

    @_inline
    def pair_end(tile, row, row2, two, acc, acc2):
        """Write work item's accumulators back to its rows of the tile (see ``pair_begin``)."""
        for cc in range(STAGED_COLUMNS):
            tile[at2(row, cc, 1)] = acc[cc]
            if two:
                tile[at2(row2, cc, 1)] = acc2[cc]

    def chunk_state_pass_staged(qg, A, w, u0, kt, total, state, emit, out, boundaries, final, dims):
        """``chunk_state_pass`` re-cut with the chunk's rows on the lanes (docs/gpu.md, "What is open").

        Same arguments and layouts. One block of ``2 * Cp`` threads per (head, tile
        of ``STAGED_TILE_V`` value columns); thread ``t`` owns row ``i = t % Cp`` and the
        ``STAGED_COLUMNS`` columns of group ``t // Cp``. Per chunk:

        1. ``U = u0 - w S`` and ``qg S``: ``w`` and ``qg`` are staged into shared memory
           transposed, ``STAGED_SLICE`` channels at a time, so that per channel a warp reads
           consecutive rows (one wavefront) and broadcasts ``S[k, c..]``;
        2. ``O = qg S + A U``, with ``A`` staged transposed the same way;
        3. ``S' = total S + kt^T U`` with the channels on the lanes (``kt`` read coalesced).

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
        nth = cuda.blockDim.x
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
            # 3. S' = total S + kt^T U, the channels on the lanes, two per thread (channels kk
            #    and kk + KP share every broadcast U load)
            for e in range(t, (K + 1) // 2 * (TV // CC), nth):
                kk, k2, two, row, row2, g0 = pair_begin(e, K, chunk, total, S, accu, accp)
                for r in range(Cp):
                    a = kt[at3(chunk, r, kk, Cp, K)]
                    b = kt[at3(chunk, r, k2, Cp, K)] if two else zero
                    urow = at2(r, g0, TV + 1)
                    for cc in range(CC):
                        x = Us[at2(urow, cc, 1)]
                        accu[cc] += a * x
                        accp[cc] += b * x
                pair_end(S, row, row2, two, accu, accp)
            cuda.syncthreads()
            if emit:
                tile_out(out, Os, chunk, Cp, 1, v0, V)
        tile_out(final, S, bh, K, 0, v0, V)

    def chunk_state_grad_pass(qg, A, w, u0, kt, total, do, boundaries, dstate, dends, U, dU, dinitial, dims):
        """The state-gradient recurrence, last chunk first; blocks, threads and layouts as the state pass.

        ``do, U, dU`` are ``[BH, NT, Cp, V]``, ``dstate, dinitial`` ``[BH, K, V]`` and ``dends``
        ``[NT, BH, K, V]``. The block keeps its tile of ``dS`` (the gradient of the state at the
        end of the chunk) in shared memory. Per chunk: stage the chunk-start state ``S`` and
        ``dO``; then ``U = u0 - w S`` and ``dU = A^T dO + kt dS`` (one pass over ``K`` for both);
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
            dS[at2(kk, tx, TV)] = dstate[at3(bh, kk, v, K, V)] if active else zero
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
                            accd[r] += kt[ik] * ds
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

    def chunk_state_grad_pass_staged(
        qg, A, w, u0, kt, total, do, boundaries, dstate, dends, U, dU, dinitial, dims
    ):
        """``chunk_state_grad_pass`` re-cut as ``chunk_state_pass_staged``: rows on the lanes.

        Same arguments and layouts; blocks and threads as ``chunk_state_pass_staged``. The block
        keeps its tile of ``dS`` in shared memory. Per chunk, last first:

        1. stage the chunk-start state ``S`` (from the boundaries), ``dO`` and ``u0``;
        2. ``U = u0 - w S`` and ``dU = A^T dO + kt dS`` (thread: one row, ``STAGED_COLUMNS``
           columns): ``w`` and ``kt`` staged transposed by slices of channels as in the state
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
        nth = cuda.blockDim.x
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
        tile_in(dS, dstate, bh, K, 0, v0, V)
        for n in range(NT - 1, -1, -1):
            chunk = at2(bh, n, NT)
            # 1.
            tile_in(S, boundaries, at2(n, bh, BH), K, 0, v0, V)
            tile_in(dOs, do, chunk, Cp, 1, v0, V)
            tile_in(Us, u0, chunk, Cp, 1, v0, V)
            cuda.syncthreads()
            tile_out(dends, dS, at2(n, bh, BH), K, 0, v0, V)
            # 2. U = u0 - w S and dU = A^T dO + kt dS
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
                slice_transposed(Kt, kt, chunk, k0, Cp, K)
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
            for cc in range(CC):
                Us[at2(i, c0 + cc, TV + 1)] = accu[cc]
                dUs[at2(i, c0 + cc, TV + 1)] = accd[cc]
            cuda.syncthreads()
            tile_out(U, Us, chunk, Cp, 1, v0, V)
            tile_out(dU, dUs, chunk, Cp, 1, v0, V)
            # 3. dS_start = total dS + qg^T dO - w^T dU, the channels on the lanes, two per thread
            #    (channels kk and kk + KP share every broadcast dO and dU load)
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
            cuda.syncthreads()
        tile_out(dinitial, dS, bh, K, 0, v0, V)

    @_inline
    def decay_and_predict(S, g, k, step, bh, c, K, V):
        """Decay column ``c`` of head ``bh``'s state ``S`` by step ``step``'s ``exp(g)`` in place;
        return the prediction ``k . S`` of the decayed column (one step of the recurrence)."""
        pred = zero
        for kk in range(K):
            tk = at2(step, kk, K)
            kc = at3(bh, kk, c, K, V)
            s = math.exp(g[tk]) * S[kc]
            S[kc] = s
            pred += k[tk] * s
        return pred

    def recurrent_forward(q, k, g, v, beta, scale, state, o, final, dims):
        """One thread per (head, value column v): every column of the state evolves alone.

        ``dims = (BH, T, K, V)``; the arrays are flattened ``[BH, T, K]`` (``q, k, g``),
        ``[BH, T, V]`` (``v, o``), ``[BH, T]`` (``beta``) and ``[BH, K, V]`` (``state, final``).
        """
        idx = cuda.grid(1)
        BH, T, K, V = dims
        bh = idx // V
        if bh >= BH:
            return
        c = idx % V
        for kk in range(K):
            kc = at3(bh, kk, c, K, V)
            final[kc] = state[kc]
        for t in range(T):
            step = at2(bh, t, T)
            pred = decay_and_predict(final, g, k, step, bh, c, K, V)
            u = beta[step] * (v[at2(step, c, V)] - pred)
            out = zero
            for kk in range(K):
                tk = at2(step, kk, K)
                kc = at3(bh, kk, c, K, V)
                s = final[kc] + k[tk] * u
                final[kc] = s
                out += q[tk] * s
            o[at2(step, c, V)] = scale * out

    def recurrent_backward(
        q, k, g, v, beta, scale, state, do, dstate, stride, ckpt, seg, dq, dk, dg, dbeta, dv, dS, dims
    ):
        """One thread per (head, value column); reductions over columns by atomics.

        ``dims = (BH, T, K, V)``; the arrays are flattened ``[BH, T, K]`` (``q, k, g, dq, dk,
        dg``), ``[BH, T, V]`` (``v, do, dv``), ``[BH, T]`` (``beta, dbeta``), ``[BH, K, V]``
        (``state, dstate, dS``) and ``[., BH, K, V]`` (``ckpt, seg``). States are kept every
        ``stride`` steps (``ckpt``) and each segment is recomputed into ``seg`` on the way back.
        ``dq, dk, dg, dbeta`` must be zero on entry.
        """
        idx = cuda.grid(1)
        BH, T, K, V = dims
        bh = idx // V
        if bh >= BH:
            return
        c = idx % V
        # forward, saving checkpoints; dS serves as the running state
        for kk in range(K):
            kc = at3(bh, kk, c, K, V)
            dS[kc] = state[kc]
        for t in range(T):
            step = at2(bh, t, T)
            if t % stride == 0:
                for kk in range(K):
                    ckpt[at4(t // stride, bh, kk, c, BH, K, V)] = dS[at3(bh, kk, c, K, V)]
            pred = decay_and_predict(dS, g, k, step, bh, c, K, V)
            u = beta[step] * (v[at2(step, c, V)] - pred)
            for kk in range(K):
                dS[at3(bh, kk, c, K, V)] += k[at2(step, kk, K)] * u
        for kk in range(K):
            kc = at3(bh, kk, c, K, V)
            dS[kc] = dstate[kc]
        nseg = (T + stride - 1) // stride
        for sg in range(nseg - 1, -1, -1):
            start = sg * stride
            stop = min(start + stride, T)
            for kk in range(K):
                seg[at4(0, bh, kk, c, BH, K, V)] = ckpt[at4(sg, bh, kk, c, BH, K, V)]
            for t in range(start, stop - 1):
                step = at2(bh, t, T)
                s0 = t - start
                pred = zero
                for kk in range(K):
                    tk = at2(step, kk, K)
                    s = math.exp(g[tk]) * seg[at4(s0, bh, kk, c, BH, K, V)]
                    seg[at4(s0 + 1, bh, kk, c, BH, K, V)] = s
                    pred += k[tk] * s
                u = beta[step] * (v[at2(step, c, V)] - pred)
                for kk in range(K):
                    seg[at4(s0 + 1, bh, kk, c, BH, K, V)] += k[at2(step, kk, K)] * u
            for t in range(stop - 1, start - 1, -1):
                step = at2(bh, t, T)
                s0 = t - start
                pred = zero
                for kk in range(K):
                    tk = at2(step, kk, K)
                    pred += k[tk] * (math.exp(g[tk]) * seg[at4(s0, bh, kk, c, BH, K, V)])
                r = v[at2(step, c, V)] - pred
                b = beta[step]
                u = b * r
                dov = do[at2(step, c, V)]
                du = zero
                for kk in range(K):
                    tk = at2(step, kk, K)
                    kc = at3(bh, kk, c, K, V)
                    sd = math.exp(g[tk]) * seg[at4(s0, bh, kk, c, BH, K, V)]
                    cuda.atomic.add(dq, tk, scale * (sd + k[tk] * u) * dov)
                    ds = dS[kc] + scale * q[tk] * dov
                    dS[kc] = ds
                    du += k[tk] * ds
                cuda.atomic.add(dbeta, step, du * r)
                dr = b * du
                dv[at2(step, c, V)] = dr
                for kk in range(K):
                    tk = at2(step, kk, K)
                    kc = at3(bh, kk, c, K, V)
                    e = math.exp(g[tk])
                    sd = e * seg[at4(s0, bh, kk, c, BH, K, V)]
                    ds = dS[kc]
                    cuda.atomic.add(dk, tk, ds * u - sd * dr)
                    dsd = ds - k[tk] * dr
                    cuda.atomic.add(dg, tk, dsd * sd)
                    dS[kc] = e * dsd

    def gate_flags(g, flags, dims):
        """Count the log decays that are not ``<= 0``: ``flags[0]`` positive, ``flags[1]`` NaN.

        A grid-stride loop over the flattened ``g``; each thread adds its counts once (atomics
        only where it found one). ``flags`` must be zero on entry. No host synchronisation: the
        counts stay on the device until someone reads them.
        """
        start = cuda.grid(1)
        step = cuda.gridsize(1)
        pos = 0
        nan = 0
        for idx in range(start, dims[0], step):
            x = g[at1(idx)]
            if x != x:
                nan += 1
            elif x > zero:
                pos += 1
        if pos:
            cuda.atomic.add(flags, 0, pos)
        if nan:
            cuda.atomic.add(flags, 1, nan)

    return {
        "chunk_local": chunk_local,
        "chunk_local_backward": chunk_local_backward,
        "chunk_state_pass": chunk_state_pass,
        "chunk_state_pass_staged": chunk_state_pass_staged,
        "chunk_state_grad_pass": chunk_state_grad_pass,
        "chunk_state_grad_pass_staged": chunk_state_grad_pass_staged,
        "recurrent_forward": recurrent_forward,
        "recurrent_backward": recurrent_backward,
        "gate_flags": gate_flags,
    }


_PYFUNCS: dict = {}
_COMPILED: dict = {}


def compiled(name: str, dtype: str, index: str = "uint32"):
    """Kernel ``name`` for ``dtype`` and ``index``, compiled on first use with its explicit signature."""
    key = (name, dtype, index)
    kernel = _COMPILED.get(key)
    if kernel is None:
        if (dtype, index) not in _PYFUNCS:
            _PYFUNCS[dtype, index] = build_kernels(dtype, index)
        kernel = cuda.jit(signature(name, dtype, index))(_PYFUNCS[dtype, index][name])
        _COMPILED[key] = kernel
    return kernel
