"""The inference parts of ``python -m benchmarks.chunk``: short sequences, decoding, prepared plans.

- ``short``: :func:`kda.chunk_kda` against :func:`kda.recurrent_kda` for ``T`` in 1..64 (default
  B=8, H=16, K=V=128, float32), forward and forward+backward. ``chunk_kda`` is timed twice: as
  shipped (it runs the step recurrence up to the backend's ``RECURRENT_MAX_T``) and with
  the chunked algorithm forced at every ``T`` (``RECURRENT_MAX_T`` set to 0 for the measurement
  and restored), which gives the crossover: the smallest ``T`` from which
  the chunked algorithm is faster than the recurrence at every measured length. Target: shipped
  ``chunk_kda`` at ``T=1``
  within 1.3x of ``recurrent_kda``.
- ``decode``: :func:`kda.decode_kda` with ``N`` requests (default N=8, H=16, K=V=128, T=1,
  float32) on a pool of ``4 N`` rows, against ``np.copyto`` of the touched states' bytes (one
  read and one write of ``N * H * K * V`` floats) in the same run. Target: within 2x.
- ``plan``: ``prepare_chunk_kda(...).run()`` and ``prepare_chunk_kda_backward(...).run()``
  against the plain calls, at B=1, H=4, K=V=64 and T=64 and 4096: the difference is the
  per-call overhead (validation and allocation) that a plan saves.

The functions compared with each other are sampled in interleaved rounds after a warm-up, and
the minimum over the rounds is reported (the median is recorded too): on a shared machine the
minimum is the least disturbed measurement. Calls faster than ``min_sample`` seconds are looped
within a sample so that the timer's resolution does not matter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import _common

__all__ = ["InferenceConfig", "compare", "crossover", "plot", "report_lines", "run", "steps"]

SHORT_T = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
SHORT_TARGET = 1.3
DECODE_TARGET = 2.0


@dataclass(frozen=True)
class InferenceConfig:
    """Shapes and timing settings of the inference parts (defaults: the module docstring's problems)."""

    short_shape: tuple[int, int, int, int] = (8, 16, 128, 128)  # B, H, K, V
    short_T: tuple[int, ...] = SHORT_T
    decode_shape: tuple[int, int, int, int] = (8, 16, 128, 128)  # N, H, K, V
    decode_T: int = 1
    plan_shape: tuple[int, int, int, int] = (1, 4, 64, 64)  # B, H, K, V
    plan_T: tuple[int, ...] = (64, 4096)
    dtype: str = "float32"
    repeats: int = 7
    min_sample: float = 0.02
    clock: str = "wall"  # or "cpu": process CPU time, see compare()
    seed: int = 0


def compare(
    fns: dict[str, Callable[[], Any]], repeats: int, min_sample: float, clock: str = "wall"
) -> dict[str, dict[str, Any]]:
    """Seconds per call of each function, sampled in interleaved rounds (:func:`benchmarks._common.rounds`).

    After one warm-up call each (which also sizes ``loops``, the calls per sample), every round
    takes one sample of each function in turn, so a change of the machine's load hits all of
    them alike. ``time_s`` is the minimum over the rounds (the least disturbed sample: this
    benchmark runs on shared machines), ``median_s`` the median; both are recorded.
    ``clock="cpu"`` measures the process's CPU time (all its threads) instead of wall time:
    on an oversubscribed machine wall time mostly measures waiting for a core.
    """
    times = _common.rounds(fns, repeats, min_sample=min_sample, clock=clock)
    return {
        name: {"time_s": t.min_s, "median_s": t.median_s, "times_s": t.times_s, "loops": t.loops}
        for name, t in times.items()
    }


def _problem(B: int, H: int, T: int, K: int, V: int, dtype: Any, seed: int) -> dict[str, np.ndarray]:
    """:func:`benchmarks._common.inputs`: unit q and k, kda.testing's mild gates, small state."""
    return _common.inputs(B, H, T, K, V, dtype, seed)


def _args(x: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    return tuple(x[n] for n in ("q", "k", "v", "g", "beta"))


# ---------------------------------------------------------------------------------- short


def _short_fns(x: dict[str, np.ndarray]) -> dict[str, dict[str, Callable[[], Any]]]:
    import kda
    from kda._backend import get_backend

    ops = get_backend(np, None)  # the backend kda.chunk_kda runs NumPy arrays on
    args, s0, do = _args(x), x["state"], x["do"]

    def chunk_fwd():
        return kda.chunk_kda(*args, initial_state=s0)

    def chunk_fwd_bwd():
        out = kda.chunk_kda(*args, initial_state=s0, save_boundaries=True)
        return kda.chunk_kda_backward(*args, out.boundaries, do, initial_state=s0)

    def forced(fn):
        def run():
            saved = ops.RECURRENT_MAX_T
            ops.RECURRENT_MAX_T = 0
            try:
                return fn()
            finally:
                ops.RECURRENT_MAX_T = saved

        return run

    def rec_fwd():
        return kda.recurrent_kda(*args, initial_state=s0)

    def rec_fwd_bwd():
        kda.recurrent_kda(*args, initial_state=s0)
        return kda.recurrent_kda_backward(*args, do, initial_state=s0)

    return {
        "chunk_kda": {"fwd": chunk_fwd, "fwd+bwd": chunk_fwd_bwd},
        "chunked_forced": {"fwd": forced(chunk_fwd), "fwd+bwd": forced(chunk_fwd_bwd)},
        "recurrent_kda": {"fwd": rec_fwd, "fwd+bwd": rec_fwd_bwd},
    }


def crossover(rows: list[dict[str, Any]], pass_: str) -> int | None:
    """Smallest measured ``T`` from which the forced chunked path beats the recurrence at every
    larger measured ``T`` (None if it never does)."""
    by_T = {}
    for r in rows:
        if r["pass"] == pass_:
            by_T.setdefault(r["T"], {})[r["method"]] = r["time_s"]
    wins = [(T, t["chunked_forced"] < t["recurrent_kda"]) for T, t in sorted(by_T.items())]
    best = None
    for T, win in reversed(wins):
        if not win:
            break
        best = T
    return best


def run_short(cfg: InferenceConfig, step: Callable[[str], None]) -> dict[str, Any]:

    B, H, K, V = cfg.short_shape
    rows = []
    for T in sorted(set(cfg.short_T)):
        fns = _short_fns(_problem(B, H, T, K, V, np.dtype(cfg.dtype), cfg.seed))
        for pass_ in ("fwd", "fwd+bwd"):
            step(f"short {pass_} T={T}")
            times = compare(
                {m: passes[pass_] for m, passes in fns.items()}, cfg.repeats, cfg.min_sample, cfg.clock
            )
            rows += [{"method": m, "pass": pass_, "T": T, **t} for m, t in times.items()]
    at1 = {r["method"] + " " + r["pass"]: r["time_s"] for r in rows if r["T"] == 1}
    from kda._backend import get_backend

    ops = get_backend(np, None)
    summary = {"recurrent_max_T": ops.RECURRENT_MAX_T}
    for pass_ in ("fwd", "fwd+bwd"):
        summary[f"crossover_T {pass_}"] = crossover(rows, pass_)
        if f"chunk_kda {pass_}" in at1:
            ratio = at1[f"chunk_kda {pass_}"] / at1[f"recurrent_kda {pass_}"]
            summary[f"T=1 chunk_kda / recurrent_kda {pass_}"] = ratio
    summary["target"] = f"chunk_kda at T=1 within {SHORT_TARGET}x of recurrent_kda (fwd)"
    ratio = summary.get("T=1 chunk_kda / recurrent_kda fwd")
    summary["within_target"] = None if ratio is None else bool(ratio <= SHORT_TARGET)
    shape = {"B": B, "H": H, "K": K, "V": V, "dtype": cfg.dtype, "chunk_size": 64}
    return {"shape": shape, "rows": rows, "summary": summary}


# ---------------------------------------------------------------------------------- decode


def run_decode(cfg: InferenceConfig, step: Callable[[str], None]) -> dict[str, Any]:
    import kda

    N, H, K, V = cfg.decode_shape
    dtype = np.dtype(cfg.dtype)
    x = _problem(N, H, cfg.decode_T, K, V, dtype, cfg.seed)
    rng = np.random.default_rng(cfg.seed + 1)
    pool = (0.1 * rng.standard_normal((4 * N, H, K, V), dtype=np.float32)).astype(dtype)
    indices = rng.choice(4 * N, size=N, replace=False)
    src = np.ascontiguousarray(pool[indices])
    dst = np.empty_like(src)
    step("decode")
    fns = {
        "decode": lambda: kda.decode_kda(*_args(x), pool, indices),
        "copy": lambda: np.copyto(dst, src),
        "gathered": lambda: kda.recurrent_kda(*_args(x), initial_state=pool[indices]),
    }
    times = compare(fns, cfg.repeats, cfg.min_sample, cfg.clock)
    decode, copy, gathered = times["decode"], times["copy"], times["gathered"]
    ratio = decode["time_s"] / copy["time_s"]
    return {
        "shape": {"N": N, "H": H, "K": K, "V": V, "T": cfg.decode_T, "dtype": cfg.dtype, "pool_rows": 4 * N},
        "decode": decode,
        "copy_touched_states": {**copy, "bytes": int(src.nbytes)},
        "recurrent_on_gathered_states": gathered,
        "summary": {
            "decode / copy": ratio,
            "target": f"within {DECODE_TARGET}x of a copy of the touched states",
            "within_target": bool(ratio <= DECODE_TARGET),
            "backend": "reference (NumPy); the CUDA kernel has not been timed (no GPU)",
        },
    }


# ---------------------------------------------------------------------------------- plans


def _plan_fns(x: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    import kda

    args, do = _args(x), x["do"]
    fwd_plan = kda.prepare_chunk_kda(*args, save_boundaries=True)
    boundaries = fwd_plan.run().boundaries
    bwd_plan = kda.prepare_chunk_kda_backward(*args, boundaries, do)
    return {
        "plain fwd": lambda: kda.chunk_kda(*args, save_boundaries=True),
        "plan fwd": fwd_plan.run,
        "plain bwd": lambda: kda.chunk_kda_backward(*args, boundaries, do),
        "plan bwd": bwd_plan.run,
    }


def run_plan(cfg: InferenceConfig, step: Callable[[str], None]) -> dict[str, Any]:
    B, H, K, V = cfg.plan_shape
    rows = []
    for T in sorted(set(cfg.plan_T)):
        fns = _plan_fns(_problem(B, H, T, K, V, np.dtype(cfg.dtype), cfg.seed))
        times = {}
        for pass_ in ("fwd", "bwd"):
            step(f"plan {pass_} T={T}")
            times |= compare(
                {n: f for n, f in fns.items() if n.endswith(pass_)}, cfg.repeats, cfg.min_sample, cfg.clock
            )
        for pass_ in ("fwd", "bwd"):
            plain, plan = times[f"plain {pass_}"]["time_s"], times[f"plan {pass_}"]["time_s"]
            samples = {k: v for k, v in times.items() if pass_ in k}
            row = {"T": T, "pass": pass_, "plain_s": plain, "plan_s": plan, "overhead_s": plain - plan}
            rows.append({**row, "plain / plan": plain / plan, "samples": samples})
    return {"shape": {"B": B, "H": H, "K": K, "V": V, "dtype": cfg.dtype, "chunk_size": 64}, "rows": rows}


# ---------------------------------------------------------------------------------- driver

PARTS = {"short": run_short, "decode": run_decode, "plan": run_plan}


def run(cfg: InferenceConfig, parts: list[str], step: Callable[[str], None]) -> dict[str, Any]:
    """Run the named parts (``short``, ``decode``, ``plan``); ``step(label)`` reports progress."""
    return {part: {**PARTS[part](cfg, step), "clock": cfg.clock} for part in parts}


def steps(cfg: InferenceConfig, parts: list[str]) -> int:
    """How many times :func:`run` calls ``step``, for a progress bar."""
    counts = {"short": 2 * len(set(cfg.short_T)), "decode": 1, "plan": 2 * len(set(cfg.plan_T))}
    return sum(counts[p] for p in parts)


def _ms(t: float) -> str:
    return f"{t * 1e3:.3g} ms"


def report_lines(results: dict[str, Any]) -> list[str]:
    """Human-readable summary of :func:`run`'s results."""
    clocks = {part["clock"] for part in results.values()}
    lines = ["times: process CPU time (--clock cpu)"] if "cpu" in clocks else []
    if "short" in results:
        s, sh = results["short"]["summary"], results["short"]["shape"]
        lines.append(f"short sequences (B={sh['B']} H={sh['H']} K={sh['K']} V={sh['V']} {sh['dtype']}):")
        t1 = {r["method"] + " " + r["pass"]: r["time_s"] for r in results["short"]["rows"] if r["T"] == 1}
        for pass_ in ("fwd", "fwd+bwd"):
            if f"chunk_kda {pass_}" in t1:
                ratio = s[f"T=1 chunk_kda / recurrent_kda {pass_}"]
                lines.append(
                    f"  T=1 {pass_}: chunk_kda {_ms(t1[f'chunk_kda {pass_}'])}, recurrent_kda "
                    f"{_ms(t1[f'recurrent_kda {pass_}'])} ({ratio:.2f}x), "
                    f"chunked algorithm forced {_ms(t1[f'chunked_forced {pass_}'])}"
                )
            lines.append(
                f"  crossover {pass_}: the chunked algorithm is faster from T = {s[f'crossover_T {pass_}']}"
            )
        lines.append(f"  target {s['target']}: {'yes' if s['within_target'] else 'NO'}")
    if "decode" in results:
        d = results["decode"]
        sh, copy = d["shape"], d["copy_touched_states"]
        lines.append(
            f"decode (N={sh['N']} H={sh['H']} K={sh['K']} V={sh['V']} T={sh['T']} {sh['dtype']}): decode_kda "
            f"{_ms(d['decode']['time_s'])}, copy of the touched states ({copy['bytes'] / 2**20:.0f} MiB) "
            f"{_ms(copy['time_s'])}: {d['summary']['decode / copy']:.2f}x "
            f"(target {DECODE_TARGET}x: {'yes' if d['summary']['within_target'] else 'NO'}); "
            "recurrent_kda on "
            f"gathered states {_ms(d['recurrent_on_gathered_states']['time_s'])}"
        )
    if "plan" in results:
        sh = results["plan"]["shape"]
        lines.append(f"plans (B={sh['B']} H={sh['H']} K={sh['K']} V={sh['V']} {sh['dtype']}):")
        for r in results["plan"]["rows"]:
            lines.append(
                f"  T={r['T']} {r['pass']}: plain {_ms(r['plain_s'])}, plan.run() {_ms(r['plan_s'])}, "
                f"per-call overhead {r['overhead_s'] * 1e6:.0f} us ({r['plain / plan']:.2f}x)"
            )
    return lines


def plot(results: dict[str, Any], path: Any, title: str) -> str | None:
    """Short-sequence times against T (and the decode / plan bars); None on success, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    panels = [p for p in ("short", "decode", "plan") if p in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, part in zip(axes[0], panels):
        {"short": _plot_short, "decode": _plot_decode, "plan": _plot_plan}[part](ax, results[part])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _plot_short(ax: Any, short: dict[str, Any]) -> None:
    for n, method in enumerate(("chunk_kda", "chunked_forced", "recurrent_kda")):
        for pass_, style in (("fwd", "-o"), ("fwd+bwd", "--s")):
            pts = sorted(
                (r["T"], r["time_s"]) for r in short["rows"] if r["method"] == method and r["pass"] == pass_
            )
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{n}", markersize=3, label=f"{method} {pass_}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T")
    ax.set_ylabel("time (s), min of rounds")
    s = short["summary"]
    ax.set_title(
        f"short sequences: crossover fwd T={s['crossover_T fwd']}, fwd+bwd T={s['crossover_T fwd+bwd']}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _plot_decode(ax: Any, d: dict[str, Any]) -> None:
    names = ("decode_kda", "copy of touched states", "recurrent_kda (gathered)")
    times = [
        d["decode"]["time_s"],
        d["copy_touched_states"]["time_s"],
        d["recurrent_on_gathered_states"]["time_s"],
    ]
    ax.bar(names, [t * 1e3 for t in times], color=["C0", "C7", "C2"])
    ax.set_ylabel("time (ms), min of rounds")
    ax.set_title(f"decode: {d['summary']['decode / copy']:.2f}x a copy (target {DECODE_TARGET}x)", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)


def _plot_plan(ax: Any, p: dict[str, Any]) -> None:
    labels = [f"T={r['T']} {r['pass']}" for r in p["rows"]]
    xs = np.arange(len(labels))
    ax.bar(xs - 0.2, [r["plain_s"] * 1e3 for r in p["rows"]], 0.4, label="plain call")
    ax.bar(xs + 0.2, [r["plan_s"] * 1e3 for r in p["rows"]], 0.4, label="plan.run()")
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("time (ms), min of rounds")
    ax.set_title("prepared plans vs plain calls", fontsize=9)
    ax.legend(fontsize=7)
