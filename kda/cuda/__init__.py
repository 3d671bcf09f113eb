"""The Numba-CUDA backend: the primitives of :mod:`kda._backend`, run by CUDA kernels.

The backend-neutral algorithm of :mod:`kda._engine.chunked` drives it unchanged. Arrays are CuPy
arrays on a GPU (kernels run on CuPy's current stream), or NumPy arrays under Numba's CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``). Kernels are compiled on first use, once per dtype
(float32, float64; float16 too for the gate check) and offset width (32-bit wherever every array
of a launch has fewer than 2**32 elements, else 64-bit). Kernels are grouped by family, each
beside its launch wrappers: ``local.py`` (the per-chunk work and its gradient), ``state_pass.py``
(the state recurrence and its gradient), ``recurrent.py`` (the step recurrence), ``_decode.py``
(decoding from a pool) and ``gate.py`` (the device-side gate check), on ``_device.py`` (offsets,
signatures, compilation) and ``_launch.py`` (the launcher). One kernel per primitive, and launches
per call do not depend on the sequence length (``kda.cuda._launch.LAUNCHES`` counts them): a
forward is 2 kernels, a backward 3 (docs/gpu.md). Padded chunks longer than :data:`MAX_CHUNK` do
not fit a block: :func:`kda._backend.resolve` runs those problems on the array-API reference
backend (on CuPy). :func:`launch_gate_check` checks the log decays on the device.
"""

# ruff: noqa: F401  (the imports are the backend interface; kda._backend.complete writes __all__)
from typing import Any

from array_api_compat import is_cupy_array

from .._backend import complete
from ._decode import decode_forward
from .gate import gate_flags, raise_for_gates
from .local import MAX_CHUNK, chunk_local, chunk_local_backward
from .recurrent import recurrent_backward, recurrent_forward
from .state_pass import chunk_state_grad_pass, chunk_state_pass

NAME = "cuda"

# the step recurrence runs one-step calls only (the default of kda._backend.complete: the chunked
# kernels are as fast from T = 2 on; not measured on a GPU yet); no fused passes (the engine
# composes the chunk primitives), one head group (one stream)

# How the chunked algorithm drives this backend: one slab at any realistic size, so kernel
# launches per call do not grow with T.
SLAB_ELEMENTS = 1 << 62


class _GateFlags:
    """:func:`gate_flags` in flight; :meth:`raise_if_bad` reads them (one synchronisation)."""

    def __init__(self, flags: Any) -> None:
        self.flags = flags

    def raise_if_bad(self) -> None:
        raise_for_gates(self.flags)


def launch_gate_check(g: Any) -> "_GateFlags | None":
    """The device-side ``g <= 0`` check for CuPy arrays (None for host arrays: checked there)."""
    return _GateFlags(gate_flags(g)) if is_cupy_array(g) else None


complete(globals(), extras=("gate_flags", "raise_for_gates"))
