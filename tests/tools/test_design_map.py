"""``docs/design.md`` against the package: its module map names every module of ``kda`` (every
``.py`` under ``kda/``, packages included) and nothing else; its layer table holds for every
import (read with ``ast``, the imports inside functions included); its change table names files
that exist; and a new gate law, done as the change table says, reaches the command line, the
options' documentation and validation with no other edit.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = "docs/design.md"

# a row of the module map: | `kda/path.py` | layer | its job |
MODULE_ROW = re.compile(r"^\| `(kda/[\w/]+\.py)` \| (\w+) \| (.+) \|$")
# a row of the layer table: | layer | what its modules may import |
LAYER_ROW = re.compile(r"^\| (\w+) \| (`[^|]*`|nothing) \| (.+) \|$")


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section of ``text``."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def module_map(root: Path) -> dict[str, str]:
    """``kda/....py`` -> its layer, from the module map of ``root``'s design notes."""
    rows = [MODULE_ROW.match(line) for line in _section(_read(root), "The modules").splitlines()]
    return {m.group(1): m.group(2) for m in rows if m}


def layer_table(root: Path) -> dict[str, set[str]]:
    """layer -> the layers its modules may import (besides their own top-level package)."""
    table = {}
    for line in _section(_read(root), "The layers").splitlines():
        m = LAYER_ROW.match(line)
        if m:
            table[m.group(1)] = set(re.findall(r"`(\w+)`", m.group(2)))
    return table


def _read(root: Path) -> str:
    return (root / DESIGN).read_text(encoding="utf-8")


def modules(root: Path) -> set[str]:
    """Every module of ``kda`` under ``root``: ``kda/....py``, packages' ``__init__.py`` included."""
    return {p.relative_to(root).as_posix() for p in (root / "kda").rglob("*.py")}


def unmapped(root: Path) -> list[str]:
    """The modules of ``root``'s tree without a line in its module map."""
    return sorted(modules(root) - set(module_map(root)))


def _name(path: str) -> str:
    """``kda/cpu/__init__.py`` -> ``kda.cpu``; ``kda/cpu/_compile.py`` -> ``kda.cpu._compile``."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, path: str) -> list[tuple[str, int]]:
    """``(module of kda, line)`` for every import of a kda module in ``path`` (a ``from X import
    name`` counts ``X`` and, where ``name`` is a module, ``X.name``), and every
    ``importlib.import_module`` of a string that names one."""
    by_name = {_name(p): p for p in modules(root)}
    name = _name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse((root / path).read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            targets = [source, *(f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in by_name)]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        found += [(t, node.lineno) for t in targets if t in by_name]
    return found


def _top(name: str) -> str:
    """A module's top-level package inside kda: ``kda.cpu._compile`` -> ``kda.cpu``."""
    return ".".join(name.split(".")[:2])


def layer_breaks(root: Path) -> list[str]:
    """Every import that the layer table does not allow, as ``path:line: text``."""
    layers, allowed = module_map(root), layer_table(root)
    by_name = {_name(p): p for p in layers}
    breaks = []
    for path, layer in sorted(layers.items()):
        if not (root / path).exists():
            continue
        for target, line in imports(root, path):
            if _top(target) == _top(_name(path)):
                continue  # a package's modules import each other freely
            theirs = layers.get(by_name.get(target, ""), "?")
            if theirs not in allowed.get(layer, set()):
                breaks.append(f"{path}:{line}: imports {target} (layer {theirs}), refused in layer {layer}")
    return breaks


# ---------------------------------------------------------------------------------- the module map


def test_every_module_has_a_line():
    missing = unmapped(ROOT)
    assert not missing, f"modules without a line in {DESIGN}'s module map: {missing}"


def test_every_line_names_a_module():
    gone = sorted(set(module_map(ROOT)) - modules(ROOT))
    assert not gone, f"{DESIGN}'s module map names modules that do not exist: {gone}"


def test_every_line_has_a_layer_of_the_table():
    layers = layer_table(ROOT)
    assert {"base", "options", "interface", "backend", "engine", "entry", "adapter", "tool"} <= set(layers)
    unknown = {p: layer for p, layer in module_map(ROOT).items() if layer not in layers}
    assert not unknown, f"module map rows with a layer the layer table lacks: {unknown}"


def test_the_map_fails_on_a_module_added_without_a_line(tmp_path):
    """The check itself: a copy of the tree with one module more, and no line for it."""
    shutil.copytree(ROOT / "kda", tmp_path / "kda", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / DESIGN, tmp_path / DESIGN)
    assert unmapped(tmp_path) == unmapped(ROOT)
    (tmp_path / "kda" / "cpu" / "_unmapped.py").write_text('"""A module nobody described."""\n')
    assert unmapped(tmp_path) == sorted([*unmapped(ROOT), "kda/cpu/_unmapped.py"])


# ----------------------------------------------------------------------------------- the layers


def test_every_import_follows_the_layer_table():
    breaks = layer_breaks(ROOT)
    assert not breaks, "imports the layer table of docs/design.md does not allow:\n" + "\n".join(breaks)


def test_only_the_dispatch_reaches_a_backend_by_name():
    """Backends import nothing from each other, and no module outside a backend's package imports
    it (the dispatch imports it through the capability table, ``importlib`` on a looked-up name)."""
    layers = module_map(ROOT)
    backends = {_top(_name(p)) for p, layer in layers.items() if layer == "backend"}
    assert backends == {"kda.reference", "kda.cpu", "kda.cuda"}
    reached = [
        f"{path}:{line}: {target}"
        for path in sorted(layers)
        if (ROOT / path).exists()
        for target, line in imports(ROOT, path)
        if _top(target) in backends and _top(target) != _top(_name(path))
    ]
    assert not reached, f"backend modules imported by name: {reached}"


def test_the_layer_check_sees_a_forbidden_import(tmp_path):
    """The check itself: the engine importing the cpu backend by name is a break."""
    shutil.copytree(ROOT / "kda", tmp_path / "kda", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / DESIGN, tmp_path / DESIGN)
    core = tmp_path / "kda" / "_engine" / "core.py"
    core.write_text(core.read_text() + "\n\ndef _reach():\n    from ..cpu import _passes\n")
    breaks = layer_breaks(tmp_path)
    assert len(breaks) == len(layer_breaks(ROOT)) + 2  # kda.cpu and kda.cpu._passes
    assert any("kda/_engine/core.py" in b and "kda.cpu._passes" in b for b in breaks)


# ---------------------------------------------------------------------------------- the change table


def _change_table() -> dict[str, str]:
    """kind of change -> the files its row names."""
    rows = {}
    for line in _section(_read(ROOT), "Where each kind of change goes").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("a new"):
            rows[cells[0]] = cells[1]
    return rows


# where the change table's relative names live
_PREFIXES = ("", "kda/", "tests/")


def _named_files(row: str) -> list[str]:
    """The files a row names: backquoted paths with a suffix (a folder ``kda/<name>/`` left out)."""
    return [n for n in re.findall(r"`([\w/.<>]+\.(?:py|md|txt|toml))`", row) if "<" not in n]


def test_the_change_table_names_every_kind_of_change():
    rows = _change_table()
    for kind in ("a new gate law", "a new model-level option", "a new backend", "a new adapter"):
        assert kind in rows, f"{DESIGN}'s change table has no row {kind!r}"
    for kind in ("a new vLLM family", "a new public entry point", "a new primitive", "a new CUDA kernel"):
        assert kind in rows, f"{DESIGN}'s change table has no row {kind!r}"


@pytest.mark.parametrize("kind", sorted(_change_table()))
def test_the_change_table_names_files_that_exist(kind):
    named = _named_files(_change_table()[kind])
    assert named, f"the row {kind!r} names no file"
    missing = [n for n in named if not any((ROOT / f"{prefix}{n}").is_file() for prefix in _PREFIXES)]
    assert not missing, f"the change table's row {kind!r} names files that do not exist: {missing}"


@pytest.fixture
def halved_law():
    """A gate law registered as the change table says (one class, registered with ``register``):
    ``g`` is the log decay, halved."""
    from kda._options import gates

    class HalvedLog(gates.GateLaw):
        name = "halved_log"
        log_input = True
        doc = "``g / 2``"

        def log_decay(self, xp, g, params, lower_bound):
            return g * 0.5, None

        def backward(self, xp, dlog, log, saved, params, lower_bound):
            return dlog * 0.5, {}

    gates.register(HalvedLog)
    try:
        yield HalvedLog.name
    finally:
        gates.unregister(HalvedLog.name)


def test_a_new_gate_law_needs_no_other_edit(halved_law, capsys):
    """The command line takes it (and runs its check), the options' documentation lists it, and a
    call with it computes what the log law computes on the mapped ``g``."""
    import kda
    import kda.__main__ as cli
    from kda._options import table

    args = cli._parser().parse_args(["--gate", halved_law])
    assert args.gate == halved_law
    x, options = cli.make_inputs(1, 2, 40, 8, 8, "float64", gate=halved_law)
    assert options["gate"] == halved_law
    assert halved_law in table.options_doc()

    q, k, v, g, beta = (x[n] for n in cli.INPUTS)
    got = kda.chunk_kda(q, k, v, g, beta, gate=halved_law, backend="reference", chunk_size=16)
    want = kda.chunk_kda(q, k, v, g * 0.5, beta, backend="reference", chunk_size=16)
    np.testing.assert_allclose(got.output, want.output, rtol=0, atol=1e-12)
    with pytest.raises(kda.KdaError, match=halved_law):
        kda.chunk_kda(q, k, v, g, beta, gate="halved_logs", backend="reference")  # the choices name it

    sizes = ["--H", "1", "--T", "48", "--K", "8", "--V", "8", "--chunk-size", "16", "--dtype", "float64"]
    only_reference = {"reference": lambda a: a}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "available_backends", lambda: only_reference)
        assert cli.main([*sizes, "--gate", halved_law]) == 0
    assert f"'gate': '{halved_law}'" in capsys.readouterr().out


FAKE_BACKEND = '''"""A backend for the change-table test: the reference's primitives under another name."""
import kda.reference as _reference
from kda._backend import complete

globals().update({name: getattr(_reference, name) for name in _reference.__all__})
NAME = "fake"
complete(globals())
'''


def test_a_new_backend_needs_only_its_package_and_its_capability_row(tmp_path, monkeypatch):
    """A backend package and its row in ``CAPABILITIES``: the dispatch imports it by the row's
    module name, and the README's table, the ``backend`` entry and the installed list name it."""
    import kda
    import kda.__main__ as cli
    from kda._backend import capabilities, dispatch

    (tmp_path / "kda_fake_backend.py").write_text(FAKE_BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    row = capabilities.Capability("fake", "kda_fake_backend", "NumPy, for a test", "by name", (), "a test's")
    monkeypatch.setattr(capabilities, "CAPABILITIES", (*capabilities.CAPABILITIES, row))
    monkeypatch.setitem(capabilities.BACKENDS, "fake", row.module)

    assert dispatch.get_backend(np, "fake").__name__ == "kda_fake_backend"
    assert "| `fake` (`kda_fake_backend`) |" in capabilities.backend_table()
    assert '"fake": a test\'s' in capabilities.backend_doc()
    assert "fake" in capabilities.installed_backends()
    x, options = cli.make_inputs(1, 2, 40, 8, 8, "float64")
    q, k, v, g, beta = (x[n] for n in cli.INPUTS)
    got = kda.chunk_kda(q, k, v, g, beta, backend="fake", chunk_size=16, **options)
    want = kda.chunk_kda(q, k, v, g, beta, backend="reference", chunk_size=16, **options)
    assert np.array_equal(got.output, want.output)


def test_a_new_vllm_family_needs_only_its_module_and_its_registry_line(monkeypatch):
    """A family: its module (here an existing one under a second name) and its ``REGISTRY`` line;
    the command line offers it and the driver finds its spec."""
    from kda.vllm import cli, families

    monkeypatch.setitem(families.REGISTRY, "second-kimi", families.REGISTRY["kimi"])
    args = cli._parser().parse_args(["check", "--model", "second-kimi"])
    assert args.model == "second-kimi"
    assert families.family("second-kimi") is families.family("kimi")
