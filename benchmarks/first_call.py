"""The first call in a fresh process: a cold Numba cache against a warm one.

    python -m benchmarks.first_call [--rounds N] [--T 256] [--top 12]

Each round runs the README's kind of call (``B=1 H=4 K=V=64`` float32, ``T`` steps:
``kda.chunk_kda(..., save_boundaries=True)`` then ``kda.chunk_kda_backward``) in a fresh process
with an empty cache (a new ``NUMBA_CACHE_DIR``), then in a second process on that cache. Each
process reports the forward's and backward's wall time and this process's CPU time (compiling runs
on one core, so CPU time is the figure that other work on the machine disturbs least) and the
``numba:compile`` events (Numba's own: one per function compiled, none for one loaded from the
cache). A cold forward that keeps its boundaries compiles the backward kernel in a second process
beside it (``kda/cpu/_ahead.py``): that process's CPU time is reported beside this one's. The
first round runs the cold call once more in one process (``KDA_COMPILE_AHEAD=0``) and, for that
run, lists the compiled functions that took longest, their own time
without the functions they compiled in turn, and where the compile's time goes: LLVM (the time
under Numba's LLVM lock: optimising each compiled function's final module and emitting its machine
code) against Numba's own typing and lowering, and how much LLVM code the emitted modules hold
against the functions' own (Numba links every callee's module into its caller's; the kernels'
helpers are inner functions, emitted only there). Then ``python -m kda warmup`` into an empty
cache (one process per dtype, side by side).

    python -m benchmarks.first_call --trace [--T 256] [--every] [--one-process]

instead runs one cold call and prints where its time goes in each process, on one time line: the
functions each compiles and when, and how long each waited for the other (:func:`trace`).

    python -m benchmarks.first_call --alternate [--rounds N] [--cores 0]

instead runs, in each round, the cold call as it is and the cold call in one process
(``KDA_COMPILE_AHEAD=0``), each with an empty cache, the order swapped every other round (so that a
drift of the machine's speed falls on both). ``--cores`` (a list such as ``0`` or ``0,1``) runs every
child process on those cores only, as ``taskset -c`` would: ``--cores 0`` is a machine with one
usable core (the processes that the call starts inherit it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
c0, w0 = time.process_time(), time.perf_counter()
import numpy as np
from numba.core import event

events, stack = [], []

class Listen(event.Listener):
    def on_start(self, ev):
        stack.append((time.process_time(), []))

    def on_end(self, ev):
        c, children = stack.pop()
        spent = time.process_time() - c
        d = ev.data["dispatcher"]
        name = getattr(getattr(d, "py_func", None), "__qualname__", None) or str(d)
        events.append({"name": name, "cpu": spent, "own": spent - sum(children), "depth": len(stack)})
        if stack:
            stack[-1][1].append(spent)

class LLVM(event.Listener):
    # the time spent inside LLVM (llvmlite holds Numba's LLVM lock around every call into it):
    # optimising each function's final module and emitting its machine code
    depth, started, spent = 0, 0.0, 0.0

    def on_start(self, ev):
        if LLVM.depth == 0:
            LLVM.started = time.process_time()
        LLVM.depth += 1

    def on_end(self, ev):
        LLVM.depth -= 1
        if LLVM.depth == 0:
            LLVM.spent += time.process_time() - LLVM.started

event.register("numba:compile", Listen())
event.register("numba:llvm_lock", LLVM())
import kda

T = int(sys.argv[1])
rng = np.random.default_rng(0)
B, H, K, V = 1, 4, 64, 64
q = rng.standard_normal((B, H, T, K)).astype(np.float32)
k = rng.standard_normal((B, H, T, K))
k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
v = rng.standard_normal((B, H, T, V)).astype(np.float32)
g = np.log(rng.uniform(0.5, 1.0, (B, H, T, K))).astype(np.float32)
beta = rng.uniform(0, 1, (B, H, T)).astype(np.float32)
do = rng.standard_normal((B, H, T, V)).astype(np.float32)
LLVM.spent = 0.0
c1, w1, u1 = time.process_time(), time.perf_counter(), time.time()
out = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True)
c2, w2, u2 = time.process_time(), time.perf_counter(), time.time()
kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do, None)
c3, w3, u3 = time.process_time(), time.perf_counter(), time.time()
import os
if os.environ.get("KDA_TRACE_FILE"):  # --trace: the call's marks on the trace's time line
    with open(os.environ["KDA_TRACE_FILE"], "a") as f:
        for what, t in (("call", u1), ("forward-returned", u2), ("backward-returned", u3)):
            f.write(f"{os.getpid()} {t:.4f} M {what}\n")

def instructions(module, name=None):
    return sum(1 for f in module.functions if name is None or f.name == name
               for b in f.blocks for i in b.instructions)

# each compiled function's final LLVM module holds its own code and a copy of every function it
# calls (Numba links the callees' modules in, then optimises and emits the whole module); inner
# functions (kda.cpu._compile) are linked into their callers and never emitted on their own
own = emitted = entry = 0
import numba
from kda.cpu import _compile, _kernels  # the entry points (the backend calls these from Python)
entries = {id(getattr(_kernels, name)) for name in _kernels.__all__}
dispatchers = {id(v): v for name, module in list(sys.modules.items()) if name.startswith("kda.cpu")
               for v in vars(module).values() if isinstance(v, numba.core.registry.CPUDispatcher)}
for d in dispatchers.values():
    for cres in d.overloads.values():
        final = getattr(cres.library, "_final_module", None)
        if final is not None and events:
            own += instructions(final, cres.fndesc.llvm_func_name)
            if not _compile.is_inner(d):
                emitted += instructions(final)
            if id(d) in entries:
                entry += instructions(final)
import resource  # the second process that compiled the backward ahead, if one ran (waited for)
children = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"llvm_cpu": LLVM.spent, "ahead_cpu": children.ru_utime + children.ru_stime,
    "own_instructions": own, "emitted_instructions": emitted,
    "entry_instructions": entry,
    "import_wall": w1 - w0, "forward_wall": w2 - w1, "forward_cpu": c2 - c1,
    "backward_wall": w3 - w2, "backward_cpu": c3 - c2, "compiled": len(events),
    "compile_cpu": sum(e["cpu"] for e in events if e["depth"] == 0), "events": events,
}))
"""


def processor() -> str:
    """The processor's model name, whether it has AVX-512, and the cores this process may use."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = info.get("model name", "unknown processor")
    known = "cpu family" in info and "model" in info
    family = f"family {info['cpu family']} model {info['model']}, " if known else ""
    vector = "AVX-512" if "avx512f" in info.get("flags", "").split() else "no AVX-512"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} ({family}{vector}), {cores} cores"


# the cores every child process runs on (--cores; None: those this process may use)
CORES: set[int] | None = None


def _pin() -> None:
    """In a child process before it runs: its cores, :data:`CORES`."""
    if CORES is not None:
        os.sched_setaffinity(0, CORES)


def _child(T: int, cache: str, tree: str, ahead: bool = True, trace_dir: str = "") -> dict:
    """One run of :data:`CHILD` on ``cache`` from ``tree`` (on :data:`CORES`); with ``trace_dir``,
    that directory first on its path (its ``sitecustomize``) and ``KDA_TRACE_FILE`` there
    (:func:`trace`)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": cache, "KDA_COMPILE_AHEAD": "1" if ahead else "0"}
    if trace_dir:
        env["KDA_TRACE_FILE"] = os.path.join(trace_dir, "trace")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [trace_dir, tree, env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", CHILD, str(T)]
    r = subprocess.run(
        command, env=env, cwd=tree, capture_output=True, text=True, check=True, preexec_fn=_pin
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


# --trace: loaded by every Python process started with its directory first on PYTHONPATH (the
# call's, and the second process compiling the backward beside the forward): records Numba's
# compile events and the waits for kda.cpu._cache's lock files into KDA_TRACE_FILE, hooking
# kda.cpu._cache as it is imported (so that nothing is imported earlier than it would be)
SITECUSTOMIZE = r"""
import os, sys, time

_FILE = os.environ.get("KDA_TRACE_FILE")


def _write(kind, what):
    with open(_FILE, "a") as f:
        f.write(f"{os.getpid()} {time.time():.4f} {kind} {what}\n")


def _hook(cache_module):
    import contextlib

    from numba.core import event

    def name(ev):
        d = ev.data.get("dispatcher")
        return getattr(getattr(d, "py_func", None), "__qualname__", None) or type(d).__name__

    class Listen(event.Listener):
        def on_start(self, ev):
            _write("S", name(ev))

        def on_end(self, ev):
            _write("E", name(ev))

    event.register("numba:compile", Listen())
    locked = cache_module.locked

    @contextlib.contextmanager
    def timed(path, exclusive, wait_s=None):
        started = time.time()
        with locked(path, exclusive, wait_s):
            waited = time.time() - started
            if waited > 0.05:
                _write("W", f"{os.path.basename(path)[:48]} {waited:.2f} s")
            yield

    cache_module.locked = timed


class _Finder:
    def find_spec(self, name, path, target=None):
        if name != "kda.cpu._cache":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _hook(module)

        spec.loader.exec_module = exec_module
        return spec


if _FILE:
    sys.meta_path.insert(0, _Finder())
"""


def trace(T: int, tree: str, ahead: bool, every: bool) -> None:
    """Print a cold call's compilations and lock waits in every process on one time line: seconds
    from the call's start, a column per process; ``S``/``E`` a compilation's start and end (none for
    a function loaded from the cache), ``W`` a wait of more than 50 ms for a lock file (printed
    at its end: another process compiling that signature, or saving to the cache), ``M`` the
    call's start and the forward's and backward's returns. The kernels and the functions they call
    directly, or with ``every`` every level (Numba's own implementations too)."""
    with tempfile.TemporaryDirectory(prefix="kda-first-call-") as tmp:
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE)
        _child(T, os.path.join(tmp, "cache"), tree, ahead, trace_dir=tmp)
        with open(os.path.join(tmp, "trace")) as f:
            rows = sorted((line.rstrip("\n").split(" ", 3) for line in f), key=lambda r: float(r[1]))
    start = next(float(t) for _, t, kind, what in rows if (kind, what) == ("M", "call"))
    pids = list(dict.fromkeys(pid for pid, *_ in rows))
    legend = "S/E: a compilation starts/ends, W: a wait for a lock"
    print(f"# {len(pids)} processes; seconds from the call; {legend}")
    depth: dict[str, int] = {}
    for pid, t, kind, what in rows:
        level = depth.get(pid, 0)
        if kind == "S":
            depth[pid] = level + 1
        elif kind == "E":
            depth[pid] = level = level - 1
        if every or kind in "MW" or (level <= 1 and not what.startswith(("ol_", "_ol_"))):
            indent = "  " * level if kind in "SE" else ""
            print(f"{' ' * 44 * pids.index(pid)}{float(t) - start:6.2f} {kind} {indent}{what}")


def _line(label: str, r: dict) -> str:
    total_wall = r["forward_wall"] + r["backward_wall"]
    total_cpu = r["forward_cpu"] + r["backward_cpu"]
    return (
        f"{label:<6} forward {r['forward_wall']:6.2f} s ({r['forward_cpu']:6.2f} CPU)  backward "
        f"{r['backward_wall']:6.2f} s ({r['backward_cpu']:6.2f} CPU)  both {total_wall:6.2f} s "
        f"({total_cpu:6.2f} CPU)  compiled {r['compiled']:3d} functions  import {r['import_wall']:.2f} s"
        + (f"  + {r['ahead_cpu']:.2f} CPU s in a second process" if r.get("ahead_cpu") else "")
    )


def alternate(rounds: int, T: int, tree: str) -> None:
    """Each round: the cold call as it is and in one process (``KDA_COMPILE_AHEAD=0``), each into an
    empty cache, the one-process run first in every other round; then each one's range."""
    runs: dict[str, list[float]] = {"as is": [], "KDA_COMPILE_AHEAD=0": []}
    for n in range(rounds):
        order = [True, False] if n % 2 == 0 else [False, True]
        print(f"round {n + 1}")
        for ahead in order:
            label = "as is" if ahead else "KDA_COMPILE_AHEAD=0"
            with tempfile.TemporaryDirectory(prefix="kda-first-call-") as cache:
                r = _child(T, cache, tree, ahead=ahead)
            runs[label].append(r["forward_wall"] + r["backward_wall"])
            print(f"  {label:<20} {_line('cold', r)}")
    for label, walls in runs.items():
        print(f"{label:<20} forward + backward {min(walls):.2f}-{max(walls):.2f} s over {len(walls)} rounds")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_call", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--T", type=int, default=256)
    p.add_argument("--top", type=int, default=12, help="list this many compiled functions (first round)")
    p.add_argument("--no-warmup", action="store_true", help="skip timing python -m kda warmup")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p.add_argument("--tree", default=here, help="the kda source tree to run (default: this repository)")
    p.add_argument(
        "--trace", action="store_true", help="one cold call's compilations, every process on one time line"
    )
    p.add_argument("--every", action="store_true", help="with --trace: every level of compilation")
    p.add_argument("--one-process", action="store_true", help="with --trace: KDA_COMPILE_AHEAD=0")
    p.add_argument(
        "--alternate", action="store_true", help="each round: the cold call as is, then KDA_COMPILE_AHEAD=0"
    )
    p.add_argument("--cores", help="run the child processes on these cores only (e.g. 0, or 0,1)")
    args = p.parse_args(argv)
    if args.cores is not None:
        global CORES
        CORES = {int(c) for c in args.cores.split(",")}
    if args.trace:
        trace(args.T, args.tree, not args.one_process, args.every)
        return 0
    print(f"# {processor()}; python -m benchmarks.first_call {' '.join(argv or sys.argv[1:])}".rstrip())
    print(f"# B=1 H=4 T={args.T} K=V=64 float32: chunk_kda(save_boundaries=True) + chunk_kda_backward")
    if CORES is not None:
        print(f"# the child processes on cores {sorted(CORES)}")
    if args.alternate:
        alternate(args.rounds, args.T, args.tree)
        return 0
    for n in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="kda-first-call-") as cache:
            load = os.getloadavg()[0]
            cold = _child(args.T, cache, args.tree)
            warm = _child(args.T, cache, args.tree)
        print(f"round {n + 1}, load average before {load:.2f}")
        print(_line("cold", cold))
        print(_line("warm", warm))
        if n == 0:
            # the same in one process (KDA_COMPILE_AHEAD=0): where the whole compile's time goes
            with tempfile.TemporaryDirectory(prefix="kda-first-call-") as cache:
                load = os.getloadavg()[0]
                cold = _child(args.T, cache, args.tree, ahead=False)
            print(f"one process (KDA_COMPILE_AHEAD=0), load average before {load:.2f}")
            print(_line("cold", cold))
            own: dict[str, list[float]] = {}
            for e in cold["events"]:
                own.setdefault(e["name"], []).append(e["own"])
            top = sorted(own.items(), key=lambda kv: -sum(kv[1]))[: args.top]
            print(
                f"  compiled functions, own CPU s (without what they compile in turn), of {cold['compiled']}:"
            )
            for name, spent in top:
                print(
                    f"    {name:<48} {sum(spent):6.2f}"
                    + (f" ({len(spent)} signatures)" if len(spent) > 1 else "")
                )
            if cold["emitted_instructions"]:
                llvm, per = cold["llvm_cpu"], cold["llvm_cpu"] / cold["emitted_instructions"]
                print(
                    f"  of the compile's {cold['compile_cpu']:.2f} CPU s, {llvm:.2f} s in LLVM (optimising"
                    " each compiled function's final module, emitting its machine code),"
                    f" {cold['compile_cpu'] - llvm:.2f} s in Numba's typing and lowering\n"
                    f"  the emitted modules hold {cold['emitted_instructions']} LLVM instructions"
                    f" ({cold['own_instructions']} of the functions' own code; each caller's module holds"
                    " its callees too), the entry kernels' modules (the code the call runs)"
                    f" {cold['entry_instructions']}: {cold['entry_instructions'] * per:.2f} s of LLVM"
                    f" at {per * 1e6:.0f} us an instruction"
                )
    if not args.no_warmup:
        with tempfile.TemporaryDirectory(prefix="kda-first-call-") as cache:
            env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": args.tree}
            start, load = time.perf_counter(), os.getloadavg()[0]
            command = [sys.executable, "-m", "kda", "warmup"]
            r = subprocess.run(
                command, env=env, cwd=args.tree, capture_output=True, text=True, preexec_fn=_pin
            )
            spent = time.perf_counter() - start
            before = f"load average before {load:.2f}"
            print(f"python -m kda warmup, empty cache, {before}: {spent:.1f} s; {r.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
