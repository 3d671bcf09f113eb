"""The device-side check of log decays (``g <= 0``), read after the call's work is queued."""

from __future__ import annotations

import math
from typing import Any

import numba
from array_api_compat import array_namespace, device
from numba import cuda

from ._device import INT32_ARRAY, Family, Kernel, constants, inline, offset_functions
from ._launch import THREADS_PER_BLOCK, _grid, launcher

__all__ = ["gate_flags", "raise_for_gates"]


def _gate_flags_kernel(dtype: str, index: str) -> Any:
    """The Python function of the gate check, specialised to ``dtype`` and ``index``."""
    # float16 decays are compared in float32 (exact): NVVM rejects a float16 comparison against
    # a closure constant (ERROR_INVALID_IR, numba-cuda 0.30 with NVVM of CUDA 12.9 and 13)
    wide = "float32" if dtype == "float16" else dtype
    widen = getattr(numba, wide)
    _, _, zero, _ = constants(wide)
    at2, _, _ = offset_functions(index)

    @inline
    def at1(i):
        """The offset ``i`` in the index type."""
        return at2(0, i, 1)

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
            x = widen(g[at1(idx)])
            if x != x:
                nan += 1
            elif x > zero:
                pos += 1
        if pos:
            cuda.atomic.add(flags, 0, pos)
        if nan:
            cuda.atomic.add(flags, 1, nan)

    return gate_flags


# g's dtypes the check takes (float16 compared in float32)
GATE_DTYPES = ("float16", "float32", "float64")

GATE_FLAGS = Kernel("gate_flags", _gate_flags_kernel, dims=1, types={"flags": INT32_ARRAY})
KERNELS = Family("gate", (GATE_FLAGS,), dtypes=GATE_DTYPES)
_launch = launcher(KERNELS)


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
    _launch(GATE_FLAGS, dname, grid, THREADS_PER_BLOCK, g, flags, dims=(n,))
    return flags


def raise_for_gates(flags: Any) -> None:
    """Raise :class:`kda.InvalidInputError` if :func:`gate_flags` found invalid decays (reads them)."""
    from .._errors import InvalidInputError

    n_pos, n_nan = (int(x) for x in flags)
    if n_pos or n_nan:
        msg = (
            "g must hold log decays <= 0 (-inf allowed: a hard reset); "
            f"got {n_pos} positive and {n_nan} NaN elements"
        )
        raise InvalidInputError(msg)
