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

__all__ = ["chunk_backward", "chunk_forward", "padded_chunk_size"]


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


def chunk_forward(
    ops: Any, xp: Any, q, k, v, g, beta, scale: float, state: Any, chunk_size: int
) -> tuple[Any, Any, Any]:
    """Chunked forward on arrays of the compute dtype.

    Returns ``output [B, H, T, V]``, ``final_state [B, H, K, V]`` and
    ``boundaries [NT, B, H, K, V]``.
    """
    T = q.shape[2]
    if T == 0:
        B, H, _, V = v.shape
        empty = xp.zeros((0, *state.shape), dtype=state.dtype, device=state.device)
        out = xp.zeros((B, H, 0, V), dtype=v.dtype, device=v.device)
        return out, xp.asarray(state, copy=True), empty
    c = _prepare(ops, xp, q, k, v, g, beta, scale, chunk_size)
    boundaries, U, final = ops.chunk_state_pass(c.w, c.u0, c.f.kt, c.f.total, state)
    O = xp.matmul(c.f.qg, _by_head(xp, boundaries)) + xp.matmul(c.A, U)
    return ops.from_chunks(O, chunk_size, T), final, boundaries


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
    if T == 0:
        empty = [xp.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, g, beta)]
        return (*empty, xp.asarray(grad_state, copy=True))
    K = q.shape[-1]
    C, Cp = chunk_size, padded_chunk_size(chunk_size)
    c = _prepare(ops, xp, q, k, v, g, beta, scale, chunk_size)
    f = c.f
    if boundaries is None:
        boundaries, U, _ = ops.chunk_state_pass(c.w, c.u0, f.kt, f.total, state)
    S = _by_head(xp, boundaries)
    if boundaries is not None:
        U = c.u0 - xp.matmul(c.w, S)
    dO = ops.to_chunks(grad_output, C, Cp)
    mT = xp.matrix_transpose

    # the state-gradient recurrence: the only sequential part
    dends, dU, dstate = ops.chunk_state_grad_pass(
        c.w, f.kt, f.total, xp.matmul(mT(c.A), dO), xp.matmul(mT(f.qg), dO), grad_state
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
    return (*grads, ops.from_chunks(dbeta[..., None], C, T)[..., 0], dstate)
