"""Exceptions raised for bad input, and the warning for a diverged computation."""

from __future__ import annotations

from typing import NoReturn

__all__ = ["InvalidInputError", "InvalidTypeError", "KdaError", "KdaWarning", "refuse"]


class KdaError(Exception):
    """Base class of every error that ``kda`` raises for bad input."""


class InvalidInputError(KdaError, ValueError):
    """A shape, size or value is not what the function accepts."""


class InvalidTypeError(KdaError, TypeError):
    """An argument has the wrong dtype, array type or Python type."""


class KdaWarning(RuntimeWarning):
    """A computation on finite inputs gave a non-finite result (the delta rule diverged)."""


def refuse(message: str) -> NoReturn:
    """Raise :class:`InvalidInputError` with ``message`` (which names the argument, what it must be
    and what was given): the one line a chain of input checks repeats."""
    raise InvalidInputError(message)
