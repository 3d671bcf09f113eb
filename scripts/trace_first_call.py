"""Where a cold first call's time goes: the compilations and waits of both processes on one time line.

    python scripts/trace_first_call.py [--T 256] [--all] [--ahead 0|1]

Runs the README's kind of call (``B=1 H=4 K=V=64`` float32, ``T`` steps: ``kda.chunk_kda(...,
save_boundaries=True)`` then ``kda.chunk_kda_backward``) in a fresh process with an empty Numba
cache. Every Python process it starts (the call's, and the second process that compiles the
backward beside the forward, ``kda/cpu/_ahead.py``) loads a ``sitecustomize`` from a temporary
directory that records, in one file: Numba's ``numba:compile`` events (a function's compilation
starts, ``S``, and ends, ``E``; none for one loaded from the cache) and every wait of more than
50 ms for one of ``kda.cpu._compile``'s lock files (``W``, at the wait's end: another process
compiling that signature, or saving to the cache). The call's own marks (``M``) give its start
and the end of the forward and of the backward. Printed: seconds from the call's start, one
column per process; by default the compilations of the kernels and of the functions they call
directly (``--all``: every level, Numba's own implementations too).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

# loaded by every Python process started with the trace's directory on PYTHONPATH: records into
# KDA_TRACE_FILE, hooking kda.cpu._compile when it is imported (so that nothing is imported early)
SITECUSTOMIZE = r"""
import os, sys, time

_FILE = os.environ.get("KDA_TRACE_FILE")


def _write(kind, what):
    with open(_FILE, "a") as f:
        f.write(f"{os.getpid()} {time.time():.4f} {kind} {what}\n")


def _hook(compile_module):
    import contextlib

    from numba.core import event

    class Listen(event.Listener):
        def on_start(self, ev):
            _write("S", _name(ev))

        def on_end(self, ev):
            _write("E", _name(ev))

    def _name(ev):
        d = ev.data.get("dispatcher")
        return getattr(getattr(d, "py_func", None), "__qualname__", None) or type(d).__name__

    event.register("numba:compile", Listen())
    locked = compile_module._locked

    @contextlib.contextmanager
    def timed(path, exclusive, wait_s=None):
        started = time.time()
        with locked(path, exclusive, wait_s):
            waited = time.time() - started
            if waited > 0.05:
                _write("W", f"{os.path.basename(path)[:48]} {waited:.2f}s")
            yield

    compile_module._locked = timed


class _Finder:
    def find_spec(self, name, path, target=None):
        if name != "kda.cpu._compile":
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

CALL = r"""
import os, time
import numpy as np

def mark(what, t):
    with open(os.environ["KDA_TRACE_FILE"], "a") as f:
        f.write(f"{os.getpid()} {t:.4f} M {what}\n")

import kda
T = int(os.environ["KDA_TRACE_T"])
rng = np.random.default_rng(0)
B, H, K, V = 1, 4, 64, 64
q = rng.standard_normal((B, H, T, K)).astype(np.float32)
k = rng.standard_normal((B, H, T, K))
k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
v = rng.standard_normal((B, H, T, V)).astype(np.float32)
g = np.log(rng.uniform(0.5, 1.0, (B, H, T, K))).astype(np.float32)
beta = rng.uniform(0, 1, (B, H, T)).astype(np.float32)
do = rng.standard_normal((B, H, T, V)).astype(np.float32)
t0 = time.time()
out = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True)
t1 = time.time()
kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do, None)
t2 = time.time()
mark("call", t0)
mark("forward-returned", t1)
mark("backward-returned", t2)
"""

WIDTH = 44  # characters per process column


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=256)
    p.add_argument("--all", action="store_true", help="every level of compilation, Numba's own too")
    p.add_argument("--ahead", default="1", help="KDA_COMPILE_AHEAD for the call (0: one process)")
    args = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE)
        trace = os.path.join(tmp, "trace")
        env = {**os.environ, "KDA_TRACE_FILE": trace, "KDA_TRACE_T": str(args.T)}
        env.update(NUMBA_CACHE_DIR=os.path.join(tmp, "cache"), KDA_COMPILE_AHEAD=args.ahead)
        env["PYTHONPATH"] = os.pathsep.join([tmp, here, *filter(None, [os.environ.get("PYTHONPATH")])])
        subprocess.run([sys.executable, "-c", CALL], env=env, check=True, stderr=subprocess.DEVNULL)
        with open(trace) as f:
            rows = [line.rstrip("\n").split(" ", 3) for line in f]
    rows.sort(key=lambda r: float(r[1]))
    start = next(float(t) for _, t, kind, what in rows if kind == "M" and what == "call")
    pids = list(dict.fromkeys(pid for pid, *_ in rows))
    legend = "S/E: a compilation starts/ends, W: waited for a lock"
    print(f"# {len(pids)} process(es); seconds from the call; {legend}")
    depth: dict[str, int] = {}
    for pid, t, kind, what in rows:
        level = depth.get(pid, 0)
        if kind == "S":
            depth[pid] = level + 1
        elif kind == "E":
            depth[pid] = level = level - 1
        shown = args.all or kind in "MW" or (level <= 1 and not what.startswith(("ol_", "_ol_")))
        if shown:
            column = " " * WIDTH * pids.index(pid)
            print(f"{column}{float(t) - start:6.2f} {kind} {'  ' * level if kind in 'SE' else ''}{what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
