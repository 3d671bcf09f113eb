"""Matrix products of the CPU kernels: ``_mm``, BLAS ``gemm`` on row-major 2-D arrays through
Numba's own ``numba_xxgemm`` (the BLAS of SciPy's ``cython_blas``, as ``np.dot`` calls it), in
blocks of :data:`GEMM_BLOCK <kda.cpu._compile.GEMM_BLOCK>` rows and columns of the result."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic
from numba.np.linalg import check_blas_return, ensure_blas, get_blas_kind

from . import _compile as cfg
from ._compile import jit


@intrinsic
def _xxgemm(typingctx, ta, tb, m, n, k, a, ia, lda, b, ib, ldb, beta, c, ic, ldc):
    """Column-major BLAS ``gemm`` (Numba's own ``numba_xxgemm``, as ``np.dot`` calls it) on the
    buffers of arrays ``a, b, c`` from the flat element offsets ``ia, ib, ic``, ``alpha = 1``;
    ``ta, tb`` are the characters' codes (``ord("n")``, ``ord("t")``)."""
    ensure_blas()
    sig = types.void(ta, tb, m, n, k, a, ia, lda, b, ib, ldb, beta, c, ic, ldc)

    def codegen(context, builder, signature, args):
        char, void_p = ir.IntType(8), ir.IntType(8).as_pointer()
        intp = context.get_value_type(types.intp)
        fnty = ir.FunctionType(
            ir.IntType(32),
            [char, char, char, intp, intp, intp, void_p, void_p, intp, void_p, intp, void_p, void_p, intp],
        )
        fn = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")
        vta, vtb, vm, vn, vk, _, via, vlda, _, vib, vldb, vbeta, _, vic, vldc = args
        tys = signature.args
        dtype = tys[5].dtype

        def at(i, offset):
            data = context.make_array(tys[i])(context, builder, args[i]).data
            return builder.bitcast(builder.gep(data, [offset]), void_p)

        def slot(value, ty):
            cell = cgutils.alloca_once_value(builder, context.cast(builder, value, ty, dtype))
            return builder.bitcast(cell, void_p)

        call = (
            ir.Constant(char, ord(get_blas_kind(dtype))), builder.trunc(vta, char), builder.trunc(vtb, char),
            vm, vn, vk, slot(ir.Constant(context.get_value_type(dtype), 1.0), dtype), at(5, via), vlda,
            at(8, vib), vldb, slot(vbeta, tys[11]), at(12, vic), vldc,
        )  # fmt: skip
        check_blas_return(context, builder, builder.call(fn, call))

    return sig, codegen


@jit()
def _mm(A, ta, B, tb, C, beta):
    """``C = op(A) @ op(B) + beta C`` (row-major; ``op(X) = X.T`` where ``tX``) in blocks of
    :data:`GEMM_BLOCK` rows and columns of ``C``. Arrays are 2-D with unit inner stride (row
    strides are passed to BLAS, so row-strided views work). A block's sums run over the whole
    inner dimension in one call, so cutting ``C`` into blocks leaves every element's sum whole."""
    m, n = C.shape
    k = A.shape[0] if ta else A.shape[1]
    lda, ldb, ldc = A.strides[0] // A.itemsize, B.strides[0] // B.itemsize, C.strides[0] // C.itemsize
    # row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T
    fa, fb = 116 if ta else 110, 116 if tb else 110  # ord("t"), ord("n")
    for i0 in range(0, m, cfg.GEMM_BLOCK):
        mi = min(cfg.GEMM_BLOCK, m - i0)
        ia = i0 if ta else i0 * lda
        for j0 in range(0, n, cfg.GEMM_BLOCK):
            nj = min(cfg.GEMM_BLOCK, n - j0)
            ib = j0 * ldb if tb else j0
            _xxgemm(fb, fa, nj, mi, k, B, ib, ldb, A, ia, lda, beta, C, i0 * ldc + j0, ldc)
