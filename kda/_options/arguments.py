"""Checks of a call's arguments, one module: shapes, dtypes, contiguity, scalars; packing
(``cu_seqlens`` offsets, the chunk count, a state pool, ``pad_slot_id``, the slots) in its sibling
:mod:`kda._options.packing`.

Every entry point, decode, Dask, context parallelism and the adapters check their arguments with
these. Each check names the argument, what was expected and what was given, and raises
:class:`~kda.InvalidInputError` (a ``ValueError``) for shapes and values or
:class:`~kda.InvalidTypeError` (a ``TypeError``) for dtypes and array types.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import array_api_compat
import numpy as np

from .._errors import InvalidInputError, InvalidTypeError

__all__ = [
    "STATE_DTYPE_RULE",
    "c_contiguous",
    "check_array",
    "check_choice",
    "check_chunk_size",
    "check_dtype",
    "check_log_decay",
    "check_lower_bound",
    "check_scale",
    "check_shape",
    "dtype_spelling",
    "host_integers",
    "namespace_of",
    "slot_stride",
]

STATE_DTYPE_RULE = "states are float64 for float64 inputs, float32 otherwise"
_NDARRAY = np.ndarray
_NUMPY_XP: list[Any] = []  # the namespace array_api_compat gives NumPy arrays, once asked


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in x.shape)


def namespace_of(names: list[str], arrays: list[Any]) -> Any:
    """Return the one array namespace that all ``arrays`` share.

    NumPy arrays (exactly ``numpy.ndarray``, the common host call) take a fast path: the
    namespace ``array_api_compat`` gives NumPy arrays, asked once; anything else asks it every
    time (the same answer for NumPy, at several microseconds a call)."""
    if arrays and all(type(x) is _NDARRAY for x in arrays):
        if not _NUMPY_XP:
            _NUMPY_XP.append(array_api_compat.array_namespace(*arrays))
        return _NUMPY_XP[0]
    for name, x in zip(names, arrays):
        if not array_api_compat.is_array_api_obj(x):
            msg = f"{name} must be an array of an array-API library; got {type(x).__name__}"
            raise InvalidTypeError(msg)
    try:
        return array_api_compat.array_namespace(*arrays)
    except TypeError as err:
        kinds = ", ".join(f"{n}: {type(x).__module__}.{type(x).__name__}" for n, x in zip(names, arrays))
        msg = f"all arrays must come from one array library; got {kinds}"
        raise InvalidTypeError(msg) from err


def c_contiguous(*arrays: Any) -> bool:
    """Whether every one of ``arrays`` is C-contiguous: kda's one contiguity predicate. NumPy's
    ``flags`` (a NumPy array asked first: the decode paths' arrays), torch's ``is_contiguous()``,
    CuPy's ``flags``; True for a namespace without strides to ask about (JAX)."""
    for x in arrays:
        if type(x) is _NDARRAY:
            if not x.flags.c_contiguous:
                return False
            continue
        is_contiguous = getattr(x, "is_contiguous", None)  # torch
        if is_contiguous is not None:
            if not is_contiguous():
                return False
            continue
        flags = getattr(x, "flags", None)
        if flags is not None and hasattr(flags, "c_contiguous") and not flags.c_contiguous:
            return False
    return True


def slot_stride(pool: Any) -> int | None:
    """The elements from one row of ``pool [P, ...]`` (a NumPy or CuPy array) to the next, where
    every row is C-contiguous (:func:`c_contiguous`) and the rows do not overlap: one row's size
    for a C-contiguous pool, more for rows a padded slot stride apart (the pool views vLLM-CPU
    keeps); None for any other pool (rows not C-contiguous, a negative or unaligned slot stride,
    rows that overlap)."""
    row = math.prod(pool.shape[1:])
    if c_contiguous(pool):
        return max(row, 1)
    if pool.shape[0] == 0 or not c_contiguous(pool[0]):
        return None
    item, slot = pool.itemsize, int(pool.strides[0])
    if slot % item or slot < row * item:
        return None
    return slot // item


def check_shape(name: str, x: Any, expected: tuple[int, ...], letters: str) -> None:
    """Raise unless ``x.shape == expected``; ``letters`` spells the dimensions, e.g. 'B, H, T, K'."""
    if _shape(x) != tuple(expected):
        msg = f"{name} must have shape [{letters}] = {tuple(expected)}; got {_shape(x)}"
        raise InvalidInputError(msg)


def dtype_spelling(dtype: Any) -> str:
    """``float32`` for NumPy's scalar type, the library's own spelling otherwise."""
    return getattr(dtype, "__name__", None) or str(dtype)


def check_dtype(name: str, x: Any, expected: Any, why: str) -> None:
    if x.dtype != expected:
        msg = f"{name} must have dtype {dtype_spelling(expected)} ({why}); got {dtype_spelling(x.dtype)}"
        raise InvalidTypeError(msg)


def check_chunk_size(chunk_size: Any) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        msg = f"chunk_size must be a positive int; got {chunk_size!r} of type {type(chunk_size).__name__}"
        raise InvalidTypeError(msg)
    if chunk_size < 1:
        msg = f"chunk_size must be >= 1; got {chunk_size}"
        raise InvalidInputError(msg)
    return int(chunk_size)


def check_scale(scale: Any, K: int) -> float:
    if scale is None:
        return K**-0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        msg = f"scale must be a real number or None; got {scale!r} of type {type(scale).__name__}"
        raise InvalidTypeError(msg)
    if not math.isfinite(float(scale)):
        msg = f"scale must be finite; got {scale!r}"
        raise InvalidInputError(msg)
    return float(scale)


def check_lower_bound(lower_bound: Any, why: str = "") -> float:
    """``lower_bound``: a finite real number < 0 (``why``: the context, for the message); as a float."""
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real):
        msg = f"lower_bound must be a float < 0{why}; got {lower_bound!r}"
        raise InvalidTypeError(msg)
    if not (math.isfinite(float(lower_bound)) and lower_bound < 0):
        msg = f"lower_bound must be a finite float < 0; got {lower_bound!r}"
        raise InvalidInputError(msg)
    return float(lower_bound)


def check_log_decay(xp: Any, g: Any) -> None:
    """``g`` is a log decay: every element must be <= 0 or -inf; NaN and positive values are refused.

    One reduction on the common path: the maximum, through which NaN propagates (the array API
    standard's ``max``), is ``<= 0`` exactly when every element is. This also rules out NaN and
    ``+inf``, so a log gate needs no finiteness check of its own (:meth:`Call.check_finite`).
    """
    if math.prod(_shape(g)) == 0 or bool(xp.max(g) <= 0):
        return
    bad = xp.logical_not(g <= 0)  # True for g > 0 and for NaN
    if bool(xp.any(bad)):
        n_nan = int(xp.sum(xp.astype(xp.isnan(g), xp.int64)))
        n_pos = int(xp.sum(xp.astype(g > 0, xp.int64)))
        msg = (
            "g must hold log decays <= 0 (-inf allowed: a hard reset); "
            f"got {n_pos} positive and {n_nan} NaN elements"
        )
        raise InvalidInputError(msg)


def check_choice(name: str, value: Any, allowed: tuple[Any, ...]) -> Any:
    """Raise unless ``value`` is one of ``allowed``."""
    if not any(value is a or (isinstance(value, str) and value == a) for a in allowed):
        msg = f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}"
        raise InvalidInputError(msg)
    return value


def check_array(name: str, x: Any, p: Any, shape: tuple[int, ...], letters: str, dtype: Any, why: str) -> Any:
    """Validate an extra array argument (state, boundaries, gradient) against the problem."""
    if not array_api_compat.is_array_api_obj(x):
        msg = f"{name} must be an array; got {type(x).__name__}"
        raise InvalidTypeError(msg)
    if array_api_compat.array_namespace(x) is not p.xp:
        msg = (
            f"{name} must come from the same array library as q ({p.xp.__name__}); "
            f"got {type(x).__module__}.{type(x).__name__}"
        )
        raise InvalidTypeError(msg)
    check_shape(name, x, shape, letters)
    check_dtype(name, x, dtype, why)
    return x


def host_integers(name: str, x: Any) -> Any:
    """A 1-D integer array (any array library, or a list of ints) as a NumPy array on the host."""
    if isinstance(x, (list, tuple)):
        host = np.asarray(x)
    elif array_api_compat.is_array_api_obj(x):
        if array_api_compat.is_cupy_array(x):
            x = x.get()
        try:
            host = np.asarray(x)
        except (TypeError, RuntimeError):
            host = np.from_dlpack(x)
    else:
        msg = f"{name} must be a 1-D integer array or None; got {type(x).__name__}"
        raise InvalidTypeError(msg)
    if host.ndim != 1 or not (np.issubdtype(host.dtype, np.integer) or host.size == 0):
        msg = f"{name} must be a 1-D integer array; got shape {host.shape} and dtype {host.dtype}"
        raise InvalidTypeError(msg)
    return host.astype(np.int64)
