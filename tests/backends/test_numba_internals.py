"""The Numba internals that kda's compile machinery uses (``kda.cpu._internals``): the Numba installed
here has them; the probe notices each of them changed; and without them kda computes the same bits
as plain Numba functions, with one warning."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import BACKENDS, ROOT

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="numba or scipy not installed")

# How a Numba whose internals changed is made here, one per check of kda.cpu._internals.CHECKS (by
# its position): each replaces something kda relies on by a stand-in that Numba itself can still
# use (a function that calls the original, with other parameters and reading no attribute), so
# that only kda's probe can tell. Run in the test's process (undone after) and in a child process.
CHANGE = r"""
from llvmlite import binding
from numba.core import caching, codegen, compiler, dispatcher, typed_passes


def _stand_in(fn):
    def stand_in(*args, **kwargs):
        return fn(*args, **kwargs)

    return stand_in


def _rebuild():
    return classmethod(_stand_in(vars(compiler.CompileResult)["_rebuild"].__func__))


CHANGES = [
    (compiler.CompileResult, "_rebuild", _rebuild),
    (codegen.JITCodeLibrary, "finalize", lambda: _stand_in(codegen.JITCodeLibrary.finalize)),
    (typed_passes.NativeLowering, "run_pass", lambda: _stand_in(typed_passes.NativeLowering.run_pass)),
    (dispatcher.Dispatcher, "_compile_for_args", lambda: _stand_in(dispatcher.Dispatcher._compile_for_args)),
    (caching.IndexDataCacheFile, "_load_index", lambda: _stand_in(caching.IndexDataCacheFile._load_index)),
    (
        caching.CompileResultCacheImpl,
        "check_cachable",
        lambda: _stand_in(caching.CompileResultCacheImpl.check_cachable),
    ),
    (binding, "llvm_version_info", lambda: (99, 0, 0)),
]
"""

# a small forward and backward: the sha256 of every result's bytes
CALL = r"""
import hashlib
import numpy as np
import kda

rng = np.random.default_rng(0)
B, H, T, K, V = 1, 2, 80, 16, 16
q, k, g = (rng.standard_normal((B, H, T, K)).astype(np.float32) for _ in range(3))
k /= np.linalg.norm(k, axis=-1, keepdims=True)
g = -np.abs(g) * 0.1
v, do = (rng.standard_normal((B, H, T, V)).astype(np.float32) for _ in range(2))
beta = rng.uniform(0, 1, (B, H, T)).astype(np.float32)
out = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True, backend="cpu")
grads = kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do, None, backend="cpu")
digest = hashlib.sha256()
for x in (out.output, *grads):
    if x is not None:
        digest.update(np.ascontiguousarray(x).tobytes())
BITS = digest.hexdigest()
"""

# the child: Numba changed first (argv[1]: CHANGE), then kda imported and called (argv[2]: CALL),
# every warning recorded
CHILD = r"""
import json, sys, warnings

scope = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exec(sys.argv[1], scope)
    for owner, name, make in scope["CHANGES"]:
        setattr(owner, name, make())
    exec(sys.argv[2], scope)
from kda.cpu import _ahead, _compile, _fused, _internals

inner = [name for name, f in vars(_fused).items() if _compile.is_inner(f)]
found = {"bits": scope["BITS"], "problems": list(_internals.PROBLEMS), "inner": inner}
found["ahead"] = _ahead.enabled()
found["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
print(json.dumps(found))
"""


def _changes() -> list:
    scope: dict = {}
    exec(CHANGE, scope)
    return scope["CHANGES"]


def test_the_numba_installed_here_has_every_internal_kda_uses():
    """The Numbas pyproject.toml allows are the ones CI runs: each has what kda uses."""
    from kda.cpu import _internals

    assert _internals.problems() == [] and _internals.SUPPORTED


@pytest.mark.parametrize("which", range(7))
def test_the_probe_notices_each_internal_changed(monkeypatch, which):
    from kda.cpu import _internals

    changes = _changes()
    assert len(changes) == len(_internals.CHECKS)
    owner, name, make = changes[which]
    monkeypatch.setattr(owner, name, make())
    assert _internals.problems() == [_internals.CHECKS[which][0]]


def test_the_probe_notices_an_internal_that_is_gone(monkeypatch):
    from numba.core import caching

    from kda.cpu import _internals

    monkeypatch.delattr(caching, "IndexDataCacheFile")
    assert _internals.problems() == [name for name, _ in _internals.CHECKS if "cache index" in name]


@pytest.mark.slow  # a cold compile of a forward and backward, every helper as a plain Numba function
def test_without_its_numba_internals_kda_computes_the_same_bits_with_one_warning(tmp_path):
    """A Numba whose internals changed (every one kda uses, in a child process with an empty cache):
    kda's functions compile as plain Numba functions (no inner function, no second process) and
    compute the bits this process computes with kda's compile machinery; one warning says so."""
    from kda.cpu import _internals

    assert _internals.SUPPORTED
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    env.pop("KDA_COMPILE_AHEAD", None)
    command = [sys.executable, "-c", CHILD, CHANGE, CALL]
    r = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    child = json.loads(r.stdout.strip().splitlines()[-1])
    assert child["problems"] == [name for name, _ in _internals.CHECKS], child
    assert child["inner"] == [] and child["ahead"] is False, child
    (warning,) = child["warnings"]
    assert warning.startswith("RuntimeWarning: kda: this Numba") and "plain Numba functions" in warning
    scope: dict = {}
    exec(CALL, scope)
    assert child["bits"] == scope["BITS"]
