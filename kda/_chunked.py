"""The backend-neutral chunked KDA forward and backward.

Written once against the primitive interface that :mod:`kda.reference` (and the CUDA
backend) implement, plus plain array-API glue (matrix products, concatenation, masks) on
the namespace ``xp`` of the inputs. It imports no array library.

Per chunk, with ``S`` the state at its start (see ``design.md``)::

    T  = (I + diag(beta) L)^-1
    W  = T diag(beta) kg            U0 = T diag(beta) v             # state-free
    U  = U0 - W S                                                   # state pass
    O  = qg S + A U
    S' = total * S + kt^T U

Everything but the state pass is done for all chunks at once, so the number of primitive
calls does not grow with the number of chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SLAB_ELEMENTS", "chunk_backward", "chunk_forward", "padded_chunk_size", "slabs"]

# Elements of one ``[B, H, chunks, Cp, max(K, V)]`` array of a slab (see :func:`slabs`).
SLAB_ELEMENTS = 1 << 22


def padded_chunk_size(chunk_size: int) -> int:
    """The next power of two ``>= chunk_size``: chunks are halved recursively."""
    return 1 << (chunk_size - 1).bit_length()


@dataclass
class _Chunks:
    """The state-free part of every chunk, shared by the forward and the backward."""

    q: Any
    k: Any
    v: Any
    beta: Any  # [B, H, NT, Cp, 1]
    f: Any  # ChunkFactors
    A: Any
    L: Any
    Tinv: Any
    kgv: Any  # [kg, v]: [B, H, NT, Cp, K + V]
    kv: Any  # beta * kgv
    w: Any
    u0: Any


def _prepare(ops: Any, xp: Any, q, k, v, g, beta, scale: float, chunk_size: int) -> _Chunks:
    C, Cp = chunk_size, padded_chunk_size(chunk_size)
    K = q.shape[-1]
    qc, kc, gc, vc = (ops.to_chunks(x, C, Cp) for x in (q, k, g, v))
    bc = ops.to_chunks(beta[..., None], C, Cp)
    f = ops.chunk_factors(qc, kc, gc, scale)
    A, L = ops.chunk_pairs(qc, kc, f, scale)
    Tinv = ops.unit_lower_inverse(bc[..., 0], L)
    kgv = xp.concat([f.kg, vc], axis=-1)
    kv = bc * kgv
    wu = xp.matmul(Tinv, kv)
    return _Chunks(qc, kc, vc, bc, f, A, L, Tinv, kgv, kv, wu[..., :K], wu[..., K:])


def _by_head(xp: Any, states: Any) -> Any:
    """``[NT, B, H, K, V]`` -> ``[B, H, NT, K, V]`` (a view)."""
    return xp.permute_dims(states, (1, 2, 0, 3, 4))


def slabs(shape: tuple[int, ...], chunk_size: int, width: int) -> list[tuple[int, int]]:
    """Ranges ``[n0, n1)`` of chunks processed together: the state-free work of one slab holds
    arrays of about ``SLAB_ELEMENTS`` elements, so memory stays bounded as ``T`` grows while the
    number of primitive calls grows only with ``T / slab``, not with the number of chunks."""
    B, H, T = shape[:3]
    NT = -(-T // chunk_size)
    per_chunk = max(1, B * H * padded_chunk_size(chunk_size) * width)
    step = max(1, SLAB_ELEMENTS // per_chunk)
    return [(n, min(n + step, NT)) for n in range(0, NT, step)]


def _steps(n0: int, n1: int, chunk_size: int, T: int) -> slice:
    return slice(n0 * chunk_size, min(n1 * chunk_size, T))


def chunk_forward(
    ops: Any, xp: Any, q, k, v, g, beta, scale: float, state: Any, chunk_size: int
) -> tuple[Any, Any, Any]:
    """Chunked forward on arrays of the compute dtype.

    Returns ``output [B, H, T, V]``, ``final_state [B, H, K, V]`` and
    ``boundaries [NT, B, H, K, V]``.
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    out = xp.zeros((B, H, T, V), dtype=v.dtype, device=v.device)
    if T == 0:
        empty = xp.zeros((0, *state.shape), dtype=state.dtype, device=state.device)
        return out, xp.asarray(state, copy=True), empty
    starts = []
    for n0, n1 in slabs(q.shape, chunk_size, max(K, V)):
        t = _steps(n0, n1, chunk_size, T)
        c = _prepare(ops, xp, *(x[:, :, t, ...] for x in (q, k, v, g, beta)), scale, chunk_size)
        boundaries, U, state = ops.chunk_state_pass(c.w, c.u0, c.f.kt, c.f.total, state)
        O = xp.matmul(c.f.qg, _by_head(xp, boundaries)) + xp.matmul(c.A, U)
        out[:, :, t, :] = ops.from_chunks(O, chunk_size, t.stop - t.start)
        starts.append(boundaries)
    return out, state, starts[0] if len(starts) == 1 else xp.concat(starts, axis=0)


def chunk_backward(
    ops: Any,
    xp: Any,
    q,
    k,
    v,
    g,
    beta,
    scale: float,
    state: Any,
    boundaries: Any | None,
    grad_output: Any,
    grad_state: Any,
    chunk_size: int,
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """Chunked backward on arrays of the compute dtype.

    ``boundaries`` are the chunk-start states of the forward, or ``None`` to recompute them
    from ``state``. Returns the gradients of ``q, k, v, g, beta`` and of the initial state.
    """
    T = q.shape[2]
    grads = [xp.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, g, beta)]
    if T == 0:
        return (*grads, xp.asarray(grad_state, copy=True))
    if boundaries is None:
        boundaries = _boundaries(ops, xp, q, k, v, g, beta, scale, state, chunk_size)
    dstate = grad_state
    for n0, n1 in reversed(slabs(q.shape, chunk_size, max(q.shape[-1], v.shape[-1]))):
        t = _steps(n0, n1, chunk_size, T)
        inputs = (x[:, :, t, ...] for x in (q, k, v, g, beta))
        slab_grads, dstate = _backward_slab(
            ops, xp, *inputs, scale, boundaries[n0:n1, ...], grad_output[:, :, t, ...], dstate, chunk_size
        )
        for acc, x in zip(grads, slab_grads, strict=True):
            acc[:, :, t, ...] = x
    return (*grads, dstate)


def _boundaries(ops: Any, xp: Any, q, k, v, g, beta, scale: float, state: Any, chunk_size: int) -> Any:
    """The chunk-start states, recomputed slab by slab (the backward given no boundaries)."""
    starts = []
    T = q.shape[2]
    for n0, n1 in slabs(q.shape, chunk_size, max(q.shape[-1], v.shape[-1])):
        t = _steps(n0, n1, chunk_size, T)
        c = _prepare(ops, xp, *(x[:, :, t, ...] for x in (q, k, v, g, beta)), scale, chunk_size)
        boundaries, _, state = ops.chunk_state_pass(c.w, c.u0, c.f.kt, c.f.total, state)
        starts.append(boundaries)
    return starts[0] if len(starts) == 1 else xp.concat(starts, axis=0)


def _backward_slab(
    ops: Any, xp: Any, q, k, v, g, beta, scale: float, boundaries: Any, grad_output: Any, dstate: Any, C: int
) -> tuple[list[Any], Any]:
    """Gradients of one slab of chunks; ``dstate`` is the gradient of the state at its end."""
    T, K = q.shape[2], q.shape[-1]
    c = _prepare(ops, xp, q, k, v, g, beta, scale, C)
    f = c.f
    S = _by_head(xp, boundaries)
    U = c.u0 - xp.matmul(c.w, S)
    dO = ops.to_chunks(grad_output, C, padded_chunk_size(C))
    mT = xp.matrix_transpose

    # the state-gradient recurrence: the only sequential part
    dends, dU, dstate = ops.chunk_state_grad_pass(
        c.w, f.kt, f.total, xp.matmul(mT(c.A), dO), xp.matmul(mT(f.qg), dO), dstate
    )
    dS = _by_head(xp, dends)

    # O = qg S + A U and S' = total S + kt^T U
    dqg = xp.matmul(dO, mT(S))
    dA = xp.tril(xp.matmul(dO, mT(U)))
    dkt = xp.matmul(U, mT(dS))
    dtotal = xp.sum(S * dS, axis=-1)
    # U = U0 - W S with [W, U0] = T [beta kg, beta v]
    dwu = xp.concat([-xp.matmul(dU, mT(S)), dU], axis=-1)
    dT = xp.matmul(dwu, mT(c.kv))
    dkv = xp.matmul(mT(c.Tinv), dwu)  # gradient of beta * [kg, v]
    # T = X^-1 with X = I + diag(beta) L
    dX = xp.tril(-xp.matmul(xp.matmul(mT(c.Tinv), dT), mT(c.Tinv)), k=-1)
    dL = c.beta * dX
    dbeta = xp.sum(dX * c.L, axis=-1) + xp.sum(c.kgv * dkv, axis=-1)
    dkgv = c.beta * dkv
    dkg, dv = dkgv[..., :K], dkgv[..., K:]
    dq, dk, dg_pairs = ops.chunk_pairs_backward(dA, dL, c.q, c.k, f, scale)
    dq = dq + scale * f.prefix * dqg
    dk = dk + f.prefix * dkg + f.suffix * dkt
    dg = ops.chunk_gate_gradient(f.qg * dqg + f.kg * dkg, f.kt * dkt, f.total * dtotal, dg_pairs)

    grads = [ops.from_chunks(x, C, T) for x in (dq, dk, dv, dg)]
    return [*grads, ops.from_chunks(dbeta[..., None], C, T)[..., 0]], dstate
