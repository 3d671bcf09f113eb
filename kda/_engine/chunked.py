"""The backend-neutral chunked KDA forward and backward.

Written once against the primitive interface that :mod:`kda.reference` (and the CUDA
backend) implement, plus plain array-API glue (matrix products, concatenation, masks) on
the namespace ``xp`` of the inputs. It imports no array library.

Per chunk, with ``S`` the state at its start (see ``docs/design.md``)::

    T  = (I + diag(beta) L)^-1
    W  = T diag(beta) kg            U0 = T diag(beta) v             # state-free
    U  = U0 - W S                                                   # state pass
    O  = qg S + A U
    S' = total * S + k_suffix^T U

Everything but the state pass is done for a whole slab of chunks at once (see :func:`slabs`),
so the number of primitive calls does not grow with the number of chunks. Independent heads
may run in concurrent groups when the backend asks for workers (the CPU reference does).

A backend may instead provide fused passes (``chunk_forward_heads`` / ``chunk_backward_heads``,
the CPU backend does: one head per worker from its first chunk to its last, see ``docs/speed.md``);
the forward and backward then call them directly and the slab composition below is not used.

Besides the primitives, a backend module provides ``SLAB_ELEMENTS`` (the size of a slab's
arrays), ``workers(xp, heads)`` (how many head groups to run at once) and
``worker_context()`` (entered around concurrent groups).

Only the core (:mod:`kda._engine.core`) calls these functions: it chooses the chunk length, the
compute dtype and the backend, and routes the sequences that are too short for chunks.

The forward is in :mod:`kda._engine.chunked_forward`, the backward in
:mod:`kda._engine.chunked_backward`, what they share (chunks, slabs, head groups) in
:mod:`kda._engine.chunks`; this module gathers their entry points.
"""

from .chunked_backward import chunk_backward, chunk_state_gradient
from .chunked_forward import chunk_end_state, chunk_forward
from .chunks import padded_chunk_size, slabs

__all__ = [
    "chunk_backward",
    "chunk_end_state",
    "chunk_forward",
    "chunk_state_gradient",
    "padded_chunk_size",
    "slabs",
]
