"""The launcher every family's wrappers use, and their shared argument checks.

Each wrapper (beside its kernels, in its family's module) validates its arrays, allocates the
outputs in the caller's namespace (``empty`` wherever the kernel writes every element), sizes
the grid and launches one kernel through :func:`launch`, which passes every array flattened (a
view: the arrays are C-contiguous) with
the kernel's dimensions, on the current CuPy stream (CuPy arrays) or on the default stream
(NumPy arrays under Numba's CUDA simulator). Every launch is counted in :data:`LAUNCHES`;
every operand that had to be copied to make it C-contiguous (none, on the chunked algorithm's
path) in :data:`COPIES`.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any

import numba
import numpy as np
from array_api_compat import device, is_cupy_array
from numba import cuda

from .._dtypes import dtype_name
from .._options.arguments import c_contiguous
from . import _device
from ._device import DTYPES, Kernel

__all__ = ["COPIES", "LAUNCHES", "SHARED_LIMIT", "THREADS_PER_BLOCK", "index_type", "launch", "launcher"]

# threads per block of the one-thread-per-output kernels
THREADS_PER_BLOCK = 128
# dynamic shared memory a block may use without opting in (bytes)
SHARED_LIMIT = 48 * 1024

# kernel name -> number of launches since import (or since the last clear())
LAUNCHES: Counter = Counter()
# kernel name -> number of operands a wrapper had to copy to make them C-contiguous
COPIES: Counter = Counter()


def _common_dtype(name: str, *arrays: Any) -> str:
    """The name of the one dtype of ``arrays`` (``TypeError`` unless they share one the kernels
    compute in), for the wrapper ``name``."""
    dt = arrays[0].dtype
    for x in arrays[1:]:
        if x.dtype != dt:
            msg = f"{name}: all arrays must share one dtype; got {dt} and {x.dtype}"
            raise TypeError(msg)
    dname = dtype_name(dt)
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


def _c(name: str, a: Any) -> Any:
    """``a`` itself when C-contiguous, else a C-contiguous copy (counted in :data:`COPIES`)."""
    if c_contiguous(a):
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
    return "uint32" if max(sizes, default=0) < _device.INDEX32_LIMIT else "uint64"


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
        dims = tuple(getattr(np, _device.INDEX_TYPES[index])(d) for d in dims)
    elif numba.config.ENABLE_CUDASIM:
        stream = 0  # host arrays under the simulator, which takes the dimensions as Python ints
        dims = tuple(int(d) for d in dims)
    else:
        # host arrays on a real GPU: Numba copies them to the device and back (and warns); the
        # dimensions in the signature's type, as for CuPy arrays
        stream = 0
        dims = tuple(getattr(np, _device.INDEX_TYPES[index])(d) for d in dims)
    kernel[grid, block, stream, shared](*args, dims)
    LAUNCHES[name] += 1


def _grid(threads: int) -> int:
    return -(-threads // THREADS_PER_BLOCK)


def launcher(family: Any) -> Any:
    """``launch_kernel(kernel, dtype, grid, block, *args, dims, shared=0)`` for the kernels of
    ``family`` (a :class:`._device.Family`): ``kernel`` is one of its :class:`._device.Kernel`
    objects, compiled for ``dtype`` and the offset type the sizes allow."""

    def launch_kernel(
        kernel: Kernel, dtype: str, grid: int, block: Any, *args: Any, dims: tuple[int, ...], shared: int = 0
    ) -> None:
        if kernel not in family.kernels:
            raise TypeError(f"{kernel.name} is not a kernel of the {family.name!r} family")
        launch(kernel.name, partial(kernel.compiled, dtype), grid, block, *args, dims=dims, shared=shared)

    return launch_kernel
