"""How the CPU backend's Numba functions are compiled: the one decorator every Numba module of
:mod:`kda.cpu` uses (:func:`jit`: the chunk kernels, the decode kernel, the MXCSR functions), the
stamps of their cache entries, the notice of the first compilation, and the block sizes chosen per
kind of core (imported on first use: this imports numba).

The functions are cached on disk where a cache is writable (:data:`CACHE`; :mod:`._cache` decides
where, once, and locks the entries that processes share). The kernels live in several modules by
phase (:mod:`._products`, :mod:`._pairs`, :mod:`._solve`, :mod:`._passes`, :mod:`._fused`) that
call each other's compiled functions. Numba's cache checks only the source file that defines a
kernel, so a kernel would keep running stale compiled copies of helpers in another file after they
change; every kernel's cache entry is therefore stamped with a hash of all of these files and of
the files that say how they are compiled (:data:`SOURCE_STAMP`): a change to any of them recompiles
all. The decode kernels and the MXCSR functions call nothing of another file: their entries are
stamped with a hash of the latter alone (:data:`COMPILE_STAMP`).

The chunk kernels' helpers are inner functions (``jit(inner=True)``, :mod:`._inner`): compiled
only inside the kernels that call them: the first compilation is about a third shorter, LLVM's part
of it half. The matrix product compiles once per dtype for every layout its callers pass
(``jit(any_layout=True)``), and the chunk kernels compile without LLVM's loop strength reduction
(:data:`_CODEGEN_OPTIONS`). A first forward whose caller says a backward follows has the backward
kernel compiled beside it, in a second process (:mod:`._ahead`); a signature compiles in one
process at a time (:func:`_compile_guarded`). All of this stands on Numba internals
(:mod:`._internals`); where this Numba's are not the ones expected, every function compiles as a
plain Numba function (the same results, a slower first call; one warning says so).

The first compilation of a kda function in a process is announced once, on the ``kda.cpu``
logger at level ``WARNING`` (shown by Python's default handler; silenced with
``logging.getLogger("kda.cpu").setLevel(logging.ERROR)``); each compiled entry point's time follows
at level ``INFO``. ``python -m kda warmup`` compiles every kernel ahead of time.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numba
from llvmlite import binding as llvm
from numba.core import event, sigutils, types
from numba.core.compiler_lock import global_compiler_lock

from . import _cache, _internals
from ._cache import CACHE, CACHING

# the inner functions' machinery subclasses Numba internals: imported where they are the expected ones
_inner: Any = None
if _internals.SUPPORTED:
    from . import _inner

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


# The modules that say how the kernels compile and are cached, then those whose compiled functions
# call each other (one cache stamp for all of them)
COMPILE_FILES = ("_compile.py", "_inner.py", "_cache.py", "_internals.py")
KERNEL_FILES = (*COMPILE_FILES, "_products.py", "_pairs.py", "_solve.py", "_passes.py", "_fused.py")


def source_stamp(directory: str, files: tuple[str, ...] = KERNEL_FILES) -> str:
    """The SHA-256 of ``files`` (default :data:`KERNEL_FILES`) in ``directory``, one after
    another (hex)."""
    digest = hashlib.sha256()
    for name in files:
        with open(os.path.join(directory, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


SOURCE_STAMP = source_stamp(os.path.dirname(os.path.abspath(__file__)))
# the stamp of the functions of a module that calls no compiled function of another: the hash of
# how they are compiled, beside Numba's own check of their file
COMPILE_STAMP = source_stamp(os.path.dirname(os.path.abspath(__file__)), COMPILE_FILES)

LOG = logging.getLogger("kda.cpu")


class _CompileNotice(event.Listener):
    """Announces the first compilation of a kda function in the process (``WARNING``, once) and
    logs each compiled entry point's time (``INFO``): Numba's ``numba:compile`` events, which
    fire only where a function is compiled (not where it is loaded from the cache)."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = 0.0
        self.told = False

    def on_start(self, ev: event.Event) -> None:
        self.depth += 1
        if self.depth != 1 or not _ours(ev.data["dispatcher"]):
            return
        self.started = time.perf_counter()
        if not self.told:
            self.told = True
            where = "nowhere: no cache directory is writable" if CACHE is None else "in a cache"
            ahead = sys.modules.get("kda.cpu._ahead")  # imported by a first forward that asked for it
            beside = ahead.running() if ahead is not None else []
            also = f"; {', '.join(beside)} in a second process beside this one" if beside else ""
            LOG.warning(
                "kda: compiling the CPU kernels for their first use (tens of seconds; kept %s%s). "
                "`python -m kda warmup` compiles them all ahead of time.",
                where,
                also,
            )

    def on_end(self, ev: event.Event) -> None:
        self.depth -= 1
        if self.depth == 0 and _ours(ev.data["dispatcher"]):
            name = ev.data["dispatcher"].py_func.__name__
            args = ", ".join(str(a) for a in ev.data["args"])
            LOG.info("kda.cpu compiled %s in %.1f s (%s)", name, time.perf_counter() - self.started, args)


def _ours(dispatcher: Any) -> bool:
    module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
    return module.startswith("kda.")


event.register("numba:compile", _CompileNotice())


def _stamp(kernel: Any, stamp: bool) -> str | None:
    """Stamp the cache entries of the dispatcher ``kernel`` with :data:`SOURCE_STAMP` (``stamp``)
    or :data:`COMPILE_STAMP` and lock their saves and loads, where it is cached
    (:func:`._cache.stamp_entries`); the path of its cache index (None where uncached)."""
    if not CACHING:
        return None
    return _cache.stamp_entries(kernel, SOURCE_STAMP if stamp else COMPILE_STAMP)


# LLVM's code generation for the chunk kernels: without loop strength reduction (LSR), which
# rewrites the loops' address arithmetic: a sixth of LLVM's time on the kernels' modules and more
# downstream (the first forward and backward compile about 2 s sooner), at the same speed
# (docs/speed.md, "Compiling the kernels") and the same bits (it changes no arithmetic on values).
# LLVM's options are the process's: set while a kernel compiles (under Numba's compiler lock, so
# no other compilation sees them) and set back to LLVM's defaults after.
_CODEGEN_OPTIONS = ("-disable-lsr=true",)
_CODEGEN_DEFAULTS = ("-disable-lsr=false",)


@contextlib.contextmanager
def _codegen_options() -> Iterator[None]:
    """:data:`_CODEGEN_OPTIONS` within the block, LLVM's defaults after (also when it raises)."""
    for option in _CODEGEN_OPTIONS:
        llvm.set_option("kda", option)
    try:
        yield
    finally:
        for option in _CODEGEN_DEFAULTS:
            llvm.set_option("kda", option)


def _compile_guarded(kernel: Any, index_path: str | None, codegen: bool) -> None:
    """Make the dispatcher ``kernel`` compile (or load) a signature it does not hold under Numba's
    compiler lock (one thread of this process at a time) and:

    - where it is cached (``index_path``: its cache index), holding that signature's lock file
      (:func:`._cache.compiling_lock`): where another process is compiling it (the backward compiled
      ahead beside a forward, :mod:`._ahead`; workers started together), this one waits and then
      loads what that one saved, instead of compiling it a second time. A process holds such locks
      along its chain of callees only, which never loops (no kernel or helper calls itself), so two
      processes never wait for each other;
    - with ``codegen`` (the chunk kernels), with LLVM's :data:`_CODEGEN_OPTIONS` (its own code and
      whatever it compiles meanwhile)."""
    if index_path is None and not codegen:
        return
    compile_here = kernel.compile

    def compile(sig: Any) -> Any:
        with global_compiler_lock:
            args, _ = sigutils.normalize_signature(sig)
            if tuple(args) in kernel.overloads:
                return compile_here(sig)
            with contextlib.ExitStack() as scope:
                if index_path is not None:
                    lock = _cache.compiling_lock(index_path, tuple(args))
                    scope.enter_context(_cache.locked(lock, exclusive=True, wait_s=_cache.COMPILING_WAIT_S))
                if codegen:
                    scope.enter_context(_codegen_options())
                return compile_here(sig)

    kernel.compile = compile


def _any_layout(kernel: Any) -> None:
    """Make the dispatcher ``kernel`` compile one signature for its compiled callers whatever the
    layouts of their arrays (``A``) and whether their scalars are constants: its callers' calls
    convert their arguments to it (a C-contiguous array is an ``A`` one; a constant its type)."""
    get_call_template = kernel.get_call_template

    def any_layout_template(args: Any, kws: Any) -> Any:
        args = tuple(types.unliteral(a) for a in args)
        args = tuple(a.copy(layout="A") if isinstance(a, types.Array) else a for a in args)
        return get_call_template(args, kws)

    kernel.get_call_template = any_layout_template


def is_inner(kernel: Any) -> bool:
    """Whether the dispatcher ``kernel`` compiles an inner function (``jit(inner=True)``)."""
    return _inner is not None and _inner.is_inner(kernel)


def jit(
    fastmath: Any = _FASTMATH,
    *,
    error_model: str = "numpy",
    stamp: bool = True,
    inner: bool = False,
    any_layout: bool = False,
    **options: Any,
) -> Callable[[Callable[..., Any]], Any]:
    """The decorator of every Numba function of :mod:`kda.cpu`: ``numba.njit`` with ``nogil``,
    ``fastmath``, ``error_model`` and ``options``, cached on disk where :data:`CACHING` (in kda's
    :func:`._cache.fallback_dir` where Numba's own directories are not writable), else compiled per
    process. With ``stamp``, the function's cache entries are stamped with
    :data:`SOURCE_STAMP` (the kernels, which call each other across files); without (a module
    that calls no compiled function of another), with :data:`COMPILE_STAMP`: both beside Numba's
    own check of the function's file.
    With ``inner``, a function only compiled functions call: compiled inside its callers only
    (its lowered module cached; :mod:`._inner`). With ``any_layout``, a function whose
    code does not depend on its arrays' layouts (one that hands them to BLAS): compiled once for
    all of its compiled callers' layouts and constants (:func:`_any_layout`), not once for each.
    Where this Numba's internals are not the ones kda uses (:data:`._internals.SUPPORTED`), none of
    this but the options and Numba's own cache: a plain Numba function."""

    options = {"nogil": True, "fastmath": fastmath, "error_model": error_model, **options}
    njit = numba.njit(cache=CACHE == "numba", **options)

    def decorate(fn: Callable[..., Any]) -> Any:
        if not _internals.SUPPORTED:
            return njit(fn)
        kernel = _inner.inner(fn, options, complete, guard) if inner else complete(fn)
        if any_layout:
            _any_layout(kernel)
        return kernel

    def guard(kernel: Any) -> None:  # an inner function's: its cache stamped, compiled under its lock
        _compile_guarded(kernel, _stamp(kernel, stamp), codegen=False)

    def complete(fn: Callable[..., Any]) -> Any:
        kernel = njit(fn)
        if _cache.FALLBACK_CACHE is not None:
            kernel._cache = _cache.FALLBACK_CACHE(kernel.py_func)  # as Dispatcher.enable_caching does
        # codegen: the chunk kernels (the decode kernel and the MXCSR functions as Numba has them)
        _compile_guarded(kernel, _stamp(kernel, stamp), codegen=stamp)
        return kernel

    return decorate
