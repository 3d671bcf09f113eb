"""Hierarchical block layout of a chunk's lower-triangular ``[Cp, Cp]`` matrices.

A chunk of ``Cp = 2**m`` steps is halved recursively. At the level with half-size
``h`` (``h = 1, 2, 4, ..., Cp/2``) the chunk is cut into ``nb = Cp / (2h)`` blocks of
``2h`` steps; in each block the *first half* (``h`` steps) is the column side and the
*second half* (``h`` steps) the row side of one off-diagonal ``[h, h]`` block. Every
strictly-lower entry of a ``[Cp, Cp]`` matrix lies in exactly one such block, so a
lower-triangular matrix is its diagonal plus one ``[..., nb, h, h]`` array per level.

These helpers only move data. Each is written with the array API; for NumPy arrays the
block views are strided views and accumulations are in place, which saves a copy of the
data per level (the results are the same bit for bit).
"""

from __future__ import annotations

from typing import Any

import array_api_compat

__all__ = [
    "FLUSH_BELOW",
    "PAIR_FLUSH_BELOW",
    "add_halves",
    "assemble_lower",
    "decay",
    "exclusive_cumsum",
    "flush",
    "half_sizes",
    "join_blocks",
    "join_halves",
    "level_blocks",
    "reverse_cumsum",
    "split_halves",
    "split_lower",
]

# Decay factors below these are set to an exact 0 (docs/options.md, "Subnormal floats"). A
# subnormal float costs x86 cores ~100x in every instruction that reads or writes it (NumPy's
# loops and BLAS alike), and strong gates put many decay products inside a chunk there.
# FLUSH_BELOW (the prefix, suffix and total decays, the recurrence's exp(g)) is the square root of
# the smallest normal float: a product of two kept factors is normal, and so is a kept factor times
# an input or a state entry of 2**-63 (2**-511) or more. PAIR_FLUSH_BELOW (the row and column
# factors of the pair products A and L, multiplied together inside a matrix product with q_d k_d):
# the square of a kept pair factor times 2**-42 (2**-342) is normal. A dropped factor scales its
# term by less than these, far below rounding against the terms of factor 1 beside it.
FLUSH_BELOW = {32: 2.0**-63, 64: 2.0**-511}
PAIR_FLUSH_BELOW = {32: 2.0**-42, 64: 2.0**-340}


def _is_numpy(xp: Any) -> bool:
    return array_api_compat.is_numpy_namespace(xp)


def flush(xp: Any, x: Any, below: dict[int, float] = FLUSH_BELOW) -> Any:
    """``x`` (decay factors in ``[0, 1]``) with entries under ``below`` (:data:`FLUSH_BELOW` or
    :data:`PAIR_FLUSH_BELOW`, by the dtype's bits) set to 0 (NaN stays NaN); NumPy arrays are
    changed in place and returned."""
    tiny = below[xp.finfo(x.dtype).bits]
    if _is_numpy(xp):
        import numpy as np

        np.copyto(x, 0, where=x < tiny)
        return x
    return xp.where(x < tiny, xp.zeros_like(x), x)


def decay(xp: Any, g: Any) -> Any:
    """``exp(g)``, flushed (:func:`flush`)."""
    return flush(xp, xp.exp(g))


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


def add_halves(xp: Any, acc: Any, first: Any | None, second: Any | None) -> Any:
    """``acc + join_halves(first, second)`` (``None``: zeros); in place for NumPy arrays."""
    ref = first if first is not None else second
    *_, nb, h, D = ref.shape
    if _is_numpy(xp):
        view = acc.reshape((*acc.shape[:-2], nb, 2, h, D))
        for i, part in enumerate((first, second)):
            if part is not None:
                view[..., i, :, :] += part
        return acc
    first = xp.zeros_like(second) if first is None else first
    second = xp.zeros_like(first) if second is None else second
    return acc + join_halves(xp, first, second)


def level_blocks(M: Any, h: int) -> Any:
    """The off-diagonal ``[..., nb, h, h]`` blocks of level ``h`` of ``M: [..., Cp, Cp]``.

    A strided view (writable when ``M`` is) of a C-contiguous NumPy array: the NumPy paths of
    :func:`assemble_lower` and :func:`split_lower` use it in place of copies.
    """
    import numpy as np

    *lead, Cp, _ = M.shape
    sr, sc = M.strides[-2:]
    shape = (*lead, Cp // (2 * h), h, h)
    strides = (*M.strides[:-2], 2 * h * (sr + sc), sr, sc)
    return np.lib.stride_tricks.as_strided(M[..., h:, :], shape=shape, strides=strides)


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
    if _is_numpy(xp):
        import numpy as np

        Cp = diagonal.shape[-1]
        M = np.zeros((*diagonal.shape, Cp), dtype=diagonal.dtype)
        np.einsum("...ii->...i", M)[...] = diagonal
        for h, off in zip(half_sizes(Cp), offs):
            level_blocks(M, h)[...] = off
        return M
    blocks = diagonal[..., None, None]
    for off in offs:
        blocks = join_blocks(xp, blocks, off)
    return blocks[..., 0, :, :]


def split_lower(xp: Any, M: Any) -> tuple[Any, list[Any]]:
    """Diagonal ``[..., Cp]`` and levels (finest first) of the lower triangle of ``M``."""
    Cp = M.shape[-1]
    if _is_numpy(xp):
        import numpy as np

        M = np.ascontiguousarray(M)
        return np.diagonal(M, axis1=-2, axis2=-1), [level_blocks(M, h) for h in half_sizes(Cp)]
    *lead, _, _ = M.shape
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


def reverse_cumsum(xp: Any, x: Any) -> Any:
    """``out[..., l, :] = sum(x[..., i, :] for i >= l)`` along axis -2."""
    return xp.flip(xp.cumulative_sum(xp.flip(x, axis=-2), axis=-2), axis=-2)


def exclusive_cumsum(xp: Any, x: Any) -> Any:
    """``out[..., l, :] = sum(x[..., j, :] for j < l)`` along axis -2 (0 for the first row)."""
    head = xp.zeros_like(x[..., :1, :])
    return xp.concat([head, xp.cumulative_sum(x[..., :-1, :], axis=-2)], axis=-2)
