"""Every code name and file a document cites resolves in the repository.

The documents are ``docs/*.md``, ``README.md`` and ``benchmarks/README.md``. Each inline code span
(text in single backticks, outside fenced blocks) is read as one of:

- a **command** (``python -m kda ...``, ``python benchmarks/x.py ...``, ``bash scripts/...``): the
  module or script must exist and every ``--flag`` must occur in the repository's sources;
- a **flag** (a span that starts with ``--``): every ``--flag`` in it must occur in the sources;
- an **environment assignment** (``NAME=value``): ``NAME`` must occur in the sources;
- a **file path** (a span without spaces under one of the repository's top folders, or ending in a
  file suffix): it must exist, relative to the repository root or to the document's folder, or as
  the tail of a repository file's path (``_backend.py``, ``results/x.txt``; ``{a,b}`` alternatives
  and ``*`` globs expanded; ``file::test`` names a test function in the file), or be listed in
  :data:`GENERATED` (each entry checked against the file that writes it) or :data:`ELSEWHERE`;
- a **code name** (an identifier or dotted path, optionally with ``()``): a dotted path is resolved
  module by module and member by member in the sources' syntax trees (``kda._threads.PIN``,
  ``ChunkCore.forward``, ``host.forward``, ``kt.Problem`` through ``import kda.testing as kt``);
  a bare identifier must be defined somewhere (a module, class, function, assignment, parameter,
  keyword argument, field) or occur in the code (a name loaded, an attribute, a word of a string
  that is not a docstring, such as an option value ``"softplus"``), be a Python keyword or
  builtin, or a word of the shell scripts or the C source. Not checked: identifiers of one or two
  letters with a digit or a subscript at most (``S``, ``kg``, ``U0``, ``T_n``: the documents'
  mathematical notation), dotted names under a root of :data:`EXTERNAL_ROOTS` (another library's
  API; but ``torch.ops.kda.NAME``, kda's own op, must be registered as ``"kda::NAME"``), and the few spans
  of :data:`OTHER_NAMES` (another project's code);
- anything else (an expression, a shape, a value with spaces or operators) is prose, not checked.

A document about another project's code (:data:`SUBJECTS`: ``docs/vllm.md``) may name that code
freely; it is held only on what points into this repository. Markdown links to relative targets
must exist too. The sources are every ``*.py`` file of
``kda/``, ``tests/``, ``benchmarks/``, ``scripts/`` and ``examples/``, for names, and those plus
the shell scripts, ``.ci/run`` and ``pyproject.toml``, for flags and variables. Pure Python: it
imports nothing of the package, so it runs in CI's first step.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import functools
import glob
import keyword
import re
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]

DOCUMENTS = (*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "benchmarks" / "README.md")
SOURCE_DIRS = ("kda", "tests", "benchmarks", "scripts", "examples")
TEXT_FILES = (".ci/run", "pyproject.toml")

# Files a document names that a run writes (not in the repository): name -> the file that writes
# it (which must spell the name: test_every_generated_output_is_written) and why it is cited.
GENERATED: dict[str, tuple[str, str]] = {
    name: ("scripts/gpu_check.sh", "the GPU check's report, written under $OUT (docs/gpu.md)")
    for name in ("summary.txt", "env.txt", "wheels.txt", "preflight.txt", "bench.txt", "bench.md", "fla.txt")
} | {
    "scripts/wheels/": ("scripts/fetch_gpu_wheels.sh", "the wheels fetched for an offline GPU machine"),
    "$KDA_BENCH_CACHE": ("benchmarks/llama_cpp.py", "where the benchmark builds llama.cpp's library"),
}

# Files a document names that belong to another project, by prefix, with the project.
ELSEWHERE: dict[str, str] = {
    "tests/ops/test_kda.py": "flash-linear-attention's KDA tests (benchmarks/run_fla_tests.py runs them)",
    "fla/ops/kda/": "flash-linear-attention's KDA package (kda.testing loads its naive reference)",
}

# Roots of dotted names that are another library's API (their names are not the repository's).
EXTERNAL_ROOTS: dict[str, str] = {
    "np": "NumPy",
    "torch": "PyTorch",
    "Tensor": "torch.Tensor",
    "jax": "JAX",
    "dask": "Dask",
    "Client": "dask.distributed.Client",
    "cupy": "CuPy",
    "cuda": "numba.cuda",
    "sys": "the standard library",
    "scipy": "SciPy",
    "ml_dtypes": "ml_dtypes",
    "transformers": "Hugging Face transformers",
    "vllm": "vLLM",
}

# Code spans that name something of another project that no source here spells, with the project.
OTHER_NAMES: dict[str, str] = {
    **dict.fromkeys(("sgemm", "dgemm"), "BLAS routines (docs/speed.md)"),
    **dict.fromkeys(
        ("selp", "mul.wide.u32", "ex2.approx.ftz.f32", "mul.f32", "ld.shared.v4"), "PTX instructions"
    ),
    **dict.fromkeys(("vcvtps2ph", "vcvtneps2bf16"), "x86 instructions"),
    **dict.fromkeys(("state_dict", "make_fx"), "PyTorch"),
    **dict.fromkeys(
        ("test_gate", "test_chunk_invalid_chunk_size", "test_chunk_use_beta_sigmoid_in_kernel"),
        "flash-linear-attention's tests (docs/adapters.md)",
    ),
}

# Documents about another project's code, which they may name freely: in them a span that does not
# resolve is accepted unless it points into this repository (a name rooted at one of its packages, a
# path under one of its folders, a command, a flag or a variable).
SUBJECTS: dict[str, str] = {"docs/vllm.md": "vLLM's classes, functions and files, which it describes"}

TOP_FOLDERS = ("kda", "docs", "tests", "benchmarks", "scripts", "examples", ".ci", "results")
SUFFIXES = (".py", ".md", ".json", ".txt", ".sh", ".c", ".toml", ".patch", ".png", ".yml", ".yaml", ".cfg")
IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
# the documents' mathematical notation, not code names: a symbol of one or two letters, a digit and
# a subscript at most (S, kg, Cp, U0, T_n, S_start)
NOTATION = re.compile(r"[A-Za-z]{1,2}[0-9]?(?:_[A-Za-z0-9]+)?")
CODE_NAME = re.compile(rf"{IDENTIFIER}(?:\.{IDENTIFIER})*")
ENV_ASSIGNMENT = re.compile(r"([A-Z][A-Z0-9_]*)=\S*")
COMMAND = re.compile(r"(?:env(?: -u \S+)* )?(python|bash|pip|pytest)\b(.*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
PYTHON = frozenset(keyword.kwlist) | frozenset(dir(builtins))


class Citation(NamedTuple):
    document: str
    line: int
    span: str


# ------------------------------------------------------------------ the documents


def citations(path: Path) -> list[Citation]:
    """Inline code spans of ``path`` outside fenced blocks (a span may run over a line break)."""
    lines = path.read_text().splitlines()
    kept, fenced = [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
            kept.append("")
            continue
        kept.append("" if fenced else line)
    text = "\n".join(kept)
    name = str(path.relative_to(ROOT))
    out = []
    for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        span = " ".join(match.group(1).split())
        out.append(Citation(name, text.count("\n", 0, match.start()) + 1, span))
    return out


def links(path: Path) -> list[Citation]:
    """Relative markdown link targets of ``path``."""
    name = str(path.relative_to(ROOT))
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z]+:|#", target):
                out.append(Citation(name, number, target.split("#", 1)[0]))
    return out


# ------------------------------------------------------------------ the sources


class Sources(NamedTuple):
    names: frozenset[str]  # every name defined anywhere
    strings: frozenset[str]  # identifier-like string constants
    torch_ops: frozenset[str]  # kda's torch ops: NAME of every "kda::NAME" string
    spelled: frozenset[str]  # every flag (--x) and word of every source and script
    shell_words: frozenset[str]  # the words of the shell scripts, the C source, .ci/run, pyproject.toml
    modules: dict[str, frozenset[str]]  # dotted module -> its top-level names
    stems: dict[str, list[str]]  # last component of a module -> dotted modules
    classes: dict[str, frozenset[str]]  # class name -> its members (over every class of that name)
    files: tuple[str, ...]  # every file and folder under the top folders, relative to the root


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        names |= _bound(node)
    return names


def _bound(node: ast.AST) -> set[str]:
    """Names a statement binds at its own level (ifs and trys looked into)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.If, ast.Try, ast.With)):
        body = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
        body += [s for h in getattr(node, "handlers", []) for s in h.body]
        return set().union(*(_bound(s) for s in body)) if body else set()
    return set()


def _members(node: ast.ClassDef) -> set[str]:
    members = set().union(*(_bound(s) for s in node.body)) if node.body else set()
    for sub in ast.walk(node):  # attributes set on self in the methods
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
            members.add(sub.attr)
    return members


@functools.lru_cache(maxsize=1)
def sources() -> Sources:
    names: set[str] = set()
    strings: set[str] = set()
    texts: list[str] = []
    modules: dict[str, frozenset[str]] = {}
    stems: dict[str, list[str]] = {}
    classes: dict[str, set[str]] = {}
    aliases: dict[str, set[str]] = {}
    torch_ops: set[str] = set()
    bases: dict[str, set[str]] = {}
    here = Path(__file__).resolve()  # this file spells stale names on purpose
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py")) if p.resolve() != here]
    for path in files:
        text = path.read_text()
        texts.append(text)
        with warnings.catch_warnings():  # a source's own warnings (an invalid escape) are ruff's to report
            warnings.simplefilter("ignore")
            tree = ast.parse(text, str(path))
        module = _module_name(path)
        modules[module] = frozenset(_top_level(tree))
        stems.setdefault(module.rsplit(".", 1)[-1], []).append(module)
        names.update(module.split("."))
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, set()).update(_members(node))
                bases.setdefault(node.name, set()).update(
                    b.id if isinstance(b, ast.Name) else b.attr
                    for b in node.bases
                    if isinstance(b, (ast.Name, ast.Attribute))
                )
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[-1])
                if node.asname and node.name.split(".")[0] in SOURCE_DIRS:
                    aliases.setdefault(node.asname, set()).add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                # option values, keys, the words of a schema or a message (not of a docstring)
                strings.update(re.findall(IDENTIFIER, node.value))
                torch_ops.update(re.findall(r"^kda::(\w+)$", node.value))
    for name in list(classes):  # inherited members, through the repository's own classes
        seen, todo = set(), list(bases.get(name, ()))
        while todo:
            base = todo.pop()
            if base in classes and base not in seen:
                seen.add(base)
                classes[name] |= classes[base]
                todo += bases.get(base, ())
    for alias, targets in aliases.items():  # `import kda.testing as kt`: kt.Problem
        stems.setdefault(alias, []).extend(m for m in sorted(targets) if m in modules)
    shell = [
        *(ROOT / "scripts").glob("*.sh"),
        *(ROOT / "benchmarks").glob("*.c"),
        *(ROOT / f for f in TEXT_FILES),
    ]
    shell_text = "\n".join(p.read_text() for p in shell if p.exists())
    files = [
        str(p.relative_to(ROOT))
        for top in TOP_FOLDERS
        for p in (ROOT / top).rglob("*")
        if "__pycache__" not in p.parts
    ]
    return Sources(
        frozenset(names),
        frozenset(strings),
        frozenset(torch_ops),
        frozenset(re.findall(rf"--[\w-]+|{IDENTIFIER}", "\n".join([*texts, shell_text]))),
        frozenset(re.findall(IDENTIFIER, shell_text)),
        modules,
        stems,
        {k: frozenset(v) for k, v in classes.items()},
        tuple(sorted(files)),
    )


# ------------------------------------------------------------------ resolving one span


def _path_exists(span: str, document: str) -> bool:
    candidate = span.rstrip("/")
    candidate = re.sub(r":\d+(?:-\d+)?$", "", candidate)  # file:line
    if "::" in candidate:  # a pytest node id: the file, then the test
        file, test = candidate.split("::", 1)
        path = ROOT / file
        return (
            path.is_file()
            and re.search(rf"def {re.escape(test.split('[')[0])}\(", path.read_text()) is not None
        )
    alternatives = [candidate]
    while any("{" in a for a in alternatives):  # {a,b} alternatives
        expanded = []
        for a in alternatives:
            m = re.search(r"\{([^{}]*)\}", a)
            if m is None:
                expanded.append(a)
                continue
            expanded += [a[: m.start()] + part + a[m.end() :] for part in m.group(1).split(",")]
        alternatives = expanded
    folders = (ROOT, (ROOT / document).parent)
    files = sources().files
    return all(
        any(glob.glob(str(folder / a)) for folder in folders)
        or any(fnmatch.fnmatch(f, f"*/{a}") for f in files)  # a tail: `_backend.py`, `results/x.txt`
        for a in alternatives
    )


def _is_path(span: str) -> bool:
    """A file citation: no spaces, and under one of the repository's top folders (or the
    benchmarks' ``results/``), or ending in a file suffix, or a generated or outside file."""
    if _known_elsewhere(span):
        return True
    if not re.fullmatch(r"[\w.$~*{},:/-]+", span):
        return False
    return (span.split("/", 1)[0] in TOP_FOLDERS and "/" in span) or span.endswith(SUFFIXES)


def _known_elsewhere(span: str) -> bool:
    return span.rstrip("/") in {g.rstrip("/") for g in GENERATED} or span.startswith(tuple(ELSEWHERE))


def _resolve_dotted(parts: list[str], src: Sources) -> bool:
    """A dotted name: a module (by full path or by its last component) and then its members, or a
    class and then a member."""
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        found = [head] if head in src.modules else (src.stems.get(head, []) if cut == 1 else [])
        if found:
            rest = parts[cut:]
            if not rest:
                return True
            for module in found:
                if rest[0] in src.modules[module] or f"{module}.{rest[0]}" in src.modules:
                    if len(rest) == 1 or _resolve_members(rest[0], rest[1:], src):
                        return True
            return False
    return parts[0] in src.classes and _resolve_members(parts[0], parts[1:], src)


def _resolve_members(owner: str, rest: list[str], src: Sources) -> bool:
    if not rest:
        return True
    if owner not in src.classes:  # a module-level value's attribute: not followed further
        return rest[0] in src.names or rest[0] in src.strings
    return rest[0] in src.classes[owner] and (len(rest) == 1 or _resolve_members(rest[0], rest[1:], src))


def _spelled(word: str, src: Sources) -> bool:
    """Whether ``word`` (a flag, a variable) occurs whole in the sources' text."""
    return word in src.spelled


def problem(citation: Citation) -> str | None:
    """Why ``citation`` does not resolve, or None when it does (or is prose)."""
    why = _problem(citation)
    if why is None or citation.document not in SUBJECTS:
        return why
    span = citation.span
    ours = (
        COMMAND.fullmatch(span)
        or span.startswith("--")
        or ENV_ASSIGNMENT.match(span)
        or span.split(".", 1)[0] in ("kda", "benchmarks", "tests", "scripts")
        or span.split("/", 1)[0] in TOP_FOLDERS
    )
    return why if ours else None


def _problem(citation: Citation) -> str | None:
    span, src = citation.span, sources()
    command = COMMAND.fullmatch(span)
    if command:
        program, args = command.groups()
        words = [w for w in re.split(r"[\s\[\]|]+", args) if w]
        if program == "python" and words[:1] == ["-m"] and len(words) > 1:
            module = words[1]
            if module.split(".")[0] not in ("kda", "benchmarks"):
                return None  # another program's flags (pytest, pip)
            if "<" not in module and module not in src.modules:  # `benchmarks.<name>`: a placeholder
                return f"no module {module}"
        elif program in ("python", "bash") and words and words[0].endswith((".py", ".sh")):
            if "<" not in words[0] and not _path_exists(words[0], citation.document):
                return f"no file {words[0]}"
        else:
            return None
        missing = [f for f in FLAG.findall(args) if not _spelled(f, src)]
        return f"flags {missing} occur nowhere in the sources" if missing else None
    if span.startswith("--"):  # a flag cited alone (`--one-core`, `--shapes 1x4096 8x512`)
        missing = [f for f in FLAG.findall(span) if not _spelled(f, src)]
        return f"flags {missing} occur nowhere in the sources" if missing else None
    if span.startswith(("http://", "https://")) or " " in span:
        env = ENV_ASSIGNMENT.match(span)
        if env and not _spelled(env.group(1), src):
            return f"variable {env.group(1)} occurs nowhere in the sources"
        return None
    env = ENV_ASSIGNMENT.fullmatch(span)
    if env:
        return (
            None if _spelled(env.group(1), src) else f"variable {env.group(1)} occurs nowhere in the sources"
        )
    name = span.removesuffix("()")
    if name in OTHER_NAMES:
        return None
    if _is_path(name):
        if _known_elsewhere(name) or _path_exists(name, citation.document):
            return None
        return f"no file {name}"
    if not CODE_NAME.fullmatch(name):
        return None
    parts = name.split(".")
    if len(parts) == 1:
        if NOTATION.fullmatch(name):
            return None
        if name in PYTHON or name in src.names or name in src.strings or name in src.shell_words:
            return None
        return f"{name} is defined nowhere in the sources"
    if parts[:3] == ["torch", "ops", "kda"] and len(parts) == 4:  # kda's own torch op: defined by name
        return None if parts[3] in src.torch_ops else f"no torch op kda::{parts[3]} is defined in the sources"
    if parts[0] in EXTERNAL_ROOTS and parts[0] not in src.stems and parts[0] not in src.classes:
        return None
    if _resolve_dotted(parts, src):
        return None
    if parts[0] in EXTERNAL_ROOTS:
        return None
    return f"{name} does not resolve to a module, class or member in the sources"


# ------------------------------------------------------------------ the tests


def test_every_cited_name_and_file_resolves():
    """Every code span of every document resolves (see the module's docstring for the rules)."""
    bad = [
        f"{c.document}:{c.line}: `{c.span}`: {why}"
        for d in DOCUMENTS
        for c in citations(d)
        if (why := problem(c))
    ]
    assert not bad, "\n".join(bad)


def test_every_relative_link_resolves():
    bad = [
        f"{c.document}:{c.line}: ({c.span})"
        for d in DOCUMENTS
        for c in links(d)
        if c.span and not _path_exists(c.span, c.document)
    ]
    assert not bad, "\n".join(bad)


def test_every_generated_output_is_written():
    """Each allowed generated output is spelled by the file said to write it, and is not in the
    repository (else it would need no allowance)."""
    for name, (writer, _) in GENERATED.items():
        assert name.rstrip("/") in (ROOT / writer).read_text(), (name, writer)
        assert not (ROOT / name).exists() or name.endswith("/"), name


def test_allowances_are_used():
    """Every allowance is still needed by some document (a stale allowance hides nothing but rots)."""
    spans = {c.span.removesuffix("()") for d in DOCUMENTS for c in citations(d)}
    unused = [n for n in OTHER_NAMES if n not in spans]
    unused += [p for p in (*GENERATED, *ELSEWHERE) if not any(s.startswith(p) for s in spans)]
    unused += [r for r in EXTERNAL_ROOTS if not any(s.split(".")[0] == r for s in spans)]
    assert not unused, unused


@pytest.mark.parametrize(
    "span",
    [
        "_load_gate",  # a function that was removed
        "kda._engine.chunked.no_such_function",
        "ChunkCore.no_such_method",
        "kda/no_such_module.py",
        "benchmarks/results/no_such_run.txt",
        "python -m benchmarks.llama_cpp --no-such-flag",
        "python -m benchmarks.no_such_benchmark",
        "KDA_NO_SUCH_VARIABLE=1",
        "torch.ops.kda.no_such_op",
        "--no-such-flag N",
    ],
)
def test_a_stale_citation_is_caught(span):
    """The checker fails on names, paths, flags and variables that do not exist."""
    assert problem(Citation("docs/design.md", 1, span)) is not None


@pytest.mark.parametrize("span", ["kda.vllm.no_such_name", "kda/vllm/no_such_file.py", "--no-such-flag"])
def test_a_document_about_another_project_is_held_on_this_ones_names(span):
    """docs/vllm.md may name vLLM's code freely, but not a stale name of this repository's."""
    assert problem(Citation("docs/vllm.md", 1, span)) is not None
    assert problem(Citation("docs/vllm.md", 1, "CpuPlatform.check_and_update_config")) is None


@pytest.mark.parametrize(
    "span",
    [
        "kda.chunk_kda",
        "kda._threads.PIN",
        "ChunkCore.forward",
        "kda/_engine/core.py",
        "python -m benchmarks.llama_cpp --one-core",
        "B=1 H=16 T=4096",
        "g = -inf",
        "np.dot",
        "torch.ops.kda.forward",
    ],
)
def test_a_real_citation_passes(span):
    assert problem(Citation("docs/design.md", 1, span)) is None
