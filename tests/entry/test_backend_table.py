"""The capability table (kda._backend.CAPABILITIES) is the one description of the backends: it
generates the README's table, the ``backend`` docstrings and the backends the tests run; and
kda._backend.complete gives every backend module the interface's defaults and its ``__all__``."""

from __future__ import annotations

import importlib
import types

import pytest
from helpers import BACKENDS, ROOT

import kda
from kda import _backend


def test_readme_table_is_the_capability_table():
    """The README's backend table is exactly :func:`kda._backend.backend_table` (regenerate it
    with ``python -c "from kda._backend import backend_table; print(backend_table())"``)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert _backend.backend_table() in readme


def test_backend_docstring_names_every_backend():
    """The ``backend`` entry of chunk_kda's docstring (which the other entry points refer to)
    lists the table's backends, in its order."""
    doc = kda.chunk_kda.__doc__
    assert "{backend}" not in doc
    names = ", ".join(f'"{c.name}"' for c in _backend.CAPABILITIES)
    assert f"backend : {{None, {names}}}" in doc


def test_the_tests_run_the_installed_backends():
    """The suite's backends are the table's installed ones, the reference always among them."""
    assert BACKENDS == _backend.installed_backends()
    assert "reference" in BACKENDS
    assert set(_backend.BACKENDS) == {c.name for c in _backend.CAPABILITIES}


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_module_is_complete(name):
    """Each backend module has every name of the interface and exports them (``__all__``)."""
    module = importlib.import_module(f"kda.{name}")
    assert module.NAME == name
    for attr in _backend.INTERFACE:
        assert hasattr(module, attr), attr
    assert set(_backend.INTERFACE) <= set(module.__all__)


def test_complete_fills_defaults_and_refuses_a_missing_primitive():
    """Defaults where a backend defines nothing of its own; its own definitions win; a missing
    primitive is a TypeError at import naming it."""
    required = {n: object() for n in _backend.INTERFACE if n not in _backend.DEFAULTS}
    own = types.SimpleNamespace()
    space = {"__name__": "kda.fake", **required, "RECURRENT_MAX_T": 7}
    _backend.complete(space, extras=())
    assert space["RECURRENT_MAX_T"] == 7
    assert space["chunk_forward_heads"] is None and space["MAX_CHUNK"] is None
    assert space["workers"](xp=own, heads=16) == 1
    assert space["FUSED_SCREENS"] == frozenset()  # no fused passes: nothing screened on the way
    assert space["launch_gate_check"](own) is None
    with space["worker_context"]():
        pass
    assert space["__all__"] == sorted(_backend.INTERFACE)
    del required["chunk_local"]
    with pytest.raises(TypeError, match="chunk_local"):
        _backend.complete({"__name__": "kda.fake", **required})
