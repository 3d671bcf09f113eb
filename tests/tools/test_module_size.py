"""Module size: every host module of ``kda`` holds at most :data:`LIMIT` lines; only the kernel
modules named in :data:`KERNEL_MODULES` (Numba or Numba-CUDA kernel source, with their reason)
may hold more."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 500

# kernel source over the limit, and why it stays in one module
KERNEL_MODULES = {
    "kda/cuda/local.py": (
        "Numba-CUDA kernels of the per-chunk work and its gradient: one builder each over device "
        "functions they share, and the launchers beside them that pass their argument kinds"
    ),
    "kda/cuda/state_pass.py": (
        "Numba-CUDA kernels of the state passes, forward and gradient in two cuts each, over device "
        "functions they share, and their launchers"
    ),
    "kda/cpu/_decode_kernels.py": (
        "the Numba decode kernel, its K-major and V-major steps and the LLVM intrinsics they are "
        "compiled from (16-bit pool loads and stores, fused multiply-adds, row updates by lanes)"
    ),
}

# host modules over the limit whose split by job is not done yet (each leaves this list with it)
NOT_YET_SPLIT: dict[str, str] = {}


def sizes(root: Path) -> dict[str, int]:
    """``kda/....py`` -> its number of lines, for every module under ``root``."""
    return {
        p.relative_to(root).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
        for p in (root / "kda").rglob("*.py")
    }


def oversized(root: Path) -> dict[str, int]:
    """The host modules over :data:`LIMIT` lines (the kernel modules left out)."""
    exempt = KERNEL_MODULES.keys() | NOT_YET_SPLIT.keys()
    return {p: n for p, n in sorted(sizes(root).items()) if n > LIMIT and p not in exempt}


def test_host_modules_are_at_most_500_lines():
    over = oversized(ROOT)
    assert not over, f"host modules over {LIMIT} lines (split them by job): {over}"


def test_the_kernel_modules_are_kernel_source_over_the_limit():
    """Each named module exists, is over the limit (else it leaves the list) and compiles Numba or
    Numba-CUDA kernels."""
    found = sizes(ROOT)
    for path, reason in KERNEL_MODULES.items():
        assert path in found, f"{path} is named a kernel module but does not exist"
        assert found[path] > LIMIT, f"{path} holds {found[path]} lines: no exception needed, remove it"
        assert reason
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        numba = any(m.split(".")[0] == "numba" for m in imported)
        assert numba, f"{path} imports no Numba: not kernel source"


def test_the_modules_not_yet_split_are_over_the_limit():
    """A module split (or removed) leaves :data:`NOT_YET_SPLIT`."""
    found = sizes(ROOT)
    done = [p for p in NOT_YET_SPLIT if found.get(p, 0) <= LIMIT]
    assert not done, f"within {LIMIT} lines or gone, remove them from NOT_YET_SPLIT: {done}"


def test_the_size_check_sees_a_long_module(tmp_path):
    """The check itself: one module more, a line over the limit, in a copy of the tree."""
    for path in sizes(ROOT):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text((ROOT / path).read_text(encoding="utf-8"), encoding="utf-8")
    assert oversized(tmp_path) == oversized(ROOT)
    (tmp_path / "kda" / "_long.py").write_text("x = 1\n" * (LIMIT + 1))
    assert oversized(tmp_path) == {**oversized(ROOT), "kda/_long.py": LIMIT + 1}
