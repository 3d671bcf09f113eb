"""Subnormal floats flushed to zero around the cpu backend's kernels (x86: MXCSR's FTZ and DAZ).

On x86 cores an arithmetic instruction that reads or produces a subnormal float (below
``2**-126`` in float32, ``2**-1022`` in float64) takes a microcode assist, about 100 times the
cost of a normal one, in kda's loops and inside BLAS alike. Strong gates (Kimi Linear's gate
formula gives a median ``g`` near ``-5`` per step and channel) make many decay products inside a
chunk fall in that range, which made the chunked forward 8-14 times slower than at mild gates.

Every kernel call of the backend therefore runs with the thread's flush-to-zero (FTZ: a
subnormal result is written as 0) and denormals-are-zero (DAZ: a subnormal operand is read as 0)
bits set, and the thread's control bits as they were afterwards (:func:`run`). The pool threads
are kda's own; a call small enough to run on the calling thread sets the bits there for the
kernel alone and puts them back before it returns, so no caller ever sees its floating-point
environment changed. The sticky status flags (bits 0-5) raised inside a kernel are kept, as
they would be without this module.

What it costs in accuracy (``docs/options.md``, "Subnormal floats"): each flushed value is
below the smallest normal float, so each operation changes by less than ``2**-126`` (float32)
or ``2**-1022`` (float64) in absolute terms, against a contract of ``1e-5`` (``1e-10``) of the
outputs' largest magnitude. ``g = -inf`` stays an exact 0. Every thread runs with the same bits,
so results stay bitwise the same for any number of threads.

Elsewhere than x86 (where the bits do not exist) :func:`run` calls the kernel unchanged.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any

__all__ = ["FLUSH", "X86", "flushing_bits", "read", "run"]

X86 = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686", "x86"}
FTZ, DAZ = 1 << 15, 1 << 6
FLUSH = FTZ | DAZ
STATUS = 0x3F  # the sticky exception flags; every other bit is control

_COMPILED: list[Any] = []  # the Numba functions over MXCSR (:func:`_compiled`), once made


def _compiled() -> Any:
    """The compiled MXCSR functions for :data:`FLUSH` and :data:`STATUS` (``read``, ``enter``,
    ``leave``: :class:`kda.cpu._mxcsr.MxcsrFunctions`), made on first use."""
    if not _COMPILED:
        from ._mxcsr import compile_functions  # imports numba

        _COMPILED.append(compile_functions(FLUSH, STATUS))
    return _COMPILED[0]


def read() -> int:
    """This thread's MXCSR (x86 only)."""
    return int(_compiled().read())


def flushing_bits(mxcsr: int) -> int:
    """The FTZ and DAZ bits of an MXCSR value."""
    return mxcsr & FLUSH


def run(kernel: Callable[..., Any], *args: Any) -> Any:
    """``kernel(*args)`` with subnormals flushed to zero on this thread, its control bits (and so
    its floating-point environment) as they were afterwards."""
    if not X86:
        return kernel(*args)
    m = _COMPILED[0] if _COMPILED else _compiled()
    old = m.enter()
    try:
        return kernel(*args)
    finally:
        m.leave(old)
