"""``python -m kda``: check the chunked KDA against the recurrence on every available backend.

``python -m kda bench ...`` runs the benchmark (see ``python -m kda bench --help``).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import kda

# the default problem of the check
DEFAULTS = {"B": 1, "H": 4, "T": 1024, "K": 64, "V": 64, "chunk_size": 64}
TOLERANCE = {"float32": 1e-5, "float64": 1e-10}
GRADIENTS = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(B: int, H: int, T: int, K: int, V: int, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """A KDA problem as models feed it: L2-normalised keys, log decays in [-1, 0], beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    arrays = {
        "q": rng.standard_normal((B, H, T, K)),
        "k": k,
        "v": rng.standard_normal((B, H, T, V)),
        "g": np.log(rng.uniform(0.5, 1.0, (B, H, T, K))),
        "beta": rng.uniform(0.0, 1.0, (B, H, T)),
        "initial_state": 0.1 * rng.standard_normal((B, H, K, V)),
        "grad_output": rng.standard_normal((B, H, T, V)),
        "grad_final_state": rng.standard_normal((B, H, K, V)),
    }
    state_dtype = np.float64 if dtype == "float64" else np.float32
    out = {}
    for name, x in arrays.items():
        out[name] = x.astype(state_dtype if name in ("initial_state", "grad_final_state") else dtype)
    return out


def available_backends() -> dict[str, Any]:
    """Backend name -> a function that moves a NumPy array to that backend's arrays."""
    backends: dict[str, Any] = {"reference": lambda x: x}
    try:
        import cupy

        cupy.zeros(1)  # raises where there is no usable GPU
        import kda.cuda  # noqa: F401

        backends["cuda"] = cupy.asarray
    except Exception:
        pass
    return backends


def _numpy(x: Any) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _rel(got: Any, want: np.ndarray) -> float:
    got = _numpy(got).astype(np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


def check(args: argparse.Namespace) -> int:
    x = make_inputs(args.B, args.H, args.T, args.K, args.V, args.dtype)
    x64 = {n: a.astype(np.float64) for n, a in x.items()}
    inputs = ("q", "k", "v", "g", "beta")
    print(
        f"kda {kda.__version__}: B={args.B} H={args.H} T={args.T} K={args.K} V={args.V} "
        f"{args.dtype}, chunk_size={args.chunk_size}; oracle: the float64 recurrence"
    )
    t0 = time.perf_counter()
    ref = kda.recurrent_kda(*(x64[n] for n in inputs), initial_state=x64["initial_state"])
    t_rec = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref_grads = kda.recurrent_kda_backward(
        *(x64[n] for n in inputs),
        x64["grad_output"],
        x64["grad_final_state"],
        initial_state=x64["initial_state"],
    )
    t_rec_bwd = time.perf_counter() - t0
    tol = TOLERANCE[args.dtype]
    header = f"{'backend':<10} {'pass':<9} {'time [s]':>9}  {'worst error':>11}  {'of':<14} status"
    print(header)
    print("-" * len(header))
    print(f"{'recurrence':<10} {'forward':<9} {t_rec:9.3f}  {'(oracle)':>11}")
    print(f"{'recurrence':<10} {'backward':<9} {t_rec_bwd:9.3f}  {'(oracle)':>11}")
    failed = False
    for name, to_backend in available_backends().items():
        dev = {n: to_backend(a) for n, a in x.items()}
        call = {"chunk_size": args.chunk_size, "initial_state": dev["initial_state"]}
        kda.chunk_kda(*(dev[n] for n in inputs), **call, save_boundaries=True)  # warm-up
        t0 = time.perf_counter()
        out = kda.chunk_kda(*(dev[n] for n in inputs), **call, save_boundaries=True)
        _numpy(out.output)
        t_fwd = time.perf_counter() - t0
        t0 = time.perf_counter()
        grads = kda.chunk_kda_backward(
            *(dev[n] for n in inputs), out.boundaries, dev["grad_output"], dev["grad_final_state"], **call
        )
        _numpy(grads.q)
        t_bwd = time.perf_counter() - t0
        fwd_err = {
            "output": _rel(out.output, ref.output),
            "final_state": _rel(out.final_state, ref.final_state),
        }
        bwd_err = {f"d{n}": _rel(a, b) for n, a, b in zip(GRADIENTS, grads[:6], ref_grads[:6], strict=True)}
        for pass_name, t, errs in (("forward", t_fwd, fwd_err), ("backward", t_bwd, bwd_err)):
            worst = max(errs, key=errs.get)
            ok = errs[worst] <= tol
            failed |= not ok
            status = "ok" if ok else f"FAIL (> {tol:.0e})"
            print(f"{name:<10} {pass_name:<9} {t:9.3f}  {errs[worst]:11.2e}  {worst:<14} {status}")
    print(f"speed-up of the chunked reference over the recurrence: forward {t_rec / t_fwd:.0f}x")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from . import _bench

        return _bench.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m kda", description=__doc__.splitlines()[0])
    for name, value in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    return check(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
