"""How a first call compiles: the backward kernel compiled ahead, beside a first forward that keeps
its boundaries (``kda.cpu._ahead``); the chunk kernels' LLVM options, set only while they compile;
one signature of the matrix product for every layout (``kda.cpu._compile``)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import BACKENDS, ROOT

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="numba or scipy not installed")
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _inputs(T=150, H=2, K=16, V=8, dtype=np.float32, time_major=False, seed=0):
    rng = np.random.default_rng(seed)
    shape = (1, T, H, K) if time_major else (1, H, T, K)
    q = rng.standard_normal(shape).astype(dtype)
    k = rng.standard_normal(shape)
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = rng.standard_normal((*shape[:-1], V)).astype(dtype)
    g = np.log(rng.uniform(0.5, 1.0, shape)).astype(dtype)
    beta = rng.uniform(0, 1, shape[:-1]).astype(dtype)
    do = rng.standard_normal(v.shape).astype(dtype)
    return q, k, v, g, beta, do


@pytest.mark.parametrize("time_major", [False, True], ids=["head_first", "time_major"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_backward_compiled_ahead_is_the_one_the_backward_calls(monkeypatch, dtype, time_major):
    """The signature a forward asks the second process for is the one the backward then compiles
    (or loads) for the same inputs: else the second process works for nothing."""
    import kda
    from kda import cpu
    from kda.cpu import _ahead, _fused, _kernels

    asked = []
    monkeypatch.setattr(cpu, "_AHEAD_ASKED", [])
    ask = lambda kernel, sig, first=(): asked.append((kernel, sig, first))  # noqa: E731
    monkeypatch.setattr(_ahead, "compile_beside", ask)
    monkeypatch.setattr(_ahead, "enabled", lambda: True)
    monkeypatch.setattr(_kernels.backward_heads, "overloads", {})  # as in a fresh process
    q, k, v, g, beta, do = _inputs(dtype=dtype, time_major=time_major)
    layout = "time_major" if time_major else "head_first"
    out = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True, layout=layout)
    monkeypatch.undo()  # the backward's real table of compiled signatures
    assert len(asked) == 1 and asked[0][0] is _kernels.backward_heads
    assert asked[0][2] == _fused.backward_own_helpers(asked[0][1][0].dtype)
    before = set(_kernels.backward_heads.overloads)
    kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do, None, layout=layout)
    used = set(_kernels.backward_heads.overloads)
    assert asked[0][1] in used, (asked[0][1], used - before)


def _kernel_arguments(dtype):
    """Arrays of the types ``forward_heads`` and ``backward_heads`` get for C-contiguous inputs of
    ``dtype``, by their parameters' order (sizes do not matter to their typing)."""
    B, H, T, K, V, NT = 1, 2, 8, 16, 8, 2
    x, y = np.zeros((B, H, T, K), dtype), np.zeros((B, H, T, V), dtype)
    beta, scale, state = np.zeros((B, H, T), dtype), np.ones(1, dtype), np.zeros((B, H, K, V), dtype)
    bounds, screen = np.zeros((NT, B, H, K, V), dtype), np.zeros((0, 2))
    forward = (x, x, y, x, beta, scale, state, 4, True, True, y, bounds, state, screen, 0, 1)
    backward = (x, x, y, x, beta, scale, bounds, y, state, 4, x, x, y, x, beta, state, screen, 0, 1)
    return forward, backward


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_backward_own_helpers_are_the_ones_its_typing_asks_for(monkeypatch, dtype):
    """The helpers the second process compiles before ``backward_heads``
    (``kda.cpu._fused.backward_own_helpers``) are the ones ``backward_heads``' typing asks for,
    with those signatures, and ``forward_heads``' typing asks for none of them (else the two
    processes would wait for each other on them instead of compiling apart)."""
    from numba import typeof
    from numba.core import compiler, typed_passes

    from kda.cpu import _fused

    own = _fused.backward_own_helpers(typeof(np.zeros(1, dtype)).dtype)
    asked = {id(helper): set() for helper, _ in own}

    def recording(helper):
        compile, calls = helper.compile, asked[id(helper)]

        def record(sig):
            calls.add(tuple(sig))
            return compile(sig)

        return record

    for helper, _ in own:
        monkeypatch.setattr(helper, "compile", recording(helper))

    def typing(kernel, args):  # Numba's type inference alone: it compiles (or loads) the callees
        kernel.typingctx.refresh()  # as Numba's compile does first (its registries of functions)
        kernel.targetctx.refresh()
        interp = compiler.run_frontend(kernel.py_func)
        types = tuple(typeof(a) for a in args)
        typed_passes.type_inference_stage(kernel.typingctx, kernel.targetctx, interp, types, None)

    forward, backward = _kernel_arguments(dtype)
    typing(_fused.backward_heads, backward)
    assert [asked[id(helper)] for helper, _ in own] == [{sig} for _, sig in own]
    for calls in asked.values():
        calls.clear()
    typing(_fused.forward_heads, forward)
    assert all(not calls for calls in asked.values()), asked


def test_a_forward_without_boundaries_asks_for_nothing_ahead(monkeypatch):
    import kda
    from kda import cpu
    from kda.cpu import _ahead, _kernels

    asked = []
    monkeypatch.setattr(cpu, "_AHEAD_ASKED", [])
    monkeypatch.setattr(_ahead, "compile_beside", lambda kernel, sig, first=(): asked.append(sig))
    monkeypatch.setattr(_ahead, "enabled", lambda: True)
    monkeypatch.setattr(_kernels.backward_heads, "overloads", {})
    q, k, v, g, beta, _ = _inputs()
    kda.chunk_kda(q, k, v, g, beta)
    assert asked == []


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "inference"])
def test_the_torch_forward_asks_for_its_backward_only_where_autograd_records_it(monkeypatch, grad):
    """``kda.torch.chunk_kda``'s op keeps boundaries always; only a forward that autograd records
    (a backward may follow) asks for the backward ahead: serving (vLLM's prefill) never does."""
    torch = pytest.importorskip("torch")
    import kda.torch as kt
    from kda import cpu
    from kda.cpu import _ahead, _kernels

    asked = []
    monkeypatch.setattr(cpu, "_AHEAD_ASKED", [])
    monkeypatch.setattr(_ahead, "compile_beside", lambda kernel, sig, first=(): asked.append(sig))
    monkeypatch.setattr(_ahead, "enabled", lambda: True)
    monkeypatch.setattr(_kernels.backward_heads, "overloads", {})
    q, k, v, g, beta, _ = (torch.from_numpy(x) for x in _inputs(time_major=True))
    q.requires_grad_(grad)
    kt.chunk_kda(q, k, v, g, beta)
    assert len(asked) == (1 if grad else 0)


def test_ahead_is_off_without_a_cache_or_when_asked(monkeypatch):
    from kda.cpu import _ahead, _compile

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv(_ahead.ENV, "1")
    monkeypatch.setattr(_compile, "CACHING", True)
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    assert _ahead.enabled()
    monkeypatch.setenv(_ahead.ENV, "0")
    assert not _ahead.enabled()
    monkeypatch.setenv(_ahead.ENV, "1")
    monkeypatch.setattr(_compile, "CACHING", False)  # the processes would share nothing
    assert not _ahead.enabled()
    monkeypatch.setattr(_compile, "CACHING", True)
    monkeypatch.setattr(sys, "executable", "/usr/bin/uwsgi")  # not an interpreter to run -m with
    assert not _ahead.enabled()


@pytest.mark.parametrize(
    ("cores", "ahead"), [({0}, False), ({3}, False), ({0, 1}, True), (set(range(16)), True)]
)
def test_ahead_only_where_this_process_may_use_two_cores(monkeypatch, cores, ahead):
    """On one usable core (``taskset -c 0``, a container's one CPU) the two processes would take
    turns on it: the kernels compile in this one alone."""
    from kda.cpu import _ahead, _compile, _internals

    monkeypatch.setenv(_ahead.ENV, "1")
    monkeypatch.setattr(_compile, "CACHING", True)
    monkeypatch.setattr(_internals, "SUPPORTED", True)
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores, raising=False)
    assert _ahead.usable_cores() == len(cores)
    assert _ahead.enabled() == ahead


def test_the_warm_up_compiles_nothing_ahead(monkeypatch):
    """``python -m kda warmup`` compiles every kernel itself (a process per dtype): its forwards
    that keep boundaries ask for no backward in a second process (``_ahead.off``), and the switch
    is on again after it."""
    from kda import __main__ as cli
    from kda import cpu
    from kda.cpu import _ahead, _kernels

    asked = []
    monkeypatch.setenv(_ahead.ENV, "1")
    monkeypatch.setattr(_ahead, "usable_cores", lambda: 2)
    monkeypatch.setattr(cpu, "_AHEAD_ASKED", [])
    monkeypatch.setattr(_ahead, "compile_beside", lambda kernel, sig, first=(): asked.append(sig))
    monkeypatch.setattr(_kernels.backward_heads, "overloads", {})  # as in a fresh process
    assert _ahead.enabled()
    cli._warm_here(["float32"])
    assert asked == [] and cpu._AHEAD_ASKED == [True]  # its first forward with boundaries asked no one
    assert _ahead.enabled()


def _fake_python(tmp_path, body: str) -> str:
    path = tmp_path / "python-fake"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _new_kernel(tmp_path, monkeypatch):
    """A kernel of a module of its own (so that no cache holds it yet) and a signature of it."""
    import importlib

    from numba import types

    name = f"kda_ahead_{tmp_path.name.replace('-', '_')}"
    source = "from kda.cpu._compile import jit\n\n\n@jit(stamp=False)\ndef twice(x):\n    return 2 * x\n"
    source += "\n\n@jit(stamp=False, inner=True)\ndef thrice(x):\n    return 3 * x\n"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name).twice, (types.float64,)


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for Python")
def test_a_failing_second_process_leaves_the_compile_to_this_one(tmp_path, monkeypatch, caplog):
    from kda.cpu import _ahead

    # it reads what to compile, then fails (one that exits before reading can fail the write first)
    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, "cat >/dev/null; exit 3"))
    monkeypatch.setenv(_ahead.ENV, "1")
    monkeypatch.setattr(_ahead, "usable_cores", lambda: 2)
    monkeypatch.setattr(_ahead, "_ASKED", set())
    monkeypatch.setattr(_ahead, "_RUNNING", {})
    kernel, sig = _new_kernel(tmp_path, monkeypatch)
    with caplog.at_level(logging.INFO, logger="kda.cpu"):
        assert _ahead.compile_beside(kernel, sig)
        assert not _ahead.compile_beside(kernel, sig)  # once a process
        kernel.compile(sig)  # waits for the second process, then compiles here
    assert sig in kernel.overloads and kernel(2.5) == 5.0
    assert any("ended with 3" in r.getMessage() for r in caplog.records), caplog.text
    assert _ahead._RUNNING[id(kernel)] == []


def test_the_second_process_compiles_the_functions_asked_first_then_the_kernel(tmp_path, monkeypatch, caplog):
    """``compile_beside``'s ``first`` (here a function the kernel does not call, so that only the
    request can have compiled it) and the kernel both land in the cache, compiled by the second
    process (nothing compiled in this one)."""
    import importlib

    from kda.cpu import _ahead

    monkeypatch.setenv(_ahead.ENV, "1")
    monkeypatch.setattr(_ahead, "usable_cores", lambda: 2)
    monkeypatch.setattr(_ahead, "_ASKED", set())
    monkeypatch.setattr(_ahead, "_RUNNING", {})
    kernel, sig = _new_kernel(tmp_path, monkeypatch)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    other = importlib.import_module(kernel.py_func.__module__).thrice
    assert not _ahead._cached(kernel, sig) and not _ahead._cached(other, sig)
    with caplog.at_level(logging.INFO, logger="kda.cpu"):
        assert _ahead.compile_beside(kernel, sig, first=[(other, sig)])
        _ahead.wait(kernel)
    assert "ended with" not in caplog.text, caplog.text
    assert _ahead._cached(other, sig) and _ahead._cached(kernel, sig)
    assert not kernel.overloads and not other.overloads


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for Python")
def test_second_processes_still_running_at_exit_are_stopped(tmp_path, monkeypatch):
    from kda.cpu import _ahead

    monkeypatch.setattr(sys, "executable", _fake_python(tmp_path, "exec sleep 60"))
    monkeypatch.setenv(_ahead.ENV, "1")
    monkeypatch.setattr(_ahead, "usable_cores", lambda: 2)
    monkeypatch.setattr(_ahead, "_ASKED", set())
    monkeypatch.setattr(_ahead, "_RUNNING", {})
    kernel, sig = _new_kernel(tmp_path, monkeypatch)
    assert _ahead.compile_beside(kernel, sig)
    (process,) = _ahead._RUNNING[id(kernel)]
    started = time.perf_counter()
    _ahead._stop()
    assert process.poll() is not None and time.perf_counter() - started < 10
    assert _ahead._RUNNING == {}


# a child process's list of the functions it compiles (Numba's compile events)
_LISTEN = r"""
from numba.core import event
compiled = []
class Listen(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__name__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Listen())
"""

_COLD = (
    _LISTEN
    + r"""
import json, sys
import numpy as np
import kda
rng = np.random.default_rng(0)
B, H, T, K, V = 1, 2, 80, 16, 16
q, k, g = (rng.standard_normal((B, H, T, K)).astype(np.float32) for _ in range(3))
k /= np.linalg.norm(k, axis=-1, keepdims=True)
g = -np.abs(g) * 0.1
v, do = (rng.standard_normal((B, H, T, V)).astype(np.float32) for _ in range(2))
beta = rng.uniform(0, 1, (B, H, T)).astype(np.float32)
out = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True)
grads = kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do, None)
weights = lambda x: np.arange(x.size).reshape(x.shape)
bits = [float(np.sum(x.astype(np.float64) * weights(x))) for x in (out.output, *grads) if x is not None]
print(json.dumps({"compiled": compiled, "bits": bits}))
"""
)


@pytest.mark.slow  # two cold forward-and-backward compilations: about 25 s of one core
@pytest.mark.skipif(_CORES < 2, reason="a second process compiles only beside a second usable core")
def test_a_cold_forward_compiles_its_backward_in_a_second_process(tmp_path):
    """Into an empty cache, a forward that keeps its boundaries has the backward kernel compiled in
    a second process: this process then loads it (compiles no ``backward_heads``) and gets the
    same results as a process that compiled it itself (``KDA_COMPILE_AHEAD=0``); the first
    compilation's notice says so."""
    import json

    def run(cache: str, ahead: str) -> dict:
        env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / cache), "PYTHONPATH": str(ROOT)}
        env["KDA_COMPILE_AHEAD"] = ahead
        command = [sys.executable, "-c", _COLD]
        r = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
        return {**json.loads(r.stdout.strip().splitlines()[-1]), "notice": r.stderr}

    ahead, alone = run("ahead", "1"), run("alone", "0")
    beside = "backward_heads in a second process beside this one"
    assert beside in ahead["notice"] and beside not in alone["notice"], (ahead["notice"], alone["notice"])
    assert "forward_heads" in ahead["compiled"] and "backward_heads" not in ahead["compiled"], ahead
    assert "forward_heads" in alone["compiled"] and "backward_heads" in alone["compiled"], alone
    assert ahead["bits"] == alone["bits"]


def test_the_matrix_product_compiles_one_signature_for_every_layout():
    """``_mm`` (BLAS takes the row strides) is compiled once per dtype, for ``A``-layout arrays and
    flags that are not constants, whatever the layouts and constants its callers pass."""
    from numba import types
    from numba.core.registry import cpu_target

    from kda.cpu import _products

    c, a = types.Array(types.float32, 2, "C"), types.Array(types.float32, 2, "A")
    yes, no = types.literal(True), types.literal(False)
    f64 = types.float64
    calls = [(c, no, c, yes, a, f64), (a, yes, c, no, c, f64), (c, yes, c, yes, c, f64)]
    for args in calls:
        template, _, _, _ = _products._mm.get_call_template(args, {})
        sig = template(cpu_target.typing_context).apply(args, {})
        assert sig is not None and sig.args == (a, types.boolean, a, types.boolean, a, types.float64), sig
    float32 = [s for s in _products._mm.overloads if s[0].dtype == types.float32]
    assert float32 == [(a, types.boolean, a, types.boolean, a, types.float64)]


def test_the_chunk_kernels_llvm_options_are_set_only_while_they_compile(monkeypatch):
    """LLVM's options are the process's: a chunk kernel's compilation sets its own and sets them
    back after, also when the compilation fails; the decode kernel compiles with LLVM's defaults."""
    from numba import types

    from kda.cpu import _compile, _decode_kernels, _kernels

    calls = []
    monkeypatch.setattr(_compile.llvm, "set_option", lambda name, option: calls.append(option))
    with pytest.raises(Exception):  # noqa: B017 - Numba's typing error: a kernel of 16 arguments given 1
        _kernels.forward_heads.compile((types.int64,))
    assert calls == [*_compile._CODEGEN_OPTIONS, *_compile._CODEGEN_DEFAULTS]
    calls.clear()
    _decode_kernels._finite.compile((types.Array(types.float64, 1, "C"),))
    assert calls == []


_WAITER = (
    _LISTEN
    + r"""
import importlib, sys
twice = importlib.import_module(sys.argv[1]).twice
print(twice(2.5), compiled)
"""
)


@pytest.mark.skipif(sys.platform == "win32", reason="fcntl locks")
def test_a_process_waits_for_another_compiling_the_same_function_and_loads_it(tmp_path, monkeypatch):
    """While one process compiles a function (holding its ``.compiling`` lock in the cache), another
    that needs it waits, then loads what the first saved instead of compiling it again."""
    import fcntl

    kernel, sig = _new_kernel(tmp_path, monkeypatch)
    from kda.cpu import _cache

    index = kernel._cache._cache_file
    path = _cache.compiling_lock(os.path.join(index._cache_path, index._index_name), sig)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # this process "is compiling" it
        command = [sys.executable, "-c", _WAITER, kernel.py_func.__module__]
        waiter = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3.0)
        assert waiter.poll() is None, waiter.communicate()  # waiting for the lock
        type(kernel).compile(kernel, sig)  # compiled and saved here (Numba's own compile: no lock)
    finally:
        os.close(fd)
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, err[-4000:]
    assert out.split() == ["5.0", "[]"], out  # loaded from the cache: nothing compiled
