"""What every benchmark shares: its inputs, the GEMM reference, the timer and the machine description.

One definition of each, so that two benchmarks' figures mean the same thing:

- :func:`inputs` (and :func:`draw`, one array of it): the problem every benchmark times. The log
  gates are :func:`kda.testing.gates` of one of :data:`kda.testing.REGIMES` (the same draws kda's
  tests use; default ``"mild"``, ``g ~ -U(0, 1)``); q and k are L2-normalised per step, v and the
  output gradient standard normal, beta ``sigmoid(N(0, 1))``, the initial state ``0.1 N(0, 1)``.
- :func:`gemm_rate`: the rate every "% of GEMM" divides by.
- :func:`rounds` (and :func:`timed`, one call): the timer: every function once per round, in turn,
  the median over the rounds, the load average before and after recorded.
- :func:`machine` (and :func:`describe`, its one-line form): CPU model, instruction sets, cores,
  BLAS, versions.

Nothing here is imported by :mod:`kda`.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "DEFAULT_REGIME",
    "GEMM_N",
    "GEMM_REPEATS",
    "GEMM_WARM_S",
    "INPUT_NAMES",
    "Timing",
    "cpu_model",
    "describe",
    "draw",
    "gemm_rate",
    "inputs",
    "isa",
    "load_average",
    "machine",
    "rounds",
    "timed",
    "usable_cores",
]

DEFAULT_REGIME = "mild"
# the arrays of :func:`inputs`, in the order they are drawn
INPUT_NAMES = ("q", "k", "v", "g", "beta", "do", "state")
GEMM_N = 2048
GEMM_WARM_S = 1.5
GEMM_REPEATS = 5


# ----------------------------------------------------------------------------------------------
# Inputs


def draw(
    name: str,
    shape: tuple[int, ...],
    rng: np.random.Generator,
    dtype: Any = np.float32,
    regime: str = DEFAULT_REGIME,
) -> np.ndarray:
    """One input array of a KDA call, drawn from ``rng``.

    Parameters
    ----------
    name : one of :data:`INPUT_NAMES`
        ``"q"``, ``"k"``: L2-normalised over the last axis; ``"v"``, ``"do"``: standard normal;
        ``"g"``: log decays, :func:`kda.testing.gates` of ``regime``; ``"beta"``: ``sigmoid(N(0, 1))``;
        ``"state"``: ``0.1 N(0, 1)``.
    shape : tuple of int
        e.g. ``[B, H, T, K]`` for ``q``, ``[B, H, T]`` for ``beta``, ``[B, H, K, V]`` for ``state``.
    rng : numpy.random.Generator
    dtype : NumPy dtype of the result
    regime : one of :data:`kda.testing.REGIMES` (for ``"g"`` only)

    Returns
    -------
    numpy.ndarray of ``shape`` and ``dtype``
    """
    if name in ("q", "k"):
        x = rng.standard_normal(shape, dtype=np.float32)
        x /= np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), np.float32(1e-6))
    elif name in ("v", "do"):
        x = rng.standard_normal(shape, dtype=np.float32)
    elif name == "g":
        from kda.testing import gates

        x = gates(rng, shape, regime)
    elif name == "beta":
        x = 1.0 / (1.0 + np.exp(-rng.standard_normal(shape, dtype=np.float32)))
    elif name == "state":
        x = 0.1 * rng.standard_normal(shape, dtype=np.float32)
    else:
        raise ValueError(f"name must be one of {INPUT_NAMES}; got {name!r}")
    return x.astype(dtype, copy=False)


def inputs(
    B: int,
    H: int,
    T: int,
    K: int,
    V: int,
    dtype: Any = np.float32,
    seed: int = 0,
    *,
    regime: str = DEFAULT_REGIME,
    layout: str = "head_first",
) -> dict[str, np.ndarray]:
    """The benchmarks' KDA problem: every array of :data:`INPUT_NAMES`, drawn by :func:`draw` in
    that order from ``numpy.random.default_rng(seed)``.

    Parameters
    ----------
    B, H, T, K, V : int
        batch, heads, steps, key and value dimensions
    dtype : NumPy dtype of every array
    seed : int
    regime : one of :data:`kda.testing.REGIMES`, the log gates' regime
    layout : {"head_first", "time_major"}
        ``"head_first"``: q, k, g ``[B, H, T, K]``, v, do ``[B, H, T, V]``, beta ``[B, H, T]``;
        ``"time_major"``: the same with the ``H`` and ``T`` axes swapped (C-contiguous).
        ``state`` is ``[B, H, K, V]`` in both.

    Returns
    -------
    dict of name -> numpy.ndarray
    """
    if layout not in ("head_first", "time_major"):
        raise ValueError(f"layout must be 'head_first' or 'time_major'; got {layout!r}")
    rng = np.random.default_rng(seed)
    seq = (B, H, T)
    shapes = {"q": (*seq, K), "k": (*seq, K), "v": (*seq, V), "g": (*seq, K), "beta": seq, "do": (*seq, V),
              "state": (B, H, K, V)}  # fmt: skip
    x = {n: draw(n, shapes[n], rng, dtype, regime) for n in INPUT_NAMES}
    if layout == "time_major":
        x.update({n: np.ascontiguousarray(np.swapaxes(a, 1, 2)) for n, a in x.items() if n != "state"})
    return x


# ----------------------------------------------------------------------------------------------
# The GEMM reference


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gemm_rate(
    n: int = GEMM_N, warm_s: float = GEMM_WARM_S, repeats: int = GEMM_REPEATS, dtype: Any = np.float32
) -> float:
    """GFLOP/s of the GEMM reference: every "% of GEMM" in ``benchmarks/`` divides by this.

    The reference is a ``dtype`` (float32 unless the figures it is compared with are float64)
    ``n x n @ n x n`` NumPy matmul (``2 n^3`` FLOPs; default
    ``n = 2048``) with the BLAS on as many threads as this process has usable cores
    (:func:`usable_cores`; ``--one-core`` benchmarks pin the process first, so one thread there),
    after ``warm_s`` seconds (default 1.5) of the same product (the first products after a pause
    have run at as little as 66 % of the rate a minute later), the median of ``repeats`` (default 5)
    products. Measure it in the same process and run as the figures it is compared with.
    """
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    try:
        import threadpoolctl
    except ImportError:  # optional: then the BLAS runs on its own default threads
        limits: Any = None
    else:
        limits = threadpoolctl.threadpool_limits(limits=usable_cores(), user_api="blas")
    try:
        end = time.perf_counter() + warm_s
        a @ b
        while time.perf_counter() < end:
            a @ b
        times = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    finally:
        if limits is not None:
            limits.restore_original_limits()
    return 2.0 * n**3 / statistics.median(times) / 1e9


# ----------------------------------------------------------------------------------------------
# The timer


class Timing(NamedTuple):
    """One function's times from :func:`rounds` (seconds per call)."""

    median_s: float
    min_s: float
    times_s: list[float]
    loops: int  # calls per sample


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def load_average() -> list[float] | None:
    """``os.getloadavg()`` (1, 5, 15 minutes), or None where the platform has none."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float, float]:
    """``fn(*args)``, its wall seconds and this process's CPU seconds (all threads)."""
    w, c = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - w, time.process_time() - c


def _sample(fn: Callable[[], Any], loops: int, tick: Callable[[], float]) -> float:
    t0 = tick()
    for _ in range(loops):
        fn()
    return (tick() - t0) / loops


def rounds(
    fns: Mapping[str, Callable[[], Any]],
    n_rounds: int,
    *,
    warm_up: int = 1,
    min_sample: float = 0.0,
    loops: int | None = None,
    repeats: int = 1,
    clock: str = "wall",
    record: dict[str, Any] | None = None,
) -> dict[str, Timing]:
    """Time each function in alternating rounds: the one timer of ``benchmarks/``.

    Each function is first called ``warm_up`` times (compiles, caches, first-touch pages; the
    first call also sizes ``loops``, the calls per sample, so that a sample lasts at least
    ``min_sample`` seconds). Then every round takes ``repeats`` samples of each function in turn,
    in an order rotated from round to round, so that a change of the machine's speed or load
    during the run falls on all of them alike.

    Parameters
    ----------
    fns : name -> function of no arguments
    n_rounds : int, at least 1
    warm_up : calls of each function before the rounds
    min_sample : seconds a sample lasts at least
    loops : calls per sample, fixed (instead of sized by ``min_sample``)
    repeats : samples of each function per round
    clock : {"wall", "cpu"}
        ``"cpu"``: this process's CPU time (all threads) instead of wall time.
    record : dict, optional
        Gets ``"load_average_before"`` and ``"load_average_after"`` (:func:`load_average`).

    Returns
    -------
    dict of name -> :class:`Timing` (median and minimum over every sample, seconds per call)
    """
    tick = CLOCKS[clock]
    if record is not None:
        record["load_average_before"] = load_average()
    per: dict[str, int] = {}
    for name, fn in fns.items():
        first = _sample(fn, 1, tick) if warm_up > 0 else 0.0
        for _ in range(warm_up - 1):
            fn()
        sized = max(1, int(min_sample / max(first, 1e-9))) if min_sample > 0 else 1
        per[name] = max(1, loops) if loops is not None else sized
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(max(1, n_rounds)):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(max(1, repeats)):
                times[name].append(_sample(fns[name], per[name], tick))
    if record is not None:
        record["load_average_after"] = load_average()
    return {n: Timing(statistics.median(ts), min(ts), ts, per[n]) for n, ts in times.items()}


# ----------------------------------------------------------------------------------------------
# The machine


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else :func:`platform.processor`)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the instruction-set extensions that decide the kernels' speed (the flags /proc/cpuinfo names)
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "asimd",
    "sve",
)


def isa() -> list[str]:
    """Which of :data:`ISA_FLAGS` the CPU has (empty where ``/proc/cpuinfo`` lists no flags)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith(("flags", "features")):
                    have = set(line.split(":", 1)[1].split())
                    return [f for f in ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def machine() -> dict[str, Any]:
    """The machine a benchmark ran on, as a JSON-able record: CPU model, instruction sets, cores,
    platform, versions, the BLAS (threadpoolctl), the thread variables set, the load average."""
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "isa": isa(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("OPENBLAS_", "OMP_", "MKL_", "BLIS_", "GOTO_", "VECLIB_", "NUMBA_NUM_THREADS"))
        },
        "loadavg_at_start": load_average(),
    }
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [
            {k: d.get(k) for k in ("user_api", "internal_api", "version", "num_threads", "architecture")}
            for d in threadpool_info()
        ]
    except ImportError:
        info["blas"] = "threadpoolctl not installed"
    try:
        import kda

        info["kda"] = kda.__version__
    except (ImportError, AttributeError):
        pass
    return info


def describe(info: Mapping[str, Any] | None = None) -> str:
    """One line: CPU model, instruction sets, usable / logical cores, load average."""
    info = machine() if info is None else info
    isa_ = "/".join(info.get("isa") or []) or "?"
    return (
        f"cpu: {info['cpu_model']} ({isa_}), {info['usable_cores']} of {info['logical_cores']} cores usable; "
        f"load average {info['loadavg_at_start']}"
    )
