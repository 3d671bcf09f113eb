"""Backends: the dispatch from the inputs' array namespace to a backend module.

Each backend is a folder beside this file implementing :mod:`kda._backends.interface`; adding one
is that folder plus its line in :data:`BACKENDS` (and, to be chosen by default, in
:func:`get_backend`).

Nothing here imports an array library the caller has not already imported: the CUDA
backend (Numba-CUDA kernels) is imported only for CuPy arrays or when asked for by name.
Every reason a backend cannot run here (a missing extra, no driver, no GPU, no NVVM) is raised
as :class:`~kda.InvalidInputError` naming what is missing and what to do, before any kernel is
compiled or launched: no exception of numba or CuPy escapes for such a cause.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import array_api_compat

from .._errors import InvalidInputError

__all__ = ["BACKENDS", "cpu_available", "cuda_problem", "get_backend", "resolve"]

# name -> module implementing the primitive interface of ``kda._backends.reference``
BACKENDS = {
    "reference": "kda._backends.reference",
    "cpu": "kda._backends.cpu",
    "cuda": "kda._backends.cuda",
}

_CUDA_FIX = (
    "Use backend='reference' (NumPy or any array-API arrays on the CPU), or run on a machine with an "
    "NVIDIA GPU and driver; NUMBA_ENABLE_CUDASIM=1 runs the kernels on Numba's CPU simulator (slow)."
)


@functools.lru_cache(maxsize=1)
def cuda_problem() -> str | None:
    """Why the CUDA backend cannot run in this process, or None when it can (checked once).

    Covers numba-cuda not installed, no driver library, a driver that fails to start, no GPU,
    and no libNVVM (the compiler of the kernels). Under Numba's simulator only the import counts.
    """
    try:
        from numba import cuda
    except ImportError as err:
        return f"numba-cuda is not installed ({err}); install it with `pip install kda[cuda]`"
    if cuda.is_available():
        return None if _simulated() else _nvvm_problem()
    reason = cuda.cuda_error()
    detail = " ".join(str(reason).split()).rstrip(".") if reason is not None else "no CUDA GPU was found"
    return f"no usable CUDA GPU: {detail}"


def _simulated() -> bool:
    from numba import config

    return bool(getattr(config, "ENABLE_CUDASIM", False))


def _nvvm_problem() -> str | None:
    try:
        from numba.cuda.cudadrv.nvvm import NVVM

        NVVM()
    except Exception as err:  # numba's NvvmSupportError and whatever loading the library raises
        detail = " ".join(str(err).split()).rstrip(".")
        return (
            f"the CUDA compiler library libNVVM cannot be loaded ({detail}); install the CUDA toolkit's "
            "NVVM, e.g. `pip install nvidia-cuda-nvcc-cu12`"
        )
    return None


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
            msg = f"backend 'cuda' cannot run here: {problem}. {_CUDA_FIX}"
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


@functools.lru_cache(maxsize=1)
def cpu_available() -> bool:
    """Whether the Numba CPU backend can run here: numba and scipy are installed (not imported)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("numba", "scipy"))


def resolve(ops: ModuleType, padded_chunk: int) -> ModuleType:
    """The backend that runs chunks of ``padded_chunk`` steps: ``ops``, or the reference backend
    (on the same arrays) when they are longer than ``ops.MAX_CHUNK``."""
    limit = ops.MAX_CHUNK
    if limit is None or padded_chunk <= limit:
        return ops
    return importlib.import_module(BACKENDS["reference"])
