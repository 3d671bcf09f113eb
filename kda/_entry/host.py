"""The host side of the fla-style adapters (:mod:`kda.torch`, :mod:`kda.jax`): arrays in, arrays out.

Both adapters translate fla's keywords once (:func:`kda._entry.fla.translate`) into a hashable
``static`` tuple (an op's non-tensor arguments, a ``custom_vjp``'s static argument) and then do
only what their framework needs: convert tensors to arrays of one namespace (NumPy on the host,
CuPy on a GPU) and back, and register the forward and backward with their autograd. Everything
between is here, once:

- :func:`shapes`: the shapes of the forward's three results (for fake tensors and callbacks);
- :func:`forward`: ``(output, final_state, boundaries)``, the boundaries (chunk-start states)
  padded to a bound that does not depend on ``cu_seqlens``' values;
- :func:`backward`: the gradients' work, given the forward's boundaries and the cotangents.

Inputs are time-major (``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``,
``beta [B, T, HV]``), in the compute dtype (float32, or float64); states ``[N, HV, K, V]``;
``A_log [HV]``, ``dt_bias [HV, K]``; ``offsets`` are host ``cu_seqlens`` or None.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import array_api_compat

from . import api as _api
from . import decode as _decode
from .call import KdaGradients
from .fla import boundary_bound, core_options, packed_chunks
from .states import backward_with_state_gradients

__all__ = ["backward", "decode", "forward", "shapes"]

Arrays = tuple[Any, ...]  # q, k, v, g, beta, initial_state, A_log, dt_bias (None where absent)


def shapes(
    static: tuple[Any, ...], q_shape: tuple[int, ...], v_shape: tuple[int, ...], num_seqs: int | None
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Shapes of :func:`forward`'s ``(output, final_state, boundaries)``.

    ``num_seqs``: the number of packed sequences with ``cu_seqlens``, else None. The boundaries
    are ``[NT, B, HV, K, V]`` with ``NT`` :func:`~kda._entry.fla.boundary_bound`'s bound
    (``ceil(T / C)`` without ``cu_seqlens``), or ``[0]`` for the recurrence.
    """
    B, T, _, K = q_shape
    HV, V = v_shape[2], v_shape[3]
    N = B if num_seqs is None else num_seqs
    if static[0] != "chunk":
        return (B, T, HV, V), (N, HV, K, V), (0,)
    NT = boundary_bound(T, static[2], num_seqs)
    return (B, T, HV, V), (N, HV, K, V), (NT, B, HV, K, V)


def forward(static: tuple[Any, ...], x: Arrays, offsets: tuple[int, ...] | None) -> tuple[Any, Any, Any]:
    """``(output [B, T, HV, V], final_state [N, HV, K, V], boundaries)`` of one fla-style call.

    ``boundaries``: ``[NT, B, HV, K, V]`` (:func:`shapes`; rows past the packed chunks are zeros)
    for ``chunk_kda``, an empty ``[0]`` array for the recurrence. Arrays in the inputs' namespace.
    """
    opts = core_options(*static, offsets)
    params = dict(initial_state=x[5], A_log=x[6], dt_bias=x[7])
    if static[0] != "chunk":  # the recurrence's forward is the decode kernel's (no states kept)
        out = _decode.decode_states(*x[:5], **params, **opts)
        return out.output, out.final_state, out.final_state.reshape(-1)[:0]  # no boundaries: [0]
    out = _api.chunk_kda(*x[:5], save_boundaries=True, **params, **opts)
    NT = boundary_bound(x[0].shape[1], static[2], None if offsets is None else len(offsets) - 1)
    return out.output, out.final_state, _pad(out.boundaries, NT)


def decode(
    static: tuple[Any, ...], x: Arrays, pool: Any, state_indices: Any, num_accepted_tokens: Any,
    offsets: tuple[int, ...] | None,
) -> Any:  # fmt: skip
    """``fused_recurrent_kda`` from a state pool (vLLM's call): :func:`kda.decode_kda` on ``pool``
    (``[P, HV, K, V]``, updated in place) with ``state_indices`` (``[N]`` or ``[N, T]``) and
    ``num_accepted_tokens``; returns the output ``[B, T, HV, V]``. ``x[5]`` (the initial state)
    is unused: the pool is the state."""
    opts = core_options(*static, offsets)
    return _decode.decode_kda(*x[:5], pool, state_indices, num_accepted_tokens=num_accepted_tokens,
                              A_log=x[6], dt_bias=x[7], **opts)  # fmt: skip


def _pad(boundaries: Any, NT: int) -> Any:
    """``boundaries`` with zero rows appended up to ``NT`` (packed sequences: the static bound)."""
    if boundaries.shape[0] >= NT:
        return boundaries
    xp = array_api_compat.array_namespace(boundaries)
    shape = (NT - boundaries.shape[0], *boundaries.shape[1:])
    pad = xp.zeros(shape, dtype=boundaries.dtype, device=boundaries.device)
    return xp.concat([boundaries, pad])


def backward(
    static: tuple[Any, ...],
    x: Arrays,
    offsets: tuple[int, ...] | None,
    boundaries: Any,
    do: Any,
    dfinal: Any,
    dboundaries: Any,
) -> Callable[[], KdaGradients]:
    """The backward of :func:`forward`, as work to run: call the result for the gradients.

    ``boundaries``: :func:`forward`'s (padded); ``do [B, T, HV, V]`` the output's gradient;
    ``dfinal`` the final state's (None: zeros); ``dboundaries`` the boundaries' (None or all
    zeros: they did not reach the loss; else :func:`backward_with_state_gradients`). The result
    is returned to be called, so that the adapter's own frame runs the gradients (the call path
    stays short). Gradients ``(q, k, v, g, beta, initial_state, A_log, dt_bias)`` come in
    :class:`~kda.KdaGradients`, each shaped like its input.
    """
    opts = core_options(*static, offsets)
    params = dict(initial_state=x[5], A_log=x[6], dt_bias=x[7])
    if static[0] != "chunk":
        return functools.partial(_api.recurrent_kda_backward, *x[:5], do, dfinal, **params, **opts)
    NT = boundaries.shape[0] if offsets is None else packed_chunks(offsets, static[2])
    if dboundaries is not None:
        xp = array_api_compat.array_namespace(dboundaries)
        if bool(xp.any(dboundaries[:NT, ...])):  # the chunk-start states reached the loss
            del opts["cu_seqlens"]
            opts.update(A_log=x[6], dt_bias=x[7])
            return functools.partial(
                backward_with_state_gradients,
                x[:5], boundaries[:NT, ...], do, dfinal, dboundaries[:NT, ...], x[5], offsets, opts,
            )  # fmt: skip
    return functools.partial(
        _api.chunk_kda_backward, *x[:5], boundaries[:NT, ...], do, dfinal, **params, **opts
    )
