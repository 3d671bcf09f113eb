"""Shared test helpers: hypothesis profiles, problem generation, ``assert_close``."""

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
