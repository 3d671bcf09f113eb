"""``python -m benchmarks.chunk``: time the chunked KDA against the step recurrence and fla's reference.

For each sequence length ``T`` it times the forward and the forward+backward of

* ``chunk``: :func:`kda.chunk_kda` on NumPy with the default backend (the Numba ``cpu`` backend
  where numba is installed; forward+backward = ``chunk_kda(save_boundaries=True)`` then
  :func:`kda.chunk_kda_backward` with those boundaries),
* ``chunk_reference``: the same on the array-API ``reference`` backend,
* ``recurrent``: :func:`kda.recurrent_kda` / :func:`kda.recurrent_kda_backward` (the step loop),
* ``fla_naive_chunk`` / ``fla_naive_recurrent``: ``naive_chunk_kda`` / ``naive_recurrent_kda``
  from flash-linear-attention (``pip install fla-core``), PyTorch on CPU, gradients by autograd,

next to this machine's float32 GEMM rate, prints a table, and writes ``bench.json`` and
``bench.png`` to ``--out``. ``--parts`` adds (by default) or selects the inference parts of
:mod:`kda.bench.inference`: short sequences (``chunk_kda`` against ``recurrent_kda`` for T in
1..64 and their crossover), decoding from a state pool (against a copy of the touched states) and
prepared plans (against plain calls); ``--parts short decode plan`` runs only those. A separate
pass measures the peak memory of the chunked forward+backward with :mod:`tracemalloc`. Nothing
here is imported by :mod:`kda` itself; tqdm, matplotlib, torch and fla are optional
(``pip install kda[bench]``).

FLOP counts (per batch and head, ``d = K = V``, ``C`` the chunk size): the forward is counted as in
the Kimi Linear report, ``6 T d^2 + 3 T C d + T C^2``; the backward as twice that, so a
forward+backward is three times the forward count. The same counts are used for every method, so
GFLOP/s is an "effective" rate that compares run times, not the work each method really does.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
import tracemalloc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _common
from kda.testing import load_fla_naive

__all__ = ["main"]

METHODS = ("chunk", "chunk_reference", "recurrent", "fla_naive_chunk", "fla_naive_recurrent")
BACKEND_CHOICES = ("chunk", "chunk_reference", "recurrent", "fla_naive")
PASSES = ("fwd", "fwd+bwd")
PARTS = ("sweep", "short", "decode", "plan")
DEFAULT_T = (256, 1024, 4096, 16384)
MEMORY_TARGET = 1.5

FLA_CONVENTIONS = (
    "fla.ops.kda.naive: time-major q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H]; g is the "
    "per-step log decay (S <- exp(g) * S before the delta update), beta multiplies the delta-rule "
    "update, scale defaults to K**-0.5 and multiplies q; no L2 normalisation of q or k inside "
    "(the naive functions take no use_qk_l2norm_in_kernel argument); computes in float32 and "
    "returns v's dtype; naive_chunk_kda needs T % chunk_size == 0. The same definition as kda: "
    "inputs are passed as x.transpose(1, 2)."
)


# ----------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.chunk",
        description="Time kda's chunked forward/backward against the step recurrence and fla's "
        "CPU reference; print a table, write JSON and a PNG plot.",
    )
    p.add_argument("--B", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--H", type=int, default=16, help="heads (default 16)")
    p.add_argument("--K", type=int, default=128, help="key dimension (default 128)")
    p.add_argument("--V", type=int, default=128, help="value dimension (default 128)")
    p.add_argument(
        "--T", type=int, nargs="+", default=list(DEFAULT_T), help="sequence lengths (default %(default)s)"
    )
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per entry, median reported")
    p.add_argument(
        "--slow-seconds",
        type=float,
        default=5.0,
        help="entries whose warm-up takes longer than this are timed once (default 5)",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        choices=BACKEND_CHOICES,
        default=list(BACKEND_CHOICES),
        help="methods to run (fla_naive = fla's naive_chunk_kda and naive_recurrent_kda)",
    )
    p.add_argument("--recurrent-max-T", type=int, default=4096, help="cap for kda.recurrent_kda")
    p.add_argument("--fla-max-T", type=int, default=4096, help="cap for fla's naive forwards")
    p.add_argument(
        "--fla-bwd-max-T",
        type=int,
        default=2048,
        help="cap for fla's fwd+bwd (autograd memory: about 4.4 GiB at T=1024 with the default shape, "
        "linear in T)",
    )
    p.add_argument("--gemm-n", type=int, default=2048, help="size of the square GEMM (default 2048)")
    p.add_argument(
        "--memory-T",
        type=int,
        nargs="*",
        default=None,
        help="lengths for the tracemalloc pass of the chunked path (default: every --T; none: skip)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--out", type=Path, default=Path("benchmarks") / "results", help="output directory")
    p.add_argument("--name", default="bench", help="file stem of the JSON and PNG (default bench)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--seed", type=int, default=0)
    _inference_arguments(p)
    return p


def _inference_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the short-sequence, decode and plan parts (``kda/_bench_inference.py``)."""
    from benchmarks.inference import SHORT_T

    p.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="what to run: the T sweep, short sequences, decoding, prepared plans (default: all)",
    )
    four = ("B", "H", "K", "V")
    p.add_argument("--short-shape", type=int, nargs=4, default=[8, 16, 128, 128], metavar=four)
    p.add_argument("--short-T", type=int, nargs="+", default=list(SHORT_T), help="lengths of the short part")
    p.add_argument(
        "--decode-shape", type=int, nargs=4, default=[8, 16, 128, 128], metavar=("N", "H", "K", "V")
    )
    p.add_argument("--decode-T", type=int, default=1, help="steps per request in the decode part")
    p.add_argument("--plan-shape", type=int, nargs=4, default=[1, 4, 64, 64], metavar=four)
    p.add_argument("--plan-T", type=int, nargs="+", default=[64, 4096], help="lengths of the plan part")
    p.add_argument(
        "--rounds", type=int, default=9, help="interleaved sampling rounds of the inference parts (default 9)"
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="inference parts: wall time, or the process's CPU time (for an oversubscribed machine)",
    )
    p.add_argument(
        "--min-sample",
        type=float,
        default=0.02,
        help="short calls are looped to fill samples of at least this many seconds (default 0.02)",
    )


# ----------------------------------------------------------------------------------------------
# Progress


class _Progress:
    """tqdm when installed, else one rewritten line on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.n, self.enabled, self._bar = total, 0, enabled, None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, desc="kda bench", unit="run", file=sys.stderr, leave=False)

    def describe(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(text)
        else:
            sys.stderr.write(f"\r[{self.n}/{self.total}] {text:<60.60}")
            sys.stderr.flush()

    def step(self) -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\r" + " " * 80 + "\r")
            sys.stderr.flush()


# ----------------------------------------------------------------------------------------------
# FLOPs and timing


def forward_flops(B: int, H: int, T: int, d: int, C: int) -> float:
    """Kimi Linear report's count for the chunked forward: ``B H (6 T d^2 + 3 T C d + T C^2)``."""
    return float(B * H * (6 * T * d * d + 3 * T * C * d + T * C * C))


def pass_flops(pass_: str, B: int, H: int, T: int, d: int, C: int) -> float:
    """The forward count, or three times it for forward+backward (backward = 2x forward)."""
    f = forward_flops(B, H, T, d, C)
    return f if pass_ == "fwd" else 3.0 * f


def _time(fn: Callable[[], Any], repeats: int, slow: float, warm_up: bool) -> dict[str, Any]:
    """Warm-up run (unless the method is already warm and slow), then the median of the repeats
    (:func:`benchmarks._common.rounds`); an entry whose first run exceeds ``slow`` seconds is timed once."""
    warmup_s = _common.timed(fn)[1] if warm_up else None
    first = warmup_s if warmup_s is not None else math.inf
    n = 1 if first > slow or not warm_up else max(1, repeats)
    t = _common.rounds({"fn": fn}, n, warm_up=0)["fn"]
    return {"time_s": t.median_s, "times_s": t.times_s, "warmup_s": warmup_s, "repeats": n}


def _gemm(n: int, batch: int, C: int, K: int, V: int, dtype: Any, rng: np.random.Generator):
    """The GEMM reference (:func:`benchmarks._common.gemm_rate`, ``n^3``: the "% of GEMM" columns
    divide by it), then the matrix-product rates at the chunk's batched shapes (for reading)."""
    rate = _common.gemm_rate(n, dtype=dtype)
    flops = 2.0 * n**3
    rows = [{"name": f"{n}x{n} @ {n}x{n}", "flops": flops, "time_s": flops / rate / 1e9, "gflops": rate,
             "repeats": _common.GEMM_REPEATS, "reference": "benchmarks._common.gemm_rate"}]  # fmt: skip
    shapes = [
        (f"[{batch},{C},{K}] @ [{batch},{K},{V}]", (batch, C, K), (batch, K, V)),
        (f"[{batch},{C},{K}] @ [{batch},{K},{C}]", (batch, C, K), (batch, K, C)),
    ]
    for name, sa, sb in shapes:
        a = rng.standard_normal(sa).astype(dtype)
        b = rng.standard_normal(sb).astype(dtype)
        flops = 2.0 * math.prod(sa) * sb[-1]
        reps = 5
        t = _common.rounds({name: lambda a=a, b=b: np.matmul(a, b)}, reps)[name].median_s
        rows.append({"name": name, "flops": flops, "time_s": t, "gflops": flops / t / 1e9, "repeats": reps})
    return rows


# ----------------------------------------------------------------------------------------------
# Inputs and methods


def _fla_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("fla-core")
    except Exception:
        return None


def _torch_view(x: np.ndarray, grad: bool) -> Any:
    """Head-first NumPy -> time-major torch tensor (a copy, contiguous)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2)))
    return t.requires_grad_(grad)


def _kda_fns(name: str, x: dict[str, np.ndarray], C: int) -> dict[str, Callable[[], Any]]:
    import kda

    q, k, v, g, beta, do = (x[n] for n in ("q", "k", "v", "g", "beta", "do"))
    if name in ("chunk", "chunk_reference"):
        backend = "reference" if name == "chunk_reference" else None

        def fwd():
            return kda.chunk_kda(q, k, v, g, beta, chunk_size=C, backend=backend)

        def fwd_bwd():
            out = kda.chunk_kda(q, k, v, g, beta, chunk_size=C, save_boundaries=True, backend=backend)
            return kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do, chunk_size=C, backend=backend)

    else:

        def fwd():
            return kda.recurrent_kda(q, k, v, g, beta)

        def fwd_bwd():
            kda.recurrent_kda(q, k, v, g, beta)
            return kda.recurrent_kda_backward(q, k, v, g, beta, do)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _fla_fns(fn: Any, x: dict[str, np.ndarray], C: int, chunked: bool) -> dict[str, Callable[[], Any]]:
    import torch

    names = ("q", "k", "v", "g", "beta")
    plain = [_torch_view(x[n], False) for n in names]
    do = _torch_view(x["do"], False)
    kw = {"chunk_size": C} if chunked else {}

    def fwd():
        with torch.no_grad():
            return fn(*plain, **kw)

    def fwd_bwd():
        leaves = [t.detach().requires_grad_(True) for t in plain]
        o, _ = fn(*leaves, **kw)
        o.backward(do)
        return [t.grad for t in leaves]

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _verify_fla(fla: Any, K: int, V: int, C: int, seed: int) -> dict[str, Any]:
    """fla's naive forward and autograd gradients against kda.recurrent_kda(_backward), float64."""
    import kda

    B, H, T = 1, 2, 2 * C
    x = _common.inputs(B, H, T, K, V, np.float64, seed + 1)
    q, k, v, g, beta, do = (x[n] for n in ("q", "k", "v", "g", "beta", "do"))
    ref = kda.recurrent_kda(q, k, v, g, beta)
    gref = kda.recurrent_kda_backward(q, k, v, g, beta, do)
    chunk = kda.chunk_kda(q, k, v, g, beta, chunk_size=C)

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))

    report: dict[str, Any] = {
        "problem": {"B": B, "H": H, "T": T, "K": K, "V": V, "dtype": "float64", "chunk_size": C},
        "oracle": "kda.recurrent_kda / kda.recurrent_kda_backward",
        "max_rel_error": {"kda.chunk_kda output": rel(chunk.output, ref.output)},
    }
    names = ("q", "k", "v", "g", "beta")
    for label, fn, kw in (
        ("naive_chunk_kda", fla.naive_chunk_kda, {"chunk_size": C}),
        ("naive_recurrent_kda", fla.naive_recurrent_kda, {}),
    ):
        leaves = [_torch_view(x[n], True) for n in names]
        # fla computes in float32 internally (x.to(torch.float)) and returns v's dtype
        o, s = fn(*leaves, output_final_state=True, **kw)
        o.backward(_torch_view(do, False))
        o_np = np.swapaxes(o.detach().numpy(), 1, 2)
        errs = {"output": rel(o_np, ref.output), "final_state": rel(s.detach().numpy(), ref.final_state)}
        for n, t in zip(names, leaves):
            errs[f"grad_{n}"] = rel(np.swapaxes(t.grad.numpy(), 1, 2), getattr(gref, n))
        report["max_rel_error"][label] = errs
    report["note"] = "fla's naive functions compute in float32 even for float64 inputs"
    return report


# ----------------------------------------------------------------------------------------------
# Memory


def _nbytes(xs: Iterable[Any]) -> int:
    return int(sum(getattr(a, "nbytes", 0) for a in xs if a is not None))


def _memory(B: int, H: int, T: int, K: int, V: int, dtype: Any, C: int, seed: int) -> dict[str, Any]:
    """Peak traced bytes during chunk_kda(save_boundaries=True) + chunk_kda_backward.

    The inputs (q, k, v, g, beta and grad_output) are allocated under tracemalloc, the peak is reset,
    and the peak then covers inputs + everything live during the two calls. It is compared with
    inputs + outputs (output, final_state) + boundaries + gradients (dq, dk, dv, dg, dbeta,
    d initial_state): the bytes a caller must hold anyway.
    """
    import kda

    tracemalloc.start()
    try:
        x = _common.inputs(B, H, T, K, V, dtype, seed)
        del x["state"]  # not used: the call starts from zeros
        q, k, v, g, beta, do = (x[n] for n in ("q", "k", "v", "g", "beta", "do"))
        tracemalloc.reset_peak()
        start, _ = tracemalloc.get_traced_memory()
        out = kda.chunk_kda(q, k, v, g, beta, chunk_size=C, save_boundaries=True)
        grads = kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do, chunk_size=C)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    parts = {
        "inputs": _nbytes([q, k, v, g, beta, do]),
        "outputs": _nbytes([out.output, out.final_state]),
        "boundaries": _nbytes([out.boundaries]),
        "gradients": _nbytes(grads),
    }
    essential = sum(parts.values())
    return {
        "T": T,
        "peak_bytes": int(peak),
        "traced_at_start_bytes": int(start),
        "essential_bytes": essential,
        "essential_breakdown": parts,
        "ratio": peak / essential,
        "target_ratio": MEMORY_TARGET,
        "within_target": bool(peak <= MEMORY_TARGET * essential),
    }


# ----------------------------------------------------------------------------------------------
# Report


def _fmt_time(t: float) -> str:
    return f"{t:.3g}" if t < 1000 else f"{t:.0f}"


def _table(results: list[dict[str, Any]]) -> str:
    head = ("method", "pass", "T", "time s", "GFLOP/s", "% GEMM", "x reference", "x recurrent", "x fla chunk")
    rows = [head]
    for r in results:
        if r["status"] != "ok":
            rows.append((r["method"], r["pass"], str(r["T"]), r["reason"], "", "", "", "", ""))
            continue

        def ratio(key: str, r=r) -> str:
            val = r.get(key)
            return f"{val:.2f}" if val is not None else "-"

        rows.append(
            (
                r["method"],
                r["pass"],
                str(r["T"]),
                _fmt_time(r["time_s"]),
                f"{r['gflops']:.2f}",
                f"{r['pct_gemm']:.1f}",
                ratio("speedup_vs_chunk_reference"),
                ratio("speedup_vs_recurrent"),
                ratio("speedup_vs_fla_naive_chunk"),
            )
        )
    widths = [max(len(row[i]) for row in rows if row[4] or i < 3) for i in range(len(head))]
    lines = []
    for n, row in enumerate(rows):
        if n and not row[4]:  # skipped: reason spans the numeric columns
            lines.append("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3])
        else:
            lines.append(
                "  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
            )
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def _plot(results: list[dict[str, Any]], path: Path, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    fig, ax = plt.subplots(figsize=(7, 5))
    for n, method in enumerate(METHODS):
        for pass_, style in zip(PASSES, ("-o", "--s")):
            pts = [(r["T"], r["time_s"]) for r in results if r["method"] == method and r["pass"] == pass_]
            pts = [(t, s) for t, s in pts if s is not None]
            if pts:
                ts, ss = zip(*pts)
                ax.plot(ts, ss, style, color=f"C{n}", label=f"{method} {pass_}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (sequence length)")
    ax.set_ylabel("time (s), median")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------------------------
# Driver


def _cap(method: str, pass_: str, args: argparse.Namespace) -> int | None:
    if method == "recurrent":
        return args.recurrent_max_T
    if method.startswith("fla_"):
        return args.fla_max_T if pass_ == "fwd" else min(args.fla_max_T, args.fla_bwd_max_T)
    return None


def _check_args(args: argparse.Namespace) -> str | None:
    """The first bad argument, as a message; None when all are fine."""
    for name in ("B", "H", "K", "V", "chunk_size", "repeats", "gemm_n", "rounds"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if any(t < 1 for t in args.T):
        return "every --T must be >= 1"
    sizes = [
        *args.short_shape,
        *args.decode_shape,
        *args.plan_shape,
        *args.short_T,
        *args.plan_T,
        args.decode_T,
    ]
    if any(n < 1 for n in sizes):
        return "every --short-*, --decode-* and --plan-* size must be >= 1"
    return None


def _methods(args: argparse.Namespace) -> tuple[list[str], Any, str, dict[str, Any]]:
    """The methods to time, fla's naive module (or None), why it is missing, and fla's description."""
    methods = [m for m in ("chunk", "chunk_reference", "recurrent") if m in args.backends]
    fla, fla_reason, fla_info = None, "", {"requested": "fla_naive" in args.backends}
    if "fla_naive" in args.backends:
        fla, fla_reason = load_fla_naive()
        fla_info.update(available=fla is not None, version=_fla_version(), conventions=FLA_CONVENTIONS)
        if fla is None:
            fla_info["reason"] = fla_reason
            print(f"kda bench: {fla_reason}; skipping it", file=sys.stderr)
        else:
            methods += ["fla_naive_chunk", "fla_naive_recurrent"]
            import torch

            fla_info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    return methods, fla, fla_reason, fla_info


@dataclass
class _Sweep:
    """What the T sweep needs: the problem, the methods, and what it has measured so far."""

    args: argparse.Namespace
    methods: list[str]
    fla: Any
    Ts: list[int]
    gemm_rate: float = 0.0
    results: list[dict[str, Any]] = field(default_factory=list)

    @property
    def d(self) -> float:  # the report's count assumes d = K = V
        K, V = self.args.K, self.args.V
        return K if K == V else math.sqrt(K * V)

    def entry(self, method: str, pass_: str, T: int, fns: Callable[[], dict]) -> dict[str, Any]:
        """Time one (method, pass, T) with ``fns()[pass_]``, or say why it is skipped."""
        args, C = self.args, self.args.chunk_size
        entry: dict[str, Any] = {"method": method, "pass": pass_, "T": T}
        cap = _cap(method, pass_, args)
        if cap is not None and T > cap:
            return {**entry, "status": "skipped", "reason": f"skipped (T > cap {cap})"}
        if method == "fla_naive_chunk" and T % C:
            return {**entry, "status": "skipped", "reason": f"skipped (fla needs T % {C} == 0)"}
        prev = [r for r in self.results if r["method"] == method and r["pass"] == pass_]
        warm = not (prev and (prev[-1].get("time_s") or 0) > args.slow_seconds)
        entry.update(status="ok", **_time(fns()[pass_], args.repeats, args.slow_seconds, warm))
        flops = pass_flops(pass_, args.B, args.H, T, self.d, C)
        entry.update(flops=flops, gflops=flops / entry["time_s"] / 1e9)
        entry["pct_gemm"] = 100.0 * entry["gflops"] / self.gemm_rate
        return entry

    def fns(self, method: str, x: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
        C = self.args.chunk_size
        if method in ("chunk", "chunk_reference", "recurrent"):
            return _kda_fns(method, x, C)
        chunked = method == "fla_naive_chunk"
        fn = self.fla.naive_chunk_kda if chunked else self.fla.naive_recurrent_kda
        return _fla_fns(fn, x, C, chunked)

    def run(self, progress: _Progress) -> None:
        a = self.args
        for T in self.Ts:
            x = _common.inputs(a.B, a.H, T, a.K, a.V, np.dtype(a.dtype).type, a.seed)
            for method in self.methods:
                cache: dict[str, Any] = {}

                def fns(method=method, x=x, cache=cache) -> dict[str, Callable[[], Any]]:
                    if not cache:  # made on first use: fla's copies only where it runs
                        cache.update(self.fns(method, x))
                    return cache

                for pass_ in PASSES:
                    progress.describe(f"{method} {pass_} T={T}")
                    self.results.append(self.entry(method, pass_, T, fns))
                    progress.step()
            del x
        _add_ratios(self.results)


def _add_ratios(results: list[dict[str, Any]]) -> None:
    """Ratios from this run: time of the other method / time of this one (same T and pass)."""
    by_key = {(r["method"], r["pass"], r["T"]): r for r in results}
    for r in results:
        if r["status"] != "ok":
            r.setdefault("time_s", None)
            continue
        for other in ("recurrent", "fla_naive_chunk", "fla_naive_recurrent", "chunk", "chunk_reference"):
            o = by_key.get((other, r["pass"], r["T"]))
            ok = o is not None and o["status"] == "ok"
            r[f"speedup_vs_{other}"] = o["time_s"] / r["time_s"] if ok else None


def _default_backend() -> str:
    """The backend ``chunk`` runs on (the default for NumPy arrays)."""
    from kda._backend import get_backend

    return get_backend(np, None).NAME


def _config(args: argparse.Namespace, Ts: list[int]) -> dict[str, Any]:
    return {
        "B": args.B,
        "H": args.H,
        "K": args.K,
        "V": args.V,
        "T": Ts,
        "dtype": args.dtype,
        "chunk_size": args.chunk_size,
        "repeats": args.repeats,
        "slow_seconds": args.slow_seconds,
        "backends": args.backends,
        "chunk_backend": _default_backend(),
        "caps": {
            f"{m} {p}": _cap(m, p, args) for m in METHODS for p in PASSES if _cap(m, p, args) is not None
        },
        "seed": args.seed,
        "inputs": "benchmarks._common.inputs: q, k L2-normalised per step; v, grad_output standard normal; "
        f"g kda.testing.gates regime {_common.DEFAULT_REGIME!r}; beta = sigmoid(normal)",
    }


FLOP_COUNT = {
    "forward": "B*H*(6*T*d^2 + 3*T*C*d + T*C^2), d = K = V (Kimi Linear report)",
    "backward": "2 x forward",
    "fwd+bwd": "3 x forward",
    "note": "the same count for every method (effective rate); GEMM = 2*m*n*k",
}


def _sweep_lines(args, gemm, fla, fla_info, fla_reason, results, memory) -> list[str]:
    """The T sweep's part of the printed report."""
    lines = [f"GEMM {row['name']}: {row['time_s'] * 1e3:.1f} ms, {row['gflops']:.1f} GFLOP/s" for row in gemm]
    if fla is None and fla_info["requested"]:
        lines.append(fla_reason + "; skipped")
    elif fla is not None:
        agree = fla_info["agreement"]["max_rel_error"]
        worst = {name: max(errs.values()) for name, errs in agree.items() if isinstance(errs, dict)}
        lines.append(
            f"fla {fla_info.get('version')} naive reference vs kda.recurrent_kda (max rel. error over "
            "output, final state and gradients): " + ", ".join(f"{n} {e:.1e}" for n, e in worst.items())
        )
    lines += ["", _table(results), ""]
    lines.append(
        "GFLOP/s: forward B*H*(6*T*d^2 + 3*T*C*d + T*C^2), fwd+bwd 3x that; "
        f"% GEMM: of the {args.gemm_n}^3 rate; x: other method's time / this one's."
    )
    for m in memory:
        lines.append(
            f"peak memory chunk fwd+bwd T={m['T']}: {m['peak_bytes'] / 2**20:.1f} MiB = {m['ratio']:.2f} x "
            f"(inputs + outputs + boundaries + gradients = {m['essential_bytes'] / 2**20:.1f} MiB); "
            f"target <= {MEMORY_TARGET}: {'yes' if m['within_target'] else 'NO'}"
        )
    return lines


def _run_sweep(args: argparse.Namespace, progress: _Progress) -> tuple[dict[str, Any], list[str]]:
    """The T sweep: GEMM rate, fla's agreement, timings and peak memory; its report and lines."""
    dtype = np.dtype(args.dtype).type
    Ts = sorted(set(args.T))
    methods, fla, fla_reason, fla_info = _methods(args)
    sweep = _Sweep(args, methods, fla, Ts)
    rng = np.random.default_rng(args.seed)
    # GEMM rate first, in the same process and run as the timings.
    progress.describe("GEMM rate")
    batch = min(args.B * args.H * max(1, math.ceil(max(Ts) / args.chunk_size)), 1024)
    gemm = _gemm(args.gemm_n, batch, args.chunk_size, args.K, args.V, dtype, rng)
    sweep.gemm_rate = gemm[0]["gflops"]
    progress.step()
    if fla is not None:
        progress.describe("fla agreement check")
        fla_info["agreement"] = _verify_fla(fla, args.K, args.V, args.chunk_size, args.seed)
    progress.step()
    sweep.run(progress)
    memory = []
    if not args.no_memory:
        for T in Ts if args.memory_T is None else sorted(set(args.memory_T)):
            progress.describe(f"memory T={T}")
            memory.append(_memory(args.B, args.H, T, args.K, args.V, dtype, args.chunk_size, args.seed))
    progress.step()
    report = {
        "config": _config(args, Ts),
        "flop_count": FLOP_COUNT,
        "gemm": gemm,
        "gemm_rate_gflops": sweep.gemm_rate,
        "fla": fla_info,
        "results": sweep.results,
        "memory": memory,
    }
    return report, _sweep_lines(args, gemm, fla, fla_info, fla_reason, sweep.results, memory)


def _inference_config(args: argparse.Namespace) -> Any:
    from benchmarks.inference import InferenceConfig

    return InferenceConfig(
        short_shape=tuple(args.short_shape),
        short_T=tuple(args.short_T),
        decode_shape=tuple(args.decode_shape),
        decode_T=args.decode_T,
        plan_shape=tuple(args.plan_shape),
        plan_T=tuple(args.plan_T),
        dtype=args.dtype,
        repeats=args.rounds,
        min_sample=args.min_sample,
        clock=args.clock,
        seed=args.seed,
    )


def _progress_total(args: argparse.Namespace, inference: list[str]) -> int:
    from benchmarks.inference import steps

    total = steps(_inference_config(args), inference) if inference else 0
    if "sweep" in args.parts:
        n_methods = len([b for b in args.backends if b != "fla_naive"]) + 2 * ("fla_naive" in args.backends)
        total += 3 + 2 * n_methods * len(set(args.T))
    return total


def _title(args: argparse.Namespace, machine: dict[str, Any]) -> str:
    shape = f"B={args.B} H={args.H} K={args.K} V={args.V} " if "sweep" in args.parts else ""
    return f"KDA {shape}{args.dtype} C={args.chunk_size} | {machine['cpu_model']}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit status."""
    args = _parser().parse_args(argv)
    error = _check_args(args)
    if error:
        print(f"kda bench: {error}", file=sys.stderr)
        return 2
    inference = [p for p in args.parts if p != "sweep"]
    machine = _common.machine()
    progress = _Progress(_progress_total(args, inference), enabled=not args.no_progress)
    report: dict[str, Any] = {"schema": "kda-bench/2", "parts": list(args.parts)}
    lines: list[str] = []
    try:
        if "sweep" in args.parts:
            sweep_report, lines = _run_sweep(args, progress)
            report |= sweep_report
        if inference:
            from benchmarks import inference as _bench_inference

            def step(label: str) -> None:
                progress.describe(label)
                progress.step()

            report["inference"] = _bench_inference.run(_inference_config(args), inference, step)
            lines += [""] * bool(lines) + _bench_inference.report_lines(report["inference"])
    finally:
        progress.close()
    return _write_report(args, argv, machine, report, lines)


def _write_report(args, argv, machine: dict[str, Any], report: dict[str, Any], lines: list[str]) -> int:
    """Print the report and write its JSON (and plots) to ``--out``."""
    if hasattr(os, "getloadavg"):  # other work on the machine skews timings: record it
        machine["loadavg_at_end"] = list(os.getloadavg())
    title = _title(args, machine)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{args.name}.json"
    head = [
        f"kda bench: {title}",
        f"machine: {machine['logical_cores']} logical cores, numpy {np.__version__}",
    ]
    if "loadavg_at_start" in machine:
        la = (machine["loadavg_at_start"][0], machine["loadavg_at_end"][0])
        head[-1] += f", 1-min load average {la[0]:.2f} at start, {la[1]:.2f} at end"
    files: dict[str, Any] = {"json": str(json_path), "png": None}
    for part, stem in (("sweep", args.name), ("inference", _inference_stem(args))):
        png_path = args.out / f"{stem}.png"
        if args.no_plot or (part not in report and not (part == "sweep" and "results" in report)):
            continue
        if part == "sweep":
            note = _plot(report["results"], png_path, title)
        else:
            from benchmarks.inference import plot

            note = plot(report["inference"], png_path, title)
        lines.append(f"plot: {note}" if note else f"plot: {png_path}")
        files["png" if part == "sweep" else "inference_png"] = None if note else str(png_path)
    lines.append(f"json: {json_path}")
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    argv_list = list(argv) if argv is not None else sys.argv[1:]
    full = {"created": created, "argv": argv_list, "machine": machine, **report, "files": files}
    json_path.write_text(json.dumps(full, indent=2) + "\n")
    print("\n".join(head + lines))
    return 0


def _inference_stem(args: argparse.Namespace) -> str:
    """File stem of the inference figure: ``<name>`` alone, ``<name>_inference`` beside the sweep."""
    return f"{args.name}_inference" if "sweep" in args.parts else args.name


if __name__ == "__main__":
    sys.exit(main())
