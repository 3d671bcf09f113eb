"""Process-wide thread settings shared by the CPU backends: one reference-counted BLAS pin.

BLAS thread counts are a process-wide setting. Every backend that pins BLAS to one thread while
it runs (the reference's concurrent head groups, the cpu backend's Numba kernels, which call BLAS
from several threads at once) holds the one :data:`PIN` here, so overlapping calls of any
backends, from any threads, leave the setting as they found it: the first holder records the
counts and sets them to 1, the last one to leave restores them.
"""

from __future__ import annotations

import contextlib
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


PIN = BlasPin()
