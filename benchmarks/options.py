"""Accuracy of every model-level option set, and packed sequences against one call per sequence.

    python benchmarks/options.py            # writes benchmarks/results/options.json

Accuracy: max-abs error over max-abs of the float64 recurrence with the same options, worst over
the output, the final state and every gradient, worst over a few seeds, per option set and dtype
(B=1, H=2, T=200, K=V=32, chunk 64; varlen: 5 sequences packed in the row).
Timing: 8 sequences of mixed lengths totalling T=8192, H=16, K=V=128, float32, forward and
forward+backward, packed (``cu_seqlens``) against the same sequences run one by one, side by side.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

import kda
from kda.__main__ import GRADIENTS, INPUTS, make_inputs

SETS = {
    "plain": {},
    "time_major": {"layout": "time_major"},
    "gva x4": {"gva": 4},
    "softplus gate": {"gate": "softplus"},
    "lower_bound gate": {"gate": "lower_bound"},
    "varlen (5 sequences)": {"varlen": 5},
    "qk_l2norm + beta sigmoid2": {"l2norm": True},
    "everything": {"layout": "time_major", "gva": 2, "gate": "softplus", "varlen": 5, "l2norm": True},
}


def _problem(dtype: str, seed: int, options: dict) -> tuple[dict, dict]:
    opts = dict(options)
    l2norm = opts.pop("l2norm", False)
    x, kwargs = make_inputs(1, 2, 200, 32, 32, dtype, seed, **opts)
    if l2norm:
        rng = np.random.default_rng(seed + 1)
        for n in ("q", "k"):
            x[n] = (x[n] * rng.uniform(0.3, 3.0, (*x[n].shape[:-1], 1))).astype(dtype)
        x["beta"] = rng.standard_normal(x["beta"].shape).astype(dtype)
        kwargs |= {"qk_l2norm": True, "beta_activation": "sigmoid2"}
    return x, kwargs


def _fwd_bwd(fn: str, x: dict, kwargs: dict) -> tuple:
    inputs = [x[n] for n in INPUTS]
    if fn == "chunk":
        out = kda.chunk_kda(*inputs, initial_state=x["initial_state"], save_boundaries=True, **kwargs)
        grads = kda.chunk_kda_backward(
            *inputs,
            out.boundaries,
            x["grad_output"],
            x["grad_final_state"],
            initial_state=x["initial_state"],
            **kwargs,
        )
    else:
        out = kda.recurrent_kda(*inputs, initial_state=x["initial_state"], **kwargs)
        grads = kda.recurrent_kda_backward(
            *inputs, x["grad_output"], x["grad_final_state"], initial_state=x["initial_state"], **kwargs
        )
    return (out.output, out.final_state, *grads)


def worst_error(dtype: str, options: dict, seeds: int = 3) -> tuple[float, str]:
    names = ("output", "final_state", *(f"d{n}" for n in GRADIENTS))
    worst, where = 0.0, ""
    for seed in range(seeds):
        x, kwargs = _problem(dtype, seed, options)
        x64 = {n: a.astype(np.float64) for n, a in x.items()}
        kw64 = {n: (a.astype(np.float64) if n in ("A_log", "dt_bias") else a) for n, a in kwargs.items()}
        got = _fwd_bwd("chunk", x, kwargs)
        want = _fwd_bwd("recurrent", x64, kw64)
        for name, a, b in zip(names, got, want, strict=True):
            if b is None:
                continue
            err = float(np.max(np.abs(a.astype(np.float64) - b)) / np.max(np.abs(b)))
            if err > worst:
                worst, where = err, name
    return worst, where


def _best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def varlen_timing() -> dict:
    lengths = [3000, 1500, 1200, 900, 700, 500, 300, 92]  # 8 mixed lengths, total 8192
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    x, _ = make_inputs(1, 16, int(cu[-1]), 128, 128, "float32", 0)
    inputs = [x[n] for n in INPUTS]
    s0 = np.zeros((len(lengths), 16, 128, 128), np.float32)

    def packed(backward: bool):
        out = kda.chunk_kda(*inputs, initial_state=s0, cu_seqlens=cu, save_boundaries=backward)
        if backward:
            kda.chunk_kda_backward(*inputs, out.boundaries, x["grad_output"], initial_state=s0, cu_seqlens=cu)

    def one_by_one(backward: bool):
        for i, (a, b) in enumerate(itertools.pairwise(cu)):
            piece = [z[:, :, a:b] for z in inputs]
            out = kda.chunk_kda(*piece, initial_state=s0[i : i + 1], save_boundaries=backward)
            if backward:
                kda.chunk_kda_backward(
                    *piece, out.boundaries, x["grad_output"][:, :, a:b], initial_state=s0[i : i + 1]
                )

    result = {"lengths": lengths, "H": 16, "K": 128, "V": 128, "dtype": "float32"}
    for name, backward in (("forward", False), ("forward+backward", True)):
        t_packed = _best(lambda b=backward: packed(b))
        t_alone = _best(lambda b=backward: one_by_one(b))
        result[name] = {"packed_s": t_packed, "one_by_one_s": t_alone, "ratio": t_packed / t_alone}
    return result


def main() -> int:
    results = {"accuracy": {}, "load_average": list(np.round(np.array(__import__("os").getloadavg()), 2))}
    for name, options in SETS.items():
        for dtype in ("float32", "float64"):
            err, where = worst_error(dtype, options)
            results["accuracy"][f"{name} / {dtype}"] = {"worst": err, "of": where}
            print(f"{name:<28} {dtype:<8} {err:9.2e}  ({where})", flush=True)
    results["varlen"] = varlen_timing()
    print(json.dumps(results["varlen"], indent=1))
    path = Path(__file__).parent / "results" / "options.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
