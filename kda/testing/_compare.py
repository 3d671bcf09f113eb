"""The dtype-relative comparison kda's own tests use (:func:`assert_close`, :data:`TOLERANCES`).

:func:`kda.testing.check_kernel` judges float32 kernels against error scales that follow the
problem instead (:mod:`kda.testing._scale`, ``docs/testing.md``); for float64, float16 and bfloat16
it keeps these tolerances, with a floor of half an ulp of the inputs' magnitudes.

Rule: ``max |actual - expected| <= tol[dtype] * scale`` over the elements where ``expected`` is
finite, with ``scale = max |expected|`` (per tensor) unless given; ``actual`` must be finite
wherever ``expected`` is. ``expected`` is the exact float64 result *on the inputs rounded to the
dtype* (:attr:`kda.testing.Problem.arrays`), so input rounding, which the kernel cannot undo, is
not counted against it.

Tolerances (relative to the tensor's max-abs), measured with ``python -m kda.testing.calibrate``
(:mod:`kda.testing.calibrate`: derandomised draws of :func:`kda.testing.problems` per dtype;
kda's chunked forward and backward against this reference, and a "perfect" kernel, the exact
results rounded to the dtype once more):

===========  ==========  ===========  =========
dtype        perfect     kda (worst)  tolerance
===========  ==========  ===========  =========
float64      0           3.0e-14      1e-10
float32      5.9e-8      3.4e-6       3e-5
float16      4.7e-4      4.7e-4       4e-3
bfloat16     3.7e-3      3.7e-3       3e-2
===========  ==========  ===========  =========

(150 examples per dtype, 600 for float32.) float32's tail is heavier than that run shows:
tensors of one element (``T = 1``, one head) have no larger element to normalise by, and a
``beta`` gradient that is a 12-term dot product which cancels measured 1.07e-5 (found by
``check_kernel`` on ``kda.chunk_kda``); 3e-5 keeps a margin of about 3 over it. float16 and
bfloat16 inputs are calibrated against an exact computation on the rounded inputs: the inputs are
rounded to the dtype, the float64 recurrence runs on them, and its result rounded to the dtype is
the best any kernel can return, half a unit in the last place of the largest element (``2**-11``,
``2**-8``); kda computes in float32 and reaches exactly that. The tolerance is 8 such units, left
for the half-precision intermediates a GPU kernel keeps (tensor-core products of ``q, k, v`` and
the chunk's ``W, U`` in the input dtype, a few roundings each amplified by the chunk's products);
a kernel off by a factor ``1 + 1e-2`` in one tensor still fails float16 (ratio 2.5).

Gate parameters: ``A_log[h]`` and ``dt_bias[h, k]`` gradients are sums over steps (and
channels) of the log-decay gradient times the gate's partial derivative, and those terms cancel:
the sum can be orders of magnitude below its terms. They are judged against the error the
log-decay gradient's own tolerance allows them, ``max |d log-decay| * sum |d log-decay / d
parameter|`` (per element; :attr:`kda.testing.Reference.grad_scales`), not against the sum.
The raw gate's gradient of the softplus and lower-bound gates is ``d log-decay`` times the gate's
derivative, which saturates (``sigmoid(30) (1 - sigmoid(30))`` is 0 in float32), so it is judged
against ``max |d log-decay| * max |d log-decay / d g|`` (``exp(A_log)``, or ``|lower_bound|
exp(A_log) / 4``). With ``qk_l2norm`` the same holds for ``q`` and ``k``:
``dq = (I - q_hat q_hat^T) dq_hat / |q|``
cancels when ``dq_hat`` is nearly parallel to ``q`` (always, for ``K = 1``), so ``dq`` is judged
against ``max |dq_hat| / |q|`` per row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._dtypes import dtype_name
from .._errors import InvalidInputError, InvalidTypeError

__all__ = ["TOLERANCES", "Mismatch", "assert_close", "compare", "to_numpy", "tolerance"]

TOLERANCES: dict[str, float] = {"float64": 1e-10, "float32": 3e-5, "float16": 4e-3, "bfloat16": 3e-2}


class Mismatch(AssertionError):
    """An :func:`assert_close` failure; ``ratio`` is the worst error over its tolerance."""

    def __init__(self, message: str, *, name: str, ratio: float, check: str = "accuracy") -> None:
        super().__init__(message)
        self.name = name
        self.ratio = ratio
        self.check = check


def tolerance(dtype: Any) -> float:
    """The relative tolerance of inputs of ``dtype`` (a name, NumPy or torch dtype)."""
    name = dtype_name(dtype)
    if name not in TOLERANCES:
        raise InvalidTypeError(f"dtype must be one of {tuple(TOLERANCES)}; got {dtype!r}")
    return TOLERANCES[name]


def to_numpy(x: Any) -> np.ndarray:
    """Any array (NumPy, array-api-strict, torch on any device, CuPy, JAX, ...) as a NumPy array;
    bfloat16 as float64."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        x = x.detach().cpu()
        return x.to(torch.float64).numpy() if x.dtype == torch.bfloat16 else x.resolve_conj().numpy()
    if mod.startswith("cupy"):
        return x.get()
    if hasattr(x, "__array__") and not hasattr(x, "__dlpack__"):
        return np.asarray(x)
    try:
        return np.from_dlpack(x)
    except (TypeError, BufferError, RuntimeError):
        a = np.asarray(x)
        return a.astype(np.float64) if a.dtype.kind == "V" or "bfloat16" in str(a.dtype) else a


def _as_float64(x: Any, name: str) -> np.ndarray:
    a = to_numpy(x)
    if "bfloat16" in str(a.dtype):
        a = a.astype(np.float32)
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise InvalidTypeError(f"{name} must be a real array; got dtype {a.dtype}")
    return a.astype(np.float64)


def shapes_and_finite(actual: Any, expected: Any, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(actual, expected, finite)`` in float64 with ``finite`` the mask of finite ``expected``
    elements; :class:`Mismatch` (``check`` ``"shape"`` or ``"finite"``) when the shapes differ or
    ``actual`` is not finite where ``expected`` is."""
    a, e = _as_float64(actual, "actual"), _as_float64(expected, "expected")
    if a.shape != e.shape:
        raise Mismatch(
            f"{name}: shape {a.shape} != expected {e.shape}", name=name, ratio=np.inf, check="shape"
        )
    finite = np.isfinite(e)
    bad = finite & ~np.isfinite(a)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise Mismatch(
            f"{name}: {int(bad.sum())} non-finite elements where the reference is finite; first at "
            f"{idx}: got {a[idx]!r}, expected {e[idx]!r}",
            name=name,
            ratio=np.inf,
            check="finite",
        )
    return a, e, finite


def compare(
    actual: Any, expected: Any, *, dtype: Any, name: str = "", scale: Any = None, tol: float | None = None
) -> float:
    """The worst ratio of error to tolerance (``<= 1`` passes); raises :class:`Mismatch` with
    ``check="finite"`` or ``"shape"`` when those fail. See :func:`assert_close`; ``tol``
    overrides the dtype's tolerance."""
    if tol is None:
        tol = tolerance(dtype)
    elif not (isinstance(tol, float | int) and tol > 0):
        raise InvalidInputError(f"tol must be a positive number; got {tol!r}")
    label = name or "array"
    a, e, finite = shapes_and_finite(actual, expected, label)
    if not finite.any():
        return 0.0
    with np.errstate(invalid="ignore"):
        err = np.where(finite, np.abs(a - e), 0.0)
    top = float(np.max(np.abs(e[finite])))
    top = max(top, float(np.finfo(np.float32).tiny))
    if scale is None:
        allowed = np.full(e.shape, tol * top)
    else:
        s = np.broadcast_to(np.asarray(_as_float64(scale, "scale")), e.shape)
        allowed = tol * np.maximum(s, top)
    ratio = err / allowed
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    r = float(ratio[worst])
    if r > 1.0:
        idx = tuple(int(i) for i in worst)
        basis = "max|expected|" if scale is None else "its error scale"
        raise Mismatch(
            f"{label}: error {float(err[worst]):.3e} at {idx} is {r:.3g} x the tolerance "
            f"{float(allowed[worst]):.3e} ({tol:.0e} x {basis}); "
            f"got {a[worst]!r}, expected {e[worst]!r}",
            name=label,
            ratio=r,
        )
    return r


def assert_close(actual: Any, expected: Any, *, dtype: Any, name: str = "", scale: Any = None) -> float:
    """Assert ``actual`` matches the exact ``expected`` within the tolerance of ``dtype``.

    Parameters
    ----------
    actual : array of any namespace, shape ``S``
    expected : array, shape ``S``
        The exact (float64) result on the inputs rounded to ``dtype``.
    dtype : "float64", "float32", "float16", "bfloat16" (or a NumPy / torch dtype)
        The dtype of the kernel's inputs; selects :data:`TOLERANCES`.
    name : str
        The tensor's name, used in the message.
    scale : array broadcastable to ``S``, optional
        The magnitude each element's error is judged against (at least ``max |expected|``);
        for the gate parameters, :attr:`kda.testing.Reference.grad_scales`.

    Returns
    -------
    float
        The worst ratio of error to tolerance.

    Raises
    ------
    AssertionError
        (:class:`Mismatch`) naming the tensor, the worst index, both values and the ratio.
    """
    return compare(actual, expected, dtype=dtype, name=name, scale=scale)
