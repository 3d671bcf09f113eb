"""The step-by-step KDA recurrence and its hand-written backward: the oracle.

Per batch and head, with state ``S: [K, V]`` and for each step ``t``::

    S'  = diag(exp(g_t)) S_{t-1}
    u_t = beta_t * (v_t - S'^T k_t)
    S_t = S' + k_t u_t^T
    o_t = scale * S_t^T q_t

All arrays are vectorised over ``[B, H]``; the loop runs over ``T``. :func:`step` is the one
step of the recurrence in this backend: the forward, the backward's recomputation of states and
:mod:`._decode` all run it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from array_api_compat import array_namespace

from .._backend import Gradients
from ._blocks import decay

__all__ = ["Step", "recurrent_backward", "recurrent_forward", "step"]


def _vecmat(xp: Any, x: Any, M: Any) -> Any:
    """``x^T M`` for ``x: [..., K]`` and ``M: [..., K, V]`` -> ``[..., V]``."""
    return xp.matmul(x[..., None, :], M)[..., 0, :]


def _matvec(xp: Any, M: Any, y: Any) -> Any:
    """``M y`` for ``M: [..., K, V]`` and ``y: [..., V]`` -> ``[..., K]``."""
    return xp.matmul(M, y[..., :, None])[..., 0]


def _at(t: int, *arrays: Any) -> list[Any]:
    """Step ``t`` of each ``[B, H, T, ...]`` array."""
    return [x[:, :, t, ...] for x in arrays]


class Step(NamedTuple):
    """One step of the recurrence from ``S_{t-1}``: the new state and output, and the intermediates
    the backward reads (shapes for states ``[..., K, V]``)."""

    state: Any  # S_t = S' + k_t u_t^T, [..., K, V]
    output: Any  # o_t = scale S_t^T q_t, [..., V]; None when the step was given no q
    decay: Any  # exp(g_t), [..., K]
    decayed: Any  # S' = diag(exp(g_t)) S_{t-1}, [..., K, V]
    residual: Any  # v_t - S'^T k_t, [..., V]
    u: Any  # u_t = beta_t (v_t - S'^T k_t), [..., V]


def step(
    xp: Any, S: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, *, read_once: bool = False
) -> Step:
    """One step of the recurrence, vectorised over the leading dimensions.

    Parameters
    ----------
    xp : the array namespace of the arrays.
    S : ``[..., K, V]``, the state before the step.
    q, k, g : ``[..., K]``; v : ``[..., V]``; beta : ``[...]``: the step's inputs. ``q`` None: no
        output (the backward recomputing the states between its checkpoints).
    scale : float
    read_once : how the two products with the state are formed. False: as the recurrence is written
        (the arrangement :func:`recurrent_backward` differentiates), ``S'`` first, then the
        prediction ``S'^T k_t`` and the output ``scale S_t^T q_t``. True (the decode): both from
        one product with ``S``, ``[k_t e, q_t e]^T S`` with ``e = exp(g_t)``, which gives the
        prediction and ``S'^T q_t``; then ``o_t = scale (S'^T q_t + (q_t . k_t) u_t)``, equal to
        ``scale S_t^T q_t``. The two arrangements agree to rounding, not bit for bit.

    Returns
    -------
    Step
    """
    e = decay(xp, g)
    decayed = e[..., :, None] * S
    if read_once:
        both = xp.matmul(xp.stack([k * e, q * e], axis=-2), S)  # [..., 2, V]
        predicted = both[..., 0, :]
    else:
        predicted = _vecmat(xp, k, decayed)
    residual = v - predicted
    u = beta[..., None] * residual
    state = decayed + k[..., :, None] * u[..., None, :]
    if q is None:
        output = None
    elif read_once:
        output = scale * (both[..., 1, :] + xp.sum(q * k, axis=-1)[..., None] * u)
    else:
        output = scale * _vecmat(xp, q, state)
    return Step(state, output, e, decayed, residual, u)


def recurrent_forward(
    q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, *, scale: float
) -> tuple[Any, Any]:
    """Run the recurrence.

    Parameters
    ----------
    q, k, g : ``[B, H, T, K]``; v : ``[B, H, T, V]``; beta : ``[B, H, T]``;
    state : ``[B, H, K, V]``, the state before the first step. All in one floating dtype.

    Returns
    -------
    output : ``[B, H, T, V]``; final_state : ``[B, H, K, V]``.
    """
    xp = array_namespace(q, k, v, g, beta, state)
    B, H, T, _ = q.shape
    S = state
    outs = []
    for t in range(T):
        S, o, *_ = step(xp, S, *_at(t, q, k, v, g, beta), scale)
        outs.append(o)
    if T == 0:
        return xp.zeros((B, H, 0, v.shape[-1]), dtype=v.dtype, device=v.device), S
    return xp.stack(outs, axis=2), S


def recurrent_backward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    state: Any,
    grad_output: Any,
    dfinal: Any,
    *,
    scale: float,
) -> Gradients:
    """Gradients of the recurrence, stepping backwards through time.

    States are kept at every ``ceil(sqrt(T))``-th step and the ones between are recomputed,
    so memory grows as ``sqrt(T)`` states rather than ``T``.

    Parameters
    ----------
    q, k, v, g, beta, state, scale : as for :func:`recurrent_forward`.
    grad_output : ``[B, H, T, V]``; dfinal : ``[B, H, K, V]``, gradient of the final state.

    Returns
    -------
    dq, dk, dv, dg, dbeta, dinitial : gradients with the shapes of ``q, k, v, g, beta, state``.
    """
    xp = array_namespace(q, k, v, g, beta, state, grad_output, dfinal)
    T = q.shape[2]
    stride = max(1, math.isqrt(max(T - 1, 0)) + 1)
    checkpoints = {}
    S = state
    for t in range(T):
        if t % stride == 0:
            checkpoints[t] = S
        S = step(xp, S, None, *_at(t, k, v, g, beta), scale).state

    grads: list[list[Any]] = [[] for _ in range(5)]  # dq, dk, dv, dg, dbeta, last step first
    dS = dfinal
    for start in reversed(range(0, T, stride)):
        stop = min(start + stride, T)
        previous = [checkpoints[start]]  # previous[i]: the state before step start + i
        for t in range(start, stop - 1):
            previous.append(step(xp, previous[-1], None, *_at(t, k, v, g, beta), scale).state)
        for t in reversed(range(start, stop)):
            q_t, k_t, v_t, g_t, b_t, do_t = _at(t, q, k, v, g, beta, grad_output)
            S_t, _, e, Sd, r, u = step(xp, previous[t - start], None, k_t, v_t, g_t, b_t, scale)
            e = e[..., :, None]
            # o_t = scale S_t^T q_t
            dq_t = scale * _matvec(xp, S_t, do_t)
            dS = dS + scale * q_t[..., :, None] * do_t[..., None, :]
            # S_t = S' + k u^T
            du = _vecmat(xp, k_t, dS)
            dk_t = _matvec(xp, dS, u)
            # u = beta (v - S'^T k)
            db_t = xp.sum(du * r, axis=-1)
            dr = b_t[..., None] * du
            dk_t = dk_t - _matvec(xp, Sd, dr)
            dSd = dS - k_t[..., :, None] * dr[..., None, :]
            # S' = diag(exp(g)) S_{t-1}
            dg_t = xp.sum(dSd * Sd, axis=-1)
            dS = e * dSd
            for acc, x in zip(grads, (dq_t, dk_t, dr, dg_t, db_t)):
                acc.append(x)
    if T == 0:
        dq, dk, dv, dg, dbeta = (
            xp.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, g, beta)
        )
    else:
        dq, dk, dv, dg, dbeta = (xp.stack(acc[::-1], axis=2) for acc in grads)
    return Gradients(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dinitial=dS)
