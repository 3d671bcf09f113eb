"""The array-API reference backend: every primitive of :mod:`kda._backend`, written
with ``array_namespace``.

It serves NumPy and any other namespace that follows the array API standard (array-api-strict,
PyTorch on CPU through array-api-compat, CuPy, ...). ``chunk_local`` and ``chunk_local_backward``
are built from finer steps that stay in this backend (:func:`chunk_factors`, :func:`chunk_pairs`,
:func:`unit_lower_inverse`, :func:`chunk_pairs_backward`, :func:`chunk_gate_gradient`).
"""

from typing import Any

from .._backend import ChunkLocal, from_chunks, to_chunks
from ._chunk import (
    ChunkFactors,
    chunk_factors,
    chunk_gate_gradient,
    chunk_local,
    chunk_local_backward,
    chunk_pairs,
    chunk_pairs_backward,
    chunk_state_grad_pass,
    chunk_state_pass,
    unit_lower_inverse,
)
from ._decode import decode_forward
from ._recurrent import recurrent_backward, recurrent_forward
from ._scheduling import SLAB_ELEMENTS, worker_context, workers

NAME = "reference"
# no fused passes: the engine composes the chunk primitives slab by slab (kda/_engine/chunked.py)
chunk_forward_heads = None
chunk_backward_heads = None
MAX_CHUNK = None  # any chunk length

# the step recurrence runs one-step calls only (measured: from T = 2 on the chunked form is as fast or
# faster here); kda/cpu measures its own crossover
RECURRENT_MAX_T = 1


def launch_gate_check(g: Any) -> None:
    """No device-side check: validation checks ``g`` on the host."""
    return None


__all__ = [
    "MAX_CHUNK",
    "NAME",
    "RECURRENT_MAX_T",
    "SLAB_ELEMENTS",
    "ChunkFactors",
    "ChunkLocal",
    "chunk_backward_heads",
    "chunk_factors",
    "chunk_forward_heads",
    "chunk_gate_gradient",
    "chunk_local",
    "chunk_local_backward",
    "chunk_pairs",
    "chunk_pairs_backward",
    "chunk_state_grad_pass",
    "chunk_state_pass",
    "decode_forward",
    "from_chunks",
    "launch_gate_check",
    "recurrent_backward",
    "recurrent_forward",
    "to_chunks",
    "unit_lower_inverse",
    "worker_context",
    "workers",
]
