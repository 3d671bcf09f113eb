"""The direct NumPy route of :func:`kda.decode_kda` and :func:`~kda._entry.decode.decode_states`.

A plain call on NumPy arrays (float32 or float64, a plain call by the option table's
:func:`~kda._options.table.is_plain`, ``HV == H``; any slot form) whose backend screens its inputs
(``decode_screen``) runs the backend's kernel on the arrays as given: the same checks as the
general route written out (the slots by :func:`~kda._options.packing.check_slots` itself, the
value checks in the backend's ``decode_screen``, one compiled pass on the cpu backend) and the
same kernel, reached through :func:`~kda._backend.get_backend` as the general route reaches it,
so the results are bitwise those of the general route. Any check that fails hands the call to the
general route, which words the error. No validation beyond these: a step costs ~25 us.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .._backend import get_backend
from .._errors import KdaError
from .._options.arguments import c_contiguous
from .._options.checks import warn_if_diverged
from .._options.packing import PADDING, SMALL, Slots, check_slots, is_half_pool
from .._options.table import is_plain

__all__ = ["numpy_route"]


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


def numpy_route(
    q,
    k,
    v,
    g,
    beta,
    pool,
    state_indices,
    *,
    scale,
    backend,
    opts,
    final_pool=None,
    num_accepted_tokens=None,
    slots=None,
    v_first=False,
    pad=PADDING,
) -> Any:
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
    if not (
        type(q) is nd
        and type(k) is nd
        and type(v) is nd
        and type(g) is nd
        and type(beta) is nd
        and type(pool) is nd
    ):
        return None
    if not is_plain(opts):
        return None
    ops = _numpy_backend(backend)
    if ops is None:
        return None
    dt, shape, head_major = q.dtype, q.shape, opts.layout == "head_first"
    pool_dt = pool.dtype is dt or (dt.type is np.float32 and is_half_pool(pool.dtype))
    if not (
        pool_dt
        and k.shape == shape
        and g.shape == shape
        and len(shape) == 4
        and v.ndim == 4
        and v.shape[:3] == shape[:3]
        and beta.shape == shape[:3]
        and pool.ndim == 4
    ):
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
    if not ops.decode_screen(q, k, v, g, beta, finite=check):  # dtypes, contiguity, g <= 0, finite
        return None
    s = K**-0.5 if scale is None else float(scale)
    start, dest = slots.start, slots.dest
    if not head_major:
        q, k, v = q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)  # (no generator: per-call cost)
        g, beta = g.swapaxes(1, 2), beta.swapaxes(1, 2)
    out = ops.decode_forward(
        q, k, v, g, beta, pool, start, dest, scale=s, final_pool=final_pool, v_first=v_first
    )
    # the output's finiteness in one pass of the backend (no warning from a sum of large finite values)
    if check and not ops.decode_finite(out):
        warn_if_diverged(np, out)
    return out if head_major else out.swapaxes(1, 2)


def _direct_slots(
    state_indices: Any, num_accepted_tokens: Any, N: int, T: int, P: int, pad: int = PADDING
) -> Slots | None:
    """:func:`check_slots`' result, or None where it would raise. The common decode call (int64
    NumPy ``[N]``, a few requests, ``pad_slot_id=-1``) is checked inline, the same checks."""
    import numpy as np

    if (
        pad == PADDING
        and num_accepted_tokens is None
        and type(state_indices) is np.ndarray
        and state_indices.dtype == np.int64
        and state_indices.shape == (N,)
        and c_contiguous(state_indices)
        and 0 < N <= SMALL
    ):
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
