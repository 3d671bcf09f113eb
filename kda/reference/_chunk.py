"""Array-API reference of the chunked KDA primitives.

Shapes: a chunked array is ``[B, H, NT, Cp, D]``: ``NT`` chunks of ``C`` steps each, padded
with zero rows to ``Cp`` (the next power of two, for the recursive halving of
:mod:`._blocks`). Padding rows carry ``q = k = v = 0``, ``beta = 0`` and ``g = 0``, so they
add nothing and decay nothing. ``...`` stands for the leading ``[B, H, NT]``.

Decay factors follow the numerical contract of ``docs/design.md``: each is a product of
``exp(g)`` over exactly the steps it spans, so every factor lies in ``[0, 1]`` when
``g <= 0``, and ``-inf`` (a hard reset) gives an exact 0 and never a NaN. Factors below
``FLUSH_BELOW`` (``2**-63`` in float32; the pair factors below ``2**-42``) are exact zeros, so
none is subnormal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import array_api_compat
from array_api_compat import array_namespace

from .._backend import ChunkLocal, LocalGradients, StateGradPass, StatePass
from ._blocks import (
    PAIR_FLUSH_BELOW,
    add_halves,
    assemble_lower,
    decay,
    exclusive_cumsum,
    flush,
    half_sizes,
    join_blocks,
    join_halves,
    reverse_cumsum,
    split_halves,
    split_lower,
)

__all__ = [
    "ChunkFactors",
    "chunk_factors",
    "chunk_gate_gradient",
    "chunk_local",
    "chunk_local_backward",
    "chunk_pairs",
    "chunk_pairs_backward",
    "chunk_state_grad_pass",
    "chunk_state_pass",
    "unit_lower_inverse",
]


@dataclass
class ChunkFactors:
    """Gate factors of every chunk.

    Attributes
    ----------
    prefix : ``[..., Cp, K]``, ``prod(exp(g[l]) for l <= i)``: decay from the chunk start to ``i``.
    suffix : ``[..., Cp, K]``, ``prod(exp(g[l]) for l > j)``: decay from ``j`` to the chunk end.
    total : ``[..., K]``, decay over the whole chunk (``prefix[..., -1, :]``).
    qg : ``[..., Cp, K]``, ``scale * q * prefix``.
    kg : ``[..., Cp, K]``, ``k * prefix``.
    k_suffix : ``[..., Cp, K]``, ``k * suffix``.
    private : whatever else the backend keeps for its own :func:`chunk_pairs` and
        :func:`chunk_pairs_backward`; the chunked algorithm never reads it. Here: the factors of
        each halving level, finest first, as ``(rows, cols)`` with one ``[..., nb, h, K]`` array
        per level: for the block split after step ``p``,
        ``rows[i] = prod(exp(g[l]) for p < l <= i)`` over its second half and
        ``cols[j] = prod(exp(g[l]) for j < l <= p)`` over its first half.
    """

    prefix: Any
    suffix: Any
    total: Any
    qg: Any
    kg: Any
    k_suffix: Any
    private: Any = None


def _decay_tree(xp: Any, e: Any) -> tuple[Any, Any, list[Any], list[Any]]:
    """Products of ``e = exp(g)`` within aligned blocks, built level by level.

    With ``I_h[i]`` the product over the steps of ``i``'s aligned block of ``h`` steps up to and
    including ``i`` and ``E_h[j]`` the product over the steps after ``j`` in its block:
    ``I_2h = [I_h, I_h * (whole first half)]`` and ``E_2h = [E_h * (whole second half), E_h]``,
    so each factor is a product over exactly the steps it spans; each product is flushed
    (:func:`~._blocks.flush`; the pair factors at :data:`~._blocks.PAIR_FLUSH_BELOW`), so no
    factor, and no product of two factors and an input, is subnormal. Returns
    ``prefix = I_Cp``, ``suffix = E_Cp`` and, per level, ``rows`` (``I_h`` on second halves) and
    ``cols`` (``E_h`` on first halves).
    """
    I, E = e, xp.ones_like(e)
    rows, cols = [], []
    if array_api_compat.is_numpy_namespace(xp):  # the same products, in place
        for h in half_sizes(e.shape[-2]):
            I5 = I.reshape((*I.shape[:-2], -1, 2, h, I.shape[-1]))
            E5 = E.reshape(I5.shape)
            rows.append(flush(xp, I5[..., 1, :, :].copy(), PAIR_FLUSH_BELOW))
            cols.append(flush(xp, E5[..., 0, :, :].copy(), PAIR_FLUSH_BELOW))
            E5[..., 0, :, :] *= I5[..., 1, -1:, :]
            I5[..., 1, :, :] *= I5[..., 0, -1:, :]
            flush(xp, E5[..., 0, :, :])
            flush(xp, I5[..., 1, :, :])
        return I, E, rows, cols
    for h in half_sizes(e.shape[-2]):
        I_first, I_second = split_halves(xp, I, h)
        E_first, E_second = split_halves(xp, E, h)
        rows.append(flush(xp, I_second, PAIR_FLUSH_BELOW))
        cols.append(flush(xp, E_first, PAIR_FLUSH_BELOW))
        I = join_halves(xp, I_first, flush(xp, I_second * I_first[..., -1:, :]))
        E = join_halves(xp, flush(xp, E_first * I_second[..., -1:, :]), E_second)
    return I, E, rows, cols


def chunk_factors(q: Any, k: Any, g: Any, scale: float) -> ChunkFactors:
    """Decay factors and gated queries and keys of every chunk (``q, k, g: [..., Cp, K]``)."""
    xp = array_namespace(q, k, g)
    prefix, suffix, rows, cols = _decay_tree(xp, decay(xp, g))
    return ChunkFactors(
        prefix=prefix,
        suffix=suffix,
        total=prefix[..., -1, :],
        qg=scale * q * prefix,
        kg=k * prefix,
        k_suffix=k * suffix,
        private=(rows, cols),
    )


def chunk_pairs(q: Any, k: Any, f: ChunkFactors, scale: float) -> tuple[Any, Any]:
    """Decayed pairwise products of every chunk.

    ``A[i, j] = scale * sum_d q[i, d] k[j, d] prod(exp(g[l, d]) for j < l <= i)`` for ``j <= i``,
    ``L[i, j] = sum_d k[i, d] k[j, d] prod(exp(g[l, d]) for j < l <= i)`` for ``j < i``.

    Returns
    -------
    A : ``[..., Cp, Cp]`` lower triangular, diagonal included.
    L : ``[..., Cp, Cp]`` strictly lower triangular.
    """
    xp = array_namespace(q, k)
    qk = xp.stack([scale * q, k], axis=-3)  # [..., 2, Cp, K]: the row sides of A and of L
    levels = []
    for h, rowf, colf in zip(half_sizes(q.shape[-2]), *f.private):
        _, rows = split_halves(xp, qk, h)  # [..., 2, nb, h, K]
        k_first, _ = split_halves(xp, k, h)  # [..., nb, h, K]
        rows = rows * rowf[..., None, :, :, :]
        cols = xp.matrix_transpose(k_first * colf)[..., None, :, :, :]
        levels.append(xp.matmul(rows, cols))  # [..., 2, nb, h, h]
    diagonal = xp.stack([scale * xp.sum(q * k, axis=-1), xp.zeros_like(q[..., 0])], axis=-2)
    AL = assemble_lower(xp, diagonal, levels)  # [..., 2, Cp, Cp]
    return AL[..., 0, :, :], AL[..., 1, :, :]


def unit_lower_inverse(beta: Any, L: Any) -> Any:
    """``(I + diag(beta) L)^-1`` for every chunk, by recursive block inversion.

    ``beta: [..., Cp]``; ``L: [..., Cp, Cp]`` strictly lower triangular (only that triangle is
    read). Returns ``[..., Cp, Cp]``, lower triangular with a unit diagonal:
    ``inv([[X11, 0], [X21, X22]]) = [[T11, 0], [-T22 X21 T11, T22]]``.
    """
    xp = array_namespace(beta, L)
    _, L_levels = split_lower(xp, L)
    blocks = xp.ones_like(beta)[..., None, None]  # [..., Cp, 1, 1]
    for h, L_off in zip(half_sizes(beta.shape[-1]), L_levels):
        _, beta_rows = split_halves(xp, beta[..., None], h)  # [..., nb, h, 1]
        *lead, m, _, _ = blocks.shape
        pairs = xp.reshape(blocks, (*lead, m // 2, 2, h, h))
        t11, t22 = pairs[..., 0, :, :], pairs[..., 1, :, :]
        off = -xp.matmul(xp.matmul(t22, beta_rows * L_off), t11)
        blocks = join_blocks(xp, blocks, off)
    return blocks[..., 0, :, :]


def chunk_local(q: Any, k: Any, v: Any, g: Any, beta: Any, *, scale: float) -> ChunkLocal:
    """Everything of every chunk that does not depend on the state: one fused step.

    ``q, k, g: [..., Cp, K]``, ``v: [..., Cp, V]``, ``beta: [..., Cp]``. The same as
    :func:`chunk_factors`, :func:`chunk_pairs`, :func:`unit_lower_inverse` and the products
    ``[W, U0] = T [diag(beta) kg, diag(beta) v]`` in turn (which is how it is computed here); a
    backend may fuse them (the CUDA backend runs one block per chunk and keeps no factor array).
    """
    xp = array_namespace(q, k, g, v, beta)
    f = chunk_factors(q, k, g, scale)
    A, L = chunk_pairs(q, k, f, scale)
    Minv = unit_lower_inverse(beta, L)
    b = beta[..., None]
    w = xp.matmul(Minv, b * f.kg)
    u0 = xp.matmul(Minv, b * v)
    return ChunkLocal(
        qg=f.qg, kg=f.kg, k_suffix=f.k_suffix, total=f.total, A=A, L=L, Minv=Minv, w=w, u0=u0, private=f
    )


def chunk_local_backward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    boundaries: Any,
    *,
    scale: float,
    local: ChunkLocal,
    dends: Any,
    u: Any,
    du: Any,
    grad_output: Any,
) -> LocalGradients:
    """Gradients of every chunk's state-free work, given its states and the state pass's gradients.

    Parameters
    ----------
    q, k, g : ``[B, H, NT, Cp, K]``; v : ``[B, H, NT, Cp, V]``; beta : ``[B, H, NT, Cp]``.
    boundaries, dends : ``[NT, B, H, K, V]``, the state at the start of each chunk and the
        gradient of the state at its end (:func:`chunk_state_grad_pass`).
    scale : float
    local : :func:`chunk_local` of these chunks.
    u, du, grad_output : ``[B, H, NT, Cp, V]``: ``U``, its gradient, and the output gradient.

    Returns
    -------
    LocalGradients
        ``dq, dk, dg [B, H, NT, Cp, K]``, ``dv [B, H, NT, Cp, V]``, ``dbeta [B, H, NT, Cp]``.
    """
    import sys

    return local_backward(
        sys.modules[__name__],
        q,
        k,
        v,
        g,
        beta,
        boundaries,
        scale=scale,
        local=local,
        dends=dends,
        u=u,
        du=du,
        grad_output=grad_output,
    )


def local_backward(
    ops: Any, q, k, v, g, beta, boundaries, *, scale: float, local: ChunkLocal, dends, u, du, grad_output
) -> LocalGradients:
    """:func:`chunk_local_backward` written with the array API and ``ops``' finer primitives.

    ``ops`` provides :func:`chunk_factors`, :func:`chunk_pairs_backward` and
    :func:`chunk_gate_gradient` (this module, or a backend's own for chunks its fused kernel
    does not take).
    """
    xp = array_namespace(q, k, g, v, beta)
    mT = xp.matrix_transpose
    S = xp.permute_dims(boundaries, (1, 2, 0, 3, 4))
    dS = xp.permute_dims(dends, (1, 2, 0, 3, 4))
    b = beta[..., None]
    dO = grad_output
    # O = qg S + A U and S' = total S + k_suffix^T U
    dqg = xp.matmul(dO, mT(S))
    dA = xp.tril(xp.matmul(dO, mT(u)))
    dk_suffix = xp.matmul(u, mT(dS))
    dtotal = xp.sum(S * dS, axis=-1)
    # U = U0 - W S with W = Minv beta kg, U0 = Minv beta v: gradients of beta kg and beta v
    MinvT = mT(local.Minv)
    dkw = -xp.matmul(MinvT, xp.matmul(du, mT(S)))
    dku = xp.matmul(MinvT, du)
    # Minv = M^-1 with M = I + diag(beta) L, and dMinv = dW (beta kg)^T + dU0 (beta v)^T:
    # dM = -Minv^T dMinv Minv^T = -(dkw W^T + dku U0^T)
    dX = xp.tril(-(xp.matmul(dkw, mT(local.w)) + xp.matmul(dku, mT(local.u0))), k=-1)
    dbeta = xp.sum(dX * local.L, axis=-1) + xp.sum(local.kg * dkw, axis=-1) + xp.sum(v * dku, axis=-1)
    dkg = b * dkw
    f = local.private if isinstance(local.private, ChunkFactors) else ops.chunk_factors(q, k, g, scale)
    dq, dk, dg_pairs = ops.chunk_pairs_backward(dA, b * dX, q, k, f, scale)
    dq = dq + scale * f.prefix * dqg
    dk = dk + f.prefix * dkg + f.suffix * dk_suffix
    dg = ops.chunk_gate_gradient(f.qg * dqg + f.kg * dkg, f.k_suffix * dk_suffix, f.total * dtotal, dg_pairs)
    return LocalGradients(dq=dq, dk=dk, dv=b * dku, dg=dg, dbeta=dbeta)


def chunk_state_pass(
    w: Any, u0: Any, k_suffix: Any, total: Any, state: Any, qg: Any = None, A: Any = None
) -> StatePass:
    """The sequential state recurrence over chunks, with the output fused in.

    For chunk ``n`` with start state ``S``: ``U = u0 - w S``, the output ``O = qg S + A U`` and
    the next state ``total[:, None] * S + k_suffix^T U``.

    Parameters
    ----------
    w : ``[B, H, NT, Cp, K]``; u0 : ``[B, H, NT, Cp, V]``; k_suffix : ``[B, H, NT, Cp, K]``;
    total : ``[B, H, NT, K]``; state : ``[B, H, K, V]``, the state before the first chunk.
    qg : ``[B, H, NT, Cp, K]`` and A : ``[B, H, NT, Cp, Cp]`` (lower triangular; only that
        triangle is read), or both ``None`` for the states alone.

    Returns
    -------
    boundaries : ``[NT, B, H, K, V]``, the state at the start of each chunk.
    output : ``[B, H, NT, Cp, V]``, ``O`` of each chunk, or ``None`` without ``qg`` and ``A``.
    final_state : ``[B, H, K, V]``.
    """
    xp = array_namespace(w, u0, k_suffix, total, state)
    starts, us = [], []
    S = state
    for n in range(w.shape[2]):
        starts.append(S)
        U = u0[:, :, n, ...] - xp.matmul(w[:, :, n, ...], S)
        us.append(U)
        S = total[:, :, n, :, None] * S + xp.matmul(xp.matrix_transpose(k_suffix[:, :, n, ...]), U)
    boundaries = _stack_states(xp, starts, state)
    if qg is None:
        return StatePass(boundaries=boundaries, output=None, final_state=S)
    if not us:
        return StatePass(
            boundaries=boundaries, output=xp.zeros(u0.shape, dtype=u0.dtype, device=u0.device), final_state=S
        )
    # the output of every chunk at once: one batched product each
    by_head = xp.permute_dims(boundaries, (1, 2, 0, 3, 4))
    output = xp.matmul(qg, by_head) + xp.matmul(xp.tril(A), xp.stack(us, axis=2))
    return StatePass(boundaries=boundaries, output=output, final_state=S)


def _stack_states(xp: Any, states: list[Any], like: Any) -> Any:
    """``[NT, B, H, K, V]`` from a list of ``NT`` states (``NT`` may be 0)."""
    if states:
        return xp.stack(states, axis=0)
    return xp.zeros((0, *like.shape), dtype=like.dtype, device=like.device)


def chunk_state_grad_pass(
    w: Any,
    u0: Any,
    k_suffix: Any,
    total: Any,
    qg: Any,
    A: Any,
    grad_output: Any,
    boundaries: Any,
    dfinal: Any,
) -> StateGradPass:
    """The state-gradient recurrence over chunks, last chunk first, with its local terms fused in.

    With ``S`` the state at the start of chunk ``n`` (``boundaries[n]``), ``dO`` its output
    gradient and ``dS`` the gradient of the state at its end: ``U = u0 - w S``,
    ``dU = A^T dO + k_suffix dS`` and the gradient at its start is
    ``total[:, None] * dS + qg^T dO - w^T dU``.

    Parameters
    ----------
    w, k_suffix, qg : ``[B, H, NT, Cp, K]``; u0, grad_output : ``[B, H, NT, Cp, V]``;
    total : ``[B, H, NT, K]``; A : ``[B, H, NT, Cp, Cp]`` (only its lower triangle is read);
    boundaries : ``[NT, B, H, K, V]``; dfinal : ``[B, H, K, V]``, the gradient of the final state.

    Returns
    -------
    dends : ``[NT, B, H, K, V]``, the gradient of the state at the end of each chunk.
    u : ``[B, H, NT, Cp, V]``, the corrected values ``U`` of each chunk (recomputed).
    du : ``[B, H, NT, Cp, V]``, the gradient of ``U``.
    dinitial : ``[B, H, K, V]``, the gradient of the state before the first chunk.
    """
    xp = array_namespace(w, u0, k_suffix, total, qg, A, grad_output, boundaries, dfinal)
    mT = xp.matrix_transpose
    NT = w.shape[2]
    if NT == 0:
        empty = xp.zeros(u0.shape, dtype=u0.dtype, device=u0.device)
        return StateGradPass(dends=_stack_states(xp, [], dfinal), u=empty, du=empty, dstart=dfinal)
    # the local terms of every chunk at once: one batched product each
    u = u0 - xp.matmul(w, xp.permute_dims(boundaries, (1, 2, 0, 3, 4)))
    du_local = xp.matmul(mT(xp.tril(A)), grad_output)
    ds_local = xp.matmul(mT(qg), grad_output)
    ends, dus = [None] * NT, [None] * NT
    dS = dfinal
    for n in reversed(range(NT)):
        ends[n] = dS
        dU = du_local[:, :, n, ...] + xp.matmul(k_suffix[:, :, n, ...], dS)
        dus[n] = dU
        dS = total[:, :, n, :, None] * dS + ds_local[:, :, n, ...] - xp.matmul(mT(w[:, :, n, ...]), dU)
    return StateGradPass(dends=xp.stack(ends, axis=0), u=u, du=xp.stack(dus, axis=2), dstart=dS)


def chunk_pairs_backward(
    dA: Any, dL: Any, q: Any, k: Any, f: ChunkFactors, scale: float
) -> tuple[Any, Any, Any]:
    """Gradients through :func:`chunk_pairs`.

    ``dA, dL: [..., Cp, Cp]`` (only the lower / strictly lower triangles are read). Returns
    ``dq, dk, dg``, each ``[..., Cp, K]``.

    The gate gradient: with ``P[i, j, d]`` the term of pair ``j < i`` in channel ``d`` times its
    upstream gradient, ``dg[l] = sum_{i >= l} sum_{j < l} P[i, j]``, which is the reverse
    cumulative sum of (row sums of ``P``) - (column sums of ``P``). The diagonal (no decay, no
    ``g``) enters neither, so the two sums do not carry a large common term.
    """
    xp = array_namespace(dA, dL, q, k)
    dY_levels = split_lower(xp, xp.stack([scale * dA, dL], axis=-3))[1]  # [..., 2, nb, h, h] each
    qk = xp.stack([q, k], axis=-3)
    dq_rows, dk_rows, dk_cols = xp.zeros_like(q), xp.zeros_like(q), xp.zeros_like(q)
    for h, rowf, colf, dY in zip(half_sizes(q.shape[-2]), *f.private, dY_levels):
        _, x_rows = split_halves(xp, qk, h)  # [..., 2, nb, h, K]
        k_first, _ = split_halves(xp, k, h)  # [..., nb, h, K]
        rowf = rowf[..., None, :, :, :]
        cols = k_first * colf
        if h == 1:  # [1, 1] blocks: the products are broadcasts
            d_rows = dY * cols[..., None, :, :, :] * rowf
            d_cols = xp.sum(dY * (x_rows * rowf), axis=-4) * colf
        else:
            d_rows = xp.matmul(dY, cols[..., None, :, :, :]) * rowf  # gradient of the q, k rows
            d_cols = xp.sum(xp.matmul(xp.matrix_transpose(dY), x_rows * rowf), axis=-4) * colf
        dq_rows = add_halves(xp, dq_rows, None, d_rows[..., 0, :, :, :])
        dk_rows = add_halves(xp, dk_rows, None, d_rows[..., 1, :, :, :])
        dk_cols = add_halves(xp, dk_cols, d_cols, None)
    dg = reverse_cumsum(xp, q * dq_rows + k * (dk_rows - dk_cols))
    d = scale * _diagonal(xp, dA)[..., None]
    return dq_rows + d * k, dk_rows + dk_cols + d * q, dg


def _diagonal(xp: Any, M: Any) -> Any:
    """The diagonal ``[..., Cp]`` of ``M: [..., Cp, Cp]``."""
    if array_api_compat.is_numpy_namespace(xp):
        return xp.diagonal(M, axis1=-2, axis2=-1)
    return xp.sum(M * xp.eye(M.shape[-1], dtype=M.dtype, device=M.device), axis=-1)


def chunk_gate_gradient(prefix_terms: Any, suffix_terms: Any, total_terms: Any, pair_terms: Any) -> Any:
    """Gradient of ``g`` from the gradients of the decay factors.

    Parameters
    ----------
    prefix_terms : ``[..., Cp, K]``, ``prefix * d(prefix)``: each step ``l <= i`` receives row ``i``.
    suffix_terms : ``[..., Cp, K]``, ``suffix * d(suffix)``: each step ``l > j`` receives row ``j``.
    total_terms : ``[..., K]``, ``total * d(total)``: every step of the chunk receives it.
    pair_terms : ``[..., Cp, K]``, the gate gradient of the pairwise terms.
    """
    xp = array_namespace(prefix_terms, suffix_terms, total_terms, pair_terms)
    return (
        reverse_cumsum(xp, prefix_terms)
        + exclusive_cumsum(xp, suffix_terms)
        + total_terms[..., None, :]
        + pair_terms
    )
