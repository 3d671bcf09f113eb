"""Choose the primitive backend from the inputs' array namespace.

Nothing here imports an array library the caller has not already imported: a GPU backend
is imported only for its own arrays or when asked for by name.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ._errors import InvalidInputError

__all__ = ["BACKENDS", "get_backend"]

BACKENDS = ("reference",)


def get_backend(xp: Any, backend: str | None) -> ModuleType:
    """The primitive module for ``backend``; ``None`` chooses from the namespace ``xp``.

    Every namespace runs on the array-API reference.
    """
    del xp  # every namespace is served by the reference for now
    if backend is None or backend == "reference":
        from . import reference

        return reference
    msg = f"backend must be None or one of {list(BACKENDS)}; got {backend!r}"
    raise InvalidInputError(msg)
