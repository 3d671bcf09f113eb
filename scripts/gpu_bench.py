"""Real-GPU accuracy check and timings of kda's CUDA backend (and of fla's Triton chunk_kda).

Run by ``scripts/gpu_check.sh`` on a lent GPU machine; writes ``bench.json`` and ``bench.md``
under ``--out``. Sections:

1. accuracy: ``chunk_kda`` / ``chunk_kda_backward`` with the cuda backend in float32 at
   B=2, H=16, T=4096, K=V=128 against the array-API reference recurrence run in float64 on
   the same GPU (CuPy arrays), for a mild and a mixed (strong decays + hard resets) gate regime;
   relative error = max-abs error / max-abs reference, per output and gradient.
2. timings at B=1, H=16, T=4096, K=V=128, chunk 64: forward, and forward + backward, of the
   cuda backend (float32, head-first [B, H, T, K]) and of flash-linear-attention's Triton
   ``fla.ops.kda.chunk_kda`` (time-major [B, T, H, K]; bfloat16, its usual dtype, and float32
   when it accepts it). Median of CUDA-event timings after warm-up.
3. profile: milliseconds per kda.cuda kernel in one forward + backward at that size (CUDA events
   around every launch), to set against the per-kernel estimates of docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback

import cupy as cp
import numpy as np

import kda
from kda.cuda._launch import LAUNCHES


def rel(got, want) -> float:
    got = cp.asarray(got, dtype=cp.float64)
    want = cp.asarray(want, dtype=cp.float64)
    if not bool(cp.all(cp.isfinite(got))):
        return float("inf")
    return float(cp.max(cp.abs(got - want)) / max(float(cp.max(cp.abs(want))), 1e-300))


def problem(B, H, T, K, V, regime, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, T, K))
    k = rng.standard_normal((B, H, T, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, H, T, V))
    g = -np.exp(rng.uniform(math.log(1e-3), 0.0, (B, H, T, K)))
    if regime == "mixed":
        u = rng.uniform(size=g.shape)
        g = np.where(u < 0.05, -rng.uniform(1.0, 1e3, g.shape), g)
        g = np.where(u > 0.999, -np.inf, g)
    beta = rng.uniform(0.0, 1.0, (B, H, T))
    state = rng.standard_normal((B, H, K, V)) * 0.1
    do = rng.standard_normal((B, H, T, V))
    dstate = rng.standard_normal((B, H, K, V))
    return [cp.asarray(x) for x in (q, k, v, g, beta, state, do, dstate)]


def accuracy(report: dict) -> None:
    B, H, T, K, V = 2, 16, 4096, 128, 128
    for regime in ("mild", "mixed"):
        arrays = problem(B, H, T, K, V, regime)
        q, k, v, g, beta, state, do, dstate = arrays
        t0 = time.perf_counter()
        want = kda.recurrent_kda(q, k, v, g, beta, initial_state=state, backend="reference")
        want_g = kda.recurrent_kda_backward(
            q, k, v, g, beta, do, dstate, initial_state=state, backend="reference"
        )
        cp.cuda.Device().synchronize()
        oracle_s = time.perf_counter() - t0
        f32 = [x.astype(cp.float32) for x in arrays]
        q, k, v, g, beta, state, do, dstate = f32
        out = kda.chunk_kda(q, k, v, g, beta, initial_state=state, chunk_size=64, save_boundaries=True)
        grads = kda.chunk_kda_backward(
            q, k, v, g, beta, out.boundaries, do, dstate, initial_state=state, chunk_size=64
        )
        errs = {"output": rel(out.output, want.output), "final_state": rel(out.final_state, want.final_state)}
        for name, got, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dstate"), grads, want_g):
            errs[name] = rel(got, ref)
        errs["oracle_seconds"] = oracle_s
        report["accuracy"][regime] = errs
        print(f"accuracy {regime}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()), flush=True)


def cuda_time(fn, warmup=2, repeat=10) -> float:
    """Median milliseconds of ``fn()`` by CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def time_kda(report: dict) -> None:
    B, H, T, K, V = 1, 16, 4096, 128, 128
    q, k, v, g, beta, state, do, dstate = (x.astype(cp.float32) for x in problem(B, H, T, K, V, "mild"))

    def forward():
        return kda.chunk_kda(q, k, v, g, beta, initial_state=state, chunk_size=64, save_boundaries=True)

    def forward_backward():
        out = forward()
        b = out.boundaries
        return kda.chunk_kda_backward(q, k, v, g, beta, b, do, dstate, initial_state=state, chunk_size=64)

    LAUNCHES.clear()
    forward()
    fwd_launches = dict(LAUNCHES)
    LAUNCHES.clear()
    forward_backward()
    fb_launches = dict(LAUNCHES)
    report["timings_ms"]["kda.cuda float32 forward"] = cuda_time(forward)
    report["timings_ms"]["kda.cuda float32 forward+backward"] = cuda_time(forward_backward)
    report["launches"] = {"forward": fwd_launches, "forward+backward": fb_launches}
    # the forward state pass's two cuts side by side, interleaved (kda.cuda.state_pass.STATE_PASS)
    import kda.cuda.state_pass as launch

    default = launch.STATE_PASS
    try:
        for variant in ("staged", "broadcast", "staged", "broadcast"):
            launch.STATE_PASS = variant
            ms = cuda_time(forward)
            key = f"kda.cuda float32 forward ({variant} state pass)"
            report["timings_ms"][key] = min(ms, report["timings_ms"].get(key, ms))
    finally:
        launch.STATE_PASS = default
    # the recurrence kernels, for scale
    report["timings_ms"]["kda.cuda float32 recurrent forward"] = cuda_time(
        lambda: kda.recurrent_kda(q, k, v, g, beta, initial_state=state), warmup=1, repeat=3
    )


def profile_kernels(report: dict) -> None:
    """Milliseconds per kernel of one forward + backward (events around each launch)."""
    import kda.cuda._launch as launch

    B, H, T, K, V = 1, 16, 4096, 128, 128
    q, k, v, g, beta, state, do, dstate = (x.astype(cp.float32) for x in problem(B, H, T, K, V, "mild"))
    events = []
    original = launch.launch  # every family's launches go through it

    def timed(name, *args, **kwargs):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        original(name, *args, **kwargs)
        stop.record()
        events.append((name, start, stop))

    def run():
        out = kda.chunk_kda(q, k, v, g, beta, initial_state=state, chunk_size=64, save_boundaries=True)
        kda.chunk_kda_backward(
            q, k, v, g, beta, out.boundaries, do, dstate, initial_state=state, chunk_size=64
        )

    run()  # compile and warm up
    cp.cuda.Device().synchronize()
    launch.launch = timed
    try:
        events.clear()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        run()
        stop.record()
        stop.synchronize()
    finally:
        launch.launch = original
    per_kernel: dict = {}
    for name, a, b in events:
        per_kernel[name] = per_kernel.get(name, 0.0) + cp.cuda.get_elapsed_time(a, b)
    per_kernel["(whole call, events included)"] = cp.cuda.get_elapsed_time(start, stop)
    report["profile_ms"] = per_kernel
    print("profile: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in per_kernel.items()), flush=True)


def torch_time(fn, warmup=3, repeat=10) -> float:
    """Median milliseconds of ``fn()`` by CUDA events on torch's current stream."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))


def time_fla_dtype(report: dict, arrays: list, name: str, g_name: str) -> None:
    """fla's chunk_kda in torch dtype ``name``, log decays in ``g_name``."""
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    dtype = getattr(torch, name)
    K = arrays[0].shape[-1]
    # kda's head-first [B, H, T, D] -> fla's time-major [B, T, H, D]
    tq, tk, tv, tg, tbeta = (
        torch.from_dlpack(x.astype(cp.float32)).transpose(1, 2).contiguous() for x in arrays[:5]
    )
    leaves = [x.to(dtype).requires_grad_() for x in (tq, tk, tv)]
    leaves += [tg.to(getattr(torch, g_name)).requires_grad_(), tbeta.to(dtype).requires_grad_()]
    tdo = torch.randn_like(leaves[2])

    def forward():
        with torch.no_grad():
            return fla_chunk_kda(*leaves, scale=K**-0.5, output_final_state=True)

    def forward_backward():
        o, _ = fla_chunk_kda(*leaves, scale=K**-0.5, output_final_state=True)
        o.backward(tdo)

    report["timings_ms"][f"fla chunk_kda {name} forward"] = torch_time(forward)
    report["timings_ms"][f"fla chunk_kda {name} forward+backward"] = torch_time(forward_backward)
    # fla's output against kda's float32 output, for information (its dtype's rounding included)
    o, _ = forward()
    q, k, v, g, beta = (x.astype(cp.float32) for x in arrays[:5])
    ours = kda.chunk_kda(q, k, v, g, beta, chunk_size=64).output
    theirs = cp.asarray(o.float().transpose(1, 2).contiguous().detach())
    report["fla_vs_kda_output_rel"][name] = rel(theirs, ours)


def time_fla_bfloat16(report: dict) -> None:
    time_fla(report, "bfloat16")


def time_fla_float32(report: dict) -> None:
    time_fla(report, "float32")


def time_fla(report: dict, name: str) -> None:
    arrays = problem(1, 16, 4096, 128, 128, "mild")
    for g_name in dict.fromkeys(("float32", name)):  # fla keeps g in float32; else g in q's dtype
        try:
            time_fla_dtype(report, arrays, name, g_name)
            report["fla_g_dtype"][name] = g_name
            return
        except Exception as err:  # record and go on: fla may not accept every dtype
            report["errors"][f"fla {name} (g {g_name})"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args()
    report = {
        "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "accuracy": {},
        "timings_ms": {},
        "fla_vs_kda_output_rel": {},
        "fla_g_dtype": {},
        "profile_ms": {},
        "errors": {},
    }
    # most important first: the JSON is rewritten after every section, should the time run out
    sections = ([] if args.skip_accuracy else [accuracy]) + [time_kda, profile_kernels]
    sections += [time_fla_bfloat16, time_fla_float32]
    for section in sections:
        t0 = time.perf_counter()
        try:
            section(report)
        except Exception as err:
            report["errors"][section.__name__] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        print(f"{section.__name__}: {time.perf_counter() - t0:.1f} s", flush=True)
        with open(f"{args.out}/bench.json", "w") as fh:
            json.dump(report, fh, indent=2)
    lines = ["| what | value |", "| --- | --- |"]
    lines += [f"| {name} (ms) | {ms:.3f} |" for name, ms in report["timings_ms"].items()]
    lines += [f"| kernel {name} (ms) | {ms:.3f} |" for name, ms in report["profile_ms"].items()]
    for regime, errs in report["accuracy"].items():
        lines += [f"| accuracy {regime} {name} | {e:.2e} |" for name, e in errs.items()]
    lines += [f"| fla vs kda output ({n}) | {e:.2e} |" for n, e in report["fla_vs_kda_output_rel"].items()]
    lines += [f"| error {n} | {e} |" for n, e in report["errors"].items()]
    table = "\n".join(lines)
    with open(f"{args.out}/bench.md", "w") as fh:
        fh.write(f"# kda.cuda on {report['device']}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
