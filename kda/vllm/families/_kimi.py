"""Tiny random Kimi Linears written as Moonshot's checkpoints (what vLLM reads), for the families
:mod:`kda.vllm.families.kda_only` and :mod:`kda.vllm.families.kimi_linear`."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .._common import VOCAB

#: the MLA layer as released (no q-LoRA; NoPE: ``mla_use_nope``)
MLA = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def build(
    path: str,
    seed: int,
    layer_types: list[str],
    moe: bool = False,
    hidden: int = 64,
    kda_heads: int = 2,
    kda_head_dim: int = 32,
    mla_heads: int = 2,
    experts: int = 4,
    moe_intermediate: int | None = None,
    min_moe_per_rank: int | None = None,
) -> Any:
    """Write a random Kimi Linear of ``layer_types`` (``linear_attention``: KDA; ``full_attention``:
    MLA as released) to ``path``; return transformers' model (float32). Layer 1's MLP is dense, the
    others MoE with ``moe`` (a sigmoid router with a drawn ``e_score_correction_bias``, ``experts``
    of ``moe_intermediate``, default ``hidden // 2``, two a token, a shared expert;
    ``min_moe_per_rank``: the config's ``min_moe_intermediate_per_partition``, up to which vLLM's
    ``KimiMoE`` pads each tensor-parallel rank's share, 256 when unset). In Moonshot's
    names: ``linear_attn_config``, a dense MLP's ``mlp.*`` (transformers writes
    ``block_sparse_moe.*``), the MLA fields null without an MLA layer (vLLM-CPU would otherwise turn
    prefix caching off for MLA). The output head is scaled up for clear greedy margins."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    n, mla = len(layer_types), "full_attention" in layer_types
    mlp = ["dense"] + ["sparse" if moe else "dense"] * (n - 1)
    sizes = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n)
    moe_sizes = dict(moe_intermediate_size=moe_intermediate or hidden // 2, num_local_experts=experts)
    heads = dict(num_attention_heads=mla_heads, num_key_value_heads=mla_heads, linear_num_heads=kda_heads)
    kinds = dict(layer_types=layer_types, mlp_layer_types=mlp, linear_head_dim=kda_head_dim)
    more = dict(linear_conv_kernel_dim=4, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=None)
    cfg = transformers.KimiLinearConfig(**sizes, **moe_sizes, **heads, **kinds, **more, **SPECIAL, **MLA)
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_()
    model.save_pretrained(path)
    weights = os.path.join(path, "model.safetensors")
    dense = re.compile(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.")
    tensors = {dense.sub(r".mlp.\1.", k): v for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(layer_types) if t == "full_attention"],
        "head_dim": kda_head_dim,
        "num_heads": kda_heads,
        "short_conv_kernel_size": 4,
    }
    config.update(
        first_k_dense_replace=1 if moe else n, mla_use_nope=True, moe_router_activation_func="sigmoid"
    )
    if not mla:
        config.update(dict.fromkeys(("q_lora_rank", *MLA)))
    if min_moe_per_rank is not None:
        config["min_moe_intermediate_per_partition"] = min_moe_per_rank
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return model


def reference(model: Any, ids: list[list[int]], tokens: int, dtype: str, record: dict) -> list[Any]:
    """transformers' Kimi Linear on kda (:mod:`kda.transformers`): ``generate``, or token by token
    for a model without an attention layer."""
    from ...transformers import apply_kda_to_kimi_linear
    from ._transformers import generate_reference, stepwise_reference

    types = model.config.layer_types
    run = generate_reference if "full_attention" in types else stepwise_reference
    return run(model, ids, tokens, dtype, apply_kda_to_kimi_linear)
