"""The backends against the interface they implement (:class:`kda._backend.Backend`): every
backend module's primitives and hooks take the protocol's parameters (names, kinds, defaults
present), the optional decode checks are filled in by :func:`kda._backend.complete` with generic
versions whose answers equal the cpu backend's, every method takes its step arrays in the order
``q, k, v, g, beta`` (then the other arrays) with everything else keyword-only, every backend
declares which inputs its fused passes screen (``FUSED_SCREENS``), and no function of
``kda/_backend`` takes more than 10 positional parameters.

The CUDA backend's module is imported under Numba's CUDA simulator where no GPU is present
(``tests/conftest.py`` switches it on before numba is imported): no GPU is needed to check it.
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest
from helpers import BACKENDS

from kda import _backend
from kda._backend import BACKENDS as ALL_BACKENDS
from kda._backend import DEFAULTS, Backend

# the modules of kda/_backend
_MODULES = ("capabilities", "cuda_probe", "defaults", "dispatch", "protocol")

# the methods of the protocol (its attributes, NAME and the like, carry no parameters)
METHODS = sorted(n for n, f in vars(Backend).items() if not n.startswith("_") and inspect.isfunction(f))


def _shape(fn) -> list[tuple[str, str, bool]]:
    """``(name, kind, has a default)`` of each parameter, ``self`` left out."""
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.kind.name, p.default is not inspect.Parameter.empty) for p in params]


def test_the_protocol_names_its_methods():
    assert {"chunk_local_backward", "chunk_backward_heads", "decode_forward", "decode_screen",
            "decode_finite", "recurrent_backward"} <= set(METHODS)  # fmt: skip
    # the final state's gradient has one name in the interface
    for name in ("chunk_state_grad_pass", "chunk_backward_heads", "recurrent_backward"):
        assert "dfinal" in inspect.signature(getattr(Backend, name)).parameters, name


@pytest.mark.parametrize("name", sorted(ALL_BACKENDS))
def test_backend_functions_take_the_protocols_parameters(name):
    if name not in BACKENDS:
        pytest.skip(f"backend {name!r} is not installed here")
    module = importlib.import_module(ALL_BACKENDS[name])
    checked = []
    for method in METHODS:
        fn = getattr(module, method)
        if fn is None and DEFAULTS.get(method, ...) is None:  # an optional pass the backend leaves out
            continue
        want, got = _shape(getattr(Backend, method)), _shape(fn)
        assert got == want, f"{module.__name__}.{method}{inspect.signature(fn)} != protocol {want}"
        checked.append(method)
    assert "decode_screen" in checked and "decode_forward" in checked


def test_every_backend_has_the_decode_checks():
    """complete() fills in the generic checks where a backend has none of its own."""
    reference = importlib.import_module("kda.reference")
    assert reference.decode_screen is _backend.decode_screen
    assert reference.decode_finite is _backend.decode_finite


def _screen_cases():
    rng = np.random.default_rng(0)

    def inputs(dtype=np.float32, T=2):
        q, k = (rng.standard_normal((3, 2, T, 8)).astype(dtype) for _ in range(2))
        v = rng.standard_normal((3, 2, T, 16)).astype(dtype)
        g = -rng.uniform(0, 1, (3, 2, T, 8)).astype(dtype)
        beta = rng.uniform(0, 1, (3, 2, T)).astype(dtype)
        return [q, k, v, g, beta]

    yield "plain", inputs()
    yield "float64", inputs(np.float64)
    x = inputs()
    x[3][1, 1, 0, 3] = -np.inf  # a hard reset: allowed
    yield "-inf gate", x
    for at, bad in ((3, 0.5), (3, np.nan), (0, np.inf), (2, np.nan), (4, -np.inf), (1, np.inf)):
        x = inputs()
        x[at].reshape(-1)[5] = bad
        yield f"input {at} = {bad}", x
    x = inputs()
    x[1] = x[1].astype(np.float64)
    yield "mixed dtypes", x
    yield "float16", [y.astype(np.float16) for y in inputs()]
    x = inputs()
    x[2] = np.asfortranarray(x[2])
    yield "not C-contiguous", x
    x = inputs(T=0)
    yield "no steps", x


@pytest.mark.skipif("cpu" not in BACKENDS, reason="numba or scipy not installed")
def test_the_generic_decode_checks_answer_as_the_cpu_backends():
    cpu = importlib.import_module("kda.cpu")
    answers = set()
    for label, x in _screen_cases():
        for finite in (True, False):
            want = cpu.decode_screen(*x, finite=finite)
            assert _backend.decode_screen(*x, finite=finite) == want, (label, finite)
            answers.add(want)
        for out in x:
            assert _backend.decode_finite(out) == cpu.decode_finite(out), label
    assert answers == {True, False}
    out = np.ones((2, 3), np.float32)
    out[1, 2] = np.nan
    assert not _backend.decode_finite(out) and not cpu.decode_finite(out)
    assert not _backend.decode_finite(out.T) and not cpu.decode_finite(out.T)


# the step arrays, in the one order every method takes them
STEPS = ("q", "k", "v", "g", "beta")
# positional parameters that are arrays besides the step arrays
ARRAYS = {
    "x", "output", "state", "boundaries", "grad_output", "dfinal", "pool", "start", "dest", "w", "u0",
    "k_suffix", "total", "qg", "A", "g",
}  # fmt: skip


@pytest.mark.parametrize("method", METHODS)
def test_step_arrays_in_one_order_and_the_rest_keyword_only(method):
    params = [p for p in inspect.signature(getattr(Backend, method)).parameters.values() if p.name != "self"]
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    steps = [n for n in STEPS if n in positional]  # those it takes, in the one order, first
    assert positional[: len(steps)] == steps, f"{method} takes {positional}"
    assert set(positional) <= ARRAYS | set(STEPS), f"{method}: only arrays are positional; got {positional}"


@pytest.mark.parametrize("name", sorted(ALL_BACKENDS))
def test_every_backend_declares_what_its_fused_passes_screen(name):
    if name not in BACKENDS:
        pytest.skip(f"backend {name!r} is not installed here")
    module = importlib.import_module(ALL_BACKENDS[name])
    screens = module.FUSED_SCREENS
    assert isinstance(screens, frozenset)
    if module.chunk_forward_heads is None:
        assert screens == frozenset()
    else:  # the names the entry points give the arrays a fused pass reads
        assert screens and screens <= {"q", "k", "v", "g", "beta", "boundaries", "grad_output"}


def test_no_function_of_the_interface_takes_more_than_ten_positional_parameters():
    positional = {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD}
    modules = [importlib.import_module(f"{_backend.__name__}.{m}") for m in _MODULES]
    functions = [
        f for m in modules for f in vars(m).values() if inspect.isfunction(f) and f.__module__ == m.__name__
    ]
    functions += [getattr(Backend, m) for m in METHODS]
    assert len(functions) > 20
    for fn in functions:
        n = sum(p.kind in positional for p in inspect.signature(fn).parameters.values() if p.name != "self")
        assert n <= 10, f"{fn.__qualname__} takes {n} positional parameters"
