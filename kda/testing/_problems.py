"""Problems: the inputs of one KDA call (float64 masters, the dtype to cast to, options, chunk size),
and the hypothesis strategy that draws them.

A :class:`Problem` is a small frozen record of parameters; its arrays are generated from them
(``seed`` drives NumPy's generator), so ``repr(problem)`` is a runnable reproducer.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .._errors import InvalidInputError, InvalidTypeError
from .._options.table import BETA_ACTIVATIONS, GATES, LAYOUTS

__all__ = [
    "DTYPES",
    "LOG_REGIMES",
    "REGIMES",
    "SIZE_CLASSES",
    "Problem",
    "gates",
    "problems",
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
            "q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": s0, "A_log": A_log,
            "dt_bias": dt_bias, "grad_output": do, "grad_final_state": ds,
        }  # fmt: skip

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


# ----------------------------------------------------------------------------------------------
# The strategy


def _range(name: str, value: Any, low: int = 1) -> tuple[int, int]:
    """An int or an inclusive ``(min, max)`` pair."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if (
        not isinstance(value, tuple | list)
        or len(value) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in value)
        or not low <= value[0] <= value[1]
    ):
        raise InvalidInputError(f"{name} must be an int >= {low} or a (min, max) pair of them; got {value!r}")
    return int(value[0]), int(value[1])


def _choices(name: str, value: Any, allowed: Sequence[Any]) -> tuple[Any, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        value = (value,)
    value = tuple(value)
    bad = [x for x in value if x not in allowed]
    if not value or bad:
        raise InvalidInputError(f"{name} must be a non-empty choice from {tuple(allowed)}; got {value!r}")
    return value


def _dtype_name(d: Any) -> str:
    name = d if isinstance(d, str) else getattr(d, "name", None) or str(d).rsplit(".", 1)[-1]
    if name not in DTYPES:
        raise InvalidTypeError(f"dtypes must name float64, float32, float16 or bfloat16; got {d!r}")
    return name


def problems(
    *,
    dtypes: Sequence[Any] = DTYPES,
    K: int | tuple[int, int] = (1, 16),
    V: int | tuple[int, int] = (1, 12),
    T: int | tuple[int, int] = (1, 80),
    T_multiple_of: int = 1,
    heads: int | tuple[int, int] = (1, 2),
    groups: Sequence[int] = (1, 2, 3),
    batch: int | tuple[int, int] = (1, 2),
    packed: Sequence[bool] = (False, True),
    max_sequences: int = 5,
    layouts: Sequence[str] = LAYOUTS,
    initial_state: Sequence[bool] = (False, True),
    gates: Sequence[str] = GATES,
    lower_bound: tuple[float, float] = (-10.0, -0.1),
    regimes: Sequence[str] = REGIMES,
    qk_l2norm: Sequence[bool] = (False, True),
    beta_activations: Sequence[str | None] = BETA_ACTIVATIONS,
    scale: Sequence[str] = ("default", "drawn"),
    chunk_sizes: Sequence[int | None] = (None, 1, 3, 8, 16, 64),
) -> Any:
    """A hypothesis strategy of :class:`Problem`; every argument narrows what is drawn.

    The defaults cover everything kda supports. A kernel that lacks a feature is tested by
    narrowing: ``problems(groups=(1,), packed=(False,))`` for one without grouped value heads
    or packed sequences.

    Parameters
    ----------
    dtypes : sequence of {"float64", "float32", "float16", "bfloat16"} (or NumPy / torch dtypes)
    K, V, T : int or (min, max)
        Key size, value size, steps (total steps of the packed row with ``packed``).
    T_multiple_of : int
        Every ``T`` (and every packed sequence's length) is a multiple of this.
    heads : int or (min, max)
        q/k heads ``H``.
    groups : sequence of int
        Value heads per q/k head ``G`` (``HV = G * H``); ``(1,)`` for no GVA.
    batch : int or (min, max)
        ``B`` (1 with packed sequences).
    packed : sequence of bool
        Whether ``cu_seqlens`` packs several sequences (empty and length-1 ones included).
    max_sequences : int
        Most packed sequences.
    layouts : sequence of {"head_first", "time_major"}
    initial_state : sequence of bool
    gates : sequence of {"log", "softplus", "lower_bound"}
    lower_bound : (min, max) floats < 0
        Range of ``lower_bound`` for the lower-bound gate.
    regimes : sequence of :data:`REGIMES`
    qk_l2norm : sequence of bool
    beta_activations : sequence of {None, "sigmoid", "sigmoid2"}
    scale : sequence of {"default", "drawn"}
        ``"default"``: not passed; ``"drawn"``: a scale in ``[0.05, 2]``.
    chunk_sizes : sequence of int or None
        None: not passed.

    Returns
    -------
    hypothesis.strategies.SearchStrategy[Problem]
    """
    space = _space(
        dtypes, K, V, T, T_multiple_of, heads, groups, batch, packed, max_sequences, layouts,
        initial_state, gates, lower_bound, regimes, qk_l2norm, beta_activations, scale, chunk_sizes,
    )  # fmt: skip
    return _strategy(space)


class _Space(NamedTuple):
    """The checked choices of :func:`problems` that a draw samples from."""

    dt: tuple[str, ...]
    Kr: tuple[int, int]
    Vr: tuple[int, int]
    Hr: tuple[int, int]
    Br: tuple[int, int]
    m: int
    t_lo: int
    t_hi: int
    Gs: tuple
    packs: tuple
    lays: tuple
    states: tuple
    gts: tuple
    regs: tuple
    norms: tuple
    betas: tuple
    scales: tuple
    chunks: tuple
    lower_bound: tuple[float, float]
    max_sequences: int


def _space(
    dtypes: Any, K: Any, V: Any, T: Any, T_multiple_of: Any, heads: Any, groups: Any, batch: Any,
    packed: Any, max_sequences: Any, layouts: Any, initial_state: Any, gates: Any, lower_bound: Any,
    regimes: Any, qk_l2norm: Any, beta_activations: Any, scale: Any, chunk_sizes: Any,
) -> _Space:  # fmt: skip
    """:func:`problems`' arguments checked (``kda.KdaError`` naming the bad one) and normalised."""
    dt = tuple(
        _dtype_name(d)
        for d in (dtypes if isinstance(dtypes, Sequence) and not isinstance(dtypes, str) else (dtypes,))
    )
    if not dt:
        raise InvalidInputError("dtypes must not be empty")
    Kr, Vr, Hr, Br = _range("K", K), _range("V", V), _range("heads", heads), _range("batch", batch)
    Tr = _range("T", T)
    if not isinstance(T_multiple_of, int) or T_multiple_of < 1:
        raise InvalidInputError(f"T_multiple_of must be a positive int; got {T_multiple_of!r}")
    m = T_multiple_of
    t_lo, t_hi = -(-Tr[0] // m), Tr[1] // m
    if t_lo > t_hi:
        raise InvalidInputError(f"T={T!r} holds no multiple of T_multiple_of={m}")
    Gs = _choices("groups", groups, range(1, 65))
    packs = _choices("packed", packed, (False, True))
    lays = _choices("layouts", layouts, LAYOUTS)
    states = _choices("initial_state", initial_state, (False, True))
    gts = _choices("gates", gates, GATES)
    regs = _choices("regimes", regimes, REGIMES)
    norms = _choices("qk_l2norm", qk_l2norm, (False, True))
    betas = _choices("beta_activations", beta_activations, BETA_ACTIVATIONS)
    scales = _choices("scale", scale, ("default", "drawn"))
    chunks = tuple(chunk_sizes) if isinstance(chunk_sizes, Sequence) else (chunk_sizes,)
    if not chunks or any(c is not None and (not isinstance(c, int) or c < 1) for c in chunks):
        raise InvalidInputError(f"chunk_sizes must hold None or positive ints; got {chunk_sizes!r}")
    if not (
        isinstance(lower_bound, tuple | list)
        and len(lower_bound) == 2
        and lower_bound[0] <= lower_bound[1] < 0
    ):
        raise InvalidInputError(f"lower_bound must be a (min, max) pair of floats < 0; got {lower_bound!r}")
    if not isinstance(max_sequences, int) or max_sequences < 1:
        raise InvalidInputError(f"max_sequences must be a positive int; got {max_sequences!r}")
    return _Space(
        dt, Kr, Vr, Hr, Br, m, t_lo, t_hi, Gs, packs, lays, states, gts, regs, norms, betas, scales, chunks,
        tuple(lower_bound), max_sequences,
    )  # fmt: skip


def _strategy(space: _Space) -> Any:
    """The hypothesis strategy of :class:`Problem` drawing from ``space``."""
    from hypothesis import strategies as st

    (dt, Kr, Vr, Hr, Br, m, t_lo, t_hi, Gs, packs, lays, states, gts, regs, norms, betas, scales, chunks,
     lower_bound, max_sequences) = space  # fmt: skip

    @st.composite
    def draw_problem(draw: Any) -> Problem:
        is_packed = draw(st.sampled_from(packs))
        T_ = m * draw(st.integers(t_lo, t_hi))
        cu = None
        if is_packed:
            cuts = draw(st.lists(st.integers(0, T_ // m), min_size=0, max_size=max_sequences - 1))
            cu = (0, *sorted(m * c for c in cuts), T_)
        gate = draw(st.sampled_from(gts))
        has_A = gate == "softplus" or (gate == "lower_bound" and draw(st.booleans()))
        return Problem(
            seed=draw(st.integers(0, 2**32 - 1)),
            dtype=draw(st.sampled_from(dt)),
            B=1 if is_packed else draw(st.integers(*Br)),
            H=draw(st.integers(*Hr)),
            G=draw(st.sampled_from(Gs)),
            T=T_,
            K=draw(st.integers(*Kr)),
            V=draw(st.integers(*Vr)),
            cu_seqlens=cu,
            layout=draw(st.sampled_from(lays)),
            initial_state=draw(st.sampled_from(states)),
            gate=gate,
            lower_bound=(
                round(draw(st.floats(*lower_bound)), 6) or lower_bound[1] if gate == "lower_bound" else None
            ),
            A_log=has_A,
            dt_bias=gate != "log" and draw(st.booleans()),
            regime=draw(st.sampled_from(regs)),
            qk_l2norm=draw(st.sampled_from(norms)),
            beta_activation=draw(st.sampled_from(betas)),
            scale=round(draw(st.floats(0.05, 2.0)), 6) if draw(st.sampled_from(scales)) == "drawn" else None,
            chunk_size=draw(st.sampled_from(chunks)),
            causal_step=draw(st.integers(1, max(T_ - 1, 1))),
        )

    return draw_problem()
