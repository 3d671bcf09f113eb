"""Numba-CUDA kernels of the chunked and recurrent KDA primitives.

Each kernel is written once as a plain Python function by :func:`build_kernels`, closed over
the constants of one floating dtype (so float32 work stays float32: no Python float literal
ever promotes it to float64), and compiled lazily, once per dtype, with an explicit signature
(:func:`compiled`). :data:`SIGNATURES` names every kernel with the kinds of its arguments; the
PTX test compiles every entry for both dtypes.

Layouts (all arrays may be strided; the launch wrappers in :mod:`._launch` flatten the
leading dimensions): ``N = B * H * NT`` chunks, ``BH = B * H`` heads, ``Cp`` padded chunk
steps, ``K`` key and ``V`` value channels, ``NL`` halving levels.

Numerical contract (``design.md``): every decay is a running product of ``exp(g)`` over
exactly the steps it spans, so it lies in ``[0, 1]``, a hard reset (``g = -inf``) gives an
exact 0 and no difference of cumulative sums is ever formed.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import cuda

__all__ = ["DTYPES", "SIGNATURES", "build_kernels", "compiled", "signature"]

# rows of the state passes that one thread accumulates at once (registers)
ROW_GROUP = 4

# columns of chunk_pairs that one thread computes at once (a power of two)
PAIR_GROUP = 4

# floating dtypes the kernels are compiled for
DTYPES = ("float32", "float64")

# kernel name -> argument kinds: a digit is an array of that many dimensions of the floating
# dtype, "s" a floating scalar, "i" an int64 scalar
SIGNATURES = {
    "chunk_factors": "333s3333324",
    "chunk_pairs": "334s33",
    "unit_lower_inverse": "233",
    "chunk_state_pass": "44433443",
    "chunk_state_grad_pass": "443443443",
    "chunk_pairs_backward": "33334s333",
    "chunk_gate_gradient": "33233",
    "recurrent_forward": "33332s333",
    "recurrent_backward": "33332s333i44333233",
}


def signature(name: str, dtype: str) -> str:
    """The explicit Numba signature of kernel ``name`` for the floating ``dtype``."""
    kinds = []
    for c in SIGNATURES[name]:
        if c == "s":
            kinds.append(dtype)
        elif c == "i":
            kinds.append("int64")
        else:
            kinds.append(f"{dtype}[{', '.join(':' * int(c))}]")
    return f"void({', '.join(kinds)})"


def build_kernels(dtype: str) -> dict:
    """The Python functions of every kernel, specialised to ``dtype`` by their constants."""
    fl = np.dtype(dtype).type
    nbtype = numba.from_dtype(np.dtype(dtype))
    zero = fl(0)
    one = fl(1)

    def chunk_factors(q, k, g, scale, prefix, suffix, qg, kg, kt, total, F):
        """One thread per (chunk n, channel d): running products along the chunk."""
        idx = cuda.grid(1)
        N, Cp, K = q.shape
        if idx >= N * K:
            return
        n = idx // K
        d = idx % K
        p = one
        for i in range(Cp):
            p *= math.exp(g[n, i, d])
            prefix[n, i, d] = p
            qg[n, i, d] = scale * q[n, i, d] * p
            kg[n, i, d] = k[n, i, d] * p
        total[n, d] = p
        s = one
        for i in range(Cp - 1, -1, -1):
            suffix[n, i, d] = s
            kt[n, i, d] = k[n, i, d] * s
            s *= math.exp(g[n, i, d])
        # per level: column factors over the first half, row factors over the second
        h = 1
        lv = 0
        while h < Cp:
            for start in range(0, Cp, 2 * h):
                c = one
                for j in range(start + h - 1, start - 1, -1):
                    F[n, lv, j, d] = c
                    c *= math.exp(g[n, j, d])
                r = one
                for i in range(start + h, start + 2 * h):
                    r *= math.exp(g[n, i, d])
                    F[n, lv, i, d] = r
            h *= 2
            lv += 1

    def chunk_pairs(q, k, F, scale, A, L):
        """One thread per (chunk, row i, aligned group of ``PAIR_GROUP`` columns j).

        Each pair (i, j < i) is a product through its split point, the highest bit where i and j
        differ (the level ``lv``): ``k[j] F[lv, j] F[lv, i]``, both factors in [0, 1]. Columns of
        one group left of i share that level, so the row's operands are loaded once for them.
        """
        idx = cuda.grid(1)
        N, Cp, K = q.shape
        groups = (Cp + PAIR_GROUP - 1) // PAIR_GROUP
        if idx >= N * Cp * groups:
            return
        n = idx // (Cp * groups)
        rest = idx % (Cp * groups)
        i = rest // groups
        j0 = (rest % groups) * PAIR_GROUP
        acc_a = cuda.local.array(PAIR_GROUP, nbtype)
        acc_l = cuda.local.array(PAIR_GROUP, nbtype)
        if j0 + PAIR_GROUP <= i:
            x = i ^ j0
            lv = 0
            while x > 1:
                x >>= 1
                lv += 1
            for r in range(PAIR_GROUP):
                acc_a[r] = zero
                acc_l[r] = zero
            for d in range(K):
                fi = F[n, lv, i, d]
                qi = q[n, i, d]
                ki = k[n, i, d]
                for r in range(PAIR_GROUP):
                    c = k[n, j0 + r, d] * F[n, lv, j0 + r, d] * fi
                    acc_a[r] += qi * c
                    acc_l[r] += ki * c
            for r in range(PAIR_GROUP):
                A[n, i, j0 + r] = scale * acc_a[r]
                L[n, i, j0 + r] = acc_l[r]
            return
        for r in range(PAIR_GROUP):
            j = j0 + r
            if j >= Cp:
                break
            if j > i:
                A[n, i, j] = zero
                L[n, i, j] = zero
            elif j == i:
                a = zero
                for d in range(K):
                    a += q[n, i, d] * k[n, i, d]
                A[n, i, j] = scale * a
                L[n, i, j] = zero
            else:
                x = i ^ j
                lv = 0
                while x > 1:
                    x >>= 1
                    lv += 1
                a = zero
                b = zero
                for d in range(K):
                    c = k[n, j, d] * F[n, lv, j, d] * F[n, lv, i, d]
                    a += q[n, i, d] * c
                    b += k[n, i, d] * c
                A[n, i, j] = scale * a
                L[n, i, j] = b

    def unit_lower_inverse(beta, L, Tinv):
        """One thread per (chunk, column j): forward substitution of ``(I + diag(beta) L) T = I``."""
        idx = cuda.grid(1)
        N, Cp = beta.shape
        if idx >= N * Cp:
            return
        n = idx // Cp
        j = idx % Cp
        for i in range(j):
            Tinv[n, i, j] = zero
        Tinv[n, j, j] = one
        for i in range(j + 1, Cp):
            acc = zero
            for m in range(j, i):
                acc += L[n, i, m] * Tinv[n, m, j]
            Tinv[n, i, j] = -beta[n, i] * acc

    def chunk_state_pass(w, u0, kt, total, state, boundaries, U, final):
        """One block per (head, tile of value columns), looping over every chunk.

        Threads ``x`` own value columns, threads ``y`` share the rows, ``ROW_GROUP`` rows per
        thread at a time (each loaded operand serves them all); the state lives in
        ``boundaries`` (global memory, made visible to the block by ``syncthreads``).
        """
        NT, Cp, K = w.shape[1:]
        V = u0.shape[3]
        tiles = (V + cuda.blockDim.x - 1) // cuda.blockDim.x
        bh = cuda.blockIdx.x // tiles
        v = (cuda.blockIdx.x % tiles) * cuda.blockDim.x + cuda.threadIdx.x
        ty = cuda.threadIdx.y
        ny = cuda.blockDim.y
        active = v < V
        acc = cuda.local.array(ROW_GROUP, nbtype)
        if active:
            for kk in range(ty, K, ny):
                boundaries[0, bh, kk, v] = state[bh, kk, v]
        cuda.syncthreads()
        for n in range(NT):
            if active:
                # U = u0 - w S
                for i0 in range(ty, Cp, ny * ROW_GROUP):
                    for r in range(ROW_GROUP):
                        i = i0 + r * ny
                        acc[r] = u0[bh, n, i, v] if i < Cp else zero
                    for kk in range(K):
                        s = boundaries[n, bh, kk, v]
                        for r in range(ROW_GROUP):
                            i = i0 + r * ny
                            if i < Cp:
                                acc[r] -= w[bh, n, i, kk] * s
                    for r in range(ROW_GROUP):
                        i = i0 + r * ny
                        if i < Cp:
                            U[bh, n, i, v] = acc[r]
            cuda.syncthreads()
            if active:
                # S' = total S + kt^T U
                for k0 in range(ty, K, ny * ROW_GROUP):
                    for r in range(ROW_GROUP):
                        kk = k0 + r * ny
                        acc[r] = total[bh, n, kk] * boundaries[n, bh, kk, v] if kk < K else zero
                    for i in range(Cp):
                        u = U[bh, n, i, v]
                        for r in range(ROW_GROUP):
                            kk = k0 + r * ny
                            if kk < K:
                                acc[r] += kt[bh, n, i, kk] * u
                    for r in range(ROW_GROUP):
                        kk = k0 + r * ny
                        if kk < K:
                            if n + 1 < NT:
                                boundaries[n + 1, bh, kk, v] = acc[r]
                            else:
                                final[bh, kk, v] = acc[r]
            cuda.syncthreads()

    def chunk_state_grad_pass(w, kt, total, du_local, ds_local, dstate, dends, dU, dinitial):
        """The state-gradient recurrence, last chunk first; blocks and threads as the state pass."""
        NT, Cp, K = w.shape[1:]
        V = du_local.shape[3]
        tiles = (V + cuda.blockDim.x - 1) // cuda.blockDim.x
        bh = cuda.blockIdx.x // tiles
        v = (cuda.blockIdx.x % tiles) * cuda.blockDim.x + cuda.threadIdx.x
        ty = cuda.threadIdx.y
        ny = cuda.blockDim.y
        active = v < V
        acc = cuda.local.array(ROW_GROUP, nbtype)
        if active:
            for kk in range(ty, K, ny):
                dends[NT - 1, bh, kk, v] = dstate[bh, kk, v]
        cuda.syncthreads()
        for n in range(NT - 1, -1, -1):
            if active:
                # dU = du_local + kt dS
                for i0 in range(ty, Cp, ny * ROW_GROUP):
                    for r in range(ROW_GROUP):
                        i = i0 + r * ny
                        acc[r] = du_local[bh, n, i, v] if i < Cp else zero
                    for kk in range(K):
                        s = dends[n, bh, kk, v]
                        for r in range(ROW_GROUP):
                            i = i0 + r * ny
                            if i < Cp:
                                acc[r] += kt[bh, n, i, kk] * s
                    for r in range(ROW_GROUP):
                        i = i0 + r * ny
                        if i < Cp:
                            dU[bh, n, i, v] = acc[r]
            cuda.syncthreads()
            if active:
                # dS_start = total dS + ds_local - w^T dU
                for k0 in range(ty, K, ny * ROW_GROUP):
                    for r in range(ROW_GROUP):
                        kk = k0 + r * ny
                        if kk < K:
                            acc[r] = total[bh, n, kk] * dends[n, bh, kk, v] + ds_local[bh, n, kk, v]
                        else:
                            acc[r] = zero
                    for i in range(Cp):
                        du = dU[bh, n, i, v]
                        for r in range(ROW_GROUP):
                            kk = k0 + r * ny
                            if kk < K:
                                acc[r] -= w[bh, n, i, kk] * du
                    for r in range(ROW_GROUP):
                        kk = k0 + r * ny
                        if kk < K:
                            if n > 0:
                                dends[n - 1, bh, kk, v] = acc[r]
                            else:
                                dinitial[bh, kk, v] = acc[r]
            cuda.syncthreads()

    def chunk_pairs_backward(dA, dL, q, k, F, scale, dq, dk, dg):
        """One thread per (chunk, channel d), visiting every pair twice (row side, column side).

        The gate gradient of each off-diagonal block is summed inside that block over the steps
        its factors span (suffix sums of row terms over its second half, prefix sums of column
        terms over its first half): nothing is subtracted, and the diagonal (no decay) never
        enters it.
        """
        idx = cuda.grid(1)
        N, Cp, K = q.shape
        if idx >= N * K:
            return
        n = idx // K
        d = idx % K
        for i in range(Cp):
            a = scale * dA[n, i, i]
            dq[n, i, d] = a * k[n, i, d]
            dk[n, i, d] = a * q[n, i, d]
            dg[n, i, d] = zero
        h = 1
        lv = 0
        while h < Cp:
            for start in range(0, Cp, 2 * h):
                mid = start + h
                run = zero
                for i in range(start + 2 * h - 1, mid - 1, -1):
                    fi = F[n, lv, i, d]
                    acc_q = zero
                    acc_k = zero
                    for j in range(start, mid):
                        c = k[n, j, d] * F[n, lv, j, d] * fi
                        acc_q += scale * dA[n, i, j] * c
                        acc_k += dL[n, i, j] * c
                    run += q[n, i, d] * acc_q + k[n, i, d] * acc_k
                    dg[n, i, d] += run
                    dq[n, i, d] += acc_q
                    dk[n, i, d] += acc_k
                run = zero
                for j in range(start, mid):
                    acc = zero
                    for i in range(mid, start + 2 * h):
                        acc += (scale * dA[n, i, j] * q[n, i, d] + dL[n, i, j] * k[n, i, d]) * F[n, lv, i, d]
                    fj = F[n, lv, j, d]
                    dg[n, j, d] += run
                    run += k[n, j, d] * fj * acc
                    dk[n, j, d] += acc * fj
            h *= 2
            lv += 1

    def chunk_gate_gradient(prefix_terms, suffix_terms, total_terms, pair_terms, dg):
        """One thread per (chunk, channel): a suffix sum and an exclusive prefix sum."""
        idx = cuda.grid(1)
        N, Cp, K = prefix_terms.shape
        if idx >= N * K:
            return
        n = idx // K
        d = idx % K
        run = zero
        for i in range(Cp - 1, -1, -1):
            run += prefix_terms[n, i, d]
            dg[n, i, d] = run
        run = zero
        for i in range(Cp):
            dg[n, i, d] = dg[n, i, d] + run + total_terms[n, d] + pair_terms[n, i, d]
            run += suffix_terms[n, i, d]

    def recurrent_forward(q, k, g, v, beta, scale, state, o, final):
        """One thread per (head, value column v): every column of the state evolves alone."""
        idx = cuda.grid(1)
        BH, T, K = q.shape
        V = v.shape[2]
        if idx >= BH * V:
            return
        bh = idx // V
        c = idx % V
        for kk in range(K):
            final[bh, kk, c] = state[bh, kk, c]
        for t in range(T):
            pred = zero
            for kk in range(K):
                s = math.exp(g[bh, t, kk]) * final[bh, kk, c]
                final[bh, kk, c] = s
                pred += k[bh, t, kk] * s
            u = beta[bh, t] * (v[bh, t, c] - pred)
            out = zero
            for kk in range(K):
                s = final[bh, kk, c] + k[bh, t, kk] * u
                final[bh, kk, c] = s
                out += q[bh, t, kk] * s
            o[bh, t, c] = scale * out

    def recurrent_backward(
        q, k, g, v, beta, scale, state, do, dstate, stride, ckpt, seg, dq, dk, dg, dbeta, dv, dS
    ):
        """One thread per (head, value column); reductions over columns by atomics.

        States are kept every ``stride`` steps (``ckpt``) and each segment is recomputed into
        ``seg`` on the way back. ``dq, dk, dg, dbeta`` must be zero on entry.
        """
        idx = cuda.grid(1)
        BH, T, K = q.shape
        V = v.shape[2]
        if idx >= BH * V:
            return
        bh = idx // V
        c = idx % V
        # forward, saving checkpoints; dS serves as the running state
        for kk in range(K):
            dS[bh, kk, c] = state[bh, kk, c]
        for t in range(T):
            if t % stride == 0:
                for kk in range(K):
                    ckpt[t // stride, bh, kk, c] = dS[bh, kk, c]
            pred = zero
            for kk in range(K):
                s = math.exp(g[bh, t, kk]) * dS[bh, kk, c]
                dS[bh, kk, c] = s
                pred += k[bh, t, kk] * s
            u = beta[bh, t] * (v[bh, t, c] - pred)
            for kk in range(K):
                dS[bh, kk, c] += k[bh, t, kk] * u
        for kk in range(K):
            dS[bh, kk, c] = dstate[bh, kk, c]
        nseg = (T + stride - 1) // stride
        for sg in range(nseg - 1, -1, -1):
            start = sg * stride
            stop = min(start + stride, T)
            for kk in range(K):
                seg[0, bh, kk, c] = ckpt[sg, bh, kk, c]
            for t in range(start, stop - 1):
                s0 = t - start
                pred = zero
                for kk in range(K):
                    s = math.exp(g[bh, t, kk]) * seg[s0, bh, kk, c]
                    seg[s0 + 1, bh, kk, c] = s
                    pred += k[bh, t, kk] * s
                u = beta[bh, t] * (v[bh, t, c] - pred)
                for kk in range(K):
                    seg[s0 + 1, bh, kk, c] += k[bh, t, kk] * u
            for t in range(stop - 1, start - 1, -1):
                s0 = t - start
                pred = zero
                for kk in range(K):
                    pred += k[bh, t, kk] * (math.exp(g[bh, t, kk]) * seg[s0, bh, kk, c])
                r = v[bh, t, c] - pred
                b = beta[bh, t]
                u = b * r
                dov = do[bh, t, c]
                du = zero
                for kk in range(K):
                    sd = math.exp(g[bh, t, kk]) * seg[s0, bh, kk, c]
                    cuda.atomic.add(dq, (bh, t, kk), scale * (sd + k[bh, t, kk] * u) * dov)
                    ds = dS[bh, kk, c] + scale * q[bh, t, kk] * dov
                    dS[bh, kk, c] = ds
                    du += k[bh, t, kk] * ds
                cuda.atomic.add(dbeta, (bh, t), du * r)
                dr = b * du
                dv[bh, t, c] = dr
                for kk in range(K):
                    e = math.exp(g[bh, t, kk])
                    sd = e * seg[s0, bh, kk, c]
                    ds = dS[bh, kk, c]
                    cuda.atomic.add(dk, (bh, t, kk), ds * u - sd * dr)
                    dsd = ds - k[bh, t, kk] * dr
                    cuda.atomic.add(dg, (bh, t, kk), dsd * sd)
                    dS[bh, kk, c] = e * dsd

    return {
        "chunk_factors": chunk_factors,
        "chunk_pairs": chunk_pairs,
        "unit_lower_inverse": unit_lower_inverse,
        "chunk_state_pass": chunk_state_pass,
        "chunk_state_grad_pass": chunk_state_grad_pass,
        "chunk_pairs_backward": chunk_pairs_backward,
        "chunk_gate_gradient": chunk_gate_gradient,
        "recurrent_forward": recurrent_forward,
        "recurrent_backward": recurrent_backward,
    }


_PYFUNCS: dict = {}
_COMPILED: dict = {}


def compiled(name: str, dtype: str):
    """Kernel ``name`` for ``dtype``, compiled on first use with its explicit signature."""
    key = (name, dtype)
    kernel = _COMPILED.get(key)
    if kernel is None:
        if dtype not in _PYFUNCS:
            _PYFUNCS[dtype] = build_kernels(dtype)
        kernel = cuda.jit(signature(name, dtype))(_PYFUNCS[dtype][name])
        _COMPILED[key] = kernel
    return kernel
