"""Preflight of scripts/gpu_check.sh: what the machine has, and one tiny kda.cuda call that must be right.

Prints (and appends to ``--summary``) the versions of Python, NumPy, kda, Numba, numba-cuda and
CuPy, the device (name, compute capability, memory, driver and runtime versions), then runs one
tiny ``chunk_kda`` forward and backward with ``backend="cuda"`` in float32 against the float64
reference recurrence (max-abs error over max-abs, 1e-5). Exits non-zero if anything is missing
or wrong, so that the check stops before spending the device time on tests that cannot pass.

``--simulate``: under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set by the caller before
Python starts): NumPy arrays with ``backend="cuda"`` instead of CuPy arrays, and no device query.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from importlib import metadata


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--simulate", action="store_true")
    parser.add_argument("--summary", default=None, help="a file to append the findings to")
    args = parser.parse_args()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    ok = True
    try:
        simulated = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
        if simulated != args.simulate:
            say(
                f"preflight: NUMBA_ENABLE_CUDASIM={os.environ.get('NUMBA_ENABLE_CUDASIM')!r} "
                f"does not match --simulate={args.simulate}"
            )
            return 1
        import numpy as np

        import kda

        say(f"python {platform.python_version()} ({sys.executable}), numpy {np.__version__}")
        say(f"kda {version('kda')} from {kda.__file__}")
        import numba

        say(f"numba {numba.__version__}, numba-cuda {version('numba-cuda')}, simulator {simulated}")
        xp = np
        if not args.simulate:
            import cupy as cp

            xp = cp
            dev = cp.cuda.Device()
            props = cp.cuda.runtime.getDeviceProperties(dev.id)
            free, total = cp.cuda.runtime.memGetInfo()
            say(
                f"cupy {cp.__version__}; device {dev.id}: {props['name'].decode()}, "
                f"cc {props['major']}.{props['minor']}, {props['multiProcessorCount']} SMs, "
                f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} free)"
            )
            say(f"driver {cp.cuda.runtime.driverGetVersion()}, runtime {cp.cuda.runtime.runtimeGetVersion()}")
            from numba import cuda

            say(f"numba sees: {cuda.get_current_device().name}")
            # the tests decide GPU or simulator by this file (tests/helpers.py, has_gpu): without it
            # they would run on the simulator here, slowly and without testing the GPU
            if not os.path.exists("/dev/nvidiactl"):
                say("preflight: /dev/nvidiactl is missing: the tests would run on Numba's simulator")
                ok = False
        else:
            say("cupy: not used (simulator: NumPy arrays with backend='cuda')")
        for dist in (
            "array-api-compat",
            "threadpoolctl",
            "hypothesis",
            "pytest",
            "pytest-xdist",
            "pytest-timeout",
            "torch",
            "triton",
            "fla-core",
            "einops",
        ):
            say(f"  {dist} {version(dist)}")
        # one tiny call: T = 10 over chunks of 4, K = 8, V = 4, float32 vs the float64 recurrence
        rng = np.random.default_rng(0)
        B, H, T, K, V = 1, 2, 10, 8, 4
        q, k = rng.standard_normal((2, B, H, T, K))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        v = rng.standard_normal((B, H, T, V))
        g = -rng.uniform(0.0, 2.0, (B, H, T, K))
        beta = rng.uniform(0.0, 1.0, (B, H, T))
        state = rng.standard_normal((B, H, K, V))
        do = rng.standard_normal((B, H, T, V))
        dstate = rng.standard_normal((B, H, K, V))
        arrays = (q, k, v, g, beta, state, do, dstate)
        want = kda.recurrent_kda(q, k, v, g, beta, initial_state=state, backend="reference")
        want_g = kda.recurrent_kda_backward(
            q, k, v, g, beta, do, dstate, initial_state=state, backend="reference"
        )
        t0 = time.perf_counter()
        dq, dk, dv, dg, dbeta, ds, ddo, dds = (xp.asarray(x.astype(np.float32)) for x in arrays)
        out = kda.chunk_kda(
            dq,
            dk,
            dv,
            dg,
            dbeta,
            initial_state=ds,
            chunk_size=4,
            save_boundaries=True,
            backend="cuda",
            check_finite=False,
        )
        grads = kda.chunk_kda_backward(
            dq,
            dk,
            dv,
            dg,
            dbeta,
            out.boundaries,
            ddo,
            dds,
            initial_state=ds,
            chunk_size=4,
            backend="cuda",
            check_finite=False,
        )
        if not args.simulate:
            xp.cuda.Device().synchronize()
        seconds = time.perf_counter() - t0

        def host(x):
            return xp.asnumpy(x) if xp is not np else np.asarray(x)

        errors = {}
        pairs = [("output", out.output, want.output), ("final_state", out.final_state, want.final_state)]
        pairs += zip(("dq", "dk", "dv", "dg", "dbeta", "dstate"), grads, want_g)
        for name, got, ref in pairs:
            got = host(got).astype(np.float64)
            ref = np.asarray(ref, dtype=np.float64)
            err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
            errors[name] = float(err) if np.all(np.isfinite(got)) else np.inf
        worst = max(errors.values())
        ok = ok and worst <= 1e-5 and type(out.output) is type(dq)
        say(
            f"tiny chunk_kda (cuda, float32, T={T} K={K} V={V}, compiles included: {seconds:.1f} s): "
            f"worst relative error {worst:.2e} ({max(errors, key=errors.get)}), "
            f"output a {type(out.output).__module__} array: {'ok' if ok else 'FAILED'}"
        )
    except Exception:
        traceback.print_exc()
        say("preflight FAILED: " + traceback.format_exc().strip().splitlines()[-1])
        ok = False
    finally:
        if args.summary:
            with open(args.summary, "a", encoding="utf-8") as fh:
                fh.writelines(f"  {line}\n" for line in lines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
