"""The core: the one way into the chunked algorithm, and the loop over groups of packed sequences.

Every entry point (plain calls, plans, transition maps, Dask blocks, the adapters) reaches the
chunked algorithm of :mod:`kda._engine.chunked` through :class:`ChunkCore`, which owns the
compute dtype (widening), the chunk clamp, the short-sequence routing, the memory check, the
choice of a backend that can hold the chunks, and caller-owned output buffers. So a plan, which is
this core with bound inputs and buffers, gives bitwise the results of the plain call.

A core computes KDA on ready inputs ``q, k, g: [B, HV, T, K]``, ``v: [B, HV, T, V]``,
``beta: [B, HV, T]`` (``B`` rows that are independent sequences):

- :class:`ChunkCore`: the chunked algorithm of :mod:`kda._engine.chunked`. A chunk is clamped to the
  sequence (``T < chunk_size`` computes one ``T``-step chunk: the same boundaries, ``NT = 1``),
  and a sequence up to the backend's measured crossover (its ``RECURRENT_MAX_T`` hooks) runs the
  step recurrence.
  float32 problems with few key channels and long chunks compute in float64
  (:func:`kda._engine.widening.chunk_compute_dtype`: their WY chunk maps lose float32 accuracy).
- :class:`RecurrentCore`: the step recurrence, the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import array_api_compat

from .._backend import resolve
from .._errors import InvalidInputError
from .._options.maps import CoreInputs
from . import varlen as _varlen
from .chunked import chunk_backward, chunk_end_state, chunk_forward, chunk_state_gradient, padded_chunk_size
from .widening import chunk_compute_dtype

__all__ = [
    "ChunkCore",
    "Core",
    "RecurrentCore",
    "run_packed_backward",
    "run_packed_forward",
]


# The pair matrices of one chunk for all heads, ``B * HV * Cp * Cp`` elements, are refused above
# this many bytes: a chunk that large cannot be worth computing as one block.
PAIR_BYTES_LIMIT = 1 << 31


class Core(Protocol):
    chunk_size: int

    def screens(self, q) -> bool: ...

    def forward(
        self, q, k, v, g, beta, state, keep: bool = True, *, out=None, screen=None
    ) -> tuple[Any, Any, Any]: ...

    def backward(
        self, q, k, v, g, beta, state, boundaries, do, dfinal, *, out=None, workspace=None, screen=None
    ) -> tuple[Any, ...]: ...


@dataclass(frozen=True)
class RecurrentCore:
    """The step recurrence of a backend."""

    ops: Any
    scale: float
    chunk_size: int = 1  # packed sequences are grouped by exact length

    def screens(self, q) -> bool:
        return False

    def forward(
        self, q, k, v, g, beta, state, keep: bool = True, *, out=None, screen=None
    ) -> tuple[Any, Any, Any]:
        o, final = self.ops.recurrent_forward(q, k, v, g, beta, self.scale, state)
        return _into(out, (o, final, None))

    def backward(
        self, q, k, v, g, beta, state, boundaries, do, dfinal, *, out=None, workspace=None, screen=None
    ) -> tuple[Any, ...]:
        return _into(out, self.ops.recurrent_backward(q, k, v, g, beta, self.scale, state, do, dfinal))


def _check_pair_memory(rows: int, C: int, T: int, itemsize: int) -> None:
    Cp = padded_chunk_size(C)
    if rows * Cp * Cp * itemsize <= PAIR_BYTES_LIMIT:
        return
    fits = 1 << ((PAIR_BYTES_LIMIT // max(rows * itemsize, 1)).bit_length() - 1) // 2
    msg = (
        f"chunk_size={C} (for T={T}) needs pair matrices of {rows} x {Cp} x {Cp} elements "
        f"({rows * Cp * Cp * itemsize / 2**30:.1f} GiB) per chunk; at most chunk_size={fits} fits "
        f"the {PAIR_BYTES_LIMIT / 2**30:.0f} GiB limit for these {rows} heads"
    )
    raise InvalidInputError(msg)


@dataclass(frozen=True)
class ChunkCore:
    """The one way into the chunked algorithm (see the module notes).

    Every method takes the core's inputs (head-first, compute dtype, options applied) and
    decides, from their sizes, the chunk length (clamped to the sequence), the route (the step
    recurrence up to the backend's crossover, ``ops.RECURRENT_MAX_T`` steps in one chunk), the
    pair-memory limit, the backend that can hold such chunks (:func:`kda._backend.resolve`) and the
    dtype to compute in (:func:`~kda._engine.widening.chunk_compute_dtype`). Results come back in
    the inputs' dtype; ``out`` buffers (compute dtype) receive them in place.
    """

    ops: Any
    scale: float
    chunk_size: int

    def route(self, q) -> tuple[Any, int, Any] | None:
        """``(backend, chunk length, dtype to compute in)``, or None for the step recurrence.

        The step recurrence runs where the backend measured it faster, up to
        ``ops.RECURRENT_MAX_T`` steps in one chunk (the one boundary is then the initial state),
        whatever the call keeps: an output's bits do not depend on ``save_boundaries``.
        """
        B, HV, T = q.shape[:3]
        C = min(self.chunk_size, max(T, 1))
        if 0 < T <= min(self.ops.RECURRENT_MAX_T, self.chunk_size):
            return None
        _check_pair_memory(B * HV, C, T, 8)
        xp = _namespace(q)
        return resolve(self.ops, padded_chunk_size(C)), C, chunk_compute_dtype(xp, q.shape[-1], C, q.dtype)

    def screens(self, q) -> bool:
        """Whether :meth:`forward` and :meth:`backward` (without ``out``) read the finiteness of
        their inputs and results off the chunks as they pass: the backend's fused passes, in
        ``q``'s dtype."""
        route = self.route(q) if q.shape[2] else None
        if route is None or route[2] != q.dtype:
            return False
        return route[0].chunk_forward_heads is not None and route[0].chunk_backward_heads is not None

    def forward(
        self, q, k, v, g, beta, state, keep: bool = True, *, out=None, screen=None
    ) -> tuple[Any, Any, Any]:
        """``(output, final_state, boundaries)``; ``keep=False`` may return None boundaries.

        ``out``: ``(output, final_state, boundaries or None)`` buffers, filled and returned.
        ``screen``: where :meth:`screens`, a zeroed float64 ``[B * H, 2]`` array that receives
        per head ``sum(x * 0)`` over ``q, k, v`` and over the results (NaN: not finite).
        """
        route = self.route(q)
        if route is None:
            o, final = self.ops.recurrent_forward(q, k, v, g, beta, self.scale, state)
            return _into(out, (o, final, _start_boundaries(state, q.shape[2]) if keep else None))
        ops, C, wide = route
        xp = _namespace(q)
        if wide == q.dtype:
            return chunk_forward(
                ops, xp, q, k, v, g, beta, self.scale, state, C, out=out, keep=keep, screen=screen
            )
        args = _cast(xp, wide, q, k, v, g, beta, state)
        results = chunk_forward(ops, xp, *args[:5], self.scale, args[5], C, keep=keep)
        return _into(out, _cast(xp, q.dtype, *results))

    def backward(
        self, q, k, v, g, beta, state, boundaries, do, dfinal, *, out=None, workspace=None, screen=None
    ) -> tuple[Any, ...]:
        """The six gradients. ``out``: six buffers of their shapes that receive them;
        ``workspace``: a ``[NT, B, HV, K, V]`` buffer for the recomputed boundaries (with
        ``boundaries=None`` and ``out``); ``screen``: as for :meth:`forward`, over ``q, k, v,
        do`` and the boundaries, and over the gradients."""
        route = self.route(q)
        if route is None:  # the one boundary, when given, is the initial state
            state = state if boundaries is None or boundaries.shape[0] == 0 else boundaries[0, ...]
            return _into(out, self.ops.recurrent_backward(q, k, v, g, beta, self.scale, state, do, dfinal))
        ops, C, wide = route
        xp = _namespace(q)
        if wide == q.dtype:
            bufs = None if out is None else (*out, *(() if workspace is None else (workspace,)))
            return chunk_backward(
                ops, xp, q, k, v, g, beta, self.scale, state, boundaries, grad_output=do, dfinal=dfinal,
                chunk_size=C, out=bufs, screen=screen,
            )  # fmt: skip
        args = _cast(xp, wide, q, k, v, g, beta, state, boundaries, do, dfinal)
        grads = chunk_backward(
            ops,
            xp,
            *args[:5],
            self.scale,
            args[5],
            args[6],
            grad_output=args[7],
            dfinal=args[8],
            chunk_size=C,
        )
        return _into(out, _cast(xp, q.dtype, *grads))

    def end_state(self, q, k, v, g, beta, start) -> Any:
        """The state after the inputs from ``start`` (no outputs formed)."""
        route = self.route(q)
        if route is None:
            return self.ops.recurrent_forward(q, k, v, g, beta, self.scale, start)[1]
        ops, C, wide = route
        xp = _namespace(q)
        args = _cast(xp, wide, q, k, v, g, beta, start)
        with ops.worker_context():  # one BLAS thread: small products
            end = chunk_end_state(ops, xp, *args[:5], self.scale, args[5], C)
        return xp.astype(end, q.dtype, copy=False)

    def state_gradient(self, q, k, v, g, beta, do) -> Any:
        """The start-state gradient when the end-state gradient is zero (``D`` of a transition)."""
        route = self.route(q)
        xp = _namespace(q)
        if route is None:
            B, HV, _, K = q.shape
            zeros = xp.zeros((B, HV, K, v.shape[-1]), dtype=q.dtype, device=q.device)
            return self.ops.recurrent_backward(q, k, v, g, beta, self.scale, zeros, do, zeros)[5]
        ops, C, wide = route
        args = _cast(xp, wide, q, k, v, g, beta, do)
        with ops.worker_context():
            D = chunk_state_gradient(ops, xp, *args[:5], self.scale, args[5], C)
        return xp.astype(D, q.dtype, copy=False)


def _into(out: Any, results: Any) -> tuple[Any, ...]:
    """``results``, or copied into the buffers ``out`` (returned; a None buffer is skipped)."""
    if out is None:
        return tuple(results)
    for buf, x in zip(out, results, strict=True):
        if buf is not None and x is not None:
            buf[...] = x
    return tuple(out)


def _cast(xp: Any, dtype: Any, *arrays: Any) -> list[Any]:
    """The arrays in ``dtype`` (None stays None; no copy when they have it already)."""
    return [None if x is None else xp.astype(x, dtype, copy=False) for x in arrays]


def _namespace(x: Any) -> Any:
    return array_api_compat.array_namespace(x)


def _start_boundaries(state: Any, T: int) -> Any:
    """The boundaries of a sequence of at most one chunk: its initial state (none when T == 0)."""
    xp = _namespace(state)
    if T == 0:
        return xp.zeros((0, *state.shape), dtype=state.dtype, device=state.device)
    return xp.asarray(state[None, ...], copy=True)


def run_packed_forward(core: Core, xp: Any, c: CoreInputs, state: Any, offsets, keep: bool, out=None):
    """``(output, final_state, boundaries)`` of the core on ``c``, per group of packed sequences.

    ``boundaries`` is None unless ``keep``. ``out``: buffers (compute dtype, head-first) that
    receive the results (copied in). Without packed sequences the caller runs ``core.forward``.
    """
    return _into(out, _run_packed_forward(core, xp, c, state, offsets, keep))


def _run_packed_forward(core: Core, xp: Any, c: CoreInputs, state: Any, offsets, keep_boundaries: bool):
    plan = _varlen.plan_sequences(offsets, core.chunk_size)
    outs, finals, group_boundaries = [], [], []
    for group in plan.groups:
        args = [_varlen.gather(xp, x, plan, group) for x in (c.q, c.k, c.v, c.g, c.beta)]
        o, final, boundaries = core.forward(
            *args, _varlen.gather_rows(xp, state, plan, group), keep_boundaries
        )
        outs.append(o)
        finals.append(final)
        group_boundaries.append(boundaries)
    if outs:
        output = _varlen.scatter(xp, outs, plan)
    else:
        output = xp.zeros(c.v.shape, dtype=c.v.dtype, device=c.v.device)
    final = _varlen.scatter_rows(xp, finals, plan, state)
    if not keep_boundaries or (group_boundaries and group_boundaries[0] is None):
        return output, final, None
    empty = xp.zeros((0, 1, *state.shape[1:]), dtype=state.dtype, device=state.device)
    return output, final, _varlen.scatter_boundaries(xp, group_boundaries, plan, empty)


def run_packed_backward(core: Core, xp: Any, c: CoreInputs, state, boundaries, do, dfinal, offsets, out=None):
    """Gradients ``(dq, dk, dv, dg, dbeta, dinitial)`` of the core's inputs, per group of packed
    sequences (without them the caller runs ``core.backward``).

    Where arrays are writable, a group of one sequence writes its gradients straight into views
    of the packed gradients, and other groups are copied in by slices; elsewhere the groups'
    gradients are concatenated. ``out``: six buffers that receive the gradients.
    """
    return _into(out, _run_packed_backward(core, xp, c, state, boundaries, do, dfinal, offsets))


def _run_packed_backward(core: Core, xp: Any, c: CoreInputs, state, boundaries, do, dfinal, offsets):
    plan = _varlen.plan_sequences(offsets, core.chunk_size)
    packed = [xp.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (c.q, c.k, c.v, c.g, c.beta)]
    in_place = bool(array_api_compat.is_writeable_array(packed[0]))
    parts: list[list[Any]] = [[] for _ in range(5)]
    dinitials = []
    for group in plan.groups:
        args = [_varlen.gather(xp, x, plan, group) for x in (c.q, c.k, c.v, c.g, c.beta, do)]
        rows = [_varlen.gather_rows(xp, x, plan, group) for x in (state, dfinal)]
        group_boundaries = (
            None if boundaries is None else _varlen.gather_boundaries(xp, boundaries, plan, group)
        )
        out = None
        if in_place and len(group.seqs) == 1:
            a, b = plan.offsets[group.seqs[0]], plan.offsets[group.seqs[0] + 1]
            out = [x[:, :, a:b, ...] for x in packed] + [
                xp.zeros(rows[1].shape, dtype=rows[1].dtype, device=rows[1].device)
            ]
        *grads, dinitial = core.backward(*args[:5], rows[0], group_boundaries, args[5], rows[1], out=out)
        if not in_place:
            for acc, x in zip(parts, grads, strict=True):
                acc.append(x)
        elif out is None:
            _varlen.scatter_into(packed, grads, plan, group)
        dinitials.append(dinitial)
    if not in_place and dinitials:
        packed = [_varlen.scatter(xp, acc, plan) for acc in parts]
    return (*packed, _varlen.scatter_rows(xp, dinitials, plan, dfinal))
