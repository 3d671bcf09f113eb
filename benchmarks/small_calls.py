"""Small-call latency: forward and forward+backward of one small problem, where per-call overhead
(validation, option maps, the adapter's glue) is a large part of the time.

Four ways in, interleaved round by round so that load on a shared machine hits all of them alike
(float32, ``B=1``, ``H=4``, ``K=V=64``, chunk 64 unless given):

* ``kda fwd`` / ``kda fwd+bwd``: :func:`kda.chunk_kda` (time-major NumPy arrays,
  ``save_boundaries=True``), then :func:`kda.chunk_kda_backward` with its boundaries;
* ``torch fwd`` / ``torch fwd+bwd``: :func:`kda.torch.chunk_kda` on CPU tensors that require
  grad, then ``o.backward(do)`` (the custom ops, autograd, the tensor <-> array exchange).

Only public API (and :mod:`benchmarks._common`, which needs :func:`kda.testing.gates`): the
script runs on any commit since those exist, so the figures before and after a change are
comparable (run both on one quiet machine)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m benchmarks.small_calls [--T 64 256] [--rounds 7]

Prints, per case, the best and the median over rounds of the mean time of ``--calls`` calls
(microseconds), the commit (``git rev-parse HEAD``), the machine and the load average before and
after, and this run's GEMM reference (:func:`benchmarks._common.gemm_rate`) as a yardstick for the
machine's speed.

``--above-engine`` measures kda's layers above the chunked algorithm alone (validation, option
maps, chain rules, the adapter's glue): ``kda._engine.core.ChunkCore.forward`` and ``.backward``
(the one way into the algorithm on every commit since the core exists) return results computed
once; wall time as without it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
from collections.abc import Callable

import numpy as np

import kda

from . import _common


def _inputs_list(T: int, H: int, K: int, V: int) -> list[np.ndarray]:
    """q, k, v, g, beta, do of :func:`benchmarks._common.inputs`, time-major ``[1, T, H, *]``."""
    x = _common.inputs(1, H, T, K, V, layout="time_major")
    return [x[n] for n in ("q", "k", "v", "g", "beta", "do")]


def _kda_cases(x: list[np.ndarray], chunk_size: int) -> dict[str, Callable[[], object]]:
    kw = {"layout": "time_major", "chunk_size": chunk_size}

    def forward():
        return kda.chunk_kda(*x[:5], save_boundaries=True, **kw)

    def forward_backward():
        out = kda.chunk_kda(*x[:5], save_boundaries=True, **kw)
        return kda.chunk_kda_backward(*x[:5], out.boundaries, x[5], **kw)

    return {"kda fwd": forward, "kda fwd+bwd": forward_backward}


def _torch_cases(x: list[np.ndarray], chunk_size: int) -> dict[str, Callable[[], object]]:
    try:
        import torch

        import kda.torch as kt
    except ImportError:
        return {}
    tensors = [torch.from_numpy(a.copy()).requires_grad_() for a in x[:5]]
    do = torch.from_numpy(x[5].copy())

    def forward():
        return kt.chunk_kda(*tensors, chunk_size=chunk_size)

    def forward_backward():
        for t in tensors:
            t.grad = None
        o, _ = kt.chunk_kda(*tensors, chunk_size=chunk_size)
        o.backward(do)

    return {"torch fwd": forward, "torch fwd+bwd": forward_backward}


def _stub_engine() -> None:
    """``ChunkCore.forward`` / ``.backward`` return the first call's results from then on."""
    from kda._engine import core

    for name in ("forward", "backward"):
        real, cache = getattr(core.ChunkCore, name), {}

        def stub(self, *args, _real=real, _cache=cache, **kwargs):
            key = tuple(getattr(a, "shape", None) for a in args)
            if key not in _cache:
                _cache[key] = _real(self, *args, **kwargs)
            return _cache[key]

        setattr(core.ChunkCore, name, stub)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[64, 256], help="sequence lengths (default 64 256)")
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--V", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7, help="rounds; best and median over them (default 7)")
    p.add_argument("--calls", type=int, default=20, help="calls per case per round (default 20)")
    p.add_argument("--above-engine", action="store_true", help="stub the engine; CPU time of the rest")
    args = p.parse_args()
    if args.above_engine:
        _stub_engine()

    print(f"kda {kda.__file__}  commit {_commit()}")
    print(_common.describe())
    rate = _common.gemm_rate()
    print(f"GEMM reference (benchmarks._common.gemm_rate, {_common.GEMM_N}^3 float32): {rate:.1f} GFLOP/s")
    what = "wall, above the engine (stubbed)" if args.above_engine else "wall"
    print(f"times: {what}, mean of {args.calls} calls, best and median of {args.rounds} rounds")
    header = f"{'case':<15} {'T':>5} {'best us':>10} {'median us':>10}"
    print(header)
    print("-" * len(header))
    for T in args.T:
        x = _inputs_list(T, args.H, args.K, args.V)
        cases = {**_kda_cases(x, args.chunk_size), **_torch_cases(x, args.chunk_size)}
        # warm up (compiles, caches, first-call imports), then rounds of args.calls calls per case
        timings = _common.rounds(cases, args.rounds, warm_up=3, loops=args.calls)
        times = {name: t.times_s for name, t in timings.items()}
        for name, ts in times.items():
            print(f"{name:<15} {T:>5} {min(ts) * 1e6:>10.1f} {statistics.median(ts) * 1e6:>10.1f}")
    print(f"load average after: {_common.load_average()}")


if __name__ == "__main__":
    main()
