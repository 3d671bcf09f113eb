"""kda.vllm.llama_cpp: the arguments it refuses (no llama.cpp needed), the tokenizer it writes for
llama.cpp's converter, and, where llama.cpp's sources and build are already in the cache
(``python -m kda.vllm.llama_cpp build``), a tiny random Kimi Linear converted to an F32 GGUF whose
llama.cpp greedy tokens equal transformers' float32 tokens. Nothing is built or downloaded here."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kda import KdaError
from kda.vllm import llama_cpp


def _have_sources() -> bool:
    return (llama_cpp.cache_dir() / f"llama_cpp_python-{llama_cpp.VERSION}" / "vendor" / "llama.cpp" /
            "convert_hf_to_gguf.py").is_file()  # fmt: skip


def _have_build() -> bool:
    return _have_sources() and (llama_cpp.cache_dir() / "build" / "bin" / llama_cpp.GREEDY).exists()


def test_refuses_bad_arguments(tmp_path):
    """Each bad argument raises a KdaError naming it, before anything is built or run."""
    with pytest.raises(KdaError, match="outtype"):
        llama_cpp.convert(tmp_path, "q4_k")
    with pytest.raises(KdaError, match="model_dir"):
        llama_cpp.convert(tmp_path, "f32")
    with pytest.raises(KdaError, match="tokens"):
        llama_cpp.greedy(tmp_path / "m.gguf", [[3, 4]], 0)
    with pytest.raises(KdaError, match="tokens"):
        llama_cpp.greedy(tmp_path / "m.gguf", [[3, 4], [5]], [2])
    with pytest.raises(KdaError, match="kv_type"):
        llama_cpp.greedy(tmp_path / "m.gguf", [[3, 4]], 2, kv_type="q8_0")
    with pytest.raises(KdaError, match="prompts"):
        llama_cpp.greedy(tmp_path / "m.gguf", [[]], 2)
    with pytest.raises(KdaError, match="vocab_size"):
        llama_cpp.write_tokenizer(tmp_path, 8)


def test_byte_table_is_gpt2s():
    """The byte -> character table the tokenizer's vocabulary is written in is the one tokenizers'
    ByteLevel pre-tokenizer maps bytes to (else the byte tokens would never match)."""
    tokenizers = pytest.importorskip("tokenizers")
    table = llama_cpp._gpt2_bytes()
    assert len(set(table)) == 256
    assert set(table) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert table[ord("a")] == "a" and table[ord(" ")] == "\u0120"


@pytest.mark.skipif(not _have_sources(), reason="llama.cpp's sources are not in the cache")
@pytest.mark.parametrize("vocab", [128, 1024])
def test_tokenizer_fits_the_vocabulary(tmp_path, vocab):
    """Every id of the written tokenizer is below ``vocab`` (the converter asserts it), ids 0-2 are
    the special tokens, text round-trips where its bytes are in the vocabulary, and the recorded
    hash is the hash of its tokens of the converter's fixed text."""
    pytest.importorskip("transformers")
    from transformers import PreTrainedTokenizerFast

    digest = llama_cpp.write_tokenizer(tmp_path, vocab)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert max(tok.get_vocab().values()) < vocab
    assert [tok.convert_ids_to_tokens(i) for i in range(3)] == list(llama_cpp.SPECIALS)
    assert tok.decode(tok.encode("the cat sat")) == "the cat sat"
    assert json.loads((tmp_path / llama_cpp.PRE_FILE).read_text()) == {digest: llama_cpp.PRE_TOKENIZER}
    assert digest == llama_cpp._pre_hash(tok, llama_cpp._check_text(llama_cpp.source_dir()))


@pytest.mark.skipif(not _have_build(), reason="llama.cpp is not built (python -m kda.vllm.llama_cpp build)")
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")
def test_kimi_linear_f32_greedy_equals_transformers(tmp_path):
    """A tiny random Kimi Linear (KDA and MLA layers, MoE): llama.cpp's greedy tokens from the F32
    GGUF that its own converter writes equal transformers' float32 greedy tokens (transformers'
    Kimi Linear with its KDA on kda, the reference of ``python -m kda.vllm check``)."""
    import torch

    from kda.transformers import apply_kda_to_kimi_linear
    from kda.vllm.families.kimi_linear import build_model

    model = build_model(str(tmp_path), moe=True, seed=0)
    apply_kda_to_kimi_linear(model)
    llama_cpp.write_tokenizer(tmp_path, model.config.vocab_size)
    gguf = llama_cpp.convert(tmp_path, "f32")
    prompts = [[5, 17, 33, 90, 4, 61, 7, 100], list(range(3, 60))]
    got = llama_cpp.greedy(gguf, prompts, 12, threads=1)
    for p, g in zip(prompts, got):
        with torch.inference_mode():
            want = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert g.tokens == want[0, len(p) :].tolist()
        assert min(g.margins) > 0


def _glm_text_config() -> dict:
    """A tiny GLM-5.3-Flash text model as llama.cpp's converter takes it: mHC on, layers KDA, MLA
    with the DSA indexer (nope only), KDA, KDA; a dense first layer, then MoE."""
    return dict(
        hidden_size=64, num_hidden_layers=4, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "deepseek_sparse_attention", "linear_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], indexer_types=["full"] * 4,
        first_k_dense_replace=1, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, head_dim=16, index_topk=2048, index_n_heads=2,
        index_head_dim=16, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-5, swiglu_limit=10.0,
        mla_use_nope=True,
        linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                            "gate_lower_bound": -5.0, "kda_layers": [0, 2, 3], "full_attn_layers": [1]},
    )  # fmt: skip


@pytest.mark.skipif(not _have_build(), reason="llama.cpp is not built (python -m kda.vllm.llama_cpp build)")
def test_glm5_next_f32_greedy_equals_transformers(tmp_path):
    """A tiny random GLM-5.3-Flash (transformers' Glm5NextForConditionalGeneration, saved as it
    saves it, a tiny vision tower the converter leaves out): llama.cpp's converter takes it with
    the GLM special tokens in the tokenizer, and llama.cpp's F32 greedy tokens equal transformers'
    float32 ones (its own torch path)."""
    pytest.importorskip("transformers.models.glm5_next")
    import torch
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(
        Glm5NextConfig(text_config=_glm_text_config(), vision_config=vision)
    )
    model = model.float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)  # clear greedy margins
    model.save_pretrained(str(tmp_path))
    llama_cpp.write_tokenizer(tmp_path, 512, llama_cpp.GLM_SPECIALS)
    gguf = llama_cpp.convert(tmp_path, "f32")
    prompts = [[5, 17, 33, 90, 4, 61, 7, 100], list(range(3, 60))]
    got = llama_cpp.greedy(gguf, prompts, 12, threads=1)
    for p, g in zip(prompts, got):
        with torch.inference_mode():
            want = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert g.tokens == want[0, len(p) :].tolist()
