"""``python -m benchmarks.llama_cpp``: kda's chunked KDA on the CPU against llama.cpp's KDA op.

llama.cpp computes KDA on the CPU as ``ggml_gated_delta_net`` in its KDA mode (a gate per key
channel; ``ggml/src/ggml-cpu/ops.cpp``: a step recurrence in C, forward only). This benchmark

1. downloads the ``llama-cpp-python`` sdist (``pip download --no-deps --no-binary :all:``) into a
   cache directory outside the repository (``$KDA_BENCH_CACHE``, default ``~/.cache/kda-bench``),
2. builds ggml's CPU backend from its vendored ``vendor/llama.cpp`` with cmake (Release,
   ``GGML_NATIVE`` i.e. ``-march=native``, shared libraries, no OpenMP: ggml's own thread pool),
3. compiles ``benchmarks/ggml_kda.c`` (a timing program of this project's own that builds a
   graph of one ``ggml_gated_delta_net`` node) against it,
4. on the same inputs, checks that ggml and ``kda.chunk_kda`` compute the same function (the
   maximal difference of the outputs and final states is printed and must stay below 1e-5), and
5. prints, per shape (and once more at Kimi Linear's gate formula, :mod:`kda.testing`'s ``kimi``
   regime, where decay products go subnormal), ggml's forward, ``kda.chunk_kda``'s forward and
   forward+backward, ``kda.recurrent_kda``, the float64 forward over the float32 one (the two
   timed in alternating rounds), the same-run GEMM reference (:func:`benchmarks._common.gemm_rate`),
   the forward and forward+backward as a percentage of it (the FLOP count of
   :mod:`benchmarks.chunk`), the ratio to ggml, the backward's time over the
   forward's (``bwd/fwd``: ``chunk_kda_backward`` alone, from saved boundaries into fresh gradients,
   over the plain forward, the two timed in alternating rounds), the peak traced memory
   (tracemalloc, as :mod:`benchmarks.chunk`) of the chunked forward+backward, and the machine
   and load average (:func:`benchmarks._common.describe`); first, the path of the kernels' matrix
   products and their rates at this run's chunk shapes, one thread, measured in the same run
   (:mod:`benchmarks.products`).

``--one-core`` runs everything (ggml on one thread, kda, the GEMM) pinned to one core. Where no
compiler or cmake is found, or the download or build fails, the ggml columns are skipped with the
reason printed. Nothing here is imported by :mod:`kda`; nothing of llama.cpp is kept in the repository.

:func:`ggml_forward_times` is the reusable part (``B, H, T, K, V, threads, repeats, seed`` ->
timings and outputs); :func:`ggml_forward` runs given head-first arrays.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from . import _common

__all__ = ["GgmlUnavailable", "build", "ggml_forward", "ggml_forward_times", "main"]

SDIST = "llama-cpp-python==0.3.36"
SOURCE = Path(__file__).with_name("ggml_kda.c")
AGREEMENT = 1e-5  # ggml and kda differ by rounding only (measured ~2.5e-7 at K = V = 128)
SHAPES = ((1, 256), (1, 1024), (1, 4096), (1, 16384), (8, 512))  # (B, T) at H = 16


class GgmlUnavailable(RuntimeError):
    """ggml cannot be built or run here (no compiler, no cmake, no network, a failed build)."""


def cache_dir() -> Path:
    """Where the sdist, its sources and the builds live (never inside the repository)."""
    return Path(os.environ.get("KDA_BENCH_CACHE", Path.home() / ".cache" / "kda-bench"))


def _check(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    log = cache_dir() / "build.log"
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, check=False)
    if r.returncode != 0:
        msg = f"{what} failed (exit {r.returncode}); see {log}"
        raise GgmlUnavailable(msg)


def _sources(root: Path) -> Path:
    """The vendored llama.cpp of the sdist, downloaded and unpacked once."""
    for candidate in root.glob("llama_cpp_python-*/vendor/llama.cpp"):
        if candidate.joinpath("ggml", "include", "ggml.h").exists():
            return candidate
    archives = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            SDIST,
            "-d",
            str(root),
        ]
        _check(cmd, f"pip download {SDIST}")
        archives = sorted(root.glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise GgmlUnavailable(f"pip download {SDIST} left no sdist in {root}")
    with tarfile.open(archives[-1]) as tar:
        tar.extractall(root, filter="data")
    for candidate in root.glob("llama_cpp_python-*/vendor/llama.cpp"):
        return candidate
    raise GgmlUnavailable(f"no vendor/llama.cpp in {archives[-1]}")


@functools.lru_cache(maxsize=1)
def build() -> Path:
    """The timing program, built once (ggml's CPU backend by cmake, then ``ggml_kda.c``)."""
    missing = [tool for tool in ("cmake", "cc") if shutil.which(tool) is None]
    if missing:
        raise GgmlUnavailable(f"no {' or '.join(missing)} on PATH: install a C compiler and cmake")
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    exe = root / "ggml_kda"
    if exe.exists() and exe.stat().st_mtime >= SOURCE.stat().st_mtime:
        return exe
    src = _sources(root)
    out = root / "build"
    if not any(out.glob("bin/libggml-cpu.*")):
        configure = [
            "cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
            "-DBUILD_SHARED_LIBS=ON", "-DGGML_OPENMP=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
            "-DLLAMA_CURL=OFF",
        ]  # fmt: skip
        _check(configure, "cmake configure of ggml")
        jobs = str(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
        _check(
            ["cmake", "--build", str(out), "-j", jobs, "--target", "ggml-cpu", "ggml"], "cmake build of ggml"
        )
    lib = out / "bin"
    include = src / "ggml" / "include"
    cmd = [
        "cc", "-O2", "-std=c11", str(SOURCE), "-I", str(include), "-L", str(lib), "-lggml", "-lggml-base",
        "-lggml-cpu", f"-Wl,-rpath,{lib}", "-o", str(exe),
    ]  # fmt: skip
    _check(cmd, "compiling benchmarks/ggml_kda.c")
    return exe


def ggml_forward(q, k, v, g, beta, state, threads: int, repeats: int) -> dict[str, Any]:
    """Run ggml's KDA op on head-first float32 arrays (scale ``K**-0.5``, ``K == V``).

    ``q, k, g: [B, H, T, K]``, ``v: [B, H, T, V]``, ``beta: [B, H, T]``, ``state: [B, H, K, V]``.
    Returns ``times_s`` (one per repeat, the graph computation alone), ``output [B, H, T, V]`` and
    ``final_state [B, H, K, V]`` (of the last repeat).
    """
    exe = build()
    B, H, T, K = q.shape
    V = v.shape[-1]
    if K != V:
        raise ValueError(f"ggml's op needs K == V; got K={K}, V={V}")
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = Path(tmp, "in.bin"), Path(tmp, "out.bin")
        with inp.open("wb") as f:
            for x in (q, k, v, g, beta[..., None]):
                f.write(np.ascontiguousarray(np.swapaxes(x, 1, 2), dtype=np.float32).tobytes())
            f.write(np.ascontiguousarray(np.swapaxes(state, 2, 3), dtype=np.float32).tobytes())
        cmd = [str(exe), *map(str, (B, H, T, K, threads, repeats)), str(inp), str(outp)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise GgmlUnavailable(f"ggml_kda failed (exit {r.returncode}): {r.stderr.strip()}")
        times = [float(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("time_s")]
        raw = np.fromfile(outp, dtype=np.float32)
    n = B * T * H * V
    output = np.swapaxes(raw[:n].reshape(B, T, H, V), 1, 2)
    final = np.swapaxes(raw[n : n + B * H * V * K].reshape(B, H, V, K), 2, 3)
    return {"times_s": times, "time_s": statistics.median(times), "output": output, "final_state": final}


def ggml_forward_times(
    B: int, H: int, T: int, K: int, V: int, threads: int = 2, repeats: int = 5, seed: int = 0
) -> dict[str, Any]:
    """ggml's forward on the inputs of :func:`benchmarks._common.inputs` (zero initial state).

    Returns what :func:`ggml_forward` returns plus ``inputs`` (the head-first arrays used).
    Raises :class:`GgmlUnavailable` where ggml cannot be built or run.
    """
    x = _common.inputs(B, H, T, K, V, np.float32, seed)
    state = np.zeros((B, H, K, V), np.float32)
    result = ggml_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], state, threads, repeats)
    return {**result, "inputs": x}


# ----------------------------------------------------------------------------------------------
# kda side


def _times(fn, repeats: int) -> list[float]:
    """``repeats`` times of ``fn()`` after one warm-up call (:func:`benchmarks._common.rounds`)."""
    return _common.rounds({"fn": fn}, repeats)["fn"].times_s


def _median(fn, repeats: int) -> float:
    return statistics.median(_times(fn, repeats))


def _crossover_times(q, k, v, g, beta, do, repeats: int) -> tuple[float, float, float, float]:
    import kda

    def chunk_both():
        out = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True)
        kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do)

    def recurrent_both():
        kda.recurrent_kda(q, k, v, g, beta)
        kda.recurrent_kda_backward(q, k, v, g, beta, do)

    c = _median(lambda: kda.chunk_kda(q, k, v, g, beta), repeats)
    r = _median(lambda: kda.recurrent_kda(q, k, v, g, beta), repeats)
    return c, r, _median(chunk_both, repeats), _median(recurrent_both, repeats)


def crossover(H: int, D: int, lengths: tuple[int, ...], repeats: int) -> None:
    """Print ``chunk_kda`` against ``recurrent_kda``, forward and forward+backward, at short lengths
    (where ``kda.cpu.RECURRENT_MAX_T`` comes from)."""
    print("crossover (B=1): T, fwd chunk / recurrent ms, fwd+bwd chunk / recurrent ms")
    for T in lengths:
        x = _common.inputs(1, H, T, D, D, np.float32, 0)
        c, r, cb, rb = _crossover_times(*(x[n] for n in ("q", "k", "v", "g", "beta", "do")), repeats)
        print(
            f"T={T:6d}  fwd {c * 1e3:8.2f} / {r * 1e3:8.2f} ({c / r:.2f})   "
            f"fwd+bwd {cb * 1e3:8.2f} / {rb * 1e3:8.2f} ({cb / rb:.2f})",
            flush=True,
        )


def _kda_times(x: dict[str, np.ndarray], repeats: int, rounds: int, C: int) -> dict[str, float]:
    """kda's forward+backward, ``recurrent_kda``, and two ratios to the float32 forward, all three
    timed in alternating rounds (so that each sees the same drift of the machine's speed): the
    float64 forward (``f64_over_f32``) and the backward alone (``bwd_over_fwd``:
    ``chunk_kda_backward`` from the boundaries of a forward made once, into fresh gradient arrays
    as a training step has them, over the plain ``chunk_kda`` forward)."""
    import kda

    q, k, v, g, beta, do = (x[n] for n in ("q", "k", "v", "g", "beta", "do"))

    def fwd_bwd():
        out = kda.chunk_kda(q, k, v, g, beta, chunk_size=C, save_boundaries=True)
        kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do, chunk_size=C)

    saved = kda.chunk_kda(q, k, v, g, beta, chunk_size=C, save_boundaries=True).boundaries
    x64 = [a.astype(np.float64) for a in (q, k, v, g, beta)]
    f32: list[float] = []
    f64: list[float] = []
    bwd: list[float] = []
    for _ in range(rounds):
        f32 += _times(lambda: kda.chunk_kda(q, k, v, g, beta, chunk_size=C), repeats)
        f64 += _times(lambda: kda.chunk_kda(*x64, chunk_size=C), repeats)
        bwd += _times(lambda: kda.chunk_kda_backward(q, k, v, g, beta, saved, do, chunk_size=C), repeats)
    return {
        "chunk_fwd_bwd": _median(fwd_bwd, repeats),
        "f64_over_f32": statistics.median(f64) / statistics.median(f32),
        "bwd_over_fwd": statistics.median(bwd) / statistics.median(f32),
        "recurrent_fwd": _median(lambda: kda.recurrent_kda(q, k, v, g, beta), max(1, repeats // 2)),
    }


# ----------------------------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama_cpp", description=__doc__.split("\n")[0])
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128, help="K = V (default 128)")
    p.add_argument(
        "--shapes", nargs="+", default=[f"{b}x{t}" for b, t in SHAPES], help="BxT (default %(default)s)"
    )
    p.add_argument("--threads", type=int, default=2, help="ggml's threads (default 2)")
    p.add_argument("--one-core", action="store_true", help="pin the process to one core, ggml on 1 thread")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds of ggml then kda's forward, each --repeats runs"
    )
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument(
        "--realistic-shape",
        default=None,
        help="BxT of the row at Kimi Linear's gate formula (default: the first of --shapes; 'none': skip)",
    )
    p.add_argument("--memory-shape", default="1x4096", help="BxT of the peak-memory pass ('none': skip)")
    p.add_argument(
        "--sub-block",
        type=int,
        default=None,
        help="run the cpu kernels with this SUB_BLOCK (compiled into a fresh Numba cache directory)",
    )
    p.add_argument(
        "--crossover",
        action="store_true",
        help="only chunk vs recurrent at T in 65..1024 (the routing constants)",
    )
    return p


@contextlib.contextmanager
def _one_core(on: bool):
    if not on or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _side_by_side(
    x: dict[str, np.ndarray], threads: int, repeats: int, rounds: int, C: int
) -> tuple[float | None, float, str]:
    """``(ggml's median, kda's forward median, note)``: ``rounds`` rounds, each ``repeats`` ggml
    runs then ``repeats`` kda forwards, so that a drift of the machine's speed during the run
    (seen here: 30-40 % between minutes) falls on both; the note is ggml's agreement with kda on
    the same inputs, or why ggml is skipped."""
    import kda

    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    B, H, _, K = q.shape
    state = np.zeros((B, H, K, v.shape[-1]), np.float32)
    out = kda.chunk_kda(q, k, v, g, beta, chunk_size=C)
    ggml_times: list[float] = []
    kda_times: list[float] = []
    note = ""
    for _ in range(rounds):
        try:
            r = ggml_forward(q, k, v, g, beta, state, threads, repeats)
        except GgmlUnavailable as err:
            note = f"ggml skipped: {err}"
        else:
            ggml_times += r["times_s"]
            diff = max(
                float(np.max(np.abs(r["output"] - out.output))),
                float(np.max(np.abs(r["final_state"] - out.final_state))),
            )
            if not diff <= AGREEMENT:
                msg = f"ggml and kda disagree: max |difference| {diff:.3g} > {AGREEMENT}"
                raise SystemExit(msg)
            note = f"agree to {diff:.2g}"
        kda_times += _times(lambda: kda.chunk_kda(q, k, v, g, beta, chunk_size=C), repeats)
    ggml = statistics.median(ggml_times) if ggml_times else None
    return ggml, statistics.median(kda_times), note


def _set_sub_block(size: int) -> None:
    """Compile the cpu kernels with ``SUB_BLOCK = size``. Numba freezes a module constant into the
    compiled code and its cache does not key on it, so the kernels go to a fresh cache directory
    (set before Numba is imported) and the usual cache is neither read nor changed."""
    if "numba" in sys.modules:
        raise SystemExit("--sub-block must be set before Numba is imported")
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="kda-sub-block-")
    from kda.cpu import _compile

    _compile.SUB_BLOCK = size
    print(f"SUB_BLOCK = {size} (kernels compiled into {os.environ['NUMBA_CACHE_DIR']})")


def main(argv: list[str] | None = None) -> int:
    from .chunk import _memory, pass_flops

    args = _parser().parse_args(argv)
    if args.sub_block is not None:
        _set_sub_block(args.sub_block)
    threads = 1 if args.one_core else args.threads
    C, H, D = args.chunk_size, args.H, args.D
    with _one_core(args.one_core):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        gemm = _common.gemm_rate()
        print(_common.describe())
        print(
            f"cores {cores}, ggml threads {threads}; same-run GEMM reference (benchmarks._common.gemm_rate, "
            f"{_common.GEMM_N}^3 float32): {gemm:.1f} GFLOP/s"
        )
        if args.crossover:
            crossover(H, D, (65, 96, 128, 192, 256, 384, 512, 1024), args.repeats)
            print(f"load average after: {_common.load_average()}")
            return 0
        from .products import report

        report(C, D)  # the product path and its rates at this run's chunk shapes
        head = (
            "B",
            "T",
            "ggml ms",
            "chunk ms",
            "chunk/ggml",
            "fwd %GEMM",
            "f+b ms",
            "f+b %GEMM",
            "bwd/fwd",
            "f64/f32",
            "recur ms",
        )
        print(" ".join(f"{h:>10}" for h in head) + "  gates, agreement")
        realistic = args.shapes[0] if args.realistic_shape is None else args.realistic_shape
        rows = [(shape, _common.DEFAULT_REGIME) for shape in args.shapes]
        if realistic != "none":
            rows.append((realistic, "kimi"))
        for shape, regime in rows:
            B, T = map(int, shape.split("x"))
            x = _common.inputs(B, H, T, D, D, np.float32, 0, regime=regime)
            ggml, fwd_time, note = _side_by_side(x, threads, args.repeats, args.rounds, C)
            t = {"chunk_fwd": fwd_time, **_kda_times(x, args.repeats, args.rounds, C)}
            fwd = 100 * pass_flops("fwd", B, H, T, D, C) / t["chunk_fwd"] / 1e9 / gemm
            both = 100 * pass_flops("fwd+bwd", B, H, T, D, C) / t["chunk_fwd_bwd"] / 1e9 / gemm
            ratio = "-" if ggml is None else f"{t['chunk_fwd'] / ggml:.3f}"
            cells = (
                B, T, "-" if ggml is None else f"{ggml * 1e3:.1f}", f"{t['chunk_fwd'] * 1e3:.1f}", ratio,
                f"{fwd:.1f}", f"{t['chunk_fwd_bwd'] * 1e3:.1f}", f"{both:.1f}",
                f"{t['bwd_over_fwd']:.2f}", f"{t['f64_over_f32']:.2f}",
                f"{t['recurrent_fwd'] * 1e3:.1f}",
            )  # fmt: skip
            label = f"gates {regime!r}" + (" (Kimi's formula)" if regime == "kimi" else "")
            print(" ".join(f"{c:>10}" for c in cells) + f"  {label}, {note}", flush=True)
        if args.memory_shape != "none":
            B, T = map(int, args.memory_shape.split("x"))
            m = _memory(B, H, T, D, D, np.float32, C, 0)
            print(
                f"peak traced memory of chunk fwd+bwd at B={B} T={T}: {m['peak_bytes'] / 2**20:.1f} MiB, "
                f"{m['ratio']:.3f}x inputs+outputs+boundaries+gradients "
                f"({m['essential_bytes'] / 2**20:.1f} MiB)"
            )
        again = _common.gemm_rate()
        print(f"same-run GEMM again at the end: {again:.1f} GFLOP/s (the % columns use the first)")
        print(f"load average after: {_common.load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
