"""The dispatch from the inputs' array namespace to a backend module (:func:`get_backend`) and to
the backend that can hold a chunk length (:func:`resolve`).

Nothing here imports an array library the caller has not already imported: the CUDA backend
(Numba-CUDA kernels) is imported only for CuPy arrays or when asked for by name, and nothing
outside this module imports a backend module by name.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import array_api_compat

from .._errors import InvalidInputError
from .capabilities import BACKENDS, cpu_available
from .cuda_probe import CUDA_FIX, cuda_problem

__all__ = ["get_backend", "resolve"]


def get_backend(xp: Any, backend: str | None) -> ModuleType:
    """The primitive module for ``backend``; ``None`` chooses from the namespace ``xp``.

    CuPy arrays run on ``"cuda"``; NumPy arrays on the Numba ``"cpu"`` backend where Numba and
    SciPy (the BLAS of Numba's ``np.dot``) are installed; every other namespace (and NumPy
    without them) on the array-API ``"reference"``. Raises :class:`~kda.InvalidInputError` when
    the chosen backend cannot run here.
    """
    if backend is None:
        if array_api_compat.is_cupy_namespace(xp):
            backend = "cuda"
        elif array_api_compat.is_numpy_namespace(xp) and cpu_available():
            backend = "cpu"
        else:
            backend = "reference"
    if backend not in BACKENDS:
        msg = f"backend must be None or one of {sorted(BACKENDS)}; got {backend!r}"
        raise InvalidInputError(msg)
    if backend == "cuda":
        problem = cuda_problem()
        if problem is not None:
            msg = f"backend 'cuda' cannot run here: {problem}. {CUDA_FIX}"
            raise InvalidInputError(msg)
    if backend == "cpu":
        if not cpu_available():
            msg = (
                "backend 'cpu' cannot run here: it needs numba and scipy (`pip install numba scipy`); "
                "backend='reference' runs NumPy arrays without them"
            )
            raise InvalidInputError(msg)
        if not array_api_compat.is_numpy_namespace(xp):
            msg = f"backend 'cpu' computes NumPy arrays; got arrays of {getattr(xp, '__name__', xp)}"
            raise InvalidInputError(msg)
    try:
        return importlib.import_module(BACKENDS[backend])
    except ImportError as err:
        msg = f"backend {backend!r} is not available here: {err}. Install it with `pip install kda[cuda]`."
        raise InvalidInputError(msg) from err


def resolve(ops: ModuleType, padded_chunk: int) -> ModuleType:
    """The backend that runs chunks of ``padded_chunk`` steps: ``ops``, or the reference backend
    (on the same arrays) when they are longer than ``ops.MAX_CHUNK``."""
    limit = ops.MAX_CHUNK
    if limit is None or padded_chunk <= limit:
        return ops
    return importlib.import_module(BACKENDS["reference"])
