"""Problems: the inputs of one KDA call (float64 masters, the dtype to cast to, options, chunk size),
and the gate regimes they are drawn in; the hypothesis strategy that draws them is in :mod:`._draw`.

A :class:`Problem` is a small frozen record of parameters; its arrays are generated from them
(``seed`` drives NumPy's generator), so ``repr(problem)`` is a runnable reproducer.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import InvalidInputError
from .._options.table import BETA_ACTIVATIONS, GATES, LAYOUTS

__all__ = [
    "DTYPES",
    "LOG_REGIMES",
    "REGIMES",
    "SIZE_CLASSES",
    "Problem",
    "gates",
    "round_to",
]

DTYPES = ("float64", "float32", "float16", "bfloat16")
# Log-gate regimes (kda's own tests use these eight): zero: no decay; weak: g ~ -U(0, 0.02),
# couplings reach hundreds of steps; mild: -U(0, 1); steep: -U(0, 10) (median -5: decay products
# inside a chunk fall through the subnormal floats); kimi: Kimi Linear's gate formula
# -exp(A_log) softplus(a) with A_log = log U(1, 16) per head, a ~ N(0, 1) (median about -4.5);
# strong: -1e-3 .. -1e3; hard: some -1e4; reset: some -inf.
LOG_REGIMES = ("zero", "weak", "mild", "steep", "kimi", "strong", "hard", "reset")
# ... and for every gate: raw: magnitudes as real models' raw gates, up to about 1e3; mixed: each
# element from a different regime.
REGIMES = (*LOG_REGIMES, "raw", "mixed")
# T against the chunk size C: one step; 1 < T <= C; several chunks, T % C == 0; several, ragged.
SIZE_CLASSES = ("one step", "one chunk", "whole chunks", "ragged chunks")
DEFAULT_CHUNK = 64


def _log_gates(rng: np.random.Generator, shape: tuple[int, ...], regime: str) -> np.ndarray:
    if regime == "zero":
        return np.zeros(shape)
    if regime == "weak":  # decays by about e^-0.01 a step: couplings ~100 steps apart still count
        return -rng.uniform(0.0, 0.02, shape)
    mild = -rng.uniform(0.0, 1.0, shape)
    if regime == "mild":
        return mild
    if regime == "steep":
        return -rng.uniform(0.0, 10.0, shape)
    if regime == "kimi":
        return -_kimi_decay(rng, shape)
    if regime == "strong":  # spans -1e-3 .. -1e3
        return -(10.0 ** rng.uniform(-3.0, 3.0, shape))
    if regime == "hard":  # some channels decay by exp(-1e4) at some steps
        return np.where(rng.uniform(size=shape) < 0.2, -1e4, mild)
    if regime == "reset":  # -inf: hard resets of random channels at random steps
        return np.where(rng.uniform(size=shape) < 0.15, -np.inf, mild)
    if regime == "raw":  # -1 .. -1e3
        return -(10.0 ** rng.uniform(0.0, 3.0, shape))
    if regime == "mixed":
        parts = np.stack([_log_gates(rng, shape, r) for r in ("weak", "strong", "hard", "reset", "raw")])
        return np.take_along_axis(parts, rng.integers(0, 5, (1, *shape)), axis=0)[0]
    raise InvalidInputError(f"regime must be one of {REGIMES}; got {regime!r}")


def _kimi_decay(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """``exp(A_log) softplus(a)``: ``A_log = log U(1, 16)`` per head (per index of all but the last
    two axes, ``[T, K]``), ``a ~ N(0, 1)`` per element, as Kimi Linear's gate."""
    A = rng.uniform(1.0, 16.0, (*shape[:-2], 1, 1)) if len(shape) >= 2 else rng.uniform(1.0, 16.0, shape)
    return A * np.logaddexp(0.0, rng.standard_normal(shape))


def _softplus_inverse(y: np.ndarray) -> np.ndarray:
    """The raw gate whose softplus is ``y > 0``."""
    return y + np.log(-np.expm1(-y))


def _raw_gates(rng: np.random.Generator, shape: tuple[int, ...], regime: str) -> np.ndarray:
    """Pre-activation gates for ``gate="softplus"`` / ``"lower_bound"`` (any finite value)."""
    if regime == "zero":
        return np.zeros(shape)
    if regime == "weak":  # softplus(-5 .. -10): log decays of -7e-3 .. -5e-5 (times exp(A_log))
        return -rng.uniform(5.0, 10.0, shape)
    if regime == "mild":
        return 3.0 * rng.standard_normal(shape)
    if regime == "steep":  # softplus of U(1e-3, 10)
        return _softplus_inverse(rng.uniform(1e-3, 10.0, shape))
    if regime == "kimi":  # Kimi's decay magnitude (times exp(A_log) where the problem has one)
        return _softplus_inverse(_kimi_decay(rng, shape))
    if regime == "strong":
        return rng.uniform(2.0, 30.0, shape)
    if regime == "hard":  # some +1e4: decays of about exp(-1e4 exp(A_log))
        return np.where(rng.uniform(size=shape) < 0.2, 1e4, 3.0 * rng.standard_normal(shape))
    if regime == "reset":  # a raw gate cannot be -inf: the strongest finite ones instead
        return np.where(rng.uniform(size=shape) < 0.15, 6e4, 3.0 * rng.standard_normal(shape))
    if regime == "raw":  # +-1 .. +-1e3, as a model's gate projection can produce
        return rng.choice([-1.0, 1.0], shape) * 10.0 ** rng.uniform(0.0, 3.0, shape)
    if regime == "mixed":
        parts = np.stack([_raw_gates(rng, shape, r) for r in ("weak", "strong", "hard", "reset", "raw")])
        return np.take_along_axis(parts, rng.integers(0, 5, (1, *shape)), axis=0)[0]
    raise InvalidInputError(f"regime must be one of {REGIMES}; got {regime!r}")


def gates(rng: np.random.Generator, shape: tuple[int, ...], regime: str, *, gate: str = "log") -> np.ndarray:
    """Gates of one regime, float64.

    Parameters
    ----------
    rng : numpy.random.Generator
    shape : tuple of int, e.g. ``[B, HV, T, K]``
    regime : one of :data:`REGIMES`
    gate : {"log", "softplus", "lower_bound"}
        ``"log"``: log decays ``<= 0`` (``-inf`` a hard reset); otherwise raw gates (any finite value).

    Returns
    -------
    numpy.ndarray of ``shape``, float64
    """
    if gate not in GATES:
        raise InvalidInputError(f"gate must be one of {GATES}; got {gate!r}")
    return _log_gates(rng, shape, regime) if gate == "log" else _raw_gates(rng, shape, regime)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (round to nearest even) and back to float64.

    bfloat16 is emulated on float32 bits, so NumPy needs no bfloat16 type.
    """
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x.copy()
    if dtype == "bfloat16":
        bits = x.astype(np.float32).view(np.uint32)
        finite = np.isfinite(x)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
        out = np.where(finite, rounded, bits & np.uint32(0xFFFF0000)).view(np.float32)
        with np.errstate(over="ignore"):
            return out.astype(np.float64)
    with np.errstate(over="ignore"):
        return x.astype(dtype).astype(np.float64)


def state_dtype(dtype: str) -> str:
    """The dtype of states (and of ``A_log``, ``dt_bias``) for inputs of ``dtype``."""
    return "float64" if dtype == "float64" else "float32"


@dataclass(frozen=True)
class Problem:
    """One KDA call: shapes, options, dtype and chunk size; the arrays come from ``seed``.

    Shapes (head-first; a kernel's convention may transpose them): ``q, k [B, H, T, K]``,
    ``v, grad_output [B, HV, T, V]``, ``g [B, HV, T, K]``, ``beta [B, HV, T]``, states
    ``[N, HV, K, V]`` with ``HV = H * G`` and ``N = B`` (or the number of packed sequences).

    Attributes
    ----------
    seed : int
        Seed of the arrays' generator.
    dtype : {"float64", "float32", "float16", "bfloat16"}
        What ``q, k, v, g, beta`` are cast to; states and gate parameters are float32
        (float64 for float64).
    B, H, G, T, K, V : int
        Batch, q/k heads, value heads per q/k head, steps, key and value sizes.
    cu_seqlens : tuple of int or None
        Packed sequences (``B == 1``): ``N + 1`` offsets from 0 to ``T``.
    layout : {"head_first", "time_major"}
        The layout a ``"kda"``-convention kernel is called with (``"fla"`` is always time-major).
    initial_state : bool
        Whether an initial state is passed.
    gate : {"log", "softplus", "lower_bound"}
    lower_bound : float or None
        For ``gate="lower_bound"``.
    A_log, dt_bias : bool
        Whether those gate parameters are passed (``A_log`` always for ``"softplus"``).
    regime : one of :data:`REGIMES`
    qk_l2norm : bool
    beta_activation : {None, "sigmoid", "sigmoid2"}
    scale : float or None
        None: not passed (the kernel's default, ``K ** -0.5``).
    chunk_size : int or None
        None: not passed (the kernel's default; kda's reference uses 64 for boundaries).
    causal_step : int
        The step from which the causality check changes the inputs (``1 <= causal_step < T``).
    """

    seed: int = 0
    dtype: str = "float32"
    B: int = 1
    H: int = 1
    G: int = 1
    T: int = 16
    K: int = 8
    V: int = 8
    cu_seqlens: tuple[int, ...] | None = None
    layout: str = "head_first"
    initial_state: bool = True
    gate: str = "log"
    lower_bound: float | None = None
    A_log: bool = False
    dt_bias: bool = False
    regime: str = "mild"
    qk_l2norm: bool = False
    beta_activation: str | None = None
    scale: float | None = None
    chunk_size: int | None = None
    causal_step: int = 1

    def __post_init__(self) -> None:
        _check_problem(self)

    @property
    def HV(self) -> int:
        """Value heads, ``H * G``."""
        return self.H * self.G

    @property
    def N(self) -> int:
        """Sequences: ``B``, or the number of packed sequences."""
        return self.B if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @property
    def lengths(self) -> tuple[int, ...]:
        """Each sequence's length."""
        if self.cu_seqlens is None:
            return (self.T,) * self.B
        return tuple(b - a for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))

    @property
    def effective_chunk(self) -> int:
        return DEFAULT_CHUNK if self.chunk_size is None else self.chunk_size

    @property
    def size_class(self) -> str:
        """One of :data:`SIZE_CLASSES`: ``T`` against the chunk size."""
        C = self.effective_chunk
        if self.T == 1:
            return "one step"
        if self.T <= C:
            return "one chunk"
        return "whole chunks" if self.T % C == 0 else "ragged chunks"

    @property
    def features(self) -> frozenset[str]:
        """Tags of what this problem exercises (for coverage: regime, size class, options)."""
        tags = {
            f"regime={self.regime}",
            f"size={self.size_class}",
            f"dtype={self.dtype}",
            f"gate={self.gate}",
        }
        tags |= {f"layout={self.layout}", f"beta={self.beta_activation}", f"chunk={self.chunk_size}"}
        if self.G > 1:
            tags.add("gva")
        if self.qk_l2norm:
            tags.add("qk_l2norm")
        if self.initial_state:
            tags.add("initial_state")
        if self.scale is not None:
            tags.add("scale")
        if self.cu_seqlens is not None:
            tags.add("packed")
            if 0 in self.lengths:
                tags.add("packed: empty sequence")
            if 1 in self.lengths:
                tags.add("packed: length-1 sequence")
        return frozenset(tags)

    @functools.cached_property
    def masters(self) -> dict[str, np.ndarray | None]:
        """The float64 arrays, head-first, before rounding (see :meth:`arrays`)."""
        rng = np.random.default_rng(self.seed)
        B, H, HV, T, K, V, N = self.B, self.H, self.HV, self.T, self.K, self.V, self.N
        q = rng.standard_normal((B, H, T, K))
        k = rng.standard_normal((B, H, T, K))
        if self.qk_l2norm:
            k *= rng.uniform(0.2, 3.0, (B, H, T, 1))  # unnormalised: the option normalises
        else:
            k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-3)
        v = rng.standard_normal((B, HV, T, V))
        g = gates(rng, (B, HV, T, K), self.regime, gate=self.gate)
        if self.beta_activation is None:
            beta = rng.uniform(0.0, 2.0, (B, HV, T))
        else:
            beta = 2.0 * rng.standard_normal((B, HV, T))
        A_log = rng.uniform(-2.0, 1.0, HV) if self.A_log else None
        dt_bias = rng.standard_normal((HV, K)) if self.dt_bias else None
        s0 = rng.standard_normal((N, HV, K, V)) if self.initial_state else None
        do = rng.standard_normal((B, HV, T, V))
        ds = rng.standard_normal((N, HV, K, V))
        return {
            "q": q,
            "k": k,
            "v": v,
            "g": g,
            "beta": beta,
            "initial_state": s0,
            "A_log": A_log,
            "dt_bias": dt_bias,
            "grad_output": do,
            "grad_final_state": ds,
        }

    def dtype_of(self, name: str) -> str:
        """The dtype array ``name`` is passed in."""
        if name in ("initial_state", "grad_final_state", "A_log", "dt_bias"):
            return state_dtype(self.dtype)
        return self.dtype

    @functools.cached_property
    def arrays(self) -> dict[str, np.ndarray | None]:
        """The arrays exactly as the kernel receives them, as float64 (each rounded to
        :meth:`dtype_of`); the reference is computed on these."""
        return {n: None if x is None else round_to(x, self.dtype_of(n)) for n, x in self.masters.items()}

    def options(self) -> dict[str, Any]:
        """kda's keyword options this problem uses (arrays as float64 NumPy); defaults left out."""
        a = self.arrays
        kw: dict[str, Any] = {}
        if self.qk_l2norm:
            kw["qk_l2norm"] = True
        if self.gate != "log":
            kw["gate"] = self.gate
            if a["A_log"] is not None:
                kw["A_log"] = a["A_log"]
            if a["dt_bias"] is not None:
                kw["dt_bias"] = a["dt_bias"]
            if self.gate == "lower_bound":
                kw["lower_bound"] = self.lower_bound
        if self.beta_activation is not None:
            kw["beta_activation"] = self.beta_activation
        if self.cu_seqlens is not None:
            kw["cu_seqlens"] = np.asarray(self.cu_seqlens, dtype=np.int64)
        return kw


def _check_problem(p: Problem) -> None:
    for name in ("B", "H", "G", "T", "K", "V"):
        x = getattr(p, name)
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise InvalidInputError(f"Problem.{name} must be a positive int; got {x!r}")
    if p.dtype not in DTYPES:
        raise InvalidInputError(f"Problem.dtype must be one of {DTYPES}; got {p.dtype!r}")
    if p.layout not in LAYOUTS:
        raise InvalidInputError(f"Problem.layout must be one of {LAYOUTS}; got {p.layout!r}")
    if p.gate not in GATES:
        raise InvalidInputError(f"Problem.gate must be one of {GATES}; got {p.gate!r}")
    if p.regime not in REGIMES:
        raise InvalidInputError(f"Problem.regime must be one of {REGIMES}; got {p.regime!r}")
    if p.beta_activation not in BETA_ACTIVATIONS:
        raise InvalidInputError(
            f"Problem.beta_activation must be one of {BETA_ACTIVATIONS}; got {p.beta_activation!r}"
        )
    if p.gate == "softplus" and not p.A_log:
        raise InvalidInputError("Problem.A_log must be True for gate='softplus'")
    if p.gate == "log" and (p.A_log or p.dt_bias):
        raise InvalidInputError("Problem.A_log / dt_bias need gate='softplus' or 'lower_bound'")
    if (p.gate == "lower_bound") != (p.lower_bound is not None) or (
        p.lower_bound is not None and p.lower_bound >= 0
    ):
        raise InvalidInputError(
            f"Problem.lower_bound must be < 0 exactly for gate='lower_bound'; got {p.lower_bound!r}"
        )
    if p.cu_seqlens is not None:
        cu = tuple(p.cu_seqlens)
        falls = any(b < a for a, b in itertools.pairwise(cu))
        if p.B != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != p.T or falls:
            raise InvalidInputError(f"Problem.cu_seqlens must rise from 0 to T={p.T} with B == 1; got {cu!r}")
    if p.chunk_size is not None and (not isinstance(p.chunk_size, int) or p.chunk_size < 1):
        raise InvalidInputError(f"Problem.chunk_size must be None or a positive int; got {p.chunk_size!r}")
    if p.scale is not None and not (isinstance(p.scale, float) and math.isfinite(p.scale)):
        raise InvalidInputError(f"Problem.scale must be None or a finite float; got {p.scale!r}")
    if not 1 <= p.causal_step <= max(p.T - 1, 1):
        raise InvalidInputError(f"Problem.causal_step must be in [1, T - 1]; got {p.causal_step!r}")
