"""``check --model kimi-linear``: tiny random Kimi Linears in the released architecture (KDA layers
1-3 of two heads of 32, layer 4 MLA as released: ``kv_lora_rank`` 512, ``qk_nope_head_dim`` 128,
``qk_rope_head_dim`` 64, ``v_head_dim`` 128, no q-LoRA, NoPE, two heads), vocabulary 128, in
Moonshot's checkpoint names, against transformers' Kimi Linear on kda. ``dense``: hidden 64, dense
MLPs; ``moe``: hidden 64, a sigmoid router with a drawn ``e_score_correction_bias``, 4 experts of 32
(2 a token), a shared expert, ``first_k_dense_replace`` 1, not padded at tensor parallel 2 (its
config's ``min_moe_intermediate_per_partition`` 16); ``moe-padded``: the MoE at hidden 128, 8
experts of 64, whose per-rank 32 rows vLLM's ``KimiMoE`` pads to 256 at tensor parallel 2 (run by
``tp2`` only). Engines and runs: ``docs/vllm.md``."""

from __future__ import annotations

from typing import Any

from .._common import Engine, Family, Model, Phase, prompt
from ._kimi import build, reference

LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]  # Moonshot: kda_layers [1, 2, 3], MLA 4
CONCURRENT = (50, 120, 200, 275, 348)  # prompt lengths of the concurrent run
JOINING = (80, 150, 60, 220)  # the requests joining a running batch, in arrival order
SHARED_PREFIX, SUFFIXES = 300, (10, 40, 70)
#: ngram speculation as the check runs it: draft tokens looked up in the prompt and output so far
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def build_model(path: str, moe: bool, seed: int = 0, **sizes: Any) -> Any:
    """Write a random Kimi Linear (the module docstring) to ``path``; return transformers' model
    (float32). ``sizes``: :func:`kda.vllm.families._kimi.build`'s (``hidden``, ``kda_heads``,
    ``kda_head_dim``, ``mla_heads``, ``experts``, ``moe_intermediate``)."""
    return build(path, seed, LAYER_TYPES, moe, **sizes)


def prompts(seed: int) -> dict[str, list[list[int]]]:
    prefix = prompt(seed + 100, SHARED_PREFIX)
    return {
        "one": [prompt(seed)],
        "concurrent": [prompt(seed + 1 + i, n) for i, n in enumerate(CONCURRENT)],
        "joining": [prompt(seed + 10 + i, n) for i, n in enumerate(JOINING)],
        "prefix": [prefix + prompt(seed + 20 + i, n) for i, n in enumerate(SUFFIXES)],
    }


ONE, CONCURRENT_16 = Phase("one", "one"), Phase("concurrent", "concurrent", 16)
JOIN, PREFIX = Phase("joining", "joining", 16, "joining"), Phase("prefix", "prefix", 16, "twice")
SPEC = {"speculative_config": SPECULATIVE, "disable_log_stats": False}  # vLLM's metrics need its stats
CHUNKED = {"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 64}
# a small KV budget (32 blocks of 128 tokens, prefix caching on): five prompts decoding 64 tokens
# each do not fit at once, vLLM preempts requests
SMALL_KV = {"num_gpu_blocks_override": 32, "max_model_len": 512, "enable_prefix_caching": True}
FAMILY = Family(
    name="kimi-linear",
    models=(
        Model("dense", lambda path, seed: build_model(path, False, seed)),
        Model("moe", lambda path, seed: build_model(path, True, seed, min_moe_per_rank=16)),
        Model(
            "moe-padded", lambda path, seed: build_model(path, True, seed, hidden=128, experts=8), ("tp2",)
        ),
    ),
    engines=(
        Engine("default", (ONE, CONCURRENT_16, JOIN)),
        # prefix caching with 64-token chunked prefill: the second pass resumes from cached states
        Engine("chunked", (PREFIX,), CHUNKED),
        Engine("bf16", (ONE,), dtypes=("bfloat16",)),
        # a rank a core: vLLM-CPU's default binds a rank to a NUMA node
        Engine(
            "tp2",
            (ONE, CONCURRENT_16),
            {"tensor_parallel_size": 2},
            tag="tp2",
            env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        ),
        Engine("spec", (CONCURRENT_16,), SPEC, tag="spec", against="default"),
        Engine(
            "spec-no-prefix",
            (CONCURRENT_16,),
            {**SPEC, "enable_prefix_caching": False},
            tag="spec-no-prefix",
            against="default",
        ),
        # the KDA state pools filled with NaN when allocated: a read of a slot nothing wrote shows
        Engine(
            "poisoned",
            (Phase("concurrent", "concurrent", 64), JOIN, PREFIX),
            SMALL_KV,
            tag="poisoned",
            poison=("KimiGatedDeltaNetAttention",),
            default=False,
        ),
    ),
    prompts=prompts,
    reference=reference,
    fixes=True,
    doc="KDA + MLA (dense, MoE), against transformers on kda",
)
