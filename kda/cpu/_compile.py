"""How the CPU backend's Numba functions are compiled: the one decorator every Numba module of
:mod:`kda.cpu` uses (:func:`jit`: the chunk kernels, the decode kernel, the MXCSR functions), its
disk cache, and the block sizes chosen per kind of core (imported on first use: this imports numba).

The cache: whether Numba can write one for this directory is decided once, here, before any
function is decorated (:data:`CACHING`, asked of Numba's own cache locators: ``NUMBA_CACHE_DIR``,
the ``__pycache__`` beside the sources, the user-wide cache directory). Where none is writable (a
read-only install under a user without a writable home) every function compiles per process,
uncached; nothing raises later.

The kernels live in several modules by phase (:mod:`._products`, :mod:`._pairs`, :mod:`._solve`,
:mod:`._passes`, :mod:`._fused`) that call each other's compiled functions. Numba's cache checks
only the source file that defines a kernel, so a kernel would keep running stale compiled copies
of helpers in another file after they change; every kernel's cache entry is therefore stamped
with a hash of all of these files (:data:`SOURCE_STAMP`): a change to any of them recompiles all.
The decode kernels and the MXCSR functions call nothing of another file and are not stamped.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import numba

# No nnan/ninf: -inf gates must stay exact. Reassociation lets channel loops vectorise; the
# compiled order is fixed, so results are deterministic.
_FASTMATH = {"reassoc", "contract"}


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


def _probe() -> int:  # pragma: no cover - never called: decorated once to ask Numba for a cache
    return 0


def cache_writable() -> bool:
    """Whether Numba can keep a disk cache of the functions of this directory: one of its cache
    locators (``NUMBA_CACHE_DIR``, the ``__pycache__`` beside the sources, the user-wide cache
    directory) finds a directory it can create and write a file in. Numba asks them when a
    function is decorated with ``cache=True`` and raises where none can; asked here with a probe
    function of this file (every Numba module of :mod:`kda.cpu` sits in this directory)."""
    try:
        numba.njit(cache=True)(_probe)
    except (RuntimeError, OSError):  # numba: "cannot cache function ...: no locator available"
        return False
    return True


# decided once, before any function is decorated: False where no cache is writable (a read-only
# install, no writable home): every function then compiles per process
CACHING = cache_writable()


def jit(
    fastmath: Any = _FASTMATH, *, error_model: str = "numpy", stamp: bool = True, **options: Any
) -> Callable[[Callable[..., Any]], Any]:
    """The decorator of every Numba function of :mod:`kda.cpu`: ``numba.njit`` with ``nogil``,
    ``fastmath``, ``error_model`` and ``options``, cached on disk where :data:`CACHING` (else
    compiled per process). With ``stamp``, the function's cache entries are stamped with
    :data:`SOURCE_STAMP` (the kernels, which call each other across files); without, Numba's
    own check of the function's file alone (a module that calls no compiled function of another)."""

    njit = numba.njit(cache=CACHING, nogil=True, fastmath=fastmath, error_model=error_model, **options)

    def decorate(fn: Callable[..., Any]) -> Any:
        kernel = njit(fn)
        index = getattr(getattr(kernel, "_cache", None), "_cache_file", None)
        if stamp and CACHING and index is not None:  # Numba's index of the function's cache entries
            index._source_stamp = (SOURCE_STAMP, index._source_stamp)
        return kernel

    return decorate
