"""Every change kda.vllm makes to vLLM's loaded modules and classes goes through this module.

A patch names what it replaces and the signature it was written against::

    replace(module, "gather_initial_states", ops.gather_initial_states,
            signature="(state, indices, has_initial_state)")
    wrap(CpuPlatform, "check_and_update_config", keep_prefix_caching, signature="(cls, vllm_config)")

- :func:`replace` installs a value; :func:`wrap` installs ``make(original)`` (vLLM's own function).
- The attribute must exist and its parameters (names and kinds: positional-only, ``*args``,
  keyword-only, ``**kwargs``; not defaults nor annotations) must be the ``signature`` given: a
  parameter list as written in a ``def`` line, or a callable whose own signature is the one written
  against; ``None`` for a value that is not a function. Otherwise nothing changes and
  :class:`VllmVersionError` names the module or class, the attribute, the expected and the found
  signature.
- Every patch is recorded (:func:`applied`); the first original is kept, so patching again
  installs the new replacement over the previous one, never over a wrapper of it. Each
  replacement function carries the attribute :data:`MARK`. A module that bound a replacement by
  name (``from m import f`` after ``m.f`` was patched) is patched too when it is patched in turn,
  with vLLM's original recorded.
- :func:`undo_all` restores vLLM's originals (and, in vLLM's modules, names bound from a patched
  module after the patch) and drops the import hooks; :func:`patches` restores, on leaving a
  ``with`` block, what was patched and hooked on entering it (for tests); :func:`all_or_nothing`
  does so only if the block raises.
- :func:`when_imported` runs hooks once a module is imported: several per module, each once.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from .._errors import InvalidInputError, KdaError

__all__ = [
    "MARK", "Patch", "VllmVersionError", "all_or_nothing", "applied", "is_patched", "is_replacement",
    "patches", "recording", "replace", "undo", "undo_all", "when_imported", "wrap",
]  # fmt: skip

#: the attribute every replacement function carries (True)
MARK = "__kda_patch__"

Hook = Callable[[types.ModuleType], None]


class VllmVersionError(KdaError, ImportError):
    """vLLM is missing, or is a version kda.vllm has not been checked against: its version, or a
    function or class kda.vllm replaces, is not what kda.vllm was written against."""


VllmVersionError.__module__ = "kda.vllm"  # its public home (pickled across vLLM's processes)


@dataclass(frozen=True)
class Patch:
    """One replaced attribute: ``owner.name`` was ``original`` and is ``new`` (both as stored on
    the owner: a classmethod object for a classmethod); ``owned``: the owner held ``original`` in
    its own namespace (else it inherited it, or a module's ``__getattr__`` gave it: undoing deletes
    the owner's own attribute)."""

    owner: Any
    name: str
    original: Any
    new: Any
    owned: bool

    @property
    def where(self) -> str:
        """``module.attr`` or ``module.Class.attr``."""
        return f"{_owner_name(self.owner)}.{self.name}"


_lock = threading.RLock()
_registry: dict[tuple[int, str], Patch] = {}  # (id(owner), name) -> its patch, in patching order
_replaced: dict[int, tuple[Any, Any]] = {}  # id(replacement) -> (replacement, the original it replaced)
_hooks: dict[str, list[Hook]] = {}  # module name -> its hooks, in registration order
_recorders: list[list[Patch]] = []


def _owner_name(owner: Any) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return f"<{type(owner).__name__} object>"


def _lookup(owner: Any, name: str) -> tuple[Any, bool] | None:
    """``owner.name`` as stored (a class's through its MRO, not bound) and whether the owner holds
    it itself; None where it has no such attribute."""
    if isinstance(owner, type):
        for base in owner.__mro__:
            if name in vars(base):
                return vars(base)[name], base is owner
        return None
    namespace = getattr(owner, "__dict__", None)
    if isinstance(owner, types.ModuleType) and isinstance(namespace, dict) and name in namespace:
        return namespace[name], True
    try:
        return getattr(owner, name), not isinstance(owner, types.ModuleType)
    except AttributeError:
        return None


def _function(raw: Any) -> Any:
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw


# ----------------------------------------------------------------------------------------------
# signatures: parameter names and kinds


def _render(params: list[tuple[str, inspect._ParameterKind]]) -> str:
    P = inspect.Parameter
    parts: list[str] = []
    star = False
    for i, (name, kind) in enumerate(params):
        if kind is P.VAR_POSITIONAL:
            parts.append(f"*{name}")
            star = True
        elif kind is P.KEYWORD_ONLY and not star:
            parts += ["*", name]
            star = True
        elif kind is P.VAR_KEYWORD:
            parts.append(f"**{name}")
        else:
            parts.append(name)
        following = params[i + 1][1] if i + 1 < len(params) else None
        if kind is P.POSITIONAL_ONLY and following is not P.POSITIONAL_ONLY:
            parts.append("/")
    return f"({', '.join(parts)})"


def _expected(signature: str | Callable[..., Any]) -> str:
    """The parameter names and kinds ``signature`` (a ``def`` line's parameter list, or a callable)
    says, rendered as :func:`_found` renders a function's."""
    if callable(signature):
        return _render([(p.name, p.kind) for p in inspect.signature(signature).parameters.values()])
    try:
        tree = ast.parse(f"def _{signature.strip()}:\n    pass\n")
        args = tree.body[0].args  # type: ignore[attr-defined]
    except (SyntaxError, AttributeError, IndexError) as err:
        msg = f"signature: a def line's parameter list such as '(x, y=None, **kwargs)'; got {signature!r}"
        raise InvalidInputError(msg) from err
    P = inspect.Parameter
    params = [(a.arg, P.POSITIONAL_ONLY) for a in args.posonlyargs]
    params += [(a.arg, P.POSITIONAL_OR_KEYWORD) for a in args.args]
    params += [(args.vararg.arg, P.VAR_POSITIONAL)] if args.vararg else []
    params += [(a.arg, P.KEYWORD_ONLY) for a in args.kwonlyargs]
    params += [(args.kwarg.arg, P.VAR_KEYWORD)] if args.kwarg else []
    return _render(params)


def _found(raw: Any) -> tuple[str | None, str]:
    """The names-and-kinds rendering of ``raw``'s signature (None: not a function, or none to
    read) and a full description for messages."""
    fn = _function(raw)
    if not callable(fn):
        return None, f"{type(fn).__name__} {fn!r:.60} (not a function)"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, f"{type(fn).__name__} {fn!r:.60} (no signature to read)"
    return _render([(p.name, p.kind) for p in sig.parameters.values()]), str(sig)


def _check(owner: Any, name: str, raw: Any, signature: str | Callable[..., Any] | None) -> None:
    names, shown = _found(raw)
    found = shown if names is None else f"{name}{shown}"
    if signature is None:
        if callable(_function(raw)):
            _version_mismatch(owner, name, "a value (not a function)", found)
        return
    expected = _expected(signature)
    if names != expected:
        _version_mismatch(owner, name, f"{name}{expected}", found)


def _version_mismatch(owner: Any, name: str, expected: str, found: str) -> NoReturn:
    msg = (
        f"kda.vllm cannot patch {_owner_name(owner)}.{name}: written against {expected}, found {found}; "
        f"this vLLM differs from the one kda.vllm was checked against (kda.vllm.SUPPORTED_VLLM); set "
        f"KDA_VLLM=0 to run vLLM without kda"
    )
    raise VllmVersionError(msg)


# ----------------------------------------------------------------------------------------------
# patching


def _mark(value: Any) -> None:
    try:
        setattr(_function(value), MARK, True)
    except (AttributeError, TypeError):  # a value that takes no attributes (an int, a builtin)
        pass


def is_replacement(value: Any) -> bool:
    """Whether ``value`` (a function, or a classmethod or staticmethod of one) was installed by
    :func:`replace` or :func:`wrap`."""
    try:
        return getattr(_function(value), MARK, False) is True
    except Exception:  # a value whose attribute access fails (a lazy placeholder)
        return False


def _as_stored(original: Any, new: Any) -> Any:
    """``new`` as the owner stores it: a classmethod (staticmethod) where ``original`` was one."""
    for kind in (classmethod, staticmethod):
        if isinstance(original, kind) and not isinstance(new, (classmethod, staticmethod)):
            return kind(new)
    return new


def _original(owner: Any, name: str, signature: str | Callable[..., Any] | None) -> tuple[Any, bool]:
    """vLLM's ``owner.name`` as stored and whether the owner holds it itself, checked against
    ``signature``: the recorded original where it is patched; where it holds a replacement bound
    from a patched module, the original that replacement stands for."""
    patch = _registry.get((id(owner), name))
    if patch is not None:
        original, owned = patch.original, patch.owned
    else:
        found = _lookup(owner, name)
        if found is None:
            expected = "a value" if signature is None else f"{name}{_expected(signature)}"
            _version_mismatch(owner, name, expected, "no such attribute")
        original, owned = found
        if is_replacement(original) and id(original) in _replaced:
            original = _replaced[id(original)][1]
    _check(owner, name, original, signature)
    return original, owned


def _install(owner: Any, name: str, original: Any, owned: bool, new: Any) -> Patch:
    stored = _as_stored(original, new)
    _mark(stored)
    setattr(owner, name, stored)
    patch = Patch(owner, name, original, stored, owned)
    _registry[(id(owner), name)] = patch
    _replaced[id(stored)] = (stored, original)
    for made in _recorders:
        made.append(patch)
    return patch


def replace(owner: Any, name: str, new: Any, *, signature: str | Callable[..., Any] | None) -> Patch:
    """Replace ``owner.name`` with ``new``, where it is what kda.vllm was written against.

    Parameters
    ----------
    owner : module, class or object
        Where the attribute lives (a class for a method: found through its MRO, set on it).
    name : str
        The attribute.
    new : Any
        The replacement. A plain function replacing a classmethod (staticmethod) is made one.
    signature : str, callable or None
        The parameters written against: ``"(cls, vllm_config)"`` (a ``def`` line's list; defaults
        and annotations ignored), or a callable with the same parameters (the replacement itself,
        where it copies vLLM's signature); None for a value that is not a function.

    Returns
    -------
    Patch
        The record (:func:`applied`).

    Raises
    ------
    VllmVersionError
        ``owner`` has no ``name``, or its parameters are not ``signature``'s; nothing is changed.
    """
    with _lock:
        original, owned = _original(owner, name, signature)
        return _install(owner, name, original, owned, new)


def wrap(
    owner: Any, name: str, make: Callable[[Any], Any], *, signature: str | Callable[..., Any] | None
) -> Patch:
    """Replace ``owner.name`` with ``make(original)``: as :func:`replace`, with the replacement built
    on vLLM's original (for a classmethod or staticmethod, its function; ``make``'s result is made
    one again). Wrapping again wraps the original, not the previous wrapper."""
    with _lock:
        original, owned = _original(owner, name, signature)
        return _install(owner, name, original, owned, make(_function(original)))


def _current(patch: Patch) -> Any:
    found = _lookup(patch.owner, patch.name)
    return None if found is None or not found[1] else found[0]


def is_patched(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` is a replacement :func:`replace` or :func:`wrap` installed (and not
    undone nor overwritten since)."""
    with _lock:
        patch = _registry.get((id(owner), name))
        return patch is not None and _current(patch) is patch.new


def applied() -> list[Patch]:
    """The patches in place, in the order they were first made."""
    with _lock:
        return list(_registry.values())


def _restore(patch: Patch) -> None:
    if patch.owned:
        setattr(patch.owner, patch.name, patch.original)
    elif patch.name in getattr(patch.owner, "__dict__", {}):
        delattr(patch.owner, patch.name)


def _unbind(undone: list[Patch]) -> None:
    """Put back, in the modules of the packages ``undone`` patched, the originals of names that
    were bound from a patched module after the patch (``from m import f``)."""
    back = {id(p.new): p.original for p in undone if is_replacement(p.new)}
    packages = {_owner_name(p.owner).split(".")[0] for p in undone}
    if not back:
        return
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] not in packages:
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if id(value) in back:
                setattr(module, attr, back[id(value)])


def undo(owner: Any, name: str) -> None:
    """Restore vLLM's ``owner.name`` (nothing if it is not patched)."""
    with _lock:
        patch = _registry.pop((id(owner), name), None)
        if patch is not None:
            _restore(patch)
            _unbind([patch])


def undo_all() -> None:
    """Restore every original, latest patch first, and drop every :func:`when_imported` hook."""
    with _lock:
        undone = list(reversed(_registry.values()))
        _registry.clear()
        for patch in undone:
            _restore(patch)
        _unbind(undone)
        _hooks.clear()
        _drop_finder()


@contextlib.contextmanager
def recording() -> Iterator[list[Patch]]:
    """A ``with`` block whose list collects the patches made in it (kept on leaving it)."""
    made: list[Patch] = []
    with _lock:
        _recorders.append(made)
    try:
        yield made
    finally:
        with _lock:
            _recorders.remove(made)


def _snapshot() -> tuple[dict[tuple[int, str], Patch], dict[str, list[Hook]]]:
    with _lock:
        return dict(_registry), {k: list(v) for k, v in _hooks.items()}


def _revert(state: tuple[dict[tuple[int, str], Patch], dict[str, list[Hook]]]) -> None:
    registry, hooks = state
    with _lock:
        undone = [p for key, p in reversed(_registry.items()) if key not in registry]
        for patch in undone:
            del _registry[(id(patch.owner), patch.name)]
            _restore(patch)
        _unbind(undone)
        for key, patch in registry.items():
            if _registry.get(key) is not patch or _current(patch) is not patch.new:
                setattr(patch.owner, patch.name, patch.new)
                _registry[key] = patch
        _hooks.clear()
        _hooks.update(hooks)
        if not _hooks:
            _drop_finder()


@contextlib.contextmanager
def patches() -> Iterator[list[Patch]]:
    """A ``with`` block on leaving which every patch and hook is as on entering it (patches made
    in it undone, those undone in it made again): for tests. Yields the patches made in it."""
    state = _snapshot()
    try:
        with recording() as made:
            yield made
    finally:
        _revert(state)


@contextlib.contextmanager
def all_or_nothing() -> Iterator[None]:
    """A ``with`` block whose patches and hooks are reverted if it raises (a plugin installs whole
    or not at all)."""
    state = _snapshot()
    try:
        yield
    except BaseException:
        _revert(state)
        raise


# ----------------------------------------------------------------------------------------------
# import hooks


def when_imported(module_name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once module ``module_name`` is imported: now if it is, else right after
    its code has run (before any importer sees its names), through a finder at the head of
    ``sys.meta_path`` that wraps the module's loader; nothing else's import changes.

    Several hooks per module run in registration order; a hook already registered for the module
    (equal to one) is not added again nor run again. The hooks run again if the module is imported
    anew (removed from ``sys.modules`` and imported again). :func:`undo_all` drops them.
    """
    with _lock:
        hooks = _hooks.setdefault(module_name, [])
        if hook in hooks:
            return
        hooks.append(hook)
        if not any(isinstance(f, _ImportHooks) for f in sys.meta_path):
            sys.meta_path.insert(0, _ImportHooks())
        module = sys.modules.get(module_name)
    if module is not None:  # outside the lock: the hook may import (another thread may hold its module)
        try:
            hook(module)
        except BaseException:
            with _lock:
                hooks.remove(hook)
            raise


def _drop_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _ImportHooks)]


def _run_hooks(module: types.ModuleType) -> None:
    with _lock:
        hooks = list(_hooks.get(module.__name__, ()))
    for hook in hooks:
        hook(module)


class _ImportHooks:
    """A meta-path finder that finds nothing itself: for a hooked name it asks the other finders
    and wraps the loader of the spec they return (:func:`when_imported`)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not _hooks.get(name):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if isinstance(finder, _ImportHooks) or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader)
        return spec

    def invalidate_caches(self) -> None:
        """Nothing cached."""


class _HookedLoader:
    """``loader``, with the module's hooks run after its code has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _run_hooks(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
