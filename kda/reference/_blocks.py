"""Hierarchical block layout of a chunk's lower-triangular ``[Cp, Cp]`` matrices.

A chunk of ``Cp = 2**m`` steps is halved recursively. At the level with half-size
``h`` (``h = 1, 2, 4, ..., Cp/2``) the chunk is cut into ``nb = Cp / (2h)`` blocks of
``2h`` steps; in each block the *first half* (``h`` steps) is the column side and the
*second half* (``h`` steps) the row side of one off-diagonal ``[h, h]`` block. Every
strictly-lower entry of a ``[Cp, Cp]`` matrix lies in exactly one such block, so a
lower-triangular matrix is its diagonal plus one ``[..., nb, h, h]`` array per level.

These helpers only move data: split a ``[..., Cp, D]`` array into halves, assemble a
lower-triangular matrix from its levels, and split one back into levels.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "assemble_lower",
    "exclusive_cumsum",
    "exclusive_suffix_prod",
    "half_sizes",
    "join_blocks",
    "join_halves",
    "reverse_cumsum",
    "small_product",
    "split_halves",
    "split_lower",
]

# Products of ``[h, K] x [K, h]`` blocks with ``h`` at most this are formed element-wise:
# a batched BLAS call per tiny block costs more than the arithmetic.
SMALL_BLOCK = 4


def half_sizes(Cp: int) -> list[int]:
    """Half-sizes of the levels, finest first: ``[1, 2, 4, ..., Cp // 2]``."""
    sizes = []
    h = 1
    while h < Cp:
        sizes.append(h)
        h *= 2
    return sizes


def split_halves(xp: Any, x: Any, h: int) -> tuple[Any, Any]:
    """``[..., Cp, D]`` -> first and second halves of each ``2h`` block, ``[..., nb, h, D]`` each."""
    *lead, Cp, D = x.shape
    y = xp.reshape(x, (*lead, Cp // (2 * h), 2, h, D))
    return y[..., 0, :, :], y[..., 1, :, :]


def join_halves(xp: Any, first: Any, second: Any) -> Any:
    """Inverse of :func:`split_halves`: two ``[..., nb, h, D]`` arrays -> ``[..., 2 nb h, D]``."""
    *lead, nb, h, D = first.shape
    return xp.reshape(xp.stack([first, second], axis=-3), (*lead, nb * 2 * h, D))


def join_blocks(xp: Any, blocks: Any, off: Any) -> Any:
    """Pair diagonal blocks ``[..., 2 nb, h, h]`` with lower-left blocks ``off`` ``[..., nb, h, h]``.

    Returns ``[..., nb, 2h, 2h]`` lower block-triangular matrices ``[[D0, 0], [off, D1]]``.
    """
    *lead, m, h, _ = blocks.shape
    pairs = xp.reshape(blocks, (*lead, m // 2, 2, h, h))
    d0, d1 = pairs[..., 0, :, :], pairs[..., 1, :, :]
    top = xp.concat([d0, xp.zeros_like(d0)], axis=-1)
    bottom = xp.concat([off, d1], axis=-1)
    return xp.concat([top, bottom], axis=-2)


def assemble_lower(xp: Any, diagonal: Any, offs: list[Any]) -> Any:
    """Lower-triangular ``[..., Cp, Cp]`` from its diagonal ``[..., Cp]`` and levels (finest first)."""
    blocks = diagonal[..., None, None]
    for off in offs:
        blocks = join_blocks(xp, blocks, off)
    return blocks[..., 0, :, :]


def split_lower(xp: Any, M: Any) -> tuple[Any, list[Any]]:
    """Diagonal ``[..., Cp]`` and levels (finest first) of the lower triangle of ``M``."""
    *lead, Cp, _ = M.shape
    blocks = M[..., None, :, :]
    offs = []
    h = Cp // 2
    while h >= 1:
        n = blocks.shape[-3]
        offs.append(blocks[..., h:, :h])
        halves = xp.stack([blocks[..., :h, :h], blocks[..., h:, h:]], axis=-3)
        blocks = xp.reshape(halves, (*lead, 2 * n, h, h))
        h //= 2
    offs.reverse()
    return blocks[..., 0, 0], offs


def small_product(xp: Any, a: Any, b: Any) -> Any:
    """``a @ b`` for ``a: [..., m, n]``, ``b: [..., n, p]``; element-wise when the blocks are tiny."""
    if a.shape[-2] <= SMALL_BLOCK and b.shape[-1] <= SMALL_BLOCK:
        return xp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)
    return xp.matmul(a, b)


def exclusive_suffix_prod(xp: Any, e: Any) -> Any:
    """``out[..., j, :] = prod(e[..., l, :] for l > j)`` along axis -2 (1 for the last row)."""
    shifted = xp.concat([e[..., 1:, :], xp.ones_like(e[..., :1, :])], axis=-2)
    return xp.flip(xp.cumulative_prod(xp.flip(shifted, axis=-2), axis=-2), axis=-2)


def reverse_cumsum(xp: Any, x: Any) -> Any:
    """``out[..., l, :] = sum(x[..., i, :] for i >= l)`` along axis -2."""
    return xp.flip(xp.cumulative_sum(xp.flip(x, axis=-2), axis=-2), axis=-2)


def exclusive_cumsum(xp: Any, x: Any) -> Any:
    """``out[..., l, :] = sum(x[..., j, :] for j < l)`` along axis -2 (0 for the first row)."""
    head = xp.zeros_like(x[..., :1, :])
    return xp.concat([head, xp.cumulative_sum(x[..., :-1, :], axis=-2)], axis=-2)
