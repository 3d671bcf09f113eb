"""No test module binds a name that ``kda.testing`` exports to something else.

A test that reads ``assert_close`` or ``Problem`` must get ``kda.testing``'s, so the suite's own
helpers (tests/helpers.py) take other names. Read from the source (nothing is imported): at a
module's top level a ``def``, a ``class``, an assignment, or an import from elsewhere than
``kda.testing`` (``from helpers import gates``) of such a name fails, and so does a function
defined inside a function under such a name. Methods are left out (a gate law's ``log_decay``
implements kda's interface), and so are local variables (``reference = ...`` holds a value).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kda.testing

TESTS = Path(__file__).resolve().parents[1]
EXPORTED = frozenset(kda.testing.__all__)


def _targets(node: ast.AST) -> list[str]:
    """The names an assignment statement binds."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _from_kda_testing(node: ast.ImportFrom, alias: ast.alias) -> bool:
    """An import of ``kda.testing``'s own object under its own name."""
    module = node.module or ""
    own_module = node.level == 0 and (module == "kda.testing" or module.startswith("kda.testing."))
    return own_module and (alias.asname or alias.name) == alias.name


def shadowing(source: str) -> list[tuple[int, str, str]]:
    """``(line, kind, name)`` for each binding of an exported name in the module ``source``."""
    tree = ast.parse(source)
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names, kind = [node.name], "def" if not isinstance(node, ast.ClassDef) else "class"
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            names, kind = _targets(node), "assignment"
        elif isinstance(node, ast.ImportFrom):
            names = [a.asname or a.name for a in node.names if not _from_kda_testing(node, a)]
            kind = f"import from {'.' * node.level}{node.module or ''}"
        elif isinstance(node, ast.Import):
            names, kind = [a.asname for a in node.names if a.asname], "import as"
        else:
            continue
        found += [(node.lineno, kind, n) for n in names if n in EXPORTED]
    for outer in ast.walk(tree):
        if isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(outer):
                nested = isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                if nested and inner is not outer and inner.name in EXPORTED and not _is_method(outer, inner):
                    found.append((inner.lineno, "nested def", inner.name))
    return sorted(set(found))


def _is_method(outer: ast.AST, inner: ast.AST) -> bool:
    """Whether ``inner`` sits directly in the body of a class within ``outer``."""
    return any(isinstance(c, ast.ClassDef) and inner in c.body for c in ast.walk(outer))


def test_no_test_module_shadows_kda_testing():
    bad = [
        f"{path.relative_to(TESTS.parent)}:{line}: {kind} {name!r}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, kind, name in shadowing(path.read_text())
    ]
    assert not bad, "names kda.testing exports, bound to something else in the tests:\n" + "\n".join(bad)


def test_the_check_finds_each_kind():
    source = (
        "from helpers import assert_close\n"
        "from kda.testing import gates\n"
        "from kda.testing import Problem as P\n"
        "import numpy as compare\n"
        "REGIMES = ('mild',)\n"
        "class Problem: ...\n"
        "def tolerance(): ...\n"
        "def test_x():\n"
        "    reference = 1\n"
        "    def round_to(x): ...\n"
        "    class Law:\n"
        "        def log_decay(self): ...\n"
    )
    assert [(kind, name) for _, kind, name in shadowing(source)] == [
        ("import from helpers", "assert_close"),
        ("import as", "compare"),
        ("assignment", "REGIMES"),
        ("class", "Problem"),
        ("def", "tolerance"),
        ("nested def", "round_to"),
    ]
