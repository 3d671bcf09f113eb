"""Worst error of the chunked KDA against the float64 recurrence, per gate regime and dtype.

    python benchmarks/accuracy.py [--examples N] [--out benchmarks/results/accuracy.json]

For each regime and dtype, ``--examples`` random problems (B, H in 1..2, T in 1..130, K, V in
2..40, chunk size in 1..80, beta in [0, 2], L2-normalised keys, random initial state and
final-state gradient) plus the fixed problem B=1, H=4, T=256, K=V=64, chunk 64. The error of an
array is max|chunked - recurrence| / max|recurrence|, the recurrence run in float64 on the same
(rounded) inputs. The regimes are kda.testing's LOG_REGIMES, drawn as the tests draw them
(tests/helpers.py: zero, weak, mild, steep, kimi, strong, hard, reset); ``--backend reference``
runs the chunked calls on the array-API reference.
K = 1 is left out here: there the initial-state gradient is ill-conditioned in the chunked form (see
tests/core/test_chunked.py, DEGENERATE_INITIAL_STATE_TOLERANCE). Small key sizes with large chunks are
measured separately (kda/_engine/widening.py, FLOAT32_MAX_CHUNK; tests/core/test_accuracy.py holds that
envelope).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import REGIMES, make_problem

import kda

NAMES = ("output", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def errors(p, chunk_size: int, dtype, backend: str | None = None) -> dict[str, float]:
    p = p.astype(dtype)
    p64 = p.astype(np.float64)
    ref = kda.recurrent_kda(*p64.inputs, initial_state=p64.initial_state)
    ref_g = kda.recurrent_kda_backward(
        *p64.inputs, p64.grad_output, p64.grad_final_state, initial_state=p64.initial_state
    )
    out = kda.chunk_kda(
        *p.inputs, initial_state=p.initial_state, chunk_size=chunk_size, save_boundaries=True, backend=backend
    )
    got_g = kda.chunk_kda_backward(
        *p.inputs,
        out.boundaries,
        p.grad_output,
        p.grad_final_state,
        initial_state=p.initial_state,
        chunk_size=chunk_size,
        backend=backend,
    )
    wants = (ref.output, ref.final_state, *ref_g[:6])
    pairs = zip(wants, (out.output, out.final_state, *got_g[:6]), strict=True)
    result = {}
    for name, (want, got) in zip(NAMES, pairs, strict=True):
        scale = max(float(np.max(np.abs(want))), float(np.finfo(got.dtype).tiny))
        result[name] = float(np.max(np.abs(got.astype(np.float64) - want))) / scale
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/accuracy.json"))
    parser.add_argument("--backend", default=None, help="the chunked calls' backend (default: NumPy's)")
    args = parser.parse_args()
    rng = np.random.default_rng(2026)
    table = {}
    for dtype in (np.float32, np.float64):
        for regime in REGIMES:
            worst = dict.fromkeys(NAMES, 0.0)
            cases = [(make_problem(1, 1, 4, 256, 64, 64, regime), 64)]
            for _ in range(args.examples):
                shape = [int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 131))]
                shape += [int(rng.integers(2, 41)), int(rng.integers(2, 41))]
                cases.append(
                    (make_problem(int(rng.integers(2**31)), *shape, regime), int(rng.integers(1, 81)))
                )
            for p, chunk_size in cases:
                for name, e in errors(p, chunk_size, dtype, args.backend).items():
                    worst[name] = max(worst[name], e)
            key = f"{np.dtype(dtype).name} {regime}"
            table[key] = worst
            print(f"{key:<16} " + "  ".join(f"{n} {e:.1e}" for n, e in worst.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"examples_per_cell": args.examples + 1, "backend": args.backend, "worst": table}
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
