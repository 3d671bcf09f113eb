"""The recurrence (the oracle) and its hand-written backward."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_within, make_problem

import kda


def loss(p, q, k, v, g, beta, s0, scale=None, backend=None):
    out = kda.recurrent_kda(q, k, v, g, beta, initial_state=s0, scale=scale, backend=backend)
    return float(np.sum(out.output * p.grad_output) + np.sum(out.final_state * p.grad_final_state))


@pytest.mark.parametrize("regime", ["zero", "weak", "mild", "reset"])
@pytest.mark.parametrize(("seed", "scale"), [(0, None), (1, 0.37)])
def test_backward_matches_central_differences(regime, seed, scale, backend):
    """Directional derivatives of <o, dO> + <S_T, dS_T> along a random direction per input
    (with the default and with a custom ``scale``), on each backend."""
    p = make_problem(seed, 1, 2, 6, 3, 2, regime)
    # keep g a valid log decay under the perturbation: mild values in [-1, -0.1], resets untouched
    p.g = np.where(np.isinf(p.g), p.g, np.minimum(p.g, -0.1))
    x = [*p.inputs, p.initial_state]
    grads = kda.recurrent_kda_backward(
        *p.inputs,
        p.grad_output,
        p.grad_final_state,
        initial_state=p.initial_state,
        scale=scale,
        backend=backend,
    )
    rng = np.random.default_rng(seed + 100)
    eps = 1e-6
    for i, name in enumerate(kda.KdaGradients._fields[:6]):
        d = rng.standard_normal(x[i].shape)
        if name == "g":
            d = np.where(np.isinf(p.g), 0.0, d)
        plus = [a + eps * d if j == i else a for j, a in enumerate(x)]
        minus = [a - eps * d if j == i else a for j, a in enumerate(x)]
        numeric = (
            loss(p, *plus, scale=scale, backend=backend) - loss(p, *minus, scale=scale, backend=backend)
        ) / (2 * eps)
        analytic = float(np.sum(grads[i] * d))
        assert abs(numeric - analytic) <= 1e-7 * max(1.0, abs(analytic)), (name, numeric, analytic)


def test_hard_reset_forgets_the_past():
    """g = -inf in every channel at step t: outputs from t on ignore everything before t."""
    p = make_problem(3, 1, 1, 12, 4, 3, "mild")
    g = p.g.copy()
    g[:, :, 5, :] = -np.inf
    a = kda.recurrent_kda(p.q, p.k, p.v, g, p.beta, initial_state=p.initial_state)
    v2 = p.v.copy()
    v2[:, :, :5] += 10.0
    b = kda.recurrent_kda(p.q, p.k, v2, g, p.beta, initial_state=p.initial_state * 3)
    np.testing.assert_array_equal(a.output[:, :, 5:], b.output[:, :, 5:])
    do = p.grad_output.copy()
    do[:, :, :5] = 0.0  # only outputs after the reset carry a gradient
    grads = kda.recurrent_kda_backward(p.q, p.k, p.v, g, p.beta, do, p.grad_final_state)
    assert np.all(np.isfinite(grads.g))
    np.testing.assert_array_equal(grads.initial_state, 0.0)
    np.testing.assert_array_equal(grads.v[:, :, :5], 0.0)


def test_steps_by_hand(backend):
    """T = 2 from the definition, written out: the recurrence, and decode from a pool row (which
    the reference backend forms in another arrangement, one product with the state per step)."""
    p = make_problem(4, 1, 1, 2, 3, 2, "mild")
    S = p.initial_state[0, 0]
    outs = []
    for t in range(2):
        S = np.exp(p.g[0, 0, t])[:, None] * S
        u = p.beta[0, 0, t] * (p.v[0, 0, t] - S.T @ p.k[0, 0, t])
        S = S + np.outer(p.k[0, 0, t], u)
        outs.append(0.5 * S.T @ p.q[0, 0, t])
    out = kda.recurrent_kda(*p.inputs, initial_state=p.initial_state, scale=0.5, backend=backend)
    assert_within(out.output[0, 0], np.stack(outs), tol=1e-14)
    assert_within(out.final_state[0, 0], S, tol=1e-14)
    pool = np.concatenate([np.zeros_like(p.initial_state), p.initial_state])  # the state in row 1
    o = kda.decode_kda(*p.inputs, pool, np.array([1], np.int32), scale=0.5, backend=backend)
    assert_within(o[0, 0], np.stack(outs), tol=1e-14)
    assert_within(pool[1, 0], S, tol=1e-14)
