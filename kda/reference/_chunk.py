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

from array_api_compat import array_namespace

from ._blocks import (
    assemble_lower,
    exclusive_cumsum,
    exclusive_suffix_prod,
    half_sizes,
    join_blocks,
    join_halves,
    reverse_cumsum,
    small_product,
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


def chunk_factors(q: Any, k: Any, g: Any, scale: float) -> ChunkFactors:
    """Decay factors and gated queries and keys of every chunk (``q, k, g: [..., Cp, K]``)."""
    xp = array_namespace(q, k, g)
    e = xp.exp(g)
    prefix = xp.cumulative_prod(e, axis=-2)
    suffix = exclusive_suffix_prod(xp, e)
    rows, cols = [], []
    for h in half_sizes(g.shape[-2]):
        first, second = split_halves(xp, e, h)
        rows.append(xp.cumulative_prod(second, axis=-2))
        cols.append(exclusive_suffix_prod(xp, first))
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
    qk = xp.stack([q, k], axis=-3)  # [..., 2, Cp, K]: row side of A and of L
    A_levels, L_levels = [], []
    for h, rowf, colf in zip(half_sizes(q.shape[-2]), *f.private):
        _, rows = split_halves(xp, qk, h)  # [..., 2, nb, h, K]
        k_first, _ = split_halves(xp, k, h)  # [..., nb, h, K]
        rows = rows * rowf[..., None, :, :, :]
        cols = xp.matrix_transpose(k_first * colf)[..., None, :, :, :]
        blocks = small_product(xp, rows, cols)  # [..., 2, nb, h, h]
        A_levels.append(blocks[..., 0, :, :, :])
        L_levels.append(blocks[..., 1, :, :, :])
    A = scale * assemble_lower(xp, xp.sum(q * k, axis=-1), A_levels)
    L = assemble_lower(xp, xp.zeros_like(q[..., 0]), L_levels)
    return A, L


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
        off = -small_product(xp, small_product(xp, t22, beta_rows * L_off), t11)
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
    ``dq, dk, dg``, each ``[..., Cp, K]``. The gate gradient of each off-diagonal block is taken
    inside that block, over the steps its factors span, so nothing cancels.
    """
    xp = array_namespace(dA, dL, q, k)
    dA_diag, dA_levels = split_lower(xp, dA)
    _, dL_levels = split_lower(xp, dL)
    d = scale * dA_diag[..., None]
    dq, dk = d * k, d * q
    dg = xp.zeros_like(q)
    qk = xp.stack([q, k], axis=-3)
    levels = zip(half_sizes(q.shape[-2]), *f.private, dA_levels, dL_levels)
    for h, rowf, colf, dA_off, dL_off in levels:
        _, x_rows = split_halves(xp, qk, h)  # [..., 2, nb, h, K]
        k_first, _ = split_halves(xp, k, h)  # [..., nb, h, K]
        rowf = rowf[..., None, :, :, :]
        rows = x_rows * rowf
        cols = k_first * colf
        dY = xp.stack([scale * dA_off, dL_off], axis=-4)  # [..., 2, nb, h, h]
        d_rows = small_product(xp, dY, cols[..., None, :, :, :])  # [..., 2, nb, h, K]
        d_cols = xp.sum(small_product(xp, xp.matrix_transpose(dY), rows), axis=-4)
        dx_rows = d_rows * rowf  # gradient of the q and k rows
        dk_cols = d_cols * colf
        zero = xp.zeros_like(dk_cols)
        dq = dq + join_halves(xp, zero, dx_rows[..., 0, :, :, :])
        dk = dk + join_halves(xp, dk_cols, dx_rows[..., 1, :, :, :])
        # sum_j P[i, j] over the row side, sum_i P[i, j] over the column side
        row_terms = xp.sum(rows * d_rows, axis=-4)
        col_terms = cols * d_cols
        dg = dg + join_halves(xp, exclusive_cumsum(xp, col_terms), reverse_cumsum(xp, row_terms))
    return dq, dk, dg


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
