"""Segment maps (kda.chunk_kda_transition and its backward) against the recurrence and composition."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import TOLERANCE, assert_within, make_problem

import kda
from kda._entry import scan
from kda._entry.transition import chunk_kda_transition, chunk_kda_transition_backward
from kda.testing import LOG_REGIMES

T_SPLIT = 37  # not a multiple of the chunk sizes used


def _weak(p):
    """Weak decays and small steps: the start state still matters at the end (|A| near 1)."""
    p.g, p.beta = 0.02 * p.g, 0.25 * p.beta
    return p


def _mT(x):
    return np.swapaxes(x, -1, -2)


@pytest.mark.parametrize("regime", LOG_REGIMES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_maps_against_the_recurrence(regime, dtype):
    """``A S0 + N`` is the recurrence's final state; ``A^T dS + D`` its initial-state gradient."""
    p = make_problem(3, 2, 3, 75, 8, 5, "mild" if regime == "weak" else regime)
    p = (_weak(p) if regime == "weak" else p).astype(dtype)
    p64 = p.astype(np.float64)
    ref = kda.recurrent_kda(*p64.inputs, initial_state=p64.initial_state)
    ref_grads = kda.recurrent_kda_backward(
        *p64.inputs, p64.grad_output, p64.grad_final_state, initial_state=p64.initial_state
    )
    A, N = chunk_kda_transition(*p.inputs, chunk_size=16)
    D = chunk_kda_transition_backward(*p.inputs, p.grad_output, chunk_size=16)
    tol = TOLERANCE[np.dtype(dtype)]
    state_dtype = np.float64 if dtype == np.float64 else np.float32
    for x in (A, N, D):
        assert x.dtype == state_dtype
    assert A.shape == (2, 3, 8, 8) and N.shape == D.shape == (2, 3, 8, 5)
    assert_within(A @ p.initial_state + N, ref.final_state, tol=tol, dtype="any", name="A S0 + N")
    dstart = _mT(A) @ p.grad_final_state + D
    assert_within(dstart, ref_grads.initial_state, tol=tol, dtype="any", name="A^T dS + D")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_two_halves_compose(dtype, chunk_size):
    """The map of the second half carries the first half's end state (gradient) to the whole's."""
    p = _weak(make_problem(5, 2, 2, 90, 6, 4, "mild")).astype(dtype)
    first = [x[:, :, :T_SPLIT] for x in p.inputs]
    second = [x[:, :, T_SPLIT:] for x in p.inputs]
    kw = {"chunk_size": chunk_size}
    whole = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, **kw)
    whole_grads = kda.chunk_kda_backward(
        *p.inputs, None, p.grad_output, p.grad_final_state, initial_state=p.initial_state, **kw
    )
    middle = kda.chunk_kda(*first, initial_state=p.initial_state, **kw).final_state
    A, N = chunk_kda_transition(*second, **kw)
    tol = TOLERANCE[np.dtype(dtype)]
    assert np.max(np.abs(A)) > 0.1  # the start state matters: a real test of the composition
    assert_within(A @ middle + N, whole.final_state, tol=tol, name="final_state")
    # backward: the first half from the gradient that the second half's maps carry back
    D = chunk_kda_transition_backward(*second, p.grad_output[:, :, T_SPLIT:], **kw)
    dmiddle = _mT(A) @ p.grad_final_state + D
    first_grads = kda.chunk_kda_backward(
        *first, None, p.grad_output[:, :, :T_SPLIT], dmiddle, initial_state=p.initial_state, **kw
    )
    for name in ("q", "k", "v", "g", "beta"):
        want = getattr(whole_grads, name)[:, :, :T_SPLIT]
        assert_within(getattr(first_grads, name), want, tol=tol, name=name)
    assert_within(first_grads.initial_state, whole_grads.initial_state, tol=tol, name="initial_state")


@pytest.mark.parametrize("zero_ends", [False, True])
def test_scan_composes_segments(zero_ends):
    """kda._entry.scan (the one composition Dask, context parallelism and the chunk-start states'
    gradients use): advance over three segments' maps from the initial state gives the whole call's
    final state; retreat from the final state's gradient gives its initial-state gradient; None
    stands for a zero state (gradient)."""
    p = _weak(make_problem(6, 1, 2, 100, 6, 4, "mild")).astype(np.float64)
    kw = {"chunk_size": 16}
    cuts = list(itertools.pairwise((0, 30, 61, 100)))
    parts = [[x[:, :, a:b] for x in p.inputs] for a, b in cuts]
    maps = [chunk_kda_transition(*x, **kw) for x in parts]
    Ds = [chunk_kda_transition_backward(*x, p.grad_output[:, :, a:b], **kw) for x, (a, b) in zip(parts, cuts)]
    s0, dF = (None, None) if zero_ends else (p.initial_state, p.grad_final_state)
    whole = kda.chunk_kda(*p.inputs, initial_state=s0, **kw)
    grads = kda.chunk_kda_backward(*p.inputs, None, p.grad_output, dF, initial_state=s0, **kw)
    state = s0
    for A, N in maps:
        state = scan.advance(A, N, state)
    dstart = dF
    for (A, _), D in zip(maps[::-1], Ds[::-1]):
        dstart = scan.retreat(A, D, dstart)
    tol = TOLERANCE[np.dtype(np.float64)]
    assert_within(state, whole.final_state, tol=tol, name="advance")
    assert_within(dstart, grads.initial_state, tol=tol, name="retreat")


@pytest.mark.parametrize("slab_chunks", [1, 3])
def test_maps_over_several_slabs(monkeypatch, slab_chunks):
    """The maps run slab by slab (a few chunks each): the state (gradient) crosses the slabs."""
    monkeypatch.setattr("kda.reference.SLAB_ELEMENTS", slab_chunks * 2 * 16 * 10)  # imports it
    p = _weak(make_problem(6, 1, 2, 70, 6, 4, "mild"))
    ref = kda.recurrent_kda(*p.inputs, initial_state=p.initial_state)
    ref_grads = kda.recurrent_kda_backward(
        *p.inputs, p.grad_output, p.grad_final_state, initial_state=p.initial_state
    )
    A, N = chunk_kda_transition(*p.inputs, chunk_size=16)
    D = chunk_kda_transition_backward(*p.inputs, p.grad_output, chunk_size=16)
    assert_within(A @ p.initial_state + N, ref.final_state, tol=1e-10, name="A S0 + N")
    assert_within(_mT(A) @ p.grad_final_state + D, ref_grads.initial_state, tol=1e-10, name="A^T dS + D")


def test_maps_do_not_depend_on_v_or_the_start():
    """``A`` and ``D`` ignore ``v``; ``N`` is the end state from a zero start."""
    p = make_problem(8, 1, 2, 40, 4, 3, "mild")
    other_v = p.v + 1.0
    A, N = chunk_kda_transition(*p.inputs, chunk_size=8)
    A2, N2 = chunk_kda_transition(p.q, p.k, other_v, p.g, p.beta, chunk_size=8)
    assert_within(A2, A, tol=1e-12, name="A")
    assert np.max(np.abs(N2 - N)) > 1e-3
    D = chunk_kda_transition_backward(*p.inputs, p.grad_output, chunk_size=8)
    D2 = chunk_kda_transition_backward(p.q, p.k, other_v, p.g, p.beta, p.grad_output, chunk_size=8)
    assert_within(D2, D, tol=1e-12, name="D")
    zero_start = kda.chunk_kda(*p.inputs, chunk_size=8).final_state
    assert_within(N, zero_start, tol=1e-12, name="N")


def test_empty_segment_is_the_identity():
    p = make_problem(1, 1, 2, 0, 4, 3, "mild")
    A, N = chunk_kda_transition(*p.inputs)
    np.testing.assert_array_equal(A, np.broadcast_to(np.eye(4), (1, 2, 4, 4)))
    np.testing.assert_array_equal(N, np.zeros((1, 2, 4, 3)))
    D = chunk_kda_transition_backward(*p.inputs, p.grad_output)
    np.testing.assert_array_equal(D, np.zeros((1, 2, 4, 3)))


def _options_problem(seed: int, T: int):
    """time-major, grouped value heads (H=2, HV=4), raw gates, raw beta, unnormalised q and k."""
    rng = np.random.default_rng(seed)
    B, H, HV, K, V = 1, 2, 4, 6, 5
    inputs = (
        rng.standard_normal((B, T, H, K)),
        rng.standard_normal((B, T, H, K)),
        rng.standard_normal((B, T, HV, V)),
        rng.standard_normal((B, T, HV, K)) - 4.0,  # raw gates: softplus keeps the decays weak
        rng.standard_normal((B, T, HV)),
    )
    options = {
        "layout": "time_major",
        "qk_l2norm": True,
        "gate": "softplus",
        "A_log": rng.uniform(-2.0, 0.0, HV),
        "dt_bias": 0.1 * rng.standard_normal((HV, K)),
        "beta_activation": "sigmoid",
    }
    state = rng.standard_normal((B, HV, K, V))
    return inputs, options, state, rng.standard_normal((B, T, HV, V)), rng.standard_normal((B, HV, K, V))


def test_options_compose():
    """Layout, grouped heads, gates, beta activation and q/k normalisation pass through."""
    inputs, options, s0, do, ds = _options_problem(2, 50)
    first = [x[:, :T_SPLIT] for x in inputs]
    second = [x[:, T_SPLIT:] for x in inputs]
    whole = kda.chunk_kda(*inputs, initial_state=s0, chunk_size=8, **options)
    middle = kda.chunk_kda(*first, initial_state=s0, chunk_size=8, **options).final_state
    A, N = chunk_kda_transition(*second, chunk_size=8, **options)
    assert A.shape == (1, 4, 6, 6)
    assert np.max(np.abs(A)) > 0.1
    assert_within(A @ middle + N, whole.final_state, tol=1e-10, name="final_state")
    whole_grads = kda.chunk_kda_backward(*inputs, None, do, ds, initial_state=s0, chunk_size=8, **options)
    D = chunk_kda_transition_backward(*second, do[:, T_SPLIT:], chunk_size=8, **options)
    first_grads = kda.chunk_kda_backward(
        *first, None, do[:, :T_SPLIT], _mT(A) @ ds + D, initial_state=s0, chunk_size=8, **options
    )
    assert_within(first_grads.initial_state, whole_grads.initial_state, tol=1e-10, name="initial_state")
    assert_within(first_grads.k, whole_grads.k[:, :T_SPLIT], tol=1e-10, name="k")


def test_packed_sequences_give_one_map_each():
    inputs, options, *_ = _options_problem(4, 30)
    cu = np.array([0, 12, 30])
    A, N = chunk_kda_transition(*inputs, chunk_size=8, cu_seqlens=cu, **options)
    assert A.shape == (2, 4, 6, 6)
    for i in range(2):
        part = [x[:, cu[i] : cu[i + 1]] for x in inputs]
        Ai, Ni = chunk_kda_transition(*part, chunk_size=8, **options)
        assert_within(A[i : i + 1], Ai, tol=1e-12, name=f"A[{i}]")
        assert_within(N[i : i + 1], Ni, tol=1e-12, name=f"N[{i}]")
    do = np.random.default_rng(5).standard_normal((1, 30, 4, 5))
    D = chunk_kda_transition_backward(*inputs, do, chunk_size=8, cu_seqlens=cu, **options)
    assert D.shape == (2, 4, 6, 5)
    for i in range(2):
        part = [x[:, cu[i] : cu[i + 1]] for x in (*inputs, do)]
        Di = chunk_kda_transition_backward(*part, chunk_size=8, **options)
        assert_within(D[i : i + 1], Di, tol=1e-12, name=f"D[{i}]")


def test_bad_input_is_refused():
    p = make_problem(1, 1, 2, 10, 4, 3, "mild")
    with pytest.raises(TypeError, match="initial_state"):
        chunk_kda_transition(*p.inputs, initial_state=p.initial_state)
    with pytest.raises(kda.InvalidInputError, match="v must have shape"):
        chunk_kda_transition(p.q, p.k, p.v[:, :, :5], p.g, p.beta)
    with pytest.raises(kda.InvalidInputError, match="g must"):
        chunk_kda_transition(p.q, p.k, p.v, -p.g, p.beta)
    with pytest.raises(kda.InvalidInputError, match="grad_output"):
        chunk_kda_transition_backward(*p.inputs, p.grad_output[..., :2])
