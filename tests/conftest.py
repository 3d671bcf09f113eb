"""The suite's setup: the CUDA simulator where no GPU is present, hypothesis profiles, the
backend fixtures; the shared helpers (problem generation, ``assert_within``) are in tests/helpers.py."""

from __future__ import annotations

import os

from helpers import HAS_GPU  # helpers imports nothing of numba

# The CUDA backend's tests run on Numba's simulator where no GPU is present; the variable must
# be set before numba is first imported.
if not HAS_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=100,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

import importlib  # noqa: E402

import pytest  # noqa: E402
from helpers import BACKENDS  # noqa: E402  (after the simulator switch: it looks numba up)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Every backend that can run here, by name (cuda under Numba's simulator without a GPU)."""
    return request.param


@pytest.fixture
def ops(backend):
    """The backend module of :func:`backend` (the primitives of kda._backend)."""
    return importlib.import_module(f"kda.{backend}")


# ------------------------------------------------------------------ what a run skipped, for CI
# With KDA_RECORD_SKIPPED=<file>, the node ids of every test (and module) this run skipped are
# written to <file>, one per line. .ci/run runs the README's test command on a fresh venv without
# any extra first, then installs the extras and runs exactly what that run skipped.
_SKIPPED: list[str] = []


def pytest_collectreport(report):
    if report.skipped and os.environ.get("KDA_RECORD_SKIPPED"):
        _SKIPPED.append(report.nodeid)


def pytest_runtest_logreport(report):
    if report.skipped and os.environ.get("KDA_RECORD_SKIPPED"):
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session):
    path = os.environ.get("KDA_RECORD_SKIPPED")
    if path and not hasattr(session.config, "workerinput"):  # pytest-xdist: the controller writes
        with open(path, "w", encoding="utf-8") as fh:
            fh.writelines(f"{nodeid}\n" for nodeid in dict.fromkeys(_SKIPPED))


# ------------------------------------------------------------------ the `cuda` marker
# Every test that runs kda.cuda's kernels (on a GPU, or under Numba's simulator) is marked `cuda`,
# so that scripts/gpu_check.sh selects them by what they test (`-m cuda`) wherever they live: tests
# marked so explicitly (tests/backends/test_cuda.py, test_ptx.py), tests parametrised with the
# cuda backend, and tests whose name says they use CUDA or CuPy.
def _uses_cuda(item) -> bool:
    if item.get_closest_marker("cuda") is not None:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    if any(isinstance(value, str) and value == "cuda" for value in params.values()):
        return True
    return any(word in item.name.lower() for word in ("cuda", "cupy"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _uses_cuda(item):
            item.add_marker(pytest.mark.cuda)
