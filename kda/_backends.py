"""Choose the primitive backend from the inputs' array namespace.

Nothing here imports an array library the caller has not already imported: the CUDA
backend (Numba-CUDA kernels) is imported only for CuPy arrays or when asked for by name.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import array_api_compat

from ._errors import InvalidInputError

__all__ = ["BACKENDS", "get_backend"]

# name -> module implementing the primitive interface of ``kda.reference``
BACKENDS = {"reference": "kda.reference", "cuda": "kda.cuda"}


def get_backend(xp: Any, backend: str | None) -> ModuleType:
    """The primitive module for ``backend``; ``None`` chooses from the namespace ``xp``.

    CuPy arrays run on ``"cuda"``; every other namespace on the array-API ``"reference"``.
    """
    if backend is None:
        backend = "cuda" if array_api_compat.is_cupy_namespace(xp) else "reference"
    if backend not in BACKENDS:
        msg = f"backend must be None or one of {sorted(BACKENDS)}; got {backend!r}"
        raise InvalidInputError(msg)
    try:
        return importlib.import_module(BACKENDS[backend])
    except ImportError as err:
        msg = f"backend {backend!r} is not available here: {err}. Install it with `pip install kda[cuda]`."
        raise InvalidInputError(msg) from err
