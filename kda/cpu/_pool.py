"""The one thread pool of the cpu backend, shared by its chunk kernels and its decode kernel.

The kernels are serial Numba functions that release the GIL; a call splits its independent items
(chunks, heads, requests) into ranges and runs them on this pool's threads (and the calling
one). The pool is made on first use with as many threads as the largest call asked for, and
forgotten in a forked child (which has none of the parent's threads).

A call makes one range per usable core (:func:`threads`, which honours ``taskset``). Numba's own
parallel layer is not used: its ``workqueue`` layer aborts on concurrent calls, and
``parallel=True`` kernels took over a minute to compile. So concurrent calls from Python threads
are safe, no Numba setting is read or changed, and since no sum crosses items the results do not
depend on the number of threads, bitwise. BLAS (called from inside the kernels on every thread) is
pinned to one thread for the duration of a call through the process-wide, reference-counted pin
of :mod:`kda._threads` (restored by the last call to leave). Each kernel's outputs are a record of
:mod:`._outputs`, passed positionally.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["pool", "run_ranges", "threads"]

_LOCK = threading.Lock()
_POOL: list[ThreadPoolExecutor] = []  # the pool, once made


def threads() -> int:
    """How many threads a call may split its items over: the cores this process may use (which
    honours ``taskset``)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def pool(n: int) -> ThreadPoolExecutor:
    """The pool, with at least ``n`` threads (made, or made anew larger, on first need)."""
    with _LOCK:
        if not _POOL or _POOL[0]._max_workers < n:
            _POOL[:] = [ThreadPoolExecutor(max_workers=n, thread_name_prefix="kda-cpu")]
        return _POOL[0]


def run_ranges(
    run: Callable[..., Any],
    kernel: Any,
    args: tuple,
    bounds: Sequence[int],
    *,
    threads: int,
    on_caller: bool = False,
) -> None:
    """``run(kernel, *args, lo, hi)`` for every range ``[lo, hi)`` between consecutive ``bounds``,
    on the pool (of at least ``threads`` threads), taken in turn by whichever thread is free;
    ``on_caller``: the first range on the calling thread while the pool runs the others. Returns
    when every range has run (the first exception raised, after all have finished)."""
    ranges = list(itertools.pairwise(bounds))
    if on_caller:
        (lo, hi), ranges = ranges[0], ranges[1:]
    executor = pool(threads)
    futures = [executor.submit(run, kernel, *args, a, b) for a, b in ranges]
    try:
        if on_caller:
            run(kernel, *args, lo, hi)
    finally:
        for f in futures:
            f.result()


def _forget() -> None:
    _POOL.clear()  # a forked child has none of the parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
