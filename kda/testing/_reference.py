"""The exact float64 reference of a :class:`~kda.testing.Problem`, from kda's recurrence."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .._entry.api import recurrent_kda, recurrent_kda_backward
from .._entry.call import KdaGradients
from .._errors import InvalidInputError, InvalidTypeError
from ._problems import Problem

__all__ = ["GRADIENTS", "Reference", "log_decay", "reference"]

GRADIENTS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


class Reference(NamedTuple):
    """The exact results of a problem, float64, head-first.

    Attributes
    ----------
    output : ``[B, HV, T, V]``
    final_state : ``[N, HV, K, V]``
    boundaries : ``[NT, B, HV, K, V]``, the state at the start of each chunk of the problem's
        chunk size (64 when it has none); packed: ``[NT, 1, HV, K, V]``, ``NT = sum(ceil(len_i / C))``.
    grads : :class:`kda.KdaGradients` or None
        Every gradient (``initial_state``, ``A_log``, ``dt_bias`` None when not inputs).
    grad_scales : dict
        The magnitude each element's error is judged against where a gradient is a sum of
        cancelling terms or products with a saturating gate (see :func:`kda.testing.assert_close`):
        ``"g"`` for the softplus / lower-bound gates, ``max |d log-decay| * max |d log-decay / d g|``;
        ``"A_log"`` / ``"dt_bias"``,
        ``max |d log-decay| * sum |d log-decay / d parameter|``; with ``qk_l2norm``, ``"q"`` /
        ``"k"``, ``max |d q_hat| / |q|`` per row (the normalisation's Jacobian has norm ``1 / |q|``).
    """

    output: np.ndarray
    final_state: np.ndarray
    boundaries: np.ndarray | None
    grads: KdaGradients | None
    grad_scales: dict[str, np.ndarray]


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def log_decay(problem: Problem) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The log decay ``[B, HV, T, K]`` the gate makes of ``g``, and its partial derivatives with
    respect to ``A_log`` (``[B, HV, T, K]``, per element of ``A_log[h]``) and ``dt_bias``."""
    a = problem.arrays
    g = a["g"]
    if problem.gate == "log":
        return g, {}
    HV = problem.HV
    A = np.zeros(HV) if a["A_log"] is None else a["A_log"]
    b = np.zeros((HV, problem.K)) if a["dt_bias"] is None else a["dt_bias"]
    eA = np.exp(A)[None, :, None, None]
    x = g + b[None, :, None, :]
    with np.errstate(over="ignore", invalid="ignore"):
        if problem.gate == "softplus":
            ld = -eA * _softplus(x)
            parts = {"A_log": ld, "dt_bias": -eA * _sigmoid(x)}
        else:
            s = _sigmoid(eA * x)
            lb = float(problem.lower_bound)
            ld = lb * s
            ds = lb * s * (1.0 - s)
            parts = {"A_log": ds * eA * x, "dt_bias": ds * eA}
    return ld, parts


def _boundaries(
    problem: Problem, kw: dict[str, Any], scale: float | None, arrays: dict[str, Any] | None = None
) -> np.ndarray:
    """Chunk-start states by running the recurrence chunk by chunk (each from the last's end), on
    ``arrays`` (default: the problem's float64 arrays)."""
    a, C = problem.arrays if arrays is None else arrays, problem.effective_chunk
    kw = {n: x for n, x in kw.items() if n != "cu_seqlens"}
    names = ("q", "k", "v", "g", "beta")
    states = []
    if problem.cu_seqlens is None:
        seqs = [(slice(None), 0, problem.T, None)]
    else:
        cu = problem.cu_seqlens
        seqs = [(slice(0, 1), cu[i], cu[i + 1], i) for i in range(problem.N)]
    for rows, start, end, i in seqs:
        if i is None:
            s = a["initial_state"]
            s = np.zeros((problem.B, problem.HV, problem.K, problem.V), a["v"].dtype) if s is None else s
        else:
            s0 = a["initial_state"]
            s = np.zeros((1, problem.HV, problem.K, problem.V), a["v"].dtype) if s0 is None else s0[i : i + 1]
        for t in range(start, end, C):
            states.append((s, rows))
            stop = min(t + C, end)
            x = [a[n][rows, :, t:stop] for n in names]
            s = recurrent_kda(*x, initial_state=s, scale=scale, backend="reference", **kw).final_state
    if not states:
        return np.zeros((0, problem.B, problem.HV, problem.K, problem.V))
    return np.stack([s for s, _ in states])


def reference(
    problem: Problem,
    grad_output: np.ndarray | None = None,
    grad_final_state: np.ndarray | None = None,
    *,
    backward: bool = True,
    boundaries: bool = True,
) -> Reference:
    """The exact float64 results of ``problem`` from kda's recurrence (``kda.recurrent_kda`` on
    the reference backend, in float64, on the inputs rounded to the problem's dtype).

    Parameters
    ----------
    problem : Problem
    grad_output : array ``[B, HV, T, V]``, optional
        Gradient of the output (head-first); default ``problem.arrays["grad_output"]``.
    grad_final_state : array ``[N, HV, K, V]``, optional
        Gradient of the final state; default ``problem.arrays["grad_final_state"]``.
    backward : bool
        Compute the gradients (else ``grads`` is None).
    boundaries : bool
        Compute the chunk-boundary states (else None).

    Returns
    -------
    Reference
    """
    if not isinstance(problem, Problem):
        raise InvalidTypeError(f"problem must be a kda.testing.Problem; got {type(problem).__name__}")
    a = problem.arrays
    kw = problem.options()
    scale = problem.scale
    x = [a[n] for n in ("q", "k", "v", "g", "beta")]
    s0 = a["initial_state"]
    out = recurrent_kda(*x, initial_state=s0, scale=scale, backend="reference", **kw)
    bounds = _boundaries(problem, kw, scale) if boundaries else None
    if not backward:
        return Reference(out.output, out.final_state, bounds, None, {})
    do = a["grad_output"] if grad_output is None else np.asarray(grad_output, dtype=np.float64)
    ds = a["grad_final_state"] if grad_final_state is None else np.asarray(grad_final_state, dtype=np.float64)
    if do.shape != out.output.shape:
        raise InvalidInputError(f"grad_output must have shape {out.output.shape}; got {do.shape}")
    if ds.shape != out.final_state.shape:
        raise InvalidInputError(f"grad_final_state must have shape {out.final_state.shape}; got {ds.shape}")
    grads = recurrent_kda_backward(*x, do, ds, initial_state=s0, scale=scale, backend="reference", **kw)
    if s0 is None:
        grads = grads._replace(initial_state=None)
    scales: dict[str, np.ndarray] = {}
    g_shape = a["g"].shape
    if problem.gate != "log":
        ld, parts = log_decay(problem)
        log_kw = {n: v for n, v in kw.items() if n not in ("gate", "A_log", "dt_bias", "lower_bound")}
        dlog = recurrent_kda_backward(
            x[0], x[1], x[2], ld, x[4], do, ds, initial_state=s0, scale=scale, backend="reference", **log_kw
        ).g
        finite = dlog[np.isfinite(dlog)]
        top = float(np.max(np.abs(finite))) if finite.size else 0.0
        # d g = d log-decay * (d log-decay / d g), whose largest value is exp(A_log) (softplus)
        # or |lower_bound| exp(A_log) / 4: computed where the gate saturates, that factor is the
        # difference of numbers near 1 and carries an absolute error of its dtype's epsilon
        eA = np.exp(a["A_log"]) if a["A_log"] is not None else np.ones(problem.HV)
        bound = eA if problem.gate == "softplus" else abs(float(problem.lower_bound)) * eA / 4
        scales["g"] = np.broadcast_to(top * bound[None, :, None, None], g_shape)
        with np.errstate(invalid="ignore"):
            if a["A_log"] is not None:
                scales["A_log"] = top * np.nansum(np.abs(parts["A_log"]), axis=(0, 2, 3))
            if a["dt_bias"] is not None:
                scales["dt_bias"] = top * np.nansum(np.abs(parts["dt_bias"]), axis=(0, 2))
    if problem.qk_l2norm:  # dq = J^T dq_hat, J = (I - q_hat q_hat^T) / |q|: its terms cancel too
        norms = {n: np.sqrt(np.sum(a[n] ** 2, axis=-1, keepdims=True) + 1e-6) for n in ("q", "k")}
        unit = {n: a[n] / norms[n] for n in ("q", "k")}
        plain = {n: v for n, v in kw.items() if n != "qk_l2norm"}
        hat = recurrent_kda_backward(
            unit["q"], unit["k"], *x[2:], do, ds, initial_state=s0, scale=scale, backend="reference", **plain
        )
        for n, d in (("q", hat.q), ("k", hat.k)):
            top = float(np.max(np.abs(d))) if d.size else 0.0
            scales[n] = np.broadcast_to(top / norms[n], a[n].shape)
    return Reference(out.output, out.final_state, bounds, grads, scales)
