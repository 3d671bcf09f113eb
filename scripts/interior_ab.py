# ruff: noqa: B023, E731  (each lambda is timed at once, inside its loop iteration)
"""Alternating before/after timings of the host layers (a refactor's speed check): each case in a
fresh process per tree, the trees' order reversed every other round; prints every process's
figures, then per case the minimum and median over processes and the ratios against the first tree.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
        python scripts/interior_ab.py base=TREE new=TREE [more=TREE] --rounds 7

Cases (microseconds; the best of many calls in one process): ``torch_decode``
(``kda.torch.fused_recurrent_kda``, one token from an initial state, inference mode, ``B=1
K=V=128``, H = 4 and 16), ``np_decode`` (``kda.decode_kda`` on NumPy), ``small`` (``kda.chunk_kda``
forward and forward+backward, ``kda.torch.chunk_kda`` in inference and with autograd, ``T=64``,
time-major), ``chunk`` (forward and backward at ``B=1 H=4 T=4096 K=V=128``, Kimi's gates), ``dask``
(``kda.dask.chunk_kda``, ``T=2048`` in blocks of 512, threaded scheduler); with ``--cases
kernels`` (a list, comma-separated), the chunked forward and backward at three sizes (``H=4 T=64
K=V=64``, ``H=4 T=256 K=V=64``, ``H=8 T=1024 K=V=128``: the compiled kernels' own speed, for a
change to how they are compiled). A tree's own ``kda`` is
imported (``PYTHONPATH``); only public API, so older trees run it too.
"""

import os
import statistics
import subprocess
import sys
import time

import numpy as np


def best(fn, n, warm=20):
    for _ in range(warm):
        fn()
    b = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        b = min(b, time.perf_counter() - t0)
    return b * 1e6


def run_case(case):
    if case == "torch_decode":
        import torch

        import kda.torch as kt

        torch.manual_seed(0)
        for H in (4, 16):
            K = V = 128
            q = torch.randn(1, 1, H, K)
            k = torch.nn.functional.normalize(torch.randn(1, 1, H, K), dim=-1)
            v = torch.randn(1, 1, H, V)
            g = -torch.rand(1, 1, H, K)
            beta = torch.rand(1, 1, H)
            s0 = torch.randn(1, H, K, V)
            with torch.inference_mode():
                t = best(
                    lambda: kt.fused_recurrent_kda(
                        q, k, v, g, beta, initial_state=s0, output_final_state=True
                    ),
                    400,
                    50,
                )
            print(f"torch_decode_H{H} {t:.1f}")
    elif case == "kernels":
        import kda

        def inputs(B, H, T, K):
            rng = np.random.default_rng(0)
            k = rng.standard_normal((B, H, T, K))
            x = {
                "q": rng.standard_normal((B, H, T, K)),
                "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
                "v": rng.standard_normal((B, H, T, K)),
                "g": np.log(rng.uniform(0.5, 1.0, (B, H, T, K))),
                "beta": rng.uniform(0, 1, (B, H, T)),
            }
            do = rng.standard_normal((B, H, T, K)).astype(np.float32)
            return [x[n].astype(np.float32) for n in ("q", "k", "v", "g", "beta")], do

        for H, T, K, n in ((4, 64, 64, 400), (4, 256, 64, 200), (8, 1024, 128, 30)):
            x, do = inputs(1, H, T, K)
            out = kda.chunk_kda(*x, save_boundaries=True)
            f = best(lambda: kda.chunk_kda(*x, save_boundaries=True), n, 5)
            b = best(lambda: kda.chunk_kda_backward(*x, out.boundaries, do, None), n, 5)
            print(f"kernels_fwd_H{H}_T{T}_K{K} {f:.1f}")
            print(f"kernels_bwd_H{H}_T{T}_K{K} {b:.1f}")
    elif case == "np_decode":
        import kda

        rng = np.random.default_rng(0)
        for H in (4, 16):
            K = V = 128
            q = rng.standard_normal((1, H, 1, K)).astype(np.float32)
            k = rng.standard_normal((1, H, 1, K)).astype(np.float32)
            k /= np.linalg.norm(k, axis=-1, keepdims=True)
            v = rng.standard_normal((1, H, 1, V)).astype(np.float32)
            g = -rng.uniform(0, 1, (1, H, 1, K)).astype(np.float32)
            beta = rng.uniform(0, 1, (1, H, 1)).astype(np.float32)
            pool = np.zeros((4, H, K, V), np.float32)
            idx = np.array([2], np.int64)
            t = best(lambda: kda.decode_kda(q, k, v, g, beta, pool, idx), 2000, 100)
            print(f"np_decode_H{H} {t:.1f}")
    elif case == "small":
        import torch

        import kda
        import kda.torch as kt

        rng = np.random.default_rng(0)
        B, H, T, K, V = 1, 4, 64, 64, 64
        q = rng.standard_normal((B, T, H, K)).astype(np.float32)
        k = rng.standard_normal((B, T, H, K))
        k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
        v = rng.standard_normal((B, T, H, V)).astype(np.float32)
        g = -rng.uniform(0.01, 0.5, (B, T, H, K)).astype(np.float32)
        beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
        do = rng.standard_normal((B, T, H, V)).astype(np.float32)
        kw = dict(layout="time_major")
        f = lambda: kda.chunk_kda(q, k, v, g, beta, save_boundaries=True, **kw)

        def fb():
            o = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True, **kw)
            kda.chunk_kda_backward(q, k, v, g, beta, o.boundaries, do, **kw)

        print(f"kda_fwd_T64 {best(f, 300):.1f}")
        print(f"kda_fwdbwd_T64 {best(fb, 200):.1f}")
        tq, tk, tv, tg, tb, tdo = (torch.from_numpy(x) for x in (q, k, v, g, beta, do))
        with torch.inference_mode():
            print(f"torch_fwd_inference_T64 {best(lambda: kt.chunk_kda(tq, tk, tv, tg, tb), 300):.1f}")

        def tfb():
            a = [x.clone().requires_grad_() for x in (tq, tk, tv, tg, tb)]
            o, _ = kt.chunk_kda(*a)
            o.backward(tdo)

        print(f"torch_fwdbwd_T64 {best(tfb, 200):.1f}")
    elif case == "chunk":
        import kda
        from kda.testing._problems import gates

        rng = np.random.default_rng(0)
        B, H, T, K, V = 1, 4, 4096, 128, 128
        q = rng.standard_normal((B, H, T, K)).astype(np.float32)
        k = rng.standard_normal((B, H, T, K))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        k = k.astype(np.float32)
        v = rng.standard_normal((B, H, T, V)).astype(np.float32)
        g = gates(rng, (B, H, T, K), "kimi").astype(np.float32)
        beta = rng.uniform(0, 1, (B, H, T)).astype(np.float32)
        out = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True)
        do = np.ones_like(out.output)
        print(
            f"chunk_fwd_T4096 {best(lambda: kda.chunk_kda(q, k, v, g, beta, save_boundaries=True), 7, 1):.0f}"
        )
        bwd = best(lambda: kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do), 7, 1)
        print(f"chunk_bwd_T4096 {bwd:.0f}")
    elif case == "dask":
        import dask
        import dask.array as da

        import kda.dask as kd

        rng = np.random.default_rng(0)
        B, H, T, K, V = 1, 4, 2048, 64, 64
        q = rng.standard_normal((B, H, T, K)).astype(np.float32)
        k = rng.standard_normal((B, H, T, K))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        k = k.astype(np.float32)
        v = rng.standard_normal((B, H, T, V)).astype(np.float32)
        g = -rng.uniform(0.01, 0.5, (B, H, T, K)).astype(np.float32)
        beta = rng.uniform(0, 1, (B, H, T)).astype(np.float32)
        ch = (1, 2, 512, -1)
        dq, dk_, dv, dg = (da.from_array(x, chunks=ch) for x in (q, k, v, g))
        db = da.from_array(beta, chunks=(1, 2, 512))

        def run():
            with dask.config.set(scheduler="threads"):
                out = kd.chunk_kda(dq, dk_, dv, dg, db)
                dask.compute(out.output, out.final_state)

        print(f"dask_fwd_T2048 {best(run, 10, 2):.0f}")


def _gemm() -> str:
    """This repository's GEMM reference (:func:`benchmarks._common.gemm_rate`), the yardstick of
    the machine's speed during the run."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import _common

    return f"GEMM reference {_common.gemm_rate():.1f} GFLOP/s (float32, n = {_common.GEMM_N})"


CASES = ("torch_decode", "np_decode", "small", "chunk", "dask")  # and "kernels", with --cases


def main(argv):
    if argv[:1] == ["--case"]:
        run_case(argv[1])
        return 0
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 5
    cases = argv[argv.index("--cases") + 1].split(",") if "--cases" in argv else CASES
    trees = dict(a.split("=", 1) for a in argv if "=" in a)
    env0 = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    res = {}
    print(f"# load average before: {os.getloadavg()}; {_gemm()}", flush=True)
    for r in range(rounds):
        for case in cases:
            order = list(trees.items())[:: -1 if r % 2 else 1]
            for label, tree in order:
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--case", case],
                    cwd=tree,
                    env={**env0, "PYTHONPATH": tree},
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                for line in out.stdout.split("\n"):
                    if line.strip():
                        name, val = line.split()
                        res.setdefault((name, label), []).append(float(val))
                        print(f"round {r + 1} {label:8s} {name:26s} {val}", flush=True)
    print(f"# load average after: {os.getloadavg()}; {_gemm()}")
    first = next(iter(trees))
    print(
        f"{'case':26s} "
        + " ".join(f"{label + ' min/med':>20s}" for label in trees)
        + "   ratios to "
        + first
        + " (min, med)"
    )
    for name in dict.fromkeys(n for n, _ in res):
        cells, ratios = [], []
        for label in trees:
            x = res.get((name, label), [])
            cells.append(f"{min(x):9.1f}/{statistics.median(x):9.1f}" if x else f"{'-':>20s}")
            b = res.get((name, first), [])
            if x and b and label != first:
                ratios.append(
                    f"{label} {min(x) / min(b):.3f} {statistics.median(x) / statistics.median(b):.3f}"
                )
        print(f"{name:26s} " + " ".join(cells) + "   " + ", ".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
