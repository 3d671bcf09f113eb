"""What a caller expects after a forward, for a backend that can prepare for it while the forward
runs: :data:`BACKWARD_FOLLOWS`, set by the entry points whose forward feeds a backward
(:func:`kda.chunk_kda` with ``save_boundaries=True``; :func:`kda.torch.chunk_kda` where autograd
records it). The CPU backend then compiles its backward kernel ahead, beside a first forward
(``kda/cpu/_ahead.py``). A hint only: no result depends on it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")

BACKWARD_FOLLOWS: ContextVar[bool] = ContextVar("kda_backward_follows", default=False)


@contextlib.contextmanager
def setting(var: ContextVar[T], value: T) -> Iterator[None]:
    """Within the block, the context variable ``var`` is ``value`` (in this thread and context);
    after it, what it was before (also when the block raises)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def backward_follows(expected: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block, :data:`BACKWARD_FOLLOWS` is ``expected`` (in this thread and context)."""
    return setting(BACKWARD_FOLLOWS, expected)
