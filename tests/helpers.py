"""Fixed-case problem generation for the test suite; regimes, gates and the comparison come from
kda.testing (the strategies and the comparison kernel authors use). No name here is one that
kda.testing exports (tests/tools/test_no_shadowing.py): a test that imports ``assert_close`` or
``Problem`` gets kda.testing's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import kda.testing as kt

# the repository root (tests are grouped in folders below tests/)
ROOT = Path(__file__).resolve().parents[1]


def _backends() -> tuple[str, ...]:
    """The backends whose tests run here, from kda's capability table (kda._backend.CAPABILITIES):
    the reference always; cpu where numba and scipy are installed; cuda where numba-cuda is (on
    the simulator without a GPU: tests/conftest.py sets NUMBA_ENABLE_CUDASIM first). The table
    looks the packages up without importing them (numba must not be imported before
    tests/conftest.py switches the simulator on)."""
    from kda._backend import installed_backends

    return installed_backends()


BACKENDS = _backends()


def has_gpu() -> bool:
    """Whether a real CUDA GPU is present (the one place the tests decide it)."""
    import os

    return os.path.exists("/dev/nvidiactl")


HAS_GPU = has_gpu()


# max-abs error over max-abs of the float64 recurrence: kda holds its own kernels to these fixed
# tolerances, stricter than kda.testing's problem-dependent float32 error scale (docs/testing.md)
TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5}


def assert_within(
    actual: Any, expected: Any, *, tol: float, dtype: Any = None, name: str = "", floor: float = 0.0
) -> float:
    """Check shape, then dtype, then kda.testing's comparison with the fixed tolerance ``tol``
    (``max|actual - expected| <= tol * max|expected|``, actual finite where expected is), where
    :func:`kda.testing.assert_close` takes the tolerance of a dtype and checks no dtype.

    ``dtype`` is the dtype ``actual`` must have (default: that of ``expected``; ``"any"``: not
    checked). ``floor``: an absolute error up to it passes whatever ``max|expected|`` is (e.g.
    float32's smallest normal, where results below it are flushed to zero). Returns the relative
    error (over ``max(max|expected|, floor / tol)``).
    """
    a, e = kt.to_numpy(actual), kt.to_numpy(expected)
    label = f"{name}: " if name else ""
    assert a.shape == e.shape, f"{label}shape {a.shape} != expected {e.shape}"
    if not (isinstance(dtype, str) and dtype == "any"):
        want = np.dtype(dtype) if dtype is not None else e.dtype
        assert a.dtype == want, f"{label}dtype {a.dtype} != expected {want}"
    scale = np.asarray(floor / tol) if floor > 0 else None
    return kt.compare(a, e, dtype="float64", tol=tol, name=name, scale=scale) * tol


@dataclass
class FixedProblem:
    """A float64 problem of :func:`make_problem`: the arrays themselves (where
    :class:`kda.testing.Problem` describes a call by its seed, shapes and options)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    beta: np.ndarray
    initial_state: np.ndarray | None
    grad_output: np.ndarray
    grad_final_state: np.ndarray | None

    @property
    def inputs(self) -> tuple[np.ndarray, ...]:
        return self.q, self.k, self.v, self.g, self.beta

    def astype(self, dtype: Any) -> FixedProblem:
        """Inputs in ``dtype``; states in float64 for float64, float32 otherwise."""
        state_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32

        def cast(x, d):
            return None if x is None else x.astype(d)

        return FixedProblem(
            *(x.astype(dtype) for x in self.inputs),
            cast(self.initial_state, state_dtype),
            self.grad_output.astype(dtype),
            cast(self.grad_final_state, state_dtype),
        )


def make_problem(
    seed: int,
    B: int,
    H: int,
    T: int,
    K: int,
    V: int,
    regime: str = "mild",
    *,
    with_state: bool = True,
    with_grad_state: bool = True,
) -> FixedProblem:
    """A float64 problem; keys L2-normalised per step, queries and values not."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, T, K))
    k = rng.standard_normal((B, H, T, K))
    k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    v = rng.standard_normal((B, H, T, V))
    g = kt.gates(rng, (B, H, T, K), regime)
    beta = rng.uniform(0.0, 2.0, (B, H, T))
    s0 = rng.standard_normal((B, H, K, V)) if with_state else None
    do = rng.standard_normal((B, H, T, V))
    ds = rng.standard_normal((B, H, K, V)) if with_grad_state else None
    return FixedProblem(q, k, v, g, beta, s0, do, ds)


@dataclass
class ModelProblem:
    """A float64 problem with options; ``kwargs`` are the keyword options of the call."""

    inputs: tuple[np.ndarray, ...]
    initial_state: np.ndarray
    grad_output: np.ndarray
    grad_final_state: np.ndarray
    kwargs: dict[str, Any] = field(default_factory=dict)

    def astype(self, dtype) -> ModelProblem:
        state = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        kwargs = {
            n: (x.astype(dtype) if isinstance(x, np.ndarray) and n != "cu_seqlens" else x)
            for n, x in self.kwargs.items()
        }
        return ModelProblem(
            tuple(x.astype(dtype) for x in self.inputs),
            self.initial_state.astype(state),
            self.grad_output.astype(dtype),
            self.grad_final_state.astype(state),
            kwargs,
        )


def make_model_problem(
    seed: int,
    B: int,
    H: int,
    T: int,
    K: int,
    V: int,
    *,
    G: int = 1,
    layout: str = "head_first",
    gate: str = "log",
    qk_l2norm: bool = False,
    beta_activation: str | None = None,
    cu_seqlens: tuple[int, ...] | None = None,
    regime: str = "mild",
    no_A_log: bool = False,
) -> ModelProblem:
    """Inputs as a layer feeds them: raw gates and beta logits where the options take them."""
    rng = np.random.default_rng(seed)
    HV = H * G
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q = rng.standard_normal((B, H, T, K))
    k = rng.standard_normal((B, H, T, K))
    if qk_l2norm:
        k = k * rng.uniform(0.2, 3.0, (B, H, T, 1))  # unnormalised: the option normalises
    else:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, HV, T, V))
    kwargs: dict[str, Any] = {"layout": layout}
    if gate == "log":
        g = kt.gates(rng, (B, HV, T, K), regime)
    else:
        g = 3 * rng.standard_normal((B, HV, T, K))
        kwargs.update(gate=gate, dt_bias=rng.standard_normal((HV, K)))
        if not (gate == "lower_bound" and no_A_log):
            kwargs["A_log"] = rng.uniform(-2.0, 1.0, HV)
        if gate == "lower_bound":
            kwargs["lower_bound"] = -5.0
    if beta_activation is None:
        beta = rng.uniform(0.0, 1.0, (B, HV, T))
    else:
        beta = 2 * rng.standard_normal((B, HV, T))
        kwargs["beta_activation"] = beta_activation
    if qk_l2norm:
        kwargs["qk_l2norm"] = True
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = np.asarray(cu_seqlens, dtype=np.int64)
    arrays = [q, k, v, g, beta]
    do = rng.standard_normal((B, HV, T, V))
    if layout == "time_major":
        arrays = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in arrays]
        do = np.ascontiguousarray(np.swapaxes(do, 1, 2))
    s0 = rng.standard_normal((N, HV, K, V))
    ds = rng.standard_normal((N, HV, K, V))
    return ModelProblem(tuple(arrays), s0, do, ds, kwargs)


def fla_naive(fresh: bool = False):
    """fla's naive reference module (``fla/ops/kda/naive.py``), through kda's one loader; skips the
    calling test where fla-core, torch or einops is missing, and fails it with KDA_REQUIRE_FLA=1
    (CI installs them: there the comparisons must run)."""
    import os

    import pytest

    from kda.testing import load_fla_naive

    module, reason = load_fla_naive(fresh=fresh)
    if module is None:
        if os.environ.get("KDA_REQUIRE_FLA") == "1":
            pytest.fail(f"KDA_REQUIRE_FLA=1 but {reason}")
        pytest.skip(reason)
    return module


def fla_naive_gates() -> dict:
    """fla's ``naive_kda_gate`` and ``naive_kda_lowerbound_gate``: ``gate.py`` imports triton at
    module level, so only those functions' source is executed (torch and ``F`` in scope)."""
    import importlib.util
    from pathlib import Path

    import torch

    fla_naive()  # the same skip / fail rules
    root = Path(importlib.util.find_spec("fla").origin).parent / "ops" / "kda"
    source = (root / "gate.py").read_text()
    names: dict = {}
    for fn in ("naive_kda_gate", "naive_kda_lowerbound_gate"):
        start = source.index(f"def {fn}(")
        end = source.index("\n\n\n", start)
        exec(
            compile(source[start:end], str(root / "gate.py"), "exec"),
            {"torch": torch, "F": torch.nn.functional},
            names,
        )
    return names


def spy_direct_decode_route(monkeypatch) -> list[bool]:
    """Record, per call, whether kda's direct NumPy decode route served it (returned an output)."""
    import kda._entry.decode as entry

    served, direct = [], entry._numpy_route

    def spy(*args, **kwargs):
        out = direct(*args, **kwargs)
        served.append(out is not None)
        return out

    monkeypatch.setattr(entry, "_numpy_route", spy)
    return served


def decline_direct_decode_route(monkeypatch) -> None:
    """Send every decode call the general way (the direct route declines each one)."""
    import kda._entry.decode as entry

    monkeypatch.setattr(entry, "_numpy_route", lambda *args, **kwargs: None)
