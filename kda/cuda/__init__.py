"""The Numba-CUDA backend: the primitive interface of :mod:`kda.reference`, run by CUDA kernels.

The backend-neutral algorithm of :mod:`kda._chunked` drives it unchanged. Arrays are CuPy
arrays on a GPU (kernels run on CuPy's current stream), or NumPy arrays under Numba's CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``). Kernels are compiled on first use, once per dtype
(float32, float64) and offset width (32-bit wherever every array of a launch has fewer than
2**32 elements, else 64-bit). Launches per call do not depend on the sequence length: one kernel per
primitive (``kda.cuda._launch.LAUNCHES`` counts them), and the fused primitives
(:func:`chunk_local`, :func:`chunk_state_pass`, :func:`chunk_state_grad_pass`,
:func:`chunk_local_backward`) leave no array product to the caller: a forward is 2 kernels, a
backward 3 (docs/gpu.md). :func:`gate_flags` checks the log decays on the device.
"""

import contextlib

from ..reference._chunk import ChunkFactors, ChunkLocal
from ._decode import decode_forward
from ._launch import (
    chunk_factors,
    chunk_gate_gradient,
    chunk_local,
    chunk_local_backward,
    chunk_pairs,
    chunk_pairs_backward,
    chunk_state_grad_pass,
    chunk_state_pass,
    from_chunks,
    recurrent_backward,
    recurrent_forward,
    to_chunks,
    unit_lower_inverse,
)
from ._launch import gate_flags as gate_flags  # not a primitive: the device-side gate check
from ._launch import raise_for_gates as raise_for_gates

NAME = "cuda"

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

# How the chunked algorithm drives this backend: one slab at any realistic size, so kernel
# launches per call do not grow with T, and no concurrent head groups (one stream).
SLAB_ELEMENTS = 1 << 62


def workers(xp: object, heads: int) -> int:
    """Head groups to run at once: always one on the GPU."""
    return 1


def worker_context() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()
