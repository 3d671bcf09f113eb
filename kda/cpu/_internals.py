"""The private Numba internals that :mod:`kda.cpu`'s compile machinery uses, checked once per process
before any function is decorated (:data:`SUPPORTED`).

kda compiles its kernels' helpers inside the kernels that call them (:mod:`._inner`), stamps and
locks the cache's entries (:mod:`._cache`), hooks the dispatchers' compilation and sets an LLVM
option while a chunk kernel compiles (:mod:`._compile`). Each of these stands on Numba internals
outside Numba's public API; :data:`CHECKS` checks each of them as kda uses it: the names, the
parameters kda calls them with or overrides, and the attributes Numba's own methods read and write
where kda reads, writes or wraps them. They hold for the Numba versions ``pyproject.toml`` allows
(its bounds, both of which CI runs). Where one is missing or has changed (another Numba), a single
``RuntimeWarning`` names it and every function compiles as a plain Numba function (``numba.njit``
cached by Numba alone, which checks only each function's own file: in a source tree, a change to a
helper in another file then needs the cache cleared): the same results, a slower first call, no
second compile process (:mod:`._ahead`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import numba

# the LLVM versions of the llvmlite releases that the allowed Numbas require: the versions on which
# LLVM's `-disable-lsr` option is known (LLVM ignores an option it does not know, silently)
LLVM_TESTED = range(20, 23)


def _code(fn: Any) -> Any:
    """The code object of ``fn`` (a function, method, class method or decorated function)."""
    return inspect.unwrap(getattr(fn, "__func__", fn)).__code__


def _uses(fn: Any, *names: str) -> bool:
    """Whether the code of ``fn`` refers to every one of ``names`` (attributes or globals)."""
    return set(names) <= set(_code(fn).co_names)


def _takes(fn: Any, *names: str) -> bool:
    """Whether ``fn``'s parameters are ``names``, in order."""
    return list(inspect.signature(inspect.unwrap(fn)).parameters) == list(names)


def _sets(cls: type, *names: str) -> bool:
    """Whether the ``__init__`` methods of ``cls`` and its bases refer to every one of ``names``
    (the attributes its instances are given)."""
    found = set()
    for base in cls.__mro__:
        if "__init__" in vars(base) and hasattr(vars(base)["__init__"], "__code__"):
            found |= set(_code(vars(base)["__init__"]).co_names)
    return set(names) <= found


def _has(owner: Any, *names: str) -> bool:
    return all(hasattr(owner, name) for name in names)


# the fields of the compile result kda builds for a cached inner function (_inner._InnerCacheImpl)
_RESULT_FIELDS = (
    "target_context",
    "typing_context",
    "library",
    "environment",
    "entry_point",
    "fndesc",
    "type_annotation",
    "signature",
    "objectmode",
    "lifted",
    "reload_init",
    "referenced_envs",
)
# the cache's payload of a compile result, as kda unpacks it (_inner._InnerCacheImpl.rebuild)
_PAYLOAD = (
    "libdata",
    "fndesc",
    "env",
    "signature",
    "objectmode",
    "lifted",
    "typeann",
    "reload_init",
    "referenced_envs",
)


def _payload() -> bool:
    from numba.core import caching, compiler

    result = compiler.CompileResult
    return (
        _takes(result._rebuild, "target_context", *_PAYLOAD)
        and _uses(caching.CompileResultCacheImpl.reduce, "_reduce")
        and _uses(caching.CompileResultCacheImpl.rebuild, "_rebuild")
        and set(_RESULT_FIELDS) <= set(compiler.CR_FIELDS)
    )


def _library() -> bool:
    from numba.core.codegen import JITCodeLibrary

    own = ("_optimize_final_module", "_finalize_final_module", "_get_module_for_linking")
    return (
        _has(
            JITCodeLibrary,
            *own,
            "_ensure_finalized",
            "serialize_using_object_code",
            "get_pointer_to_function",
        )
        and _uses(JITCodeLibrary.finalize, *own, "_final_module")
        and _uses(JITCodeLibrary._get_module_for_linking, "_final_module")
        and _sets(JITCodeLibrary, "_final_module", "_reload_init")
        and _takes(JITCodeLibrary.__init__, "self", "codegen", "name")
    )


def _pipeline() -> bool:
    from numba.core import compiler, compiler_machinery, typed_passes

    return (
        _has(compiler.DefaultPassBuilder, "define_nopython_pipeline")
        and _has(compiler.CompilerBase, "define_pipelines")
        and _has(compiler_machinery, "register_pass")
        and _sets(compiler_machinery.PassManager, "passes")
        and _uses(typed_passes.NativeLowering.run_pass, "library", "get_executable")
    )


def _dispatcher() -> bool:
    from numba.core import dispatcher, sigutils
    from numba.core.compiler_lock import global_compiler_lock

    cls = dispatcher.Dispatcher
    return (
        _takes(cls._compile_for_args, "self", "args", "kws")
        and _takes(cls.add_overload, "self", "cres")
        and _takes(cls.compile, "self", "sig")
        and _takes(cls.get_call_template, "self", "args", "kws")
        and _sets(cls, "_cache", "_compiler", "overloads")
        and _sets(dispatcher._FunctionCompiler, "pipeline_class")
        and _has(sigutils, "normalize_signature")
        and callable(global_compiler_lock)
    )


def _index() -> bool:
    from numba.core import caching

    index = caching.IndexDataCacheFile
    return (
        _takes(index.save, "self", "key", "data")
        and _takes(index.load, "self", "key")
        and _sets(index, "_source_stamp", "_cache_path", "_index_name")
        and _uses(index._load_index, "_source_stamp")
        and _uses(index._save_index, "_source_stamp")
        and _sets(caching.FunctionCache, "_cache_file")
    )


def _caches() -> bool:
    from numba.core import caching

    impl = caching.CompileResultCacheImpl
    return (
        _takes(impl.rebuild, "self", "target_context", "payload")
        and _takes(impl.check_cachable, "self", "cres")
        and _takes(impl.get_filename_base, "self", "fullname", "abiflags")
        and _has(impl, "_locator_classes")
        and _has(caching.FunctionCache, "_impl_class")
        and _has(caching, "_SourceFileBackedLocatorMixin")
        and _has(caching._CacheLocator, "get_suitable_cache_subpath")
    )


def _llvm_option() -> bool:
    from llvmlite import binding

    return callable(binding.set_option) and binding.llvm_version_info[0] in LLVM_TESTED


# what kda uses, each with the check of it
CHECKS: tuple[tuple[str, Callable[[], bool]], ...] = (
    ("the cache's payload of a compile result (CompileResult._rebuild, CR_FIELDS)", _payload),
    ("the code library's final module (JITCodeLibrary)", _library),
    ("the nopython pipeline and its lowering (DefaultPassBuilder, NativeLowering)", _pipeline),
    ("the dispatcher (_compile_for_args, add_overload, compile, get_call_template, _cache)", _dispatcher),
    ("the cache index (IndexDataCacheFile: save, load, _source_stamp)", _index),
    ("the cache classes (CompileResultCacheImpl, FunctionCache, the locators)", _caches),
    (f"LLVM's -disable-lsr option (LLVM {LLVM_TESTED[0]}-{LLVM_TESTED[-1]})", _llvm_option),
)


def problems() -> list[str]:
    """What of :data:`CHECKS` this Numba lacks or has changed (their names; empty where all hold)."""
    found = []
    for name, check in CHECKS:
        try:
            holds = check()
        except Exception:  # a name that is not there, or not a function of the form checked
            holds = False
        if not holds:
            found.append(name)
    return found


PROBLEMS = tuple(problems())
SUPPORTED = not PROBLEMS
if PROBLEMS:
    warnings.warn(
        f"kda: this Numba ({numba.__version__}) lacks or has changed internals that kda compiles its "
        f"CPU kernels with: {'; '.join(PROBLEMS)}. They compile as plain Numba functions instead: the "
        "same results, a slower first call. The Numba versions kda is tested with are the bounds in "
        "its pyproject.toml.",
        RuntimeWarning,
        stacklevel=2,
    )
