"""Error scales that follow the problem: what a correct kernel of the problem's dtype can meet.

For float32 problems each tensor ``X`` (output, final state, boundaries, every gradient) is judged
against

    scale_X = max(yardstick_X, floor_X)

- ``yardstick_X = max |X_32 - X_exact|``: the error of kda's own float32 recurrence (the step-by-step
  definition, :func:`kda.recurrent_kda` and its backward on the reference backend, which computes in
  the inputs' dtype and never widens) on the same rounded inputs. It carries the problem's
  conditioning: products of ``diag(exp g) - beta k k^T`` that float32 loses, gradients that are
  cancelling sums, saturated gates.
- ``floor_X = eps * max(max |X_exact|, magnitude_X)``: half an ulp of the tensor's largest element
  or of the magnitude its terms have, whichever is larger, with ``eps = 2**-24``. ``magnitude_X``
  is tied to the inputs: ``max(|v|, |initial_state|)`` for the forward tensors, that times
  ``max(|grad_output|, |grad_final_state|)`` for the gradients, and for the gate parameters and
  ``qk_l2norm``'s ``q, k`` the condition scales of :attr:`kda.testing.Reference.grad_scales`. An
  exact zero (a gradient that is 0 by cancellation) is then judged against the rounding of the
  terms that cancel, not against zero.

float64, float16 and bfloat16 problems keep the dtype-relative rule of :data:`TOLERANCES`
(``tol * max |X_exact|``; float16 and bfloat16 errors are dominated by rounding the result to the
dtype, float64's by nothing a float64 yardstick can show) with the same floor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._problems import Problem

__all__ = ["EPS", "IMPRECISE_BAND", "YARDSTICK_MARGIN", "error_scales", "judge", "verdict", "yardstick"]

# Half an ulp of each dtype: the unit of the floor
EPS = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
# float32: the scale is this many times max(yardstick, floor). A chunked kernel builds each chunk's
# state map in the WY form, a sum of C terms of order one, and its gate gradients as sums over the
# chunk's pairs; with few key channels that map is tiny and the sums' rounding, about C eps, is many
# times the step recurrence's error (kda/_engine/widening.py measured it; kda widens those chunks to
# float64, a third-party kernel need not). Measured (python -m kda.testing.calibrate --kernels, 300
# draws per kernel; docs/testing.md): worst error / max(yardstick, floor) 5.4 (kda reference), 4.5
# (kda cpu), 6.9 (kda.torch), 3.9 (transformers' recurrent fallback), 3.2 (fla's naive_recurrent_kda)
# and 49 (transformers' chunked fallback, K = 1, chunk 64); on 600 draws of K = 1, T in [40, 80] with
# zero or weak decays that chunked fallback reached 97 (K = 2: 44, K = 4: 29). 256 keeps a margin of
# 2.6 over the worst.
YARDSTICK_MARGIN = 256.0
# A ratio error / scale above 1 and at most this is "imprecise"; above it, "wrong". float32: 4 x the
# scale is 1024 x max(yardstick, floor) (about 1e-4 relative on a well-conditioned problem: a term off
# by 0.5 % is wrong); the other dtypes keep their dtype-relative tolerances, calibrated as the edge of
# correct, so their band is narrow.
IMPRECISE_BAND = {"float64": 2.0, "float32": 4.0, "float16": 2.0, "bfloat16": 2.0}

_FORWARD = ("output", "final_state", "boundaries")


def yardstick(problem: Problem, names: tuple[str, ...], backward: bool) -> dict[str, np.ndarray]:
    """kda's float32 recurrence on the problem's rounded inputs: ``{tensor name: result}`` (float64
    NumPy, head-first) for the forward tensors and ``d<input>`` gradients named in ``names``."""
    import kda

    from ._reference import GRADIENTS, _boundaries

    a = problem.arrays
    f32 = {n: None if x is None else x.astype(np.float32) for n, x in a.items()}
    kw = problem.options()
    for n in ("A_log", "dt_bias"):
        if n in kw:
            kw[n] = f32[n]
    x = [f32[n] for n in ("q", "k", "v", "g", "beta")]
    s0 = f32["initial_state"]
    out = kda.recurrent_kda(*x, initial_state=s0, scale=problem.scale, backend="reference", **kw)
    res: dict[str, np.ndarray] = {"output": out.output, "final_state": out.final_state}
    if "boundaries" in names:
        res["boundaries"] = _boundaries(problem, kw, problem.scale, arrays=f32)
    if backward and any(n.startswith("d") for n in names):
        gr = kda.recurrent_kda_backward(
            *x,
            f32["grad_output"],
            f32["grad_final_state"],
            initial_state=s0,
            scale=problem.scale,
            backend="reference",
            **kw,
        )
        for n, d in zip(GRADIENTS, gr):
            if d is not None and "d" + n in names:
                res["d" + n] = d
    return {n: np.asarray(v, dtype=np.float64) for n, v in res.items() if n in names}


def _max_abs(x: Any) -> float:
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(np.max(np.abs(x))) if x.size else 0.0


def magnitudes(problem: Problem) -> tuple[float, float]:
    """``(forward, gradient)`` magnitudes of the problem's terms, from its inputs."""
    a = problem.arrays
    fwd = max(_max_abs(a["v"]), _max_abs(a["initial_state"]) if a["initial_state"] is not None else 0.0)
    seeds = max(_max_abs(a["grad_output"]), _max_abs(a["grad_final_state"]))
    return fwd, seeds * max(fwd, 1.0)


def error_scales(
    problem: Problem,
    expected: dict[str, np.ndarray],
    grad_scales: dict[str, np.ndarray],
    backward: bool,
) -> dict[str, tuple[float, str]]:
    """The error scale of each expected tensor (see the module's docstring): ``{name: (scale,
    how it was formed)}``."""
    from ._compare import TOLERANCES

    dt = problem.dtype
    eps = EPS[dt]
    fwd, grad = magnitudes(problem)
    ys: dict[str, np.ndarray] = {}
    if dt == "float32":
        with np.errstate(all="ignore"):  # where float32 overflows, those elements are left out
            ys = yardstick(problem, tuple(expected), backward)
    out: dict[str, tuple[float, str]] = {}
    for n, e in expected.items():
        cond = _max_abs(grad_scales.get(n[1:], 0.0)) if n not in _FORWARD else 0.0
        mag = fwd if n in _FORWARD else max(grad, cond)
        top = _max_abs(e)
        floor = eps * max(top, mag)
        if dt == "float32":
            y = ys.get(n)
            with np.errstate(invalid="ignore"):
                ystick = 0.0 if y is None else _max_abs(np.where(np.isfinite(e), y - e, 0.0))
            basis = f"kda's float32 error {ystick:.2e}" if ystick >= floor else f"the floor {floor:.2e}"
            out[n] = (YARDSTICK_MARGIN * max(ystick, floor), f"{YARDSTICK_MARGIN:g} x {basis}")
        else:
            rel = TOLERANCES[dt] * max(top, cond)
            basis = f"{TOLERANCES[dt]:.0e} x max|expected|" if rel >= floor else f"the floor {floor:.2e}"
            out[n] = (max(rel, floor), basis)
    return out


def judge(actual: Any, expected: Any, scale: float, *, name: str) -> tuple[float, str]:
    """The worst ratio ``|actual - expected| / scale`` over the elements where ``expected`` is finite,
    and a description of the worst element; raises :class:`kda.testing.Mismatch` (``check`` of
    ``"shape"`` or ``"finite"``) when the shapes differ or ``actual`` is not finite where
    ``expected`` is."""
    from ._compare import shapes_and_finite

    a, e, finite = shapes_and_finite(actual, expected, name)
    if not finite.any():
        return 0.0, ""
    with np.errstate(invalid="ignore"):
        err = np.where(finite, np.abs(a - e), 0.0)
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    idx = tuple(int(i) for i in worst)
    r = float(err[worst]) / scale
    return r, f"error {float(err[worst]):.3e} at {idx} (got {a[worst]!r}, expected {e[worst]!r})"


def verdict(ratio: float, dtype: str) -> str:
    """``"accurate"`` (ratio <= 1), ``"imprecise"`` (up to :data:`IMPRECISE_BAND` of the dtype) or
    ``"wrong"``."""
    if ratio <= 1.0:
        return "accurate"
    return "imprecise" if ratio <= IMPRECISE_BAND[dtype] else "wrong"
