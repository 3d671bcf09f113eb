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

``--decode`` instead splits one decode step (T = 1, B = 1, K = V = 128, float32, ``--H`` heads;
inference mode) into the layers it passes, each timed as a whole call, interleaved in rounds
(:func:`benchmarks._common.rounds`: median and minimum microseconds over ``--rounds`` rounds of
``--repeats`` calls each)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/torch_overhead.py --decode --H 4

* ``decode_kda``: :func:`kda.decode_kda` in place on a pool row (NumPy, head-first);
* ``decode_states``: the adapters' recurrent forward on NumPy views (time-major; a new final state);
* ``host.forward``: the host layer on the same views, with the translated options;
* ``op``: ``torch.ops.kda.recurrent_inference`` (the dispatcher, the tensor <-> array views, the host layer);
* ``fused_recurrent_kda``: the public call (fla's keywords, their translation, the op);
* ``pool call``: ``fused_recurrent_kda(initial_state=pool, ssm_state_indices=int32,
  inplace_final_state=True)``, vLLM's call.

Each row also prints its difference from the call it wraps (the pool call: from ``decode_kda``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

import kda
import kda.torch as kt
from kda._options.spec import CallSpec

if __package__ in (None, ""):  # run as a file: the repository root, for benchmarks._common
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common


def _inputs_list(T: int, H: int, K: int) -> list[np.ndarray]:
    """q, k, v, g, beta, do of :func:`benchmarks._common.inputs` (``B = 1``, ``V = K``), time-major."""
    x = _common.inputs(1, H, T, K, K, layout="time_major")
    return [x[n] for n in ("q", "k", "v", "g", "beta", "do")]


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


def _decode_layers(H: int, K: int) -> dict[str, object]:
    """One decode step's calls, outermost last (see the module docstring)."""
    from kda._entry import host
    from kda._entry.decode import decode_states

    x = _inputs_list(1, H, K)
    rng = np.random.default_rng(1)
    s0 = (0.1 * rng.standard_normal((1, H, K, K))).astype(np.float32)
    q, k, v, g, beta = (torch.from_numpy(a) for a in x[:5])  # time-major [1, 1, H, K]
    state = torch.from_numpy(s0)
    views = tuple(t.numpy() for t in (q, k, v, g, beta))
    head_first = [np.ascontiguousarray(np.swapaxes(a, 1, 2)) for a in x[:5]]
    pool = np.zeros((8, H, K, K), np.float32)
    pool[3] = s0[0]
    rows = np.array([3], np.int64)
    tpool, trows = torch.from_numpy(pool.copy()), torch.tensor([3], dtype=torch.int32)
    static = CallSpec(method="recurrent", scale=K**-0.5, layout="time_major")
    return {
        "decode_kda": lambda: kda.decode_kda(*head_first, pool, rows),
        "decode_states": lambda: decode_states(*views, s0, layout="time_major"),
        "host.forward": lambda: host.forward(static, host.Inputs(*views, s0), None),
        "op": lambda: torch.ops.kda.recurrent_inference(
            q, k, v, g, beta, state, None, None, None, False, *static
        ),
        "fused_recurrent_kda": lambda: kt.fused_recurrent_kda(
            q, k, v, g, beta, initial_state=state, output_final_state=True
        ),
        "pool call": lambda: kt.fused_recurrent_kda(
            q, k, v, g, beta, initial_state=tpool, ssm_state_indices=trows, inplace_final_state=True
        ),
    }


# each layer against the call it wraps (the pool call against decode_kda, its NumPy equivalent)
BASES = {
    "decode_states": "decode_kda",
    "host.forward": "decode_states",
    "op": "host.forward",
    "fused_recurrent_kda": "op",
    "pool call": "decode_kda",
}


def decode(H: int, K: int, rounds: int, repeats: int) -> None:
    """Print the per-layer table of one decode step (``--decode``)."""
    calls = _decode_layers(H, K)
    print(_common.describe())
    with torch.inference_mode():
        timings = _common.rounds(calls, rounds, warm_up=5, repeats=repeats)
    best = {name: (t.median_s, t.min_s) for name, t in timings.items()}
    print(f"one decode step, B=1, T=1, H={H}, K=V={K}, float32, torch {torch.__version__}, inference mode")
    print("layer | median us | min us | compared with | median difference us")
    for name, (med, low) in best.items():
        base = BASES.get(name)
        step = "-" if base is None else f"{base} | {(med - best[base][0]) * 1e6:+.1f}"
        print(f"{name} | {med * 1e6:.1f} | {low * 1e6:.1f} | {step}")
    print(f"load average after: {_common.load_average()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=300, help="calls per block (--decode)")
    p.add_argument("--decode", action="store_true", help="the per-layer cost of one decode step")
    p.add_argument("--out", type=Path, default=Path("benchmarks") / "results" / "torch_overhead.json")
    args = p.parse_args()
    if args.decode:
        decode(args.H, args.K, args.rounds, args.repeats)
        return
    x = _inputs_list(args.T, args.H, args.K)
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
            _, wall_s, cpu_s = _common.timed(run)
            times[name].append(wall_s)
            cpu[name].append(cpu_s)
    report = {
        "shape": {"B": 1, "T": args.T, "H": args.H, "K": args.K, "V": args.K, "dtype": "float32"},
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": _common.load_average(),
        "machine": _common.machine(),
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
