"""Problem generation and the one comparison helper of the test suite."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# zero: no decay; weak: g ~ -U(0, 0.02), couplings reach hundreds of steps (as in the README);
# mild: -U(0, 1); strong: -1e-3 .. -1e3; hard: some -1e4; reset: some -inf
REGIMES = ("zero", "weak", "mild", "strong", "hard", "reset")

def _backends() -> tuple[str, ...]:
    """The backends whose tests run here: the reference always; cpu where numba and scipy are
    installed; cuda where numba-cuda imports (on the simulator without a GPU: tests/conftest.py
    sets NUMBA_ENABLE_CUDASIM first)."""
    import importlib.util

    names = ["reference"]
    if all(importlib.util.find_spec(name) is not None for name in ("numba", "scipy")):
        names.append("cpu")
    if importlib.util.find_spec("numba") is not None and importlib.util.find_spec("numba.cuda") is not None:
        names.append("cuda")
    return tuple(names)


BACKENDS = _backends()


def has_gpu() -> bool:
    """Whether a real CUDA GPU is present (the one place the tests decide it)."""
    import os

    return os.path.exists("/dev/nvidiactl")


# max-abs error over max-abs of the float64 recurrence
TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5}


def to_numpy(x: Any) -> np.ndarray:
    """Any array (NumPy, array-api-strict, torch CPU, ...) as a NumPy array."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        import torch

        return x.detach().to(torch.float64).numpy() if x.dtype == torch.bfloat16 else x.numpy()
    return np.from_dlpack(x)


def assert_close(actual: Any, expected: Any, *, tol: float, dtype: Any = None, name: str = "") -> float:
    """Check shape, then dtype, then ``max|actual - expected| <= tol * max|expected|``.

    ``dtype`` is the dtype ``actual`` must have (default: that of ``expected``). On failure the
    message gives the worst element, its index and both values. Returns the relative error.
    """
    a, e = to_numpy(actual), to_numpy(expected)
    label = f"{name}: " if name else ""
    assert a.shape == e.shape, f"{label}shape {a.shape} != expected {e.shape}"
    if not (isinstance(dtype, str) and dtype == "any"):
        want = np.dtype(dtype) if dtype is not None else e.dtype
        assert a.dtype == want, f"{label}dtype {a.dtype} != expected {want}"
    if a.size == 0:
        return 0.0
    a64, e64 = a.astype(np.float64), e.astype(np.float64)
    assert np.all(np.isfinite(a64)), f"{label}{np.sum(~np.isfinite(a64))} non-finite elements"
    err = np.abs(a64 - e64)
    # a reference below the normal range of the result's dtype cannot be matched relatively
    floor = float(np.finfo(a.dtype).tiny) if np.issubdtype(a.dtype, np.floating) else 0.0
    scale = max(float(np.max(np.abs(e64))), floor)
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    rel = float(err[worst]) / scale if scale > 0 else float(err[worst])
    assert rel <= tol, (
        f"{label}max-abs error {float(err[worst]):.3e} over max-abs reference {scale:.3e} = {rel:.3e} "
        f"> {tol:.1e}; worst at {tuple(int(i) for i in worst)}: got {a64[worst]!r}, expected {e64[worst]!r}"
    )
    return rel


@dataclass
class Problem:
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

    def astype(self, dtype: Any) -> Problem:
        """Inputs in ``dtype``; states in float64 for float64, float32 otherwise."""
        state_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32

        def cast(x, d):
            return None if x is None else x.astype(d)

        return Problem(
            *(x.astype(dtype) for x in self.inputs),
            cast(self.initial_state, state_dtype),
            self.grad_output.astype(dtype),
            cast(self.grad_final_state, state_dtype),
        )


def gates(rng: np.random.Generator, shape: tuple[int, ...], regime: str) -> np.ndarray:
    """Log decays ``g <= 0`` of one regime."""
    if regime == "zero":
        return np.zeros(shape)
    if regime == "weak":  # decays by about e^-0.01 a step: couplings ~100 steps apart still count
        return -rng.uniform(0.0, 0.02, shape)
    mild = -rng.uniform(0.0, 1.0, shape)
    if regime == "mild":
        return mild
    if regime == "strong":  # spans -1e-3 .. -1e3
        return -(10.0 ** rng.uniform(-3.0, 3.0, shape))
    if regime == "hard":  # some channels decay by exp(-1e4) at some steps
        return np.where(rng.uniform(size=shape) < 0.2, -1e4, mild)
    if regime == "reset":  # -inf: hard resets of random channels at random steps
        return np.where(rng.uniform(size=shape) < 0.15, -np.inf, mild)
    raise ValueError(regime)


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
) -> Problem:
    """A float64 problem; keys L2-normalised per step, queries and values not."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, T, K))
    k = rng.standard_normal((B, H, T, K))
    k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    v = rng.standard_normal((B, H, T, V))
    g = gates(rng, (B, H, T, K), regime)
    beta = rng.uniform(0.0, 2.0, (B, H, T))
    s0 = rng.standard_normal((B, H, K, V)) if with_state else None
    do = rng.standard_normal((B, H, T, V))
    ds = rng.standard_normal((B, H, K, V)) if with_grad_state else None
    return Problem(q, k, v, g, beta, s0, do, ds)


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
    seed: int, B: int, H: int, T: int, K: int, V: int, *, G: int = 1, layout: str = "head_first",
    gate: str = "log", qk_l2norm: bool = False, beta_activation: str | None = None,
    cu_seqlens: tuple[int, ...] | None = None, regime: str = "mild", no_A_log: bool = False,
) -> ModelProblem:  # fmt: skip
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
        g = gates(rng, (B, HV, T, K), regime)
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
