"""The host side of the fla-style adapters (:mod:`kda.torch`, :mod:`kda.jax`): arrays in, arrays out.

Both adapters translate fla's keywords once (:func:`kda._entry.fla.translate`) into a hashable
:class:`~kda._entry.fla.OpOptions` (an op's non-tensor arguments, a ``custom_vjp``'s static
argument; each function here takes it as such or as the plain tuple an op received) and then do
only what their framework needs: convert tensors to arrays of one namespace (NumPy on the host,
CuPy on a GPU) and back, and register the forward and backward with their autograd. Everything
between is here, once:

- :func:`route`: the one hand-off of a call's keywords: translated, the gate arrays' sizes
  checked, and which path runs it (the plain forward, a state pool, context parallelism);
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
from typing import Any, NamedTuple

import array_api_compat

from .._errors import InvalidInputError
from .._options.gates import PARAMETER_NAMES, any_given, parameter_values
from .._options.packing import num_chunks
from . import decode as _decode
from .call import Call, Inputs, KdaGradients, bind_call, build_call
from .fla import (
    FlaCall,
    OpOptions,
    boundary_bound,
    check_gate_sizes,
    translate,
)
from .states import backward_with_state_gradients

__all__ = [
    "Inputs",
    "Route",
    "backward",
    "check_pool_call",
    "decode",
    "forward",
    "route",
    "shapes",
    "validated_call",
]

# the bodies of kda.decode_kda and of the decode kernel's recurrent forward, which take the
# options as one Choices
_DECODE_STATES = _decode._decode_states
_DECODE = _decode._decode_kda


class Route(NamedTuple):
    """Where an fla-style call goes (:func:`route`)."""

    path: str  # "forward" (the chunked or recurrent forward), "pool" (decoding from a state pool), "cp"
    call: FlaCall


def route(
    function: str,
    q_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    kw: dict[str, Any],
    A_log: Any,
    dt_bias: Any,
    has_cu_seqlens: bool,
    cp: bool = False,
) -> Route:
    """The one hand-off of an adapter's call (``function``: ``"chunk_kda"`` or
    ``"fused_recurrent_kda"``, fla's keywords ``kw``): the keywords translated
    (:func:`~kda._entry.fla.translate`), ``A_log`` and ``dt_bias`` checked by element count
    (anything with a ``shape``, or None) and the path that runs it: ``"cp"`` with a context of
    context parallelism (``cp``), ``"pool"`` for ``fused_recurrent_kda`` on a state pool
    (``inplace_final_state``, ``ssm_state_indices`` or ``num_accepted_tokens``; those keywords
    checked to fit together, :func:`check_pool_call`), else ``"forward"``."""
    call = translate(
        function,
        q_shape,
        v_shape,
        kw,
        has_A_log=A_log is not None,
        has_dt_bias=dt_bias is not None,
        has_cu_seqlens=has_cu_seqlens,
    )
    if A_log is not None or dt_bias is not None:
        check_gate_sizes(A_log, dt_bias, call)
    if cp:
        return Route("cp", call)
    if function == "fused_recurrent_kda" and (
        kw.get("inplace_final_state")
        or kw.get("ssm_state_indices") is not None
        or kw.get("num_accepted_tokens") is not None
    ):
        pool, indices = kw.get("initial_state"), kw.get("ssm_state_indices")
        check_pool_call(kw, pool, indices, kw.get("num_accepted_tokens"))
        return Route("pool", call)
    return Route("forward", call)


def shapes(
    static: OpOptions, q_shape: tuple[int, ...], v_shape: tuple[int, ...], num_seqs: int | None
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Shapes of :func:`forward`'s ``(output, final_state, boundaries)``.

    ``num_seqs``: the number of packed sequences with ``cu_seqlens``, else None. The boundaries
    are ``[NT, B, HV, K, V]`` with ``NT`` :func:`~kda._entry.fla.boundary_bound`'s bound
    (``ceil(T / C)`` without ``cu_seqlens``), or ``[0]`` for the recurrence.
    """
    static = OpOptions.of(static)
    B, T, _, K = q_shape
    HV, V = v_shape[2], v_shape[3]
    N = B if num_seqs is None else num_seqs
    if static.method != "chunk":
        return (B, T, HV, V), (N, HV, K, V), (0,)
    NT = boundary_bound(T, static.chunk_size, num_seqs)
    return (B, T, HV, V), (N, HV, K, V), (NT, B, HV, K, V)


def forward(
    static: OpOptions, x: Inputs, offsets: tuple[int, ...] | None, v_first: bool = False
) -> tuple[Any, Any, Any]:
    """``(output [B, T, HV, V], final_state [N, HV, K, V], boundaries)`` of one fla-style call.

    The call is built by the validating door (:func:`~kda._entry.call.build_call`) from the
    call's :class:`~kda._options.spec.CallSpec` (``static.spec()``) and run as :func:`kda.chunk_kda`
    runs it (the recurrence: the decode kernel's, :func:`~kda._entry.decode.decode_states`): the
    inputs and options are validated here, once. ``boundaries``: ``[NT, B, HV, K, V]`` (:func:`shapes`;
    rows past the packed chunks are zeros) for ``chunk_kda``, an empty ``[0]`` array for the
    recurrence. Arrays in the inputs' namespace. ``v_first`` (the recurrence only): the initial
    and final states are V-major, ``[N, HV, V, K]``, read and written so by the decode kernel.
    """
    static = OpOptions.of(static)
    if static.method != "chunk":  # the recurrence's forward is the decode kernel's (no states kept)
        opts = _call_options(static, x, offsets)
        out = _DECODE_STATES(
            *x.steps, x.initial_state, state_v_first=v_first, scale=static.scale, backend=None, opts=opts
        )
        return out.output, out.final_state, out.final_state.reshape(-1)[:0]  # no boundaries: [0]
    call = build_call(static.spec(), x, cu_seqlens=offsets, defer_gate=True)
    state = call.state_or_zeros("initial_state", x.initial_state)
    finite = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, initial_state=x.initial_state)
    out = call.forward(x, state, True, check_inputs=finite)
    NT = boundary_bound(x.q.shape[1], static.chunk_size, None if offsets is None else len(offsets) - 1)
    return out.output, out.final_state, _pad(out.boundaries, NT)


def _call_options(static: OpOptions, x: Inputs, offsets: tuple[int, ...] | None) -> Any:
    """The table's :class:`~kda._options.table.Choices` of a call: made once per ``static`` for
    a call with no gate arrays and no offsets (immutable), else from the arrays."""
    params = parameter_values(x)
    if offsets is None and not any_given(params):
        return _plain_choices(static)
    return static.spec().choices(dict(zip(PARAMETER_NAMES, params)), offsets)


@functools.lru_cache(maxsize=256)
def _plain_choices(static: OpOptions) -> Any:
    return static.spec().choices()


def decode(
    static: OpOptions,
    x: Inputs,
    pool: Any,
    state_indices: Any,
    *,
    num_accepted_tokens: Any,
    offsets: tuple[int, ...] | None,
    v_first: bool = False,
    pad_slot_id: int = -1,
) -> Any:
    """``fused_recurrent_kda`` from a state pool (vLLM's call): :func:`kda.decode_kda` on ``pool``
    (``[P, HV, K, V]``, ``[P, HV, V, K]`` with ``v_first``; updated in place) with
    ``state_indices`` (``[N]`` or ``[N, T]``), ``num_accepted_tokens`` and ``pad_slot_id``;
    returns the output ``[B, T, HV, V]``. ``x.initial_state`` is unused: the pool is the state."""
    static = OpOptions.of(static)
    opts = _call_options(static, x, offsets)
    return _DECODE(
        *x.steps,
        pool,
        state_indices,
        num_accepted_tokens=num_accepted_tokens,
        state_v_first=v_first,
        pad_slot_id=pad_slot_id,
        scale=static.scale,
        backend=None,
        opts=opts,
    )


def check_pool_call(kw: dict[str, Any], pool: Any, indices: Any, accepted: Any) -> None:
    """The keywords of a pool call (vLLM's ``fused_recurrent_kda(..., initial_state=pool,
    ssm_state_indices=..., num_accepted_tokens=..., inplace_final_state=True)``) fit together;
    :class:`~kda.InvalidInputError` naming what is missing otherwise. The arrays themselves are
    checked by :func:`kda.decode_kda`."""
    if not kw.get("inplace_final_state", False):
        msg = (
            "ssm_state_indices and num_accepted_tokens need inplace_final_state=True (the state pool, "
            "initial_state, is updated in place)"
        )
        raise InvalidInputError(msg)
    if pool is None:
        msg = "inplace_final_state=True needs initial_state: the state pool [P, HV, K, V] it updates"
        raise InvalidInputError(msg)
    if accepted is not None and indices is None:
        msg = "num_accepted_tokens needs ssm_state_indices [N, T] (a slot per step)"
        raise InvalidInputError(msg)


def _pad(boundaries: Any, NT: int) -> Any:
    """``boundaries`` with zero rows appended up to ``NT`` (packed sequences: the static bound)."""
    if boundaries.shape[0] >= NT:
        return boundaries
    xp = array_api_compat.array_namespace(boundaries)
    shape = (NT - boundaries.shape[0], *boundaries.shape[1:])
    pad = xp.zeros(shape, dtype=boundaries.dtype, device=boundaries.device)
    return xp.concat([boundaries, pad])


def backward(
    static: OpOptions,
    x: Inputs,
    offsets: tuple[int, ...] | None,
    boundaries: Any,
    do: Any,
    dfinal: Any,
    dboundaries: Any,
) -> Callable[[], KdaGradients]:
    """The backward of :func:`forward`, as work to run: call the result for the gradients.

    ``x``, ``static`` and ``offsets`` are those that :func:`forward` validated, so they are not
    checked again (:func:`validated_call`); ``boundaries`` are its (padded) boundaries. The
    cotangents, new here, are checked for finiteness only: ``do [B, T, HV, V]`` the output's
    gradient, ``dfinal`` the final state's (None: zeros); ``dboundaries`` the boundaries' (None
    or all zeros: they did not reach the loss; else the work is
    :func:`~kda._entry.states.backward_with_state_gradients`, on calls derived from this one).

    The work is returned to be called, so that the adapter's own frame runs it: the call path
    from the adapter to the core is :meth:`Call.backward` alone. Gradients ``(q, k, v, g, beta,
    initial_state, A_log, dt_bias)`` come in :class:`~kda.KdaGradients`, each shaped like its
    input.
    """
    static = OpOptions.of(static)
    call = validated_call(static, x, offsets)
    if static.method != "chunk":
        boundaries = None
    else:
        NT = boundaries.shape[0] if offsets is None else num_chunks(static.chunk_size, offsets=offsets)
        boundaries = boundaries[:NT, ...]
        # the chunk-start states' gradients reached the loss
        if dboundaries is not None and bool(call.problem.xp.any(dboundaries[:NT, ...])):
            dboundaries = dboundaries[:NT, ...]
            call.check_finite(grad_output=do, grad_final_state=dfinal, grad_boundaries=dboundaries)
            return functools.partial(
                backward_with_state_gradients, call, x, boundaries, do, dfinal, dboundaries
            )
    call.check_finite(grad_output=do, grad_final_state=dfinal)
    state = call.zero_state() if x.initial_state is None else x.initial_state
    dfinal = call.zero_state() if dfinal is None else dfinal
    do = call.grad_output(do, check=False)
    return functools.partial(call.backward, x, state, boundaries, do, dfinal)


def validated_call(static: OpOptions, x: Inputs, offsets: tuple[int, ...] | None) -> Call:
    """The :class:`~kda._entry.call.Call` that :func:`forward` validated, rebuilt without checks
    (:func:`~kda._entry.call.bind_call`, the builder's non-validating door) from the same static
    options and arrays (compute dtype, time-major, ``A_log [HV]``, ``dt_bias [HV, K]``)."""
    return bind_call(OpOptions.of(static).spec(), x, offsets)
