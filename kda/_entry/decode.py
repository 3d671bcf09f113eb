"""Decoding from a state pool: ``decode_kda``, speculative verification, and the prepared form.

A serving engine keeps the recurrent states of its requests in one pool ``[P, HV, K, V]`` and
runs a batch of requests, each a few steps long (one for decoding, a few for speculative
verification), against the rows it names. Rows are written in place; rows that no request names
are neither read nor written. ``docs/decode.md`` is the guide.

Slots. ``state_indices [N]``: request ``n`` starts from row ``state_indices[n]`` and its final
state goes back there (``-1``: a padding request). ``state_indices [N, W]`` (speculative
verification, as flash-linear-attention and vLLM): request ``n`` starts from slot
``[n, num_accepted_tokens[n] - 1]`` and its state after step ``t`` goes to slot ``[n, t]``
(``-1``: not kept). The backends receive the same two int64 arrays in both cases,
``start [N]`` and ``dest [N, W]`` (:meth:`kda._backend.Backend.decode_forward`).

Cost. Validation looks at the small arrays only (the inputs' shapes and dtypes, the indices, and
the inputs' values for the gate and finiteness checks); the pool's shape, dtype and writability
are read from its header, its contents never. On NumPy the call takes a direct route
(:func:`_numpy_route`) whenever the problem is one the kernel computes as given (float32 or
float64, a plain call by the option table's :func:`~kda._options.table.is_plain`, ``HV == H``;
any slot form) and the backend screens the inputs (``decode_screen``): the same checks written
out (the slots by :func:`check_slots` itself, the value checks in the backend's
``decode_screen``, one compiled pass on the cpu backend) and the same kernel, reached through
:func:`~kda._backend.get_backend` as the general route reaches it, so the results are bitwise
those of the general route, which handles everything else (and words every error: a
direct-route check that fails hands the call to the general route). :func:`decode_states` is
the adapters' recurrent forward on the same kernel.
"""

from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Any

import array_api_compat

from .._backend import get_backend
from .._errors import InvalidInputError, InvalidTypeError, KdaError
from .._options.checks import warn_if_diverged
from .._options.maps import head_first
from .._options.table import Array, Choices, is_plain, takes_options
from .._options.validation import Problem, _host_integers, c_contiguous, check_array, check_state
from .call import Call, Inputs, KdaOutput, open_call
from .layout import check_state_v_first

__all__ = ["DecodePlan", "Slots", "decode_kda", "decode_states", "prepare_decode_kda"]

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


def check_pool(state_pool: Any, p: Problem, v_first: bool = False) -> int:
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
    import numpy as np

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
    import numpy as np

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
        import numpy as np

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
    host = _host_integers("num_accepted_tokens", num_accepted_tokens)
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
    import numpy as np

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


# ----------------------------------------------------------------------------------------------
# the call


def _run(
    call: Call, inputs: Inputs, pool: Any, slots: Slots, *, out: Any = None, final_pool: Any = None,
    v_first: bool = False,
) -> Any:  # fmt: skip
    """The general route: options mapped, the backend's kernel, the output in the caller's layout."""
    p, xp = call.p, call.p.xp
    c = call.core_inputs(inputs)
    ops = call.core.ops
    if v_first:
        o = ops.decode_forward(c.q, c.k, c.v, c.g, c.beta, p.scale, pool, slots.start, slots.dest,
                               offsets=p.offsets, final_pool=final_pool, v_first=True)  # fmt: skip
    else:
        o = ops.decode_forward(c.q, c.k, c.v, c.g, c.beta, p.scale, pool, slots.start, slots.dest,
                               offsets=p.offsets, final_pool=final_pool)  # fmt: skip
    o = head_first(xp, xp.astype(o, p.dtype, copy=False), p.layout)
    if call.check:
        warn_if_diverged(xp, o, stacklevel=4)
    if out is not None:
        out[...] = o
        return out
    return o


def decode_kda(
    q: Array, k: Array, v: Array, g: Array, beta: Array, state_pool: Array, state_indices: Array, *,
    num_accepted_tokens: Array | None = None, state_v_first: bool = False, pad_slot_id: int = PADDING,
    scale: float | None = None, backend: str | None = None, opts: Choices,
) -> Any:  # fmt: skip
    """A few KDA steps of a batch of requests, each continuing a state held in a pool row.

    With 1-D ``state_indices``, request ``n`` starts from ``state_pool[state_indices[n]]``, runs
    its steps of the recurrence (as :func:`kda.recurrent_kda` would with that row as
    ``initial_state``) and writes its final state back into that row, in place. With 2-D
    ``state_indices [N, T]`` (speculative verification, the convention of flash-linear-attention
    and vLLM), request ``n`` starts from slot ``[n, num_accepted_tokens[n] - 1]`` and writes its
    state after step ``t`` into slot ``[n, t]``.

    Parameters
    ----------
    q, k : array, shape ``[N, H, T, K]`` (``[N, T, H, K]`` with ``layout="time_major"``)
        Queries and keys of the ``N`` requests (``[1, H, T_total, K]`` with ``cu_seqlens``:
        request ``n`` is steps ``cu_seqlens[n]:cu_seqlens[n + 1]``).
    v : array, shape ``[N, HV, T, V]``
        Values (``HV`` a multiple of ``H``: grouped value heads).
    g : array, shape ``[N, HV, T, K]``
        Gates: log decays ``<= 0`` with ``gate="log"``, raw gates otherwise.
    beta : array, shape ``[N, HV, T]``
        Delta-rule step sizes (raw, with ``beta_activation``).
    state_pool : array, shape ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``state_v_first``)
        The pool of states, writable; updated in place. float32, float16 or bfloat16
        (``ml_dtypes.bfloat16`` for NumPy) for float32 and 16-bit inputs, float64 for float64
        inputs: a row is read as it is, the steps compute in float32 (float64) and every state
        stored is rounded to the pool's dtype (to nearest even). Rows that no request names
        are neither read nor written (bitwise unchanged).
    state_indices : integer array or list, shape ``[N]`` or ``[N, T]``
        ``[N]``: the row of each request (``-1`` or ``pad_slot_id``: a padding request, whose
        output is zeros and which reads and writes no state). ``[N, T]``: a row per step
        (``-1`` / ``pad_slot_id``: that step's state is not kept; a request whose start slot is
        padding is a padding request and must be padding throughout); columns past a request's
        length are ignored. A request may name its own row at several steps (they are written
        in step order: the row ends with the state after the last of them); no row is named by
        two requests.
    num_accepted_tokens : integer array or list, shape ``[N]``, optional
        With 2-D ``state_indices`` only: request ``n`` starts from slot
        ``[n, num_accepted_tokens[n] - 1]``, each in ``1..T`` (``T``: the request's steps).
        Default: all 1 (start from slot ``[n, 0]``).
    state_v_first : bool
        The pool is V-major, ``[P, HV, V, K]`` (vLLM's Kimi Linear layers): read and written in
        that layout in place, as fast as a K-major pool.
    pad_slot_id : int
        The index that marks padding besides ``-1``: ``-1`` (default) or a pool row reserved
        for padding (vLLM's KDA layers pass 0); that row is neither read nor written.
    scale : float, optional
        Query scale; default ``K ** -0.5``.
    backend : {None, "reference", "cpu", "cuda"}
        ``None`` picks from the arrays' namespace; CuPy arrays run one CUDA kernel.
    {options}
        (``check_finite`` scans the inputs, not the pool: that would read every row.)

    Returns
    -------
    output : array, shape ``[N, HV, T, V]`` (``[N, T, HV, V]`` time-major), dtype of the inputs.

    Raises
    ------
    InvalidInputError
        Wrong shapes, an index outside ``[-1, P)``, a row named twice in a call, a
        ``num_accepted_tokens`` outside ``1..T``, a pool that cannot be written in place (a
        read-only NumPy array, an immutable namespace such as JAX). Nothing is written then.
    InvalidTypeError
        Wrong dtypes (the pool must be the compute dtype) or array types.
    """
    if opts.cu_seqlens is None and (state_v_first is False or state_v_first is True):
        out = _numpy_route(q, k, v, g, beta, state_pool, state_indices, scale=scale, backend=backend,
                           opts=opts, num_accepted_tokens=num_accepted_tokens, v_first=state_v_first,
                           pad=pad_slot_id)  # fmt: skip
        if out is not None:
            return out
    call = open_call(q, k, v, g, beta, scale, opts, backend=backend)
    p = call.p
    v_first = check_state_v_first(state_v_first)
    P = check_pool(state_pool, p, v_first)
    pad = check_pad_slot_id(pad_slot_id, P)
    slots = check_slots(state_indices, num_accepted_tokens, p.N, p.T, p.offsets, P, pad)
    call.check_inputs_finite(q=q, k=k, v=v, g=g, beta=beta)
    return _run(call, Inputs(q, k, v, g, beta), state_pool, slots, v_first=v_first)


# the body (options as one Choices), which the adapters' host layer calls directly
decode_kda_body = decode_kda
decode_kda = takes_options()(decode_kda)

_ROWS: dict[int, Slots] = {}  # N -> request n on row n (arange(N), int64, read-only): decode_states


def _rows(N: int) -> Slots:
    """The slots of :func:`decode_states`: request ``n`` reads row ``n`` and writes row ``n``."""
    slots = _ROWS.get(N)
    if slots is None:
        import numpy as np

        rows = np.arange(N, dtype=np.int64)
        rows.flags.writeable = False
        slots = _ROWS[N] = Slots(rows, rows.reshape(N, 1))
    return slots


def decode_states(
    q: Array, k: Array, v: Array, g: Array, beta: Array, initial_state: Array | None = None, *,
    state_v_first: bool = False, scale: float | None = None, backend: str | None = None, opts: Choices,
) -> KdaOutput:  # fmt: skip
    """:func:`kda.recurrent_kda`'s forward through the decode kernel: ``(output, final_state, None)``.

    Request ``n`` (batch row, or packed sequence with ``cu_seqlens``) starts from
    ``initial_state[n]`` (zeros when None) and its final state is written into a new
    ``final_state [N, HV, K, V]`` (``[N, HV, V, K]``, read and written V-major, with
    ``state_v_first``); ``initial_state`` is only read. As for :func:`decode_kda`,
    ``check_finite`` scans the step inputs, not the states. The adapters' recurrent forward
    (``fused_recurrent_kda``) runs here.
    """
    v_first = state_v_first is True
    if initial_state is not None and opts.cu_seqlens is None:
        import numpy as np

        plain = (
            type(initial_state) is np.ndarray and initial_state.ndim == 4 and initial_state.dtype == q.dtype
        )
        if plain and getattr(q, "ndim", 0) == 4 and initial_state.shape[0] == q.shape[0]:
            final = np.empty(initial_state.shape, initial_state.dtype)
            rows = _rows(initial_state.shape[0])
            out = _numpy_route(q, k, v, g, beta, initial_state, rows.start, scale=scale, backend=backend,
                               opts=opts, final_pool=final, slots=rows, v_first=v_first)  # fmt: skip
            if out is not None:
                return KdaOutput(out, final, None)
    call = open_call(q, k, v, g, beta, scale, opts, backend=backend)
    p, xp = call.p, call.p.xp
    v_first = check_state_v_first(state_v_first)
    call.check_inputs_finite(q=q, k=k, v=v, g=g, beta=beta)
    shape = (p.N, p.HV, p.V, p.K) if v_first else (p.N, p.HV, p.K, p.V)
    final = xp.zeros(shape, dtype=p.compute_dtype, device=array_api_compat.device(q))
    slots = _rows(p.N)
    if initial_state is None:
        return KdaOutput(_run(call, Inputs(q, k, v, g, beta), final, slots, v_first=v_first), final, None)
    if v_first:
        rows = "B" if p.offsets is None else "N"
        check_array("initial_state", initial_state, p, shape, f"{rows}, HV, V, K", p.compute_dtype,
                    "states are float64 for float64 inputs, float32 otherwise")  # fmt: skip
    else:
        check_state("initial_state", initial_state, p)
    o = _run(call, Inputs(q, k, v, g, beta), initial_state, slots, final_pool=final, v_first=v_first)
    return KdaOutput(o, final, None)


# the body (options as one Choices), which the adapters' host layer calls directly
decode_states_body = decode_states
decode_states = takes_options()(decode_states)


# ----------------------------------------------------------------------------------------------
# the direct NumPy route


_NUMPY_BACKENDS: dict[Any, Any] = {}  # backend argument -> the backend module NumPy arrays run on


def _numpy_backend(backend: Any) -> Any:
    """The backend :func:`~kda._backend.get_backend` gives NumPy arrays for ``backend`` (as the
    general route's :func:`~kda._entry.call.open_call`), looked up once; None where it refuses
    (the general route words the error)."""
    ops = _NUMPY_BACKENDS.get(backend)
    if ops is None and (backend is None or isinstance(backend, str)):
        import numpy as np

        try:
            ops = _NUMPY_BACKENDS[backend] = get_backend(np, backend)
        except KdaError:
            return None
    return ops


def _numpy_route(
    q, k, v, g, beta, pool, state_indices, *, scale, backend, opts, final_pool=None, num_accepted_tokens=None,
    slots=None, v_first=False, pad=PADDING,
) -> Any:  # fmt: skip
    """The output of a plain NumPy call, or None to take the general route.

    A plain call (:func:`~kda._options.table.is_plain`: the options leave the inputs as they are)
    runs the backend's kernel on the arrays as given, through the backend's own screen of them
    (``decode_screen``: dtypes, contiguity, ``g <= 0`` and finiteness, in one pass on the cpu
    backend) and of the output (``decode_finite``). Every check of the general route that can
    fail for such a call is made here too (types, shapes, dtypes, the pool's writability, the
    slots by :func:`check_slots` itself); any failure returns None before anything is written,
    and the general route raises its own error. ``final_pool``: the pool that receives the
    states (checked by the caller), or None (``pool``, in place); ``slots``: the :class:`Slots`
    of ``state_indices`` where the caller knows them valid (each request its own row:
    :func:`decode_states`), or None to check them here; ``v_first``: the pools' layout (a
    bool); ``pad``: ``pad_slot_id``.
    """
    import numpy as np

    nd = np.ndarray
    if not (type(q) is nd and type(k) is nd and type(v) is nd and type(g) is nd and type(beta) is nd
            and type(pool) is nd):  # fmt: skip
        return None
    if not is_plain(opts):
        return None
    ops = _numpy_backend(backend)
    screen = getattr(ops, "decode_screen", None)
    if screen is None:
        return None
    dt, shape, head_major = q.dtype, q.shape, opts.layout == "head_first"
    pool_dt = pool.dtype is dt or (dt.type is np.float32 and is_half_pool(pool.dtype))
    if not (pool_dt and k.shape == shape and g.shape == shape and len(shape) == 4 and v.ndim == 4
            and v.shape[:3] == shape[:3] and beta.shape == shape[:3] and pool.ndim == 4):  # fmt: skip
        return None
    N, K, V = shape[0], shape[3], v.shape[3]
    H, T = (shape[1], shape[2]) if head_major else (shape[2], shape[1])
    writable = final_pool is not None or pool.flags.writeable  # a separate final_pool: pool is only read
    if pool.shape[1:] != ((H, V, K) if v_first else (H, K, V)) or not writable or not _plain_scale(scale):
        return None
    if type(pad) is not int or not PADDING <= pad < pool.shape[0]:
        return None
    if slots is None:
        slots = _direct_slots(state_indices, num_accepted_tokens, N, T, pool.shape[0], pad)
    if slots is None:
        return None
    check = opts.check_finite is True
    if not screen(q, k, v, g, beta, check):  # dtypes, contiguity, g <= 0, finite
        return None
    s = K**-0.5 if scale is None else float(scale)
    start, dest = slots.start, slots.dest
    if not head_major:
        q, k, v = q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)  # (no generator: per-call cost)
        g, beta = g.swapaxes(1, 2), beta.swapaxes(1, 2)
    out = ops.decode_forward(q, k, v, g, beta, s, pool, start, dest, final_pool=final_pool, v_first=v_first)
    # the output's finiteness in one pass of the backend (no warning from a sum of large finite values)
    if check and not ops.decode_finite(out):
        warn_if_diverged(np, out, stacklevel=3)
    return out if head_major else out.swapaxes(1, 2)


def _direct_slots(
    state_indices: Any, num_accepted_tokens: Any, N: int, T: int, P: int, pad: int = PADDING
) -> Slots | None:
    """:func:`check_slots`' result, or None where it would raise. The common decode call (int64
    NumPy ``[N]``, a few requests, ``pad_slot_id=-1``) is checked inline, the same checks."""
    import numpy as np

    if (
        pad == PADDING and num_accepted_tokens is None and type(state_indices) is np.ndarray
        and state_indices.dtype == np.int64 and state_indices.shape == (N,)
        and state_indices.flags.c_contiguous and 0 < N <= SMALL
    ):  # fmt: skip
        rows = state_indices.tolist()
        named = [r for r in rows if r >= 0]
        if min(rows) < PADDING or max(rows) >= P or len(set(named)) != len(named):
            return None
        return Slots(state_indices, state_indices.reshape(N, 1))
    try:
        return check_slots(state_indices, num_accepted_tokens, N, T, None, P, pad)
    except KdaError:
        return None


def _plain_scale(scale: Any) -> bool:
    if scale is None or type(scale) is float:  # the adapters pass a float: no ABC check
        return scale is None or math.isfinite(scale)
    return isinstance(scale, numbers.Real) and not isinstance(scale, bool) and math.isfinite(scale)


# ----------------------------------------------------------------------------------------------
# the prepared form


@dataclass
class DecodePlan:
    """A validated decode call, to run many times on refilled inputs (:func:`prepare_decode_kda`).

    Attributes
    ----------
    out : the output buffer ``[N, HV, T, V]`` (time-major: ``[N, T, HV, V]``) every run writes.
    """

    call: Call
    inputs: Inputs  # q .. beta
    pool: Any
    state_indices: Any
    num_accepted_tokens: Any
    out: Any
    P: int
    direct: bool  # the kernel reads the bound arrays as they are (no option maps, no casts)
    v_first: bool = False  # the pool is [P, HV, V, K]
    pad: int = PADDING  # pad_slot_id

    def __post_init__(self) -> None:
        p, xp = self.call.p, self.call.p.xp
        # what runs read: head-first views of the bound buffers (valid while they are refilled)
        self._views = tuple(head_first(xp, x, p.layout) for x in self.inputs.steps)
        self._buffer = head_first(xp, self.out, p.layout)
        idx = self.state_indices
        one_d = (
            _is_int64_vector(idx, p.N) and self.num_accepted_tokens is None and p.offsets is None
            and self.pad == PADDING
        )  # fmt: skip
        self._rows = Slots(idx, idx.reshape(p.N, 1)) if one_d else None

    def run(self) -> Any:
        """Run from the current contents of the bound arrays; returns :attr:`out`.

        Re-checks what a caller refills between runs: the slots (``state_indices``,
        ``num_accepted_tokens``: range, repeats, counts; O(N T), the pool is not read) and, for
        a log gate on host arrays, ``max(g) <= 0``. Shapes, dtypes and options are not re-checked.
        """
        p = self.call.p
        if self._rows is not None and p.N <= SMALL:
            _check_rows(
                "state_indices", self._rows.start.tolist(), self.P, "two requests cannot share a state"
            )
            slots = self._rows
        else:
            slots = check_slots(
                self.state_indices, self.num_accepted_tokens, p.N, p.T, p.offsets, self.P, self.pad
            )
        self._recheck_gate()
        if not self.direct:
            return _run(self.call, self.inputs, self.pool, slots, out=self.out, v_first=self.v_first)
        buffer = self._buffer
        ops = self.call.core.ops
        if self.v_first:
            o = ops.decode_forward(*self._views, p.scale, self.pool, slots.start, slots.dest,
                                   offsets=p.offsets, out=buffer, v_first=True)  # fmt: skip
        else:
            o = ops.decode_forward(
                *self._views, p.scale, self.pool, slots.start, slots.dest, offsets=p.offsets, out=buffer
            )
        if o is not buffer:
            buffer[...] = o
        return self.out

    def _recheck_gate(self) -> None:
        g, xp = self.inputs.g, self.call.p.xp
        if self.call.options.gate != "log" or array_api_compat.is_cupy_namespace(xp) or g.size == 0:
            return
        if not bool((g.max() if hasattr(g, "max") else xp.max(g)) <= 0):
            msg = "g must hold log decays <= 0 (-inf allowed); the refilled g has a positive or NaN element"
            raise InvalidInputError(msg)


def _is_int64_vector(x: Any, N: int) -> bool:
    import numpy as np

    return type(x) is np.ndarray and x.dtype == np.int64 and x.shape == (N,) and x.flags.c_contiguous


@takes_options()
def prepare_decode_kda(
    q: Array, k: Array, v: Array, g: Array, beta: Array, state_pool: Array, state_indices: Array, *,
    num_accepted_tokens: Array | None = None, state_v_first: bool = False, pad_slot_id: int = PADDING,
    out: Array | None = None, scale: float | None = None, backend: str | None = None, opts: Choices,
) -> DecodePlan:  # fmt: skip
    """Validate a :func:`decode_kda` call once and bind its arrays: ``plan.run()`` runs it again.

    The arguments are those of :func:`decode_kda`, plus ``out``: a writable output buffer
    ``[N, HV, T, V]`` (``[N, T, HV, V]`` time-major) of the inputs' dtype, or None to allocate
    one. Every run reads the *current contents* of the bound arrays, ``state_indices`` and
    ``num_accepted_tokens`` included (refill them in place; their shapes are fixed), and writes
    :attr:`DecodePlan.out`. On NumPy, a plain problem (float32 / float64, ``gate="log"``, no
    ``qk_l2norm`` or beta activation, ``HV == H``) allocates nothing in ``run()``: the kernel
    reads the bound arrays and writes ``out`` and the pool directly.

    Parameters
    ----------
    q, k, v, g, beta, state_pool, state_indices, num_accepted_tokens, state_v_first, pad_slot_id, scale
        As for :func:`decode_kda` (and ``backend``); the inputs must be C-contiguous.
    out : array, optional
        The output buffer.
    {options}

    Returns
    -------
    DecodePlan
    """
    call = open_call(q, k, v, g, beta, scale, opts, backend=backend)
    p = call.p
    v_first = check_state_v_first(state_v_first)
    P = check_pool(state_pool, p, v_first)
    pad = check_pad_slot_id(pad_slot_id, P)
    check_slots(state_indices, num_accepted_tokens, p.N, p.T, p.offsets, P, pad)
    call.check_inputs_finite(q=q, k=k, v=v, g=g, beta=beta)
    for name, x in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta)):
        if not c_contiguous(x):
            msg = f"prepared decode requires C-contiguous bindings: {name} (shape {tuple(x.shape)}) is not"
            raise InvalidInputError(msg)
    shape = p.shape(p.HV, p.V)
    if out is None:
        out = p.xp.zeros(shape, dtype=p.dtype, device=array_api_compat.device(q))
    else:
        check_array("out", out, p, shape, p.letters("HV", "V"), p.dtype, "the dtype of q")
        if not array_api_compat.is_writeable_array(out) or not c_contiguous(out):
            msg = "out must be a writable C-contiguous array (runs write the output into it)"
            raise InvalidInputError(msg)
    direct = call.options.is_identity and p.H == p.HV and p.dtype == p.compute_dtype
    return DecodePlan(
        call=call, inputs=Inputs(q, k, v, g, beta), pool=state_pool, state_indices=state_indices,
        num_accepted_tokens=num_accepted_tokens, out=out, P=P, direct=direct, v_first=v_first, pad=pad,
    )  # fmt: skip
