"""Checks of packing arguments, one module: ``cu_seqlens`` offsets and the chunk count they give,
a state pool (its shape, dtype, writability), ``pad_slot_id`` and the slots.

The sibling of :mod:`kda._options.arguments` (single arrays and scalars): every entry point,
decode, Dask, context parallelism and the adapters check these with the functions here. Each
check names the argument, what was expected and what was given, and raises
:class:`~kda.InvalidInputError` (a ``ValueError``) for shapes and values or
:class:`~kda.InvalidTypeError` (a ``TypeError``) for dtypes and array types.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass
from typing import Any

import array_api_compat
import numpy as np

from .._dtypes import dtype_name
from .._errors import InvalidInputError, InvalidTypeError
from .arguments import check_array, host_integers

__all__ = [
    "HALF_POOLS",
    "PADDING",
    "POOL_DTYPE_RULE",
    "SMALL",
    "Slots",
    "check_cu_seqlens",
    "check_pad_slot_id",
    "check_pool",
    "check_pool_dtype",
    "check_slots",
    "is_half_pool",
    "num_chunks",
    "pool_dtype_ok",
]


def check_cu_seqlens(cu_seqlens: Any, B: int, T: int | None, *, sequences: int = 0) -> tuple[int, ...] | None:
    """``N + 1`` non-decreasing offsets from 0 to ``T`` (with ``B == 1``), as host ints; at least
    ``sequences`` sequences (``N``). ``T`` None: any total (context parallelism's global offsets,
    whose total is the token count). None stays None."""
    if cu_seqlens is None:
        return None
    host = host_integers("cu_seqlens", cu_seqlens)
    if sequences and host.size < sequences + 1:
        msg = f"cu_seqlens must hold N + 1 >= {sequences + 1} offsets (N sequences); got {host.size}"
        raise InvalidInputError(msg)
    end = host[-1] if T is None and host.size else T
    if host.size < 1 or host[0] != 0 or host[-1] != end:
        ends = f"first {host[0]}, last {host[-1]}" if host.size else "no elements"
        msg = f"cu_seqlens must start at 0{'' if T is None else f' and end at T={T}'}; got {ends}"
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


def num_chunks(chunk_size: int, *, T: int = 0, offsets: Any = None) -> int:
    """The chunk count: ``ceil(T / C)``, or with host ``offsets`` (``cu_seqlens``) the packed
    sequences' ``sum(ceil(len_i / C))`` (each sequence chunked on its own)."""
    if offsets is None:
        return -(-T // chunk_size)
    return sum(-(-(int(b) - int(a)) // chunk_size) for a, b in itertools.pairwise(offsets))


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


_HALF_SEEN: dict[int, tuple[Any, bool]] = {}  # id(dtype) -> (dtype, whether a 16-bit pool dtype)


def is_half_pool(dtype: Any) -> bool:
    """Whether ``dtype`` is float16 or bfloat16, looked up once per dtype object (a NumPy
    dtype's name costs microseconds: float16's 4 us)."""
    seen = _HALF_SEEN.get(id(dtype))
    if seen is None:
        seen = _HALF_SEEN[id(dtype)] = (dtype, dtype_name(dtype) in HALF_POOLS)  # kept alive: ids stay
    return seen[1]


def pool_dtype_ok(dtype: Any, compute_dtype: Any) -> bool:
    """Whether a pool of ``dtype`` serves a call computing in ``compute_dtype`` (:data:`POOL_DTYPE_RULE`)."""
    if dtype == compute_dtype:
        return True
    return dtype_name(dtype) in HALF_POOLS and dtype_name(compute_dtype) == "float32"


def check_pool_dtype(name: str, dtype: Any, compute_dtype: Any, input_dtype: Any = None) -> None:
    """``name`` (a state pool) has a dtype that serves a call computing in ``compute_dtype``
    (:data:`POOL_DTYPE_RULE`); :class:`~kda.InvalidTypeError` naming it otherwise. Any library's
    dtypes (NumPy, ``ml_dtypes``, torch, JAX); ``input_dtype``: the inputs', for the message."""
    if pool_dtype_ok(dtype, compute_dtype):
        return
    want = "float64" if dtype_name(compute_dtype) == "float64" else "float32, float16 or bfloat16"
    msg = f"{name} must have dtype {want} ({POOL_DTYPE_RULE}); got {dtype_name(dtype)}"
    if input_dtype is not None:
        msg += f" with {dtype_name(input_dtype)} inputs"
    raise InvalidTypeError(msg)


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
    check_pool_dtype("state_pool", state_pool.dtype, p.compute_dtype, p.dtype)
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
    state_indices: Any,
    num_accepted_tokens: Any,
    N: int,
    T: int,
    offsets: tuple[int, ...] | None,
    P: int,
    pad_slot_id: int = PADDING,
) -> Slots:
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
