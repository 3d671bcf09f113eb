"""The array-API reference backend: every primitive, written with ``array_namespace``.

It serves NumPy and any other namespace that follows the array API standard
(array-api-strict, PyTorch on CPU through array-api-compat, ...).
"""

from ._chunk import (
    ChunkFactors,
    ChunkLocal,
    chunk_factors,
    chunk_gate_gradient,
    chunk_local,
    chunk_local_backward,
    chunk_pairs,
    chunk_pairs_backward,
    chunk_state_grad_pass,
    chunk_state_pass,
    from_chunks,
    to_chunks,
    unit_lower_inverse,
)
from ._decode import decode_forward
from ._recurrent import recurrent_backward, recurrent_forward
from ._scheduling import SLAB_ELEMENTS, worker_context, workers

NAME = "reference"

__all__ = [
    "NAME",
    "SLAB_ELEMENTS",
    "ChunkFactors",
    "ChunkLocal",
    "chunk_factors",
    "chunk_gate_gradient",
    "chunk_local",
    "chunk_local_backward",
    "chunk_pairs",
    "chunk_pairs_backward",
    "chunk_state_grad_pass",
    "chunk_state_pass",
    "decode_forward",
    "from_chunks",
    "recurrent_backward",
    "recurrent_forward",
    "to_chunks",
    "unit_lower_inverse",
    "worker_context",
    "workers",
]
