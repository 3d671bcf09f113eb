"""Decoding from a state pool on the GPU: one kernel gathers, steps, scatters and writes outputs.

One thread per (request ``n``, value head ``h``, value column ``c``) owns column ``c`` of its
request's state row and updates it in place in the pool (rows are distinct, so no two threads
share a column). Per step, with ``e = exp(g_t)``, it reads the column once for both products::

    pred = sum_d k[d] e[d] S[d, c]        qs = sum_d q[d] e[d] S[d, c]
    u    = beta (v[c] - pred)             o[c] = scale (qs + (q . k) u)
    S[d, c] = e[d] S[d, c] + k[d] u       (written back)

Adjacent threads hold adjacent columns, so every pool access is coalesced. Padding requests
(index ``-1``) write zero outputs and touch no state. The kernel is compiled once per dtype.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from array_api_compat import array_namespace, device, is_cupy_array
from numba import cuda

from ._kernels import DTYPES
from ._launch import LAUNCHES

__all__ = ["SIGNATURE", "build_decode_kernel", "compiled_decode", "decode_forward", "decode_signature"]

NAME = "decode_forward"

# q, k, g, v: 4-D; beta: 3-D; scale; pool: 4-D; indices: int64 1-D; output: 4-D
SIGNATURE = "void({a4}, {a4}, {a4}, {a4}, {a3}, {s}, {a4}, int64[:], {a4})"

THREADS_PER_BLOCK = 128

_COMPILED: dict[str, Any] = {}


def decode_signature(dtype: str) -> str:
    """The explicit Numba signature of the decode kernel for the floating ``dtype``."""
    return SIGNATURE.format(a4=f"{dtype}[:, :, :, :]", a3=f"{dtype}[:, :, :]", s=dtype)


def build_decode_kernel(dtype: str):
    """The kernel's Python function, closed over the constants of ``dtype`` (no float64 promotion)."""
    zero = np.dtype(dtype).type(0)

    def decode_forward(q, k, g, v, beta, scale, pool, indices, o):
        idx = cuda.grid(1)
        N, HV, T, K = q.shape
        V = v.shape[3]
        if idx >= N * HV * V:
            return
        n = idx // (HV * V)
        h = (idx // V) % HV
        c = idx % V
        row = indices[n]
        if row < 0:
            for t in range(T):
                o[n, h, t, c] = zero
            return
        for t in range(T):
            pred = zero
            qs = zero
            qk = zero
            for d in range(K):
                s = math.exp(g[n, h, t, d]) * pool[row, h, d, c]
                pred += k[n, h, t, d] * s
                qs += q[n, h, t, d] * s
                qk += q[n, h, t, d] * k[n, h, t, d]
            u = beta[n, h, t] * (v[n, h, t, c] - pred)
            o[n, h, t, c] = scale * (qs + qk * u)
            for d in range(K):
                pool[row, h, d, c] = math.exp(g[n, h, t, d]) * pool[row, h, d, c] + k[n, h, t, d] * u

    return decode_forward


def compiled_decode(dtype: str):
    """The decode kernel for ``dtype``, compiled on first use."""
    kernel = _COMPILED.get(dtype)
    if kernel is None:
        kernel = cuda.jit(decode_signature(dtype))(build_decode_kernel(dtype))
        _COMPILED[dtype] = kernel
    return kernel


def _launch(dtype: str, grid: int, *args: Any) -> None:
    """One launch on the caller's CuPy stream (or the simulator's default stream)."""
    kernel = compiled_decode(dtype)
    if any(is_cupy_array(a) for a in args):
        import cupy

        ptr = cupy.cuda.get_current_stream().ptr
        stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()
        args = tuple(cuda.as_cuda_array(a, sync=False) if is_cupy_array(a) else a for a in args)
    else:  # the simulator: inputs as contiguous host buffers; the pool itself, to update it in place
        stream = 0
        pool = args[6]
        args = tuple(
            a if a is pool or not isinstance(a, np.ndarray) else np.ascontiguousarray(a) for a in args
        )
    kernel[grid, THREADS_PER_BLOCK, stream](*args)
    LAUNCHES[NAME] += 1


def decode_forward(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, pool: Any, indices: Any) -> Any:
    """The CUDA backend of :func:`kda.reference.decode_forward`, in one kernel launch.

    ``q, k, g: [N, HV, T, K]``, ``v: [N, HV, T, V]``, ``beta: [N, HV, T]`` and
    ``pool: [P, HV, K, V]`` of one dtype (float32 or float64); ``indices``: ``N`` host ints.
    Returns the output ``[N, HV, T, V]``; the named pool rows are updated in place.
    """
    xp = array_namespace(q, k, v, g, beta, pool)
    dtype = str(pool.dtype)
    if dtype not in DTYPES or any(x.dtype != pool.dtype for x in (q, k, v, g, beta)):
        got = [str(x.dtype) for x in (q, k, v, g, beta, pool)]
        msg = f"decode_forward: all arrays must share one dtype in {DTYPES}; got {got}"
        raise TypeError(msg)
    N, HV, T, V = v.shape
    out = xp.empty((N, HV, T, V), dtype=v.dtype, device=device(v))
    rows = xp.asarray(list(indices), dtype=xp.int64, device=device(pool))
    grid = -(-N * HV * V // THREADS_PER_BLOCK)
    if grid and T:
        _launch(dtype, grid, q, k, g, v, beta, pool.dtype.type(scale), pool, rows, out)
    return out
