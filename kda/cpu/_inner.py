"""Inner functions (``jit(inner=True)``, :mod:`._compile`): compiled only inside the kernels that
call them.

Numba compiles every function into an LLVM module of its own, with wrappers that let Python
call it, optimises that module and emits its machine code, then links the module into each
caller, whose module is optimised and emitted again with it. For a function that only other
compiled functions call (every helper of the kernels) its own optimisation, wrappers and machine
code are never used: most of a cold compile. An inner function is typed and lowered without
wrappers, and its module (after Numba's function passes) is linked into its callers, to be
optimised there once; it never has machine code of its own. A call from Python (tests call
helpers directly) runs a separate, complete compilation of the same function
(:func:`_from_python`, cached as an entry point is). The callers' code is the same: LLVM
optimises the callees in the caller's module either way (the kernels' results are bitwise those
of complete compilation: scripts/fixed_calls.py). An inner function's lowered module is cached
(as bitcode), so that a process compiling a new signature of a kernel does not type and lower
its helpers again.

This module subclasses Numba internals (:mod:`._internals` checks them); it is imported only where
they are the ones it expects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
from llvmlite import binding as llvm
from numba.core import caching, compiler, typed_passes
from numba.core.codegen import JITCodeLibrary
from numba.core.compiler_lock import global_compiler_lock
from numba.core.compiler_machinery import register_pass

from ._cache import CACHE, fallback_cache


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
    complete = FROM_PYTHON.get(fn)
    if complete is None:
        with global_compiler_lock:
            complete = FROM_PYTHON.get(fn)
            if complete is None:
                complete = FROM_PYTHON[fn] = _INNER[fn](fn)
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
FROM_PYTHON: dict[Callable[..., Any], Any] = {}
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
    _INNER_CACHE = fallback_cache(CACHE, _InnerCacheImpl)


def inner(
    fn: Callable[..., Any],
    options: dict[str, Any],
    complete: Callable[..., Any],
    guard: Callable[[Any], None],
) -> Any:
    """``fn`` as an inner function: a Numba dispatcher compiling with :class:`_InnerCompiler`,
    without wrappers, cached with :class:`_InnerCacheImpl`, its compilations guarded by ``guard``
    (given the dispatcher: stamps its cache entries and locks its compilations), whose entry
    points stay out of its table of compiled C functions. A call from Python finds none
    there and asks the dispatcher's ``_compile_for_args``, which here returns the complete
    compilation (``complete(fn)``, made once): Numba's dispatcher then calls that with the
    arguments."""
    _INNER[fn] = complete
    kernel = numba.njit(cache=False, pipeline_class=_InnerCompiler, **_NO_WRAPPERS, **options)(fn)
    if _INNER_CACHE is not None:
        kernel._cache = _INNER_CACHE(fn)
    guard(kernel)
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


def is_inner(kernel: Any) -> bool:
    """Whether the dispatcher ``kernel`` compiles an inner function (:func:`inner`)."""
    return getattr(getattr(kernel, "_compiler", None), "pipeline_class", None) is _InnerCompiler
