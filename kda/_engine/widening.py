"""The widening policy: which dtype the chunked algorithm computes in.

A chunk's state map is a product of ``C`` contractions, built in the WY form as a sum of ``C``
terms of order one; with few key channels and weak decay that product is tiny and float32 loses
it. Past a measured envelope float32 problems compute in float64 and cast back.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

__all__ = ["FLOAT32_MAX_CHUNK", "chunk_compute_dtype"]


# The largest chunk computed in float32, by key size K (the first row whose K bound is >= K).
# Each chunk's state map, prod_t (diag(exp g_t) - beta_t k_t k_t^T), is formed in the WY form as
# diag(total) - k_suffix^T W: a sum of C terms of order one. With few key channels and weak decay the
# product is tiny (1e-13 for K = 2, C = 128), so its absolute error of about C * eps dominates
# the initial-state gradient. Measured worst float32 error against the float64 recurrence
# (zero and weak decay, beta in [0, 2], unit keys, T = max(512, 4 C), 6 seeds; 2 for K >= 32) at
# these bounds: K=1 C=3 1.8e-6, K=2 C=16 1.9e-6, K=3 C=32 2.6e-6, K=4 C=48 3.2e-6, K=5..7 C=64
# 2.1e-6, K=8..15 C=96 2.3e-6, K=16..31 C=128 2.1e-6, K>=32 C=256 2.2e-6; past them it grows
# about linearly in C (K=2 C=128 9e-6, K=3 C=128 1.6e-5, K=2 C=256 2.6e-5). K=1 stops at C=3:
# at C=4, T=100, over 45 problems a float32 ulp apart (3 seeds, each input nudged one ulp at
# random), the worst was 7.3e-6 with SciPy's BLAS and 1.02e-5 with MKL (the same spread, p90
# 4.5e-6 and 4.2e-6: the last bits of any BLAS decide), against 1.8e-6 at C=3 on both.
FLOAT32_MAX_CHUNK = ((1, 3), (2, 16), (3, 32), (4, 48), (7, 64), (15, 96), (31, 128), (None, 256))


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
