"""Where the CPU backend's compiled functions are cached, and the lock files that let processes share
the cache.

Where the cache is written is decided once, here, before any function is decorated
(:data:`CACHE`). First Numba's own cache locators (``NUMBA_CACHE_DIR``, the ``__pycache__`` beside
the sources, the user-wide ``$XDG_CACHE_HOME/numba`` or ``~/.cache/numba``); where none is
writable (a read-only install under a user without a writable home), kda's own per-user
directory in the temporary directory (:func:`fallback_dir`: ``kda-numba-<uid>``, mode ``0700``,
used only where it is this user's and no other user can write it: a cache entry is a pickle).
Only where that fails too (or Numba's internals are not the ones kda uses: :mod:`._internals`)
does every function compile per process, uncached; nothing raises later.

Processes share a cache safely: Numba writes each file whole and renames it into place, and kda
makes each save of an entry (index and data) and each load atomic with a lock file in the cache
directory (:func:`lock_entries`); a signature being compiled holds a lock file of its own
(:func:`compiling_lock`), so that a process needing it waits and loads it instead of compiling it
too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import numba
from numba.core import caching

from . import _internals


def _locator_probe() -> int:  # pragma: no cover - never called: decorated once to ask Numba for a cache
    return 0


def cache_writable() -> bool:
    """Whether Numba's own cache locators (``NUMBA_CACHE_DIR``, the ``__pycache__`` beside the
    sources, the user-wide cache directory) find a directory they can create and write a file in.
    Numba asks them when a function is decorated with ``cache=True`` and raises where none can;
    asked here with a function of this file (every Numba module of :mod:`kda.cpu` sits in this
    directory)."""
    try:
        numba.njit(cache=True)(_locator_probe)
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


def fallback_cache(root: str, impl: type | None = None) -> type | None:
    """Numba's function cache class (with ``impl`` for its cache implementation, default Numba's
    ``CompileResultCacheImpl``), located in ``root`` only (a subdirectory per source directory,
    as Numba's ``NUMBA_CACHE_DIR`` locator lays it out); None where this Numba lacks the classes
    it is made of (no cache then, rather than no backend)."""
    if not _internals.SUPPORTED:
        return None
    mixin, base = caching._SourceFileBackedLocatorMixin, caching._CacheLocator
    impl, cache = impl or caching.CompileResultCacheImpl, caching.FunctionCache

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
    cache = fallback_cache(root) if root else None
    return (root, cache) if cache is not None else (None, None)


# decided once, before any function is decorated: "numba" (Numba's own cache directories), kda's
# fallback directory (FALLBACK_CACHE: its cache class), or None where no cache is writable (every
# function then compiles per process)
CACHE, FALLBACK_CACHE = _choose_cache()
CACHING = CACHE is not None


LOCK_FILE = "kda-cache.lock"


@contextlib.contextmanager
def locked(path: str, exclusive: bool, wait_s: float | None = None) -> Iterator[None]:
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


def lock_entries(index: Any) -> None:
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
        with locked(path, exclusive=True):
            return save(key, data)

    def locked_load(key: Any) -> Any:
        with locked(path, exclusive=False):
            return load(key)

    index.save, index.load = locked_save, locked_load


def stamp_entries(kernel: Any, stamp: str) -> str | None:
    """Stamp the cache entries of the dispatcher ``kernel`` with ``stamp`` (beside Numba's own
    stamp of its source file: an entry written under another stamp is not loaded) and lock their
    saves and loads (:func:`lock_entries`), where it is cached; the path of its cache index (None
    where uncached)."""
    index = getattr(getattr(kernel, "_cache", None), "_cache_file", None)
    if index is None:  # index: Numba's index of the function's cache entries
        return None
    index._source_stamp = (stamp, index._source_stamp)
    lock_entries(index)
    return os.path.join(index._cache_path, index._index_name)


# how long a compilation waits for another process compiling the same function (a kernel takes
# seconds; a process stuck that long is not waited for further: this one compiles too)
COMPILING_WAIT_S = 600.0


def compiling_lock(index_path: str, args: tuple[Any, ...]) -> str:
    """The lock file held while the signature ``args`` of the function whose cache index is
    ``index_path`` compiles: beside the index, named by a hash of the signature."""
    return f"{index_path}.{hashlib.sha256(str(args).encode()).hexdigest()[:16]}.compiling"
