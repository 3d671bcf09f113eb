"""Inner functions (``kda.cpu._compile.jit(inner=True)``, ``kda.cpu._inner``): the kernels' helpers
compile only inside the kernels that call them (no module passes or machine code of their own until
a call from Python asks for them), and every function the backend calls from Python is compiled in
full."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import BACKENDS, ROOT

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="numba or scipy not installed")

# the chunk kernels the cpu backend calls from Python (kda/cpu/__init__.py): compiled in full and
# cached; every other compiled function of their modules is inner
ENTRIES = {
    "kda.cpu._fused": {"forward_heads", "backward_heads"},
    "kda.cpu._passes": {
        "local_forward",
        "local_backward",
        "state_pass",
        "state_grad_pass",
        "recurrent_forward",
        "recurrent_backward",
    },
    "kda.cpu._products": set(),
    "kda.cpu._pairs": set(),
    "kda.cpu._solve": set(),
}


def _dispatchers(module):
    import numba

    return {
        name: value
        for name, value in vars(module).items()
        if isinstance(value, numba.core.registry.CPUDispatcher)
        and value.py_func.__module__ == module.__name__
    }


def test_every_helper_is_inner_and_every_entry_is_not():
    import importlib

    from kda.cpu import _compile, _kernels

    assert {n for n in _kernels.__all__} <= ENTRIES["kda.cpu._fused"] | ENTRIES["kda.cpu._passes"]
    for module_name, entries in ENTRIES.items():
        found = _dispatchers(importlib.import_module(module_name))
        assert entries <= set(found), module_name
        for name, kernel in found.items():
            assert _compile.is_inner(kernel) == (name not in entries), f"{module_name}.{name}"
    # the decode kernel's helpers are compiled in full: inlined from their optimised modules, the
    # kernel runs faster (kda/cpu/_decode_kernels.py)
    from kda.cpu import _decode_kernels

    assert not any(_compile.is_inner(f) for f in _dispatchers(_decode_kernels).values())


def _twice(x):
    return 2.0 * x


def _twice_plus_one(x):
    return TWICE(x) + 1.0


TWICE = None  # _twice, made inner by the test below


def test_an_inner_function_compiles_inside_its_caller_and_on_a_call_from_python():
    """A compiled caller runs inner functions that have no machine code of their own; a call from
    Python runs the function's complete compilation (made once, not the inner one) and gives the
    same result."""
    import numba

    from kda.cpu import _compile, _inner

    global TWICE
    TWICE = twice = _compile.jit(inner=True)(_twice)
    twice_plus_one = _compile.jit(inner=True)(_twice_plus_one)

    def caller(x):
        return twice_plus_one(x) - 0.5

    caller = numba.njit(caller)  # not cached: defined in a test
    assert caller(3.0) == 6.5
    for f in (twice, twice_plus_one):
        (compiled,) = f.overloads.values()
        with pytest.raises(RuntimeError, match="no machine code of its own"):
            compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)
    assert _twice_plus_one not in _inner.FROM_PYTHON
    assert twice_plus_one(3) == 7.0 and twice_plus_one(4.0) == 9.0  # int64, then float64
    assert _twice_plus_one in _inner.FROM_PYTHON and _twice not in _inner.FROM_PYTHON
    assert len(twice_plus_one.overloads) == 1  # Python's calls compiled no inner version
    assert not _compile.is_inner(_inner.FROM_PYTHON[_twice_plus_one])
    assert twice(4.0) == 8.0
    assert caller(4.0) == 8.5


_COLD = """
import numpy as np
import kda
from kda.__main__ import make_inputs, INPUTS
from kda.cpu import _compile, _fused, _inner, _pairs, _passes, _products, _solve
x, options = make_inputs(1, 2, 80, 16, 16, "float64")
inputs = [x[n] for n in INPUTS]
out = kda.chunk_kda(*inputs, save_boundaries=True, backend="cpu", **options)
kda.chunk_kda_backward(*inputs, out.boundaries, x["grad_output"], None, backend="cpu", **options)
x, options = make_inputs(2, 2, 1, 16, 16, "float64")
pool = np.zeros((3, 2, 16, 16))
kda.decode_kda(*[x[n] for n in INPUTS], pool, np.array([1, 2]), backend="cpu", **options)
modules = (_fused, _pairs, _passes, _products, _solve)
inner = [c for m in modules for f in vars(m).values() if _compile.is_inner(f) for c in f.overloads.values()]
print(len(inner), sorted(f.__name__ for f in _inner.FROM_PYTHON))
"""


@pytest.mark.slow  # compiles the fused forward and backward and the decode kernel: about 20 s
def test_the_backend_calls_no_inner_function_from_python(tmp_path):
    """A cold chunked forward, backward and decode step compile their helpers as inner functions
    and call none from Python (one called would be an entry point left inner: compiled again in
    every process, uncached)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _COLD], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    count, realized = r.stdout.split(maxsplit=1)
    assert int(count) > 20 and realized.strip() == "[]", r.stdout
