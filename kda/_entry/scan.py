"""The affine state map of a segment and its adjoint, composed over segments (written once).

The state after a segment of steps is affine in the state before it, and the gradient of the
state before it is affine in the gradient of the state after it (:func:`kda.chunk_kda_transition`,
:func:`kda.chunk_kda_transition_backward`)::

    S_end = A S_start + N            dS_start = A^T dS_end + D

with ``A [..., K, K]`` and ``N, D, S [..., K, V]``. Dask's time shards (:mod:`kda.dask`), context
parallelism's ranks (:mod:`kda._entry.cp`) and the gradients through the chunk-start states
(:mod:`kda._entry.states`) compose these maps over their segments with :func:`advance` (first to
last) and :func:`retreat` (last to first). None stands for a zero state (gradient), so a
segment from a zero start costs no product.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

__all__ = ["advance", "retreat"]


def advance(A: Any, N: Any, start: Any) -> Any:
    """``S_end = A S_start + N``; ``start`` None: zeros (``N``)."""
    if start is None:
        return N
    return array_api_compat.array_namespace(A).matmul(A, start) + N


def retreat(A: Any, D: Any, dend: Any) -> Any:
    """``dS_start = A^T dS_end + D``; ``dend`` (``dS_end``) None: zeros (``D``)."""
    if dend is None:
        return D
    xp = array_api_compat.array_namespace(A)
    return xp.matmul(xp.matrix_transpose(A), dend) + D
