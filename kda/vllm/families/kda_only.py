"""``python -m kda.vllm check`` (``--model kimi``): a tiny random Kimi Linear of KDA layers only (two
layers of two heads of 32, hidden 64, dense MLPs, vocabulary 128; built with transformers, no
download) against transformers' Kimi Linear on kda, token by token (a model without attention
layers: transformers' ``generate`` cannot tell its sequence length). One engine (vLLM's default
flags, one sequence at a time), float32 and bfloat16: a 16-token prompt, and a 300-token prompt twice
(longer than vLLM-CPU's 128-token block: the second pass must be served partly from the prefix
cache)."""

from __future__ import annotations

from typing import Any

from .._common import Engine, Family, Model, Phase, prompt
from ._kimi import build, reference

LAYERS = 2
CACHE_PROMPT_LEN = 300


def build_model(path: str, seed: int = 0) -> Any:
    """Write the model to ``path`` (Moonshot's checkpoint format); return transformers' model."""
    return build(path, seed, ["linear_attention"] * LAYERS)


FAMILY = Family(
    name="kimi",
    models=(Model("all-kda", build_model),),
    engines=(
        Engine(
            "default",
            (Phase("one", "one"), Phase("prefix", "long", 2, "twice")),
            {"max_num_seqs": 1},
            dtypes=("float32", "bfloat16"),
        ),
    ),
    prompts=lambda seed: {"one": [prompt(seed)], "long": [prompt(seed + 1, CACHE_PROMPT_LEN)]},
    reference=reference,
    doc="every layer KDA, against transformers on kda",
)
