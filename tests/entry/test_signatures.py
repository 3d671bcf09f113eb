"""Every public entry point's signature, docstring and body against the option table.

The model-level options are declared once, in :data:`kda._options.table.OPTIONS`; each entry
point writes them out in its own ``def``. These tests hold the written signatures (names, order,
kinds, defaults, type hints), the docstrings' entries and the gathering of the keywords into one
:class:`~kda._options.table.Choices` to the table, so that an option added to the table and
missing from one entry point fails here, naming it. The same for the fla-style adapters'
signatures against :mod:`kda._entry.fla`'s parameter declarations, and for the plain-call tests
(:func:`~kda._options.table.is_plain`, ``Options.is_identity``).
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest

import kda
from kda._entry import decode
from kda._options import table
from kda._options.maps import Options
from kda._options.table import ANY, Choices, Option, is_plain, option_header

# every function that takes the model-level options; the public ones are also checked for their
# docstrings (decode_states is the adapters' recurrent forward, not exported)
PUBLIC = [
    kda.chunk_kda,
    kda.chunk_kda_backward,
    kda.recurrent_kda,
    kda.recurrent_kda_backward,
    kda.prepare_chunk_kda,
    kda.prepare_chunk_kda_backward,
    kda.chunk_kda_transition,
    kda.chunk_kda_transition_backward,
    kda.decode_kda,
    kda.prepare_decode_kda,
]
INTERNAL = [decode.decode_states]


def _dask_functions() -> list:
    try:
        import kda.dask
    except ImportError:  # pragma: no cover - without dask
        return []
    return [kda.dask.chunk_kda, kda.dask.chunk_kda_backward]


DASK = _dask_functions()
ENTRY_POINTS = PUBLIC + DASK + INTERNAL


def _name(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _ids(fns: list) -> list[str]:
    return [_name(f) for f in fns]


# --------------------------------------------------------------------------------- the checks


def signature_problems(fn) -> list[str]:
    """What in ``fn``'s signature differs from the table: its last parameters are the table's
    options, keyword-only, in table order, with the table's defaults and type hints; no other
    parameter has an option's name."""
    options = table.OPTIONS
    params = list(inspect.signature(fn).parameters.values())
    own, tail = params[: -len(options)], params[-len(options) :]
    problems = [f"{p.name} (an option) before the options" for p in own if p.name in table.option_names()]
    if len(tail) < len(options) or [p.name for p in tail] != [o.name for o in options]:
        return [*problems, f"options {[p.name for p in tail]}, the table's {[o.name for o in options]}"]
    for p, o in zip(tail, options, strict=True):
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            problems.append(f"{p.name} is {p.kind.name}, not keyword-only")
        same = p.default == o.default if isinstance(o.default, str) else p.default is o.default
        if not same:
            problems.append(f"{p.name} defaults to {p.default!r}, the table's {o.default!r}")
        if p.annotation != o.annotation:
            problems.append(f"{p.name}: {p.annotation!r}, the table's {o.annotation!r}")
    return problems


def _entries(doc: str) -> dict[str, tuple[str, str]]:
    """The parameter entries of a numpydoc docstring: name -> (header line, description)."""
    lines = inspect.cleandoc(doc).splitlines()
    entries, current = {}, None
    for line in lines:
        header = re.match(r"(\w+) : ", line)
        if header:
            current = header.group(1)
            entries[current] = (line, "")
        elif current is not None and line.startswith("    "):
            head, body = entries[current]
            entries[current] = (head, f"{body} {line.strip()}")
        else:
            current = None
    return entries


def _words(text: str) -> str:
    return " ".join(text.split())


def docstring_problems(fn) -> list[str]:
    """What in ``fn``'s docstring differs from the table: an entry per option, in table order,
    its header :func:`~kda._options.table.option_header`, its description the option's doc
    (a remark of the entry point may follow it)."""
    doc = fn.__doc__ or ""
    entries = _entries(doc)
    problems = []
    for o in table.OPTIONS:
        if o.name not in entries:
            problems.append(f"no docstring entry for {o.name}")
            continue
        header, body = entries[o.name]
        if header != option_header(o):
            problems.append(f"{o.name}'s entry reads {header!r}, the table's {option_header(o)!r}")
        if not _words(body).startswith(_words(o.doc)):
            problems.append(f"{o.name}'s description is not the table's: {_words(body)[:80]!r}...")
    order = [name for name in entries if name in table.option_names()]
    if order != [o.name for o in table.OPTIONS if o.name in entries]:
        problems.append(f"docstring entries in the order {order}, not the table's")
    if "{options}" in doc:
        problems.append("an unfilled {options} placeholder")
    return problems


class _Gathered(Exception):
    """Raised by the recording Choices: the body gathered its keywords."""


def gathered_keywords(fn, monkeypatch) -> dict:
    """The keywords ``fn``'s body passes to ``Choices`` when called with a distinct value for
    every option (None for its own required parameters)."""
    seen: dict = {}

    def recording(**kw):
        seen.update(kw)
        raise _Gathered

    monkeypatch.setattr(sys.modules[fn.__module__], "Choices", recording)
    required = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    values = {o.name: f"<{o.name}>" for o in table.OPTIONS}
    with pytest.raises(_Gathered):
        fn(*(None for _ in required), **values)
    return seen


# --------------------------------------------------------------------------------- the tests


def test_every_exported_function_is_checked():
    """Every function that kda exports is in the lists above (a new entry point gets checked)."""
    exported = {getattr(kda, n) for n in kda.__all__ if inspect.isfunction(getattr(kda, n))}
    assert exported == set(PUBLIC)


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=_ids(ENTRY_POINTS))
def test_signature_is_the_table(fn):
    assert signature_problems(fn) == [], _name(fn)


@pytest.mark.parametrize("fn", PUBLIC + DASK, ids=_ids(PUBLIC + DASK))
def test_docstring_is_the_table(fn):
    assert docstring_problems(fn) == [], _name(fn)


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=_ids(ENTRY_POINTS))
def test_body_gathers_every_keyword_into_its_field(fn, monkeypatch):
    assert gathered_keywords(fn, monkeypatch) == {o.name: f"<{o.name}>" for o in table.OPTIONS}


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=_ids(ENTRY_POINTS))
def test_signature_is_written_in_source(fn):
    """The signature is a ``def`` in a module of kda (what an editor's go-to-definition and a type
    checker read), every option written on it."""
    source = textwrap.dedent(inspect.getsource(fn))
    assert source.startswith(f"def {fn.__name__}("), _name(fn)
    assert Path(inspect.getsourcefile(fn)).resolve().is_relative_to(Path(kda.__file__).parent.resolve())
    header = source[: source.index(":\n", source.index(")"))]
    for o in table.OPTIONS:
        assert re.search(rf"\b{o.name}: ", header), f"{_name(fn)} does not write out {o.name}"


def test_a_new_option_fails_every_signature(monkeypatch):
    """An option added to the table and to no entry point: the checks name every entry point."""
    fake = Option(name="fake_option", default=None, annotation="bool | None", doc="Fake.", plain=(None,))
    monkeypatch.setattr(table, "OPTIONS", (*table.OPTIONS, fake))
    for fn in ENTRY_POINTS:
        assert signature_problems(fn), _name(fn)
    for fn in PUBLIC + DASK:
        assert "no docstring entry for fake_option" in docstring_problems(fn), _name(fn)


def test_a_keyword_missing_from_a_def_fails(monkeypatch):
    """An entry point whose ``def`` lacks one option (its signature replaced by one without
    ``cu_seqlens``) fails the signature check."""

    def without_cu_seqlens(
        q,
        k,
        v,
        g,
        beta,
        *,
        layout="head_first",
        qk_l2norm=False,
        gate="log",
        A_log=None,
        dt_bias=None,
        lower_bound=None,
        beta_activation=None,
        check_finite=True,
    ):
        """Nothing."""

    assert any("options" in p for p in signature_problems(without_cu_seqlens))
    assert "no docstring entry for cu_seqlens" in docstring_problems(without_cu_seqlens)


def test_choices_fields_are_the_table():
    assert [(f.name, f.default, f.type) for f in fields(Choices)] == [
        (o.name, o.default, o.annotation) for o in table.OPTIONS
    ]


# --------------------------------------------------------------------------------- plain calls


class _Probe:
    """A record of options at given values that notes which attributes are read."""

    def __init__(self, values: dict) -> None:
        self._values, self.read = values, set()

    def __getattr__(self, name: str):
        self.read.add(name)
        return self._values[name]


def _plain_values(names) -> dict:
    return {o.name: (o.default if o.plain is ANY else o.plain[0]) for o in table.OPTIONS if o.name in names}


def test_is_plain_asks_every_option_with_plain_values():
    """:func:`is_plain` reads every option whose ``plain`` is not ``ANY`` (and no other), accepts
    each of its plain values and refuses any other value."""
    asked = {o.name for o in table.OPTIONS if o.plain is not ANY}
    probe = _Probe(_plain_values(table.option_names()))
    assert is_plain(probe)
    assert probe.read == asked
    for o in table.OPTIONS:
        if o.plain is ANY:
            continue
        for value in o.plain:
            assert is_plain(_Probe({**_plain_values(table.option_names()), o.name: value})), (o.name, value)
        assert not is_plain(_Probe({**_plain_values(table.option_names()), o.name: object()})), o.name


def test_options_is_identity_is_is_plain_on_its_fields():
    """``Options.is_identity`` asks what :func:`is_plain` asks of the options it holds."""
    held = {f.name for f in fields(Options)}
    assert held <= set(table.option_names())
    asked = {o.name for o in table.OPTIONS if o.plain is not ANY and o.name in held}
    probe = _Probe(_plain_values(held))
    assert Options.is_identity.fget(probe)
    assert probe.read == asked
    for name in asked:
        assert not Options.is_identity.fget(_Probe({**_plain_values(held), name: object()})), name


# --------------------------------------------------------------------------------- no exec


def test_no_function_of_kda_is_generated():
    """No module of kda calls ``exec`` or ``eval``: every function is a ``def`` in its source."""
    root = Path(kda.__file__).parent
    calls = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("exec", "eval")
            ):
                calls.append(f"{path.relative_to(root)}:{node.lineno} {node.func.id}")
    assert calls == []


# --------------------------------------------------------------------------------- the adapters


#: the fla-style functions, by module: the same test ids whether or not torch and jax import
FLA = [
    (module, name, kind)
    for module in ("kda.torch", "kda.jax")
    for name, kind in (("chunk_kda", "CHUNK"), ("fused_recurrent_kda", "RECURRENT"))
]


@pytest.mark.parametrize(("module", "name", "kind"), FLA, ids=[f"{m}.{n}" for m, n, _ in FLA])
def test_fla_signature_is_fla_s(module, name, kind, monkeypatch):
    """kda.torch's and kda.jax's fla-style functions: ``q, k, v, g, beta``, then fla 0.6's named
    parameters (:data:`kda._entry.fla.CHUNK_PARAMS` / ``RECURRENT_PARAMS``) with their defaults,
    then ``**kwargs``; the body passes every one to the adapter's call by its own name, and refuses
    a keyword fla does not define."""
    from kda._entry import fla

    fn = getattr(pytest.importorskip(module), name)
    declared = getattr(fla, f"{kind}_PARAMS")
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params[:5]] == ["q", "k", "v", "g", "beta"]
    assert [(p.name, p.default) for p in params[5:-1]] == list(declared)
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
    assert textwrap.dedent(inspect.getsource(fn)).startswith(f"def {fn.__name__}(")

    seen = {}

    def recording(method, q, k, v, g, beta, kw):
        seen.update(kw)
        raise _Gathered

    monkeypatch.setattr(sys.modules[fn.__module__], "_call", recording)
    values = {name: f"<{name}>" for name, _ in declared}
    with pytest.raises(_Gathered):
        fn(None, None, None, None, None, **values, chunk_size=32)
    assert seen == {**values, "chunk_size": 32}
    with pytest.raises(TypeError, match="not_an_fla_keyword"):
        fn(None, None, None, None, None, not_an_fla_keyword=1)
