"""Array-API reference of the chunked KDA primitives.

Shapes: a chunked array is ``[B, H, NT, Cp, D]``: ``NT`` chunks of ``C`` steps each, padded
with zero rows to ``Cp`` (the next power of two, for the recursive halving of
:mod:`._blocks`). Padding rows carry ``q = k = v = 0``, ``beta = 0`` and ``g = 0``, so they
add nothing and decay nothing. ``...`` stands for the leading ``[B, H, NT]``.

Decay factors follow the numerical contract of ``design.md``: each is a product of
``exp(g)`` over exactly the steps it spans, so every factor lies in ``[0, 1]`` when
``g <= 0``, and ``-inf`` (a hard reset) gives an exact 0 and never a NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import array_api_compat
from array_api_compat import array_namespace

from ._blocks import (
    add_halves,
    assemble_lower,
    exclusive_cumsum,
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
    "chunk_pairs",
    "chunk_pairs_backward",
    "chunk_state_grad_pass",
    "chunk_state_pass",
    "from_chunks",
    "to_chunks",
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
    kt : ``[..., Cp, K]``, ``k * suffix``.
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
    kt: Any
    private: Any = None


def to_chunks(x: Any, chunk_size: int, padded_size: int) -> Any:
    """``[B, H, T, D]`` -> ``[B, H, NT, Cp, D]``, zero-padded in time and within each chunk."""
    xp = array_namespace(x)
    B, H, T, D = x.shape
    C, Cp = chunk_size, padded_size
    NT = -(-T // C)
    if NT * C > T:
        x = xp.concat([x, xp.zeros((B, H, NT * C - T, D), dtype=x.dtype, device=x.device)], axis=2)
    x = xp.reshape(x, (B, H, NT, C, D))
    if Cp > C:
        x = xp.concat([x, xp.zeros((B, H, NT, Cp - C, D), dtype=x.dtype, device=x.device)], axis=3)
    return x


def from_chunks(x: Any, chunk_size: int, length: int) -> Any:
    """Inverse of :func:`to_chunks`: ``[B, H, NT, Cp, D]`` -> ``[B, H, T, D]`` with ``T = length``."""
    xp = array_namespace(x)
    B, H, NT, _, D = x.shape
    x = xp.reshape(x[..., :chunk_size, :], (B, H, NT * chunk_size, D))
    return x[:, :, :length, :]


def _decay_tree(xp: Any, e: Any) -> tuple[Any, Any, list[Any], list[Any]]:
    """Products of ``e = exp(g)`` within aligned blocks, built level by level.

    With ``I_h[i]`` the product over the steps of ``i``'s aligned block of ``h`` steps up to and
    including ``i`` and ``E_h[j]`` the product over the steps after ``j`` in its block:
    ``I_2h = [I_h, I_h * (whole first half)]`` and ``E_2h = [E_h * (whole second half), E_h]``,
    so each factor is a product over exactly the steps it spans. Returns
    ``prefix = I_Cp``, ``suffix = E_Cp`` and, per level, ``rows`` (``I_h`` on second halves) and
    ``cols`` (``E_h`` on first halves).
    """
    I, E = e, xp.ones_like(e)
    rows, cols = [], []
    if array_api_compat.is_numpy_namespace(xp):  # the same products, in place
        for h in half_sizes(e.shape[-2]):
            I5 = I.reshape((*I.shape[:-2], -1, 2, h, I.shape[-1]))
            E5 = E.reshape(I5.shape)
            rows.append(I5[..., 1, :, :].copy())
            cols.append(E5[..., 0, :, :].copy())
            E5[..., 0, :, :] *= I5[..., 1, -1:, :]
            I5[..., 1, :, :] *= I5[..., 0, -1:, :]
        return I, E, rows, cols
    for h in half_sizes(e.shape[-2]):
        I_first, I_second = split_halves(xp, I, h)
        E_first, E_second = split_halves(xp, E, h)
        rows.append(I_second)
        cols.append(E_first)
        I = join_halves(xp, I_first, I_second * I_first[..., -1:, :])
        E = join_halves(xp, E_first * I_second[..., -1:, :], E_second)
    return I, E, rows, cols


def chunk_factors(q: Any, k: Any, g: Any, scale: float) -> ChunkFactors:
    """Decay factors and gated queries and keys of every chunk (``q, k, g: [..., Cp, K]``)."""
    xp = array_namespace(q, k, g)
    prefix, suffix, rows, cols = _decay_tree(xp, xp.exp(g))
    return ChunkFactors(
        prefix=prefix,
        suffix=suffix,
        total=prefix[..., -1, :],
        qg=scale * q * prefix,
        kg=k * prefix,
        kt=k * suffix,
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


def chunk_state_pass(w: Any, u0: Any, kt: Any, total: Any, state: Any) -> tuple[Any, Any, Any]:
    """The sequential state recurrence over chunks.

    For chunk ``n`` with start state ``S``: ``U = u0 - w S`` and the next state is
    ``total[:, None] * S + kt^T U``.

    Parameters
    ----------
    w : ``[B, H, NT, Cp, K]``; u0 : ``[B, H, NT, Cp, V]``; kt : ``[B, H, NT, Cp, K]``;
    total : ``[B, H, NT, K]``; state : ``[B, H, K, V]``, the state before the first chunk.

    Returns
    -------
    boundaries : ``[NT, B, H, K, V]``, the state at the start of each chunk.
    u : ``[B, H, NT, Cp, V]``, the corrected values ``U`` of each chunk.
    final_state : ``[B, H, K, V]``.
    """
    xp = array_namespace(w, u0, kt, total, state)
    starts, us = [], []
    S = state
    for n in range(w.shape[2]):
        starts.append(S)
        U = u0[:, :, n, ...] - xp.matmul(w[:, :, n, ...], S)
        us.append(U)
        S = total[:, :, n, :, None] * S + xp.matmul(xp.matrix_transpose(kt[:, :, n, ...]), U)
    return xp.stack(starts, axis=0), xp.stack(us, axis=2), S


def chunk_state_grad_pass(
    w: Any, kt: Any, total: Any, du_local: Any, ds_local: Any, dstate: Any
) -> tuple[Any, Any, Any]:
    """The state-gradient recurrence over chunks, last chunk first.

    With ``dS`` the gradient of the state at the end of chunk ``n``:
    ``dU = du_local + kt dS`` and the gradient at its start is
    ``total[:, None] * dS + ds_local - w^T dU``.

    Parameters
    ----------
    w, kt : ``[B, H, NT, Cp, K]``; total : ``[B, H, NT, K]``;
    du_local : ``[B, H, NT, Cp, V]`` (``A^T dO``); ds_local : ``[B, H, NT, K, V]`` (``qg^T dO``);
    dstate : ``[B, H, K, V]``, the gradient of the final state.

    Returns
    -------
    dends : ``[NT, B, H, K, V]``, the gradient of the state at the end of each chunk.
    du : ``[B, H, NT, Cp, V]``, the gradient of ``U``.
    dinitial : ``[B, H, K, V]``, the gradient of the state before the first chunk.
    """
    xp = array_namespace(w, kt, total, du_local, ds_local, dstate)
    ends, dus = [], []
    dS = dstate
    for n in reversed(range(w.shape[2])):
        ends.append(dS)
        dU = du_local[:, :, n, ...] + xp.matmul(kt[:, :, n, ...], dS)
        dus.append(dU)
        dS = (
            total[:, :, n, :, None] * dS
            + ds_local[:, :, n, ...]
            - xp.matmul(xp.matrix_transpose(w[:, :, n, ...]), dU)
        )
    ends.reverse()
    dus.reverse()
    return xp.stack(ends, axis=0), xp.stack(dus, axis=2), dS


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
