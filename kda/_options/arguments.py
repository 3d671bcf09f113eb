"""Checks of a call's arguments, one module: shapes, dtypes, contiguity, scalars, and packing
(``cu_seqlens`` offsets, a state pool, its slots).

Every entry point, decode, Dask, context parallelism and the adapters check their arguments with
these. Each check names the argument, what was expected and what was given, and raises
:class:`~kda.InvalidInputError` (a ``ValueError``) for shapes and values or
:class:`~kda.InvalidTypeError` (a ``TypeError``) for dtypes and array types.
"""

from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Any

import array_api_compat
import numpy as np

from .._errors import InvalidInputError, InvalidTypeError

__all__ = [
    "PADDING", "POOL_DTYPE_RULE", "STATE_DTYPE_RULE", "Slots", "c_contiguous", "check_array",
    "check_choice", "check_chunk_size", "check_cu_seqlens", "check_dtype", "check_log_decay",
    "check_lower_bound", "check_pad_slot_id", "check_pool", "check_scale", "check_shape", "check_slots",
    "dtype_name", "host_integers", "is_half_pool", "namespace_of", "pool_dtype_ok", "slot_stride",
]  # fmt: skip

STATE_DTYPE_RULE = "states are float64 for float64 inputs, float32 otherwise"
_NDARRAY = np.ndarray


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


def check_cu_seqlens(cu_seqlens: Any, B: int, T: int) -> tuple[int, ...] | None:
    """``N + 1`` non-decreasing offsets from 0 to ``T`` (with ``B == 1``), as host ints."""
    if cu_seqlens is None:
        return None
    host = host_integers("cu_seqlens", cu_seqlens)
    if host.size < 1 or host[0] != 0 or host[-1] != T:
        ends = f"first {host[0]}, last {host[-1]}" if host.size else "no elements"
        msg = f"cu_seqlens must start at 0 and end at T={T}; got {ends}"
        raise InvalidInputError(msg)
    steps = host[1:] - host[:-1]
    if (steps < 0).any():
        i = int((steps < 0).argmax())
        msg = f"cu_seqlens must be non-decreasing; got {host[i]} then {host[i + 1]} at index {i}"
        raise InvalidInputError(msg)
    if B != 1:
        msg = f"cu_seqlens packs sequences into one row: the batch size B must be 1; got B={B}"
        raise InvalidInputError(msg)
    return tuple(int(n) for n in host)


# ----------------------------------------------------------------------------------------------
# a state pool and its slots


PADDING = -1
# slot arrays up to this size are checked in Python (cheaper than NumPy's calls on tiny arrays)
SMALL = 64


# ----------------------------------------------------------------------------------------------
# the pool and the slots


POOL_DTYPE_RULE = (
    "a pool holds float32, float16 or bfloat16 states for float32 (and 16-bit) inputs, float64 for "
    "float64 inputs"
)
HALF_POOLS = ("float16", "bfloat16")  # 16-bit pool dtypes: read into float32, rounded on store


def _dtype_name(dtype: Any) -> str:
    """``float16`` for NumPy's and torch's float16, ``bfloat16`` for ``ml_dtypes.bfloat16`` and torch's."""
    name = getattr(dtype, "name", None)
    if not isinstance(name, str):
        name = getattr(dtype, "__name__", None)
    return name if isinstance(name, str) else str(dtype).rpartition(".")[2]


_HALF_SEEN: dict[int, tuple[Any, bool]] = {}  # id(dtype) -> (dtype, whether a 16-bit pool dtype)


def is_half_pool(dtype: Any) -> bool:
    """Whether ``dtype`` is float16 or bfloat16, looked up once per dtype object (a NumPy
    dtype's name costs microseconds: float16's 4 us)."""
    seen = _HALF_SEEN.get(id(dtype))
    if seen is None:
        seen = _HALF_SEEN[id(dtype)] = (dtype, _dtype_name(dtype) in HALF_POOLS)  # kept alive: ids stay
    return seen[1]


def pool_dtype_ok(dtype: Any, compute_dtype: Any) -> bool:
    """Whether a pool of ``dtype`` serves a call computing in ``compute_dtype`` (:data:`POOL_DTYPE_RULE`)."""
    if dtype == compute_dtype:
        return True
    return _dtype_name(dtype) in HALF_POOLS and _dtype_name(compute_dtype) == "float32"


def check_pool(state_pool: Any, p: Any, v_first: bool = False) -> int:
    """Validate the pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``v_first``; float32,
    float16 or bfloat16 for float32 compute, float64 for float64; writable in place); return ``P``."""
    if not array_api_compat.is_array_api_obj(state_pool) or state_pool.ndim != 4:
        shape = getattr(state_pool, "shape", None)
        letters = "P, HV, V, K" if v_first else "P, HV, K, V"
        msg = f"state_pool must be a 4-D array [{letters}]; got {type(state_pool).__name__} of shape {shape}"
        raise InvalidInputError(msg) if shape is not None else InvalidTypeError(msg)
    P = int(state_pool.shape[0])
    shape = (P, p.HV, p.V, p.K) if v_first else (P, p.HV, p.K, p.V)
    got = tuple(int(n) for n in state_pool.shape)
    check_array("state_pool", state_pool, p, got, "", state_pool.dtype, "")  # the array library
    if got != shape:
        other = (P, p.HV, p.K, p.V) if v_first else (P, p.HV, p.V, p.K)
        letters = "P, HV, V, K" if v_first else "P, HV, K, V"
        msg = f"state_pool must have shape [{letters}] = {shape} (state_v_first={bool(v_first)}); got {got}"
        if got == other:
            msg += f" (the other layout: pass state_v_first={not v_first} for a pool of that layout)"
        raise InvalidInputError(msg)
    if not pool_dtype_ok(state_pool.dtype, p.compute_dtype):
        want = "float64" if _dtype_name(p.compute_dtype) == "float64" else "float32, float16 or bfloat16"
        msg = (
            f"state_pool must have dtype {want} ({POOL_DTYPE_RULE}); got {_dtype_name(state_pool.dtype)} "
            f"with {_dtype_name(p.dtype)} inputs"
        )
        raise InvalidTypeError(msg)
    if not array_api_compat.is_writeable_array(state_pool):
        msg = (
            "state_pool must be writable in place (it is updated in place); got a read-only or "
            f"immutable {type(state_pool).__module__}.{type(state_pool).__name__}"
        )
        raise InvalidInputError(msg)
    return P


def check_pad_slot_id(pad_slot_id: Any, P: int) -> int:
    """``pad_slot_id``: ``-1`` (the default) or a row of ``[0, P)`` that marks padding (vLLM's KDA
    layers pass 0); returned as an int."""
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, numbers.Integral):
        msg = (
            f"pad_slot_id must be an int (-1, or a pool row in [0, {P}) reserved for padding); got "
            f"{pad_slot_id!r} of type {type(pad_slot_id).__name__}"
        )
        raise InvalidTypeError(msg)
    if not PADDING <= int(pad_slot_id) < P:
        msg = f"pad_slot_id must be -1 or a pool row in [0, {P}) reserved for padding; got {int(pad_slot_id)}"
        raise InvalidInputError(msg)
    return int(pad_slot_id)


@dataclass(frozen=True)
class Slots:
    """Validated slots of one call, as the backends take them.

    Attributes
    ----------
    start : int64 NumPy ``[N]``, the row each request starts from (``-1``: padding).
    dest : int64 NumPy ``[N, W]``: ``W == 1`` the row of the final state, else the row of the
        state after each step (``-1``: not kept).
    """

    start: Any
    dest: Any


def _host_slots(state_indices: Any) -> Any:
    """``state_indices`` as an int64 NumPy array of 1 or 2 dimensions."""
    if isinstance(state_indices, np.ndarray) and state_indices.dtype == np.int64:
        host = state_indices
    elif isinstance(state_indices, (list, tuple)) or array_api_compat.is_array_api_obj(state_indices):
        if array_api_compat.is_cupy_array(state_indices):
            state_indices = state_indices.get()
        try:
            host = np.asarray(state_indices)
        except (TypeError, RuntimeError, ValueError):
            try:
                host = np.from_dlpack(state_indices)
            except (TypeError, RuntimeError, ValueError, AttributeError):
                host = None
    else:
        host = None
    if (
        host is None
        or host.ndim not in (1, 2)
        or not (np.issubdtype(host.dtype, np.integer) or host.size == 0)
    ):
        what = type(state_indices).__name__
        if host is not None:
            what += f" of shape {tuple(host.shape)} and dtype {host.dtype}"
        msg = (
            "state_indices must be a 1-D integer array or list of ints ([N]: one row per request), or a "
            f"2-D one ([N, T]: one slot per step, for speculative verification); got {what}"
        )
        raise InvalidTypeError(msg)
    return np.ascontiguousarray(host, np.int64)


def _check_range(name: str, rows: list[int], P: int) -> None:
    """Every entry ``-1`` or a row of ``[0, P)``."""
    if rows and (min(rows) < PADDING or max(rows) >= P):
        bad = [r for r in rows if not PADDING <= r < P]
        msg = f"{name} must be -1 (padding) or a row in [0, {P}) of state_pool; got {bad[:5]}"
        raise InvalidInputError(msg)


def _shared(row: int, first: int, second: int, why: str) -> InvalidInputError:
    msg = (
        f"state_indices must name each pool row at most once across requests ({why}); got [{row}] "
        f"named by requests {first} and {second}"
    )
    return InvalidInputError(msg)


def _check_rows(name: str, rows: list[int], P: int, what: str) -> None:
    """Every entry ``-1`` or a row of ``[0, P)``; non-negative ones distinct (entry ``n``: request ``n``)."""
    _check_range(name, rows, P)
    named = [r for r in rows if r >= 0]
    if len(set(named)) != len(named):
        owner: dict[int, int] = {}
        for n, r in enumerate(rows):
            if r >= 0 and owner.setdefault(r, n) != n:
                raise _shared(r, owner[r], n, what)


def _check_rows_numpy(name: str, rows: Any, P: int, what: str) -> None:
    """:func:`_check_rows` for a large int64 array (sorting, no Python loop)."""
    if rows.size and (int(rows.min()) < PADDING or int(rows.max()) >= P):
        _check_range(name, rows.tolist(), P)  # words the error
    named = np.sort(rows[rows >= 0])
    if named.size > 1 and bool(np.any(named[1:] == named[:-1])):
        _check_rows(name, rows.tolist(), P, what)


def _lengths(N: int, T: int, offsets: tuple[int, ...] | None) -> list[int]:
    if offsets is None:
        return [T] * N
    return [b - a for a, b in itertools.pairwise(offsets)]


def check_slots(
    state_indices: Any, num_accepted_tokens: Any, N: int, T: int, offsets: tuple[int, ...] | None, P: int,
    pad_slot_id: int = PADDING,
) -> Slots:  # fmt: skip
    """Validate the slots of ``N`` requests of ``T`` steps (per request with ``offsets``).

    Entries equal to ``pad_slot_id`` (checked by the caller: :func:`check_pad_slot_id`) or
    ``-1`` are padding: the backends receive them as ``-1``. Raises
    :class:`~kda.InvalidInputError` / :class:`~kda.InvalidTypeError` naming ``state_indices``
    or ``num_accepted_tokens``; nothing is written before these checks pass.
    """
    host = _host_slots(state_indices)
    if pad_slot_id != PADDING:
        host = np.where(host == pad_slot_id, PADDING, host)  # a new array: the input is not modified
    if host.ndim == 1:
        return _one_slot_each(host, num_accepted_tokens, N, P)
    return _slot_per_step(host, num_accepted_tokens, N, T, offsets, P)


def _one_slot_each(host: Any, num_accepted_tokens: Any, N: int, P: int) -> Slots:
    if host.shape != (N,):
        msg = f"state_indices must have shape [N] = ({N},), one row per request; got {tuple(host.shape)}"
        raise InvalidInputError(msg)
    if num_accepted_tokens is not None:
        msg = (
            "num_accepted_tokens needs 2-D state_indices [N, T] (a slot per step); got 1-D state_indices "
            f"of shape {tuple(host.shape)}"
        )
        raise InvalidInputError(msg)
    what = "two requests cannot share a state"
    if N <= SMALL:
        _check_rows("state_indices", host.tolist(), P, what)
    else:
        _check_rows_numpy("state_indices", host, P, what)
    return Slots(host, host.reshape(N, 1))


def _accepted(num_accepted_tokens: Any, N: int, lengths: list[int]) -> list[int]:
    """``num_accepted_tokens [N]`` as host ints, each in ``1..T_n`` (ignored for empty requests)."""
    if num_accepted_tokens is None:
        return [1] * N
    host = host_integers("num_accepted_tokens", num_accepted_tokens)
    if host.shape != (N,):
        msg = (
            f"num_accepted_tokens must have shape [N] = ({N},), one count per request; "
            f"got {tuple(host.shape)}"
        )
        raise InvalidInputError(msg)
    counts = host.tolist()
    bad = [(n, a, t) for n, (a, t) in enumerate(zip(counts, lengths)) if t > 0 and not 1 <= a <= t]
    if bad:
        n, a, t = bad[0]
        msg = (
            "num_accepted_tokens must be in 1..T for each request (the start slot is "
            f"state_indices[n, num_accepted_tokens[n] - 1]); got {a} for request {n} of {t} steps"
            + (f" ({len(bad)} requests out of range)" if len(bad) > 1 else "")
        )
        raise InvalidInputError(msg)
    return counts


def _slot_per_step(
    host: Any, num_accepted_tokens: Any, N: int, T: int, offsets: tuple[int, ...] | None, P: int
) -> Slots:
    lengths = _lengths(N, T, offsets)
    longest = max(lengths, default=0)
    if host.shape[0] != N or host.shape[1] < max(longest, 1):
        msg = (
            f"state_indices must have shape [N, T] = ({N}, {max(longest, 1)}) (a slot per step; more "
            f"columns are ignored); got {tuple(host.shape)}"
        )
        raise InvalidInputError(msg)
    accepted = _accepted(num_accepted_tokens, N, lengths)
    table = host.tolist()
    used = [row[:t] for row, t in zip(table, lengths)]
    start = [row[a - 1] if row else PADDING for row, a in zip(used, accepted)]
    _check_range("state_indices", [r for row in used for r in row], P)
    owner: dict[int, int] = {}  # row -> the request that names it (its own slot at any of its steps)
    for n, row in enumerate(used):
        for r in row:
            if r >= 0 and owner.setdefault(r, n) != n:
                raise _shared(r, owner[r], n, "a request may name its own slot at several steps")
    idle = [n for n, (s, row) in enumerate(zip(start, used)) if s < 0 and any(r >= 0 for r in row)]
    if idle:
        n = idle[0]
        msg = (
            f"state_indices[{n}] starts from slot {accepted[n] - 1}, which is -1 (a padding request), but "
            f"names rows to write ({used[n]}); a padding request must be -1 throughout"
        )
        raise InvalidInputError(msg)
    return Slots(np.asarray(start, np.int64), host)
