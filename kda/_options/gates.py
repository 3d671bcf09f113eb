"""Gate laws: how the gate argument ``g`` becomes the log decay the core consumes, one class each.

A law is one unit: its name (the ``gate`` option's value), its parameters with their shapes, its
check, its log decay and the backward of that map. Every layer that handles a gate asks the law
of the call (:func:`law`) instead of branching on the gate's name: validation checks the
parameters a law declares, the maps apply its :meth:`GateLaw.log_decay` and
:meth:`GateLaw.backward`, the plans and decode ask :attr:`GateLaw.log_input` (``g`` is the log
decay itself, refused when positive), and the entry points, the adapters and Dask iterate over
:data:`PARAMETERS` (the arrays a law may take, each an option of the table and a field of
:class:`~kda.KdaGradients`).

Adding a law: one subclass of :class:`GateLaw` registered with :func:`register`; it may use
the parameters of :data:`PARAMETERS` and the scalar ``lower_bound``. A law whose parameter is
not one of those also needs that parameter's option row (``table.py``) and its field in
:class:`~kda.KdaGradients` and :class:`~kda._entry.call.Inputs`.

softplus and sigmoid are written with ``exp(-|x|)`` only, so they neither overflow nor switch
formula at a threshold: ``softplus(x) = max(x, 0) + log1p(exp(-|x|))`` equals ``log1p(exp(x))``
to rounding for every finite ``x``. No law produces a positive log decay.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from typing import Any, ClassVar, NamedTuple

from .._errors import InvalidInputError
from .arguments import check_lower_bound

__all__ = [
    "A_LOG",
    "DT_BIAS",
    "LAWS",
    "PARAMETERS",
    "GateLaw",
    "GateParam",
    "law",
    "register",
    "sigmoid",
    "softplus",
    "unregister",
]


class GateParam(NamedTuple):
    """One array parameter of a gate law: its name (an option of the table, a field of
    :class:`~kda.KdaGradients`) and its dimensions, letters of the problem's sizes (``HV``, ``K``)."""

    name: str
    dims: tuple[str, ...]

    def shape(self, HV: int, K: int) -> tuple[int, ...]:
        sizes = {"HV": HV, "K": K}
        return tuple(sizes[d] for d in self.dims)

    @property
    def letters(self) -> str:
        return ", ".join(self.dims)

    def broadcast(self, x: Any) -> Any:
        """``x`` indexed to broadcast over ``[B, HV, T, K]`` (``[HV]`` -> ``[1, HV, 1, 1]``,
        ``[HV, K]`` -> ``[1, HV, 1, K]``)."""
        return x[None, :, None, None] if self.dims == ("HV",) else x[None, :, None, :]

    def reduce_axes(self) -> tuple[int, ...]:
        """The axes of a ``[B, HV, T, K]`` gradient summed into this parameter's gradient."""
        return (0, 2, 3) if self.dims == ("HV",) else (0, 2)


A_LOG = GateParam("A_log", ("HV",))
DT_BIAS = GateParam("dt_bias", ("HV", "K"))
# every array parameter a law may take, in the order of KdaGradients' fields
PARAMETERS: tuple[GateParam, ...] = (A_LOG, DT_BIAS)
PARAMETER_NAMES: tuple[str, ...] = tuple(p.name for p in PARAMETERS)
_values = operator.attrgetter(*PARAMETER_NAMES)


def parameter_values(record: Any) -> tuple[Any, ...]:
    """Every gate parameter of ``record`` (anything with them as attributes: the table's options,
    the host arrays), in :data:`PARAMETER_NAMES`' order, None where not given: one C call (every
    call asks, the decode steps among them)."""
    values = _values(record)
    return values if len(PARAMETER_NAMES) > 1 else (values,)


def parameters_of(record: Any) -> dict[str, Any]:
    """:func:`parameter_values` by name."""
    return dict(zip(PARAMETER_NAMES, parameter_values(record)))


def any_given(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` (gate parameters) is given, not None (in C: no generator)."""
    return any(map(operator.is_not, values, itertools.repeat(None)))


def sigmoid(xp: Any, x: Any) -> Any:
    """``1 / (1 + exp(-x))`` without overflow for any ``x``."""
    z = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + z), z / (1 + z))


def softplus(xp: Any, x: Any) -> Any:
    """``log1p(exp(x))`` without overflow for any ``x``."""
    return xp.maximum(x, xp.zeros_like(x)) + xp.log1p(xp.exp(-xp.abs(x)))


class GateLaw:
    """A gate law. Subclasses set the class attributes and write :meth:`log_decay` and
    :meth:`backward`; instances are stateless (the registry holds one of each).

    Attributes
    ----------
    name : the ``gate`` option's value.
    params : the array parameters it takes (from :data:`PARAMETERS`); ``required``: those it
        cannot do without. A parameter given to a law that does not take it is refused.
    lower_bound : whether it takes the scalar ``lower_bound`` (then required, a finite float < 0).
    log_input : ``g`` is the log decay itself: validation refuses positive and NaN ``g`` (``-inf``
        a legal reset) and the finiteness scan skips it; otherwise ``g`` is a raw gate, any finite
        value.
    doc : the formula, for the option's documentation.
    """

    name: ClassVar[str]
    params: ClassVar[tuple[GateParam, ...]] = ()
    required: ClassVar[tuple[str, ...]] = ()
    lower_bound: ClassVar[bool] = False
    log_input: ClassVar[bool] = False
    doc: ClassVar[str] = ""

    def check(self, given: dict[str, Any], lower_bound: Any) -> float | None:
        """Refuse parameters this law does not take, require those it needs; return ``lower_bound``
        checked (a float) or None. ``given``: every parameter of :data:`PARAMETERS` by name."""
        if not (self.lower_bound or self.required or lower_bound is not None or any_given(given.values())):
            return None  # the common call: nothing given, nothing required
        for name in self.required:
            if given.get(name) is None:
                shape = next(p.letters for p in self.params if p.name == name)
                msg = f"{name} (shape [{shape}]) is required with gate={self.name!r}; got None"
                raise InvalidInputError(msg)
        taken = {p.name for p in self.params}
        refused = [n for n in PARAMETER_NAMES if given.get(n) is not None and n not in taken]
        if not self.lower_bound and lower_bound is not None:
            refused.append("lower_bound")
        if refused:
            why = " (g is already the log decay)" if self.log_input else ""
            got = f"{lower_bound!r}" if refused == ["lower_bound"] else "a value"
            msg = f"{', '.join(refused)} must be None with gate={self.name!r}{why}; got {got}"
            raise InvalidInputError(msg)
        if not self.lower_bound:
            return None
        return check_lower_bound(lower_bound, f" with gate={self.name!r}")

    def log_decay(
        self, xp: Any, g: Any, params: dict[str, Any], lower_bound: float | None
    ) -> tuple[Any, Any]:
        """``(log decay, saved)`` from the gate ``g [B, HV, T, K]`` (compute dtype, head-first) and
        the parameters by name (compute dtype, None where not given); ``saved`` is what
        :meth:`backward` needs besides the log decay."""
        raise NotImplementedError

    def backward(
        self, xp: Any, dlog: Any, log: Any, saved: Any, params: dict[str, Any], lower_bound: float | None
    ) -> tuple[Any, dict[str, Any]]:
        """``(dg, {parameter: gradient})`` from the log decay's gradient ``dlog`` (``log``: the log
        decay, ``saved``: :meth:`log_decay`'s); a parameter not given has no gradient (None)."""
        raise NotImplementedError


def _argument(xp: Any, g: Any, params: dict[str, Any]) -> Any:
    """``g + dt_bias`` (broadcast over batch and steps); ``g`` without ``dt_bias``."""
    bias = params.get("dt_bias")
    return g if bias is None else g + DT_BIAS.broadcast(bias)


def _bias_gradient(xp: Any, dx: Any, params: dict[str, Any]) -> Any:
    return None if params.get("dt_bias") is None else xp.sum(dx, axis=DT_BIAS.reduce_axes())


class LogGate(GateLaw):
    """``g`` is the log decay."""

    name = "log"
    log_input = True
    doc = "``g`` itself"

    def log_decay(self, xp, g, params, lower_bound):
        return g, None

    def backward(self, xp, dlog, log, saved, params, lower_bound):
        return dlog, {}


class SoftplusGate(GateLaw):
    """``-exp(A_log[h]) * softplus(g + dt_bias[h])`` (Kimi Linear's)."""

    name = "softplus"
    params = (A_LOG, DT_BIAS)
    required = ("A_log",)
    doc = "``-exp(A_log[h]) * softplus(g + dt_bias[h])``"

    def log_decay(self, xp, g, params, lower_bound):
        x = _argument(xp, g, params)
        return -xp.exp(A_LOG.broadcast(params["A_log"])) * softplus(xp, x), x

    def backward(self, xp, dlog, log, saved, params, lower_bound):
        x = saved
        a = xp.exp(A_LOG.broadcast(params["A_log"]))
        dx = -a * sigmoid(xp, x) * dlog
        dA = xp.sum(dlog * log, axis=A_LOG.reduce_axes())  # d(-a softplus)/dA_log = the log decay itself
        return dx, {"A_log": dA, "dt_bias": _bias_gradient(xp, dx, params)}


class LowerBoundGate(GateLaw):
    """``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (factor 1 when ``A_log`` is None)."""

    name = "lower_bound"
    params = (A_LOG, DT_BIAS)
    lower_bound = True
    doc = "``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (factor 1 when ``A_log`` is None)"

    def log_decay(self, xp, g, params, lower_bound):
        x = _argument(xp, g, params)
        A_log = params.get("A_log")
        scaled = x if A_log is None else xp.exp(A_LOG.broadcast(A_log)) * x
        return lower_bound * sigmoid(xp, scaled), x

    def backward(self, xp, dlog, log, saved, params, lower_bound):
        x, A_log = saved, params.get("A_log")
        a = 1.0 if A_log is None else xp.exp(A_LOG.broadcast(A_log))
        s = sigmoid(xp, a * x)
        ds = lower_bound * s * (1 - s) * dlog  # gradient of the sigmoid's argument
        dx = a * ds
        dA = None if A_log is None else xp.sum(ds * a * x, axis=A_LOG.reduce_axes())
        return dx, {"A_log": dA, "dt_bias": _bias_gradient(xp, dx, params)}


# name -> law: the gate option's values (the table reads its choices here, live)
LAWS: dict[str, GateLaw] = {}


def register(gate_law: type[GateLaw] | GateLaw) -> GateLaw:
    """Add a law (a :class:`GateLaw` subclass or instance) under its name; returns the instance."""
    instance = gate_law() if isinstance(gate_law, type) else gate_law
    unknown = [p.name for p in instance.params if p not in PARAMETERS]
    if unknown:
        msg = f"gate law {instance.name!r}: parameters {unknown} are not among {PARAMETER_NAMES}"
        raise ValueError(msg)
    if instance.name in LAWS:
        msg = f"a gate law named {instance.name!r} is registered already"
        raise ValueError(msg)
    LAWS[instance.name] = instance
    return instance


def unregister(name: str) -> None:
    """Remove the law ``name`` (a law a test registered); the built-in laws stay."""
    if name in BUILT_IN:
        msg = f"the built-in gate law {name!r} cannot be removed"
        raise ValueError(msg)
    del LAWS[name]


def law(name: str) -> GateLaw:
    """The registered law called ``name`` (validated calls only: the option's check words errors)."""
    return LAWS[name]


for _law in (LogGate, SoftplusGate, LowerBoundGate):
    register(_law)
BUILT_IN = tuple(LAWS)
