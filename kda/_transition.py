"""Segment transition maps: what sequence (context) parallelism over time rests on.

Over a segment of steps the state map is affine (``design.md``, ``docs/sequence_parallel.md``)::

    S_end   = A S_start + N             A: [K, K] per head, N: [K, V]
    dS_start = A^T dS_end + D           D: [K, V], the start-state gradient when dS_end = 0

``A`` is the product of the chunk maps ``diag(total) - kt^T W``, which do not depend on ``v``;
``N`` is the end state from a zero start; ``D`` depends on neither ``S_start`` nor ``v``. Both are
computed by the ordinary chunked passes: one forward with the value width widened to ``K + V``
(values ``[0, v]``, start state ``[I, 0]``, so that its end state is ``[A, N]``), and one backward
from a zero start with ``grad_final_state = 0``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import array_api_compat

from ._api import _check_inputs_finite, _core_inputs, _grad_output, chunk_kda, chunk_kda_backward
from ._backends import get_backend
from ._checks import floating_point_quiet, warn_if_diverged
from ._chunked import _prepare, padded_chunk_size, slabs
from ._validation import check_chunk_size, check_options_call

__all__ = ["KdaTransition", "chunk_kda_transition", "chunk_kda_transition_backward"]


class KdaTransition(NamedTuple):
    """The affine state map of a segment: ``S_end = A @ S_start + N`` per batch row and value head.

    Attributes
    ----------
    A : ``[B, HV, K, K]`` (``[N, HV, K, K]`` with ``cu_seqlens``), float32 (float64 for float64
        inputs).
    N : ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``), same dtype: the end state
        from a zero start state.
    """

    A: Any
    N: Any


def _option_keywords(
    layout: str,
    qk_l2norm: bool,
    gate: str,
    A_log: Any,
    dt_bias: Any,
    lower_bound: float | None,
    beta_activation: str | None,
    cu_seqlens: Any,
    check_finite: bool,
) -> dict[str, Any]:
    """The model-level options, as keywords for :func:`kda.chunk_kda` and its backward."""
    return {
        "layout": layout,
        "qk_l2norm": qk_l2norm,
        "gate": gate,
        "A_log": A_log,
        "dt_bias": dt_bias,
        "lower_bound": lower_bound,
        "beta_activation": beta_activation,
        "cu_seqlens": cu_seqlens,
        "check_finite": check_finite,
    }


def _end_state(ops: Any, xp: Any, inputs: tuple, start: Any, scale: float, chunk_size: int) -> Any:
    """The state after the core's inputs ``q, k, v, g, beta`` from ``start``: states only, no outputs."""
    q, v = inputs[0], inputs[2]
    B, HV, T, K = q.shape
    if T == 0 or B * HV == 0:
        return xp.asarray(start, copy=True)
    C = min(chunk_size, T)
    state = start
    for n0, n1 in slabs(q.shape, C, max(K, v.shape[-1]), ops.SLAB_ELEMENTS):
        t = slice(n0 * C, min(n1 * C, T))
        loc = _prepare(ops, xp, *(x[:, :, t, ...] for x in inputs), scale, C).local
        state = ops.chunk_state_pass(loc.w, loc.u0, loc.kt, loc.total, state)[2]  # states only
    return state


def _shape_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options that validation takes (all but ``check_finite``)."""
    return {name: value for name, value in options.items() if name != "check_finite"}


def chunk_kda_transition(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Any = None,
    dt_bias: Any = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Any = None,
    check_finite: bool = True,
    backend: str | None = None,
) -> KdaTransition:
    """The affine state map of a segment of steps: ``S_end = A @ S_start + N``.

    For a sequence cut into consecutive segments (shards), every segment's map can be computed
    independently (in parallel); a scan ``S_{i+1} = A_i @ S_i + N_i`` over the small maps then
    gives every segment its true start state, from which :func:`kda.chunk_kda` computes that
    segment's outputs exactly. See ``docs/sequence_parallel.md``.

    Parameters
    ----------
    q, k, v, g, beta : array
        One segment's inputs, exactly as for :func:`kda.chunk_kda` (shapes by ``layout``; grouped
        value heads ``HV``). ``v`` does not enter ``A``; it only enters ``N``.
    scale, chunk_size, backend
        As for :func:`kda.chunk_kda`. The result does not depend on ``chunk_size`` beyond rounding.
    layout, qk_l2norm, gate, A_log, dt_bias, lower_bound, beta_activation, check_finite
        The model-level options, as for :func:`kda.chunk_kda`.
    cu_seqlens : 1-D int array ``[N + 1]``, optional
        Packed sequences (``B == 1``): one map per sequence, ``A: [N, HV, K, K]``.

    Returns
    -------
    KdaTransition
        ``(A [B, HV, K, K], N [B, HV, K, V])``, float32 (float64 for float64 inputs). For
        ``T == 0``, ``A`` is the identity and ``N`` zero.

    Notes
    -----
    Runs the state recurrence of one chunked forward whose value width is ``K + V`` (values
    ``[0, v]`` from the start state ``[I, 0]``, whose end state is ``[A, N]``), without forming
    outputs. With ``cu_seqlens`` it runs the ordinary forward so widened.
    """
    options = _option_keywords(
        layout, qk_l2norm, gate, A_log, dt_bias, lower_bound, beta_activation, cu_seqlens, check_finite
    )
    if cu_seqlens is not None:  # one map per sequence: the ordinary forward, widened
        return _packed_transition(q, k, v, g, beta, scale, chunk_size, backend, options)
    p, o = check_options_call(q, k, v, g, beta, scale, **_shape_options(options))
    chunk_size = check_chunk_size(chunk_size)
    ops = get_backend(p.xp, backend)
    _check_inputs_finite(p, o, check_finite, q=q, k=k, v=v, g=g, beta=beta)
    c = _core_inputs(p, o, q, k, v, g, beta)
    xp, device = p.xp, array_api_compat.device(c.v)
    # values widened to [0, v] and the start state [I, 0]: the end state is [A, N]
    wide_v = xp.concat([xp.zeros((*c.v.shape[:-1], p.K), dtype=c.v.dtype, device=device), c.v], axis=-1)
    eye = xp.eye(p.K, p.K + p.V, dtype=p.compute_dtype, device=device)
    start = xp.broadcast_to(eye, (p.N, p.HV, p.K, p.K + p.V))
    with floating_point_quiet(xp), ops.worker_context():  # one BLAS thread: small products
        end = _end_state(ops, xp, (c.q, c.k, wide_v, c.g, c.beta), start, p.scale, chunk_size)
    if check_finite:
        warn_if_diverged(xp, end, stacklevel=3)
    return KdaTransition(end[..., : p.K], end[..., p.K :])


def _packed_transition(
    q, k, v, g, beta, scale, chunk_size, backend, options: dict[str, Any]
) -> KdaTransition:
    """The maps of packed sequences: the public forward with values ``[0, v]`` from ``[I, 0]``."""
    p, _ = check_options_call(q, k, v, g, beta, scale, **_shape_options(options))
    xp, device = p.xp, array_api_compat.device(v)
    # v widened to [0, v] and the start state [I, 0]: the end state is [A, N]
    wide_v = xp.concat([xp.zeros((*v.shape[:-1], p.K), dtype=v.dtype, device=device), v], axis=-1)
    eye = xp.eye(p.K, p.K + p.V, dtype=p.compute_dtype, device=device)
    start = xp.broadcast_to(eye, (p.N, p.HV, p.K, p.K + p.V))
    out = chunk_kda(
        q,
        k,
        wide_v,
        g,
        beta,
        scale=scale,
        initial_state=start,
        chunk_size=chunk_size,
        backend=backend,
        **options,
    )
    return KdaTransition(out.final_state[..., : p.K], out.final_state[..., p.K :])


def chunk_kda_transition_backward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    grad_output: Any,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Any = None,
    dt_bias: Any = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Any = None,
    check_finite: bool = True,
    backend: str | None = None,
) -> Any:
    """The start-state gradient of a segment when its end-state gradient is zero: ``D``.

    With ``A`` from :func:`chunk_kda_transition`, the gradient of a segment's start state is
    ``dS_start = A^T @ dS_end + D`` (``A^T`` is ``matrix_transpose(A)``). A reverse scan over
    the segments gives every segment its true end-state gradient, from which
    :func:`kda.chunk_kda_backward` computes the exact gradients of that segment's inputs.

    Parameters
    ----------
    q, k, v, g, beta : array
        One segment's inputs, as for :func:`kda.chunk_kda`. ``D`` depends on neither ``v`` nor
        the start state.
    grad_output : array
        Gradient of the segment's output, shaped and typed like that output.
    scale, chunk_size, backend, layout, qk_l2norm, gate, A_log, dt_bias, lower_bound, \
beta_activation, cu_seqlens, check_finite
        As for :func:`chunk_kda_transition`.

    Returns
    -------
    array, shape ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``)
        ``D``, float32 (float64 for float64 inputs).

    Notes
    -----
    Runs only the state-gradient recurrence of the chunked backward (the state-free work of each
    chunk and one ``[K, V]`` product pair per chunk): no states, no gradients of the inputs. With
    ``cu_seqlens`` it runs the ordinary backward and returns its initial-state gradient.
    """
    options = _option_keywords(
        layout, qk_l2norm, gate, A_log, dt_bias, lower_bound, beta_activation, cu_seqlens, check_finite
    )
    if cu_seqlens is not None:  # one D per sequence: the ordinary backward's initial-state gradient
        grads = chunk_kda_backward(
            q, k, v, g, beta, None, grad_output, None, scale=scale, chunk_size=chunk_size, backend=backend,
            **options,
        )  # fmt: skip
        return grads.initial_state
    p, o = check_options_call(q, k, v, g, beta, scale, **_shape_options(options))
    chunk_size = check_chunk_size(chunk_size)
    ops = get_backend(p.xp, backend)
    do = _grad_output(p, grad_output)
    _check_inputs_finite(p, o, check_finite, q=q, k=k, v=v, g=g, beta=beta, grad_output=grad_output)
    c = _core_inputs(p, o, q, k, v, g, beta)
    with floating_point_quiet(p.xp), ops.worker_context():  # one BLAS thread: small products
        return _state_gradient(ops, p.xp, c, do, p.scale, chunk_size)


def _state_gradient(ops: Any, xp: Any, c: Any, do: Any, scale: float, chunk_size: int) -> Any:
    """``D`` by the state-gradient recurrence alone: no states, no gradients of the inputs.

    ``c``: the core's inputs (head-first, compute dtype, options applied); ``do``: ``[B, HV, T, V]``.
    Per chunk, from the last: ``dU = A^T dO + kt dS`` and
    ``dS <- total * dS + qg^T dO - W^T dU`` (the backend's ``chunk_state_grad_pass``).
    """
    B, HV, T, K = c.q.shape
    V = c.v.shape[-1]
    device = array_api_compat.device(c.q)
    dstate = xp.zeros((B, HV, K, V), dtype=c.q.dtype, device=device)
    if T == 0 or B * HV == 0:
        return dstate
    C = min(chunk_size, T)
    for n0, n1 in reversed(slabs(c.q.shape, C, max(K, V), ops.SLAB_ELEMENTS)):
        t = slice(n0 * C, min(n1 * C, T))
        loc = _prepare(ops, xp, *(x[:, :, t, ...] for x in (c.q, c.k, c.v, c.g, c.beta)), scale, C).local
        dO = ops.to_chunks(do[:, :, t, ...], C, padded_chunk_size(C))
        # D does not depend on the states: the pass runs from zero states (its U is not used)
        zeros = xp.zeros((n1 - n0, *dstate.shape), dtype=dstate.dtype, device=device)
        dstate = ops.chunk_state_grad_pass(
            loc.w, loc.u0, loc.kt, loc.total, loc.qg, loc.A, dO, zeros, dstate
        )[3]
    return dstate
