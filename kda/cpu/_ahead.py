"""Compiling a kernel ahead, in a second process, beside the one this process is compiling.

A first forward whose caller says a backward follows (:data:`kda._backend.expect.BACKWARD_FOLLOWS`:
``kda.chunk_kda(..., save_boundaries=True)``, the README's call, and ``kda.torch.chunk_kda`` under
autograd; no inference call) is followed by its backward. Cold, each takes its own ~6 s of compiling on
one core; Numba compiles one function at a time per process (its compiler lock, and one LLVM
context). So when such a forward is about to compile, :func:`compile_beside` starts ``python -m
kda.cpu._ahead`` on the backward kernel's expected signature: it compiles on another core into
the shared cache while this process compiles the forward, and this process's backward then loads
it from the cache (:func:`_wait_first`: the dispatcher's ``compile`` waits for the second process
before it looks in the cache). The second process first compiles the helpers that only the
backward calls (``first``: :func:`kda.cpu._fused.backward_own_helpers`), while this one compiles the
forward's, so that the helpers both kernels call are mostly in the cache by the time it types the
backward kernel (each signature compiles in one process; the other waits for it and loads it); it
ends without the interpreter's teardown.

Only where it helps and can work: where this process may run on at least two cores
(:func:`usable_cores`: on one, the two processes would take turns on it, and the first call would
wait longer than for one process compiling both kernels), where a cache is writable
(:data:`kda.cpu._compile.CACHING`) and Numba's internals are the ones kda uses
(:data:`kda.cpu._internals.SUPPORTED`: the lock files the processes share the cache by), where this
process is a plain Python interpreter, once per process and signature, and not with
``KDA_COMPILE_AHEAD=0``. A second process that fails, or is wrong about the signature, costs only
its time: this process then compiles as it would have. It is stopped if this process exits first
(its cache entries are written whole or not at all). The first compilation's notice on the
``kda.cpu`` logger says that it runs (:func:`running`); ``python -m kda warmup`` remains the way to
compile everything ahead of time.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import importlib
import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from numba.core.dispatcher import Dispatcher

from .._backend.expect import setting
from . import _compile, _internals

ENV = "KDA_COMPILE_AHEAD"
LOG = logging.getLogger("kda.cpu")
# how long a compile waits for the second process before compiling itself (a cold kernel takes
# about 6 s on a quiet core; a loaded machine many times that)
WAIT_S = 600.0

# the block sizes the kernels read when they compile (kda/cpu/_compile.py): the second process
# compiles with this one's (a test that sets them for the other kind of core gets its own)
CONSTANTS = ("GEMM_BLOCK", "SUB_BLOCK", "SOLVE_BLOCK", "SUBSTITUTE_BELOW")

_LOCK = threading.Lock()
_ASKED: set[tuple[int, tuple[Any, ...]]] = set()  # (dispatcher's id, signature) asked for once
_RUNNING: dict[int, list[subprocess.Popen]] = {}  # per dispatcher's id: its second processes


# set within :func:`off` (``python -m kda warmup``, which compiles everything itself)
_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("kda_compile_ahead_off", default=False)


def off() -> contextlib.AbstractContextManager[None]:
    """No kernel compiled ahead in a second process within the block (in this context)."""
    return setting(_OFF, True)


def usable_cores() -> int:
    """The number of cores this process may run on (its affinity, where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def enabled() -> bool:
    """Whether a kernel may be compiled ahead in a second process: at least two usable cores (the
    processes compile side by side), a writable cache (the only way the processes share their work)
    and the Numba internals kda shares it by, a Python interpreter to start, ``KDA_COMPILE_AHEAD``
    not ``0`` and not within :func:`off`."""
    if _OFF.get() or os.environ.get(ENV, "1").strip() == "0" or not _compile.CACHING:
        return False
    if not _internals.SUPPORTED or usable_cores() < 2:
        return False
    name = os.path.basename(sys.executable or "").lower()
    return name.startswith(("python", "pypy"))


def _cached(kernel: Any, sig: tuple[Any, ...]) -> bool:
    """Whether ``kernel`` has ``sig`` compiled in this process or in its cache's index (Numba's
    private cache classes; where they differ from what this expects: assumed cached)."""
    if sig in kernel.overloads:
        return True
    try:
        cache = kernel._cache
        key = cache._index_key(sig, kernel.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:  # another Numba's internals: do nothing ahead
        return True


Signature = tuple[Any, ...]  # a function's argument types (Numba types)


def _named(kernel: Any, sig: Signature) -> tuple[str, str, Signature]:
    """The dispatcher ``kernel`` by its module and qualified name, with ``sig``: what the second
    process imports and compiles."""
    return (kernel.py_func.__module__, kernel.py_func.__qualname__, sig)


def compile_beside(kernel: Any, sig: Signature, first: Sequence[tuple[Any, Signature]] = ()) -> bool:
    """Start compiling the dispatcher ``kernel`` (a function of a :mod:`kda.cpu` module) for the
    argument types ``sig`` in a second process, unless it is compiled or cached already, was asked
    for before, or :func:`enabled` says no. True where one was started. ``first``: ``(dispatcher,
    argument types)`` of helpers the kernel calls, compiled first, in that order: those that the
    kernels this process is compiling meanwhile do not call, so that the two processes compile
    different functions at once (the helpers they share compile in whichever reaches them first,
    the other waits: :func:`kda.cpu._compile._compile_guarded`)."""
    key = (id(kernel), sig)
    with _LOCK:
        if key in _ASKED:
            return False
        _ASKED.add(key)
    if not enabled() or _cached(kernel, sig):
        return False
    constants = {name: getattr(_compile, name) for name in CONSTANTS}
    payload = pickle.dumps(([*(_named(*f) for f in first), _named(kernel, sig)], constants))
    env = {**os.environ, ENV: "0", "PYTHONPATH": _path()}
    process = None
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "kda.cpu._ahead"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        process.stdin.write(payload)
        process.stdin.close()
    except OSError as e:  # could not start, or it ended before reading what to compile
        if process is not None:
            process.kill()
            process.wait()
        LOG.info("kda.cpu: could not compile %s ahead in a second process (%s)", kernel.py_func.__name__, e)
        return False
    process.kda_owner = os.getpid()  # a forked child of this process does not wait for it or stop it
    process.kda_kernel = kernel.py_func.__name__
    with _LOCK:
        first = id(kernel) not in _RUNNING
        _RUNNING.setdefault(id(kernel), []).append(process)
    if first:
        _wait_first(kernel)
    LOG.info(
        "kda.cpu: compiling %s in a second process beside this one (%s=0: not)", kernel.py_func.__name__, ENV
    )
    return True


def running() -> list[str]:
    """The names of the kernels that second processes of this one are compiling now."""
    with _LOCK:
        return sorted({p.kda_kernel for ps in _RUNNING.values() for p in ps if p.poll() is None})


def _path() -> str:
    """The second process's ``PYTHONPATH``: this one's, after the directory this ``kda`` was
    imported from where that is not a site directory (a source tree, a path a script added), so
    that it imports the same ``kda``; site directories are left where Python puts them (after the
    standard library)."""
    import site

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sites = {os.path.abspath(p) for p in (*site.getsitepackages(), site.getusersitepackages())}
    first = [] if here in sites else [here]
    return os.pathsep.join([*first, *filter(None, [os.environ.get("PYTHONPATH")])])


def _wait_first(kernel: Any) -> None:
    """Make the dispatcher ``kernel``'s compilations wait for its second processes first (their
    results are then in the cache, where Numba's ``compile`` looks before it compiles)."""
    compile_here = kernel.compile

    def compile(sig: Any) -> Any:
        wait(kernel)
        return compile_here(sig)

    kernel.compile = compile


def wait(kernel: Any) -> None:
    """Wait for the second processes compiling ``kernel`` (at most :data:`WAIT_S` each, then stop
    it: this process compiles instead)."""
    with _LOCK:
        running = list(_RUNNING.get(id(kernel), ()))
    for process in running:  # every thread that calls the kernel waits (the pool's run it at once)
        if process.kda_owner != os.getpid():
            continue
        try:
            rc = process.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            rc = process.wait()
        with _LOCK:
            if process in _RUNNING.get(id(kernel), ()):
                _RUNNING[id(kernel)].remove(process)
                if rc != 0:
                    name = kernel.py_func.__name__
                    LOG.info("kda.cpu: the second process compiling %s ended with %s", name, rc)


@atexit.register
def _stop() -> None:
    """Stop the second processes still running when this process exits."""
    with _LOCK:
        running = [p for ps in _RUNNING.values() for p in ps]
        _RUNNING.clear()
    for process in running:
        if process.kda_owner == os.getpid() and process.poll() is None:
            process.terminate()
            process.wait()


def main() -> int:
    """The second process: compile the functions named on standard input, in order, into the cache
    (a pickle of a list of their modules, qualified names and argument types, then the first
    process's :data:`CONSTANTS`)."""
    functions, constants = pickle.loads(sys.stdin.buffer.read())  # from the first process, a pipe
    if set(constants) != set(CONSTANTS):
        return 2
    for constant, value in constants.items():
        setattr(_compile, constant, value)
    importlib.import_module("kda.cpu._kernels")  # as the first kernel call does (the BLAS, pinned)
    for module, name, sig in functions:
        kernel = importlib.import_module(module)
        for part in name.split("."):
            kernel = getattr(kernel, part)
        if not isinstance(kernel, Dispatcher):
            return 2
        kernel.compile(sig)
    return 0


if __name__ == "__main__":
    code = main()
    # what it compiled is in the cache: end without the interpreter's teardown (with Numba and
    # LLVM loaded, about 0.4 s that the first process would wait for)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
