"""Checks of values around a call: non-finite inputs, diverged results, floating-point warnings.

Each check costs one reduction per array on the common path (a sum: a NaN or an infinity anywhere
makes it non-finite) and looks at elements only when that sum says something is wrong, so it
stays a small fraction of a call (see README, "Non-finite input and divergence").
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from typing import Any

import array_api_compat

from .._errors import InvalidInputError, KdaWarning

__all__ = [
    "check_finite",
    "floating_point_quiet",
    "is_real_floating",
    "warn_at_caller",
    "warn_if_diverged",
]

STABILITY = (
    "the delta rule is stable only while beta * |k|^2 <= 2 at every step (each step multiplies the "
    "state by I - beta k k^T); fix: qk_l2norm=True or L2-normalised keys, with beta in [0, 2]"
)


def is_real_floating(xp: Any, dtype: Any) -> bool:
    """Whether ``dtype`` is a real floating dtype of ``xp``: the standard's (float16 where the
    library has it, float32, float64), and NumPy's ``ml_dtypes.bfloat16`` (which NumPy does not
    class as floating). kda computes float16 and bfloat16 in float32."""
    try:
        if xp.isdtype(dtype, "real floating"):
            return True
    except (TypeError, ValueError):
        pass
    return array_api_compat.is_numpy_namespace(xp) and getattr(dtype, "name", None) == "bfloat16"


def floating_point_quiet(xp: Any) -> contextlib.AbstractContextManager:
    """NumPy's overflow / invalid / divide warnings off inside the block, for this thread only.

    ``np.errstate`` is a context manager local to the thread (a context variable in NumPy >= 2),
    so it changes no process-wide setting. Other namespaces do not warn: a null context.
    """
    if array_api_compat.is_numpy_namespace(xp):
        import numpy as np

        return np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore")
    return contextlib.nullcontext()


def _sum_is_clean(xp: Any, x: Any, allow_neg_inf: bool) -> bool:
    """True when the sum of ``x`` rules out NaN and +inf (and -inf unless allowed) in ``x``.

    NaN propagates through every sum, and +inf makes it +inf or NaN, so a finite sum (or -inf
    where -inf is allowed) proves the elements clean. A non-finite sum may still be an overflow
    of finite elements: the caller then looks at the elements.
    """
    with floating_point_quiet(xp):
        total = xp.sum(x)
        if bool(xp.isfinite(total)):
            return True
        return allow_neg_inf and bool(total == -math.inf)


def _first_index(xp: Any, mask: Any) -> tuple[int, ...]:
    """Index of the first True element of ``mask`` in C order."""
    flat = xp.reshape(xp.astype(mask, xp.int8), (-1,))
    i = int(xp.argmax(flat))
    index = []
    for n in reversed(tuple(int(d) for d in mask.shape)):
        i, r = divmod(i, n)
        index.append(r)
    return tuple(reversed(index))


def check_finite(xp: Any, name: str, x: Any, *, allow_neg_inf: bool = False) -> None:
    """Raise :class:`~kda.InvalidInputError` if ``x`` holds a NaN or an infinity.

    Parameters
    ----------
    xp : the array namespace of ``x``.
    name : the argument's name, for the message.
    x : array of any shape, or None (nothing to check). Non-floating arrays pass.
    allow_neg_inf : bool
        ``-inf`` is legal (a log gate, where it is a hard reset); NaN and ``+inf`` are not.

    The message names the argument, how many elements are bad, and the index and value of the
    first one.
    """
    if x is None or not is_real_floating(xp, x.dtype) or _sum_is_clean(xp, x, allow_neg_inf):
        return
    with floating_point_quiet(xp):
        bad = xp.isnan(x) | (x == math.inf)
        if not allow_neg_inf:
            bad = bad | (x == -math.inf)
        count = int(xp.sum(xp.astype(bad, xp.int64)))
    if count == 0:  # the sum overflowed; every element is fine
        return
    index = _first_index(xp, bad)
    value = float(x[index])
    expected = "finite or -inf (a hard reset)" if allow_neg_inf else "finite"
    msg = (
        f"{name} must be {expected}; got {count} non-finite element{'s' if count > 1 else ''}, "
        f"the first {value} at index {index}. Pass check_finite=False to skip this check."
    )
    raise InvalidInputError(msg)


def _all_finite(xp: Any, x: Any) -> bool:
    if _sum_is_clean(xp, x, allow_neg_inf=False):
        return True
    with floating_point_quiet(xp):
        return bool(xp.all(xp.isfinite(x)))


# the kda package's directory: a frame whose file lies under it is kda's own. Functions that kda
# generates (entry points, fla-style signatures, the plain-call test) have "<kda ...>" file names.
_KDA_PREFIX = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_GENERATED_PREFIX = "<kda "


def _is_kda_file(filename: str) -> bool:
    return filename.startswith(_KDA_PREFIX) or filename.startswith(_GENERATED_PREFIX)


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """:func:`warnings.warn` attributed to the first frame outside the kda package: the line that
    called kda, whichever path (public function, plan, adapter, Dask task) led here.

    The stack level is counted by walking the frames, not fixed: the same warning reached through
    a public function and through an adapter has kda frames of different depths above it.
    """
    frame = sys._getframe(1)  # warnings.warn's stacklevel 2
    level = 2
    while frame is not None and _is_kda_file(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


def warn_if_diverged(xp: Any, *results: Any) -> bool:
    """Emit one :class:`~kda.KdaWarning` if any of ``results`` holds a NaN or an infinity.

    Called on the outputs (and states) of a call whose inputs were finite: a non-finite result
    then means the recurrence diverged. ``None`` entries are skipped. The warning names the
    caller's line (:func:`warn_at_caller`). Returns whether it warned.
    """
    shapes = [tuple(x.shape) for x in results if x is not None and not _all_finite(xp, x)]
    if not shapes:
        return False
    msg = (
        f"kda: finite inputs gave non-finite results (arrays of shape {', '.join(map(str, shapes))}): "
        f"{STABILITY}."
    )
    warn_at_caller(msg, KdaWarning)
    return True
