"""Accuracy at scale and timings of kda's CUDA backend (and of fla's Triton chunk_kda).

Run by ``scripts/gpu_check.sh``: writes ``bench.json`` and ``bench.md`` under ``--out``, both
rewritten after every section (a run cut short keeps what it measured). Sections, correctness
first:

1. ``accuracy``: ``chunk_kda`` / ``chunk_kda_backward`` with the cuda backend in float32 at
   B=2, H=16, T=4096, K=V=128 against the array-API reference recurrence run in float64 on the
   same device, in four of :data:`kda.testing.REGIMES` (the draws kda's tests use, :func:`kda.testing.gates`:
   mild ``g ~ -U(0, 1)``; mixed: each element from weak, strong, hard, reset or raw; strong:
   ``-1e-3 .. -1e3``; kimi: Kimi Linear's ``-exp(A_log) softplus(a)``); relative error = max-abs error
   / max-abs of the reference, per output and gradient.
2. ``timings``: at B=1, H=16, T=4096, K=V=128, chunk 64, float32, head-first: forward, and forward +
   backward, of the cuda backend with ``check_finite=False`` (no host synchronisation inside the
   timed window), both state-pass cuts interleaved, and the step recurrence. Median of CUDA-event
   timings after warm-up.
3. ``profile``: milliseconds per kda.cuda kernel in one forward + backward at that size (events
   around every launch), to set against docs/gpu.md's per-kernel estimates.
4. ``fla`` (``--fla``, run as its own step: Triton compiles on a cold cache): fla's
   ``fla.ops.kda.chunk_kda`` in bfloat16 (time-major ``[B, T, H, K]``, log decays in float32),
   forward and forward + backward, and its output against kda's float32 output.

``--simulate``: the same sections under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` set by
the caller) on NumPy arrays with ``backend="cuda"``, at tiny sizes, with wall-clock timings: it
checks the script, not the speed; fla is reported as skipped where torch has no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

import kda

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dstate")
REGIMES = ("mild", "mixed", "strong", "kimi")


class Device:
    """CuPy on a GPU, or NumPy under the simulator; timing by CUDA events or by the wall clock."""

    def __init__(self, simulate: bool) -> None:
        self.simulate = simulate
        if simulate:
            self.xp = np
            self.name = "Numba CUDA simulator (NumPy arrays, backend='cuda')"
        else:
            import cupy

            self.xp = cupy
            self.name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()

    def asarray(self, x: np.ndarray) -> Any:
        return self.xp.asarray(x)

    def host(self, x: Any) -> np.ndarray:
        return np.asarray(x) if self.simulate else self.xp.asnumpy(x)

    def sync(self) -> None:
        if not self.simulate:
            self.xp.cuda.Device().synchronize()

    def mark(self) -> Any:
        """A point in the stream: a recorded CUDA event, or the wall clock (the simulator is synchronous)."""
        if self.simulate:
            return time.perf_counter()
        event = self.xp.cuda.Event()
        event.record()
        return event

    def elapsed_ms(self, start: Any, stop: Any) -> float:
        if self.simulate:
            return (stop - start) * 1e3
        stop.synchronize()
        return float(self.xp.cuda.get_elapsed_time(start, stop))

    def time_ms(self, fn: Callable[[], Any], warmup: int = 2, repeat: int = 10) -> float:
        """Median milliseconds of ``fn()`` on the current stream."""
        if self.simulate:
            warmup, repeat = 0, 1
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeat):
            start = self.mark()
            fn()
            times.append(self.elapsed_ms(start, self.mark()))
        return float(np.median(times))


def sizes(simulate: bool, what: str) -> dict:
    """Problem sizes: the real ones on a GPU, tiny ones under the simulator."""
    if simulate:
        return {"B": 1, "H": 1, "T": 9, "K": 4, "V": 4, "chunk": 4}
    if what == "accuracy":
        return {"B": 2, "H": 16, "T": 4096, "K": 128, "V": 128, "chunk": 64}
    return {"B": 1, "H": 16, "T": 4096, "K": 128, "V": 128, "chunk": 64}


def gates(rng: np.random.Generator, shape: tuple, regime: str) -> np.ndarray:
    """Log decays of one of :data:`kda.testing.REGIMES` (:func:`kda.testing.gates`)."""
    import kda.testing

    return kda.testing.gates(rng, shape, regime)


def problem(dev: Device, size: dict, regime: str, seed: int = 0) -> list:
    """float64 device arrays q, k, v, g, beta, state, do, dstate (head-first)."""
    rng = np.random.default_rng(seed)
    B, H, T, K, V = (size[n] for n in "BHTKV")
    q = rng.standard_normal((B, H, T, K))
    k = rng.standard_normal((B, H, T, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, H, T, V))
    g = gates(rng, (B, H, T, K), regime)
    beta = rng.uniform(0.0, 1.0, (B, H, T))
    state = rng.standard_normal((B, H, K, V)) * 0.1
    do = rng.standard_normal((B, H, T, V))
    dstate = rng.standard_normal((B, H, K, V))
    return [dev.asarray(x) for x in (q, k, v, g, beta, state, do, dstate)]


def rel(dev: Device, got: Any, want: Any) -> float:
    xp = dev.xp
    got = xp.asarray(got, dtype=xp.float64)
    want = xp.asarray(want, dtype=xp.float64)
    if not bool(xp.all(xp.isfinite(got))):
        return float("inf")
    return float(xp.max(xp.abs(got - want)) / max(float(xp.max(xp.abs(want))), 1e-300))


def accuracy(dev: Device, report: dict) -> None:
    size = sizes(dev.simulate, "accuracy")
    report["sizes"]["accuracy"] = size
    chunk = size["chunk"]
    for regime in REGIMES:
        arrays = problem(dev, size, regime)
        q, k, v, g, beta, state, do, dstate = arrays
        t0 = time.perf_counter()
        want = kda.recurrent_kda(q, k, v, g, beta, initial_state=state, backend="reference")
        want_g = kda.recurrent_kda_backward(
            q, k, v, g, beta, do, dstate, initial_state=state, backend="reference"
        )
        dev.sync()
        oracle_s = time.perf_counter() - t0
        q, k, v, g, beta, state, do, dstate = (x.astype(dev.xp.float32) for x in arrays)
        out = kda.chunk_kda(
            q, k, v, g, beta, initial_state=state, chunk_size=chunk, save_boundaries=True, backend="cuda"
        )
        grads = kda.chunk_kda_backward(
            q,
            k,
            v,
            g,
            beta,
            out.boundaries,
            do,
            dstate,
            initial_state=state,
            chunk_size=chunk,
            backend="cuda",
        )
        errs = {"output": rel(dev, out.output, want.output)}
        errs["final_state"] = rel(dev, out.final_state, want.final_state)
        for name, got, ref in zip(GRAD_NAMES, grads, want_g):
            errs[name] = rel(dev, got, ref)
        report["accuracy"][regime] = errs
        report["accuracy_oracle_seconds"][regime] = oracle_s
        worst = max(errs.values())
        print(f"accuracy {regime}: worst {worst:.2e}; " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))


def timing_inputs(dev: Device) -> tuple[dict, list]:
    size = sizes(dev.simulate, "timings")
    return size, [x.astype(dev.xp.float32) for x in problem(dev, size, "mild")]


def timings(dev: Device, report: dict) -> None:
    from kda.cuda._launch import LAUNCHES

    size, (q, k, v, g, beta, state, do, dstate) = timing_inputs(dev)
    report["sizes"]["timings"] = size
    chunk = size["chunk"]
    opts = {"chunk_size": chunk, "backend": "cuda", "check_finite": False}

    def forward():
        return kda.chunk_kda(q, k, v, g, beta, initial_state=state, save_boundaries=True, **opts)

    def forward_backward():
        out = forward()
        return kda.chunk_kda_backward(
            q, k, v, g, beta, out.boundaries, do, dstate, initial_state=state, **opts
        )

    LAUNCHES.clear()
    forward()
    fwd_launches = dict(LAUNCHES)
    LAUNCHES.clear()
    forward_backward()
    report["launches"] = {"forward": fwd_launches, "forward+backward": dict(LAUNCHES)}
    ms = report["timings_ms"]
    ms["kda.cuda float32 forward"] = dev.time_ms(forward)
    ms["kda.cuda float32 forward+backward"] = dev.time_ms(forward_backward)
    # the forward state pass's two cuts side by side, interleaved (kda.cuda.state_pass.STATE_PASS)
    import kda.cuda.state_pass as state_pass

    default = state_pass.STATE_PASS
    try:
        # interleaved twice on a GPU; once each under the simulator (which times nothing real)
        for variant in ("staged", "broadcast") * (1 if dev.simulate else 2):
            state_pass.STATE_PASS = variant
            t = dev.time_ms(forward)
            key = f"kda.cuda float32 forward ({variant} state pass)"
            ms[key] = min(t, ms.get(key, t))
    finally:
        state_pass.STATE_PASS = default
    ms["kda.cuda float32 recurrent forward"] = dev.time_ms(
        lambda: kda.recurrent_kda(q, k, v, g, beta, initial_state=state, backend="cuda", check_finite=False),
        warmup=1,
        repeat=3,
    )
    print("timings: " + ", ".join(f"{n} {t:.3f} ms" for n, t in ms.items()))


def profile(dev: Device, report: dict) -> None:
    """Milliseconds per kernel of one forward + backward (a mark around every launch)."""
    import kda.cuda._launch as launch

    size, (q, k, v, g, beta, state, do, dstate) = timing_inputs(dev)
    opts = {"chunk_size": size["chunk"], "backend": "cuda", "check_finite": False}
    events = []
    original = launch.launch  # every family's launches go through it

    def timed(name, *args, **kwargs):
        start = dev.mark()
        original(name, *args, **kwargs)
        events.append((name, start, dev.mark()))

    def run():
        out = kda.chunk_kda(q, k, v, g, beta, initial_state=state, save_boundaries=True, **opts)
        kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do, dstate, initial_state=state, **opts)

    if not dev.simulate:  # the simulator compiles nothing
        run()  # compile and warm up
        dev.sync()
    launch.launch = timed
    try:
        start = dev.mark()
        run()
        stop = dev.mark()
    finally:
        launch.launch = original
    per_kernel: dict = {}
    for name, a, b in events:
        per_kernel[name] = per_kernel.get(name, 0.0) + dev.elapsed_ms(a, b)
    per_kernel["(whole call, marks included)"] = dev.elapsed_ms(start, stop)
    report["profile_ms"] = per_kernel
    print("profile: " + ", ".join(f"{n} {t:.3f} ms" for n, t in per_kernel.items()))


def fla(dev: Device, report: dict) -> None:
    """fla's Triton chunk_kda in bfloat16 (log decays in float32) at the timing size."""
    try:
        import torch
    except ImportError as err:
        report["skipped"]["fla"] = f"torch is not importable: {err}"
        return
    if dev.simulate or not torch.cuda.is_available():
        report["skipped"]["fla"] = "no CUDA device for torch and Triton (simulator run)"
        return
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    size = sizes(dev.simulate, "timings")
    arrays = problem(dev, size, "mild")
    K = size["K"]
    # kda's head-first [B, H, T, D] -> fla's time-major [B, T, H, D]
    tq, tk, tv, tg, tbeta = (
        torch.from_dlpack(x.astype(dev.xp.float32)).transpose(1, 2).contiguous() for x in arrays[:5]
    )
    bf16 = torch.bfloat16
    leaves = [x.to(bf16).requires_grad_() for x in (tq, tk, tv)]
    leaves += [tg.requires_grad_(), tbeta.to(bf16).requires_grad_()]
    tdo = torch.randn_like(leaves[2])

    def forward():
        with torch.no_grad():
            return fla_chunk_kda(*leaves, scale=K**-0.5, output_final_state=True)

    def forward_backward():
        o, _ = fla_chunk_kda(*leaves, scale=K**-0.5, output_final_state=True)
        o.backward(tdo)

    def torch_ms(fn, warmup=2, repeat=10):
        """Median milliseconds of ``fn()`` by CUDA events on torch's current stream."""
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeat):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return float(np.median(times))

    ms = report["timings_ms"]
    t0 = time.perf_counter()
    forward_backward()  # Triton's compilation, timed apart
    torch.cuda.synchronize()
    report["fla_compile_seconds"] = time.perf_counter() - t0
    ms["fla chunk_kda bfloat16 forward"] = torch_ms(forward)
    ms["fla chunk_kda bfloat16 forward+backward"] = torch_ms(forward_backward)
    # fla's output against kda's float32 output, for information (bfloat16's rounding included)
    o, _ = forward()
    q, k, v, g, beta = (x.astype(dev.xp.float32) for x in arrays[:5])
    ours = kda.chunk_kda(
        q, k, v, g, beta, chunk_size=size["chunk"], backend="cuda", check_finite=False
    ).output
    theirs = dev.xp.asarray(o.float().transpose(1, 2).contiguous().detach())
    report["fla_vs_kda_output_rel"]["bfloat16"] = rel(dev, theirs, ours)
    print(f"fla: {', '.join(f'{n} {t:.3f} ms' for n, t in ms.items() if n.startswith('fla'))}")


def write_markdown(report: dict, path: str) -> None:
    lines = [f"# kda.cuda on {report['device']}", ""]
    if report.get("simulate"):
        lines += ["Simulator run: tiny sizes, wall-clock times of the simulator (not a GPU's).", ""]
    lines += [f"Sizes: {json.dumps(report['sizes'])}", ""]
    if report["accuracy"]:
        names = ("output", "final_state", *GRAD_NAMES)
        lines += ["Accuracy, float32 vs the float64 recurrence (max-abs error / max-abs; contract 1e-5):", ""]
        lines += ["| regime | worst | " + " | ".join(names) + " |", "| --- " * (len(names) + 2) + "|"]
        for regime, errs in report["accuracy"].items():
            cells = " | ".join(f"{errs[n]:.1e}" for n in names)
            lines += [f"| {regime} | {max(errs.values()):.2e} | {cells} |"]
        lines += [""]
    lines += ["| what | value |", "| --- | --- |"]
    lines += [f"| {name} (ms) | {t:.3f} |" for name, t in report["timings_ms"].items()]
    lines += [f"| kernel {name} (ms) | {t:.3f} |" for name, t in report["profile_ms"].items()]
    if "fla_compile_seconds" in report:
        lines += [f"| fla compile (first call, s) | {report['fla_compile_seconds']:.1f} |"]
    lines += [f"| fla vs kda output ({n}) | {e:.2e} |" for n, e in report["fla_vs_kda_output_rel"].items()]
    lines += [f"| skipped {n} | {why} |" for n, why in report["skipped"].items()]
    lines += [f"| error {n} | {e} |" for n, e in report["errors"].items()]
    lines += [f"| section {n} (s) | {t:.1f} |" for n, t in report["section_seconds"].items()]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--simulate", action="store_true", help="Numba's CUDA simulator, NumPy arrays")
    parser.add_argument("--fla", action="store_true", help="only fla's chunk_kda (added to bench.json)")
    args = parser.parse_args()
    if args.simulate != (os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"):
        print("--simulate needs NUMBA_ENABLE_CUDASIM=1 (and a GPU run needs it unset)")
        return 2
    dev = Device(args.simulate)
    json_path, md_path = os.path.join(args.out, "bench.json"), os.path.join(args.out, "bench.md")
    report = {
        "device": dev.name,
        "simulate": args.simulate,
        "sizes": {},
        "accuracy": {},
        "accuracy_oracle_seconds": {},
        "timings_ms": {},
        "launches": {},
        "profile_ms": {},
        "fla_vs_kda_output_rel": {},
        "skipped": {},
        "errors": {},
        "section_seconds": {},
    }
    if args.fla and os.path.exists(json_path):  # the step after the main one: add to its report
        with open(json_path, encoding="utf-8") as fh:
            report.update(json.load(fh))
    sections = [fla] if args.fla else [accuracy, timings, profile]
    failed = False
    for section in sections:
        t0 = time.perf_counter()
        try:
            section(dev, report)
        except Exception as err:
            failed = True
            report["errors"][section.__name__] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        report["section_seconds"][section.__name__] = time.perf_counter() - t0
        print(f"{section.__name__}: {report['section_seconds'][section.__name__]:.1f} s", flush=True)
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
        write_markdown(report, md_path)
    # accuracy is a check: over the contract's float32 tolerance, the step fails
    worst = max((e for errs in report["accuracy"].values() for e in errs.values()), default=0.0)
    if worst > 1e-5:
        print(f"accuracy: worst relative error {worst:.2e} > 1e-5")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
