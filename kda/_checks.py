"""Checks of values around a call: non-finite inputs, diverged results, floating-point warnings.

Each check costs one reduction per array on the common path (a sum: a NaN or an infinity anywhere
makes it non-finite) and looks at elements only when that sum says something is wrong, so it
stays a small fraction of a call (see README, "Non-finite input and divergence").
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import array_api_compat

from ._errors import InvalidInputError, KdaWarning

__all__ = [
    "FLOAT32_MAX_CHUNK",
    "check_finite",
    "chunk_compute_dtype",
    "floating_point_quiet",
    "warn_if_diverged",
]

STABILITY = (
    "the delta rule is stable only while beta * |k|^2 <= 2 at every step (each step multiplies the "
    "state by I - beta k k^T); fix: qk_l2norm=True or L2-normalised keys, with beta in [0, 2]"
)


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
    if x is None or not xp.isdtype(x.dtype, "real floating") or _sum_is_clean(xp, x, allow_neg_inf):
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


def warn_if_diverged(xp: Any, *results: Any, stacklevel: int = 3) -> bool:
    """Emit one :class:`~kda.KdaWarning` if any of ``results`` holds a NaN or an infinity.

    Called on the outputs (and states) of a call whose inputs were finite: a non-finite result
    then means the recurrence diverged. ``None`` entries are skipped. ``stacklevel`` as for
    :func:`warnings.warn`, counted from this function (3: the caller of the public function
    that calls this). Returns whether it warned.
    """
    shapes = [tuple(x.shape) for x in results if x is not None and not _all_finite(xp, x)]
    if not shapes:
        return False
    msg = (
        f"kda: finite inputs gave non-finite results (arrays of shape {', '.join(map(str, shapes))}): "
        f"{STABILITY}."
    )
    warnings.warn(msg, KdaWarning, stacklevel=stacklevel)
    return True


# The largest chunk computed in float32, by key size K (the first row whose K bound is >= K).
# Each chunk's state map, prod_t (diag(exp g_t) - beta_t k_t k_t^T), is formed in the WY form as
# diag(total) - kt^T W: a sum of C terms of order one. With few key channels and weak decay the
# product is tiny (1e-13 for K = 2, C = 128), so its absolute error of about C * eps dominates
# the initial-state gradient. Measured worst float32 error against the float64 recurrence
# (zero and weak decay, beta in [0, 2], unit keys, T = max(512, 4 C), 6 seeds; 2 for K >= 32) at
# these bounds: K=1 C=4 1.6e-6, K=2 C=16 1.9e-6, K=3 C=32 2.6e-6, K=4 C=48 3.2e-6, K=5..7 C=64
# 2.1e-6, K=8..15 C=96 2.3e-6, K=16..31 C=128 2.1e-6, K>=32 C=256 2.2e-6; past them it grows
# about linearly in C (K=2 C=128 9e-6, K=3 C=128 1.6e-5, K=2 C=256 2.6e-5).
FLOAT32_MAX_CHUNK = ((1, 4), (2, 16), (3, 32), (4, 48), (7, 64), (15, 96), (31, 128), (None, 256))


def chunk_compute_dtype(xp: Any, K: int, chunk_size: int, dtype: Any) -> Any:
    """The dtype the chunked algorithm should compute in to keep float32 within 1e-5.

    Parameters
    ----------
    xp : the array namespace of the inputs.
    K : key size.
    chunk_size : the chunk ``C`` that will run (after any clamping to ``T``).
    dtype : the compute dtype chosen from the inputs (float32 or float64).

    Returns
    -------
    ``xp.float64`` when ``dtype`` is float32 and ``C`` exceeds :data:`FLOAT32_MAX_CHUNK` for
    ``K`` (small key sizes with large chunks), else ``dtype``. Outputs and states are then cast
    back to their usual dtypes (output: the inputs'; states: float32). Namespaces without
    float64 (JAX without ``jax_enable_x64``) keep ``dtype``.
    """
    if dtype != xp.float32 or chunk_size <= _float32_max_chunk(K) or not _has_float64(xp):
        return dtype
    return xp.float64


def _float32_max_chunk(K: int) -> int:
    return next(c for k, c in FLOAT32_MAX_CHUNK if k is None or K <= k)


def _has_float64(xp: Any) -> bool:
    if array_api_compat.is_jax_namespace(xp):
        import jax

        return bool(jax.config.read("jax_enable_x64"))
    return True
