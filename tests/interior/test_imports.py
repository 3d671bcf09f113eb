"""The shape of kda's modules, read from their source (nothing is imported).

- No import cycle among kda's modules: every ``import`` and ``from ... import`` counts, at module
  level and inside functions (a function-level import hides a cycle, it does not remove it),
  relative imports resolved; only ``if TYPE_CHECKING:`` blocks, which never run, are left out.
- ``kda._backend``, ``kda._engine``, ``kda._entry`` and ``kda._options`` are regular packages.
- No host-layer function takes more than 10 positional parameters (``self`` / ``cls`` not
  counted): more are passed by keyword or as a record.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import ROOT

KDA = ROOT / "kda"
MAX_POSITIONAL = 10
# functions whose positional parameters are another library's public signature, kept exactly:
# fla 0.6's chunk_kda and fused_recurrent_kda (kda.torch's and kda.jax's, held to
# kda._entry.fla.CHUNK_PARAMS / RECURRENT_PARAMS by tests/entry/test_signatures.py)
FOREIGN_SIGNATURES = {
    ("torch.py", "chunk_kda"),
    ("torch.py", "fused_recurrent_kda"),
    ("jax.py", "chunk_kda"),
    ("jax.py", "fused_recurrent_kda"),
}
# the host layers: the entry points, the engine, the options, the backend interface, the adapters' host code
HOST_LAYERS = ("_entry", "_engine", "_options", "_backend", "torch.py", "jax.py", "dask.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(KDA.rglob("*.py"))}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skipped.update(id(n) for n in ast.walk(child))
    return skipped


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The kda modules that module ``name`` imports, anywhere in its source."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_nodes(tree)
    package = name if _is_package(path) else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from pkg import module` imports the module; else pkg's name
                module = f"{source}.{alias.name}"
                targets.add(module if module in modules else source)
    return {t for t in targets if t in modules and t != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_read():
    """The graph has the edges it must (guards the parser: an empty graph has no cycles)."""
    graph = _graph()
    assert "kda._entry.call" in graph["kda._entry.api"]  # from .call import ...
    assert "kda._entry.host" in graph["kda.torch"]  # from ._entry import host as _host
    assert "kda._backend" in graph["kda._entry.call"]  # from .._backend import ...
    assert "kda.cpu" in graph["kda.cpu._decode"] or "kda._backend" in graph["kda.cpu"]
    assert len(graph) > 40


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    """No module of kda imports itself again through others (function-level imports included)."""
    cycles = _cycles(_graph())
    assert not cycles, "import cycles among kda's modules: " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("package", ["_backend", "_engine", "_entry", "_options"])
def test_host_packages_are_regular(package):
    assert (KDA / package / "__init__.py").is_file()


def _host_files() -> list[Path]:
    files = []
    for entry in HOST_LAYERS:
        path = KDA / entry
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def _positional(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    return names[1:] if names and names[0] in ("self", "cls") else names


def test_host_functions_take_at_most_ten_positional_parameters():
    long = []
    for path in _host_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = _positional(node)
                if len(names) > MAX_POSITIONAL and (path.name, node.name) not in FOREIGN_SIGNATURES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({len(names)})")
    assert len(_host_files()) > 20
    assert not long, "functions with more than 10 positional parameters:\n" + "\n".join(long)
