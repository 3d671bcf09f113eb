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


@dataclass
class _Chunks:
    """The inputs of a slab as chunks, and their state-free work (shared by forward and backward)."""

    q: Any
    k: Any
    g: Any
    v: Any
    beta: Any  # [B, H, NT, Cp]
    local: Any  # ChunkLocal: qg, kg, k_suffix, total, A, L, Minv, w, u0


def _prepare(ops: Any, xp: Any, q, k, v, g, beta, scale: float, chunk_size: int) -> _Chunks:
    C, Cp = chunk_size, padded_chunk_size(chunk_size)
    qc, kc, gc, vc = (ops.to_chunks(x, C, Cp) for x in (q, k, g, v))
    bc = ops.to_chunks(beta[..., None], C, Cp)[..., 0]
    return _Chunks(qc, kc, gc, vc, bc, ops.chunk_local(qc, kc, gc, vc, bc, scale))


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
    workers = ops.workers(xp, B * H)
    axis, n = (1, H) if H >= workers or H >= B else (0, B)
    workers = min(workers, n)
    if workers <= 1:
        return 1, [slice(None)]
    edges = [n * i // workers for i in range(workers + 1)]
    return axis, [slice(a, b) for a, b in itertools.pairwise(edges)]


def _run_groups(ops: Any, groups: list[slice], task) -> list[Any]:
    """``task(group)`` for every group, concurrently when there is more than one."""
    if len(groups) == 1:
        return [task(groups[0])]
    from concurrent.futures import ThreadPoolExecutor

    # each group runs in a copy of the caller's context, so context-local settings (NumPy's
    # errstate, for one) hold in the workers as they do in the caller
    contexts = [contextvars.copy_context() for _ in groups]
    with ops.worker_context(), ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(lambda ctx, group: ctx.run(task, group), contexts, groups))


def _index(axis: int, group: slice) -> tuple[slice, ...]:
    return (*(slice(None),) * axis, group, ...)


def _writable(x: Any) -> bool:
    import array_api_compat

    return bool(array_api_compat.is_writeable_array(x))


def chunk_forward(
    ops: Any, xp: Any, q, k, v, g, beta, scale: float, state: Any, chunk_size: int, *, out: Any = None,
    keep: bool = True, screen: Any = None,
) -> tuple[Any, Any, Any]:  # fmt: skip
    """Chunked forward on arrays of the compute dtype.

    Returns ``output [B, H, T, V]``, ``final_state [B, H, K, V]`` and
    ``boundaries [NT, B, H, K, V]`` (None from the fused pass with ``keep=False``: a forward
    that keeps no boundaries writes none). ``screen``: a zeroed float64 ``[B * H, 2]`` array that
    the fused pass fills (see the backend's ``chunk_forward_heads``). ``out``, when given, is a
    triple of caller-owned writable buffers of those shapes (compute dtype) that receive the
    results in place and are returned: then nothing is allocated whose size grows with ``T``
    beyond one slab's work.
    """
    B, H, T, _ = q.shape
    V = v.shape[-1]
    NT = -(-T // chunk_size)
    if out is None:
        fill = xp.empty if ops.chunk_forward_heads is not None else xp.zeros  # fused: every row written
        o = fill((B, H, T, V), dtype=v.dtype, device=v.device)
        final_buf = boundaries = None
    else:
        o, final_buf, boundaries = out
    if T == 0 or B * H == 0:  # nothing to compute: no steps, or no heads
        if out is None:
            empty = xp.zeros((NT, *state.shape), dtype=state.dtype, device=state.device)
            return o, xp.asarray(state, copy=True), empty
        final_buf[...] = state
        return out
    if ops.chunk_forward_heads is not None and _writable(o):
        if out is None and keep:
            boundaries = xp.empty((NT, *state.shape), dtype=state.dtype, device=state.device)
        final = ops.chunk_forward_heads(
            q, k, v, g, beta, scale, state, chunk_size, output=o, boundaries=boundaries, screen=screen
        )
        if out is None:
            return o, final, boundaries
        final_buf[...] = final
        return out
    axis, groups = _head_groups(ops, xp, q.shape)
    if not _writable(o):
        axis, groups = 1, [slice(None)]

    def task(group: slice) -> tuple[Any, Any, Any]:
        i = _index(axis, group)
        inputs = [x[i] for x in (q, k, v, g, beta)]
        into = None if boundaries is None else boundaries[(slice(None), *i)]
        result = _forward_heads(ops, xp, *inputs, scale, state[i], chunk_size, out=o[i], boundaries_buf=into)
        if final_buf is not None:
            final_buf[i] = result[0]
        return result

    results = _run_groups(ops, groups, task)
    if out is not None:
        return out
    if len(results) == 1:
        return o if _writable(o) else results[0][2], results[0][0], results[0][1]
    final = xp.concat([r[0] for r in results], axis=axis)
    boundaries = xp.concat([r[1] for r in results], axis=axis + 1)
    return o, final, boundaries


def _forward_heads(
    ops: Any,
    xp: Any,
    q,
    k,
    v,
    g,
    beta,
    scale: float,
    state: Any,
    C: int,
    *,
    out: Any,
    boundaries_buf: Any = None,
) -> tuple[Any, Any, Any]:
    """Forward of a group of heads, slab by slab; writes ``out`` where it can.

    ``out=None`` asks for the states only (the backward's recomputed boundaries): no output is formed.
    ``boundaries_buf``, when given, is a ``[NT, ...]`` buffer that receives the chunk-start states slab by
    slab (and is returned as the boundaries) instead of concatenating them.
    """
    T = q.shape[2]
    parts, outs = [], []  # the slabs' boundaries (without boundaries_buf), outputs
    for n0, n1 in slabs(q.shape, C, max(q.shape[-1], v.shape[-1]), ops.SLAB_ELEMENTS):
        t = _steps(n0, n1, C, T)
        c = _prepare(ops, xp, *(x[:, :, t, ...] for x in (q, k, v, g, beta)), scale, C)
        loc = c.local
        dense = () if out is None else (loc.qg, loc.A)  # the output O = qg S + A U, fused in
        boundaries, O, state = ops.chunk_state_pass(loc.w, loc.u0, loc.k_suffix, loc.total, state, *dense)
        if boundaries_buf is None:
            parts.append(boundaries)
        else:
            boundaries_buf[n0:n1, ...] = boundaries
        if out is None:
            continue
        O = ops.from_chunks(O, C, t.stop - t.start)
        if _writable(out):
            out[:, :, t, :] = O
        else:
            outs.append(O)
    if boundaries_buf is not None:
        boundaries = boundaries_buf
    else:
        boundaries = parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)
    return state, boundaries, (xp.concat(outs, axis=2) if outs else out)


def chunk_backward(
    ops: Any, xp: Any, q, k, v, g, beta, scale: float, state: Any, boundaries: Any | None, *,
    grad_output: Any, dfinal: Any, chunk_size: int, out: Any = None, screen: Any = None,
) -> tuple[Any, Any, Any, Any, Any, Any]:  # fmt: skip
    """Chunked backward on arrays of the compute dtype.

    ``boundaries`` are the chunk-start states of the forward, or ``None`` to recompute them
    from ``state``; ``dfinal`` is the final state's gradient. Returns the gradients of
    ``q, k, v, g, beta`` and of the initial state.
    ``screen``: as for :func:`chunk_forward`, filled by the fused backward pass.
    ``out``, when given, is a tuple of caller-owned writable buffers (compute dtype) for those
    six gradients, optionally followed by a ``[NT, B, H, K, V]`` workspace that receives the
    recomputed boundaries when ``boundaries`` is None; the gradients are written in place and
    the six buffers returned.
    """
    T = q.shape[2]
    if out is None:
        fill = xp.empty if ops.chunk_backward_heads is not None else xp.zeros  # fused: every row written
        grads = [fill(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, g, beta)]
        dinitial_buf = workspace = None
    else:
        grads, dinitial_buf = list(out[:5]), out[5]
        workspace = out[6] if len(out) > 6 else None
    if T == 0 or q.shape[0] * q.shape[1] == 0:  # nothing to compute: no steps, or no heads
        if out is None:
            return (*grads, xp.asarray(dfinal, copy=True))
        dinitial_buf[...] = dfinal
        return tuple(out[:6])
    if ops.chunk_backward_heads is not None and _writable(grads[0]):
        return _backward_fused(ops, xp, q, k, v, g, beta, scale, state, boundaries, grad_output=grad_output,
                               dfinal=dfinal, chunk_size=chunk_size, grads=grads, dinitial=dinitial_buf,
                               workspace=workspace, screen=screen)  # fmt: skip
    axis, groups = _head_groups(ops, xp, q.shape)
    if not _writable(grads[0]):
        axis, groups = 1, [slice(None)]

    def task(group: slice) -> tuple[Any, list[Any]]:
        i = _index(axis, group)
        inputs = [x[i] for x in (q, k, v, g, beta)]
        if boundaries is None:
            ws = None if workspace is None else workspace[(slice(None), *i)]
            group_boundaries = _forward_heads(
                ops, xp, *inputs, scale, state[i], chunk_size, out=None, boundaries_buf=ws
            )[1]
        else:
            group_boundaries = boundaries[(slice(None), *i)]
        result = _backward_heads(
            ops, xp, *inputs, scale, group_boundaries, grad_output=grad_output[i], dfinal=dfinal[i],
            chunk_size=chunk_size, grads=[x[i] for x in grads],
        )  # fmt: skip
        if dinitial_buf is not None:
            dinitial_buf[i] = result[0]
        return result

    results = _run_groups(ops, groups, task)
    if out is not None:
        return tuple(out[:6])
    if len(results) == 1:
        return (*results[0][1], results[0][0])
    return (*grads, xp.concat([r[0] for r in results], axis=axis))


def _backward_fused(
    ops: Any, xp: Any, q, k, v, g, beta, scale: float, state: Any, boundaries: Any, *, grad_output: Any,
    dfinal: Any, chunk_size: int, grads: list[Any], dinitial: Any, workspace: Any, screen: Any = None,
) -> tuple[Any, ...]:  # fmt: skip
    """The backward through the backend's fused passes (boundaries recomputed when None);
    ``dinitial``: the initial state's gradient's buffer, or None."""
    C = chunk_size
    if boundaries is None:
        NT = -(-q.shape[2] // C)
        if workspace is None:
            workspace = xp.empty((NT, *state.shape), dtype=state.dtype, device=state.device)
        ops.chunk_forward_heads(q, k, v, g, beta, scale, state, C, output=None, boundaries=workspace)
        boundaries = workspace
    if dinitial is None:
        dinitial = xp.empty(dfinal.shape, dtype=dfinal.dtype, device=dfinal.device)
    ops.chunk_backward_heads(
        q, k, v, g, beta, scale, boundaries, grad_output, dfinal, C, grads=[*grads, dinitial], screen=screen
    )
    return (*grads, dinitial)


def _backward_heads(
    ops: Any, xp: Any, q, k, v, g, beta, scale: float, boundaries, *, grad_output, dfinal, chunk_size: int,
    grads,
) -> tuple[Any, list[Any]]:  # fmt: skip
    """Backward of a group of heads, slab by slab from the last; writes ``grads`` where it can.
    Returns the initial state's gradient and the gradients."""
    T, C, dend = q.shape[2], chunk_size, dfinal  # the gradient of the state at a slab's end
    collected = []
    for n0, n1 in reversed(slabs(q.shape, C, max(q.shape[-1], v.shape[-1]), ops.SLAB_ELEMENTS)):
        t = _steps(n0, n1, C, T)
        inputs = (x[:, :, t, ...] for x in (q, k, v, g, beta))
        slab_grads, dend = _backward_slab(
            ops, xp, *inputs, scale, boundaries[n0:n1, ...], grad_output=grad_output[:, :, t, ...],
            dfinal=dend, chunk_size=C,
        )  # fmt: skip
        if _writable(grads[0]):
            for acc, x in zip(grads, slab_grads, strict=True):
                acc[:, :, t, ...] = x
        else:
            collected.append(slab_grads)
    if collected:
        grads = [xp.concat(parts[::-1], axis=2) for parts in zip(*collected, strict=True)]
    return dend, grads


def _backward_slab(
    ops: Any, xp: Any, q, k, v, g, beta, scale: float, boundaries: Any, *, grad_output: Any, dfinal: Any,
    chunk_size: int,
) -> tuple[list[Any], Any]:  # fmt: skip
    """Gradients of one slab of chunks; ``dfinal`` is the gradient of the state at its end; returns
    them and the gradient of the state at its start.

    Three primitives: the state-free work again, the state-gradient recurrence (which also
    recomputes ``U`` and forms ``A^T dO`` and ``qg^T dO``), and the gradients of the state-free
    work given the states and their gradients.
    """
    T, C = q.shape[2], chunk_size
    c = _prepare(ops, xp, q, k, v, g, beta, scale, C)
    loc = c.local
    dO = ops.to_chunks(grad_output, C, padded_chunk_size(C))
    dends, U, dU, dstart = ops.chunk_state_grad_pass(
        loc.w, loc.u0, loc.k_suffix, loc.total, loc.qg, loc.A, dO, boundaries, dfinal
    )
    dq, dk, dv, dg, dbeta = ops.chunk_local_backward(
        c.q, c.k, c.g, c.v, c.beta, scale, loc, boundaries, dends=dends, u=U, du=dU, grad_output=dO
    )
    grads = [ops.from_chunks(x, C, T) for x in (dq, dk, dv, dg)]
    return [*grads, ops.from_chunks(dbeta[..., None], C, T)[..., 0]], dstart


def chunk_end_state(ops: Any, xp: Any, q, k, v, g, beta, scale: float, start: Any, chunk_size: int) -> Any:
    """The state after the inputs from ``start``: the state pass alone, no outputs, no boundaries."""
    B, H, T, K = q.shape
    if T == 0 or B * H == 0:
        return xp.asarray(start, copy=True)
    if ops.chunk_forward_heads is not None:  # the fused forward, neither outputs nor boundaries kept
        return ops.chunk_forward_heads(
            q, k, v, g, beta, scale, start, chunk_size, output=None, boundaries=None
        )
    state = start
    for n0, n1 in slabs(q.shape, chunk_size, max(K, v.shape[-1]), ops.SLAB_ELEMENTS):
        t = _steps(n0, n1, chunk_size, T)
        loc = _prepare(ops, xp, *(x[:, :, t, ...] for x in (q, k, v, g, beta)), scale, chunk_size).local
        state = ops.chunk_state_pass(loc.w, loc.u0, loc.k_suffix, loc.total, state)[2]
    return state


def chunk_state_gradient(
    ops: Any, xp: Any, q, k, v, g, beta, scale: float, grad_output: Any, chunk_size: int
):
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
        loc = _prepare(ops, xp, *(x[:, :, t, ...] for x in (q, k, v, g, beta)), scale, C).local
        dO = ops.to_chunks(grad_output[:, :, t, ...], C, Cp)
        zeros = xp.zeros((n1 - n0, *dend.shape), dtype=dend.dtype, device=dend.device)
        dend = ops.chunk_state_grad_pass(
            loc.w, loc.u0, loc.k_suffix, loc.total, loc.qg, loc.A, dO, zeros, dend
        )[3]
    return dend
