"""The CPU kernels' matrix products at the chunk shapes: which path they take and how fast it runs.

Every dense product of the fused passes (``kda.cpu._fused``: ``forward_heads``, ``backward_heads``
and the pairs and solves they call) goes through ``_mm`` (``kda/cpu/_products.py``, on the
process's product path). This lists those products per chunk for a chunk size and ``K = V =
D`` (:func:`chunk_products`), measures ``_mm``'s rate at each distinct shape on one thread
(:func:`rates`) and adds up what the products of one head and chunk would take at those rates
(:func:`product_time`), to set beside the time a pass takes per head and chunk. ``--paths``
measures product paths one after another, each in a fresh process.

    python -m benchmarks.products --chunk-size 64 --D 128 [--paths scipy mkl]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from typing import NamedTuple

import numpy as np

ENV = "KDA_CPU_PRODUCTS"  # kda.cpu._products.ENV (read without importing numba)


class Product(NamedTuple):
    """``C[m, n] = op(A) @ op(B)`` with ``k`` terms a sum; ``ta``/``tb``: the operand is transposed."""

    m: int
    n: int
    k: int
    ta: bool
    tb: bool

    @property
    def label(self) -> str:
        t = ("T" if self.ta else "") + ("/T" if self.tb else "") if self.ta or self.tb else ""
        return f"{self.m}x{self.n}x{self.k}{' ' + t.strip('/') if t else ''}"

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def _pairs_products(Cp: int, K: int, c: int, backward: bool) -> list[Product]:
    """The products across sub-blocks of ``c`` steps (``kda.cpu._pairs``)."""
    out: list[Product] = []
    if c >= Cp:
        return out
    for a0 in range(c, Cp, c):
        if backward:
            out += [Product(2 * c, K, a0, False, False), Product(a0, K, 2 * c, True, False)]
        else:
            out.append(Product(2 * c, a0, K, False, True))
    return out


def _solve_products(Cp: int, V: int, c: int, transposed: bool) -> list[Product]:
    """The products of the solve by blocks of ``c`` rows (``kda.cpu._solve``)."""
    c = min(c, Cp)
    out: list[Product] = []
    for a0 in range(0, Cp, c):
        if transposed:
            if a0 + c < Cp:
                out.append(Product(c, V, Cp - a0 - c, True, False))
            out.append(Product(c, V, c, True, False))
        else:
            if a0 > 0:
                out.append(Product(c, V, a0, False, False))
            out.append(Product(c, V, c, False, False))
    return out


def chunk_products(C: int, D: int) -> dict[str, list[Product]]:
    """The products of one head and chunk of ``forward_heads`` and ``backward_heads`` at chunk
    size ``C`` and ``K = V = D`` (a chunk after the first, with a state), with the block sizes
    the kernels are compiled with on this machine (``kda.cpu._compile``)."""
    from kda._engine.chunked import padded_chunk_size
    from kda.cpu import _compile as cfg

    Cp = padded_chunk_size(C)
    K = V = D
    c = min(cfg.SUB_BLOCK, Cp)
    pairs_f, pairs_b = _pairs_products(Cp, K, c, False), _pairs_products(Cp, K, c, True)
    solve = _solve_products(Cp, V, cfg.SOLVE_BLOCK, False)
    fwd = [*pairs_f, Product(2 * Cp, V, K, False, False), *solve]
    fwd += [Product(Cp, V, Cp, False, False), Product(K, V, Cp, True, False)]
    bwd = [*pairs_f, Product(Cp, V, K, False, False), *solve, Product(Cp, V, Cp, True, True)]
    bwd += [Product(Cp, V, K, False, False), *_solve_products(Cp, V, cfg.SOLVE_BLOCK, True)]
    bwd += [Product(K, V, 2 * Cp, True, True), Product(2 * Cp, K, V, True, True)]
    bwd += [Product(Cp, Cp, V, True, False), Product(Cp, Cp, V, False, False)]
    bwd += [Product(Cp, K, V, True, True), *pairs_b]
    return {"fwd": fwd, "bwd": bwd}


def _loop():
    import numba

    from kda.cpu._products import _mm

    @numba.njit(nogil=True)
    def loop(A, ta, B, tb, C, n):
        for _ in range(n):
            _mm(A, ta, B, tb, C, 0.0)

    return loop


def rates(products: list[Product], dtype=np.float32, seconds: float = 0.05) -> dict[Product, float]:
    """GFLOP/s of ``_mm`` at each distinct product, one thread (the BLAS limited to one), the best
    of three runs of about ``seconds`` each."""
    import threadpoolctl

    loop = _loop()
    rng = np.random.default_rng(0)
    out: dict[Product, float] = {}
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        for p in dict.fromkeys(products):
            A = rng.standard_normal((p.k, p.m) if p.ta else (p.m, p.k)).astype(dtype)
            B = rng.standard_normal((p.n, p.k) if p.tb else (p.k, p.n)).astype(dtype)
            C = np.empty((p.m, p.n), dtype)
            loop(A, p.ta, B, p.tb, C, 1)
            t0 = time.perf_counter()
            loop(A, p.ta, B, p.tb, C, 10)
            n = max(10, int(seconds / max((time.perf_counter() - t0) / 10, 1e-9)))
            best = 0.0
            for _ in range(3):
                t0 = time.perf_counter()
                loop(A, p.ta, B, p.tb, C, n)
                best = max(best, p.flops * n / (time.perf_counter() - t0) / 1e9)
            out[p] = best
    return out


def product_time(products: list[Product], rate: dict[Product, float]) -> float:
    """Seconds the ``products`` take at the measured ``rate`` (GFLOP/s)."""
    return sum(p.flops / (rate[p] * 1e9) for p in products)


def path() -> str:
    """The product path of the CPU kernels, in words: its name, the library ``_mm`` calls, its
    version and why it was chosen (``kda.cpu._products.PATH``; ``KDA_CPU_PRODUCTS`` overrides)."""
    from kda.cpu._products import PATH

    version = f" {PATH.version}" if PATH.version else ""
    return f"{PATH.name}: {PATH.library}{version} ({PATH.reason})"


def report(C: int, D: int) -> dict[str, float]:
    """Print the path, each product's rate and count per head and chunk, and what the products
    of a head and chunk take at those rates; returns those times (seconds) by pass."""
    groups = chunk_products(C, D)
    rate = rates([p for ps in groups.values() for p in ps])
    print(f"products: {path()}; one thread, float32, GFLOP/s at M x N x K (count per chunk fwd/bwd):")
    counts = {name: Counter(ps) for name, ps in groups.items()}
    cells = [f"{p.label} {r:.0f} ({counts['fwd'][p]}/{counts['bwd'][p]})" for p, r in rate.items()]
    for i in range(0, len(cells), 4):
        print("  " + "; ".join(cells[i : i + 4]))
    times = {name: product_time(ps, rate) for name, ps in groups.items()}
    flops = {name: sum(p.flops for p in ps) for name, ps in groups.items()}
    parts = [
        f"{name} {t * 1e6:.1f} us ({flops[name] / t / 1e9:.0f} GFLOP/s, {len(groups[name])} calls)"
        for name, t in times.items()
    ]
    print("products per head and chunk at these rates: " + ", ".join(parts))
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--D", type=int, default=128, help="K = V (default 128)")
    p.add_argument(
        "--paths", nargs="+", choices=("auto", "scipy", "mkl"),
        help="product paths to measure one after another, each in a fresh process (KDA_CPU_PRODUCTS)",
    )  # fmt: skip
    args = p.parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    if args.paths:
        for name in args.paths:
            cmd = [sys.executable, "-m", "benchmarks.products", f"--chunk-size={args.chunk_size}"]
            cmd.append(f"--D={args.D}")
            env = {**os.environ, ENV: name}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            print("\n".join(line for line in out.stdout.splitlines() if not line.startswith("load average")))
    else:
        report(args.chunk_size, args.D)
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
