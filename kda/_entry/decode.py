"""Decoding from a state pool: ``decode_kda``.

A serving engine keeps the recurrent states of its requests in one pool ``[P, HV, K, V]`` and
runs a batch of requests, each a few steps long (one for decoding, a few for speculative
verification), against the rows it names. The rows are updated in place; rows that no request
names are not touched at all.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from .._errors import InvalidInputError, InvalidTypeError
from .._options.checks import warn_if_diverged
from .._options.maps import head_first
from .._options.table import Array, Choices, takes_options
from .._options.validation import STATE_DTYPE_RULE, Problem, _host_integers, check_array
from .call import open_call

__all__ = ["decode_kda"]

PADDING = -1


def check_pool(state_pool: Any, p: Problem) -> int:
    """Validate the pool ``[P, HV, K, V]`` (compute dtype, writable in place); return ``P``."""
    if not array_api_compat.is_array_api_obj(state_pool) or state_pool.ndim != 4:
        shape = getattr(state_pool, "shape", None)
        msg = (
            f"state_pool must be a 4-D array [P, HV, K, V]; got {type(state_pool).__name__} of shape {shape}"
        )
        raise InvalidInputError(msg) if shape is not None else InvalidTypeError(msg)
    P = int(state_pool.shape[0])
    check_array(
        "state_pool", state_pool, p, (P, p.HV, p.K, p.V), "P, HV, K, V", p.compute_dtype, STATE_DTYPE_RULE
    )
    if not array_api_compat.is_writeable_array(state_pool):
        msg = (
            "state_pool must be writable in place (it is updated in place); got a read-only or "
            f"immutable {type(state_pool).__module__}.{type(state_pool).__name__}"
        )
        raise InvalidInputError(msg)
    return P


def check_indices(state_indices: Any, N: int, P: int) -> tuple[int, ...]:
    """``N`` host ints, each ``-1`` (padding) or a distinct row of a pool of ``P`` rows."""
    try:
        host = _host_integers("state_indices", state_indices)
    except InvalidTypeError as err:  # its message also offers None, which is cu_seqlens' case
        msg = f"state_indices must be a 1-D integer array or list of ints; got {type(state_indices).__name__}"
        if hasattr(state_indices, "dtype"):
            msg += f" of dtype {state_indices.dtype}"
        raise InvalidTypeError(msg) from err
    if host.shape != (N,):
        msg = f"state_indices must have shape [N] = ({N},), one row per request; got {tuple(host.shape)}"
        raise InvalidInputError(msg)
    bad = [int(i) for i in host if not PADDING <= i < P]
    if bad:
        msg = f"state_indices must be -1 (padding) or a row in [0, {P}) of state_pool; got {bad[:5]}"
        raise InvalidInputError(msg)
    rows = [int(i) for i in host if i != PADDING]
    if len(set(rows)) != len(rows):
        seen: set[int] = set()
        dups = sorted({r for r in rows if r in seen or seen.add(r)})
        msg = (
            "state_indices must name each pool row at most once (two requests cannot share a state); "
            f"got {dups} more than once"
        )
        raise InvalidInputError(msg)
    return tuple(int(i) for i in host)


@takes_options(exclude=("cu_seqlens",))
def decode_kda(
    q: Array, k: Array, v: Array, g: Array, beta: Array, state_pool: Array, state_indices: Array, *,
    scale: float | None = None, backend: str | None = None, opts: Choices,
) -> Any:  # fmt: skip
    """A few KDA steps of a batch of requests, each continuing the state held in a pool row.

    Request ``n`` starts from ``state_pool[state_indices[n]]``, runs its ``T`` steps of the
    recurrence (as :func:`kda.recurrent_kda` would with that row as ``initial_state``) and writes
    its final state back into that row, in place.

    Parameters
    ----------
    q, k : array, shape ``[N, H, T, K]`` (``[N, T, H, K]`` with ``layout="time_major"``)
        Queries and keys of the ``N`` requests.
    v : array, shape ``[N, HV, T, V]``
        Values (``HV`` a multiple of ``H``: grouped value heads).
    g : array, shape ``[N, HV, T, K]``
        Gates: log decays ``<= 0`` with ``gate="log"``, raw gates otherwise.
    beta : array, shape ``[N, HV, T]``
        Delta-rule step sizes (raw, with ``beta_activation``).
    state_pool : array, shape ``[P, HV, K, V]``
        The pool of states, float32 (float64 for float64 inputs), writable; updated in place.
        Rows that no request names are left bitwise unchanged.
    state_indices : 1-D integer array or list, shape ``[N]``
        Row of ``state_pool`` of each request, or ``-1`` for a padding request (its output is
        zeros and it reads and writes no state). Non-negative indices must be distinct.
    scale : float, optional
        Query scale; default ``K ** -0.5``.
    backend : {None, "reference", "cuda"}
        ``None`` picks from the arrays' namespace; CuPy arrays run one CUDA kernel.
    {options}
        (``check_finite`` scans the inputs, not the pool: that would read every row.)

    Returns
    -------
    output : array, shape ``[N, HV, T, V]`` (``[N, T, HV, V]`` time-major), dtype of the inputs.

    Raises
    ------
    InvalidInputError
        Wrong shapes, an index outside ``[-1, P)``, a row named twice, a pool that cannot be
        written in place (a read-only NumPy array, an immutable namespace such as JAX).
    InvalidTypeError
        Wrong dtypes (the pool must be the compute dtype) or array types.
    """
    call = open_call(q, k, v, g, beta, scale, opts, backend=backend)
    p, xp = call.p, call.p.xp
    P = check_pool(state_pool, p)
    indices = check_indices(state_indices, p.B, P)
    call.check_inputs_finite(q=q, k=k, v=v, g=g, beta=beta)
    c = call.core_inputs(q, k, v, g, beta)
    out = call.core.ops.decode_forward(c.q, c.k, c.v, c.g, c.beta, p.scale, state_pool, indices)
    out = head_first(xp, xp.astype(out, p.dtype, copy=False), p.layout)
    if call.check:
        warn_if_diverged(xp, out)
    return out
