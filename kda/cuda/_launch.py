"""Launch wrappers: the primitive interface of :mod:`kda.reference`, run by Numba-CUDA kernels.

Each wrapper validates its arrays, flattens the leading dimensions, allocates the outputs in
the caller's namespace, sizes the grid and launches one kernel on the current CuPy stream
(CuPy arrays) or on the default stream (NumPy arrays under Numba's CUDA simulator). Every
launch is counted in :data:`LAUNCHES`.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numba
from array_api_compat import array_namespace, device, is_cupy_array
from numba import cuda

from ..reference._chunk import ChunkFactors, from_chunks, to_chunks
from ._kernels import DTYPES, PAIR_GROUP, compiled

__all__ = [
    "LAUNCHES",
    "chunk_factors",
    "chunk_gate_gradient",
    "chunk_pairs",
    "chunk_pairs_backward",
    "chunk_state_grad_pass",
    "chunk_state_pass",
    "from_chunks",
    "recurrent_backward",
    "recurrent_forward",
    "to_chunks",
    "unit_lower_inverse",
]

# threads per block of the one-thread-per-output kernels
THREADS_PER_BLOCK = 128
# value columns per block of the state passes (threads x), and threads sharing their rows (y):
# 8 x 16 gives B * H * V / 8 blocks (256 at B=1, H=16, V=128) of 128 threads, 32-byte rows
STATE_TILE_V = 8
STATE_ROWS = 16
# the simulator pays per thread at every syncthreads: one row thread there
SIMULATOR_STATE_ROWS = 1

# kernel name -> number of launches since import (or since the last clear())
LAUNCHES: Counter = Counter()


def _dtype_name(name: str, *arrays: Any) -> str:
    dt = arrays[0].dtype
    for x in arrays[1:]:
        if x.dtype != dt:
            msg = f"{name}: all arrays must share one dtype; got {dt} and {x.dtype}"
            raise TypeError(msg)
    dname = str(dt)
    if dname not in DTYPES:
        msg = f"{name}: the CUDA kernels compute in {' or '.join(DTYPES)}; got {dname}"
        raise TypeError(msg)
    return dname


def _check_shape(name: str, arg: str, x: Any, shape: tuple[int, ...]) -> None:
    if tuple(int(n) for n in x.shape) != tuple(shape):
        msg = f"{name}: {arg} must have shape {tuple(shape)}; got {tuple(x.shape)}"
        raise ValueError(msg)


def _check_ndim(name: str, arg: str, x: Any, ndim: int) -> None:
    if len(x.shape) != ndim:
        msg = f"{name}: {arg} must have {ndim} dimensions; got shape {tuple(x.shape)}"
        raise ValueError(msg)


def _empty(xp: Any, like: Any, shape: tuple[int, ...]) -> Any:
    return xp.empty(shape, dtype=like.dtype, device=device(like))


def _zeros(xp: Any, like: Any, shape: tuple[int, ...]) -> Any:
    return xp.zeros(shape, dtype=like.dtype, device=device(like))


def _contiguous(a: Any) -> Any:
    flags = getattr(a, "flags", None)
    if flags is None or flags.c_contiguous:
        return a
    import numpy as np

    return np.ascontiguousarray(a)


def _launch(name: str, dtype: str, grid: int, block: Any, *args: Any) -> None:
    """Launch kernel ``name`` on the caller's stream; nothing to do for an empty grid."""
    if grid == 0:
        return
    kernel = compiled(name, dtype)
    if any(is_cupy_array(a) for a in args):
        import cupy

        ptr = cupy.cuda.get_current_stream().ptr
        stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()
        # same stream as CuPy's work: no host synchronisation on the arrays' stream is needed
        args = tuple(cuda.as_cuda_array(a, sync=False) if is_cupy_array(a) else a for a in args)
    else:
        # host arrays (the simulator) travel as one contiguous buffer; outputs already are one
        stream = 0
        args = tuple(_contiguous(a) for a in args)
    kernel[grid, block, stream](*args)
    LAUNCHES[name] += 1


def _grid(threads: int) -> int:
    return -(-threads // THREADS_PER_BLOCK)


def _state_block(V: int) -> tuple[int, int]:
    rows = SIMULATOR_STATE_ROWS if numba.config.ENABLE_CUDASIM else STATE_ROWS
    return min(STATE_TILE_V, max(V, 1)), rows


def _flat(xp: Any, x: Any, lead: int) -> Any:
    """Merge the first ``lead`` dimensions of ``x`` into one."""
    return xp.reshape(x, (math.prod(x.shape[:lead]), *x.shape[lead:]))


def _factors_match(f: Any, N: int, Cp: int, K: int) -> bool:
    F = getattr(f, "private", None)
    shape = tuple(getattr(F, "shape", ()))
    return len(shape) == 4 and (shape[0], *shape[2:]) == (N, Cp, K)


def chunk_factors(q: Any, k: Any, g: Any, scale: float) -> ChunkFactors:
    """Decay factors and gated queries and keys of every chunk (``q, k, g: [..., Cp, K]``).

    ``private`` holds the factors of every halving level, ``[N, NL, Cp, K]`` with
    ``N = B * H * NT``: column factors over each block's first half, row factors over its second.
    """
    name = "chunk_factors"
    xp = array_namespace(q, k, g)
    dtype = _dtype_name(name, q, k, g)
    _check_ndim(name, "q", q, 5)
    _check_shape(name, "k", k, q.shape)
    _check_shape(name, "g", g, q.shape)
    B, H, NT, Cp, K = q.shape
    if Cp & (Cp - 1):
        msg = f"{name}: the padded chunk size must be a power of two; got {Cp}"
        raise ValueError(msg)
    N = B * H * NT
    NL = max(Cp.bit_length() - 1, 1)
    outs = [_empty(xp, q, (N, Cp, K)) for _ in range(5)]
    total = _empty(xp, q, (N, K))
    F = _zeros(xp, q, (N, NL, Cp, K))
    flat = [_flat(xp, x, 3) for x in (q, k, g)]
    _launch(name, dtype, _grid(N * K), THREADS_PER_BLOCK, *flat, q.dtype.type(scale), *outs, total, F)
    prefix, suffix, qg, kg, kt = (xp.reshape(x, q.shape) for x in outs)
    return ChunkFactors(prefix, suffix, xp.reshape(total, (B, H, NT, K)), qg, kg, kt, private=F)


def chunk_pairs(q: Any, k: Any, f: ChunkFactors, scale: float) -> tuple[Any, Any]:
    """Decayed pairwise products ``A`` (lower, diagonal included) and ``L`` (strictly lower)."""
    name = "chunk_pairs"
    xp = array_namespace(q, k)
    _check_ndim(name, "q", q, 5)
    _check_shape(name, "k", k, q.shape)
    B, H, NT, Cp, K = q.shape
    N = B * H * NT
    if not _factors_match(f, N, Cp, K):
        msg = f"{name}: f must come from kda.cuda.chunk_factors of the same chunks"
        raise ValueError(msg)
    dtype = _dtype_name(name, q, k, f.private)
    A = _empty(xp, q, (N, Cp, Cp))
    L = _empty(xp, q, (N, Cp, Cp))
    args = (_flat(xp, q, 3), _flat(xp, k, 3), f.private, q.dtype.type(scale), A, L)
    _launch(name, dtype, _grid(N * Cp * -(-Cp // PAIR_GROUP)), THREADS_PER_BLOCK, *args)
    shape = (B, H, NT, Cp, Cp)
    return xp.reshape(A, shape), xp.reshape(L, shape)


def unit_lower_inverse(beta: Any, L: Any) -> Any:
    """``(I + diag(beta) L)^-1`` of every chunk (``beta: [..., Cp]``, ``L: [..., Cp, Cp]``)."""
    name = "unit_lower_inverse"
    xp = array_namespace(beta, L)
    dtype = _dtype_name(name, beta, L)
    _check_shape(name, "L", L, (*beta.shape, beta.shape[-1]))
    *lead, Cp = beta.shape
    N = math.prod(lead)
    Tinv = _empty(xp, L, (N, Cp, Cp))
    args = (xp.reshape(beta, (N, Cp)), xp.reshape(L, (N, Cp, Cp)), Tinv)
    _launch(name, dtype, _grid(N * Cp), THREADS_PER_BLOCK, *args)
    return xp.reshape(Tinv, L.shape)


def chunk_state_pass(w: Any, u0: Any, kt: Any, total: Any, state: Any) -> tuple[Any, Any, Any]:
    """The state recurrence over every chunk, in one kernel.

    Returns ``boundaries [NT, B, H, K, V]``, ``U [B, H, NT, Cp, V]`` and the final state.
    """
    name = "chunk_state_pass"
    xp = array_namespace(w, u0, kt, total, state)
    dtype = _dtype_name(name, w, u0, kt, total, state)
    _check_ndim(name, "w", w, 5)
    _check_ndim(name, "u0", u0, 5)
    B, H, NT, Cp, K = w.shape
    V = u0.shape[-1]
    _check_shape(name, "u0", u0, (B, H, NT, Cp, V))
    _check_shape(name, "kt", kt, w.shape)
    _check_shape(name, "total", total, (B, H, NT, K))
    _check_shape(name, "state", state, (B, H, K, V))
    BH = B * H
    boundaries = _empty(xp, w, (NT, BH, K, V))
    U = _empty(xp, w, (BH, NT, Cp, V))
    final = _empty(xp, w, (BH, K, V))
    if NT == 0:
        return xp.reshape(boundaries, (NT, B, H, K, V)), xp.reshape(U, u0.shape), xp.asarray(state, copy=True)
    tile, rows = _state_block(V)
    grid = BH * (-(-V // tile)) if K * V else 0
    args = (_flat(xp, w, 2), _flat(xp, u0, 2), _flat(xp, kt, 2), _flat(xp, total, 2), _flat(xp, state, 2))
    _launch(name, dtype, grid, (tile, rows), *args, boundaries, U, final)
    return xp.reshape(boundaries, (NT, B, H, K, V)), xp.reshape(U, u0.shape), xp.reshape(final, state.shape)


def chunk_state_grad_pass(
    w: Any, kt: Any, total: Any, du_local: Any, ds_local: Any, dstate: Any
) -> tuple[Any, Any, Any]:
    """The state-gradient recurrence over every chunk, last first, in one kernel.

    Returns ``dends [NT, B, H, K, V]``, ``dU [B, H, NT, Cp, V]`` and the initial-state gradient.
    """
    name = "chunk_state_grad_pass"
    xp = array_namespace(w, kt, total, du_local, ds_local, dstate)
    dtype = _dtype_name(name, w, kt, total, du_local, ds_local, dstate)
    _check_ndim(name, "w", w, 5)
    _check_ndim(name, "du_local", du_local, 5)
    B, H, NT, Cp, K = w.shape
    V = du_local.shape[-1]
    _check_shape(name, "kt", kt, w.shape)
    _check_shape(name, "total", total, (B, H, NT, K))
    _check_shape(name, "du_local", du_local, (B, H, NT, Cp, V))
    _check_shape(name, "ds_local", ds_local, (B, H, NT, K, V))
    _check_shape(name, "dstate", dstate, (B, H, K, V))
    BH = B * H
    dends = _empty(xp, w, (NT, BH, K, V))
    dU = _empty(xp, w, (BH, NT, Cp, V))
    dinitial = _empty(xp, w, (BH, K, V))
    if NT == 0:
        dinitial = xp.asarray(dstate, copy=True)
        return xp.reshape(dends, (NT, B, H, K, V)), xp.reshape(dU, du_local.shape), dinitial
    tile, rows = _state_block(V)
    grid = BH * (-(-V // tile)) if K * V else 0
    args = [_flat(xp, x, 2) for x in (w, kt, total, du_local, ds_local, dstate)]
    _launch(name, dtype, grid, (tile, rows), *args, dends, dU, dinitial)
    shape = (NT, B, H, K, V)
    return xp.reshape(dends, shape), xp.reshape(dU, du_local.shape), xp.reshape(dinitial, dstate.shape)


def chunk_pairs_backward(
    dA: Any, dL: Any, q: Any, k: Any, f: ChunkFactors, scale: float
) -> tuple[Any, Any, Any]:
    """Gradients through :func:`chunk_pairs`: ``dq, dk, dg``, each ``[..., Cp, K]``."""
    name = "chunk_pairs_backward"
    xp = array_namespace(dA, dL, q, k)
    _check_ndim(name, "q", q, 5)
    B, H, NT, Cp, K = q.shape
    N = B * H * NT
    _check_shape(name, "k", k, q.shape)
    _check_shape(name, "dA", dA, (B, H, NT, Cp, Cp))
    _check_shape(name, "dL", dL, (B, H, NT, Cp, Cp))
    if not _factors_match(f, N, Cp, K):
        msg = f"{name}: f must come from kda.cuda.chunk_factors of the same chunks"
        raise ValueError(msg)
    dtype = _dtype_name(name, dA, dL, q, k, f.private)
    outs = [_empty(xp, q, (N, Cp, K)) for _ in range(3)]
    args = [_flat(xp, x, 3) for x in (dA, dL, q, k)]
    _launch(name, dtype, _grid(N * K), THREADS_PER_BLOCK, *args, f.private, q.dtype.type(scale), *outs)
    dq, dk, dg = (xp.reshape(x, q.shape) for x in outs)
    return dq, dk, dg


def chunk_gate_gradient(prefix_terms: Any, suffix_terms: Any, total_terms: Any, pair_terms: Any) -> Any:
    """Gradient of ``g`` from the gradients of the decay factors (see :mod:`kda.reference`)."""
    name = "chunk_gate_gradient"
    xp = array_namespace(prefix_terms, suffix_terms, total_terms, pair_terms)
    dtype = _dtype_name(name, prefix_terms, suffix_terms, total_terms, pair_terms)
    _check_ndim(name, "prefix_terms", prefix_terms, 5)
    B, H, NT, Cp, K = prefix_terms.shape
    N = B * H * NT
    _check_shape(name, "suffix_terms", suffix_terms, prefix_terms.shape)
    _check_shape(name, "pair_terms", pair_terms, prefix_terms.shape)
    _check_shape(name, "total_terms", total_terms, (B, H, NT, K))
    dg = _empty(xp, prefix_terms, (N, Cp, K))
    args = [_flat(xp, x, 3) for x in (prefix_terms, suffix_terms, total_terms, pair_terms)]
    _launch(name, dtype, _grid(N * K), THREADS_PER_BLOCK, *args, dg)
    return xp.reshape(dg, prefix_terms.shape)


def _check_recurrent(name: str, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any) -> tuple[int, ...]:
    _check_ndim(name, "q", q, 4)
    _check_ndim(name, "v", v, 4)
    B, H, T, K = q.shape
    V = v.shape[-1]
    _check_shape(name, "k", k, q.shape)
    _check_shape(name, "g", g, q.shape)
    _check_shape(name, "v", v, (B, H, T, V))
    _check_shape(name, "beta", beta, (B, H, T))
    _check_shape(name, "state", state, (B, H, K, V))
    return B, H, T, K, V


def recurrent_forward(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, state: Any) -> tuple[Any, Any]:
    """The recurrence, one kernel looping over every step: ``(output, final_state)``."""
    name = "recurrent_forward"
    xp = array_namespace(q, k, v, g, beta, state)
    dtype = _dtype_name(name, q, k, v, g, beta, state)
    B, H, T, K, V = _check_recurrent(name, q, k, v, g, beta, state)
    BH = B * H
    o = _zeros(xp, v, (BH, T, V))
    final = _empty(xp, state, (BH, K, V))
    args = [_flat(xp, x, 2) for x in (q, k, g, v, beta)]
    grid = _grid(BH * V) if K else 0
    _launch(name, dtype, grid, THREADS_PER_BLOCK, *args, q.dtype.type(scale), _flat(xp, state, 2), o, final)
    if grid == 0:
        final = xp.asarray(state, copy=True)
    return xp.reshape(o, v.shape), xp.reshape(final, state.shape)


def recurrent_backward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    scale: float,
    state: Any,
    grad_output: Any,
    grad_state: Any,
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """Gradients of the recurrence, one kernel: ``(dq, dk, dv, dg, dbeta, dstate)``.

    Keeps ``ceil(sqrt(T))`` checkpoint states and recomputes the steps between them.
    """
    name = "recurrent_backward"
    xp = array_namespace(q, k, v, g, beta, state, grad_output, grad_state)
    dtype = _dtype_name(name, q, k, v, g, beta, state, grad_output, grad_state)
    B, H, T, K, V = _check_recurrent(name, q, k, v, g, beta, state)
    _check_shape(name, "grad_output", grad_output, v.shape)
    _check_shape(name, "grad_state", grad_state, state.shape)
    BH = B * H
    stride = math.isqrt(max(T - 1, 0)) + 1
    nseg = max(-(-T // stride), 1)
    ckpt = _empty(xp, state, (nseg, BH, K, V))
    seg = _empty(xp, state, (stride, BH, K, V))
    dq, dk, dg = (_zeros(xp, q, (BH, T, K)) for _ in range(3))
    dbeta = _zeros(xp, q, (BH, T))
    dv = _zeros(xp, v, (BH, T, V))
    dS = _empty(xp, state, (BH, K, V))
    grid = _grid(BH * V) if K else 0
    flat = [_flat(xp, x, 2) for x in (q, k, g, v, beta)]
    tail = (_flat(xp, state, 2), _flat(xp, grad_output, 2), _flat(xp, grad_state, 2), stride, ckpt, seg)
    outs = (dq, dk, dg, dbeta, dv, dS)
    _launch(name, dtype, grid, THREADS_PER_BLOCK, *flat, q.dtype.type(scale), *tail, *outs)
    if grid == 0:
        dS = xp.asarray(grad_state, copy=True)
    dq, dk, dg = (xp.reshape(x, q.shape) for x in (dq, dk, dg))
    return dq, dk, xp.reshape(dv, v.shape), dg, xp.reshape(dbeta, beta.shape), xp.reshape(dS, state.shape)
