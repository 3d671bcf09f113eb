"""Checks of user input, shared by every public function.

Each check names the argument, what was expected and what was given, and raises
:class:`~kda.InvalidInputError` (a ``ValueError``) for shapes and values or
:class:`~kda.InvalidTypeError` (a ``TypeError``) for dtypes and array types.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import array_api_compat

from ._errors import InvalidInputError, InvalidTypeError

__all__ = ["Problem", "validate_problem"]


@dataclass(frozen=True)
class Problem:
    """Validated sizes, dtypes and namespace of one KDA call."""

    xp: Any
    B: int
    H: int
    T: int
    K: int
    V: int
    dtype: Any  # dtype of q, k, v, g, beta and of the output
    compute_dtype: Any  # float64 for float64 inputs, float32 otherwise
    scale: float

    def num_chunks(self, chunk_size: int) -> int:
        return -(-self.T // chunk_size)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in x.shape)


def namespace_of(names: list[str], arrays: list[Any]) -> Any:
    """Return the one array namespace that all ``arrays`` share."""
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


def check_shape(name: str, x: Any, expected: tuple[int, ...], letters: str) -> None:
    """Raise unless ``x.shape == expected``; ``letters`` spells the dimensions, e.g. 'B, H, T, K'."""
    if _shape(x) != tuple(expected):
        msg = f"{name} must have shape [{letters}] = {tuple(expected)}; got {_shape(x)}"
        raise InvalidInputError(msg)


def dtype_name(dtype: Any) -> str:
    """``float32`` for NumPy's scalar type, the library's own spelling otherwise."""
    return getattr(dtype, "__name__", None) or str(dtype)


def check_dtype(name: str, x: Any, expected: Any, why: str) -> None:
    if x.dtype != expected:
        msg = f"{name} must have dtype {dtype_name(expected)} ({why}); got {dtype_name(x.dtype)}"
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


def check_log_decay(xp: Any, g: Any) -> None:
    """``g`` is a log decay: every element must be <= 0 or -inf; NaN and positive values are refused."""
    bad = xp.logical_not(g <= 0)  # True for g > 0 and for NaN
    if bool(xp.any(bad)):
        n_nan = int(xp.sum(xp.astype(xp.isnan(g), xp.int64)))
        n_pos = int(xp.sum(xp.astype(g > 0, xp.int64)))
        msg = (
            "g must hold log decays <= 0 (-inf allowed: a hard reset); "
            f"got {n_pos} positive and {n_nan} NaN elements"
        )
        raise InvalidInputError(msg)


def _is_float(xp: Any, dtype: Any) -> bool:
    try:
        return bool(xp.isdtype(dtype, "real floating"))
    except (TypeError, ValueError):
        return False


def validate_problem(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: Any) -> Problem:
    """Check ``q, k, v, g, beta`` and ``scale``; return the problem's sizes and dtypes."""
    names = ["q", "k", "v", "g", "beta"]
    arrays = [q, k, v, g, beta]
    xp = namespace_of(names, arrays)
    if q.ndim != 4:
        msg = f"q must have shape [B, H, T, K] (4 dimensions); got shape {_shape(q)}"
        raise InvalidInputError(msg)
    B, H, T, K = _shape(q)
    check_shape("k", k, (B, H, T, K), "B, H, T, K")
    check_shape("g", g, (B, H, T, K), "B, H, T, K")
    if v.ndim != 4 or _shape(v)[:3] != (B, H, T):
        msg = f"v must have shape [B, H, T, V] = ({B}, {H}, {T}, V); got {_shape(v)}"
        raise InvalidInputError(msg)
    V = _shape(v)[3]
    check_shape("beta", beta, (B, H, T), "B, H, T")
    if K < 1 or V < 1:
        msg = f"K and V must be >= 1; got K={K}, V={V}"
        raise InvalidInputError(msg)
    if not _is_float(xp, q.dtype):
        allowed = "float16, bfloat16, float32, float64"
        msg = f"q must have a real floating dtype ({allowed}); got {dtype_name(q.dtype)}"
        raise InvalidTypeError(msg)
    for name, x in zip(names[1:], arrays[1:]):
        check_dtype(name, x, q.dtype, "the dtype of q")
    compute_dtype = xp.float64 if q.dtype == xp.float64 else xp.float32
    check_log_decay(xp, g)
    return Problem(xp, B, H, T, K, V, q.dtype, compute_dtype, check_scale(scale, K))


def check_array(
    name: str, x: Any, p: Problem, shape: tuple[int, ...], letters: str, dtype: Any, why: str
) -> Any:
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


STATE_DTYPE_RULE = "states are float64 for float64 inputs, float32 otherwise"


def check_state(name: str, state: Any, p: Problem) -> Any:
    """Validate a ``[B, H, K, V]`` state; ``None`` passes through (it means zeros)."""
    if state is None:
        return None
    shape = (p.B, p.H, p.K, p.V)
    return check_array(name, state, p, shape, "B, H, K, V", p.compute_dtype, STATE_DTYPE_RULE)
