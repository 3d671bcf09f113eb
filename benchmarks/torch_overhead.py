"""The cost of kda.torch over calling kda directly: forward+backward, side by side in one run.

Three ways of computing the same forward and backward (float32, time-major inputs as fla takes
them), interleaved round by round so that load on a shared machine hits all of them alike:

* ``kda direct``: :func:`kda.chunk_kda` (``layout="time_major"``, ``save_boundaries=True``)
  then :func:`kda.chunk_kda_backward` on NumPy arrays;
* ``kda.torch``: :func:`kda.torch.chunk_kda` on CPU tensors, then ``o.backward(do)``
  (the custom ops, autograd, the tensor <-> array exchange);
* ``kda direct, head-first``: the same on head-first arrays (no layout change inside kda).

    python benchmarks/torch_overhead.py [--T 2048] [--rounds 5]

Reports the minimum over rounds (and the median) of the wall time and of the process's CPU
time (all threads; less sensitive to other load on the machine), and writes
``benchmarks/results/torch_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import kda
import kda.torch as kt


def _inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K), dtype=np.float32)
    k = rng.standard_normal((B, T, H, K), dtype=np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V), dtype=np.float32)
    g = np.log(rng.uniform(0.9, 1.0, (B, T, H, K))).astype(np.float32)
    beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    do = rng.standard_normal((B, T, H, V), dtype=np.float32)
    return [q, k, v, g, beta, do]


def _direct(x: list[np.ndarray], layout: str):
    def run():
        out = kda.chunk_kda(*x[:5], layout=layout, save_boundaries=True)
        return kda.chunk_kda_backward(*x[:5], out.boundaries, x[5], layout=layout)

    return run


def _adapter(x: list[np.ndarray]):
    tensors = [torch.from_numpy(a).requires_grad_() for a in x[:5]]
    do = torch.from_numpy(x[5])

    def run():
        for t in tensors:
            t.grad = None
        o, _ = kt.chunk_kda(*tensors)
        o.backward(do)
        return [t.grad for t in tensors]

    return run


def _summary(times: dict[str, list[float]]) -> dict[str, dict]:
    return {name: {"min": min(t), "median": statistics.median(t), "all": t} for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("benchmarks") / "results" / "torch_overhead.json")
    args = p.parse_args()
    x = _inputs(1, args.T, args.H, args.K, args.K)
    head_first = [np.ascontiguousarray(np.swapaxes(a, 1, 2)) for a in x]
    methods = {
        "kda direct": _direct(x, "time_major"),
        "kda.torch": _adapter(x),
        "kda direct, head-first": _direct(head_first, "head_first"),
    }
    expected = methods["kda direct"]()  # warm-up, and the gradients must agree
    got = methods["kda.torch"]()
    for a, b in zip(expected[:5], got):
        np.testing.assert_array_equal(a, b.numpy())
    times: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, run in methods.items():
            t, c = time.perf_counter(), time.process_time()
            run()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    report = {
        "shape": {"B": 1, "T": args.T, "H": args.H, "K": args.K, "V": args.K, "dtype": "float32"},
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "rounds": args.rounds,
        "seconds": _summary(times),
        "cpu_seconds": _summary(cpu),
    }
    base, base_cpu = min(times["kda direct"]), min(cpu["kda direct"])
    for name, t in times.items():
        print(
            f"{name:24s} fwd+bwd min {min(t):.3f} s  median {statistics.median(t):.3f} s  "
            f"({min(t) / base:.3f}x kda direct); CPU time min {min(cpu[name]):.3f} s "
            f"({min(cpu[name]) / base_cpu:.3f}x)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
