"""A public call validates its inputs once and scans each for NaN / inf once.

Composition (the state-gradient backward, packed transitions) runs on calls derived from the
validated one (``kda._entry.call.Call.packed`` and friends), never on the public functions again:
counted here by wrapping the validation (``check_options_call``) and the finiteness check
(``kda._entry.call._check_finite``). The fused passes' screens are switched off, so that every
scan goes through that check.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import kda
import kda._entry.call as call_module
from kda._engine.core import ChunkCore


@pytest.fixture
def counted(monkeypatch):
    """``(validations, scans)``: the calls of the validation, and the names of the non-None arrays
    scanned for finiteness."""
    validations, scans = [], Counter()
    real_check, real_scan = call_module.check_options_call, call_module._check_finite

    def check(*args, **kwargs):
        validations.append(1)
        return real_check(*args, **kwargs)

    def scan(xp, name, x, **kwargs):
        if x is not None:
            scans[name] += 1
        return real_scan(xp, name, x, **kwargs)

    monkeypatch.setattr(call_module, "check_options_call", check)
    monkeypatch.setattr(call_module, "_check_finite", scan)
    monkeypatch.setattr(ChunkCore, "screens", lambda self, q: False)  # every scan by _check_finite
    return validations, scans


def _torch_inputs(B: int, T: int, H: int, K: int, V: int, N: int):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)

    def t(*shape, scale=1.0):
        return torch.tensor(rng.standard_normal(shape) * scale, dtype=torch.float64, requires_grad=True)

    q, k, v, g = t(B, T, H, K), t(B, T, H, K, scale=0.3), t(B, T, H, V), t(B, T, H, K)
    beta = torch.tensor(rng.uniform(size=(B, T, H)), dtype=torch.float64, requires_grad=True)
    extra = {"initial_state": t(N, H, K, V), "A_log": t(H, scale=0.3), "dt_bias": t(H * K, scale=0.3)}
    return (q, k, v, g, beta), extra


@pytest.mark.parametrize("packed", [False, True])
def test_torch_backward_with_boundaries_in_the_loss_scans_once(counted, packed):
    """``kda.torch.chunk_kda`` whose chunk-start states reach the loss: one validation (the
    forward's), each input scanned once (the forward), each cotangent once (the backward)."""
    torch = pytest.importorskip("torch")
    import kda.torch as kt

    validations, scans = counted
    if packed:
        steps, extra = _torch_inputs(1, 40, 2, 4, 3, 3)
        extra["cu_seqlens"] = torch.tensor([0, 11, 11, 40])
    else:
        steps, extra = _torch_inputs(2, 21, 2, 4, 3, 2)
    o, final, h = kt.chunk_kda(
        *steps, output_final_state=True, return_intermediate_states=True, use_gate_in_kernel=True,
        chunk_size=8, **extra,
    )  # fmt: skip
    assert validations == [1]
    (o.square().sum() + final.sin().sum() + h.cos().sum()).backward()
    assert validations == [1]  # the backward validates nothing again
    inputs = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
    cotangents = ("grad_output", "grad_final_state", "grad_boundaries")
    assert scans == Counter(dict.fromkeys((*inputs, *cotangents), 1)), scans
    assert all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in steps)


def test_packed_transition_scans_once(counted):
    """A packed ``chunk_kda_transition`` (one widened forward underneath): one validation, each
    input scanned once, and the start state ``[I, 0]`` it makes is not an input to scan."""
    validations, scans = counted
    rng = np.random.default_rng(6)
    B, H, T, K, V = 1, 2, 30, 4, 3
    q, k = (rng.standard_normal((B, H, T, K)) for _ in range(2))
    v = rng.standard_normal((B, H, T, V))
    g = -np.abs(rng.standard_normal((B, H, T, K)))
    beta = rng.uniform(size=(B, H, T))
    cu = np.array([0, 7, 7, 30])
    t = kda.chunk_kda_transition(q, k, v, g, beta, chunk_size=8, cu_seqlens=cu)
    assert t.A.shape == (3, H, K, K) and t.N.shape == (3, H, K, V)
    assert validations == [1]
    assert scans == Counter(dict.fromkeys(("q", "k", "v", "beta"), 1)), scans  # g: a log gate, validated
    D = kda.chunk_kda_transition_backward(q, k, v, g, beta, rng.standard_normal((B, H, T, V)), cu_seqlens=cu)
    assert D.shape == (3, H, K, V)
    assert validations == [1, 1]
    assert scans == Counter({"q": 2, "k": 2, "v": 2, "beta": 2, "grad_output": 1}), scans


@pytest.mark.parametrize("packed", [False, True])
def test_dask_blocks_scan_once(counted, packed):
    """kda.dask: each block's arrays are validated and scanned once (its check task), however many
    tasks read the block (the shard maps, the forward, the backward)."""
    dask = pytest.importorskip("dask")
    da = pytest.importorskip("dask.array")
    import kda.dask as kdd

    _, scans = counted
    rng = np.random.default_rng(7)
    B, H, T, K, V = 1, 2, 64, 4, 3
    q, k = (rng.standard_normal((B, H, T, K)) for _ in range(2))
    v, do = (rng.standard_normal((B, H, T, V)) for _ in range(2))
    g = -np.abs(rng.standard_normal((B, H, T, K)))
    beta = rng.uniform(size=(B, H, T))
    cu = np.array([0, 20, 64]) if packed else None  # the second sequence crosses the time blocks
    N = 2 if packed else B
    s0, dfinal = (rng.standard_normal((N, H, K, V)) for _ in range(2))
    blocks = [da.from_array(a, chunks=(1, H, 32, -1)[: a.ndim]) for a in (q, k, v, g, beta, do)]
    steps, grad = blocks[:5], blocks[5]
    with dask.config.set(scheduler="synchronous"):
        out = kdd.chunk_kda(*steps, initial_state=s0, chunk_size=8, cu_seqlens=cu)
        dask.compute(out.output, out.final_state)
        assert scans == Counter({"q": 2, "k": 2, "v": 2, "beta": 2, "initial_state": 1}), scans
        scans.clear()
        grads = kdd.chunk_kda_backward(
            *steps, None, grad, dfinal, initial_state=s0, chunk_size=8, cu_seqlens=cu
        )
        dask.compute(*grads[:6])
    want = {"q": 2, "k": 2, "v": 2, "beta": 2, "grad_output": 2, "initial_state": 1, "grad_final_state": 1}
    assert scans == Counter(want), scans
