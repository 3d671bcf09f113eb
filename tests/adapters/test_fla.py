"""kda against flash-linear-attention's own reference code (``fla/ops/kda/naive.py``): outputs, final
states and every gradient (fla's by PyTorch autograd), time-major with grouped value heads.

fla-core is installed without its dependencies (``pip install --no-deps fla-core``; the naive file
needs only torch and einops) and the file is loaded by path, as ``kda bench`` does. Where fla is
missing the test skips, unless ``KDA_REQUIRE_FLA=1`` (set by CI), where it fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_within, fla_naive

import kda

# fla's naive functions compute in float32 whatever the input dtype; measured against kda's float64
# chunked form here: at most 1.6e-7 (naive_recurrent_kda) and 4.3e-7 (naive_chunk_kda)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def fla():
    return fla_naive()


def _problem(seed: int = 0) -> dict[str, np.ndarray]:
    """Time-major float64 inputs: H = 2 query/key heads, HV = 4 value heads, mild decay."""
    B, T, H, HV, K, V = 1, 96, 2, 4, 16, 8
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, T, H, K))
    return {
        "q": rng.standard_normal((B, T, H, K)),
        "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
        "v": rng.standard_normal((B, T, HV, V)),
        "g": -rng.uniform(0.0, 0.5, (B, T, HV, K)),
        "beta": rng.uniform(0.0, 1.0, (B, T, HV)),
        "initial_state": rng.standard_normal((B, HV, K, V)),
        "grad_output": rng.standard_normal((B, T, HV, V)),
        "grad_final_state": rng.standard_normal((B, HV, K, V)),
    }


def _fla_run(fla, name: str, x: dict[str, np.ndarray], scale: float, chunk_size: int):
    """fla's output, final state and input gradients (autograd), as float64 NumPy arrays."""
    import torch

    inputs = {
        n: torch.tensor(x[n], dtype=torch.float32, requires_grad=True)
        for n in ("q", "k", "v", "g", "beta", "initial_state")
    }
    extra = {"chunk_size": chunk_size} if name == "naive_chunk_kda" else {}
    o, S = getattr(fla, name)(
        *(inputs[n] for n in ("q", "k", "v", "g", "beta")),
        scale=scale,
        initial_state=inputs["initial_state"],
        output_final_state=True,
        **extra,
    )
    loss = (o * torch.tensor(x["grad_output"], dtype=torch.float32)).sum()
    loss = loss + (S * torch.tensor(x["grad_final_state"], dtype=torch.float32)).sum()
    loss.backward()
    grads = [inputs[n].grad.double().numpy() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    return o.detach().double().numpy(), S.detach().double().numpy(), grads


@pytest.mark.parametrize("name", ["naive_recurrent_kda", "naive_chunk_kda"])
def test_matches_fla_naive_with_gradients(fla, name):
    x = _problem()
    scale, C = 0.3, 32
    o_fla, s_fla, grads_fla = _fla_run(fla, name, x, scale, C)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    opts = {"scale": scale, "initial_state": x["initial_state"], "chunk_size": C, "layout": "time_major"}
    out = kda.chunk_kda(*args, **opts, save_boundaries=True)
    grads = kda.chunk_kda_backward(*args, out.boundaries, x["grad_output"], x["grad_final_state"], **opts)
    assert_within(o_fla, out.output, tol=TOLERANCE, dtype="any", name="output")
    assert_within(s_fla, out.final_state, tol=TOLERANCE, dtype="any", name="final_state")
    for field, got, want in zip(kda.KdaGradients._fields, grads_fla, grads[:6]):
        assert_within(got, want, tol=TOLERANCE, dtype="any", name=f"d{field}")
