"""The backend-neutral chunked KDA forward and backward.

Written once against the primitive interface that :mod:`kda.reference` (and the CUDA
backend) implement, plus plain array-API glue (matrix products, concatenation, masks) on
the namespace ``xp`` of the inputs. It imports no array library.

Per chunk, with ``S`` the state at its start (see ``docs/design.md``)::

    T  = (I + diag(beta) L)^-1
    W  = T diag(beta) kg            U0 = T diag(beta) v             # state-free
    U  = U0 - W S                                                   # state pass
    O  = qg S + A U
    S' = total * S + k_suffix^T U

Everything but the state pass is done for a whole slab of chunks at once (see :func:`slabs`),
so the number of primitive calls does not grow with the number of chunks. Independent heads
may run in concurrent groups when the backend asks for workers (the CPU reference does).

A backend may instead provide fused passes (``chunk_forward_heads`` / ``chunk_backward_heads``,
the CPU backend does: one head per worker from its first chunk to its last, see ``docs/speed.md``);
the forward and backward then call them directly and the slab composition below is not used.

Besides the primitives, a backend module provides ``SLAB_ELEMENTS`` (the size of a slab's
arrays), ``workers(xp, heads)`` (how many head groups to run at once) and
``worker_context()`` (entered around concurrent groups).

Only the core (:mod:`kda._engine.core`) calls these functions: it chooses the chunk length, the
compute dtype and the backend, and routes the sequences that are too short for chunks.
"""

from __future__ import annotations

import contextvars
import itertools
from dataclasses import dataclass
from typing import Any

from .._backend import Gradients, KdaOutput

__all__ = [
    "chunk_backward",
    "chunk_end_state",
    "chunk_forward",
    "chunk_state_gradient",
    "padded_chunk_size",
    "slabs",
]


def padded_chunk_size(chunk_size: int) -> int:
    """The next power of two ``>= chunk_size``: chunks are halved recursively."""
    return 1 << (chunk_size - 1).bit_length()


@dataclass(frozen=True)
class _Chunks:
    """The inputs of a slab as chunks, and their state-free work (shared by forward and backward)."""

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any  # [B, H, NT, Cp]
    local: Any  # ChunkLocal: qg, kg, k_suffix, total, A, L, Minv, w, u0


def _prepare(ops: Any, xp: Any, q, k, v, g, beta, *, scale: float, chunk_size: int) -> _Chunks:
    C, Cp = chunk_size, padded_chunk_size(chunk_size)
    qc, kc, vc, gc = (ops.to_chunks(x, chunk_size=C, padded_size=Cp) for x in (q, k, v, g))
    bc = ops.to_chunks(beta[..., None], chunk_size=C, padded_size=Cp)[..., 0]
    return _Chunks(q=qc, k=kc, v=vc, g=gc, beta=bc, local=ops.chunk_local(qc, kc, vc, gc, bc, scale=scale))


def slabs(shape: tuple[int, ...], chunk_size: int, width: int, slab_elements: int) -> list[tuple[int, int]]:
    """Ranges ``[n0, n1)`` of chunks processed together.

    The state-free work of one slab holds arrays of about ``slab_elements`` elements, so memory
    stays bounded as ``T`` grows, and the number of primitive calls grows with ``T / slab``, not
    with the number of chunks.
    """
    B, H, T = shape[:3]
    NT = -(-T // chunk_size)
    per_chunk = max(1, B * H * padded_chunk_size(chunk_size) * width)
    step = max(1, slab_elements // per_chunk)
    return [(n, min(n + step, NT)) for n in range(0, NT, step)]


def _steps(n0: int, n1: int, chunk_size: int, T: int) -> slice:
    return slice(n0 * chunk_size, min(n1 * chunk_size, T))


def _head_groups(ops: Any, xp: Any, shape: tuple[int, ...]) -> tuple[int, list[slice]]:
    """Split the independent heads ``B * H`` into groups that run concurrently.

    Returns the axis (0 for B, 1 for H) and one slice per group; the backend decides how many
    workers it wants (one on a GPU).
    """
    B, H = shape[:2]
    workers = ops.workers(xp=xp, heads=B * H)
    axis, n = (1, H) if H >= workers or H >= B else (0, B)
    workers = min(workers, n)
    if workers <= 1:
        return 1, [slice(None)]
    edges = [n * i // workers for i in range(workers + 1)]
    return axis, [slice(a, b) for a, b in itertools.pairwise(edges)]


def _run_groups(ops: Any, groups: list[slice], task) -> list[Any]:
    """``task(group)`` for every group, concurrently when there is more than one."""
    if len(groups) == 1:
        return [task(group) for group in groups]
    from concurrent.futures import ThreadPoolExecutor

    # each group runs in a copy of the caller's context, so context-local settings (NumPy's
    # errstate, for one) hold in the workers as they do in the caller
    contexts = [contextvars.copy_context() for _ in groups]
    with ops.worker_context(), ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(lambda ctx, group: ctx.run(task, group), contexts, groups))


def _writable(x: Any) -> bool:
    import array_api_compat

    return bool(array_api_compat.is_writeable_array(x))


def chunk_forward(
    ops: Any, xp: Any, q, k, v, g, beta, state: Any, *, scale: float, chunk_size: int,
    out: KdaOutput | None = None, keep: bool = True, screen: Any = None,
) -> KdaOutput:  # fmt: skip
    """Chunked forward on arrays of the compute dtype.

    Returns ``output [B, H, T, V]``, ``final_state [B, H, K, V]`` and
    ``boundaries [NT, B, H, K, V]`` (None from the fused pass with ``keep=False``: a forward
    that keeps no boundaries writes none). ``screen``: a zeroed float64 ``[B * H, 2]`` array that
    the fused pass fills (see the backend's ``chunk_forward_heads``). ``out``, when given, is a
    :class:`~kda._backend.KdaOutput` of caller-owned writable buffers of those shapes (compute dtype;
    ``boundaries`` may be None) that receive the results in place and is returned: then nothing is
    allocated whose size grows with ``T`` beyond one slab's work.
    """
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
    if ops.chunk_forward_heads is not None and _writable(o):
        if out is None and keep:
            boundaries = xp.empty((NT, *state.shape), dtype=state.dtype, device=state.device)
        final = ops.chunk_forward_heads(
            q, k, v, g, beta, state, scale=scale, chunk_size=chunk_size, output=o, boundaries=boundaries,
            screen=screen,
        )  # fmt: skip
        if out is None:
            return KdaOutput(output=o, final_state=final, boundaries=boundaries)
        final_buf[...] = final
        return out
    axis, groups = _head_groups(ops, xp, q.shape)
    if not _writable(o):
        axis, groups = 1, [slice(None)]

    def task(group: slice) -> KdaOutput:
        i = (*(slice(None),) * axis, group, ...)  # the group's heads along axis (0: B, 1: H)
        inputs = [x[i] for x in (q, k, v, g, beta)]
        into = None if boundaries is None else boundaries[(slice(None), *i)]
        result = _forward_heads(
            ops, xp, *inputs, state[i], scale=scale, chunk_size=chunk_size, out=o[i], boundaries_buf=into
        )
        if final_buf is not None:
            final_buf[i] = result.final_state
        return result

    results = _run_groups(ops, groups, task)
    if out is not None:
        return out
    if len(results) == 1:
        (only,) = results
        return only._replace(output=o) if _writable(o) else only
    final = xp.concat([r.final_state for r in results], axis=axis)
    boundaries = xp.concat([r.boundaries for r in results], axis=axis + 1)
    return KdaOutput(output=o, final_state=final, boundaries=boundaries)


def _forward_heads(
    ops: Any, xp: Any, q, k, v, g, beta, state: Any, *, scale: float, chunk_size: int, out: Any,
    boundaries_buf: Any = None,
) -> KdaOutput:  # fmt: skip
    """Forward of a group of heads, slab by slab; writes ``out`` where it can.

    ``out=None`` asks for the states only (the backward's recomputed boundaries): no output is formed.
    ``boundaries_buf``, when given, is a ``[NT, ...]`` buffer that receives the chunk-start states slab by
    slab (and is returned as the boundaries) instead of concatenating them.
    """
    T, C = q.shape[2], chunk_size
    parts, outs = [], []  # the slabs' boundaries (without boundaries_buf), outputs
    for n0, n1 in slabs(q.shape, C, max(q.shape[-1], v.shape[-1]), ops.SLAB_ELEMENTS):
        t = _steps(n0, n1, C, T)
        loc = _prepare(
            ops, xp, *(x[:, :, t, ...] for x in (q, k, v, g, beta)), scale=scale, chunk_size=C
        ).local
        # the output O = qg S + A U, fused in where one is asked for
        passed = ops.chunk_state_pass(
            loc.w, loc.u0, loc.k_suffix, loc.total, state, None if out is None else loc.qg,
            None if out is None else loc.A,
        )  # fmt: skip
        state = passed.final_state
        if boundaries_buf is None:
            parts.append(passed.boundaries)
        else:
            boundaries_buf[n0:n1, ...] = passed.boundaries
        if out is None:
            continue
        O = ops.from_chunks(passed.output, chunk_size=C, length=t.stop - t.start)
        if _writable(out):
            out[:, :, t, :] = O
        else:
            outs.append(O)
    if boundaries_buf is not None:
        boundaries = boundaries_buf
    else:
        boundaries = xp.concat(parts, axis=0) if len(parts) > 1 else parts.pop()
    return KdaOutput(
        output=xp.concat(outs, axis=2) if outs else out, final_state=state, boundaries=boundaries
    )


def chunk_backward(
    ops: Any, xp: Any, q, k, v, g, beta, state: Any, boundaries: Any | None, *, grad_output: Any, dfinal: Any,
    scale: float, chunk_size: int, out: Gradients | None = None, workspace: Any = None, screen: Any = None,
) -> Gradients:  # fmt: skip
    """Chunked backward on arrays of the compute dtype.

    ``boundaries`` are the chunk-start states of the forward, or ``None`` to recompute them
    from ``state``; ``dfinal`` is the final state's gradient. Returns the gradients of
    ``q, k, v, g, beta`` and of the initial state (:class:`~kda._backend.Gradients`).
    ``screen``: as for :func:`chunk_forward`, filled by the fused backward pass.
    ``out``, when given, is a :class:`~kda._backend.Gradients` of caller-owned writable buffers
    (compute dtype) for those six gradients, written in place and returned; ``workspace`` (with
    ``out`` only) is a ``[NT, B, H, K, V]`` buffer that receives the recomputed boundaries when
    ``boundaries`` is None.
    """
    T = q.shape[2]
    if out is None:
        fill = xp.empty if ops.chunk_backward_heads is not None else xp.zeros  # fused: every row written
        dq, dk, dv, dg, dbeta = (fill(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, g, beta))
        bufs = Gradients(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dinitial=None)
        workspace = None
    else:
        bufs = out
    if T == 0 or q.shape[0] * q.shape[1] == 0:  # nothing to compute: no steps, or no heads
        if out is None:
            return bufs._replace(dinitial=xp.asarray(dfinal, copy=True))
        out.dinitial[...] = dfinal
        return out
    if ops.chunk_backward_heads is not None and _writable(bufs.dq):
        return _backward_fused(ops, xp, q, k, v, g, beta, state, boundaries, grad_output=grad_output,
                               dfinal=dfinal, scale=scale, chunk_size=chunk_size, grads=bufs,
                               workspace=workspace, screen=screen)  # fmt: skip
    axis, groups = _head_groups(ops, xp, q.shape)
    if not _writable(bufs.dq):
        axis, groups = 1, [slice(None)]

    def task(group: slice) -> Gradients:
        i = (*(slice(None),) * axis, group, ...)  # the group's heads along axis (0: B, 1: H)
        inputs = [x[i] for x in (q, k, v, g, beta)]
        if boundaries is None:
            ws = None if workspace is None else workspace[(slice(None), *i)]
            group_boundaries = _forward_heads(
                ops, xp, *inputs, state[i], scale=scale, chunk_size=chunk_size, out=None, boundaries_buf=ws
            ).boundaries
        else:
            group_boundaries = boundaries[(slice(None), *i)]
        views = Gradients(dq=bufs.dq[i], dk=bufs.dk[i], dv=bufs.dv[i], dg=bufs.dg[i], dbeta=bufs.dbeta[i],
                          dinitial=None)  # fmt: skip
        result = _backward_heads(
            ops, xp, *inputs, group_boundaries, grad_output=grad_output[i], dfinal=dfinal[i], scale=scale,
            chunk_size=chunk_size, grads=views,
        )  # fmt: skip
        if bufs.dinitial is not None:
            bufs.dinitial[i] = result.dinitial
        return result

    results = _run_groups(ops, groups, task)
    if out is not None:
        return out
    if len(results) == 1:
        (only,) = results
        return only
    return bufs._replace(dinitial=xp.concat([r.dinitial for r in results], axis=axis))


def _backward_fused(
    ops: Any, xp: Any, q, k, v, g, beta, state: Any, boundaries: Any, *, grad_output: Any, dfinal: Any,
    scale: float, chunk_size: int, grads: Gradients, workspace: Any, screen: Any = None,
) -> Gradients:  # fmt: skip
    """The backward through the backend's fused passes (boundaries recomputed when None);
    ``grads.dinitial``: the initial state's gradient's buffer, or None."""
    C = chunk_size
    if boundaries is None:
        NT = -(-q.shape[2] // C)
        if workspace is None:
            workspace = xp.empty((NT, *state.shape), dtype=state.dtype, device=state.device)
        ops.chunk_forward_heads(
            q, k, v, g, beta, state, scale=scale, chunk_size=C, output=None, boundaries=workspace
        )
        boundaries = workspace
    if grads.dinitial is None:
        grads = grads._replace(dinitial=xp.empty(dfinal.shape, dtype=dfinal.dtype, device=dfinal.device))
    ops.chunk_backward_heads(
        q,
        k,
        v,
        g,
        beta,
        boundaries,
        grad_output,
        dfinal,
        scale=scale,
        chunk_size=C,
        grads=grads,
        screen=screen,
    )
    return grads


def _backward_heads(
    ops: Any, xp: Any, q, k, v, g, beta, boundaries, *, grad_output, dfinal, scale: float, chunk_size: int,
    grads: Gradients,
) -> Gradients:  # fmt: skip
    """Backward of a group of heads, slab by slab from the last; writes the step arrays' gradients
    into ``grads`` where it can. Returns them and the initial state's gradient."""
    T, C, dend = q.shape[2], chunk_size, dfinal  # the gradient of the state at a slab's end
    steps = (grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta)
    collected = []
    for n0, n1 in reversed(slabs(q.shape, C, max(q.shape[-1], v.shape[-1]), ops.SLAB_ELEMENTS)):
        t = _steps(n0, n1, C, T)
        inputs = (x[:, :, t, ...] for x in (q, k, v, g, beta))
        slab = _backward_slab(
            ops, xp, *inputs, boundaries[n0:n1, ...], grad_output=grad_output[:, :, t, ...], dfinal=dend,
            scale=scale, chunk_size=C,
        )  # fmt: skip
        dend = slab.dinitial
        slab_steps = (slab.dq, slab.dk, slab.dv, slab.dg, slab.dbeta)
        if _writable(grads.dq):
            for acc, x in zip(steps, slab_steps, strict=True):
                acc[:, :, t, ...] = x
        else:
            collected.append(slab_steps)
    if collected:
        steps = tuple(xp.concat(parts[::-1], axis=2) for parts in zip(*collected, strict=True))
    dq, dk, dv, dg, dbeta = steps
    return Gradients(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dinitial=dend)


def _backward_slab(
    ops: Any, xp: Any, q, k, v, g, beta, boundaries: Any, *, grad_output: Any, dfinal: Any, scale: float,
    chunk_size: int,
) -> Gradients:  # fmt: skip
    """Gradients of one slab of chunks; ``dfinal`` is the gradient of the state at its end, and
    ``dinitial`` of the result the gradient of the state at its start.

    Three primitives: the state-free work again, the state-gradient recurrence (which also
    recomputes ``U`` and forms ``A^T dO`` and ``qg^T dO``), and the gradients of the state-free
    work given the states and their gradients.
    """
    T, C = q.shape[2], chunk_size
    c = _prepare(ops, xp, q, k, v, g, beta, scale=scale, chunk_size=C)
    loc = c.local
    dO = ops.to_chunks(grad_output, chunk_size=C, padded_size=padded_chunk_size(C))
    passed = ops.chunk_state_grad_pass(
        loc.w, loc.u0, loc.k_suffix, loc.total, loc.qg, loc.A, dO, boundaries, dfinal
    )
    d = ops.chunk_local_backward(
        c.q, c.k, c.v, c.g, c.beta, boundaries, scale=scale, local=loc, dends=passed.dends, u=passed.u,
        du=passed.du, grad_output=dO,
    )  # fmt: skip

    def back(x: Any) -> Any:
        return ops.from_chunks(x, chunk_size=C, length=T)

    return Gradients(dq=back(d.dq), dk=back(d.dk), dv=back(d.dv), dg=back(d.dg),
                     dbeta=back(d.dbeta[..., None])[..., 0], dinitial=passed.dstart)  # fmt: skip


def chunk_end_state(ops: Any, xp: Any, q, k, v, g, beta, start: Any, *, scale: float, chunk_size: int) -> Any:
    """The state after the inputs from ``start``: the state pass alone, no outputs, no boundaries."""
    B, H, T, K = q.shape
    if T == 0 or B * H == 0:
        return xp.asarray(start, copy=True)
    if ops.chunk_forward_heads is not None:  # the fused forward, neither outputs nor boundaries kept
        return ops.chunk_forward_heads(
            q, k, v, g, beta, start, scale=scale, chunk_size=chunk_size, output=None, boundaries=None
        )
    state = start
    for n0, n1 in slabs(q.shape, chunk_size, max(K, v.shape[-1]), ops.SLAB_ELEMENTS):
        t = _steps(n0, n1, chunk_size, T)
        sliced = (x[:, :, t, ...] for x in (q, k, v, g, beta))
        loc = _prepare(ops, xp, *sliced, scale=scale, chunk_size=chunk_size).local
        state = ops.chunk_state_pass(loc.w, loc.u0, loc.k_suffix, loc.total, state).final_state
    return state


def chunk_state_gradient(
    ops: Any, xp: Any, q, k, v, g, beta, grad_output: Any, *, scale: float, chunk_size: int
) -> Any:
    """The start-state gradient when the end-state gradient is zero, by the state-gradient pass alone.

    Per chunk, from the last: ``dU = A^T dO + k_suffix dS`` and ``dS <- total * dS + qg^T dO - W^T dU``;
    it depends on neither the states nor ``v``, so the pass runs from zero states.
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    dend = xp.zeros((B, H, K, V), dtype=q.dtype, device=q.device)
    if T == 0 or B * H == 0:
        return dend
    C, Cp = chunk_size, padded_chunk_size(chunk_size)
    for n0, n1 in reversed(slabs(q.shape, C, max(K, V), ops.SLAB_ELEMENTS)):
        t = _steps(n0, n1, C, T)
        loc = _prepare(
            ops, xp, *(x[:, :, t, ...] for x in (q, k, v, g, beta)), scale=scale, chunk_size=C
        ).local
        dO = ops.to_chunks(grad_output[:, :, t, ...], chunk_size=C, padded_size=Cp)
        zeros = xp.zeros((n1 - n0, *dend.shape), dtype=dend.dtype, device=dend.device)
        dend = ops.chunk_state_grad_pass(
            loc.w, loc.u0, loc.k_suffix, loc.total, loc.qg, loc.A, dO, zeros, dend
        ).dstart
    return dend
