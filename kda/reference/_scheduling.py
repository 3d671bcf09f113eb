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
from typing import Any

import array_api_compat

from .._threads import PIN, BlasPin, _no_controlling_thread  # noqa: F401  (tests import it here)

__all__ = ["SLAB_ELEMENTS", "BlasPin", "worker_context", "workers"]

# Elements of one ``[B, H, chunks, Cp, max(K, V)]`` array of a slab of chunks.
SLAB_ELEMENTS = 1 << 18


def workers(*, xp: Any, heads: int) -> int:
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


_PIN = PIN


def worker_context() -> contextlib.AbstractContextManager:
    """One BLAS thread per worker while head groups run concurrently (safe across threads)."""
    return _PIN.hold()
