"""Launch wrappers: the primitives of :mod:`kda._backends.interface`, run by Numba-CUDA kernels.

Each wrapper validates its arrays, allocates the outputs in the caller's namespace (``empty``
wherever the kernel writes every element), sizes the grid and launches one kernel through
:func:`launch`, which passes every array flattened (a view: the arrays are C-contiguous) with
the kernel's dimensions, on the current CuPy stream (CuPy arrays) or on the default stream
(NumPy arrays under Numba's CUDA simulator). Every launch is counted in :data:`LAUNCHES`;
every operand that had to be copied to make it C-contiguous (none, on the chunked algorithm's
path) in :data:`COPIES`.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
from array_api_compat import array_namespace, device, is_cupy_array
from numba import cuda

from ..interface import ChunkLocal, from_chunks, to_chunks
from . import _kernels
from ._kernels import DTYPES, LOCAL_TILE_K, STAGED_COLUMNS, STAGED_SLICE, STAGED_TILE_V, compiled

__all__ = [
    "LAUNCHES",
    "chunk_local",
    "chunk_local_backward",
    "chunk_state_grad_pass",
    "chunk_state_pass",
    "from_chunks",
    "gate_flags",
    "raise_for_gates",
    "recurrent_backward",
    "recurrent_forward",
    "to_chunks",
]

# threads per block of the one-thread-per-output kernels
THREADS_PER_BLOCK = 128
# the state passes: blocks of STATE_THREADS threads, STATE_TILE_V value columns (threads x) by
# STATE_THREADS / STATE_TILE_V row threads (y); B * H * V / 16 blocks (128 at B=1, H=16, V=128).
# The same block shape runs under the simulator (the tests exercise the real layout).
STATE_TILE_V = 16
STATE_THREADS = 256
# threads of chunk_local's block and of chunk_local_backward's (one block per chunk)
LOCAL_THREADS = 128
LOCAL_BACKWARD_THREADS = 64
# the state passes: "staged" (chunk_state_pass_staged, chunk_state_grad_pass_staged: the chunk's
# rows on the lanes, w, qg, kt, A staged in shared memory), or "broadcast" (chunk_state_pass,
# chunk_state_grad_pass: value columns on the lanes, w, qg, kt, A read through L1), which also
# serves chunks over 128 steps and tiles over the shared-memory limit. Staged by the PTX's
# instruction counts (docs/gpu.md); not measured on a GPU yet: scripts/gpu_bench.py times both.
STATE_PASS = "staged"
# dynamic shared memory a block may use without opting in (bytes)
SHARED_LIMIT = 48 * 1024
# the longest padded chunk whose work fits chunk_local's and chunk_local_backward's blocks in
# SHARED_LIMIT, in float32 and float64 (float32 at 128 steps needs 49 KiB in chunk_local);
# longer chunks run on the array-API reference backend (kda._backends.resolve)
MAX_CHUNK = 64

# kernel name -> number of launches since import (or since the last clear())
LAUNCHES: Counter = Counter()
# kernel name -> number of operands a wrapper had to copy to make them C-contiguous
COPIES: Counter = Counter()


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


def _is_contiguous(a: Any) -> bool:
    flags = getattr(a, "flags", None)
    return flags is None or bool(flags.c_contiguous)


def _c(name: str, a: Any) -> Any:
    """``a`` itself when C-contiguous, else a C-contiguous copy (counted in :data:`COPIES`)."""
    if _is_contiguous(a):
        return a
    COPIES[name] += 1
    if is_cupy_array(a):
        import cupy

        return cupy.ascontiguousarray(a)
    import numpy as np

    return np.ascontiguousarray(a)


def index_type(arrays: Any, dims: tuple[int, ...]) -> str:
    """``"uint32"`` where every array and dimension of a launch is under ``INDEX32_LIMIT``, else
    ``"uint64"``."""
    sizes = [int(getattr(a, "size", 0)) for a in arrays] + [int(d) for d in dims]
    return "uint32" if max(sizes, default=0) < _kernels.INDEX32_LIMIT else "uint64"


def launch(
    name: str, kernel_for: Any, grid: int, block: Any, *args: Any, dims: tuple[int, ...], shared: int = 0
) -> None:
    """Launch ``kernel_for(index)`` on the caller's stream; nothing to do for an empty grid.

    Every array argument must be C-contiguous (a strided one is copied and counted in
    :data:`COPIES`) and is passed as a flat view; ``dims`` are the dimensions the kernel indexes
    by, and ``index`` is the offset type the sizes allow (:func:`index_type`). ``shared`` is the
    dynamic shared memory of a block in bytes. Counted in :data:`LAUNCHES` under ``name``.
    """
    if grid == 0:
        return
    args = tuple(_c(name, a) for a in args)
    index = index_type([a for a in args if hasattr(a, "shape")], dims)
    args = tuple(a.reshape(-1) if hasattr(a, "shape") and a.ndim > 1 else a for a in args)
    kernel = kernel_for(index)
    if any(is_cupy_array(a) for a in args):
        import cupy

        ptr = cupy.cuda.get_current_stream().ptr
        stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()
        # same stream as CuPy's work: no host synchronisation on the arrays' stream is needed
        args = tuple(cuda.as_cuda_array(a, sync=False) if is_cupy_array(a) else a for a in args)
        dims = tuple(getattr(np, _kernels.INDEX_TYPES[index])(d) for d in dims)
    else:
        stream = 0  # host arrays: the simulator, which takes the dimensions as Python ints
        dims = tuple(int(d) for d in dims)
    kernel[grid, block, stream, shared](*args, dims)
    LAUNCHES[name] += 1


def _launch(
    name: str, dtype: str, grid: int, block: Any, *args: Any, dims: tuple[int, ...], shared: int = 0
) -> None:
    """Launch kernel ``name`` of :mod:`._kernels` for ``dtype`` (see :func:`launch`)."""
    launch(name, lambda index: compiled(name, dtype, index), grid, block, *args, dims=dims, shared=shared)


def _grid(threads: int) -> int:
    return -(-threads // THREADS_PER_BLOCK)


def _state_block(name: str, K: int, Cp: int, itemsize: int, rows: int) -> tuple[tuple[int, int], int]:
    """Block shape and dynamic shared memory of a state pass keeping ``rows`` rows of ``TV`` columns.

    ``TV = STATE_TILE_V`` value columns unless the tiles would not fit in :data:`SHARED_LIMIT`;
    then fewer columns (and more row threads), down to one.
    """
    tv = STATE_TILE_V
    while tv > 1 and rows * tv * itemsize > SHARED_LIMIT:
        tv //= 2
    if rows * tv * itemsize > SHARED_LIMIT:
        from ..._errors import InvalidInputError

        msg = (
            f"{name}: K={K} with a padded chunk of {Cp} steps needs {rows * itemsize} bytes of shared "
            f"memory per value column, over the {SHARED_LIMIT} a block has; use a smaller chunk_size "
            "or backend='reference'"
        )
        raise InvalidInputError(msg)
    return (tv, STATE_THREADS // tv), rows * tv * itemsize


def _state_kernel(
    name: str, BH: int, NT: int, Cp: int, K: int, V: int, itemsize: int, backward: bool = False
) -> tuple[str, int, Any, int]:
    """``(kernel, grid, block, shared)`` of a state pass (its gradient pass with ``backward``).

    The staged kernel where :data:`STATE_PASS` asks for it and its tiles fit (at most 1024
    threads, :data:`SHARED_LIMIT`); otherwise the broadcast kernel ``name``.
    """
    work = NT and K * V  # else an empty grid: nothing to launch
    threads = Cp * (STAGED_TILE_V // STAGED_COLUMNS)
    tiles, rows = (2, 3) if backward else (1, 2)  # [K, TV] state tiles and [Cp, TV + 1] row tiles
    elements = tiles * K * STAGED_TILE_V + rows * Cp * (STAGED_TILE_V + 1) + 2 * STAGED_SLICE * (Cp + 1)
    if STATE_PASS == "staged" and threads <= 1024 and elements * itemsize <= SHARED_LIMIT:
        grid = BH * -(-V // STAGED_TILE_V) if work else 0
        return f"{name}_staged", grid, threads, elements * itemsize
    block, shared = _state_block(name, K, Cp, itemsize, 2 * K + 2 * Cp if backward else K + 2 * Cp)
    return name, BH * -(-V // block[0]) if work else 0, block, shared


def _local_shared(Cp: int, itemsize: int) -> int:
    """Bytes of dynamic shared memory of :func:`chunk_local`'s block."""
    return (Cp + Cp * (Cp + 1) // 2 + max(2 * Cp * LOCAL_TILE_K, Cp * Cp // 4)) * itemsize


def chunk_local(q: Any, k: Any, g: Any, v: Any, beta: Any, scale: float) -> ChunkLocal:
    """The state-free work of every chunk in one kernel, one block per chunk (no factor array).

    ``q, k, g: [..., Cp, K]``, ``v: [..., Cp, V]``, ``beta: [..., Cp]``, ``Cp <= MAX_CHUNK``
    (longer chunks run on the reference backend: :func:`kda._backends.resolve`).
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
    q: Any,
    k: Any,
    g: Any,
    v: Any,
    beta: Any,
    scale: float,
    loc: ChunkLocal,
    boundaries: Any,
    dends: Any,
    u: Any,
    du: Any,
    grad_output: Any,
) -> tuple[Any, Any, Any, Any, Any]:
    """Gradients of every chunk's state-free work in one kernel, one block per chunk.

    Returns ``dq, dk, dv, dg, dbeta`` (see :mod:`kda._backends.interface`); ``Cp <= MAX_CHUNK``.
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
    shared = Cp * LOCAL_BACKWARD_THREADS * q.dtype.itemsize
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


def chunk_state_pass(
    w: Any, u0: Any, kt: Any, total: Any, state: Any, qg: Any = None, A: Any = None
) -> tuple[Any, Any, Any]:
    """The state recurrence over every chunk with the output ``O = qg S + A U``, in one kernel.

    Returns ``boundaries [NT, B, H, K, V]``, ``output [B, H, NT, Cp, V]`` (``None`` without
    ``qg`` and ``A``: the states alone) and the final state.
    """
    name = "chunk_state_pass"
    xp = array_namespace(w, u0, kt, total, state)
    emit = qg is not None
    dtype = _dtype_name(name, w, u0, kt, total, state, *((qg, A) if emit else ()))
    _check_ndim(name, "w", w, 5)
    _check_ndim(name, "u0", u0, 5)
    B, H, NT, Cp, K = w.shape
    V = u0.shape[-1]
    _check_shape(name, "u0", u0, (B, H, NT, Cp, V))
    _check_shape(name, "kt", kt, w.shape)
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
    name, grid, block, shared = _state_kernel(name, BH, NT, Cp, K, V, w.dtype.itemsize)
    if emit:
        dense = (qg, A)
    else:
        dense = (_empty(xp, w, (1, 1, 1, K)), _empty(xp, w, (1, 1, 1, 1)))
    args = (*dense, w, u0, kt, total, state, np.int32(emit), out, boundaries, final)
    _launch(name, dtype, grid, block, *args, shared=shared, dims=(BH, NT, Cp, K, V))
    output = xp.reshape(out, u0.shape) if emit else None
    return xp.reshape(boundaries, (NT, B, H, K, V)), output, xp.reshape(final, state.shape)


def chunk_state_grad_pass(
    w: Any,
    u0: Any,
    kt: Any,
    total: Any,
    qg: Any,
    A: Any,
    grad_output: Any,
    boundaries: Any,
    dstate: Any,
) -> tuple[Any, Any, Any, Any]:
    """The state-gradient recurrence over every chunk, last first, in one kernel.

    Returns ``dends [NT, B, H, K, V]``, ``U`` and ``dU`` (``[B, H, NT, Cp, V]``) and the
    initial-state gradient (see :mod:`kda.reference`).
    """
    name = "chunk_state_grad_pass"
    arrays = (w, u0, kt, total, qg, A, grad_output, boundaries, dstate)
    xp = array_namespace(*arrays)
    dtype = _dtype_name(name, *arrays)
    _check_ndim(name, "w", w, 5)
    _check_ndim(name, "u0", u0, 5)
    B, H, NT, Cp, K = w.shape
    V = u0.shape[-1]
    _check_shape(name, "u0", u0, (B, H, NT, Cp, V))
    _check_shape(name, "kt", kt, w.shape)
    _check_shape(name, "qg", qg, w.shape)
    _check_shape(name, "total", total, (B, H, NT, K))
    _check_shape(name, "A", A, (B, H, NT, Cp, Cp))
    _check_shape(name, "grad_output", grad_output, u0.shape)
    _check_shape(name, "boundaries", boundaries, (NT, B, H, K, V))
    _check_shape(name, "dstate", dstate, (B, H, K, V))
    BH = B * H
    dends = _empty(xp, w, (NT, BH, K, V))
    U, dU = (_empty(xp, w, (BH, NT, Cp, V)) for _ in range(2))
    dinitial = _empty(xp, w, (BH, K, V))
    if NT == 0 or K * V == 0:
        dinitial = xp.asarray(dstate, copy=True)
        U, dU = (_zeros(xp, w, (BH, NT, Cp, V)) for _ in range(2))
    name, grid, block, shared = _state_kernel(name, BH, NT, Cp, K, V, w.dtype.itemsize, backward=True)
    args = (qg, A, w, u0, kt, total, grad_output, boundaries, dstate, dends, U, dU, dinitial)
    _launch(name, dtype, grid, block, *args, shared=shared, dims=(BH, NT, Cp, K, V))
    shape = (NT, B, H, K, V)
    return (
        xp.reshape(dends, shape),
        xp.reshape(U, u0.shape),
        xp.reshape(dU, u0.shape),
        xp.reshape(dinitial, dstate.shape),
    )


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
    grid = _grid(BH * V) if K else 0
    o = (_empty if grid else _zeros)(xp, v, (BH, T, V))  # every element written by the kernel
    final = _empty(xp, state, (BH, K, V))
    args = (q, k, g, v, beta, q.dtype.type(scale), state, o, final)
    _launch(name, dtype, grid, THREADS_PER_BLOCK, *args, dims=(BH, T, K, V))
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
    grid = _grid(BH * V) if K else 0
    dv = (_empty if grid else _zeros)(xp, v, (BH, T, V))  # every element written by the kernel
    dS = _empty(xp, state, (BH, K, V))
    tail = (state, grad_output, grad_state, stride, ckpt, seg)
    outs = (dq, dk, dg, dbeta, dv, dS)
    args = (q, k, g, v, beta, q.dtype.type(scale), *tail, *outs)
    _launch(name, dtype, grid, THREADS_PER_BLOCK, *args, dims=(BH, T, K, V))
    if grid == 0:
        dS = xp.asarray(grad_state, copy=True)
    dq, dk, dg = (xp.reshape(x, q.shape) for x in (dq, dk, dg))
    return dq, dk, xp.reshape(dv, v.shape), dg, xp.reshape(dbeta, beta.shape), xp.reshape(dS, state.shape)


GATE_DTYPES = ("float16", "float32", "float64")


def gate_flags(g: Any) -> Any:
    """Count the invalid log decays of ``g`` on the device, without a host synchronisation.

    Returns an int32 array ``[2]`` in ``g``'s namespace: the number of positive and of NaN
    elements (``-inf`` is valid). The counts are final once the caller's stream reaches them;
    :func:`raise_for_gates` reads them (that read is the only synchronisation).
    """
    name = "gate_flags"
    xp = array_namespace(g)
    dname = str(g.dtype)
    if dname not in GATE_DTYPES:
        msg = f"{name}: g must be float16, float32 or float64 here; got {dname}"
        raise TypeError(msg)
    flags = xp.zeros((2,), dtype=xp.int32, device=device(g))
    n = math.prod(g.shape)
    grid = min(_grid(n), 1024)
    _launch(name, dname, grid, THREADS_PER_BLOCK, g, flags, dims=(n,))
    return flags


def raise_for_gates(flags: Any) -> None:
    """Raise :class:`kda.InvalidInputError` if :func:`gate_flags` found invalid decays (reads them)."""
    from ..._errors import InvalidInputError

    n_pos, n_nan = (int(x) for x in flags)
    if n_pos or n_nan:
        msg = (
            "g must hold log decays <= 0 (-inf allowed: a hard reset); "
            f"got {n_pos} positive and {n_nan} NaN elements"
        )
        raise InvalidInputError(msg)
