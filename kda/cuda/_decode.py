"""Decoding from a state pool on the GPU: one kernel gathers, steps, scatters and writes outputs.

One thread per (request ``n``, value head ``h``, value column ``c``) owns column ``c`` of its
request's state row and updates it in place in the pool (rows are distinct, so no two threads
share a column). Per step, with ``e = exp(g_t)``, it reads the column once for both products::

    pred = sum_d k[d] e[d] S[d, c]        qs = sum_d q[d] e[d] S[d, c]
    u    = beta (v[c] - pred)             o[c] = scale (qs + (q . k) u)
    S[d, c] = e[d] S[d, c] + k[d] u       (written back)

Adjacent threads hold adjacent columns, so every pool access is coalesced. Padding requests
(index ``-1``) write zero outputs and touch no state. Every array is passed flattened with its
dimensions, offsets in 32 bits where the sizes allow (as in :mod:`._kernels`); the kernel is
compiled once per (dtype, index type).
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

# q, k, g, v, beta: flattened; scale; pool: flattened; indices: int64 1-D; output: flattened;
# dims = (N, HV, T, K, V) in the index type
SIGNATURE = "void({a}, {a}, {a}, {a}, {a}, {s}, {a}, int64[::1], {a}, UniTuple({d}, 5))"

THREADS_PER_BLOCK = 128

_COMPILED: dict[tuple[str, str], Any] = {}


def decode_signature(dtype: str, index: str = "uint32") -> str:
    """The explicit Numba signature of the decode kernel for the floating ``dtype`` and ``index`` type.

    Every array is passed flattened (C-contiguous, 1-D): the kernel computes its offsets in
    ``index`` arithmetic from the trailing dimensions ``(N, HV, T, K, V)``, as the kernels of
    :mod:`._kernels` do.
    """
    return SIGNATURE.format(a=f"{dtype}[::1]", s=dtype, d=INDEX_TYPES[index])


def build_decode_kernel(dtype: str, index: str = "uint32"):
    """The kernel's Python function, closed over the constants of ``dtype`` (no float64 promotion)
    and the offset functions of ``index``."""
    zero = np.dtype(dtype).type(0)
    at2, at3, _ = offset_functions(index)

    def decode_forward(q, k, g, v, beta, scale, pool, indices, o, dims):
        """``q, k, g``: ``[N, HV, T, K]``, ``v, o``: ``[N, HV, T, V]``, ``beta``: ``[N, HV, T]``
        and ``pool``: ``[P, HV, K, V]``, all flattened; ``dims = (N, HV, T, K, V)``."""
        idx = cuda.grid(1)
        N, HV, T, K, V = dims
        c = idx % V
        h = (idx // V) % HV
        n = idx // V // HV  # not idx >= N * HV * V: uint32 products are uint64, compared in float64
        if n >= N:
            return
        head = at2(n, h, HV)
        row = indices[n]
        if row < 0:
            for t in range(T):
                o[at3(head, t, c, T, V)] = zero
            return
        state = at2(row, h, HV)  # the [K, V] state of (row, h) in the pool
        for t in range(T):
            step = at2(head, t, T)
            pred = zero
            qs = zero
            qk = zero
            for d in range(K):
                td = at2(step, d, K)
                s = math.exp(g[td]) * pool[at3(state, d, c, K, V)]
                pred += k[td] * s
                qs += q[td] * s
                qk += q[td] * k[td]
            u = beta[step] * (v[at2(step, c, V)] - pred)
            o[at2(step, c, V)] = scale * (qs + qk * u)
            for d in range(K):
                td = at2(step, d, K)
                dc = at3(state, d, c, K, V)
                pool[dc] = math.exp(g[td]) * pool[dc] + k[td] * u

    return decode_forward


def compiled_decode(dtype: str, index: str = "uint32"):
    """The decode kernel for ``dtype`` and ``index``, compiled on first use."""
    key = (dtype, index)
    kernel = _COMPILED.get(key)
    if kernel is None:
        kernel = cuda.jit(decode_signature(dtype, index))(build_decode_kernel(dtype, index))
        _COMPILED[key] = kernel
    return kernel


def decode_forward(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, pool: Any, indices: Any) -> Any:
    """The CUDA backend of :func:`kda.reference.decode_forward`, in one kernel launch.

    ``q, k, g: [N, HV, T, K]``, ``v: [N, HV, T, V]``, ``beta: [N, HV, T]`` and
    ``pool: [P, HV, K, V]`` of one dtype (float32 or float64); ``indices``: ``N`` host ints.
    Returns the output ``[N, HV, T, V]``; the named pool rows are updated in place (through a
    C-contiguous copy of the pool, written back, where the pool itself is not C-contiguous).
    """
    xp = array_namespace(q, k, v, g, beta, pool)
    dtype = str(pool.dtype)
    if dtype not in DTYPES or any(x.dtype != pool.dtype for x in (q, k, v, g, beta)):
        got = [str(x.dtype) for x in (q, k, v, g, beta, pool)]
        msg = f"decode_forward: all arrays must share one dtype in {DTYPES}; got {got}"
        raise TypeError(msg)
    N, HV, T, V = v.shape
    K = q.shape[-1]
    out = xp.empty((N, HV, T, V), dtype=v.dtype, device=device(v))
    rows = xp.asarray(list(indices), dtype=xp.int64, device=device(pool))
    grid = -(-N * HV * V // THREADS_PER_BLOCK)
    if grid and T:
        work = _c(NAME, pool)  # the kernel updates it in place: copied back below if need be
        args = (q, k, g, v, beta, pool.dtype.type(scale), work, rows, out)
        kernel_for = partial(compiled_decode, dtype)
        launch(NAME, kernel_for, grid, THREADS_PER_BLOCK, *args, dims=(N, HV, T, K, V))
        if work is not pool:
            pool[...] = work
    return out
