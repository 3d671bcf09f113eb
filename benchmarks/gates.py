"""``python -m benchmarks.gates``: every CPU path's time against the strength of the gates.

Strong decays put many decay products inside a chunk (and, in the step recurrence, many decayed
state entries) among the subnormal floats, which x86 cores handle about 100 times slower than
normal ones unless the thread flushes them (``docs/options.md``, "Subnormal floats"). This
benchmark times, per gate regime (:data:`kda.testing.REGIMES`: the draws kda's tests use) and on the
same other inputs (:func:`benchmarks._common.inputs`: unit q and k, beta in (0, 1)):

- ``kda.chunk_kda`` forward and forward+backward on the ``cpu`` and ``reference`` backends,
- ``kda.recurrent_kda`` (cpu),
- one ``kda.decode_kda`` step of 64 requests from a pool of 256 rows (cpu; the mean of
  :data:`DECODE_STEPS` steps per sample),
- llama.cpp's ``ggml_gated_delta_net`` forward (:mod:`benchmarks.llama_cpp`; skipped with the
  reason where it cannot be built),

in rounds (every regime once per round, the median over rounds), and prints each time with its
ratio to the first regime's (``zero`` by default: no decay), the CPU model and the load average
before and after. ``--one-core``
pins the process (and ggml) to one core. ``--unflushed`` adds each kda call once more with the
flushing switched off (the cpu kernels without FTZ/DAZ, the reference's thresholds at 0), in the
same rounds: what the flushing buys on this core.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from kda.testing import LOG_REGIMES, REGIMES

from . import _common

__all__ = ["gates", "main"]

POOL, REQUESTS = 256, 64
DECODE_STEPS = 8  # decode steps per sample (one step is a few ms, memory-bound: one sample is noisy)


def gates(regime: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """float32 log decays ``[B, H, T, K]`` of one of :data:`kda.testing.REGIMES`
    (:func:`kda.testing.gates`)."""
    return _common.draw("g", shape, np.random.default_rng(seed), np.float32, regime)


def _once(fn: Callable[[], Any]) -> float:
    return _common.timed(fn)[1]


def _calls(x: dict[str, np.ndarray], g: np.ndarray, args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    import kda

    q, k, v, beta, do = (x[n] for n in ("q", "k", "v", "beta", "do"))
    B, H, T, K = q.shape
    calls: dict[str, Callable[[], Any]] = {}
    for backend in args.backends:
        calls[f"{backend} fwd"] = lambda b=backend: kda.chunk_kda(q, k, v, g, beta, backend=b)

        def both(b=backend):
            out = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True, backend=b)
            kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do, backend=b)

        calls[f"{backend} f+b"] = both
    calls["recurrent"] = lambda: kda.recurrent_kda(q, k, v, g, beta, backend="cpu")
    n = min(REQUESTS, B * T)
    pick = np.random.default_rng(1).permutation(B * T)[:n]

    def steps(a: np.ndarray) -> np.ndarray:  # n requests of one step, [n, H, 1, D]
        return np.ascontiguousarray(np.swapaxes(a, 1, 2).reshape(B * T, H, 1, *a.shape[3:])[pick])

    dq, dk, dv, dg = (steps(a) for a in (q, k, v, g))
    db = np.ascontiguousarray(np.swapaxes(beta, 1, 2).reshape(B * T, H, 1)[pick])
    pool = (0.1 * np.random.default_rng(2).standard_normal((POOL, H, K, v.shape[-1]))).astype(np.float32)
    rows = np.random.default_rng(3).permutation(POOL)[:n].astype(np.int64)
    calls["decode"] = lambda: kda.decode_kda(
        dq, dk, dv, dg, db, pool, rows, backend="cpu", check_finite=False
    )
    if args.unflushed:
        calls.update({f"{c} unfl.": _without_flushing(fn) for c, fn in list(calls.items())})
    if args.ggml:
        calls["ggml"] = _ggml_call(q, k, v, g, beta, 1 if args.one_core else args.threads)
    return calls


@contextlib.contextmanager
def _unflushed():
    """The cpu kernels without FTZ/DAZ and the reference without its thresholds, for the block."""
    from kda.cpu import _fpenv
    from kda.reference import _blocks

    saved = _fpenv.X86, dict(_blocks.FLUSH_BELOW), dict(_blocks.PAIR_FLUSH_BELOW)
    _fpenv.X86 = False
    for table in (_blocks.FLUSH_BELOW, _blocks.PAIR_FLUSH_BELOW):
        for bits in table:
            table[bits] = 0.0
    try:
        yield
    finally:
        _fpenv.X86 = saved[0]
        _blocks.FLUSH_BELOW.update(saved[1])
        _blocks.PAIR_FLUSH_BELOW.update(saved[2])


def _without_flushing(fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        with _unflushed():
            return fn()

    return call


def _ggml_call(q, k, v, g, beta, threads: int) -> Callable[[], Any]:
    """A thunk returning ggml's own time of one forward (the graph computation alone)."""
    from .llama_cpp import ggml_forward

    state = np.zeros((*q.shape[:2], q.shape[-1], v.shape[-1]), np.float32)
    return lambda: ggml_forward(q, k, v, g, beta, state, threads, 1)["time_s"]


def _measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    x = _common.inputs(args.B, args.H, args.T, args.D, args.D, np.float32, 0)
    shape = x["q"].shape
    table = {r: _calls(x, gates(r, shape), args) for r in args.regimes}
    if args.calls:
        table = {r: {c: fn for c, fn in calls.items() if c.removesuffix(" unfl.") in args.calls}
                 for r, calls in table.items()}  # fmt: skip
    times: dict[str, dict[str, list[float]]] = {r: {c: [] for c in calls} for r, calls in table.items()}
    for calls in table.values():  # warm-up: compiles, builds ggml, first-touch pages
        for fn in calls.values():
            fn()
    for _ in range(args.rounds):
        for r, calls in table.items():
            for c, fn in calls.items():
                per = DECODE_STEPS if c.startswith("decode") else 1
                times[r][c].append(fn() if c == "ggml" else _once(fn) / per)
    return {r: {c: statistics.median(ts) for c, ts in cs.items()} for r, cs in times.items()}


def _print(result: dict[str, dict[str, float]]) -> None:
    mild = next(iter(result.values()))
    cols = list(mild)
    print(f"{'regime':>12} " + " ".join(f"{c:>16}" for c in cols))
    for r, row in result.items():
        cells = []
        for c in cols:
            unit, scale = ("us", 1e6) if c.startswith("decode") else ("ms", 1e3)
            cells.append(f"{row[c] * scale:8.1f}{unit} {row[c] / mild[c]:4.2f}x")
        print(f"{r:>12} " + " ".join(f"{s:>16}" for s in cells))
    fwd = next((c for c in ("cpu fwd", "reference fwd") if c in mild), None)
    if "ggml" in mild and fwd is not None:
        for r, row in result.items():
            print(f"{r:>12}: {fwd} / ggml = {row[fwd] / row['ggml']:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gates", description=__doc__.split("\n")[0])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--D", type=int, default=128, help="K = V (default 128)")
    p.add_argument("--regimes", nargs="+", default=list(LOG_REGIMES), choices=list(REGIMES),
                   help="kda.testing's gate regimes (default: %(default)s)")  # fmt: skip
    p.add_argument("--backends", nargs="+", default=["cpu", "reference"], choices=["cpu", "reference"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="ggml's threads (default 2)")
    p.add_argument("--one-core", action="store_true", help="pin the process to one core, ggml on 1 thread")
    p.add_argument("--no-ggml", dest="ggml", action="store_false", help="leave llama.cpp out")
    p.add_argument("--unflushed", action="store_true", help="also every kda call without the flushing")
    p.add_argument("--calls", nargs="+", default=None, help="only these columns (e.g. 'cpu fwd' recurrent)")
    args = p.parse_args(argv)
    if args.one_core and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    print(_common.describe())
    print(f"B={args.B} H={args.H} T={args.T} K=V={args.D} float32")
    if args.ggml:
        try:
            from .llama_cpp import build

            build()
        except Exception as err:  # GgmlUnavailable, OSError: no compiler, no network
            print(f"ggml skipped: {err}")
            args.ggml = False
    _print(_measure(args))
    print(f"load average after: {_common.load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
