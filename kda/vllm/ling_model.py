"""A tiny random Ling-3 (``BailingMoeV3ForCausalLM``) in the released checkpoints' conventions, written
locally (no download; transformers has no Ling-3 class, so the config is written as JSON beside the
configuration module the released checkpoints ship, ``configuration_bailing_moe_v3.py``).

The conventions (those vLLM's ``bailing_moe_v3.py`` and llama.cpp's converter
``conversion/bailingmoe3.py`` read):

- ``model_type`` ``bailing_hybrid``, ``auto_map`` to the configuration module (vLLM loads it with
  ``trust_remote_code=True``);
- layer grouping: ``layer_group_size`` ``G``; layer ``i`` is KDA unless ``(i + 1) % G == 0`` or ``i``
  is past the last whole group (``i >= n // G * G``), then it is MLA (full attention); here 5 layers
  with ``G = 4``: KDA 0-2, MLA 3 (the group's last) and 4 (past the last whole group);
- KDA: ``no_kda_lora`` (full ``f_proj``), ``kda_safe_gate`` with ``kda_lower_bound`` -5 (the gate
  ``-5 * sigmoid(exp(A_log) * (f + dt_bias))``), ``{q,k,v}_proj``, ``b_proj``, ``g_proj`` (the
  output gate, sigmoid), ``o_norm``, ``o_proj``, ``{q,k,v}_conv1d [H K, 1, 4]``, ``A_log [H]``,
  ``dt_bias [H K]``, heads of ``head_dim``;
- MLA as released: ``kv_lora_rank`` 512, ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64 (RoPE,
  interleaved), ``v_head_dim`` 128, a query LoRA (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``;
  ``q_lora_rank`` here 64), the head-wise output gate (``gated_attention_proj_granularity_type``
  ``head_wise``: ``g_proj [H, hidden]``), ``dense`` the output projection;
- MoE from ``first_k_dense_replace`` 1 (layer 0 a dense MLP): sigmoid router with
  ``expert_bias`` (``noaux_tc``), grouped top-k (``n_group``, ``topk_group``), normalised top-k
  weights scaled by ``routed_scaling_factor``, a shared expert;
- checkpoint names ``model.word_embeddings``, ``model.layers.N.attention.*``, ``model.layers.N.mlp.*``
  (``mlp.gate.weight``, ``mlp.gate.expert_bias``, ``mlp.experts.E.{gate,up,down}_proj``,
  ``mlp.shared_experts.*``), ``model.norm``, ``lm_head``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

__all__ = ["CONFIG_MODULE", "LAYERS", "build_model", "config", "is_kda_layer"]

VOCAB, HIDDEN, HEADS, HEAD_DIM = 128, 64, 2, 32
LAYERS, GROUP = 5, 4
KV_LORA, Q_LORA, NOPE, ROPE, V_DIM = 512, 64, 128, 64, 128
EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, MOE_DIM = 8, 2, 4, 2, 32

#: the configuration module written beside ``config.json`` (the released checkpoints ship theirs)
CONFIG_MODULE = '''"""Bailing MoE V3 (Ling-3) configuration: every field of config.json, as written."""

from transformers.configuration_utils import PretrainedConfig


class BailingMoeV3Config(PretrainedConfig):
    model_type = "bailing_hybrid"

    def __init__(self, **kwargs):
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
'''


def is_kda_layer(i: int, layers: int = LAYERS, group: int = GROUP) -> bool:
    """Whether layer ``i`` is a KDA layer (else MLA): the released checkpoints' grouping."""
    return not ((i + 1) % group == 0 or i >= layers // group * group)


def config() -> dict[str, Any]:
    """The ``config.json`` of the tiny model."""
    return {
        "architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid",
        "auto_map": {"AutoConfig": "configuration_bailing_moe_v3.BailingMoeV3Config"},
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": LAYERS, "layer_group_size": GROUP, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu", "use_bias": False,
        "use_qkv_bias": False, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 4096, "rope_theta": 600000.0, "partial_rotary_factor": 0.5,
        "rope_interleave": True, "rope_scaling": None,
        # KDA
        "no_kda_lora": True, "kda_safe_gate": True, "kda_lower_bound": -5.0, "short_conv_kernel_size": 4,
        # MLA
        "kv_lora_rank": KV_LORA, "q_lora_rank": Q_LORA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
        "v_head_dim": V_DIM, "gated_attention_proj_granularity_type": "head_wise",
        # MoE
        "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_group": N_GROUP, "topk_group": TOPK_GROUP,
        "num_shared_experts": 1, "moe_intermediate_size": MOE_DIM,
        "moe_shared_expert_intermediate_size": MOE_DIM,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "score_function": "sigmoid", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "moe_router_enable_expert_bias": True, "router_dtype": "fp32", "num_nextn_predict_layers": 0,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }  # fmt: skip


def build_model(path: str, seed: int = 0, mix: float = 1.0) -> dict[str, Any]:
    """Write ``config.json``, ``configuration_bailing_moe_v3.py`` and ``model.safetensors`` (random
    weights, scaled by fan-in; the output head scaled up for clear greedy margins) to ``path``;
    returns the config. ``mix`` scales every layer's output projection (KDA's ``o_proj``, MLA's
    ``dense``, every MLP's ``down_proj``), the same random draws otherwise: below 1 the embedding's
    own path through the residual stream weighs more, and greedy runs come back to earlier tokens
    (``check --model ling``'s speculative row, :mod:`kda.vllm.families.ling`)."""
    import torch
    from safetensors.torch import save_file

    cfg = config()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "configuration_bailing_moe_v3.py"), "w") as f:
        f.write(CONFIG_MODULE)
    gen = torch.Generator().manual_seed(seed)

    def lin(rows: int, cols: int, s: float = 1.0) -> Any:
        return torch.randn(rows, cols, generator=gen) * (s / math.sqrt(cols))

    def norm(n: int) -> Any:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    P = HEADS * HEAD_DIM
    t: dict[str, Any] = {
        "model.word_embeddings.weight": torch.randn(VOCAB, HIDDEN, generator=gen),
        "model.norm.weight": norm(HIDDEN), "lm_head.weight": lin(VOCAB, HIDDEN, 25.0),
    }  # fmt: skip
    for i in range(LAYERS):
        a, m = f"model.layers.{i}.attention.", f"model.layers.{i}."
        if is_kda_layer(i):
            for name, shape in (("q_proj", (P, HIDDEN)), ("k_proj", (P, HIDDEN)), ("v_proj", (P, HIDDEN)),
                                ("b_proj", (HEADS, HIDDEN)), ("f_proj", (P, HIDDEN)), ("g_proj", (P, HIDDEN)),
                                ("o_proj", (HIDDEN, P))):  # fmt: skip
                t[a + name + ".weight"] = lin(*shape, mix if name == "o_proj" else 1.0)
            for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
                t[a + name + ".weight"] = torch.randn(P, 1, 4, generator=gen) * 0.5
            t[a + "A_log"] = torch.randn(HEADS, generator=gen) * 0.5
            t[a + "dt_bias"] = torch.randn(P, generator=gen)
            t[a + "o_norm.weight"] = norm(HEAD_DIM)
        else:
            t[a + "q_a_proj.weight"] = lin(Q_LORA, HIDDEN)
            t[a + "q_a_layernorm.weight"] = norm(Q_LORA)
            t[a + "q_b_proj.weight"] = lin(HEADS * (NOPE + ROPE), Q_LORA)
            t[a + "kv_a_proj_with_mqa.weight"] = lin(KV_LORA + ROPE, HIDDEN)
            t[a + "kv_a_layernorm.weight"] = norm(KV_LORA)
            t[a + "kv_b_proj.weight"] = lin(HEADS * (NOPE + V_DIM), KV_LORA)
            t[a + "g_proj.weight"] = lin(HEADS, HIDDEN)
            t[a + "dense.weight"] = lin(HIDDEN, HEADS * V_DIM, mix)
        if i < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            t[m + "mlp.gate_proj.weight"] = lin(inter, HIDDEN)
            t[m + "mlp.up_proj.weight"] = lin(inter, HIDDEN)
            t[m + "mlp.down_proj.weight"] = lin(HIDDEN, inter, mix)
        else:
            t[m + "mlp.gate.weight"] = lin(EXPERTS, HIDDEN, 2.0)
            t[m + "mlp.gate.expert_bias"] = 0.1 * torch.randn(EXPERTS, generator=gen)
            for e in range(EXPERTS):
                x = f"{m}mlp.experts.{e}."
                t[x + "gate_proj.weight"] = lin(MOE_DIM, HIDDEN)
                t[x + "up_proj.weight"] = lin(MOE_DIM, HIDDEN)
                t[x + "down_proj.weight"] = lin(HIDDEN, MOE_DIM, mix)
            x = f"{m}mlp.shared_experts."
            t[x + "gate_proj.weight"], t[x + "up_proj.weight"] = lin(MOE_DIM, HIDDEN), lin(MOE_DIM, HIDDEN)
            t[x + "down_proj.weight"] = lin(HIDDEN, MOE_DIM, mix)
        t[m + "input_layernorm.weight"], t[m + "post_attention_layernorm.weight"] = norm(HIDDEN), norm(HIDDEN)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return cfg
