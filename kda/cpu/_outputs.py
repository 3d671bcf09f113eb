"""What each chunk kernel of the cpu backend writes: one record per kernel, its fields the kernel's
output parameters in their order (between its inputs and its range ``lo, hi``).

The primitives build these records by keyword and :func:`kda.cpu._run` passes them on
positionally (a Numba dispatcher binds keyword arguments in Python on every call), so the order
is bound once, here, and never reflected on per call. ``tests/backends/test_cpu.py`` checks every
record against its kernel's parameters (:data:`KERNEL_OUTPUTS`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "KERNEL_OUTPUTS",
    "BackwardHeadsOut",
    "ForwardHeadsOut",
    "LocalBackwardOut",
    "LocalForwardOut",
    "RecurrentBackwardOut",
    "RecurrentForwardOut",
    "StateGradPassOut",
    "StatePassOut",
]


class LocalForwardOut(NamedTuple):
    """``local_forward``: every chunk's state-free work."""

    qg: Any
    kg: Any
    k_suffix: Any
    total: Any
    A: Any
    L: Any
    Minv: Any
    w: Any
    u0: Any


class StatePassOut(NamedTuple):
    """``state_pass``: the chunk-start states, the output and the final state."""

    boundaries: Any
    out: Any
    final: Any


class StateGradPassOut(NamedTuple):
    """``state_grad_pass``: the end-state gradients, ``U``, ``dU`` and the start state's gradient."""

    ends: Any
    u: Any
    du: Any
    dinit: Any


class LocalBackwardOut(NamedTuple):
    """``local_backward``: the chunked step arrays' gradients."""

    dq: Any
    dk: Any
    dv: Any
    dg: Any
    dbeta: Any


class ForwardHeadsOut(NamedTuple):
    """``forward_heads``: the output, the boundaries, the final state and the screen."""

    out: Any
    boundaries: Any
    final: Any
    screen: Any


class BackwardHeadsOut(NamedTuple):
    """``backward_heads``: the six gradients and the screen."""

    dq: Any
    dk: Any
    dv: Any
    dg: Any
    dbeta: Any
    dinit: Any
    screen: Any


class RecurrentForwardOut(NamedTuple):
    """``recurrent_forward``: the output and the final state."""

    out: Any
    final: Any


class RecurrentBackwardOut(NamedTuple):
    """``recurrent_backward``: the six gradients."""

    dq: Any
    dk: Any
    dv: Any
    dg: Any
    dbeta: Any
    dinit: Any


# kernel name (in kda.cpu._kernels) -> the record of its outputs
KERNEL_OUTPUTS: dict[str, type] = {
    "local_forward": LocalForwardOut,
    "state_pass": StatePassOut,
    "state_grad_pass": StateGradPassOut,
    "local_backward": LocalBackwardOut,
    "forward_heads": ForwardHeadsOut,
    "backward_heads": BackwardHeadsOut,
    "recurrent_forward": RecurrentForwardOut,
    "recurrent_backward": RecurrentBackwardOut,
}
