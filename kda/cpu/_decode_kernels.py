"""The Numba kernel of the CPU backend's decode (imported on first use: this imports numba).

:func:`decode` runs the items ``[lo, hi)`` of ``N * HV`` (request, value head) pairs. Each item
reads its request's start state from ``src``, runs the request's steps and writes the state after
each step into ``dst`` (the same array for an in-place pool) or, where no slot is named, into a
scratch state of its own. Per step, with ``e = exp(g_t)``, the state is read once for both
products and once more for the update::

    pred = (k e)^T S        qs = (q e)^T S             # pass 1: reads S
    u    = beta (v - pred)   o = scale (qs + (q . k) u)  # = scale S_t^T q_t
    D    = e[:, None] S + k u^T                          # pass 2: reads S, writes D (D may be S)

so a step moves ``3 K V`` elements of state (two reads, one write) and nothing else of that size.
The inner loops run over the ``V`` contiguous columns and vectorise. ``g = -inf`` gives
``e = 0`` exactly. No sum crosses items, so results do not depend on how items are split.

LLVM vectorises those loops behind run-time checks that the array a loop stores to does not sit
just past one it loads from, and falls back to scalar code, whose fused multiply-adds round
differently, where the check fails. The kernel's own vectors and scratch state therefore live in
one private buffer, at fixed offsets with a guard of :data:`GUARD` elements around each, and no
loop stores to one caller's array while loading another's (but a pool row from a pool row: the
same pool on every thread): a check's answer then cannot depend on where the heap of the thread
that runs an item put its allocations. (Before, with the vectors allocated on their own and the
output loop storing ``pred`` and ``o`` at once, a step's output was seen to depend on where its
vectors sat, by an ulp (float64, ``K=8, V=24``); the likely cause of a call split over two
threads that once differed from the one-thread call.)
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["decode"]

# No nnan/ninf: -inf gates must stay exact. Reassociation lets the column loops vectorise; the
# compiled order is fixed, so results are deterministic.
_OPTIONS = {"nogil": True, "fastmath": {"reassoc", "contract"}, "error_model": "numpy", "boundscheck": False}

try:
    _jit = numba.njit(cache=True, **_OPTIONS)
    CACHING = True
except (RuntimeError, OSError):  # pragma: no cover - numba: no cache locator (read-only install)
    _jit = numba.njit(cache=False, **_OPTIONS)
    CACHING = False

# elements around each of the kernel's private vectors (512 bytes of float32, 1 KiB of float64):
# more than a vectorised loop's reach (4 x 16 float32 or 4 x 8 float64 lanes, 256 bytes)
GUARD = 128


@_jit
def _step(S, D, write, q, k, v, g, b, scale, o, e, pred, qs, zero):
    """One step from ``S: [K, V]`` into ``D`` (``write``; ``D`` may be ``S``); ``o: [V]`` output."""
    K, V = S.shape
    for d in range(K):
        e[d] = np.exp(g[d])
    qk = zero
    for d in range(K):  # a sum in a loop that stores nothing: one compiled order
        qk += q[d] * k[d]
    for c in range(V):
        pred[c] = 0
        qs[c] = 0
    d4 = K - K % 4
    for d in range(0, d4, 4):  # four rows per sweep: a quarter of the loads and stores of pred, qs
        k0, k1, k2, k3 = k[d] * e[d], k[d + 1] * e[d + 1], k[d + 2] * e[d + 2], k[d + 3] * e[d + 3]
        q0, q1, q2, q3 = q[d] * e[d], q[d + 1] * e[d + 1], q[d + 2] * e[d + 2], q[d + 3] * e[d + 3]
        S0, S1, S2, S3 = S[d], S[d + 1], S[d + 2], S[d + 3]
        for c in range(V):
            a0, a1, a2, a3 = S0[c], S1[c], S2[c], S3[c]
            pred[c] += (k0 * a0 + k1 * a1) + (k2 * a2 + k3 * a3)
            qs[c] += (q0 * a0 + q1 * a1) + (q2 * a2 + q3 * a3)
    for d in range(d4, K):
        kd = k[d] * e[d]
        qd = q[d] * e[d]
        for c in range(V):
            s = S[d, c]
            pred[c] += kd * s
            qs[c] += qd * s
    for c in range(V):
        pred[c] = b * (v[c] - pred[c])  # u
    for c in range(V):
        o[c] = scale * (qs[c] + qk * pred[c])
    if write and D.ctypes.data == S.ctypes.data:
        # in place, written as such: LLVM's overlap check would send the general loop to scalar code
        for d in range(K):
            ed = e[d]
            kd = k[d]
            for c in range(V):
                D[d, c] = ed * D[d, c] + kd * pred[c]
    elif write:
        for d in range(K):
            ed = e[d]
            kd = k[d]
            for c in range(V):
                D[d, c] = ed * S[d, c] + kd * pred[c]


@_jit
def decode(q, k, v, g, beta, scale, src, dst, start, dest, offsets, out, lo, hi):
    """Items ``[lo, hi)`` of ``N * HV`` (request ``n``, head ``h``) pairs.

    ``q, k, g: [B, HV, T, K]``, ``v, out: [B, HV, T, V]``, ``beta: [B, HV, T]``; ``src, dst:
    [P, HV, K, V]`` (may be one array); ``start: [N]``, ``dest: [N, W]`` int64 rows (``W == 1``:
    every step writes row ``dest[n, 0]``, so the last one leaves the final state there; else step
    ``t`` writes ``dest[n, t]``; ``< 0``: not written); ``offsets``: ``[N + 1]`` (request ``n`` is
    steps ``offsets[n]:offsets[n + 1]`` of batch row 0) or empty (request ``n`` is batch row ``n``).
    A request with ``start[n] < 0`` is padding: zero outputs, no state read or written.
    """
    _B, HV, T, K = q.shape
    V = v.shape[3]
    W = dest.shape[1]
    packed = offsets.shape[0] > 0
    work = np.empty(4 * GUARD + K + 2 * V, q.dtype)  # e, pred, qs at fixed offsets (see above)
    e = work[GUARD : GUARD + K]
    pred = work[2 * GUARD + K : 2 * GUARD + K + V]
    qs = work[3 * GUARD + K + V : 3 * GUARD + K + 2 * V]
    zero = np.zeros(1, q.dtype)[0]
    none = np.empty((0, 0), q.dtype)  # stands for "no state" (typed as the writable states)
    scratch = none  # a private state, made the first time a step has no slot but is not the last
    for item in range(lo, hi):
        n = item // HV
        h = item - n * HV
        b, t0, steps = n, 0, T
        if packed:
            b, t0, steps = 0, offsets[n], offsets[n + 1] - offsets[n]
        o = out[b, h]
        row = start[n]
        if row < 0:
            for t in range(t0, t0 + steps):
                for c in range(V):
                    o[t, c] = 0
            continue
        first = src[row, h]  # read only: src may be a read-only array (a JAX buffer)
        S = none  # the current state after the first step (writable)
        for t in range(steps):
            slot = dest[n, 0] if W == 1 else dest[n, t]
            write = True
            if slot >= 0:
                D = dst[slot, h]
            elif t == steps - 1:
                D = none
                write = False  # the last state is not kept: outputs only
            else:
                if scratch.shape[0] != K:
                    guarded = np.empty(2 * GUARD + K * V, q.dtype)
                    scratch = guarded[GUARD : GUARD + K * V].reshape(K, V)
                D = scratch
            i = t0 + t
            if t == 0:
                _step(first, D, write, q[b, h, i], k[b, h, i], v[b, h, i], g[b, h, i], beta[b, h, i], scale,
                      o[i], e, pred, qs, zero)  # fmt: skip
            else:
                _step(S, D, write, q[b, h, i], k[b, h, i], v[b, h, i], g[b, h, i], beta[b, h, i], scale,
                      o[i], e, pred, qs, zero)  # fmt: skip
            S = D
        if steps == 0 and W == 1 and dest[n, 0] >= 0:
            dst[dest[n, 0], h, :, :] = first  # no steps: the final state is the start state


@_jit
def _finite(x):
    """Whether every element of ``x`` is finite: ``x * 0`` is NaN exactly where ``x`` is NaN or
    infinite (never folded to 0: no nnan / nsz), and a sum keeps a NaN; branch-free, it vectorises."""
    acc = 0.0
    for i in range(x.size):
        acc += x[i] * 0.0
    return acc == 0.0


@_jit
def _log_decays(g):
    """Whether every ``g <= 0`` (``-inf`` allowed; NaN and positive values fail); branch-free."""
    bad = 0
    for i in range(g.size):
        bad += not g[i] <= 0
    return bad == 0


@_jit
def screen(q, k, v, g, beta, finite):
    """Whether every ``g <= 0`` (``-inf`` allowed, NaN not) and, with ``finite``, every element of
    ``q, k, v, beta`` is finite: one pass over the (small) inputs, flattened C-contiguous arrays."""
    if not _log_decays(g):
        return False
    if finite:
        return _finite(q) and _finite(k) and _finite(v) and _finite(beta)
    return True
