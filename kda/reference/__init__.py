"""The array-API reference backend: every primitive of :mod:`kda._backend`, written
with ``array_namespace``.

It serves NumPy and any other namespace that follows the array API standard (array-api-strict,
PyTorch on CPU through array-api-compat, CuPy, ...). ``chunk_local`` and ``chunk_local_backward``
are built from finer steps that stay in this backend (:func:`chunk_factors`, :func:`chunk_pairs`,
:func:`unit_lower_inverse`, :func:`chunk_pairs_backward`, :func:`chunk_gate_gradient`).
"""

# ruff: noqa: F401  (the imports are the backend interface; kda._backend.complete writes __all__)
from .._backend import complete
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
# the step recurrence runs one-step calls only (the default; measured: from T = 2 on the chunked
# form is as fast or faster here); kda/cpu measures its own crossover. Any chunk length, no fused
# passes (the engine composes the chunk primitives slab by slab), the gate checked on the host:
# the defaults of kda._backend.complete.

complete(
    globals(),
    extras=(
        "ChunkFactors",
        "chunk_factors",
        "chunk_gate_gradient",
        "chunk_pairs",
        "chunk_pairs_backward",
        "unit_lower_inverse",
    ),
)
