"""``state_v_first`` in the chunked calls: ``chunk_kda`` takes ``initial_state [B, HV, V, K]``
and returns V-major final states and boundaries, ``chunk_kda_backward`` takes V-major states,
boundaries and final-state gradients and returns a V-major ``initial_state`` gradient: bitwise
the K-major call's results, transposed, on every backend (cuda on Numba's simulator), with and
without ``cu_seqlens``; the JAX and torch adapters' chunk calls likewise; a state of the other
layout is refused naming it."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BACKENDS

import kda


def _t(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(a, -1, -2))


def _problem(rng, B=2, H=2, T=9, K=4, V=6):
    q = rng.standard_normal((B, H, T, K)).astype(np.float32)
    k = rng.standard_normal((B, H, T, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, H, T, V)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, (B, H, T, K)).astype(np.float32)
    beta = rng.uniform(0.1, 1.0, (B, H, T)).astype(np.float32)
    s0 = rng.standard_normal((B, H, K, V)).astype(np.float32)
    return (q, k, v, g, beta), s0


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_kda_v_major_states_are_the_k_major_ones_transposed(backend):
    rng = np.random.default_rng(30)
    x, s0 = _problem(rng)
    kw = dict(chunk_size=4, save_boundaries=True, backend=backend)
    want = kda.chunk_kda(*x, initial_state=s0, **kw)
    got = kda.chunk_kda(*x, initial_state=_t(s0), state_v_first=True, **kw)
    assert got.final_state.shape == (2, 2, 6, 4) and got.boundaries.shape == (3, 2, 2, 6, 4)
    assert np.array_equal(got.output, want.output)
    assert np.array_equal(got.final_state, _t(want.final_state))
    assert np.array_equal(got.boundaries, _t(want.boundaries))
    # no initial state: zeros either way
    want0 = kda.chunk_kda(*x, **kw)
    got0 = kda.chunk_kda(*x, state_v_first=True, **kw)
    assert np.array_equal(got0.final_state, _t(want0.final_state))
    # the backward from V-major boundaries, final-state gradient and initial state
    do = rng.standard_normal(want.output.shape).astype(np.float32)
    dfinal = rng.standard_normal(s0.shape).astype(np.float32)
    bkw = dict(chunk_size=4, backend=backend)
    gw = kda.chunk_kda_backward(*x, want.boundaries, do, dfinal, initial_state=s0, **bkw)
    gv = kda.chunk_kda_backward(*x, got.boundaries, do, _t(dfinal), initial_state=_t(s0), state_v_first=True,
                                **bkw)  # fmt: skip
    for name in ("q", "k", "v", "g", "beta"):
        assert np.array_equal(getattr(gv, name), getattr(gw, name)), name
    assert np.array_equal(gv.initial_state, _t(gw.initial_state))
    # boundaries recomputed (None) from a V-major initial state
    gn = kda.chunk_kda_backward(*x, None, do, _t(dfinal), initial_state=_t(s0), state_v_first=True, **bkw)
    assert np.array_equal(gn.initial_state, gv.initial_state) and np.array_equal(gn.q, gv.q)


def test_chunk_kda_v_major_packed_sequences():
    rng = np.random.default_rng(31)
    x, _ = _problem(rng, B=1, T=13)
    cu = (0, 5, 13)
    s0 = rng.standard_normal((2, 2, 4, 6)).astype(np.float32)
    kw = dict(chunk_size=4, save_boundaries=True, cu_seqlens=cu)
    want = kda.chunk_kda(*x, initial_state=s0, **kw)
    got = kda.chunk_kda(*x, initial_state=_t(s0), state_v_first=True, **kw)
    assert np.array_equal(got.output, want.output)
    assert np.array_equal(got.final_state, _t(want.final_state))
    assert np.array_equal(got.boundaries, _t(want.boundaries))


def test_chunk_kda_refuses_the_other_layout():
    rng = np.random.default_rng(32)
    x, s0 = _problem(rng)
    with pytest.raises(kda.InvalidInputError, match=r"initial_state must have shape \[B, HV, V, K\].*"
                       r"pass state_v_first=False"):  # fmt: skip
        kda.chunk_kda(*x, initial_state=s0, state_v_first=True)
    with pytest.raises(kda.InvalidInputError, match=r"initial_state must have shape \[B, HV, K, V\]"):
        kda.chunk_kda(*x, initial_state=_t(s0))
    with pytest.raises(kda.InvalidTypeError, match=r"state_v_first must be a bool"):
        kda.chunk_kda(*x, initial_state=_t(s0), state_v_first=1)
    out = kda.chunk_kda(*x, initial_state=_t(s0), chunk_size=4, save_boundaries=True, state_v_first=True)
    do = np.zeros_like(out.output)
    with pytest.raises(kda.InvalidInputError, match=r"boundaries must have shape \[NT, B, HV, V, K\]"):
        kda.chunk_kda_backward(
            *x, _t(out.boundaries), do, initial_state=_t(s0), chunk_size=4, state_v_first=True
        )
    with pytest.raises(kda.InvalidInputError, match=r"grad_final_state must have shape \[B, HV, V, K\]"):
        kda.chunk_kda_backward(
            *x, out.boundaries, do, s0, initial_state=_t(s0), chunk_size=4, state_v_first=True
        )


def test_jax_chunk_kda_v_major():
    """kda.jax.chunk_kda (fla's form) with ``state_v_first``: bitwise the K-major call transposed,
    the initial state's gradient too."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from kda.jax import chunk_kda

    rng = np.random.default_rng(33)
    x, s0 = _problem(rng)
    q, k, v, g, beta = (jnp.asarray(np.swapaxes(a, 1, 2)) for a in x)
    kw = dict(output_final_state=True, return_intermediate_states=True, chunk_size=4)
    o, s, h = chunk_kda(q, k, v, g, beta, initial_state=jnp.asarray(s0), **kw)
    ov, sv, hv = chunk_kda(q, k, v, g, beta, initial_state=jnp.asarray(_t(s0)), state_v_first=True, **kw)
    assert np.array_equal(np.asarray(ov), np.asarray(o))
    assert np.array_equal(np.asarray(sv), _t(np.asarray(s)))
    assert np.array_equal(np.asarray(hv), _t(np.asarray(h)))

    w = rng.standard_normal(s0.shape).astype(np.float32)

    def loss(state, v_first):
        out, final = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True, chunk_size=4,
                               state_v_first=v_first)  # fmt: skip
        return jnp.sum(out * out) + jnp.sum(final * jnp.asarray(_t(w) if v_first else w))

    dk = jax.grad(loss)(jnp.asarray(s0), False)
    dv = jax.grad(loss)(jnp.asarray(_t(s0)), True)
    assert np.array_equal(np.asarray(dv), _t(np.asarray(dk)))
