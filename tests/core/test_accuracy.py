"""float32 accuracy where the chunked form is weakest: small key sizes with large chunks, long sequences.

Every check is against float64 (the recurrence, or the float64 chunked form where the recurrence
would take minutes) and holds float32 to 1e-5 of the reference's max-abs (tests/helpers.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TOLERANCE, FixedProblem, assert_within, make_problem

import kda
from kda._engine.widening import FLOAT32_MAX_CHUNK, chunk_compute_dtype

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
F32 = TOLERANCE[np.dtype(np.float32)]


def _forward_backward(p: FixedProblem, chunk_size: int):
    out = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, chunk_size=chunk_size, save_boundaries=True)
    grads = kda.chunk_kda_backward(
        *p.inputs,
        out.boundaries,
        p.grad_output,
        p.grad_final_state,
        initial_state=p.initial_state,
        chunk_size=chunk_size,
    )
    return out, grads


def _check_against_recurrence(p32: FixedProblem, chunk_size: int) -> None:
    p64 = p32.astype(np.float64)
    ref = kda.recurrent_kda(*p64.inputs, initial_state=p64.initial_state)
    ref_grads = kda.recurrent_kda_backward(
        *p64.inputs, p64.grad_output, p64.grad_final_state, initial_state=p64.initial_state
    )
    out, grads = _forward_backward(p32, chunk_size)
    assert_within(out.output, ref.output, tol=F32, dtype=np.float32, name="output")
    assert_within(out.final_state, ref.final_state, tol=F32, dtype=np.float32, name="final_state")
    for name, got, want in zip(NAMES, grads[:6], ref_grads[:6], strict=True):
        assert_within(got, want, tol=F32, dtype=np.float32, name=name)


def test_chunk_compute_dtype_promotes_small_keys_with_large_chunks():
    assert chunk_compute_dtype(np, 2, 16, np.float32) == np.float32
    assert chunk_compute_dtype(np, 2, 17, np.float32) == np.float64
    assert chunk_compute_dtype(np, 4, 64, np.float32) == np.float64
    assert chunk_compute_dtype(np, 8, 64, np.float32) == np.float32
    assert chunk_compute_dtype(np, 128, 64, np.float32) == np.float32
    assert chunk_compute_dtype(np, 128, 257, np.float32) == np.float64
    assert chunk_compute_dtype(np, 2, 128, np.float64) == np.float64
    bounds = [c for _, c in FLOAT32_MAX_CHUNK]
    assert bounds == sorted(bounds)


@pytest.mark.parametrize(("K", "chunk_size"), [(k or 48, c) for k, c in FLOAT32_MAX_CHUNK])
@pytest.mark.parametrize("regime", ["zero", "weak"])
def test_float32_at_the_largest_float32_chunk(K, chunk_size, regime):
    """The envelope of FLOAT32_MAX_CHUNK: at each bound, float32 itself stays within 1e-5.

    Zero and weak decay with beta up to 2 are the worst regimes (the chunk's state map is then a
    product of many contractions, formed as a sum of C terms of order one).
    """
    assert chunk_compute_dtype(np, K, chunk_size, np.float32) == np.float32
    T = max(3 * chunk_size + 5, 100)
    p = make_problem(K * 1000 + chunk_size, 1, 2, T, K, min(K, 16), regime).astype(np.float32)
    _check_against_recurrence(p, chunk_size)


@pytest.mark.parametrize(
    ("K", "chunk_size", "seed"),
    [
        (3, 128, 0),  # 1.6e-5 of ds0 when computed in float32
        (3, 83, 0),  # 1.2e-5
        (2, 256, 0),  # 2.6e-5
    ],
)
def test_small_keys_with_large_chunks_stay_within_1e5(K, chunk_size, seed):
    """Zero decay, beta up to 2, T = 512: with keys this small and chunks this large a chunk's state
    map is tiny and float32 loses it; the chunked form computes these in float64
    (:func:`kda._engine.widening.chunk_compute_dtype`), which keeps them within 1e-5."""
    p = make_problem(seed, 1, 2, 512, K, K, "zero").astype(np.float32)
    _check_against_recurrence(p, chunk_size)


@pytest.mark.slow
@pytest.mark.parametrize(("regime", "backward"), [("weak", True), ("mild", False)])
def test_long_sequence_float32_stays_within_1e5_of_float64(regime, backward):
    """T = 65536, H = 2, K = V = 64 at the default chunk: float32 against the float64 chunked form.

    (The float64 chunked form is held to 1e-10 of the float64 recurrence by test_chunked; the
    recurrence itself would take minutes here.) Weak decay couples the longest ranges: forward and
    backward; mild decay: the forward only (half the time). Measured drift: every array within
    6.1e-7 (weak) and 5.9e-7 (mild, backward included); README, "Long sequences".
    """
    p32 = make_problem(0, 1, 2, 65536, 64, 64, regime).astype(np.float32)
    p64 = p32.astype(np.float64)
    if not backward:
        out32 = kda.chunk_kda(*p32.inputs, initial_state=p32.initial_state)
        out64 = kda.chunk_kda(*p64.inputs, initial_state=p64.initial_state)
        assert_within(out32.output, out64.output, tol=F32, dtype=np.float32, name="output")
        assert_within(out32.final_state, out64.final_state, tol=F32, dtype=np.float32, name="final_state")
        return
    out32, grads32 = _forward_backward(p32, 64)
    out64, grads64 = _forward_backward(p64, 64)
    assert_within(out32.output, out64.output, tol=F32, dtype=np.float32, name="output")
    assert_within(out32.final_state, out64.final_state, tol=F32, dtype=np.float32, name="final_state")
    for name, got, want in zip(NAMES, grads32[:6], grads64[:6], strict=True):
        assert_within(got, want, tol=F32, dtype=np.float32, name=name)
