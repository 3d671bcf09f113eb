"""Numba-compiled kernels of the CPU backend (imported on first use: this imports numba).

Every kernel takes arrays of one floating dtype (float32 or float64; C-contiguous, except the
inputs of the fused passes, read in place with any strides) and writes its results into output
arrays the caller allocated. Each kernel computes the items ``[lo, hi)`` of its independent
chunks or heads and releases the GIL (``nogil``), so the caller runs ranges on threads of its
own; no sum crosses items, so the results do not depend on how they are split.

The kernels live in modules by phase: how they are compiled and the block sizes per kind of core
(:mod:`._compile`), the matrix products (:mod:`._products`), the pairs of a chunk and their
gradients (:mod:`._pairs`), the solve with ``I + diag(beta) L`` (:mod:`._solve`), the unfused
passes and the step recurrence (:mod:`._passes`) and the fused passes over heads
(:mod:`._fused`). This module gathers the entry points (the backend's primitives import them
from here, on their first call: ``import kda`` imports no Numba), and importing it loads the BLAS
that Numba's ``np.dot`` calls (SciPy's) and has :data:`kda._threads.PIN` pin that BLAS too.
"""

from __future__ import annotations

import scipy.linalg.cython_blas  # noqa: F401  (the BLAS of Numba's np.dot)

from .._threads import PIN
from ._fused import backward_heads, forward_heads
from ._passes import (
    local_backward,
    local_forward,
    recurrent_backward,
    recurrent_forward,
    state_grad_pass,
    state_pass,
)

PIN.rescan()  # pin that BLAS too

__all__ = [
    "backward_heads",
    "forward_heads",
    "local_backward",
    "local_forward",
    "recurrent_backward",
    "recurrent_forward",
    "state_grad_pass",
    "state_pass",
]
