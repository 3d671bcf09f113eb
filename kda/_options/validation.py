"""Validation of a call: the problem (sizes, dtypes, namespace) and the model-level options.

The checks of single arguments are :mod:`kda._options.arguments`'; this module combines them
into a :class:`Problem` and validated :class:`~kda._options.maps.Options`. Each check names the
argument, what was expected and what was given, and raises :class:`~kda.InvalidInputError` (a
``ValueError``) for shapes and values or :class:`~kda.InvalidTypeError` (a ``TypeError``) for
dtypes and array types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import array_api_compat

from .._errors import InvalidInputError, InvalidTypeError
from . import gates
from .arguments import (
    STATE_DTYPE_RULE,
    _shape,
    c_contiguous,
    check_array,
    check_choice,
    check_chunk_size,
    check_dtype,
    check_log_decay,
    check_scale,
    check_shape,
    dtype_spelling,
    namespace_of,
)
from .checks import is_real_floating
from .gates import GateParam
from .maps import Options
from .packing import check_cu_seqlens, num_chunks
from .table import OPTIONS, Choices

__all__ = [
    "STATE_DTYPE_RULE",
    "Problem",
    "c_contiguous",
    "check_array",
    "check_chunk_size",
    "check_options_call",
    "check_scale",
    "check_state",
    "namespace_of",
    "validate_options",
    "validate_problem",
]


@dataclass(frozen=True)
class Problem:
    """Validated sizes, dtypes and namespace of one KDA call (sizes as the core sees them).

    ``H`` q/k heads and ``HV`` value heads (``HV`` a multiple of ``H``); ``N`` state rows: ``B``,
    or the number of packed sequences with ``cu_seqlens``.
    """

    xp: Any
    B: int
    H: int
    HV: int
    T: int
    K: int
    V: int
    dtype: Any  # dtype of q, k, v, g, beta and of the output
    compute_dtype: Any  # float64 for float64 inputs, float32 otherwise
    scale: float
    layout: str = "head_first"
    offsets: tuple[int, ...] | None = None  # cu_seqlens on the host
    gate_flags: Any = None  # a deferred device check of g <= 0 (CuPy), read by raise_for_gates

    @property
    def N(self) -> int:
        return self.B if self.offsets is None else len(self.offsets) - 1

    def num_chunks(self, chunk_size: int) -> int:
        return num_chunks(chunk_size, T=self.T, offsets=self.offsets)

    def letters(self, heads: str, last: str = "") -> str:
        """Shape letters of an input in this call's layout, e.g. ``B, T, HV, K``."""
        dims = ["B", heads, "T"] if self.layout == "head_first" else ["B", "T", heads]
        return ", ".join(dims + ([last] if last else []))

    def shape(self, heads: int, last: int | None = None) -> tuple[int, ...]:
        dims = [self.B, heads, self.T] if self.layout == "head_first" else [self.B, self.T, heads]
        return tuple(dims + ([] if last is None else [last]))


def recheck_gate(options: Options, xp: Any, g: Any) -> None:
    """A prepared call's refilled ``g``, re-checked with one reduction where its gate law takes
    log decays, on host arrays: ``max(g) <= 0`` (NaN fails it too). A positive gate would
    silently overflow ``exp`` otherwise."""
    if not options.law.log_input or array_api_compat.is_cupy_namespace(xp) or math.prod(_shape(g)) == 0:
        return
    if not bool((g.max() if hasattr(g, "max") else xp.max(g)) <= 0):
        msg = "g must hold log decays <= 0 (-inf allowed); the refilled g has a positive or NaN element"
        raise InvalidInputError(msg)


def _sizes(q: Any, v: Any, layout: str) -> tuple[int, int, int, int, int, int]:
    """``B, H, HV, T, K, V`` read off q and v in ``layout``, with their ranks checked."""
    letters = "B, H, T, K" if layout == "head_first" else "B, T, H, K"
    for name, x in (("q", q), ("v", v)):
        if x.ndim != 4:
            spelled = letters if name == "q" else letters.replace("H", "HV").replace("K", "V")
            msg = (
                f"{name} must have shape [{spelled}] (4 dimensions, layout={layout!r}); got shape {_shape(x)}"
            )
            raise InvalidInputError(msg)
    h_axis, t_axis = (1, 2) if layout == "head_first" else (2, 1)
    B, K, V = _shape(q)[0], _shape(q)[3], _shape(v)[3]
    return B, _shape(q)[h_axis], _shape(v)[h_axis], _shape(q)[t_axis], K, V


def _check_value_heads(v: Any, B: int, H: int, HV: int, T: int, layout: str) -> None:
    letters = "B, HV, T, V" if layout == "head_first" else "B, T, HV, V"
    t_axis = 2 if layout == "head_first" else 1
    groups_ok = HV == 0 if H == 0 else HV % H == 0 and HV >= H
    if _shape(v)[0] != B or _shape(v)[t_axis] != T or not groups_ok:
        msg = (
            f"v must have shape [{letters}] with B={B}, T={T} and HV a multiple of the {H} q/k heads "
            f"(layout={layout!r}); got {_shape(v)}"
        )
        raise InvalidInputError(msg)


def validate_problem(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    scale: Any,
    *,
    layout: str = "head_first",
    log_gate: bool = True,
    gate_check: Any = None,
) -> Problem:
    """Check ``q, k, v, g, beta`` and ``scale``; return the problem's sizes and dtypes.

    ``log_gate``: ``g`` is a log decay (``<= 0``, ``-inf`` a reset); otherwise a raw gate.
    ``gate_check``: the backend's deferred device check of ``g <= 0`` (its
    ``launch_gate_check``), or None. When it returns flags, they are kept on the problem instead
    of synchronising now, and the caller reads them with :func:`raise_for_gates` once its own
    work is queued; when it returns None (or there is none), ``g`` is checked here.
    """
    names = ["q", "k", "v", "g", "beta"]
    arrays = [q, k, v, g, beta]
    xp = namespace_of(names, arrays)  # layout: checked with the other choices (check_options_call)
    B, H, HV, T, K, V = _sizes(q, v, layout)
    _check_value_heads(v, B, H, HV, T, layout)
    p = Problem(
        xp=xp, B=B, H=H, HV=HV, T=T, K=K, V=V, dtype=q.dtype, compute_dtype=None, scale=0.0, layout=layout
    )
    check_shape("k", k, p.shape(H, K), p.letters("H", "K"))
    check_shape("g", g, p.shape(HV, K), p.letters("HV", "K"))
    check_shape("beta", beta, p.shape(HV), p.letters("HV"))
    if K < 1 or V < 1:
        msg = f"K and V must be >= 1; got K={K}, V={V}"
        raise InvalidInputError(msg)
    if not is_real_floating(xp, q.dtype):
        allowed = "float16, bfloat16, float32, float64"
        msg = f"q must have a real floating dtype ({allowed}); got {dtype_spelling(q.dtype)}"
        raise InvalidTypeError(msg)
    for name, x in zip(names[1:], arrays[1:]):
        check_dtype(name, x, q.dtype, "the dtype of q")
    compute_dtype = xp.float64 if q.dtype == xp.float64 else xp.float32
    flags = gate_check(g) if log_gate and gate_check is not None else None
    if log_gate and flags is None:
        check_log_decay(xp, g)
    return replace(p, compute_dtype=compute_dtype, scale=check_scale(scale, K), gate_flags=flags)


class ScreenedGate:
    """The check of ``g <= 0`` left to a backend's fused passes, which screen ``g`` as they load
    its chunks (a head with an element that is not ``<= 0`` turns the screen's input column NaN).

    The call settles it (:meth:`settle`) when a fused pass ran with a screen that came back clean;
    otherwise (no fused pass ran, or the screen saw a bad input) :meth:`raise_if_bad` checks ``g``
    on the host (:func:`check_log_decay`, which words the error), once.
    """

    def __init__(self, xp: Any, g: Any) -> None:
        self.xp, self.g, self.done = xp, g, False

    def settle(self) -> None:
        self.done = True

    def raise_if_bad(self) -> None:
        if not self.done:
            check_log_decay(self.xp, self.g)
            self.done = True


def raise_for_gates(p: Problem) -> None:
    """Read a deferred device gate check (one host synchronisation) and raise if it failed."""
    if p.gate_flags is not None:
        p.gate_flags.raise_if_bad()


def check_state(name: str, state: Any, p: Problem) -> Any:
    """Validate a ``[B, HV, K, V]`` state (``[N, HV, K, V]`` with ``cu_seqlens``); None means zeros."""
    if state is None:
        return None
    rows = "B" if p.offsets is None else "N"
    shape = (p.N, p.HV, p.K, p.V)
    return check_array(name, state, p, shape, f"{rows}, HV, K, V", p.compute_dtype, STATE_DTYPE_RULE)


def _check_param(param: GateParam, x: Any, p: Problem) -> Any:
    """A gate parameter: an array of q's library, real floating, of its shape; in the compute dtype."""
    name = param.name
    if not array_api_compat.is_array_api_obj(x) or array_api_compat.array_namespace(x) is not p.xp:
        msg = f"{name} must be an array of the same library as q ({p.xp.__name__}); got {type(x).__name__}"
        raise InvalidTypeError(msg)
    check_shape(name, x, param.shape(p.HV, p.K), param.letters)
    if not is_real_floating(p.xp, x.dtype):
        msg = f"{name} must have a real floating dtype; got {dtype_spelling(x.dtype)}"
        raise InvalidTypeError(msg)
    return p.xp.astype(x, p.compute_dtype, copy=False)


def _check_gate(p: Problem, opts: Choices) -> dict[str, Any]:
    """The gate law's parameters (by name, in the compute dtype; None where not given) and its
    ``lower_bound``, validated by the law (:meth:`~kda._options.gates.GateLaw.check`)."""
    gate_law = gates.law(opts.gate)
    given = gates.parameters_of(opts)
    checked: dict[str, Any] = {"lower_bound": gate_law.check(given, opts.lower_bound)}
    for param in gates.PARAMETERS:
        x = given[param.name]
        checked[param.name] = None if x is None else _check_param(param, x, p)
    return checked


def _check_choices(opts: Choices) -> None:
    """Every option with a fixed set of values (the table's ``choices``) has one of them."""
    for option in OPTIONS:
        if option.choices is not None:
            check_choice(option.name, getattr(opts, option.name), option.choices)


def validate_options(p: Problem, opts: Choices) -> tuple[Problem, Options]:
    """Check the model-level options against the problem; return it with ``cu_seqlens`` set."""
    if not isinstance(opts.qk_l2norm, bool):
        msg = f"qk_l2norm must be True or False; got {opts.qk_l2norm!r}"
        raise InvalidTypeError(msg)
    gate = _check_gate(p, opts)
    offsets = check_cu_seqlens(opts.cu_seqlens, p.B, p.T)
    options = Options(qk_l2norm=opts.qk_l2norm, gate=opts.gate, beta_activation=opts.beta_activation, **gate)
    return replace(p, offsets=offsets), options


def check_options_call(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    scale: Any,
    opts: Choices,
    gate_check: Any = None,
    scan: bool = True,
) -> tuple[Problem, Options]:
    """:func:`validate_problem` then :func:`validate_options`: everything about the inputs.

    ``gate_check``: the backend's deferred device gate check, if any (see :func:`validate_problem`).
    ``scan=False``: no look at the values (``g <= 0``): a part of arrays a call checked already.
    """
    _check_choices(opts)
    log_gate = gates.law(opts.gate).log_input and scan
    p = validate_problem(
        q, k, v, g, beta, scale, layout=opts.layout, log_gate=log_gate, gate_check=gate_check
    )
    return validate_options(p, opts)
