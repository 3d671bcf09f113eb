"""Numba functions over x86's MXCSR (imported on first use by :mod:`._fpenv`: this imports numba).

The bits they set and keep are :mod:`._fpenv`'s: it passes them to :func:`compile_functions`
(this module imports nothing of it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ._compile import jit

__all__ = ["MxcsrFunctions", "compile_functions"]


def _call_mxcsr_intrinsic(builder: ir.IRBuilder, name: str, slot: ir.Value) -> None:
    """A call of the MXCSR intrinsic ``name`` (``stmxcsr`` stores MXCSR into ``slot``, ``ldmxcsr``
    loads it from there) on the 32-bit ``slot``'s address."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p]), name)
    builder.call(fn, [builder.bitcast(slot, i8p)])


@intrinsic
def _stmxcsr(typingctx):
    """This thread's MXCSR (``llvm.x86.sse.stmxcsr``)."""

    def codegen(context, builder, signature, args):
        slot = cgutils.alloca_once(builder, ir.IntType(32))
        _call_mxcsr_intrinsic(builder, "llvm.x86.sse.stmxcsr", slot)
        return builder.load(slot)

    return types.uint32(), codegen


@intrinsic
def _ldmxcsr(typingctx, value):
    """Set this thread's MXCSR (``llvm.x86.sse.ldmxcsr``)."""

    def codegen(context, builder, signature, args):
        _call_mxcsr_intrinsic(builder, "llvm.x86.sse.ldmxcsr", cgutils.alloca_once_value(builder, args[0]))
        return context.get_dummy_value()

    return types.void(types.uint32), codegen


# kda.cpu's one Numba decorator with numba.njit's own defaults (no fastmath, Python's error model)
_jit = jit(fastmath=False, error_model="python", stamp=False)


@_jit
def _read():
    """This thread's MXCSR."""
    return _stmxcsr()


class MxcsrFunctions(NamedTuple):
    """The compiled functions over this thread's MXCSR, for one pair of masks."""

    read: Any  # () -> the MXCSR
    enter: Any  # () -> the MXCSR before; sets the bits of ``flush``
    leave: Any  # (old) -> None; puts back the bits of ``old`` but those of ``status``


def compile_functions(flush: int, status: int) -> MxcsrFunctions:
    """The MXCSR functions that set the bits ``flush`` (:func:`enter`) and put back every bit but
    the sticky ``status`` flags raised since (:func:`leave`); the masks are compile-time
    constants (Numba freezes the closure's values; its cache keys on them)."""

    @_jit
    def enter():
        """Set the bits of ``flush``; return the MXCSR before."""
        old = _stmxcsr()
        _ldmxcsr(old | np.uint32(flush))
        return old

    @_jit
    def leave(old):
        """Put back the control bits of ``old``, keeping the status flags raised since."""
        _ldmxcsr((np.uint32(old) & ~np.uint32(status)) | (_stmxcsr() & np.uint32(status)))

    return MxcsrFunctions(_read, enter, leave)
