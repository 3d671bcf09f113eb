"""The README's front page holds: its example runs as written, and its links and layout are real."""

from __future__ import annotations

import re

import numpy as np
from helpers import ROOT

import kda

README = (ROOT / "README.md").read_text()


def test_readme_example_runs_and_matches_the_recurrence():
    """The README's Python example, as written; its output agrees with the float64 recurrence."""
    block = README.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    x64 = [scope[n].astype(np.float64) for n in ("q", "k", "v", "g", "beta")]
    want = kda.recurrent_kda(*x64).output
    err = np.max(np.abs(scope["out"].output - want)) / np.max(np.abs(want))
    assert err <= 1e-5, err
    assert scope["grads"].q.shape == scope["q"].shape and np.isfinite(scope["grads"].q).all()


def test_readme_links_and_paths_exist():
    """Every repository path the README names in backticks (docs, benchmarks, kda modules) exists."""
    paths = set(re.findall(r"`((?:docs|benchmarks|kda|tests|examples)/[\w./-]*)`", README))
    assert paths, "the README names no paths"
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    assert not missing, missing


def test_readme_is_a_front_page():
    """At most 250 lines, and the first bash block is the two commands CI runs first."""
    assert len(README.splitlines()) <= 250
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(block) == 2 and block[0].startswith("pip install -e . && python -m kda")
