"""The chunked forward and backward against the step recurrence (float64 oracle)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TOLERANCE, FixedProblem, assert_within, make_problem
from hypothesis import example, given
from hypothesis import strategies as st

import kda
from kda.testing import LOG_REGIMES

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def oracle(p: FixedProblem, scale: float | None = None) -> tuple[kda.KdaOutput, kda.KdaGradients]:
    """Forward and gradients of the float64 recurrence on ``p``'s values."""
    p64 = p.astype(np.float64)
    out = kda.recurrent_kda(*p64.inputs, initial_state=p64.initial_state, scale=scale, backend="reference")
    grads = kda.recurrent_kda_backward(
        *p64.inputs, p64.grad_output, p64.grad_final_state, initial_state=p64.initial_state, scale=scale
    )
    return out, grads


# A looser bound for T = 1, where an output array is a handful of sums whose terms cancel, so that
# its max-abs (the denominator of the check) is far below the size of those terms and no float32
# evaluation reaches 1e-5 of it. Measured in float32 (dev profile, 1000 examples a run): with V = 1
# the output is one dot product q.k (3.8e-5 of a 1.8e-6 max, K = 23); with K = 1, dq and dbeta are
# single dot products over V (1.8e-5, 1.9e-5; the float32 recurrence itself gets 1.2e-5 on one).
# K = 1 with T > 1 is held to TOLERANCE: its chunk maps (products of factors 1 - beta k^2, formed in
# the WY form as 1 - sum w kt) lost up to 1.6e-4 in float32, and kda._engine.widening.chunk_compute_dtype has
# such chunks (C > 4) computed in float64; measured worst over 300 random K = 1 problems (T 2..130,
# C 1..80, every regime): 1.3e-6.
DEGENERATE_TOLERANCE = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-4}


def _tolerance(q, dtype, name: str = "") -> float:
    if q.shape[2] != 1:
        return TOLERANCE[np.dtype(dtype)]
    return DEGENERATE_TOLERANCE[np.dtype(dtype)]


def check_forward(p: FixedProblem, out: kda.KdaOutput, ref: kda.KdaOutput, dtype) -> None:
    tol = _tolerance(p.q, dtype)
    state_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    assert_within(out.output, ref.output, tol=tol, dtype=dtype, name="output")
    assert_within(out.final_state, ref.final_state, tol=tol, dtype=state_dtype, name="final_state")


def check_gradients(grads: kda.KdaGradients, ref: kda.KdaGradients, dtype) -> None:
    state_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    for name, got, want in zip(GRAD_NAMES, grads[:6], ref[:6], strict=True):
        d = state_dtype if name == "initial_state" else dtype
        assert_within(got, want, tol=_tolerance(ref.q, dtype, name), dtype=d, name=name)


def run_chunked(
    p: FixedProblem,
    chunk_size: int,
    *,
    saved: bool = True,
    backend: str = "reference",
    scale: float | None = None,
):
    out = kda.chunk_kda(
        *p.inputs,
        initial_state=p.initial_state,
        chunk_size=chunk_size,
        save_boundaries=True,
        backend=backend,
        scale=scale,
    )
    grads = kda.chunk_kda_backward(
        *p.inputs,
        out.boundaries if saved else None,
        p.grad_output,
        p.grad_final_state,
        initial_state=p.initial_state,
        chunk_size=chunk_size,
        backend=backend,
        scale=scale,
    )
    return out, grads


# Sizes: half the draws short (T <= 40, K <= 16), half realistic (T up to 260, K up to 64), so
# that multi-chunk float32 problems are common; every regime is also an explicit example below
# (derandomised, the ci profile's 100 draws need not reach each one).
problem_args = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**32 - 1),
        "B": st.integers(1, 2),
        "H": st.integers(1, 3),
        "T": st.integers(0, 40) | st.integers(41, 260),
        "K": st.integers(1, 16) | st.integers(17, 64),
        "V": st.integers(1, 40),
        "regime": st.sampled_from(LOG_REGIMES),
        "with_state": st.booleans(),
        "with_grad_state": st.booleans(),
    }
)
scales = st.none() | st.floats(0.05, 2.0)


def _example(regime: str, seed: int) -> dict:
    """A multi-chunk float32 problem of one regime (chunk 48: not a power of two)."""
    return {"seed": seed, "B": 1, "H": 2, "T": 130, "K": 24, "V": 20, "regime": regime}


@given(
    problem=problem_args,
    chunk_size=st.integers(1, 80),
    dtype=st.sampled_from([np.float32, np.float64]),
    scale=scales,
)
@example(
    problem={**_example("zero", 1), "with_state": True, "with_grad_state": True},
    chunk_size=48,
    dtype=np.float32,
    scale=0.3,
)
@example(
    problem={**_example("weak", 2), "with_state": True, "with_grad_state": False},
    chunk_size=48,
    dtype=np.float32,
    scale=None,
)
@example(
    problem={**_example("mild", 3), "with_state": False, "with_grad_state": True},
    chunk_size=48,
    dtype=np.float32,
    scale=1.7,
)
@example(
    problem={**_example("strong", 4), "with_state": True, "with_grad_state": True},
    chunk_size=48,
    dtype=np.float32,
    scale=None,
)
@example(
    problem={**_example("hard", 5), "with_state": True, "with_grad_state": True},
    chunk_size=48,
    dtype=np.float32,
    scale=0.5,
)
@example(
    problem={**_example("reset", 6), "with_state": True, "with_grad_state": True},
    chunk_size=48,
    dtype=np.float32,
    scale=None,
)
def test_chunked_matches_recurrence(problem, chunk_size, dtype, scale):
    p = make_problem(**problem).astype(dtype)
    ref_out, ref_grads = oracle(p, scale)
    out, grads = run_chunked(p, chunk_size, saved=bool(problem["seed"] % 2), scale=scale)
    check_forward(p, out, ref_out, dtype)
    assert out.boundaries.shape == (-(-p.q.shape[2] // chunk_size), *ref_out.final_state.shape)
    check_gradients(grads, ref_grads, dtype)


@pytest.mark.parametrize("regime", LOG_REGIMES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_regime_at_default_chunk(regime, dtype):
    """T = 2 chunks + 1 at the default chunk size, K = V = 32, every gate regime."""
    p = make_problem(7, 1, 2, 129, 32, 32, regime).astype(dtype)
    ref_out, ref_grads = oracle(p)
    out, grads = run_chunked(p, 64)
    check_forward(p, out, ref_out, dtype)
    check_gradients(grads, ref_grads, dtype)


@pytest.mark.parametrize(
    ("H", "T", "K", "regime", "slab_chunks", "scale"),
    [
        (2, 320, 64, "weak", 2, None),  # 5 chunks in slabs of 2: three slabs
        (2, 300, 64, "strong", 3, 0.2),
        (1, 256, 128, "mild", None, None),  # the default slabs
        (1, 200, 128, "reset", 1, 1.3),  # every chunk its own slab
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_realistic_sizes_against_the_recurrence(monkeypatch, H, T, K, regime, slab_chunks, scale, dtype):
    """K = V = 64 and 128 at the default chunk, T >= 200, one and several slabs, against the oracle."""
    import kda.reference

    if slab_chunks is not None:
        monkeypatch.setattr(kda.reference, "SLAB_ELEMENTS", slab_chunks * H * 64 * K)
    p = make_problem(T + K, 1, H, T, K, K, regime).astype(dtype)
    ref_out, ref_grads = oracle(p, scale)
    out, grads = run_chunked(p, 64, saved=regime != "weak", scale=scale)
    check_forward(p, out, ref_out, dtype)
    check_gradients(grads, ref_grads, dtype)


@pytest.mark.parametrize(
    ("T", "chunk_size"),
    [
        (0, 64),  # empty sequence: the final state is the initial state
        (1, 64),  # one step
        (1, 1),
        (17, 1),  # chunk_size = 1: every step its own chunk
        (10, 64),  # chunk_size > T
        (48, 16),  # T = n C
        (47, 16),  # T = n C - 1
        (49, 16),  # T = n C + 1
        (40, 24),  # chunk size not a power of two
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_edge_cases(T, chunk_size, dtype):
    p = make_problem(T + chunk_size, 2, 2, T, 5, 3, "mild").astype(dtype)
    ref_out, ref_grads = oracle(p)
    out, grads = run_chunked(p, chunk_size)
    check_forward(p, out, ref_out, dtype)
    check_gradients(grads, ref_grads, dtype)
    assert out.boundaries.shape[0] == -(-T // chunk_size)


def test_empty_sequence_returns_the_initial_state():
    p = make_problem(0, 2, 3, 0, 4, 5)
    out = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, save_boundaries=True)
    assert out.output.shape == (2, 3, 0, 5)
    np.testing.assert_array_equal(out.final_state, p.initial_state)
    assert out.final_state is not p.initial_state
    assert out.boundaries.shape == (0, 2, 3, 4, 5)
    grads = kda.chunk_kda_backward(*p.inputs, out.boundaries, p.grad_output, p.grad_final_state)
    np.testing.assert_array_equal(grads.initial_state, p.grad_final_state)


def test_boundaries_are_the_chunk_start_states():
    p = make_problem(3, 1, 2, 50, 6, 4, "mild")
    out = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, chunk_size=16, save_boundaries=True)
    for n, start in enumerate(range(0, 50, 16)):
        sliced = [x[:, :, :start] for x in p.inputs]
        ref = kda.recurrent_kda(*sliced, initial_state=p.initial_state)
        assert_within(out.boundaries[n], ref.final_state, tol=1e-12, name=f"boundaries[{n}]")


def test_saved_and_recomputed_boundaries_agree():
    p = make_problem(5, 2, 2, 70, 8, 8, "strong")
    _, saved = run_chunked(p, 16, saved=True)
    _, recomputed = run_chunked(p, 16, saved=False)
    for name, a, b in zip(GRAD_NAMES, saved[:6], recomputed[:6], strict=True):
        assert_within(a, b, tol=1e-13, name=name)


def test_default_scale_is_inverse_sqrt_k():
    p = make_problem(11, 1, 1, 20, 9, 3)
    a = kda.chunk_kda(*p.inputs)
    b = kda.chunk_kda(*p.inputs, scale=9**-0.5)
    c = kda.chunk_kda(*p.inputs, scale=1.0)
    np.testing.assert_array_equal(a.output, b.output)
    assert not np.allclose(a.output, c.output)


@pytest.mark.parametrize("slab_elements", [1, 1000])
def test_slabs_give_the_same_result(monkeypatch, slab_elements):
    """Large problems run slab by slab (bounded memory); the result must not depend on it."""
    import kda._engine.chunked
    import kda.reference

    p = make_problem(9, 2, 2, 77, 6, 5, "reset")
    whole_out, whole_grads = run_chunked(p, 8)
    whole_recomputed = run_chunked(p, 8, saved=False)[1]
    monkeypatch.setattr(kda.reference, "SLAB_ELEMENTS", slab_elements)
    assert len(kda._engine.chunked.slabs(p.q.shape, 8, 6, slab_elements)) > 1
    out, grads = run_chunked(p, 8)
    recomputed = run_chunked(p, 8, saved=False)[1]
    for a, b in zip(out, whole_out, strict=True):
        assert_within(a, b, tol=1e-14)
    for a, b, c in zip(grads[:6], whole_grads[:6], recomputed[:6], strict=True):
        assert_within(a, b, tol=1e-14)
        assert_within(c, b, tol=1e-14)
    assert_within(whole_recomputed.g, whole_grads.g, tol=1e-14)


@pytest.mark.parametrize(("B", "H"), [(1, 3), (3, 1), (2, 2), (2, 3)])
def test_head_groups_give_the_same_result(monkeypatch, B, H):
    """Heads run in concurrent groups on the CPU; one group must give the same numbers."""
    import kda.reference

    p = make_problem(B * 10 + H, B, H, 40, 5, 4, "mild")
    monkeypatch.setattr(kda.reference, "workers", lambda xp, heads: 3)
    out, grads = run_chunked(p, 16)
    recomputed = run_chunked(p, 16, saved=False)[1]
    monkeypatch.setattr(kda.reference, "workers", lambda xp, heads: 1)
    serial_out, serial_grads = run_chunked(p, 16)
    for a, b in zip(
        (*out, *grads[:6], *recomputed[:6]), (*serial_out, *serial_grads[:6], *serial_grads[:6]), strict=True
    ):
        assert_within(a, b, tol=1e-14)


@pytest.mark.parametrize(("B", "H"), [(0, 2), (2, 0)])
def test_empty_batch_or_heads(B, H):
    p = make_problem(0, B, H, 9, 3, 2)
    out = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, chunk_size=4, save_boundaries=True)
    assert out.output.shape == (B, H, 9, 2)
    assert out.final_state.shape == (B, H, 3, 2)
    assert out.boundaries.shape == (3, B, H, 3, 2)
    grads = kda.chunk_kda_backward(*p.inputs, out.boundaries, p.grad_output, chunk_size=4)
    assert [x.shape for x in grads[:6]] == [x.shape for x in (*p.inputs, p.initial_state)]
    assert kda.recurrent_kda(*p.inputs).output.shape == (B, H, 9, 2)
