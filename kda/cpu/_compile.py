"""How the CPU backend's Numba functions are compiled: the one decorator every Numba module of
:mod:`kda.cpu` uses (:func:`jit`: the chunk kernels, the decode kernel, the MXCSR functions), its
disk cache, the notice of the first compilation, and the block sizes chosen per kind of core
(imported on first use: this imports numba).

The cache: where it is written is decided once, here, before any function is decorated
(:data:`CACHE`). First Numba's own cache locators (``NUMBA_CACHE_DIR``, the ``__pycache__`` beside
the sources, the user-wide ``$XDG_CACHE_HOME/numba`` or ``~/.cache/numba``); where none is
writable (a read-only install under a user without a writable home), kda's own per-user
directory in the temporary directory (:func:`fallback_dir`: ``kda-numba-<uid>``, mode ``0700``,
used only where it is this user's and no other user can write it: a cache entry is a pickle).
Only where that fails too does every function compile per process, uncached; nothing raises
later. Processes share a cache safely: Numba writes each file whole and renames it into place,
and kda makes each save of an entry (index and data) and each load atomic with a lock file in
the cache directory (:func:`_lock_entries`).

The kernels live in several modules by phase (:mod:`._products`, :mod:`._pairs`, :mod:`._solve`,
:mod:`._passes`, :mod:`._fused`) that call each other's compiled functions. Numba's cache checks
only the source file that defines a kernel, so a kernel would keep running stale compiled copies
of helpers in another file after they change; every kernel's cache entry is therefore stamped
with a hash of all of these files (:data:`SOURCE_STAMP`): a change to any of them recompiles all.
The decode kernels and the MXCSR functions call nothing of another file: their entries are
stamped with a hash of this file alone (:data:`COMPILE_STAMP`: how they are compiled).

The chunk kernels' helpers are inner functions (``jit(inner=True)``, below): compiled only inside
the kernels that call them: the first compilation is about a third shorter, LLVM's part of it half.
The matrix product compiles once per dtype for every layout its callers pass (``jit(any_layout=
True)``), and the chunk kernels compile without LLVM's loop strength reduction
(:data:`_CODEGEN_OPTIONS`). A first forward whose caller says a backward follows has the backward
kernel compiled beside it, in a second process (:mod:`._ahead`); a signature compiles in one
process at a time (:func:`_compile_guarded`).

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
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numba
from llvmlite import binding as llvm
from numba.core import caching, compiler, event, sigutils, typed_passes, types
from numba.core.codegen import JITCodeLibrary
from numba.core.compiler_lock import global_compiler_lock
from numba.core.compiler_machinery import register_pass

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


def source_stamp(directory: str, files: tuple[str, ...] = KERNEL_FILES) -> str:
    """The SHA-256 of ``files`` (default :data:`KERNEL_FILES`) in ``directory``, one after
    another (hex)."""
    digest = hashlib.sha256()
    for name in files:
        with open(os.path.join(directory, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


SOURCE_STAMP = source_stamp(os.path.dirname(os.path.abspath(__file__)))
# the stamp of the functions of a module that calls no compiled function of another: this file's
# hash (how they are compiled), beside Numba's own check of their file
COMPILE_STAMP = source_stamp(os.path.dirname(os.path.abspath(__file__)), ("_compile.py",))


def _probe() -> int:  # pragma: no cover - never called: decorated once to ask Numba for a cache
    return 0


def cache_writable() -> bool:
    """Whether Numba's own cache locators (``NUMBA_CACHE_DIR``, the ``__pycache__`` beside the
    sources, the user-wide cache directory) find a directory they can create and write a file in.
    Numba asks them when a function is decorated with ``cache=True`` and raises where none can;
    asked here with a probe function of this file (every Numba module of :mod:`kda.cpu` sits in
    this directory)."""
    try:
        numba.njit(cache=True)(_probe)
    except (RuntimeError, OSError):  # numba: "cannot cache function ...: no locator available"
        return False
    return True


def fallback_dir(base: str | None = None) -> str | None:
    """kda's own cache directory where Numba finds none: ``kda-numba-<uid>`` in ``base`` (default:
    the temporary directory, :func:`tempfile.gettempdir`), created with mode ``0700``; None where it
    cannot be created or written, or is not safe to load from: not a directory of this user's (a
    link, another user's) or writable by others (Numba's cache index is a pickle: an entry written
    by another user could run code here)."""
    base = tempfile.gettempdir() if base is None else base
    uid = os.getuid() if hasattr(os, "getuid") else None
    path = os.path.join(base, f"kda-numba-{uid if uid is not None else 'user'}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or (uid is not None and st.st_uid != uid):
            return None
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return None
    return path


def _fallback_cache(root: str, impl: type | None = None) -> type | None:
    """Numba's function cache class (with ``impl`` for its cache implementation, default Numba's
    ``CompileResultCacheImpl``), located in ``root`` only (a subdirectory per source directory,
    as Numba's ``NUMBA_CACHE_DIR`` locator lays it out); None where this Numba lacks the classes
    it is made of (no cache then, rather than no backend)."""
    try:
        mixin, base = caching._SourceFileBackedLocatorMixin, caching._CacheLocator
        impl, cache = impl or caching.CompileResultCacheImpl, caching.FunctionCache
    except AttributeError:
        return None

    class Locator(mixin, base):
        def __init__(self, py_func: Any, py_file: str) -> None:
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = os.path.join(root, self.get_suitable_cache_subpath(py_file))

        def get_cache_path(self) -> str:
            return self._cache_path

    class Impl(impl):
        _locator_classes: ClassVar[list[type]] = [Locator]

    class Cache(cache):
        _impl_class = Impl

    return Cache


def _choose_cache() -> tuple[str | None, type | None]:
    """Where the functions are cached: ``"numba"`` where Numba's own locators find a writable
    directory, else kda's :func:`fallback_dir` (with its cache class), else None (no cache: every
    function compiles per process)."""
    if cache_writable():
        return "numba", None
    root = fallback_dir()
    cache = _fallback_cache(root) if root else None
    return (root, cache) if cache is not None else (None, None)


# decided once, before any function is decorated: "numba" (Numba's own cache directories), kda's
# fallback directory, or None where no cache is writable (every function then compiles per process)
CACHE, _FALLBACK_CACHE = _choose_cache()
CACHING = CACHE is not None

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


LOCK_FILE = "kda-cache.lock"


@contextlib.contextmanager
def _locked(path: str, exclusive: bool, wait_s: float | None = None) -> Iterator[None]:
    """``flock`` of the lock file ``path`` (created where it can be), exclusive or shared; no lock
    where there is no ``fcntl`` or the file can be neither created nor opened (a read-only cache
    is only ever read), nor after ``wait_s`` seconds of waiting for it (None: no limit)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            yield
            return
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        if wait_s is None:
            fcntl.flock(fd, mode)
        else:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break  # go on unlocked
                    time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # releases the lock


def _lock_entries(index: Any) -> None:
    """Numba's index of a function's cache entries (``IndexDataCacheFile``), its ``save`` and
    ``load`` made atomic among processes: Numba saves an entry by reading the index, choosing a
    data file name not in it, writing the index, then the data, with no lock, so two processes
    saving two signatures of one function at once can give both the same data file (one index
    entry then loads the other signature's code), and a process loading meanwhile can read an
    entry whose data is not yet written. Saves take the directory's lock file exclusively, loads
    shared."""
    path = os.path.join(index._cache_path, LOCK_FILE)
    save, load = index.save, index.load

    def locked_save(key: Any, data: Any) -> Any:
        with _locked(path, exclusive=True):
            return save(key, data)

    def locked_load(key: Any) -> Any:
        with _locked(path, exclusive=False):
            return load(key)

    index.save, index.load = locked_save, locked_load


# Inner functions: compiled only inside the kernels that call them.
#
# Numba compiles every function into an LLVM module of its own, with wrappers that let Python
# call it, optimises that module and emits its machine code, then links the module into each
# caller, whose module is optimised and emitted again with it. For a function that only other
# compiled functions call (every helper of the kernels) its own optimisation, wrappers and machine
# code are never used: most of a cold compile. An inner function (``jit(inner=True)``) is typed
# and lowered without wrappers, and its module (after Numba's function passes) is linked into its
# callers, to be optimised there once; it never has machine code of its own. A call from Python
# (tests call helpers directly) runs a separate, complete compilation of the same function
# (:func:`_from_python`, cached as an entry point is). The callers' code is the same: LLVM
# optimises the callees in the caller's module either way (the kernels' results are bitwise those
# of complete compilation: scripts/fixed_calls.py). An inner function's lowered module is cached
# (as bitcode), so that a process compiling a new signature of a kernel does not type and lower
# its helpers again.


class _InnerLibrary(JITCodeLibrary):
    """An inner function's code: finalised for linking into its callers after Numba's function
    passes only (no module passes), with no machine code of its own."""

    def _optimize_final_module(self) -> None:
        pass  # its callers optimise it, in their modules (its functions had Numba's function passes)

    def _finalize_final_module(self) -> None:
        self._finalized = True  # ready to link into callers; never added to the execution engine

    def get_pointer_to_function(self, name: str) -> int:
        raise RuntimeError(f"{self.name} is an inner function of kda.cpu: it has no machine code of its own")

    @property
    def has_dynamic_globals(self) -> bool:  # Numba's own count is made where its code is emitted
        return any(gv.name.startswith("numba.dynamic.globals") for gv in self._final_module.global_variables)

    def serialize_using_object_code(self) -> tuple[str, str, bytes]:
        """For the cache: the lowered module, its callees linked in, as LLVM bitcode (there is no
        object code)."""
        self._ensure_finalized()
        return (self.name, "kda-inner-bitcode", self._final_module.as_bitcode())

    @classmethod
    def from_bitcode(cls, codegen: Any, name: str, bitcode: bytes) -> _InnerLibrary:
        """The library of a cached inner function (:meth:`serialize_using_object_code`)."""
        library = cls(codegen, name)
        library._final_module = llvm.parse_bitcode(bitcode)
        library._finalized = True
        return library


class _InnerCacheImpl(caching.CompileResultCacheImpl):
    """Numba's cache of compile results for inner functions: the lowered module as bitcode,
    rebuilt into an :class:`_InnerLibrary` with a :class:`_FromPython` entry point. Its files are
    named apart (``inner-``) from those of the function's complete compilation."""

    def __init__(self, py_func: Callable[..., Any]) -> None:
        super().__init__(py_func)
        self._fn = py_func

    def get_filename_base(self, fullname: str, abiflags: str) -> str:
        return "inner-" + super().get_filename_base(fullname, abiflags)

    def check_cachable(self, cres: Any) -> bool:
        # A module that refers to addresses of this process (Numba's dynamic globals: dead code
        # in the lowered helpers that have them, gone once optimised in a kernel) is not saved;
        # such a helper is lowered again where a kernel is compiled. No warning: that is expected.
        return not cres.lifted and not cres.library.has_dynamic_globals

    def rebuild(self, target_context: Any, payload: Any) -> Any:
        libdata, fndesc, env, signature, objectmode, lifted, typeann, reload_init, referenced_envs = payload
        for init in reload_init or ():
            init()
        name, _kind, bitcode = libdata
        library = _InnerLibrary.from_bitcode(target_context.codegen(), name, bitcode)
        library._reload_init.update(reload_init or ())
        fields = dict.fromkeys(compiler.CR_FIELDS)
        fields.update(
            target_context=target_context,
            typing_context=target_context.typing_context,
            library=library,
            environment=env,
            entry_point=_FromPython(self._fn),
            fndesc=fndesc,
            type_annotation=typeann,
            signature=signature,
            objectmode=objectmode,
            lifted=lifted,
            reload_init=reload_init,
            referenced_envs=referenced_envs,
        )
        return compiler.CompileResult(**fields)


def _from_python(fn: Callable[..., Any]) -> Any:
    """The complete compilation of the inner function ``fn`` (its Python function), for calls from
    Python: made once, by :func:`jit`'s decorator without ``inner`` (cached and stamped as an entry
    point)."""
    complete = _FROM_PYTHON.get(fn)
    if complete is None:
        with global_compiler_lock:
            complete = _FROM_PYTHON.get(fn)
            if complete is None:
                complete = _FROM_PYTHON[fn] = _INNER[fn](fn)
    return complete


class _FromPython:
    """An inner function's entry point: the key its callers' lowering finds it by. Called (it is
    not, as Python's calls go to :func:`_from_python`), it runs the complete compilation."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _from_python(self._fn)(*args, **kwargs)


# per inner function (its Python function): the decorator that compiles it completely, and that
# compilation once Python has called it
_INNER: dict[Callable[..., Any], Callable[[Callable[..., Any]], Any]] = {}
_FROM_PYTHON: dict[Callable[..., Any], Any] = {}
_NO_WRAPPERS = {"no_cpython_wrapper": True, "no_cfunc_wrapper": True}


@register_pass(mutates_CFG=True, analysis_only=False)
class _InnerLowering(typed_passes.NativeLowering):
    """Numba's lowering into an :class:`_InnerLibrary`, whose entry point is a :class:`_FromPython`
    instead of compiled machine code."""

    _name = "kda_inner_lowering"

    def run_pass(self, state: Any) -> bool:
        context = state.targetctx
        if state.library is None:
            state.library = _InnerLibrary(context.codegen(), state.func_id.func_qualname)
        library, executable, fn = state.library, context.get_executable, state.func_id.func

        def get_executable(lib: Any, fndesc: Any, env: Any) -> Any:
            return _FromPython(fn) if lib is library else executable(lib, fndesc, env)

        shadowed = vars(context).get("get_executable")  # an enclosing inner lowering's, if any
        context.get_executable = get_executable  # for this pass only (under the compiler lock)
        try:
            return super().run_pass(state)
        finally:
            if shadowed is None:
                del context.get_executable
            else:
                context.get_executable = shadowed


class _InnerCompiler(compiler.CompilerBase):
    """Numba's nopython pipeline with :class:`_InnerLowering` for its lowering."""

    def define_pipelines(self) -> list[Any]:
        pm = compiler.DefaultPassBuilder.define_nopython_pipeline(self.state)
        pm.passes = [(_InnerLowering if p is typed_passes.NativeLowering else p, d) for p, d in pm.passes]
        pm.finalize()
        return [pm]


class _InnerCache(caching.FunctionCache):
    _impl_class = _InnerCacheImpl


# the inner functions' cache class, where the complete compilations' is (decided once, as CACHE)
_INNER_CACHE = _InnerCache if CACHE == "numba" else None
if CACHE is not None and CACHE != "numba":  # kda's fallback directory
    _INNER_CACHE = _fallback_cache(CACHE, _InnerCacheImpl)


def _inner(fn: Callable[..., Any], options: dict[str, Any], complete: Callable[..., Any], stamp: bool) -> Any:
    """``fn`` as an inner function: a Numba dispatcher compiling with :class:`_InnerCompiler`,
    without wrappers, cached with :class:`_InnerCacheImpl` (stamped as ``stamp`` says), whose
    entry points stay out of its table of compiled C functions. A call from Python finds none
    there and asks the dispatcher's ``_compile_for_args``, which here returns the complete
    compilation (``complete(fn)``, made once): Numba's dispatcher then calls that with the
    arguments."""
    _INNER[fn] = complete
    kernel = numba.njit(cache=False, pipeline_class=_InnerCompiler, **_NO_WRAPPERS, **options)(fn)
    if _INNER_CACHE is not None:
        kernel._cache = _INNER_CACHE(fn)
    _compile_guarded(kernel, _stamp(kernel, stamp), codegen=False)
    add_overload = kernel.add_overload

    def add_inner_overload(cres: Any) -> None:
        if isinstance(cres.entry_point, _FromPython):
            kernel.overloads[tuple(cres.signature.args)] = cres
        else:
            add_overload(cres)

    def from_python(*args: Any, **kwargs: Any) -> Any:
        return _from_python(fn)

    kernel.add_overload, kernel._compile_for_args = add_inner_overload, from_python
    return kernel


# the Numba internals inner functions stand on (numba 0.60-0.68 have them); without, helpers
# compile completely, as plain Numba functions
_INNER_SUPPORTED = all(
    hasattr(owner, name)
    for owner, name in (
        (JITCodeLibrary, "_optimize_final_module"),
        (JITCodeLibrary, "_finalize_final_module"),
        (compiler.DefaultPassBuilder, "define_nopython_pipeline"),
        (compiler, "CR_FIELDS"),
    )
)


def is_inner(kernel: Any) -> bool:
    """Whether the dispatcher ``kernel`` compiles an inner function (``jit(inner=True)``)."""
    return getattr(getattr(kernel, "_compiler", None), "pipeline_class", None) is _InnerCompiler


def _stamp(kernel: Any, stamp: bool) -> str | None:
    """Stamp the cache entries of the dispatcher ``kernel`` (:func:`jit`'s ``stamp``) and lock
    their saves and loads (:func:`_lock_entries`), where it is cached; the path of its cache index
    (None where uncached)."""
    index = getattr(getattr(kernel, "_cache", None), "_cache_file", None)
    if not CACHING or index is None:  # index: Numba's index of the function's cache entries
        return None
    index._source_stamp = (SOURCE_STAMP if stamp else COMPILE_STAMP, index._source_stamp)
    _lock_entries(index)
    return os.path.join(index._cache_path, index._index_name)


# how long a compilation waits for another process compiling the same function (a kernel takes
# seconds; a process stuck that long is not waited for further: this one compiles too)
COMPILING_WAIT_S = 600.0


def compiling_lock(index_path: str, args: tuple[Any, ...]) -> str:
    """The lock file held while the signature ``args`` of the function whose cache index is
    ``index_path`` compiles: beside the index, named by a hash of the signature."""
    return f"{index_path}.{hashlib.sha256(str(args).encode()).hexdigest()[:16]}.compiling"


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
      (:func:`compiling_lock`): where another process is compiling it (the backward compiled
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
                    lock = compiling_lock(index_path, tuple(args))
                    scope.enter_context(_locked(lock, exclusive=True, wait_s=COMPILING_WAIT_S))
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
    :func:`fallback_dir` where Numba's own directories are not writable), else compiled per
    process. With ``stamp``, the function's cache entries are stamped with
    :data:`SOURCE_STAMP` (the kernels, which call each other across files); without (a module
    that calls no compiled function of another), with :data:`COMPILE_STAMP`: both beside Numba's
    own check of the function's file.
    With ``inner``, a function only compiled functions call: compiled inside its callers only
    (its lowered module cached; :class:`_InnerLibrary`). With ``any_layout``, a function whose
    code does not depend on its arrays' layouts (one that hands them to BLAS): compiled once for
    all of its compiled callers' layouts and constants (:func:`_any_layout`), not once for each."""

    options = {"nogil": True, "fastmath": fastmath, "error_model": error_model, **options}
    njit = numba.njit(cache=CACHE == "numba", **options)

    def decorate(fn: Callable[..., Any]) -> Any:
        kernel = _inner(fn, options, complete, stamp) if inner and _INNER_SUPPORTED else complete(fn)
        if any_layout:
            _any_layout(kernel)
        return kernel

    def complete(fn: Callable[..., Any]) -> Any:
        kernel = njit(fn)
        if _FALLBACK_CACHE is not None:
            kernel._cache = _FALLBACK_CACHE(kernel.py_func)  # as Dispatcher.enable_caching does
        # codegen: the chunk kernels (the decode kernel and the MXCSR functions as Numba has them)
        _compile_guarded(kernel, _stamp(kernel, stamp), codegen=stamp)
        return kernel

    return decorate
