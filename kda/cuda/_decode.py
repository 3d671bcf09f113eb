"""Decoding from a state pool on the GPU: one kernel reads the start rows, steps, writes the slots.

One thread per (request ``n``, value head ``h``, value column ``c``) owns column ``c`` of its
request's state. Per step, with ``e = exp(g_t)``, it reads the column of the current state
(first the start row of ``src``) once for both products and once for the update, which it writes
to the step's slot in ``dst`` (or, when the step names no slot and a later step follows, to its
column of a scratch state)::

    pred = sum_d k[d] e[d] S[d, c]        qs = sum_d q[d] e[d] S[d, c]
    u    = beta (v[c] - pred)             o[c] = scale (qs + (q . k) u)
    D[d, c] = e[d] S[d, c] + k[d] u       (D: the slot's row, or the scratch)

Rows named in one call are distinct across requests, so no two threads share a column; a thread
reads a column before it writes it, so a request may write the row it started from. Adjacent
threads hold adjacent columns: every pool access is coalesced. Padding requests (start ``-1``)
write zero outputs and touch no state. Every array is passed flattened with its dimensions,
offsets in 32 bits where the sizes allow (as in :mod:`._device`); the kernel is compiled once
per (dtype, index type).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import numpy as np
from array_api_compat import array_namespace, device
from numba import cuda

from ._device import DTYPES, INDEX_TYPES, offset_functions
from ._launch import _c, launch

__all__ = ["SIGNATURE", "build_decode_kernel", "compiled_decode", "decode_forward", "decode_signature"]

NAME = "decode_forward"

# q, k, g, v, beta: flattened; scale; src, dst pools: flattened; start [N], dest [N, W], offsets
# [N + 1] or empty: int64 1-D; scratch: flattened [N, HV, K, V] or 1 element; output: flattened;
# dims = (N, HV, T, K, V, W) in the index type
SIGNATURE = (
    "void({a}, {a}, {a}, {a}, {a}, {s}, {a}, {a}, int64[::1], int64[::1], int64[::1], {a}, {a}, "
    "UniTuple({d}, 6))"
)

THREADS_PER_BLOCK = 128

_COMPILED: dict[tuple[str, str], Any] = {}


def decode_signature(dtype: str, index: str = "uint32") -> str:
    """The explicit Numba signature of the decode kernel for the floating ``dtype`` and ``index`` type.

    Every array is passed flattened (C-contiguous, 1-D): the kernel computes its offsets in
    ``index`` arithmetic from the trailing dimensions ``(N, HV, T, K, V, W)``, as the kernels of
    :mod:`._device` do.
    """
    return SIGNATURE.format(a=f"{dtype}[::1]", s=dtype, d=INDEX_TYPES[index])


def build_decode_kernel(dtype: str, index: str = "uint32"):
    """The kernel's Python function, closed over the constants of ``dtype`` (no float64 promotion)
    and the offset functions of ``index``."""
    zero = np.dtype(dtype).type(0)
    at2, at3, _ = offset_functions(index)

    def decode_forward(q, k, g, v, beta, scale, src, dst, start, dest, offsets, scratch, o, dims):
        """``q, k, g``: ``[B, HV, T, K]``, ``v, o``: ``[B, HV, T, V]``, ``beta``: ``[B, HV, T]``,
        ``src``, ``dst``: ``[P, HV, K, V]``, all flattened; ``dims = (N, HV, T, K, V, W)``."""
        idx = cuda.grid(1)
        N, HV, T, K, V, W = dims
        c = idx % V
        h = (idx // V) % HV
        n = idx // V // HV  # not idx >= N * HV * V: uint32 products are uint64, compared in float64
        if n >= N:
            return
        b, t0, steps = n, n - n, T
        if offsets.shape[0] > 0:
            b, t0, steps = n - n, offsets[n], offsets[n + 1] - offsets[n]
        head = at2(b, h, HV)
        row = start[n]
        if row < 0:
            for t in range(steps):
                o[at3(head, t0 + t, c, T, V)] = zero
            return
        cur = src
        state = at2(row, h, HV)  # the [K, V] state of (row, h) in cur
        for t in range(steps):
            slot = dest[at2(n, 0, W)] if W == 1 else dest[at2(n, t, W)]
            step = at2(head, t0 + t, T)
            pred = zero
            qs = zero
            qk = zero
            for d in range(K):
                td = at2(step, d, K)
                s = math.exp(g[td]) * cur[at3(state, d, c, K, V)]
                pred += k[td] * s
                qs += q[td] * s
                qk += q[td] * k[td]
            u = beta[step] * (v[at2(step, c, V)] - pred)
            o[at2(step, c, V)] = scale * (qs + qk * u)
            if slot >= 0:
                nxt, into = dst, at2(slot, h, HV)
            elif t + 1 < steps:
                nxt, into = scratch, at2(n, h, HV)
            else:
                break  # the last state is not kept
            for d in range(K):
                td = at2(step, d, K)
                nxt[at3(into, d, c, K, V)] = math.exp(g[td]) * cur[at3(state, d, c, K, V)] + k[td] * u
            cur, state = nxt, into
        if steps == 0 and W == 1 and dest[n] >= 0:
            into = at2(dest[n], h, HV)
            for d in range(K):
                dst[at3(into, d, c, K, V)] = cur[at3(state, d, c, K, V)]

    return decode_forward


def compiled_decode(dtype: str, index: str = "uint32"):
    """The decode kernel for ``dtype`` and ``index``, compiled on first use."""
    key = (dtype, index)
    kernel = _COMPILED.get(key)
    if kernel is None:
        kernel = cuda.jit(decode_signature(dtype, index))(build_decode_kernel(dtype, index))
        _COMPILED[key] = kernel
    return kernel


def _contiguous(x: Any) -> bool:
    flags = getattr(x, "flags", None)
    return flags is None or bool(flags.c_contiguous)


def _has_holes(start: Any, dest: Any, offsets: Any) -> bool:
    """Whether a running request names no slot for a step that another step follows (host arrays)."""
    if dest.shape[1] == 1:
        return False
    T = dest.shape[1]
    lengths = np.diff(offsets) if offsets is not None else np.full(len(start), T)
    used = np.arange(T)[None, :] < (lengths[:, None] - 1)
    return bool(np.any((dest < 0) & used & (start[:, None] >= 0)))


def decode_forward(
    q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, pool: Any, start: Any, dest: Any,
    offsets: Any = None, final_pool: Any = None, out: Any = None,
) -> Any:  # fmt: skip
    """The CUDA backend of :func:`kda.reference.decode_forward`, in one kernel launch.

    ``q, k, g: [B, HV, T, K]``, ``v: [B, HV, T, V]``, ``beta: [B, HV, T]`` and
    ``pool: [P, HV, K, V]`` of one dtype (float32 or float64); ``start [N]``, ``dest [N, W]`` and
    ``offsets [N + 1]`` (or None) int64 host arrays. Returns the output ``[B, HV, T, V]``; the
    slots' rows of ``final_pool`` (default ``pool``) are written in place (through a
    C-contiguous copy, written back, where the pool itself is not C-contiguous); ``out``: a
    C-contiguous output buffer, or None.
    """
    xp = array_namespace(q, k, v, g, beta, pool)
    dtype = str(pool.dtype)
    if dtype not in DTYPES or any(x.dtype != pool.dtype for x in (q, k, v, g, beta)):
        got = [str(x.dtype) for x in (q, k, v, g, beta, pool)]
        msg = f"decode_forward: all arrays must share one dtype in {DTYPES}; got {got}"
        raise TypeError(msg)
    B, HV, T, V = v.shape
    K = q.shape[-1]
    N, W = dest.shape
    if out is None or out.dtype != v.dtype or tuple(out.shape) != (B, HV, T, V) or not _contiguous(out):
        out = xp.empty((B, HV, T, V), dtype=v.dtype, device=device(v))
    if out.size == 0:
        return out
    dev = device(pool)
    ints = [xp.asarray(np.array(x, np.int64).reshape(-1), device=dev)  # copies: the simulator writes back
            for x in (start, dest, np.zeros(0, np.int64) if offsets is None else offsets)]  # fmt: skip
    holes = _has_holes(start, dest, offsets)
    scratch = xp.empty((N, HV, K, V) if holes else (1,), dtype=pool.dtype, device=dev)
    dst = pool if final_pool is None else final_pool
    src_work = _c(NAME, pool)  # the kernel writes dst in place: copied back below if need be
    if isinstance(src_work, np.ndarray) and not src_work.flags.writeable:
        src_work = src_work.copy()  # the simulator copies every argument back to the host
    dst_work = src_work if dst is pool else _c(NAME, dst)
    args = (q, k, g, v, beta, pool.dtype.type(scale), src_work, dst_work, *ints, scratch, out)
    grid = -(-N * HV * V // THREADS_PER_BLOCK)
    launch(NAME, partial(compiled_decode, dtype), grid, THREADS_PER_BLOCK, *args, dims=(N, HV, T, K, V, W))
    if dst_work is not dst:
        dst[...] = dst_work
    return out
