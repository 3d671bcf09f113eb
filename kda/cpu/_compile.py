"""How the CPU backend's kernels are compiled: the Numba decorator every kernel module uses, its
cache and the block sizes chosen per kind of core (imported on first use: this imports numba).

The kernels live in several modules by phase (:mod:`._products`, :mod:`._pairs`, :mod:`._solve`,
:mod:`._passes`, :mod:`._fused`) that call each other's compiled functions. Numba's cache checks
only the source file that defines a kernel, so a kernel would keep running stale compiled copies
of helpers in another file after they change; every kernel's cache entry is therefore stamped
with a hash of all of these files (:data:`SOURCE_STAMP`): a change to any of them recompiles all.
"""

from __future__ import annotations

import hashlib
import os

import numba

# No nnan/ninf: -inf gates must stay exact. Reassociation lets channel loops vectorise; the
# compiled order is fixed, so results are deterministic.
_FASTMATH = {"reassoc", "contract"}


CACHING = True  # False when no cache directory is writable (a read-only install)

# Key sizes below this form [W, U0] by forward substitution (more accurate there), above by BLAS
SUBSTITUTE_BELOW = 16


def _avx512() -> bool:
    """Whether the kernels are compiled for AVX-512: Numba's target features (the host's unless
    ``NUMBA_CPU_FEATURES`` says otherwise). Numba's cache keys on them, so a cached kernel always
    carries the block sizes chosen here for its target."""
    features = numba.config.CPU_FEATURES
    if features is None:
        from llvmlite import binding

        features = binding.get_host_cpu_features().flatten()
    return "+avx512f" in features.split(",")


# The block sizes are measured per kind of core (docs/speed.md, "Block sizes by kind of core").
# With AVX-512, OpenBLAS takes products up to [64, k] @ [k, 64] through its small-matrix kernels
# (no packing) and the hand loops run 16 float32 lanes: small products are cheap, so sub-blocks
# and solve blocks of 8 steps, and larger products cut into 64 x 64 blocks. With AVX2 (Zen 3
# here), every BLAS call packs its operands (an 8 x 128 x 64 product costs ~8 us, a 128 x 128 x
# 128 one 68 us as one call, 84 as four): fewer and larger calls, blocks of 16, products whole.
def block_sizes(wide: bool) -> tuple[int, int, int]:
    """``(GEMM_BLOCK, SUB_BLOCK, SOLVE_BLOCK)`` for AVX-512 (``wide``) or narrower vectors:
    the rows and columns of one BLAS call's result (a larger product is cut into such blocks), the
    steps of a sub-block of a chunk (pairs inside one by running products, across them by matrix
    products: :func:`_pairs`) and the rows of a block of the solve for ``U`` (:func:`_solve_blocks`)."""
    return (64, 8, 8) if wide else (1 << 20, 16, 16)


WIDE = _avx512()
GEMM_BLOCK, SUB_BLOCK, SOLVE_BLOCK = block_sizes(WIDE)


# The modules whose compiled functions call each other (one cache stamp for all of them)
KERNEL_FILES = ("_compile.py", "_products.py", "_pairs.py", "_solve.py", "_passes.py", "_fused.py")


def source_stamp(directory: str) -> str:
    """The SHA-256 of the :data:`KERNEL_FILES` in ``directory``, one after another (hex)."""
    digest = hashlib.sha256()
    for name in KERNEL_FILES:
        with open(os.path.join(directory, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


SOURCE_STAMP = source_stamp(os.path.dirname(os.path.abspath(__file__)))


def jit(fastmath=_FASTMATH):
    """``numba.njit`` (``nogil``, ``fastmath``, NumPy's error model) with caching, its cache entries
    stamped with :data:`SOURCE_STAMP`; without caching where no cache directory is writable (a
    read-only install: Numba finds no cache locator), which sets :data:`CACHING` to False."""

    def decorate(fn):
        global CACHING
        options = {"nogil": True, "fastmath": fastmath, "error_model": "numpy"}
        try:
            kernel = numba.njit(cache=True, **options)(fn)
        except (RuntimeError, OSError):  # numba: "no locator available" for a read-only tree
            CACHING = False
            return numba.njit(cache=False, **options)(fn)
        index = getattr(getattr(kernel, "_cache", None), "_cache_file", None)
        if index is not None:  # Numba's index of the function's cache entries
            index._source_stamp = (SOURCE_STAMP, index._source_stamp)
        return kernel

    return decorate
