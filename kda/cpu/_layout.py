"""How the CPU backend lays arrays out for its kernels: the compute dtype checked, C-contiguous
copies where a kernel needs them, heads merged into one axis, steps cut into padded chunks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_heads", "compute_dtype", "contiguous", "in_place", "scalar", "to_chunks"]


def compute_dtype(x: Any) -> np.dtype:
    """The dtype of ``x``, which must be float32 or float64 (else :class:`~kda._errors.InvalidInputError`)."""
    dtype = np.asarray(x).dtype
    if dtype not in (np.float32, np.float64):
        from .._errors import InvalidInputError

        msg = f"the cpu backend computes float32 or float64 arrays; got {dtype}"
        raise InvalidInputError(msg)
    return dtype


def contiguous(x: Any, dtype: Any) -> np.ndarray:
    """``x`` as a C-contiguous array of ``dtype`` (no copy when it is one already)."""
    return np.ascontiguousarray(x, dtype=dtype)


def scalar(value: float, dtype: Any) -> np.ndarray:
    """``value`` as a one-element array of ``dtype`` (how the kernels take the scale)."""
    return np.full(1, value, dtype=dtype)


def as_heads(x: Any, dtype: Any) -> np.ndarray:
    """``[B, H, ...]`` -> C-contiguous ``[B * H, ...]``."""
    return contiguous(x, dtype).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def in_place(x: Any, dtype: Any) -> np.ndarray:
    """``x`` as a NumPy array of ``dtype``, read in place when it already is one (any strides)."""
    x = np.asarray(x)
    return x if x.dtype == dtype else x.astype(dtype)


def to_chunks(x: Any, *, chunk_size: int, padded_size: int) -> np.ndarray:
    """``[B, H, T, D]`` -> C-contiguous ``[B, H, NT, Cp, D]``, zero-padded (one copy at most)."""
    B, H, T, D = x.shape
    C, Cp = chunk_size, padded_size
    NT = -(-T // C)
    full = T // C
    if full == NT and Cp == C:
        return np.ascontiguousarray(np.reshape(x, (B, H, NT, C, D)))
    out = np.zeros((B, H, NT, Cp, D), dtype=x.dtype)
    out[:, :, :full, :C, :] = np.reshape(x[:, :, : full * C, :], (B, H, full, C, D))
    if full < NT:
        out[:, :, full, : T - full * C, :] = x[:, :, full * C :, :]
    return out
