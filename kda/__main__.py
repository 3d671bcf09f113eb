"""``python -m kda``: check the chunked KDA against the recurrence on every available backend.

``python -m kda warmup`` compiles every kernel of the CPU backend ahead of time (float32 and
float64) into its cache, and prints how long that took: for images and servers, so that no
process pays the compilation at its first call.

The benchmarks live outside the library, in the repository's ``benchmarks/`` folder
(``python -m benchmarks.chunk --help`` from the repository root).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from typing import Any

import numpy as np

import kda

from ._backend import cpu_available, get_backend
from ._options import gates
from ._options.table import OPTIONS, Option

try:
    import resource  # the CPU time of the warm-up's processes (POSIX)
except ImportError:  # pragma: no cover - Windows
    resource = None

# the default problem of the check
DEFAULTS = {"B": 1, "H": 4, "T": 1024, "K": 64, "V": 64, "chunk_size": 64}
TOLERANCE = {"float32": 1e-5, "float64": 1e-10}
# the fields of KdaGradients: the inputs, the initial state and every gate parameter of the laws
GRADIENTS = ("q", "k", "v", "g", "beta", "initial_state", *gates.PARAMETER_NAMES)
INPUTS = ("q", "k", "v", "g", "beta")


# how the check draws each gate parameter (in this order; a parameter not named here: N(0, 1))
_PARAMETER_DRAWS = {
    "dt_bias": lambda rng, shape: rng.standard_normal(shape),
    "A_log": lambda rng, shape: rng.uniform(-2.0, 0.5, shape),
}
# the lower_bound of the laws that take one
_LOWER_BOUND = -5.0


def _gate_inputs(rng: np.random.Generator, shape: tuple[int, ...], gate: str) -> dict[str, Any]:
    """``g`` and the gate's keyword options, as the law ``gate`` of the option table takes them:
    log decays in [log 0.5, 0] for a law whose ``g`` is the log decay, raw gates ``N(0, 1)``
    otherwise, with every parameter the law takes and its ``lower_bound``."""
    law = gates.law(gate)
    options: dict[str, Any] = {} if gate == _option("gate").default else {"gate": gate}
    if law.log_input:
        return {"g": np.log(rng.uniform(0.5, 1.0, shape)), **options}
    HV, K = shape[1], shape[3]
    options["g"] = rng.standard_normal(shape)
    taken = {p.name: p for p in law.params}
    order = [n for n in _PARAMETER_DRAWS if n in taken] + [n for n in taken if n not in _PARAMETER_DRAWS]
    for name in order:
        draw = _PARAMETER_DRAWS.get(name, lambda rng, shape: rng.standard_normal(shape))
        options[name] = draw(rng, taken[name].shape(HV, K))
    if law.lower_bound:
        options["lower_bound"] = _LOWER_BOUND
    return options


def _option(name: str) -> Option:
    """The option table's row ``name``."""
    return next(o for o in OPTIONS if o.name == name)


def _offsets(rng: np.random.Generator, T: int, n: int) -> np.ndarray:
    """``n`` packed sequences of random lengths summing to ``T``."""
    cuts = np.sort(rng.choice(np.arange(1, T), size=min(n - 1, T - 1), replace=False))
    return np.concatenate([[0], cuts, [T]]).astype(np.int64)


def make_inputs(
    B: int,
    H: int,
    T: int,
    K: int,
    V: int,
    dtype: str,
    seed: int = 0,
    *,
    gva: int = 1,
    gate: str = "log",
    varlen: int = 0,
    layout: str = "head_first",
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A KDA problem as models feed it, and its keyword options.

    L2-normalised keys, log decays in [log 0.5, 0] (or raw gates with ``A_log``/``dt_bias``),
    beta in (0, 1); ``gva`` value heads per q/k head; ``varlen > 0`` packs that many sequences
    into one row (``B`` must be 1).
    """
    rng = np.random.default_rng(seed)
    HV = H * gva
    N = B if not varlen else len(_offsets(np.random.default_rng(seed), T, varlen)) - 1
    k = rng.standard_normal((B, H, T, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    gate_options = _gate_inputs(rng, (B, HV, T, K), gate)
    arrays = {
        "q": rng.standard_normal((B, H, T, K)),
        "k": k,
        "v": rng.standard_normal((B, HV, T, V)),
        "g": gate_options.pop("g"),
        "beta": rng.uniform(0.0, 1.0, (B, HV, T)),
        "grad_output": rng.standard_normal((B, HV, T, V)),
        "initial_state": 0.1 * rng.standard_normal((N, HV, K, V)),
        "grad_final_state": rng.standard_normal((N, HV, K, V)),
    }
    if layout == "time_major":
        for name in (*INPUTS, "grad_output"):
            arrays[name] = np.ascontiguousarray(np.swapaxes(arrays[name], 1, 2))
    state_dtype = np.float64 if dtype == "float64" else np.float32
    out = {
        n: x.astype(state_dtype if n in ("initial_state", "grad_final_state") else dtype)
        for n, x in arrays.items()
    }
    options: dict[str, Any] = {"layout": layout, **gate_options}
    if varlen:
        options["cu_seqlens"] = _offsets(np.random.default_rng(seed), T, varlen)
    return out, options


def available_backends() -> dict[str, Any]:
    """Backend name -> a function that moves a NumPy array to that backend's arrays."""
    backends: dict[str, Any] = {}
    if cpu_available():  # NumPy's default: the Numba backend
        backends["cpu"] = lambda x: x
    backends["reference"] = lambda x: x
    try:
        import cupy

        cupy.zeros(1)  # raises where there is no usable GPU
        get_backend(cupy, "cuda")  # the dispatch imports the backend; raises where it cannot run

        backends["cuda"] = cupy.asarray
    except Exception:
        pass
    return backends


def _numpy(x: Any) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _rel(got: Any, want: np.ndarray) -> float:
    got = _numpy(got).astype(np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


def _timed(fn) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def _oracle(x: dict[str, np.ndarray], options: dict[str, Any]) -> tuple[Any, Any, float, float]:
    """Forward and backward of the float64 recurrence, with their times (of this call: the
    caller warms it up first, so that no compile time is counted)."""
    x64 = {n: a.astype(np.float64) for n, a in x.items()}
    opts = {n: (a.astype(np.float64) if n in gates.PARAMETER_NAMES else a) for n, a in options.items()}
    inputs = [x64[n] for n in INPUTS]
    ref, t_fwd = _timed(lambda: kda.recurrent_kda(*inputs, initial_state=x64["initial_state"], **opts))
    ref_grads, t_bwd = _timed(
        lambda: kda.recurrent_kda_backward(
            *inputs, x64["grad_output"], x64["grad_final_state"], initial_state=x64["initial_state"], **opts
        )
    )
    return ref, ref_grads, t_fwd, t_bwd


def _check_backend(name: str, to_backend, x, options, chunk_size: int, ref, ref_grads):
    """Times and worst errors of one backend's chunked forward and backward (the second call's
    times: the first compiles where the backend compiles)."""
    dev = {n: to_backend(a) for n, a in x.items()}
    opts = {n: (to_backend(a) if n in gates.PARAMETER_NAMES else a) for n, a in options.items()}
    call = {"chunk_size": chunk_size, "initial_state": dev["initial_state"], "backend": name, **opts}
    inputs = [dev[n] for n in INPUTS]
    warm = kda.chunk_kda(*inputs, **call, save_boundaries=True)  # warm-up (compiles, on cpu)
    kda.chunk_kda_backward(*inputs, warm.boundaries, dev["grad_output"], dev["grad_final_state"], **call)
    out, t_fwd = _timed(lambda: kda.chunk_kda(*inputs, **call, save_boundaries=True))
    _numpy(out.output)
    grads, t_bwd = _timed(
        lambda: kda.chunk_kda_backward(
            *inputs, out.boundaries, dev["grad_output"], dev["grad_final_state"], **call
        )
    )
    _numpy(grads.q)
    fwd_err = {"output": _rel(out.output, ref.output), "final_state": _rel(out.final_state, ref.final_state)}
    bwd_err = {
        f"d{n}": _rel(a, b) for n, a, b in zip(GRADIENTS, grads, ref_grads, strict=True) if b is not None
    }
    return (("forward", t_fwd, fwd_err), ("backward", t_bwd, bwd_err)), t_fwd


def check(args: argparse.Namespace) -> int:
    B = 1 if args.varlen else args.B
    x, options = make_inputs(
        B,
        args.H,
        args.T,
        args.K,
        args.V,
        args.dtype,
        gva=args.gva,
        gate=args.gate,
        varlen=args.varlen,
        layout=args.layout,
    )
    shown = {n: v for n, v in options.items() if not hasattr(v, "shape")}
    if args.varlen:
        shown["sequences"] = len(options["cu_seqlens"]) - 1
    print(
        f"kda {kda.__version__}: B={B} H={args.H} HV={args.H * args.gva} T={args.T} K={args.K} V={args.V} "
        f"{args.dtype}, chunk_size={args.chunk_size}, {shown}; oracle: the float64 recurrence"
    )
    _oracle(x, options)  # warm-up: the first call compiles the recurrence where a backend compiles
    ref, ref_grads, t_rec, t_rec_bwd = _oracle(x, options)
    tol = TOLERANCE[args.dtype]
    header = f"{'backend':<10} {'pass':<9} {'time [s]':>9}  {'worst error':>11}  {'of':<14} status"
    print(header)
    print("-" * len(header))
    print(f"{'recurrence':<10} {'forward':<9} {t_rec:9.3f}  {'(oracle)':>11}")
    print(f"{'recurrence':<10} {'backward':<9} {t_rec_bwd:9.3f}  {'(oracle)':>11}")
    failed = False
    t_first = 0.0
    for name, to_backend in available_backends().items():
        passes, t_fwd = _check_backend(name, to_backend, x, options, args.chunk_size, ref, ref_grads)
        t_first = t_first or t_fwd
        for pass_name, t, errs in passes:
            worst = max(errs, key=errs.get)
            ok = errs[worst] <= tol
            failed |= not ok
            status = "ok" if ok else f"FAIL (> {tol:.0e})"
            print(f"{name:<10} {pass_name:<9} {t:9.3f}  {errs[worst]:11.2e}  {worst:<14} {status}")
    print(f"speed-up of the chunked form (first backend) over the recurrence: forward {t_rec / t_first:.0f}x")
    return 1 if failed else 0


def _warm_calls(dtype: str) -> None:
    """Small calls of every NumPy entry point on the cpu backend, in ``dtype``: each layout and
    kind of state the kernels take (head-first and time-major inputs, states ``[K, V]`` and
    ``[V, K]``, packed sequences), the chunked route and the recurrent one (short sequences), and
    decoding from every kind of pool (16-bit pools for float32). Time-major inputs are views that
    Numba types by their strides: with one batch row ``beta``'s view is Fortran-ordered, with more
    it is strided, two signatures of each kernel; both are compiled."""
    for layout in ("head_first", "time_major"):
        for B in (1, 2):
            _warm_chunked(dtype, layout, B)
        _warm_decode(dtype, layout)
    x, options = make_inputs(1, 2, 80, 16, 16, dtype, varlen=3)
    inputs = [x[n] for n in INPUTS]
    out = kda.chunk_kda(
        *inputs, initial_state=x["initial_state"], save_boundaries=True, backend="cpu", **options
    )
    kda.chunk_kda_backward(
        *inputs,
        out.boundaries,
        x["grad_output"],
        x["grad_final_state"],
        initial_state=x["initial_state"],
        backend="cpu",
        **options,
    )


def _warm_chunked(dtype: str, layout: str, B: int) -> None:
    """The chunked forward and backward (with and without a state, ``[K, V]`` and ``[V, K]``), the
    transitions, and the recurrent route (8 steps), on ``B`` batch rows."""
    x, options = make_inputs(B, 2, 80, 16, 16, dtype, layout=layout)  # 80 steps: the chunked route
    inputs = [x[n] for n in INPUTS]
    for v_first in (False, True):
        state = np.swapaxes(x["initial_state"], -1, -2) if v_first else x["initial_state"]
        grad_final = np.swapaxes(x["grad_final_state"], -1, -2) if v_first else x["grad_final_state"]
        call = {"backend": "cpu", "initial_state": state, "state_v_first": v_first, **options}
        out = kda.chunk_kda(*inputs, save_boundaries=True, **call)
        kda.chunk_kda_backward(*inputs, out.boundaries, x["grad_output"], grad_final, **call)
    out = kda.chunk_kda(*inputs, save_boundaries=True, backend="cpu", **options)  # no state
    kda.chunk_kda_backward(*inputs, out.boundaries, x["grad_output"], None, backend="cpu", **options)
    kda.chunk_kda_transition(*inputs, backend="cpu", **options)
    kda.chunk_kda_transition_backward(*inputs, x["grad_output"], backend="cpu", **options)
    short = {n: a[:, :, :8] if layout == "head_first" else a[:, :8] for n, a in x.items() if a.ndim >= 3}
    s = [short[n] for n in INPUTS]
    for route in ({"initial_state": x["initial_state"]}, {}):  # 8 steps: the recurrent route
        kda.chunk_kda(*s, save_boundaries=True, backend="cpu", **route, **options)
        kda.recurrent_kda(*s, backend="cpu", **route, **options)
        kda.recurrent_kda_backward(*s, short["grad_output"], None, backend="cpu", **route, **options)


def _warm_decode(dtype: str, layout: str) -> None:
    """Decode steps (one and two tokens a request) from each kind of pool the cpu backend keeps."""
    pools = [dtype] if dtype == "float64" else [dtype, "float16"]
    try:
        import ml_dtypes
    except ImportError:
        pass
    else:
        if dtype == "float32":
            pools.append(ml_dtypes.bfloat16)
    N, P, H, K, V = 2, 3, 2, 16, 16
    rng = np.random.default_rng(0)
    for T in (1, 2):
        x, options = make_inputs(N, H, T, K, V, dtype, layout=layout)
        inputs = [x[n] for n in INPUTS]
        slots = np.array([2, 0], np.int64)
        for pool_dtype in pools:
            for v_first in (False, True):
                pool = rng.standard_normal((P, H, K, V)).astype(pool_dtype)
                call = {"backend": "cpu", "state_v_first": v_first, **options}
                kda.decode_kda(*inputs, pool, slots, **call)
                kda.prepare_decode_kda(*inputs, pool, slots, **call).run()


def warmup(args: argparse.Namespace) -> int:
    """Compile every kernel of the CPU backend for ``args.dtype`` (both by default) into its cache;
    prints the time taken and how many kernels were compiled or loaded from the cache. With more
    than one job (``args.jobs``; default: one per dtype, at most one per core, and one where no
    cache is writable), each dtype compiles in a process of its own (``python -m kda warmup
    --dtype D --jobs 1``), side by side: Numba compiles on one core per process."""
    if not cpu_available():
        print("kda: the cpu backend is not available here (it needs numba and scipy); nothing to compile")
        return 1
    kept = get_backend(np, "cpu").kernel_cache()
    where = {None: "none (every process compiles)", "numba": "Numba's cache directory"}
    cache = where.get(kept, kept)
    jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    # processes share their work only through a cache: without one, compile here, once
    jobs = min(jobs, len(args.dtype)) if kept is not None else 1
    started = time.perf_counter()
    if jobs > 1:
        compiled, cpu = _warm_in_processes(args.dtype, jobs)
        if compiled is None:
            return 1
        how = f"{cpu:.1f} s of CPU time in {len(args.dtype)} processes, {jobs} at a time"
    else:
        compiled, cpu = _warm_here(args.dtype)
        how = f"{cpu:.1f} s of CPU time"
    print(
        f"kda {kda.__version__}: cpu kernels ready for {' and '.join(args.dtype)} in "
        f"{time.perf_counter() - started:.1f} s ({how}; "
        f"{compiled} kernels compiled, the others loaded from the cache); cache: {cache}"
    )
    return 0


def _warm_here(dtypes: list[str]) -> tuple[int, float]:
    """Warm ``dtypes`` in this process: ``(kernels compiled, CPU seconds)``."""
    from numba.core import event

    compiled: list[str] = []

    class Count(event.Listener):
        def __init__(self) -> None:
            self.depth = 0

        def on_start(self, ev: event.Event) -> None:
            self.depth += 1

        def on_end(self, ev: event.Event) -> None:
            self.depth -= 1
            if self.depth == 0:
                compiled.append(getattr(ev.data["dispatcher"], "__qualname__", "?"))

    # the warm-up compiles every kernel itself (its processes, one per dtype, are its parallelism):
    # no backward compiled ahead in a second process of the first call's
    cpu = time.process_time()
    with get_backend(np, "cpu").compile_ahead_off(), event.install_listener("numba:compile", Count()):
        for dtype in dtypes:
            _warm_calls(dtype)
    return len(compiled), time.process_time() - cpu


# the count in a warm-up's summary line (printed by :func:`warmup`)
_COMPILED = re.compile(r"; (\d+) kernels compiled,")


def _warm_in_processes(dtypes: list[str], jobs: int) -> tuple[int | None, float]:
    """Warm each of ``dtypes`` in a process of its own (``python -m kda warmup --dtype D --jobs
    1``), ``jobs`` at a time: ``(kernels compiled, CPU seconds of the processes)``; ``(None, ...)``
    where one failed (its output printed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN) if resource else None
    compiled, queue, running = 0, list(dtypes), []
    failed = False
    while queue or running:
        while queue and len(running) < jobs:
            command = [sys.executable, "-m", "kda", "warmup", "--dtype", queue.pop(0), "--jobs", "1"]
            # its summary line read from stdout; its notices (stderr) pass through
            running.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True))
        child = running.pop(0)
        out, _ = child.communicate()
        found = _COMPILED.search(out.strip().splitlines()[-1] if out.strip() else "")
        if child.returncode != 0 or found is None:
            print(out, end="")
            failed = True
        else:
            compiled += int(found.group(1))
    after = resource.getrusage(resource.RUSAGE_CHILDREN) if resource else None
    cpu = float("nan")
    if before is not None and after is not None:
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return (None if failed else compiled), cpu


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text}")
    return value


def _warmup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kda warmup", description="Compile every kernel of the CPU backend ahead of time."
    )
    parser.add_argument("--dtype", nargs="+", choices=sorted(TOLERANCE), default=sorted(TOLERANCE))
    parser.add_argument(
        "--jobs",
        type=_positive,
        default=None,
        help="processes compiling side by side, a dtype each (default: one per dtype, at most one per core)",
    )
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kda",
        description=__doc__.splitlines()[0],
        epilog="python -m kda warmup: compile the CPU kernels ahead of time (see its --help)",
    )
    for name, value in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    layout, gate = _option("layout"), _option("gate")  # their values: the table's (every registered law)
    parser.add_argument("--layout", choices=list(layout.choices), default=layout.default)
    parser.add_argument("--gate", choices=list(gate.choices), default=gate.default)
    parser.add_argument("--gva", type=int, default=1, help="value heads per q/k head (HV = H * GVA)")
    parser.add_argument("--varlen", type=int, default=0, help="pack this many sequences into one row (B = 1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["warmup"]:
        return warmup(_warmup_parser().parse_args(argv[1:]))
    return check(_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
