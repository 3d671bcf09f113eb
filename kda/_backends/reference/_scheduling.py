"""How the chunked algorithm runs on the CPU: slab size and concurrent head groups.

Measured on a 2-core machine (B=1, H=16, T=4096, K=V=128, float32): batched products of a
chunk's shapes run faster on one BLAS thread than on two (BLAS threading costs more than it
gives on 64x128 matrices, and with other load on the machine it stalls), while two head groups
on two threads, each with single-threaded BLAS, gave 1.7x over one group. Slabs of 2**18
elements keep a slab's arrays near the caches and the peak memory low.

BLAS thread counts are a process-wide setting, so concurrent calls share one pin
(:class:`BlasPin`): the first call to enter sets BLAS to one thread, the last to leave restores
the value it found. Calls from any number of threads at once therefore leave the setting as
they found it. While a call runs, BLAS is single-threaded for the whole process (also for the
caller's own products in other threads); the results of kda do not depend on it. The pin acts
on the BLAS libraries loaded at the first call (NumPy's); with a BLAS threaded by OpenMP the
limit is per thread, so there the workers are not pinned (slower, the same results).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import array_api_compat

__all__ = ["SLAB_ELEMENTS", "BlasPin", "worker_context", "workers"]

# Elements of one ``[B, H, chunks, Cp, max(K, V)]`` array of a slab of chunks.
SLAB_ELEMENTS = 1 << 18


def workers(xp: Any, heads: int) -> int:
    """Head groups to run at once: one per core for NumPy when BLAS threads can be pinned."""
    if not array_api_compat.is_numpy_namespace(xp) or heads < 2:
        return 1
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        return 1
    return max(
        1,
        min(heads, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1),
    )


class BlasPin:
    """A process-wide, reference-counted pin of BLAS to one thread.

    ``with pin.hold(): ...`` may be entered by any number of threads at once. The first holder
    records the BLAS thread counts and sets them to 1; the last holder to leave restores the
    recorded counts. Holders in between change nothing, so overlapping calls cannot restore a
    value that another call set.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._limiter: Any = None
        self._controller: Any = None

    @property
    def holders(self) -> int:
        """How many holders are inside the pin now."""
        return self._holders

    def _enter(self) -> None:
        with self._lock:
            if self._holders == 0:
                if self._controller is None:  # scanning the loaded libraries costs ~0.5 ms: once
                    import threadpoolctl

                    self._controller = threadpoolctl.ThreadpoolController()
                with _no_controlling_thread():
                    self._limiter = self._controller.limit(limits=1, user_api="blas")
            self._holders += 1

    def _exit(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                limiter, self._limiter = self._limiter, None
                with _no_controlling_thread():
                    limiter.restore_original_limits()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """BLAS on one thread inside the block; the original counts back after the last holder."""
        self._enter()
        try:
            yield
        finally:
            self._exit()


@contextlib.contextmanager
def _no_controlling_thread() -> Iterator[None]:
    """Let this thread change OpenBLAS's process-wide pool, and leave no thread in control.

    threadpoolctl >= 3.8 lets only one "controlling" thread change the pool of an OpenBLAS built
    on pthreads and silently ignores the others, while the pin is set by one thread and restored
    by another. Every change of the pin is made under its lock, so this is safe among kda calls.
    """
    import threadpoolctl

    clear = getattr(getattr(threadpoolctl, "OpenBLASController", None), "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)
    try:
        yield
    finally:
        if clear is not None:
            clear(force=True)


_PIN = BlasPin()


def worker_context() -> contextlib.AbstractContextManager:
    """One BLAS thread per worker while head groups run concurrently (safe across threads)."""
    return _PIN.hold()
