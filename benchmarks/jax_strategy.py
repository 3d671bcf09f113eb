"""How should ``kda.jax`` run on the CPU? Measure its two candidate strategies.

1. ``callback``: ``jax.pure_callback`` to kda's NumPy path (forward, and the chunked backward
   through a ``jax.custom_vjp``): XLA sees one opaque call.
2. ``trace``: kda's array-API reference traced with ``jax.numpy`` (JAX arrays are immutable, so the
   non-writable code path of :mod:`kda._engine.chunked` runs, concatenating slab results): XLA compiles
   the whole unrolled algorithm (every slab and every chunk of the state pass).

For each: the time to trace + compile under ``jax.jit`` and the median run time of the jitted
function (best of --repeats), forward and forward+backward (``jax.grad`` of ``sum(o * w)``), float32,
B=1, H=16, K=V=128 (default T=4096). Writes ``benchmarks/results/jax_strategy.json``.

    python benchmarks/jax_strategy.py [--T 4096] [--skip-trace-bwd]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import kda
import kda.reference as reference
from kda._engine.chunked import chunk_backward, chunk_forward

if __package__ in (None, ""):  # run as a file: the repository root, for benchmarks._common
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common


def _callback_fn(C: int):
    """custom_vjp over pure_callback to kda's public NumPy functions (head-first)."""

    # the callback receives jax.Array objects: np.asarray views them as NumPy arrays (no copy on
    # the CPU), which puts kda on its NumPy path
    def host_fwd(*x):
        out = kda.chunk_kda(*map(np.asarray, x), chunk_size=C, save_boundaries=True)
        return out.output, out.boundaries

    def host_bwd(*x):
        return tuple(kda.chunk_kda_backward(*map(np.asarray, x), chunk_size=C)[:5])

    def shapes_fwd(q, v):
        B, H, T, K = q.shape
        NT = -(-T // C)
        return (
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct((NT, B, H, K, v.shape[-1]), v.dtype),
        )

    @jax.custom_vjp
    def f(q, k, v, g, beta):
        return jax.pure_callback(host_fwd, shapes_fwd(q, v), q, k, v, g, beta)[0]

    def fwd(q, k, v, g, beta):
        o, saved = jax.pure_callback(host_fwd, shapes_fwd(q, v), q, k, v, g, beta)
        return o, (q, k, v, g, beta, saved)

    def bwd(res, do):
        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in res[:5])
        return jax.pure_callback(host_bwd, shapes, *res, do)

    f.defvjp(fwd, bwd)
    return f


def _allow_device_on_tracers() -> None:
    """kda's glue writes ``xp.zeros(..., device=x.device)``; JAX tracers have no ``device``
    attribute (``array_api_compat.device(x)`` would work). For this measurement only, tracers
    answer ``None`` (the default device)."""
    from jax._src import core

    core.Tracer.device = property(lambda self: None)


def _trace_fn(C: int):
    """custom_vjp whose forward and backward are kda's chunked algorithm traced on jax.numpy."""
    ops = reference
    _allow_device_on_tracers()

    def forward(q, k, v, g, beta):
        state = jnp.zeros((*q.shape[:2], q.shape[-1], v.shape[-1]), q.dtype)
        result = chunk_forward(ops, jnp, q, k, v, g, beta, state, scale=q.shape[-1] ** -0.5, chunk_size=C)
        return result.output, result.boundaries

    @jax.custom_vjp
    def f(q, k, v, g, beta):
        return forward(q, k, v, g, beta)[0]

    def fwd(q, k, v, g, beta):
        o, saved = forward(q, k, v, g, beta)
        return o, (q, k, v, g, beta, saved)

    def bwd(res, do):
        q, k, v, g, beta, saved = res
        zero = jnp.zeros((*q.shape[:2], q.shape[-1], v.shape[-1]), q.dtype)
        grads = chunk_backward(
            ops, jnp, q, k, v, g, beta, zero, saved, grad_output=do, dfinal=zero, scale=q.shape[-1] ** -0.5,
            chunk_size=C,
        )  # fmt: skip
        return grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta

    f.defvjp(fwd, bwd)
    return f


def _measure(fn, args, repeats: int) -> dict[str, float]:
    lowered, trace_s, trace_cpu = _common.timed(jax.jit(fn).lower, *args)
    compiled, compile_s, compile_cpu = _common.timed(lowered.compile)
    jax.block_until_ready(compiled(*args))  # warm-up
    runs = [_common.timed(lambda: jax.block_until_ready(compiled(*args)))[1:] for _ in range(repeats)]
    return {
        "trace_s": trace_s,
        "trace_cpu_s": trace_cpu,
        "compile_s": compile_s,
        "compile_cpu_s": compile_cpu,
        "run_s": min(r[0] for r in runs),
        "run_cpu_s": min(r[1] for r in runs),
    }


def _numpy_baseline(x: list[np.ndarray], w: np.ndarray, C: int, repeats: int) -> dict[str, float]:
    """kda.chunk_kda / chunk_kda_backward called directly: the callback's floor."""

    def fwd_bwd():
        out = kda.chunk_kda(*x, chunk_size=C, save_boundaries=True)
        return kda.chunk_kda_backward(*x, out.boundaries, w, chunk_size=C)

    fwd = [_common.timed(lambda: kda.chunk_kda(*x, chunk_size=C))[1:] for _ in range(repeats)]
    both = [_common.timed(fwd_bwd)[1:] for _ in range(repeats)]
    return {
        "fwd_run_s": min(r[0] for r in fwd),
        "fwd_run_cpu_s": min(r[1] for r in fwd),
        "fwd+bwd_run_s": min(r[0] for r in both),
        "fwd+bwd_run_cpu_s": min(r[1] for r in both),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--strategies", nargs="+", default=["callback", "trace"])
    p.add_argument("--out", type=Path, default=Path("benchmarks") / "results" / "jax_strategy.json")
    args = p.parse_args()
    drawn = _common.inputs(1, args.H, args.T, args.K, args.K)
    x_np = [drawn[n] for n in ("q", "k", "v", "g", "beta")]
    w_np = np.random.default_rng(1).standard_normal(x_np[2].shape, dtype=np.float32)
    x, w = [jnp.asarray(a) for a in x_np], jnp.asarray(w_np)
    report = {
        "shape": {"B": 1, "H": args.H, "T": args.T, "K": args.K, "V": args.K, "chunk_size": args.chunk_size},
        "jax": jax.__version__,
        "machine": _common.machine(),
        "cpus": _common.usable_cores(),
        "load_average_before": _common.load_average(),
    }
    report["numpy direct"] = r = _numpy_baseline(x_np, w_np, args.chunk_size, args.repeats)
    print(f"numpy direct: fwd {r['fwd_run_s']:.3f} s, fwd+bwd {r['fwd+bwd_run_s']:.3f} s", flush=True)
    for name in args.strategies:
        f = (_callback_fn if name == "callback" else _trace_fn)(args.chunk_size)

        def loss(q, k, v, g, beta, f=f):
            return jnp.sum(f(q, k, v, g, beta) * w)

        for pass_, fn in (("fwd", f), ("fwd+bwd", jax.grad(loss, argnums=(0, 1, 2, 3, 4)))):
            t = time.perf_counter()
            report[f"{name} {pass_}"] = r = _measure(fn, x, args.repeats)
            print(
                f"{name:8s} {pass_:8s} trace {r['trace_s']:7.2f} s  compile {r['compile_s']:7.2f} s "
                f"(cpu {r['compile_cpu_s']:.2f} s)  run {r['run_s']:7.3f} s  "
                f"(total {time.perf_counter() - t:.1f} s)",
                flush=True,
            )
    report["load_average_after"] = _common.load_average()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
