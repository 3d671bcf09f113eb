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
from typing import Any, NamedTuple, Protocol

import array_api_compat

from .._backend import Gradients, KdaOutput, resolve
from .._errors import InvalidInputError
from .._options.maps import CoreInputs
from . import varlen as _varlen
from .chunked import chunk_backward, chunk_end_state, chunk_forward, chunk_state_gradient, padded_chunk_size
from .widening import chunk_compute_dtype

__all__ = [
    "ChunkCore",
    "Core",
    "Gradients",
    "KdaOutput",
    "RecurrentCore",
    "Route",
    "run_packed_backward",
    "run_packed_forward",
]


# The pair matrices of one chunk for all heads, ``B * HV * Cp * Cp`` elements, are refused above
# this many bytes: a chunk that large cannot be worth computing as one block.
PAIR_BYTES_LIMIT = 1 << 31


class Core(Protocol):
    """What the entry points call: :class:`ChunkCore` or :class:`RecurrentCore`. Results are
    :class:`~kda._backend.KdaOutput` and :class:`~kda._backend.Gradients` records; ``out`` buffers
    are records of the same kinds."""

    chunk_size: int

    def screens(self, q) -> bool: ...

    def forward(
        self, q, k, v, g, beta, state, *, keep: bool = True, out: KdaOutput | None = None, screen=None
    ) -> KdaOutput: ...

    def backward(
        self,
        q,
        k,
        v,
        g,
        beta,
        state,
        boundaries,
        do,
        dfinal,
        *,
        out: Gradients | None = None,
        workspace=None,
        screen=None,
    ) -> Gradients: ...


@dataclass(frozen=True)
class RecurrentCore:
    """The step recurrence of a backend."""

    ops: Any
    scale: float
    chunk_size: int = 1  # packed sequences are grouped by exact length

    def screens(self, q) -> bool:
        return False

    def forward(
        self, q, k, v, g, beta, state, *, keep: bool = True, out: KdaOutput | None = None, screen=None
    ) -> KdaOutput:
        o, final = self.ops.recurrent_forward(q, k, v, g, beta, state, scale=self.scale)
        return _into(out, KdaOutput(output=o, final_state=final, boundaries=None))

    def backward(
        self,
        q,
        k,
        v,
        g,
        beta,
        state,
        boundaries,
        do,
        dfinal,
        *,
        out: Gradients | None = None,
        workspace=None,
        screen=None,
    ) -> Gradients:
        return _into(out, self.ops.recurrent_backward(q, k, v, g, beta, state, do, dfinal, scale=self.scale))


class Route(NamedTuple):
    """How :class:`ChunkCore` runs a call's chunks: on ``ops`` (the backend, or the reference
    where the chunks are longer than it holds), ``chunk_size`` steps per chunk (clamped to the
    sequence), computing in ``dtype``."""

    ops: Any
    chunk_size: int
    dtype: Any


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

    def route(self, q) -> Route | None:
        """How the chunks of ``q``'s call run (:class:`Route`), or None for the step recurrence.

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
        return Route(
            ops=resolve(self.ops, padded_chunk_size(C)),
            chunk_size=C,
            dtype=chunk_compute_dtype(xp, q.shape[-1], C, q.dtype),
        )

    def screens(self, q) -> bool:
        """Whether :meth:`forward` and :meth:`backward` (without ``out``) read the finiteness of
        their inputs and results off the chunks as they pass: the backend's fused passes, in
        ``q``'s dtype."""
        route = self.route(q) if q.shape[2] else None
        if route is None or route.dtype != q.dtype:
            return False
        return route.ops.chunk_forward_heads is not None and route.ops.chunk_backward_heads is not None

    def forward(
        self, q, k, v, g, beta, state, *, keep: bool = True, out: KdaOutput | None = None, screen=None
    ) -> KdaOutput:
        """The output, final state and boundaries; ``keep=False`` may return None boundaries.

        ``out``: a :class:`~kda._backend.KdaOutput` of buffers (``boundaries`` may be None), filled
        and returned. ``screen``: where :meth:`screens`, a zeroed float64 ``[B * H, 2]`` array that
        receives per head ``sum(x * 0)`` over ``q, k, v`` and over the results (NaN: not finite).
        """
        route = self.route(q)
        if route is None:
            o, final = self.ops.recurrent_forward(q, k, v, g, beta, state, scale=self.scale)
            boundaries = _start_boundaries(state, q.shape[2]) if keep else None
            return _into(out, KdaOutput(output=o, final_state=final, boundaries=boundaries))
        xp = _namespace(q)
        if route.dtype == q.dtype:
            return chunk_forward(
                route.ops,
                xp,
                q,
                k,
                v,
                g,
                beta,
                state,
                scale=self.scale,
                chunk_size=route.chunk_size,
                out=out,
                keep=keep,
                screen=screen,
            )
        wide = _Steps.cast(xp, route.dtype, q, k, v, g, beta)
        result = chunk_forward(
            route.ops,
            xp,
            *wide,
            _cast(xp, route.dtype, state),
            scale=self.scale,
            chunk_size=route.chunk_size,
            keep=keep,
        )
        back = KdaOutput(
            output=_cast(xp, q.dtype, result.output),
            final_state=_cast(xp, q.dtype, result.final_state),
            boundaries=_cast(xp, q.dtype, result.boundaries),
        )
        return _into(out, back)

    def backward(
        self,
        q,
        k,
        v,
        g,
        beta,
        state,
        boundaries,
        do,
        dfinal,
        *,
        out: Gradients | None = None,
        workspace=None,
        screen=None,
    ) -> Gradients:
        """The six gradients. ``out``: a :class:`~kda._backend.Gradients` of buffers of their
        shapes that receive them; ``workspace``: a ``[NT, B, HV, K, V]`` buffer for the recomputed
        boundaries (with ``boundaries=None`` and ``out``); ``screen``: as for :meth:`forward`, over
        ``q, k, v, do`` and the boundaries, and over the gradients."""
        route = self.route(q)
        if route is None:  # the one boundary, when given, is the initial state
            state = state if boundaries is None or boundaries.shape[0] == 0 else boundaries[0, ...]
            grads = self.ops.recurrent_backward(q, k, v, g, beta, state, do, dfinal, scale=self.scale)
            return _into(out, grads)
        xp = _namespace(q)
        if route.dtype == q.dtype:
            return chunk_backward(
                route.ops,
                xp,
                q,
                k,
                v,
                g,
                beta,
                state,
                boundaries,
                grad_output=do,
                dfinal=dfinal,
                scale=self.scale,
                chunk_size=route.chunk_size,
                out=out,
                workspace=workspace,
                screen=screen,
            )
        wide = route.dtype
        grads = chunk_backward(
            route.ops,
            xp,
            *_Steps.cast(xp, wide, q, k, v, g, beta),
            _cast(xp, wide, state),
            _cast(xp, wide, boundaries),
            grad_output=_cast(xp, wide, do),
            dfinal=_cast(xp, wide, dfinal),
            scale=self.scale,
            chunk_size=route.chunk_size,
        )
        back = Gradients(
            dq=_cast(xp, q.dtype, grads.dq),
            dk=_cast(xp, q.dtype, grads.dk),
            dv=_cast(xp, q.dtype, grads.dv),
            dg=_cast(xp, q.dtype, grads.dg),
            dbeta=_cast(xp, q.dtype, grads.dbeta),
            dinitial=_cast(xp, q.dtype, grads.dinitial),
        )
        return _into(out, back)

    def end_state(self, q, k, v, g, beta, start) -> Any:
        """The state after the inputs from ``start`` (no outputs formed)."""
        route = self.route(q)
        if route is None:
            _, final = self.ops.recurrent_forward(q, k, v, g, beta, start, scale=self.scale)
            return final
        xp = _namespace(q)
        wide = route.dtype
        with route.ops.worker_context():  # one BLAS thread: small products
            end = chunk_end_state(
                route.ops,
                xp,
                *_Steps.cast(xp, wide, q, k, v, g, beta),
                _cast(xp, wide, start),
                scale=self.scale,
                chunk_size=route.chunk_size,
            )
        return xp.astype(end, q.dtype, copy=False)

    def state_gradient(self, q, k, v, g, beta, do) -> Any:
        """The start-state gradient when the end-state gradient is zero (``D`` of a transition)."""
        route = self.route(q)
        xp = _namespace(q)
        if route is None:
            B, HV, _, K = q.shape
            zeros = xp.zeros((B, HV, K, v.shape[-1]), dtype=q.dtype, device=q.device)
            return self.ops.recurrent_backward(q, k, v, g, beta, zeros, do, zeros, scale=self.scale).dinitial
        wide = route.dtype
        with route.ops.worker_context():
            D = chunk_state_gradient(
                route.ops,
                xp,
                *_Steps.cast(xp, wide, q, k, v, g, beta),
                _cast(xp, wide, do),
                scale=self.scale,
                chunk_size=route.chunk_size,
            )
        return xp.astype(D, q.dtype, copy=False)


class _Steps(NamedTuple):
    """The step arrays of a call, by name (cast together to the compute dtype)."""

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any

    @classmethod
    def cast(cls, xp: Any, dtype: Any, q, k, v, g, beta) -> _Steps:
        return cls(
            q=_cast(xp, dtype, q),
            k=_cast(xp, dtype, k),
            v=_cast(xp, dtype, v),
            g=_cast(xp, dtype, g),
            beta=_cast(xp, dtype, beta),
        )


def _into(out: Any, results: Any) -> Any:
    """``results`` (a :class:`~kda._backend.KdaOutput` or :class:`~kda._backend.Gradients`), or
    copied into the buffers ``out``, a record of the same kind (returned; a None buffer is
    skipped)."""
    if out is None:
        return results
    for buf, x in zip(out, results, strict=True):
        if buf is not None and x is not None:
            buf[...] = x
    return out


def _cast(xp: Any, dtype: Any, x: Any) -> Any:
    """``x`` in ``dtype`` (None stays None; no copy when it has it already)."""
    return None if x is None else xp.astype(x, dtype, copy=False)


def _namespace(x: Any) -> Any:
    return array_api_compat.array_namespace(x)


def _start_boundaries(state: Any, T: int) -> Any:
    """The boundaries of a sequence of at most one chunk: its initial state (none when T == 0)."""
    xp = _namespace(state)
    if T == 0:
        return xp.zeros((0, *state.shape), dtype=state.dtype, device=state.device)
    return xp.asarray(state[None, ...], copy=True)


def run_packed_forward(
    core: Core, xp: Any, c: CoreInputs, state: Any, offsets, *, keep: bool, out: KdaOutput | None = None
) -> KdaOutput:
    """The output, final state and boundaries of the core on ``c``, per group of packed sequences.

    ``boundaries`` is None unless ``keep``. ``out``: a :class:`~kda._backend.KdaOutput` of buffers
    (compute dtype, head-first) that receive the results (copied in). Without packed sequences the
    caller runs ``core.forward``.
    """
    return _into(out, _run_packed_forward(core, xp, c, state, offsets, keep))


def _run_packed_forward(
    core: Core, xp: Any, c: CoreInputs, state: Any, offsets, keep_boundaries: bool
) -> KdaOutput:
    plan = _varlen.plan_sequences(offsets, core.chunk_size)
    outs, finals, group_boundaries = [], [], []
    for group in plan.groups:
        q, k, v, g, beta = (_varlen.gather(xp, x, plan, group) for x in (c.q, c.k, c.v, c.g, c.beta))
        result = core.forward(
            q, k, v, g, beta, _varlen.gather_rows(xp, state, plan, group), keep=keep_boundaries
        )
        outs.append(result.output)
        finals.append(result.final_state)
        group_boundaries.append(result.boundaries)
    if outs:
        output = _varlen.scatter(xp, outs, plan)
    else:
        output = xp.zeros(c.v.shape, dtype=c.v.dtype, device=c.v.device)
    final = _varlen.scatter_rows(xp, finals, plan, state)
    if not keep_boundaries or any(b is None for b in group_boundaries):  # the step recurrence keeps none
        return KdaOutput(output=output, final_state=final, boundaries=None)
    empty = xp.zeros((0, 1, *state.shape[1:]), dtype=state.dtype, device=state.device)
    boundaries = _varlen.scatter_boundaries(xp, group_boundaries, plan, empty)
    return KdaOutput(output=output, final_state=final, boundaries=boundaries)


def run_packed_backward(
    core: Core,
    xp: Any,
    c: CoreInputs,
    state,
    boundaries,
    do,
    dfinal,
    offsets,
    *,
    out: Gradients | None = None,
) -> Gradients:
    """The gradients of the core's inputs (:class:`~kda._backend.Gradients`), per group of
    packed sequences (without them the caller runs ``core.backward``).

    Where arrays are writable, a group of one sequence writes its gradients straight into views
    of the packed gradients, and other groups are copied in by slices; elsewhere the groups'
    gradients are concatenated. ``out``: a record of six buffers that receive the gradients.
    """
    return _into(out, _run_packed_backward(core, xp, c, state, boundaries, do, dfinal, offsets))


def _run_packed_backward(
    core: Core, xp: Any, c: CoreInputs, state, boundaries, do, dfinal, offsets
) -> Gradients:
    plan = _varlen.plan_sequences(offsets, core.chunk_size)
    steps = (c.q, c.k, c.v, c.g, c.beta)
    packed = [xp.zeros(x.shape, dtype=x.dtype, device=x.device) for x in steps]
    in_place = all(array_api_compat.is_writeable_array(x) for x in packed)
    parts: list[list[Any]] = [[] for _ in steps]
    dinitials = []
    for group in plan.groups:
        q, k, v, g, beta, group_do = (_varlen.gather(xp, x, plan, group) for x in (*steps, do))
        start, dend = (_varlen.gather_rows(xp, x, plan, group) for x in (state, dfinal))
        group_boundaries = (
            None if boundaries is None else _varlen.gather_boundaries(xp, boundaries, plan, group)
        )
        out = None
        if in_place and len(group.seqs) == 1:
            (seq,) = group.seqs
            a, b = plan.offsets[seq], plan.offsets[seq + 1]
            dq, dk, dv, dg, dbeta = (x[:, :, a:b, ...] for x in packed)
            dinitial = xp.zeros(dend.shape, dtype=dend.dtype, device=dend.device)
            out = Gradients(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dinitial=dinitial)
        grads = core.backward(q, k, v, g, beta, start, group_boundaries, group_do, dend, out=out)
        group_steps = (grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta)
        if not in_place:
            for acc, x in zip(parts, group_steps, strict=True):
                acc.append(x)
        elif out is None:
            _varlen.scatter_into(packed, group_steps, plan, group)
        dinitials.append(grads.dinitial)
    if not in_place and dinitials:
        packed = [_varlen.scatter(xp, acc, plan) for acc in parts]
    dq, dk, dv, dg, dbeta = packed
    return Gradients(
        dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dinitial=_varlen.scatter_rows(xp, dinitials, plan, dfinal)
    )
