"""Numba functions over x86's MXCSR (imported on first use by :mod:`._fpenv`: this imports numba)."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ._fpenv import FLUSH, STATUS

__all__ = ["enter", "leave", "read"]


def _call(builder: ir.IRBuilder, name: str, slot: ir.Value) -> None:
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p]), name)
    builder.call(fn, [builder.bitcast(slot, i8p)])


@intrinsic
def _stmxcsr(typingctx):
    """This thread's MXCSR (``llvm.x86.sse.stmxcsr``)."""

    def codegen(context, builder, signature, args):
        slot = cgutils.alloca_once(builder, ir.IntType(32))
        _call(builder, "llvm.x86.sse.stmxcsr", slot)
        return builder.load(slot)

    return types.uint32(), codegen


@intrinsic
def _ldmxcsr(typingctx, value):
    """Set this thread's MXCSR (``llvm.x86.sse.ldmxcsr``)."""

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.sse.ldmxcsr", cgutils.alloca_once_value(builder, args[0]))
        return context.get_dummy_value()

    return types.void(types.uint32), codegen


def _jit(fn):
    try:
        return numba.njit(nogil=True, cache=True)(fn)
    except (RuntimeError, OSError):  # numba: "no locator available" (a read-only install)
        return numba.njit(nogil=True, cache=False)(fn)


@_jit
def read():
    """This thread's MXCSR."""
    return _stmxcsr()


@_jit
def enter():
    """Set FTZ and DAZ; return the MXCSR before."""
    old = _stmxcsr()
    _ldmxcsr(old | np.uint32(FLUSH))
    return old


@_jit
def leave(old):
    """Put back the control bits of ``old``, keeping the status flags raised since."""
    _ldmxcsr((np.uint32(old) & ~np.uint32(STATUS)) | (_stmxcsr() & np.uint32(STATUS)))
