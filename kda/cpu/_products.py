"""Matrix products of the CPU kernels: ``_mm``, BLAS ``gemm`` on row-major 2-D arrays, in blocks
of :data:`GEMM_BLOCK <kda.cpu._compile.GEMM_BLOCK>` rows and columns of the result.

The BLAS is the process's *product path* (:data:`PATH`), chosen once, when this module is first
imported (by the first kernel call), and logged on the ``kda.cpu`` logger:

- ``scipy``: the BLAS of SciPy's ``cython_blas`` (its OpenBLAS; the one Numba's ``np.dot`` calls),
  in every install;
- ``mkl``: Intel MKL's ``libmkl_rt`` (the ``mkl`` wheel, ``pip install "kda[mkl]"``), taken when it
  is installed and the processor is Intel's. AMD processors keep SciPy's BLAS unless asked: there
  MKL ran the chunk products slower (``docs/speed.md``, "Product paths";
  ``python -m benchmarks.products --paths scipy mkl``).

The environment variable ``KDA_CPU_PRODUCTS`` (``auto``, the default, ``scipy`` or ``mkl``)
overrides the choice. The kernels call Fortran ``sgemm``/``dgemm`` through two symbols,
``kda_sgemm`` and ``kda_dgemm``, bound to the chosen library's functions before any kernel is
linked, so compiled and cached kernels are the same for both paths. Each call of the BLAS runs on
one thread, so results are bitwise the same for any number of threads on a given path; another
path may change the last bits (``docs/speed.md``, "Product paths").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
import sys
from typing import NamedTuple

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba.core import cgutils, errors, types
from numba.extending import get_cython_function_address, intrinsic

from .._errors import InvalidInputError, KdaError
from . import _compile as cfg
from ._compile import jit

ENV = "KDA_CPU_PRODUCTS"
CHOICES = ("auto", "scipy", "mkl")
_SYMBOLS = {"s": "kda_sgemm", "d": "kda_dgemm"}
LOG = logging.getLogger("kda.cpu")


class ProductPath(NamedTuple):
    """The BLAS the kernels' products call: ``name`` (``"scipy"`` or ``"mkl"``), the ``library``
    file, its ``version`` and why it was chosen (``reason``)."""

    name: str
    library: str
    version: str
    reason: str


def _scipy() -> tuple[ProductPath, dict[str, int]]:
    """SciPy's ``cython_blas`` ``sgemm``/``dgemm`` (named by threadpoolctl where it can)."""
    import scipy
    import scipy.linalg.cython_blas

    addresses = {t: get_cython_function_address("scipy.linalg.cython_blas", f"{t}gemm") for t in _SYMBOLS}
    library, version = scipy.linalg.cython_blas.__file__, ""
    try:
        import threadpoolctl

        infos = [i for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
        here = os.path.dirname(os.path.dirname(scipy.__file__))  # SciPy's wheel: site-packages/scipy.libs
        info = next((i for i in infos if i.get("filepath", "").startswith(os.path.join(here, "scipy"))), None)
        if info is not None:
            library = info["filepath"]
            version = f"{info.get('internal_api')} {info.get('version')} ({info.get('architecture')})"
    except ImportError:
        pass
    return ProductPath("scipy", library, version, ""), addresses


def _mkl_files() -> list[str]:
    """Where ``libmkl_rt`` may be: the ``mkl`` wheel's ``lib`` folder of this environment (and of
    the base one), then the loader's search path."""
    found: list[str] = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        found += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")), reverse=True)
    name = ctypes.util.find_library("mkl_rt")
    return found + ([name] if name else [])


def _mkl() -> tuple[ProductPath, dict[str, int]] | str:
    """MKL's Fortran ``sgemm_``/``dgemm_`` (32-bit integers), or why it cannot be used."""
    layer = os.environ.get("MKL_INTERFACE_LAYER", "").upper()
    if "ILP64" in layer:
        return f"MKL_INTERFACE_LAYER={layer} (the kernels pass 32-bit integers)"
    files = _mkl_files()
    for file in files:
        try:
            lib = ctypes.CDLL(file)
            addresses = {t: ctypes.cast(getattr(lib, f"{t}gemm_"), ctypes.c_void_p).value for t in _SYMBOLS}
            text = ctypes.create_string_buffer(256)
            lib.mkl_get_version_string(text, ctypes.c_int(len(text)))
        except (OSError, AttributeError):  # not loadable, or not MKL's runtime
            continue
        version = " ".join(text.value.decode(errors="replace").split()[:8])
        return ProductPath("mkl", file, version, ""), addresses
    return "no libmkl_rt found (pip install 'kda[mkl]')" + (f"; could not load {files}" if files else "")


def vendor() -> str:
    """The processor's vendor string (``GenuineIntel``, ``AuthenticAMD``; ``""`` where unknown)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def choose(setting: str | None, cpu_vendor: str | None = None) -> tuple[ProductPath, dict[str, int]]:
    """The product path for ``setting`` (the value of ``KDA_CPU_PRODUCTS``; None or ``"auto"``:
    MKL where it is installed and ``cpu_vendor`` (default: this processor's) is Intel's, else
    SciPy's BLAS) and its ``gemm`` addresses by BLAS type letter."""
    value = (setting or "auto").strip().lower()
    if value not in CHOICES:
        msg = f"{ENV}: expected one of {', '.join(CHOICES)}; got {setting!r}"
        raise InvalidInputError(msg)
    cpu_vendor = vendor() if cpu_vendor is None and value == "auto" else cpu_vendor
    if value == "scipy":
        why = f"{ENV}=scipy"
    elif value == "auto" and cpu_vendor != "GenuineIntel":
        why = f"auto: processor {cpu_vendor or 'of unknown vendor'}, not Intel's"
    else:
        mkl = _mkl()
        if not isinstance(mkl, str):
            why = f"{ENV}=mkl" if value == "mkl" else "auto: an Intel processor, MKL installed"
            return _because(mkl, why)
        if value == "mkl":
            msg = f"{ENV}=mkl: {mkl}"
            raise KdaError(msg)
        why = f"auto: {mkl}"
    return _because(_scipy(), why)


def _because(found: tuple[ProductPath, dict[str, int]], reason: str) -> tuple[ProductPath, dict[str, int]]:
    path, addresses = found
    return path._replace(reason=reason), addresses


def _bind(path: ProductPath, addresses: dict[str, int]) -> ProductPath:
    for t, symbol in _SYMBOLS.items():
        llvm.add_symbol(symbol, addresses[t])
    LOG.info("kda.cpu matrix products: %s, %s %s (%s)", path.name, path.library, path.version, path.reason)
    return path


PATH = _bind(*choose(os.environ.get(ENV)))


@intrinsic
def _xxgemm(typingctx, ta, tb, m, n, k, a, ia, lda, b, ib, ldb, beta, c, ic, ldc):
    """Column-major Fortran ``gemm`` of the product path on the buffers of arrays ``a, b, c``
    from the flat element offsets ``ia, ib, ic``, ``alpha = 1``; ``ta, tb`` are the characters'
    codes (``ord("n")``, ``ord("t")``)."""
    letter = {types.float32: "s", types.float64: "d"}.get(getattr(a, "dtype", None))
    if letter is None:
        raise errors.TypingError(f"_mm computes float32 or float64 arrays; got {a}")
    sig = types.void(ta, tb, m, n, k, a, ia, lda, b, ib, ldb, beta, c, ic, ldc)

    def codegen(context, builder, signature, args):
        void_p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [void_p] * 13), _SYMBOLS[letter]
        )
        vta, vtb, vm, vn, vk, _, via, vlda, _, vib, vldb, vbeta, _, vic, vldc = args
        tys = signature.args
        dtype = tys[5].dtype

        def at(i, offset):
            data = context.make_array(tys[i])(context, builder, args[i]).data
            return builder.bitcast(builder.gep(data, [offset]), void_p)

        def cell(value):
            return builder.bitcast(cgutils.alloca_once_value(builder, value), void_p)

        def real(value, ty):
            return cell(context.cast(builder, value, ty, dtype))

        def integer(value):
            return cell(builder.trunc(value, i32))

        call = (
            cell(builder.trunc(vta, ir.IntType(8))),
            cell(builder.trunc(vtb, ir.IntType(8))),
            integer(vm),
            integer(vn),
            integer(vk),
            cell(ir.Constant(context.get_value_type(dtype), 1.0)),
            at(5, via),
            integer(vlda),
            at(8, vib),
            integer(vldb),
            real(vbeta, tys[11]),
            at(12, vic),
            integer(vldc),
        )
        builder.call(fn, call)
        return context.get_dummy_value()

    return sig, codegen


@jit(inner=True)
def empty2(rows, cols, dt):
    """An uninitialised C-contiguous ``[rows, cols]`` array of dtype ``dt`` whose data starts on a
    64-byte boundary. The kernels' scratch arrays (every operand of ``_mm``) are made so: MKL's
    results may depend on its operands' alignment, so a fixed alignment keeps them the same from
    call to call (OpenBLAS's do not depend on it)."""
    raw = np.empty(rows * cols + 16, dt)  # room to skip up to 15 float32 (7 float64) elements
    per = 64 // raw.itemsize
    skip = (-(raw.ctypes.data // raw.itemsize)) % per
    return raw[skip : skip + rows * cols].reshape((rows, cols))


@jit(inner=True)
def copy2(src, dst):
    """``dst[:, :] = src`` (2-D arrays of one shape), element by element. The kernels copy arrays
    so rather than by slice assignment: Numba compiles, with every slice assignment from an array,
    the formatting of its shape-mismatch message (``str``, ``join``: seconds of compile time)."""
    for i in range(dst.shape[0]):
        for j in range(dst.shape[1]):
            dst[i, j] = src[i, j]


@jit(inner=True, any_layout=True)  # BLAS takes the row strides: one signature for every layout
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
