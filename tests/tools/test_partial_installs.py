"""Collection works in every combination of installed extras: ``python -m pytest --collect-only``
in a subprocess where some optional packages look uninstalled.

CI installs either no extra (step 1) or all of them (step 2); a module-level skip that works in
those two can still break collection in between (``pip install -e ".[test,torch]"``: torch without
transformers). Here a ``sitecustomize`` module on ``PYTHONPATH`` hides the packages named in
``KDA_HIDE_PACKAGES`` from every import finder, so that ``import transformers`` raises
``ModuleNotFoundError`` and ``importlib.util.find_spec("transformers")`` returns None, as on a
machine where it is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT

SITECUSTOMIZE = '''
import os
import sys

HIDDEN = tuple(n for n in os.environ.get("KDA_HIDE_PACKAGES", "").split(",") if n)


def _hidden(name):
    return any(name == h or name.startswith(h + ".") for h in HIDDEN)


class _Hide:
    """A finder of sys.meta_path that finds nothing of the hidden packages."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if _hidden(name):
            return None
        find = getattr(self._finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


if HIDDEN:
    sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
'''

# name -> the packages that look uninstalled (import names, with what depends on them)
PARTIAL = {
    "torch without transformers": ("transformers", "accelerate"),
    "no torch": ("torch", "transformers", "accelerate", "fla"),
    "no jax": ("jax", "jaxlib"),
    "no dask": ("dask", "distributed"),
    "no numba-cuda": ("numba_cuda", "cupy"),
}


def _collect(tmp_path, hidden: tuple[str, ...], *paths: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    # not CI's switches: KDA_REQUIRE_* would fail the hidden packages' tests, and KDA_RECORD_SKIPPED would
    # overwrite the skip list of the run this test is part of (.ci/run step 1)
    drop = ("KDA_REQUIRE_", "KDA_RECORD_SKIPPED", "PYTEST_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["KDA_HIDE_PACKAGES"] = ",".join(hidden)
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_hiding_works(tmp_path):
    """A hidden module neither imports nor is found; the others are untouched."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    code = (
        "import importlib.util\n"
        "try:\n    import csv\n    got = 'imported'\n"
        "except ModuleNotFoundError:\n    got = 'missing'\n"
        "print(got, importlib.util.find_spec('csv'), importlib.util.find_spec('json') is not None)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "KDA_HIDE_PACKAGES": "csv"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["missing", "None", "True"], r.stderr
    env["KDA_HIDE_PACKAGES"] = ""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.split()[0] == "imported", r.stderr


@pytest.mark.parametrize("case", list(PARTIAL))
def test_collection_succeeds_with_some_extras_missing(tmp_path, case):
    r = _collect(tmp_path, PARTIAL[case])
    errors = r.stdout[r.stdout.find("= ERRORS =") :] if "= ERRORS =" in r.stdout else r.stdout[-2000:]
    assert r.returncode == 0, f"{case}: collection exited {r.returncode}\n{errors}\n{r.stderr[-2000:]}"
    assert "tests collected" in r.stdout, r.stdout[-2000:]
