"""Process-wide thread settings shared by the CPU backends: one reference-counted BLAS pin.

BLAS thread counts are a process-wide setting. Every backend that pins BLAS to one thread while
it runs (the reference's concurrent head groups, the cpu backend's Numba kernels, which call BLAS
from several threads at once) holds the one :data:`PIN` here, so overlapping calls of any
backends, from any threads, leave the setting as they found it: the first holder records the
counts and sets them to 1, the last one to leave restores them.

Intel MKL (threaded by OpenMP) is the exception: its thread count is a setting of each thread
(a count set in one thread is not seen in another), so a process-wide pin set by one thread and
restored by another would leave threads changed. MKL is pinned per thread instead:
:meth:`BlasPin.this_thread` sets the calling thread's MKL to one thread
(``mkl_set_num_threads_local``) and puts the thread's own setting back when it leaves; every
holder of the pin does that on its own thread, and the cpu backend does it on each of its
workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["PIN", "BlasPin"]


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
        self._mkl: list[Any] = []  # MKL's mkl_set_num_threads_local, per loaded MKL library

    def rescan(self) -> None:
        """Scan the loaded BLAS libraries again at the next pin (after a backend loaded another
        BLAS, e.g. SciPy's, which Numba's ``np.dot`` calls)."""
        with self._lock:
            if self._holders == 0:
                self._controller = None

    @property
    def holders(self) -> int:
        """How many holders are inside the pin now."""
        return self._holders

    def _enter(self) -> None:
        with self._lock:
            if self._holders == 0:
                if self._controller is None:  # scanning the loaded libraries costs ~0.5 ms: once
                    self._scan()
                with _no_controlling_thread():
                    self._limiter = self._controller.limit(limits=1)
            self._holders += 1

    def _scan(self) -> None:
        """The loaded BLAS libraries: MKL's per-thread setters apart, the others in one controller."""
        import threadpoolctl

        blas = threadpoolctl.ThreadpoolController().select(user_api="blas")
        mkl = [c for c in blas.lib_controllers if c.internal_api == "mkl"]
        self._mkl = [_local_setter(c) for c in mkl]
        others = sorted({c.internal_api for c in blas.lib_controllers} - {"mkl"})
        self._controller = blas.select(internal_api=others)

    def _exit(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                limiter, self._limiter = self._limiter, None
                with _no_controlling_thread():
                    limiter.restore_original_limits()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """BLAS on one thread inside the block; the original counts back after the last holder
        (MKL's on this thread: :meth:`this_thread`)."""
        self._enter()
        try:
            with self.this_thread():
                yield
        finally:
            self._exit()

    @contextlib.contextmanager
    def this_thread(self) -> Iterator[None]:
        """MKL on one thread for calls from this thread inside the block, this thread's own
        setting back after it (nothing where no MKL was loaded at the pin's last scan)."""
        setters = self._mkl
        old = [setter(1) for setter in setters]
        try:
            yield
        finally:
            for setter, value in zip(setters, old, strict=True):
                setter(value)


def _local_setter(controller: Any) -> Any:
    """``mkl_set_num_threads_local`` of an MKL library (threadpoolctl's controller of it): sets
    this thread's count (0: back to the process's) and returns the thread's previous one."""
    lib = getattr(controller, "dynlib", None) or ctypes.CDLL(controller.filepath)
    setter = lib.MKL_Set_Num_Threads_Local
    setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
    return setter


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


PIN = BlasPin()
