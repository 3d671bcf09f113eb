"""Segment transition maps: what sequence (context) parallelism over time rests on.

Over a segment of steps the state map is affine (``docs/design.md``, ``docs/sequence_parallel.md``)::

    S_end   = A S_start + N             A: [K, K] per head, N: [K, V]
    dS_start = A^T dS_end + D           D: [K, V], the start-state gradient when dS_end = 0

``A`` is the product of the chunk maps ``diag(total) - k_suffix^T W``, which do not depend on ``v``;
``N`` is the end state from a zero start; ``D`` depends on neither ``S_start`` nor ``v``. Both are
computed by the ordinary chunked passes: one forward with the value width widened to ``K + V``
(values ``[0, v]``, start state ``[I, 0]``, so that its end state is ``[A, N]``), and one backward
from a zero start with ``grad_final_state = 0``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import array_api_compat

from .._options.checks import warn_if_diverged
from .._options.table import Array, Choices
from .call import Call, Inputs, open_call

__all__ = [
    "KdaTransition",
    "chunk_kda_transition",
    "chunk_kda_transition_backward",
    "transition_gradient",
    "transition_map",
]


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


def chunk_kda_transition(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    backend: str | None = None,
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Array | None = None,
    check_finite: bool = True,
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
    layout : {"head_first", "time_major"}, default "head_first"
        ``"time_major"`` takes and returns ``[B, T, heads, ...]`` arrays. States are always
        ``[B, HV, K, V]``, boundaries ``[NT, B, HV, K, V]``.
    qk_l2norm : bool, default False
        Replace q and k by ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head.
    gate : {"log", "softplus", "lower_bound"}, default "log"
        The gate law (:mod:`kda._options.gates`), the log decay from ``g``: ``"log"``: ``g`` itself;
        ``"softplus"``: ``-exp(A_log[h]) * softplus(g + dt_bias[h])``; ``"lower_bound"``:
        ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (factor 1 when ``A_log`` is
        None).
    A_log : Array | None, default None
        shape ``[HV]``. Required for ``"softplus"``, optional for ``"lower_bound"``, refused
        for ``"log"``.
    dt_bias : Array | None, default None
        shape ``[HV, K]``. Gate bias (zeros when None); refused for ``"log"``.
    lower_bound : float | None, default None
        A float < 0, required for ``"lower_bound"`` only.
    beta_activation : {None, "sigmoid", "sigmoid2"}, default None
        Use ``beta``, ``sigmoid(beta)`` or ``2 * sigmoid(beta)`` (negative eigenvalues allowed).
    cu_seqlens : Array | None, default None
        1-D integer array of ``N + 1`` offsets. With ``B == 1``: the row holds ``N``
        independent sequences, sequence ``i`` at steps ``cu_seqlens[i]:cu_seqlens[i + 1]``;
        states are ``[N, HV, K, V]``, boundaries ``[NT, 1, HV, K, V]`` with
        ``NT = sum(ceil(len_i / C))``, in sequence order.
        With ``cu_seqlens``: one map per sequence, ``A: [N, HV, K, K]``.
    check_finite : bool, default True
        Refuse NaN or infinite inputs (``-inf`` stays legal in a log gate) with
        :class:`~kda.InvalidInputError`, and warn with :class:`~kda.KdaWarning` when finite
        inputs give non-finite results (the delta rule diverged). False skips both.

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
    choices = Choices(
        layout=layout,
        qk_l2norm=qk_l2norm,
        gate=gate,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        beta_activation=beta_activation,
        cu_seqlens=cu_seqlens,
        check_finite=check_finite,
    )
    call = open_call(q, k, v, g, beta, scale, choices, backend=backend, chunk_size=chunk_size)
    call.check_inputs_finite(q=q, k=k, v=v, g=g, beta=beta)
    return transition_map(call, Inputs.of(q, k, v, g, beta, choices))


def transition_map(call: Call, x: Inputs) -> KdaTransition:
    """:func:`chunk_kda_transition` of a validated (and scanned) ``call`` on the raw ``x.q .. x.beta``
    of its layout: what the public function and every composition (packed chunks, context
    parallelism, Dask shards) run, checking nothing again."""
    p, xp = call.problem, call.problem.xp
    if p.offsets is not None:  # one map per sequence: the ordinary forward, widened
        wide_v, start = _widened(xp, x.v, p.N, p.HV, p.K, p.compute_dtype)  # V is last in either layout
        out = call.widened(p.K + p.V).forward(x._replace(v=wide_v), start, False)
        return KdaTransition(out.final_state[..., : p.K], out.final_state[..., p.K :])
    c = call.core_inputs(x)
    wide_v, start = _widened(xp, c.v, p.N, p.HV, p.K, p.compute_dtype)
    end = call.end_state(dataclasses.replace(c, v=wide_v), start)
    if call.check:
        warn_if_diverged(xp, end)
    return KdaTransition(end[..., : p.K], end[..., p.K :])


def _widened(xp: Any, v: Any, N: int, HV: int, K: int, dtype: Any) -> tuple[Any, Any]:
    """Values ``[0, v]`` and the start state ``[I, 0]``: from them the end state is ``[A, N]``."""
    device = array_api_compat.device(v)
    wide_v = xp.concat([xp.zeros((*v.shape[:-1], K), dtype=v.dtype, device=device), v], axis=-1)
    eye = xp.eye(K, K + v.shape[-1], dtype=dtype, device=device)
    return wide_v, xp.broadcast_to(eye, (N, HV, K, K + v.shape[-1]))


def chunk_kda_transition_backward(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    grad_output: Array,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    backend: str | None = None,
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Array | None = None,
    check_finite: bool = True,
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
    scale, chunk_size, backend
        As for :func:`chunk_kda_transition`.
    layout : {"head_first", "time_major"}, default "head_first"
        ``"time_major"`` takes and returns ``[B, T, heads, ...]`` arrays. States are always
        ``[B, HV, K, V]``, boundaries ``[NT, B, HV, K, V]``.
    qk_l2norm : bool, default False
        Replace q and k by ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head.
    gate : {"log", "softplus", "lower_bound"}, default "log"
        The gate law (:mod:`kda._options.gates`), the log decay from ``g``: ``"log"``: ``g`` itself;
        ``"softplus"``: ``-exp(A_log[h]) * softplus(g + dt_bias[h])``; ``"lower_bound"``:
        ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (factor 1 when ``A_log`` is
        None).
    A_log : Array | None, default None
        shape ``[HV]``. Required for ``"softplus"``, optional for ``"lower_bound"``, refused
        for ``"log"``.
    dt_bias : Array | None, default None
        shape ``[HV, K]``. Gate bias (zeros when None); refused for ``"log"``.
    lower_bound : float | None, default None
        A float < 0, required for ``"lower_bound"`` only.
    beta_activation : {None, "sigmoid", "sigmoid2"}, default None
        Use ``beta``, ``sigmoid(beta)`` or ``2 * sigmoid(beta)`` (negative eigenvalues allowed).
    cu_seqlens : Array | None, default None
        1-D integer array of ``N + 1`` offsets. With ``B == 1``: the row holds ``N``
        independent sequences, sequence ``i`` at steps ``cu_seqlens[i]:cu_seqlens[i + 1]``;
        states are ``[N, HV, K, V]``, boundaries ``[NT, 1, HV, K, V]`` with
        ``NT = sum(ceil(len_i / C))``, in sequence order.
    check_finite : bool, default True
        Refuse NaN or infinite inputs (``-inf`` stays legal in a log gate) with
        :class:`~kda.InvalidInputError`, and warn with :class:`~kda.KdaWarning` when finite
        inputs give non-finite results (the delta rule diverged). False skips both.

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
    choices = Choices(
        layout=layout,
        qk_l2norm=qk_l2norm,
        gate=gate,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        beta_activation=beta_activation,
        cu_seqlens=cu_seqlens,
        check_finite=check_finite,
    )
    call = open_call(q, k, v, g, beta, scale, choices, backend=backend, chunk_size=chunk_size)
    do = call.grad_output(grad_output)
    call.check_inputs_finite(q=q, k=k, v=v, g=g, beta=beta, grad_output=grad_output)
    return transition_gradient(call, Inputs.of(q, k, v, g, beta, choices), do)


def transition_gradient(call: Call, x: Inputs, do: Any) -> Any:
    """:func:`chunk_kda_transition_backward` of a validated (and scanned) ``call`` on the raw
    ``x.q .. x.beta`` (``x.A_log``, ``x.dt_bias`` too) and the head-first output gradient ``do``
    in the compute dtype (:meth:`~kda._entry.call.Call.grad_output`), checking nothing again."""
    if call.problem.offsets is not None:  # one D per sequence: the ordinary backward's initial-state gradient
        return call.backward(x, call.zero_state(), None, do, call.zero_state()).initial_state
    return call.state_gradient(call.core_inputs(x), do)
