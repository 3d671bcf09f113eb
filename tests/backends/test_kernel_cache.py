"""The CPU kernels' Numba cache across their modules: a kernel that calls compiled helpers of
another module is recompiled when that module changes (Numba alone checks only the kernel's own
file), and loaded from the cache when nothing changed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers import BACKENDS, ROOT

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="numba or scipy not installed")

_RUN = """
import numpy as np
import kda
from kda.cpu._kernels import forward_heads
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, 20, 4), dtype=np.float32) for _ in range(3))
g = -rng.uniform(0, 1, (1, 1, 20, 4)).astype(np.float32)
beta = rng.uniform(0, 1, (1, 1, 20)).astype(np.float32)
kda.chunk_kda(q, k, v, g, beta, chunk_size=16, backend="cpu")
stats = forward_heads.stats
print("hits", sum(stats.cache_hits.values()), "misses", sum(stats.cache_misses.values()))
"""


def test_source_stamp_covers_every_kernel_module(tmp_path):
    """The stamp is a hash of all kernel modules: it changes when any one of them changes."""
    from kda.cpu import _compile

    here = ROOT / "kda" / "cpu"
    for name in _compile.KERNEL_FILES:
        shutil.copy(here / name, tmp_path / name)
    before = _compile.source_stamp(str(tmp_path))
    assert before == _compile.SOURCE_STAMP
    for name in _compile.KERNEL_FILES:
        with open(tmp_path / name, "a") as f:
            f.write("\n")
        after = _compile.source_stamp(str(tmp_path))
        assert after != before, name
        before = after


def test_every_cached_function_is_stamped_with_how_it_is_compiled():
    """The kernels carry :data:`SOURCE_STAMP` (every kernel module, the modules that say how they
    compile among them), the functions of a module that calls no compiled function of another
    :data:`COMPILE_STAMP` (those modules alone): a change to how they are compiled recompiles them
    too."""
    from kda.cpu import _compile, _decode_kernels, _kernels

    if not _compile.CACHING:
        pytest.skip("no cache directory is writable here")
    assert set(_compile.COMPILE_FILES) <= set(_compile.KERNEL_FILES)
    assert _compile.COMPILE_STAMP == _compile.source_stamp(str(ROOT / "kda" / "cpu"), _compile.COMPILE_FILES)
    for kernel, stamp in (
        (_kernels.forward_heads, _compile.SOURCE_STAMP),
        (_decode_kernels.decode, _compile.COMPILE_STAMP),
    ):
        assert kernel._cache._cache_file._source_stamp[0] == stamp


@pytest.mark.slow
def test_a_changed_helper_module_recompiles_the_kernels_that_call_it(tmp_path):
    """forward_heads (``_fused.py``) calls ``_mm`` (``_products.py``): a copy of the package
    compiled into a fresh cache, run again (loaded from the cache), then run after
    ``_products.py`` changed (compiled again)."""
    shutil.copytree(ROOT / "kda", tmp_path / "kda", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path)}

    def run() -> str:
        r = subprocess.run(
            [sys.executable, "-c", _RUN], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().splitlines()[-1]

    assert run() == "hits 0 misses 1"
    assert run() == "hits 1 misses 0"
    with open(tmp_path / "kda" / "cpu" / "_products.py", "a") as f:
        f.write("\n# changed\n")
    assert run() == "hits 0 misses 1"


def test_fallback_dir_is_private_to_its_user(tmp_path):
    """kda's cache where Numba finds none: ``kda-numba-<uid>`` in the given directory, created
    private (``0700``); refused where another user could write it or it is a link (a cache entry is
    a pickle: loading one written by someone else would run their code)."""
    from kda.cpu import _cache

    path = _cache.fallback_dir(str(tmp_path))
    assert path == str(tmp_path / f"kda-numba-{os.getuid()}")
    assert os.stat(path).st_mode & 0o777 == 0o700
    assert _cache.fallback_dir(str(tmp_path)) == path  # found again
    os.chmod(path, 0o777)
    assert _cache.fallback_dir(str(tmp_path)) is None  # writable by others
    os.chmod(path, 0o700)
    other = tmp_path / "other"
    other.mkdir()
    link = other / f"kda-numba-{os.getuid()}"
    link.symlink_to(path)
    assert _cache.fallback_dir(str(other)) is None  # a link, not a directory
    assert _cache.fallback_dir("/proc/kda-no-cache") is None  # not creatable


_FALLBACK = """
import sys, tempfile
import numba.core.dispatcher as d
def refuse(self):
    raise RuntimeError("cannot cache function: no locator available")
d.Dispatcher.enable_caching = refuse  # Numba finds no cache directory of its own
tempfile.tempdir = sys.argv[1]
from numba.core import event
compiled = []
class Count(event.Listener):
    def on_start(self, ev):
        pass
    def on_end(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__module__)
event.register("numba:compile", Count())
import numpy as np, kda
from kda.cpu import _compile
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
g = -rng.uniform(0, 1, (1, 2, 5, 4)); beta = rng.uniform(0, 1, (1, 2, 5))
out = kda.recurrent_kda(q, k, v, g, beta, backend="cpu").output
kda.recurrent_kda_backward(q, k, v, g, beta, v, None, backend="cpu")  # another kernel
print("cache", _compile.CACHE)
print("compiled", sum(m.startswith("kda.") for m in compiled), out.tobytes().hex()[:32])
"""


def test_without_a_numba_cache_directory_a_second_process_loads_kdas_fallback_cache(tmp_path):
    """Numba finds no cache directory (a read-only install, no writable home): the first process
    compiles into kda's per-user directory in the temporary directory, saying so once on the
    ``kda.cpu`` logger (two kernels compiled, one notice), the second compiles nothing (no
    ``numba:compile`` event of a kda function), says nothing and computes the same bits."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NUMBA_CACHE_DIR", None)

    notices = []

    def run() -> list[str]:
        command = [sys.executable, "-c", _FALLBACK, str(tmp_path)]
        r = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        notices.append(r.stderr.count("kda: compiling the CPU kernels"))
        return r.stdout.splitlines()[-2:]

    first, second = run(), run()
    assert notices == [1, 0], notices  # the first compilation announced once; none, none
    assert first[0] == f"cache {tmp_path / f'kda-numba-{os.getuid()}'}", first
    assert int(first[1].split()[1]) > 0, first  # compiled there
    assert second[0] == first[0]
    assert second[1].split()[1] == "0", second  # loaded: nothing compiled
    assert second[1].split()[2] == first[1].split()[2]


_LOADS = """
import numpy as np, kda
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
g = -rng.uniform(0, 1, (1, 2, 5, 4)); beta = rng.uniform(0, 1, (1, 2, 5))
print("imported", flush=True)
kda.recurrent_kda(q, k, v, g, beta, backend="cpu")
print("done", flush=True)
"""


def test_a_process_waits_to_load_while_the_cache_is_being_written(tmp_path):
    """Saves and loads of cache entries are atomic among processes (a lock file in the cache
    directory): while another process holds the lock as a save does, a process that needs a
    cached kernel waits for it, then loads it."""
    import fcntl
    import glob
    import time

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _LOADS], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr[-4000:]  # compiled and saved
    locks = glob.glob(str(tmp_path / "cache" / "**" / "kda-cache.lock"), recursive=True)
    assert locks, "no lock file in the cache"
    files = [open(path) for path in locks]  # held until released below
    try:
        for f in files:
            fcntl.flock(f, fcntl.LOCK_EX)  # as a process saving an entry holds it
        child = subprocess.Popen(
            [sys.executable, "-c", _LOADS], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert child.stdout.readline().strip() == "imported"
        time.sleep(3)
        assert child.poll() is None, "loaded a cache entry while the cache was locked"
    finally:
        for f in files:
            f.close()  # releases the lock
    out, err = child.communicate(timeout=600)
    assert child.returncode == 0 and out.strip() == "done", err[-4000:]


_AFTER_WARMUP = """
from numba.core import event
compiled = []
class Count(event.Listener):
    def on_start(self, ev):
        pass
    def on_end(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__qualname__)
event.register("numba:compile", Count())
import numpy as np, kda
from kda.__main__ import make_inputs, INPUTS
for layout in ("head_first", "time_major"):
    for T, state in ((300, True), (40, False)):  # the chunked route, the recurrent one
        x, options = make_inputs(2, 3, T, 32, 48, "float32", layout=layout)
        s0 = x["initial_state"] if state else None
        out = kda.chunk_kda(*[x[n] for n in INPUTS], initial_state=s0, save_boundaries=True, **options)
        kda.chunk_kda_backward(*[x[n] for n in INPUTS], out.boundaries, x["grad_output"], None,
                               initial_state=s0, **options)
x, options = make_inputs(2, 3, 1, 32, 48, "float32")
pool = np.zeros((4, 3, 32, 48), np.float32)
kda.decode_kda(*[x[n] for n in INPUTS], pool, np.array([1, 3]), **options)
print("compiled", sorted(set(compiled)))
"""


@pytest.mark.slow  # compiles every float32 kernel: a minute or two of one core
def test_warmup_compiles_what_later_calls_use(tmp_path):
    """``python -m kda warmup --dtype float32`` into an empty cache compiles the kernels; run again,
    it compiles none; then calls of other shapes, layouts and routes than its own (chunked and
    recurrent, head-first and time-major, a decode step) compile nothing either."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}

    def run(*args: str) -> str:
        r = subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
        return r.stdout.strip().splitlines()[-1]

    first = run("-m", "kda", "warmup", "--dtype", "float32")
    assert "cpu kernels ready for float32" in first and " 0 kernels compiled" not in first, first
    assert " 0 kernels compiled" in run("-m", "kda", "warmup", "--dtype", "float32")
    assert run("-c", _AFTER_WARMUP) == "compiled []"
