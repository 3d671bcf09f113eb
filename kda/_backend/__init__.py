"""The backend interface and the dispatch to a backend, one module per job:

- :mod:`.protocol`: :class:`Backend` (the primitives the chunked algorithm is written against,
  and the hooks) and the records they return;
- :mod:`.defaults`: what a backend module has unless it defines its own (:data:`DEFAULTS`) and
  :func:`complete`, which every backend module ends with;
- :mod:`.capabilities`: the one table of what each backend runs and when it is chosen, and the
  docs and test lists generated from it;
- :mod:`.cuda_probe`: whether the CUDA backend can run here;
- :mod:`.dispatch`: from the inputs' namespace to a backend module (:func:`get_backend`) and to
  the backend that can hold a chunk length (:func:`resolve`).

A backend is a package beside this one (``kda/reference``, ``kda/cpu``, ``kda/cuda``) that
provides every name of :class:`Backend`: it defines its primitives and ends with
:func:`complete`. The chunked algorithm (:mod:`kda._engine.chunked`), the cores
(:mod:`kda._engine.core`) and the entry points call backends only through these names.
Backends import nothing from each other. No signature has more than ten positional parameters
(the rest are keyword-only); ``tests/interior/test_protocol.py`` checks every backend's functions
against :class:`Backend`'s parameters.

Every reason a backend cannot run here (a missing extra, no driver, no GPU, no NVVM) is raised
as :class:`~kda.InvalidInputError` naming what is missing and what to do, before any kernel is
compiled or launched.
"""

from __future__ import annotations

from .capabilities import (
    BACKENDS,
    CAPABILITIES,
    Capability,
    backend_doc,
    backend_table,
    cpu_available,
    installed_backends,
)
from .cuda_probe import cuda_problem
from .defaults import DEFAULTS, INTERFACE, complete, decode_finite, decode_screen, from_chunks, to_chunks
from .dispatch import get_backend, resolve
from .protocol import (
    Backend,
    ChunkLocal,
    GateFlags,
    Gradients,
    KdaOutput,
    LocalGradients,
    StateGradPass,
    StatePass,
)

__all__ = [
    "BACKENDS",
    "CAPABILITIES",
    "DEFAULTS",
    "INTERFACE",
    "Backend",
    "Capability",
    "ChunkLocal",
    "GateFlags",
    "Gradients",
    "KdaOutput",
    "LocalGradients",
    "StateGradPass",
    "StatePass",
    "backend_doc",
    "backend_table",
    "complete",
    "cpu_available",
    "cuda_problem",
    "decode_finite",
    "decode_screen",
    "from_chunks",
    "get_backend",
    "installed_backends",
    "resolve",
    "to_chunks",
]
