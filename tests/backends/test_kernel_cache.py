"""The CPU kernels' Numba cache across their modules: a kernel that calls compiled helpers of
another module is recompiled when that module changes (Numba alone checks only the kernel's own
file), and loaded from the cache when nothing changed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers import BACKENDS, ROOT

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="numba or scipy not installed")

_RUN = """
import numpy as np
import kda
from kda.cpu._kernels import forward_heads
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, 20, 4), dtype=np.float32) for _ in range(3))
g = -rng.uniform(0, 1, (1, 1, 20, 4)).astype(np.float32)
beta = rng.uniform(0, 1, (1, 1, 20)).astype(np.float32)
kda.chunk_kda(q, k, v, g, beta, chunk_size=16, backend="cpu")
stats = forward_heads.stats
print("hits", sum(stats.cache_hits.values()), "misses", sum(stats.cache_misses.values()))
"""


def test_source_stamp_covers_every_kernel_module(tmp_path):
    """The stamp is a hash of all kernel modules: it changes when any one of them changes."""
    from kda.cpu import _compile

    here = ROOT / "kda" / "cpu"
    for name in _compile.KERNEL_FILES:
        shutil.copy(here / name, tmp_path / name)
    before = _compile.source_stamp(str(tmp_path))
    assert before == _compile.SOURCE_STAMP
    for name in _compile.KERNEL_FILES:
        with open(tmp_path / name, "a") as f:
            f.write("\n")
        after = _compile.source_stamp(str(tmp_path))
        assert after != before, name
        before = after


@pytest.mark.slow
def test_a_changed_helper_module_recompiles_the_kernels_that_call_it(tmp_path):
    """forward_heads (``_fused.py``) calls ``_mm`` (``_products.py``): a copy of the package
    compiled into a fresh cache, run again (loaded from the cache), then run after
    ``_products.py`` changed (compiled again)."""
    shutil.copytree(ROOT / "kda", tmp_path / "kda", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path)}

    def run() -> str:
        r = subprocess.run(
            [sys.executable, "-c", _RUN], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().splitlines()[-1]

    assert run() == "hits 0 misses 1"
    assert run() == "hits 1 misses 0"
    with open(tmp_path / "kda" / "cpu" / "_products.py", "a") as f:
        f.write("\n# changed\n")
    assert run() == "hits 0 misses 1"
