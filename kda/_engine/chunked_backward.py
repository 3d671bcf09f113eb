"""The chunked backward (:func:`chunk_backward`) and the state-gradient pass alone
(:func:`chunk_state_gradient`).

The algorithm and what a backend provides: :mod:`kda._engine.chunked`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._backend import Gradients
from .chunked_forward import forward_heads
from .chunks import Steps, head_groups, padded_chunk_size, prepare, run_groups, slabs, step_range, writable

__all__ = ["chunk_backward", "chunk_state_gradient"]


class _Ends(NamedTuple):
    """What a backward starts from besides the step arrays: the forward's chunk-start states
    ``boundaries [NT, B, H, K, V]`` (None: recomputed), the output's gradient ``grad_output`` and
    the gradient ``dfinal`` of the state at the end."""

    boundaries: Any
    grad_output: Any
    dfinal: Any


def chunk_backward(
    ops: Any,
    xp: Any,
    q,
    k,
    v,
    g,
    beta,
    state: Any,
    boundaries: Any | None,
    *,
    grad_output: Any,
    dfinal: Any,
    scale: float,
    chunk_size: int,
    out: Gradients | None = None,
    workspace: Any = None,
    screen: Any = None,
) -> Gradients:
    """Chunked backward on arrays of the compute dtype.

    ``boundaries`` are the chunk-start states of the forward, or ``None`` to recompute them
    from ``state``; ``dfinal`` is the final state's gradient. Returns the gradients of
    ``q, k, v, g, beta`` and of the initial state (:class:`~kda._backend.Gradients`).
    ``screen``: as for :func:`~kda._engine.chunked_forward.chunk_forward`, filled by the fused
    backward pass. ``out``, when given, is a :class:`~kda._backend.Gradients` of caller-owned
    writable buffers (compute dtype) for those six gradients, written in place and returned;
    ``workspace`` (with ``out`` only) is a ``[NT, B, H, K, V]`` buffer that receives the recomputed
    boundaries when ``boundaries`` is None.
    """
    steps = Steps(q, k, v, g, beta)
    T = q.shape[2]
    if out is None:
        fill = xp.empty if ops.chunk_backward_heads is not None else xp.zeros  # fused: every row written
        dq, dk, dv, dg, dbeta = (fill(x.shape, dtype=x.dtype, device=x.device) for x in steps)
        bufs = Gradients(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dinitial=None)
        workspace = None
    else:
        bufs = out
    if T == 0 or q.shape[0] * q.shape[1] == 0:  # nothing to compute: no steps, or no heads
        if out is None:
            return bufs._replace(dinitial=xp.asarray(dfinal, copy=True))
        out.dinitial[...] = dfinal
        return out
    if ops.chunk_backward_heads is not None and writable(bufs.dq):
        ends = _Ends(boundaries=boundaries, grad_output=grad_output, dfinal=dfinal)
        return _backward_fused(
            ops,
            xp,
            steps,
            state,
            ends,
            scale=scale,
            chunk_size=chunk_size,
            grads=bufs,
            workspace=workspace,
            screen=screen,
        )
    axis, groups = head_groups(ops, xp, q.shape)
    if not writable(bufs.dq):
        axis, groups = 1, [slice(None)]

    def task(group: slice) -> Gradients:
        i = (*(slice(None),) * axis, group, ...)  # the group's heads along axis (0: B, 1: H)
        group_steps = steps.heads(i)
        if boundaries is None:
            ws = None if workspace is None else workspace[(slice(None), *i)]
            group_boundaries = forward_heads(
                ops,
                xp,
                group_steps,
                state[i],
                scale=scale,
                chunk_size=chunk_size,
                out=None,
                boundaries_buf=ws,
            ).boundaries
        else:
            group_boundaries = boundaries[(slice(None), *i)]
        views = Gradients(*(x[i] for x in bufs[:5]), dinitial=None)
        ends = _Ends(boundaries=group_boundaries, grad_output=grad_output[i], dfinal=dfinal[i])
        result = _backward_heads(ops, xp, group_steps, ends, scale=scale, chunk_size=chunk_size, grads=views)
        if bufs.dinitial is not None:
            bufs.dinitial[i] = result.dinitial
        return result

    results = run_groups(ops, groups, task)
    if out is not None:
        return out
    if len(results) == 1:
        (only,) = results
        return only
    return bufs._replace(dinitial=xp.concat([r.dinitial for r in results], axis=axis))


def _backward_fused(
    ops: Any,
    xp: Any,
    steps: Steps,
    state: Any,
    ends: _Ends,
    *,
    scale: float,
    chunk_size: int,
    grads: Gradients,
    workspace: Any,
    screen: Any,
) -> Gradients:
    """The backward through the backend's fused passes (boundaries recomputed when None);
    ``grads.dinitial``: the initial state's gradient's buffer, or None."""
    C, boundaries, dfinal = chunk_size, ends.boundaries, ends.dfinal
    if boundaries is None:
        NT = -(-steps.q.shape[2] // C)
        if workspace is None:
            workspace = xp.empty((NT, *state.shape), dtype=state.dtype, device=state.device)
        ops.chunk_forward_heads(*steps, state, scale=scale, chunk_size=C, output=None, boundaries=workspace)
        boundaries = workspace
    if grads.dinitial is None:
        grads = grads._replace(dinitial=xp.empty(dfinal.shape, dtype=dfinal.dtype, device=dfinal.device))
    ops.chunk_backward_heads(
        *steps, boundaries, ends.grad_output, dfinal, scale=scale, chunk_size=C, grads=grads, screen=screen
    )
    return grads


def _backward_heads(
    ops: Any, xp: Any, steps: Steps, ends: _Ends, *, scale: float, chunk_size: int, grads: Gradients
) -> Gradients:
    """Backward of a group of heads, slab by slab from the last; writes the step arrays' gradients
    into ``grads`` where it can. Returns them and the initial state's gradient."""
    T, C = steps.q.shape[2], chunk_size
    dend = ends.dfinal  # the gradient of the state at a slab's end
    step_grads = grads[:5]  # dq, dk, dv, dg, dbeta
    collected = []
    shape, width = steps.q.shape, max(steps.q.shape[-1], steps.v.shape[-1])
    for n0, n1 in reversed(slabs(shape, C, width, ops.SLAB_ELEMENTS)):
        t = step_range(n0, n1, C, T)
        slab_ends = _Ends(
            boundaries=ends.boundaries[n0:n1, ...], grad_output=ends.grad_output[:, :, t, ...], dfinal=dend
        )
        slab = _backward_slab(ops, xp, steps.span(t), slab_ends, scale=scale, chunk_size=C)
        dend = slab.dinitial
        if writable(grads.dq):
            for acc, x in zip(step_grads, slab[:5], strict=True):
                acc[:, :, t, ...] = x
        else:
            collected.append(slab[:5])
    if collected:
        step_grads = tuple(xp.concat(parts[::-1], axis=2) for parts in zip(*collected, strict=True))
    return Gradients(*step_grads, dinitial=dend)


def _backward_slab(
    ops: Any, xp: Any, steps: Steps, ends: _Ends, *, scale: float, chunk_size: int
) -> Gradients:
    """Gradients of one slab of chunks; ``ends.dfinal`` is the gradient of the state at its end, and
    ``dinitial`` of the result the gradient of the state at its start.

    Three primitives: the state-free work again, the state-gradient recurrence (which also
    recomputes ``U`` and forms ``A^T dO`` and ``qg^T dO``), and the gradients of the state-free
    work given the states and their gradients.
    """
    T, C = steps.q.shape[2], chunk_size
    c = prepare(ops, steps, scale=scale, chunk_size=C)
    loc = c.local
    dO = ops.to_chunks(ends.grad_output, chunk_size=C, padded_size=padded_chunk_size(C))
    passed = ops.chunk_state_grad_pass(
        loc.w, loc.u0, loc.k_suffix, loc.total, loc.qg, loc.A, dO, ends.boundaries, ends.dfinal
    )
    d = ops.chunk_local_backward(
        c.q,
        c.k,
        c.v,
        c.g,
        c.beta,
        ends.boundaries,
        scale=scale,
        local=loc,
        dends=passed.dends,
        u=passed.u,
        du=passed.du,
        grad_output=dO,
    )

    def back(x: Any) -> Any:
        return ops.from_chunks(x, chunk_size=C, length=T)

    return Gradients(
        dq=back(d.dq),
        dk=back(d.dk),
        dv=back(d.dv),
        dg=back(d.dg),
        dbeta=back(d.dbeta[..., None])[..., 0],
        dinitial=passed.dstart,
    )


def chunk_state_gradient(
    ops: Any, xp: Any, q, k, v, g, beta, grad_output: Any, *, scale: float, chunk_size: int
) -> Any:
    """The start-state gradient when the end-state gradient is zero, by the state-gradient pass alone.

    Per chunk, from the last: ``dU = A^T dO + k_suffix dS`` and ``dS <- total * dS + qg^T dO - W^T dU``;
    it depends on neither the states nor ``v``, so the pass runs from zero states.
    """
    steps = Steps(q, k, v, g, beta)
    B, H, T, K = q.shape
    V = v.shape[-1]
    dend = xp.zeros((B, H, K, V), dtype=q.dtype, device=q.device)
    if T == 0 or B * H == 0:
        return dend
    C, Cp = chunk_size, padded_chunk_size(chunk_size)
    for n0, n1 in reversed(slabs(q.shape, C, max(K, V), ops.SLAB_ELEMENTS)):
        t = step_range(n0, n1, C, T)
        loc = prepare(ops, steps.span(t), scale=scale, chunk_size=C).local
        dO = ops.to_chunks(grad_output[:, :, t, ...], chunk_size=C, padded_size=Cp)
        zeros = xp.zeros((n1 - n0, *dend.shape), dtype=dend.dtype, device=dend.device)
        dend = ops.chunk_state_grad_pass(
            loc.w, loc.u0, loc.k_suffix, loc.total, loc.qg, loc.A, dO, zeros, dend
        ).dstart
    return dend
