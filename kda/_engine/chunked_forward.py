"""The chunked forward (:func:`chunk_forward`) and the state pass alone (:func:`chunk_end_state`).

The algorithm and what a backend provides: :mod:`kda._engine.chunked`.
"""

from __future__ import annotations

from typing import Any

from .._backend import KdaOutput
from .chunks import Steps, head_groups, prepare, run_groups, slabs, step_range, writable

__all__ = ["chunk_end_state", "chunk_forward", "forward_heads"]


def chunk_forward(
    ops: Any,
    xp: Any,
    q,
    k,
    v,
    g,
    beta,
    state: Any,
    *,
    scale: float,
    chunk_size: int,
    out: KdaOutput | None = None,
    keep: bool = True,
    screen: Any = None,
) -> KdaOutput:
    """Chunked forward on arrays of the compute dtype.

    Returns ``output [B, H, T, V]``, ``final_state [B, H, K, V]`` and
    ``boundaries [NT, B, H, K, V]`` (None from the fused pass with ``keep=False``: a forward
    that keeps no boundaries writes none). ``screen``: a zeroed float64 ``[B * H, 2]`` array that
    the fused pass fills (see the backend's ``chunk_forward_heads``). ``out``, when given, is a
    :class:`~kda._backend.KdaOutput` of caller-owned writable buffers of those shapes (compute dtype;
    ``boundaries`` may be None) that receive the results in place and is returned: then nothing is
    allocated whose size grows with ``T`` beyond one slab's work.
    """
    steps = Steps(q, k, v, g, beta)
    B, H, T, _ = q.shape
    V = v.shape[-1]
    NT = -(-T // chunk_size)
    if out is None:
        fill = xp.empty if ops.chunk_forward_heads is not None else xp.zeros  # fused: every row written
        o = fill((B, H, T, V), dtype=v.dtype, device=v.device)
        final_buf = boundaries = None
    else:
        o, final_buf, boundaries = out.output, out.final_state, out.boundaries
    if T == 0 or B * H == 0:  # nothing to compute: no steps, or no heads
        if out is None:
            empty = xp.zeros((NT, *state.shape), dtype=state.dtype, device=state.device)
            return KdaOutput(output=o, final_state=xp.asarray(state, copy=True), boundaries=empty)
        final_buf[...] = state
        return out
    if ops.chunk_forward_heads is not None and writable(o):
        if out is None and keep:
            boundaries = xp.empty((NT, *state.shape), dtype=state.dtype, device=state.device)
        final = ops.chunk_forward_heads(
            *steps, state, scale=scale, chunk_size=chunk_size, output=o, boundaries=boundaries, screen=screen
        )
        if out is None:
            return KdaOutput(output=o, final_state=final, boundaries=boundaries)
        final_buf[...] = final
        return out
    axis, groups = head_groups(ops, xp, q.shape)
    if not writable(o):
        axis, groups = 1, [slice(None)]

    def task(group: slice) -> KdaOutput:
        i = (*(slice(None),) * axis, group, ...)  # the group's heads along axis (0: B, 1: H)
        into = None if boundaries is None else boundaries[(slice(None), *i)]
        result = forward_heads(
            ops,
            xp,
            steps.heads(i),
            state[i],
            scale=scale,
            chunk_size=chunk_size,
            out=o[i],
            boundaries_buf=into,
        )
        if final_buf is not None:
            final_buf[i] = result.final_state
        return result

    results = run_groups(ops, groups, task)
    if out is not None:
        return out
    if len(results) == 1:
        (only,) = results
        return only._replace(output=o) if writable(o) else only
    final = xp.concat([r.final_state for r in results], axis=axis)
    boundaries = xp.concat([r.boundaries for r in results], axis=axis + 1)
    return KdaOutput(output=o, final_state=final, boundaries=boundaries)


def forward_heads(
    ops: Any,
    xp: Any,
    steps: Steps,
    state: Any,
    *,
    scale: float,
    chunk_size: int,
    out: Any,
    boundaries_buf: Any,
) -> KdaOutput:
    """Forward of a group of heads, slab by slab; writes ``out`` where it can.

    ``out=None`` asks for the states only (the backward's recomputed boundaries): no output is formed.
    ``boundaries_buf``, when not None, is a ``[NT, ...]`` buffer that receives the chunk-start states slab
    by slab (and is returned as the boundaries) instead of concatenating them.
    """
    T, C, V = steps.q.shape[2], chunk_size, steps.v.shape[-1]
    parts, outs = [], []  # the slabs' boundaries (without boundaries_buf), outputs
    for n0, n1 in slabs(steps.q.shape, C, max(steps.q.shape[-1], V), ops.SLAB_ELEMENTS):
        t = step_range(n0, n1, C, T)
        loc = prepare(ops, steps.span(t), scale=scale, chunk_size=C).local
        # the output O = qg S + A U, fused in where one is asked for
        qg, A = (None, None) if out is None else (loc.qg, loc.A)
        passed = ops.chunk_state_pass(loc.w, loc.u0, loc.k_suffix, loc.total, state, qg, A)
        state = passed.final_state
        if boundaries_buf is None:
            parts.append(passed.boundaries)
        else:
            boundaries_buf[n0:n1, ...] = passed.boundaries
        if out is None:
            continue
        O = ops.from_chunks(passed.output, chunk_size=C, length=t.stop - t.start)
        if writable(out):
            out[:, :, t, :] = O
        else:
            outs.append(O)
    if boundaries_buf is not None:
        boundaries = boundaries_buf
    else:
        boundaries = xp.concat(parts, axis=0) if len(parts) > 1 else parts.pop()
    output = xp.concat(outs, axis=2) if outs else out
    return KdaOutput(output=output, final_state=state, boundaries=boundaries)


def chunk_end_state(ops: Any, xp: Any, q, k, v, g, beta, start: Any, *, scale: float, chunk_size: int) -> Any:
    """The state after the inputs from ``start``: the state pass alone, no outputs, no boundaries."""
    steps = Steps(q, k, v, g, beta)
    B, H, T, K = q.shape
    if T == 0 or B * H == 0:
        return xp.asarray(start, copy=True)
    if ops.chunk_forward_heads is not None:  # the fused forward, neither outputs nor boundaries kept
        return ops.chunk_forward_heads(
            *steps, start, scale=scale, chunk_size=chunk_size, output=None, boundaries=None
        )
    state = start
    for n0, n1 in slabs(q.shape, chunk_size, max(K, v.shape[-1]), ops.SLAB_ELEMENTS):
        t = step_range(n0, n1, chunk_size, T)
        loc = prepare(ops, steps.span(t), scale=scale, chunk_size=chunk_size).local
        state = ops.chunk_state_pass(loc.w, loc.u0, loc.k_suffix, loc.total, state).final_state
    return state
