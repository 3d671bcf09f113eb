"""What every kernel family shares: dtypes, offset types, offsets, signatures, compilation.

A family (``local.py``, ``state_pass.py``, ``recurrent.py``, ``gate.py``) writes each kernel once
as a plain Python function in its own ``builder(dtype, index)`` factory, closed over the constants
of one floating dtype (:func:`constants`: so float32 work stays float32, no Python float literal
ever promotes it to float64) and the offset functions of one index type (:func:`offset_functions`);
the device functions its kernels share come from cached factories of the same two keys. A
:class:`Kernel` holds one kernel's builder and argument kinds and compiles it lazily, once per
(dtype, index type), with an explicit signature; a :class:`Family` groups a module's kernels.
:data:`FAMILIES` lists them all: the PTX test compiles every kernel for every dtype its family
accepts (``Family.dtypes``: float32 and float64,
and float16 for the gate check), and the 64-bit offsets in float32.

Layouts: every array is C-contiguous and passed flattened; a kernel indexes it by offsets
(``at2``, ``at3``, ``at4``: unsigned, 32-bit where the launch's sizes allow) from the dimensions
in its trailing ``dims`` tuple. ``N = B * H * NT`` chunks, ``BH = B * H`` heads, ``Cp`` padded chunk
steps, ``K`` key and ``V`` value channels, ``NL`` halving levels. The forward and backward of
the chunked algorithm run four kernels (``chunk_local``, a state pass, a state-gradient pass,
``chunk_local_backward``; docs/gpu.md).

Numerical contract (``docs/design.md``): every decay is a running product of ``exp(g)`` over
exactly the steps it spans, so it lies in ``[0, 1]``, a hard reset (``g = -inf``) gives an
exact 0 and no difference of cumulative sums is ever formed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import cuda

__all__ = [
    "DTYPES",
    "FAMILIES",
    "INDEX32_LIMIT",
    "INDEX_TYPES",
    "Family",
    "Kernel",
    "constants",
    "inline",
    "offset_functions",
    "signature",
]

# floating dtypes the kernels are compiled for
DTYPES = ("float32", "float64")

# index types: every array is passed flattened, and the kernels compute their offsets into it
# in 32 bits (unsigned: no negative-index fix-ups) wherever every array and every dimension of
# the launch has fewer than INDEX32_LIMIT elements, in 64 bits otherwise; the launcher
# picks (kda.cuda._launch.index_type)
# index type -> the type of the dimensions passed with it (signed in 64 bits: Numba types a mix
# of uint64 and signed integers as float64)
INDEX_TYPES = {"uint32": "uint32", "uint64": "int64"}
INDEX32_LIMIT = 2**32

# the Numba types a kernel parameter may have ({dtype}: the kernel's floating dtype); a parameter is
# an ARRAY unless its Kernel names another type for it
ARRAY = "{dtype}[::1]"  # a C-contiguous 1-D array of the floating dtype (a flattened array)
SCALAR = "{dtype}"  # a floating scalar
INT64 = "int64"
INT32 = "int32"
INT32_ARRAY = "int32[::1]"


def signature(parameters: list[str], types: dict[str, str], dims: int, dtype: str, index: str) -> str:
    """The explicit Numba signature of a kernel with ``parameters`` (its Python function's, ending
    in ``dims``) for ``dtype`` and ``index``: each parameter of the type ``types`` names (an
    :data:`ARRAY` where it names none), and ``dims`` a tuple of ``dims`` dimensions in the index
    type.

    Every array is C-contiguous and one-dimensional (a flattened view): an element is an offset
    computed in ``index`` arithmetic from the trailing tuple of dimensions, with no stride loads
    and no negative-index selects.
    """
    *arguments, last = parameters
    unknown = set(types) - set(arguments)
    if last != "dims" or unknown:
        raise AssertionError(f"a kernel's parameters end in dims and include {sorted(types)}: {parameters}")
    args = [types.get(name, ARRAY).format(dtype=dtype) for name in arguments]
    return f"void({', '.join([*args, f'UniTuple({INDEX_TYPES[index]}, {dims})'])})"


def constants(dtype: str) -> tuple:
    """``(fl, nbtype, zero, one)``: the scalar type of ``dtype``, its Numba type, 0 and 1 in it."""
    fl = np.dtype(dtype).type
    return fl, numba.from_dtype(np.dtype(dtype)), fl(0), fl(1)


class Kernel:
    """One kernel: its ``builder(dtype, index)``, which returns the kernel's Python function closed
    over the constants of ``dtype`` and the offsets of ``index`` (builders share device functions
    through cached factories of their own), the number ``dims`` of dimensions its last parameter
    holds, and the ``types`` of its parameters that are not arrays of the floating dtype
    (:func:`signature`).
    A family's module makes each of its kernels once and its wrappers launch that object
    (:func:`kda.cuda._launch.launcher`): no name chooses a kernel. ``name`` labels it (the
    launch counts, the PTX report). Compiled lazily, once per (dtype, index type), and cached.
    """

    def __init__(
        self,
        name: str,
        builder: Callable[[str, str], Callable],
        *,
        dims: int,
        types: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.builder = builder
        self.dims = dims
        self.types = dict(types or {})
        self._functions: dict[tuple[str, str], Callable] = {}
        self._compiled: dict[tuple[str, str], Any] = {}

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"

    def signature(self, dtype: str, index: str = "uint32") -> str:
        """The explicit Numba signature of this kernel for ``dtype`` and ``index`` (:func:`signature`)."""
        parameters = list(inspect.signature(self.function(dtype, index)).parameters)
        return signature(parameters, self.types, self.dims, dtype, index)

    def function(self, dtype: str, index: str = "uint32") -> Callable:
        """The Python function of this kernel for ``dtype`` and ``index``, built once."""
        key = (dtype, index)
        found = self._functions.get(key)
        if found is None:
            found = self._functions[key] = self.builder(dtype, index)
        return found

    def compiled(self, dtype: str, index: str = "uint32") -> Any:
        """This kernel for ``dtype`` and ``index``, compiled on first use."""
        key = (dtype, index)
        found = self._compiled.get(key)
        if found is None:
            found = cuda.jit(self.signature(dtype, index))(self.function(dtype, index))
            self._compiled[key] = found
        return found


class Family:
    """One kernel family: its kernels (:class:`Kernel`) and the floating dtypes they are compiled
    for (:data:`DTYPES`, or more); listed in :data:`FAMILIES`."""

    def __init__(self, name: str, kernels: tuple[Kernel, ...], dtypes: tuple[str, ...] = DTYPES) -> None:
        self.name = name
        self.kernels = tuple(kernels)
        self.dtypes = dtypes
        FAMILIES.append(self)


# every family, in import order (kda.cuda imports them all)
FAMILIES: list[Family] = []


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


def inline(func):
    """An inline device function on a GPU; the plain function under the simulator."""
    if numba.config.ENABLE_CUDASIM:
        return func
    return cuda.jit(device=True, inline="always")(func)


@functools.cache
def offset_functions(index: str) -> tuple:
    """``(at2, at3, at4)``: the offsets of elements of C-contiguous arrays in the ``index`` type.

    ``at2(i, j, J)`` is element ``[i, j]`` of a ``[., J]`` array, ``at3(i, j, m, J, M)`` element
    ``[i, j, m]`` of a ``[., J, M]`` one and ``at4(i, j, m, r, J, M, R)`` element ``[i, j, m, r]``
    of a ``[., J, M, R]`` one: inline device functions on a GPU, plain functions under the
    simulator (:func:`_offset_function`); built once per index type.
    """
    at2 = _offset_function(getattr(numba, index))

    @inline
    def at3(i, j, m, J, M):
        """The offset of element ``[i, j, m]`` of a C-contiguous ``[., J, M]`` array."""
        return at2(at2(i, j, J), m, M)

    @inline
    def at4(i, j, m, r, J, M, R):
        """The offset of element ``[i, j, m, r]`` of a C-contiguous ``[., J, M, R]`` array."""
        return at2(at3(i, j, m, J, M), r, R)

    return at2, at3, at4
