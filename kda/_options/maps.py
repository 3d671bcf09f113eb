"""The model-level options: element-wise maps before the core and their chain rules after it.

Everything here is backend-neutral array-API code on the namespace ``xp`` of the inputs, so every
backend (and the recurrence, the oracle) gets every option without new kernels:

- ``qk_l2norm``: ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head, for q and k.
- grouped value heads: q/k head ``h`` serves value heads ``h * G .. h * G + G - 1``,
  ``G = HV // H``; their gradients are summed over each group.
- ``gate``: the log decay that the core consumes, from the gate ``g``, by the call's gate law
  (:mod:`kda._options.gates`: its :meth:`~kda._options.gates.GateLaw.log_decay` and backward).
- ``beta_activation``: ``sigmoid(beta)`` or ``2 * sigmoid(beta)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import gates
from .gates import sigmoid as _sigmoid

__all__ = [
    "L2NORM_EPS",
    "CoreInputs",
    "Options",
    "expand_heads",
    "gate_backward",
    "head_first",
    "l2norm_backward",
    "prepare_core_inputs",
    "sum_heads",
]

L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class Options:
    """Validated element-wise options of one call (arrays in the compute dtype, head-first).

    The layout and the packed-sequence offsets are the problem's (:class:`~kda._options.validation.Problem`).
    """

    qk_l2norm: bool = False
    gate: str = "log"
    A_log: Any = None  # [HV]
    dt_bias: Any = None  # [HV, K]
    lower_bound: float | None = None
    beta_activation: str | None = None

    @property
    def law(self) -> gates.GateLaw:
        """The gate law (:mod:`kda._options.gates`)."""
        return gates.law(self.gate)

    def gate_params(self) -> dict[str, Any]:
        """Every gate parameter (:data:`~kda._options.gates.PARAMETERS`) by name, None where not given."""
        return gates.parameters_of(self)

    @property
    def is_identity(self) -> bool:
        """No element-wise map at all: the core's inputs are the raw inputs (every option held here
        at a plain value of the table: :func:`kda._options.table.is_plain`'s tests of these
        fields; ``tests/entry/test_signatures.py`` holds the two together)."""
        return (
            self.qk_l2norm is False
            and self.gate == "log"
            and self.A_log is None
            and self.dt_bias is None
            and self.lower_bound is None
            and self.beta_activation is None
        )


def head_first(xp: Any, x: Any, layout: str) -> Any:
    """Swap the time and head axes of a time-major array (its own inverse); a view.

    ``[B, T, heads, ...]`` <-> ``[B, heads, T, ...]``; head-first arrays and None pass through.
    """
    if layout == "head_first" or x is None:
        return x
    return xp.permute_dims(x, (0, 2, 1, *range(3, x.ndim)))


@dataclass(frozen=True)
class CoreInputs:
    """Inputs of the core (head-first, compute dtype, ``HV`` heads) and what the chain rule needs
    (frozen: a changed input is a new record, ``dataclasses.replace``)."""

    q: Any
    k: Any
    v: Any
    g: Any  # log decay
    beta: Any
    q_unit: Any = None  # normalised q and k at H heads (qk_l2norm), and their norms
    k_unit: Any = None
    q_norm: Any = None
    k_norm: Any = None
    gate_saved: Any = None  # what the gate law's backward needs (g + dt_bias for the built-in raw gates)
    beta_sig: Any = None  # sigmoid(raw beta) (beta activations)


def _l2norm(xp: Any, x: Any) -> tuple[Any, Any]:
    norm = xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)
    return x / norm, norm


def l2norm_backward(xp: Any, dy: Any, y: Any, norm: Any) -> Any:
    """Gradient of ``y = x / sqrt(sum(x**2) + eps)`` with respect to ``x``."""
    return (dy - y * xp.sum(dy * y, axis=-1, keepdims=True)) / norm


def expand_heads(xp: Any, x: Any, HV: int) -> Any:
    """``[B, H, T, K]`` -> ``[B, HV, T, K]``: value head ``i`` reads head ``i // (HV // H)``."""
    B, H = x.shape[:2]
    if H == HV:
        return x
    G = HV // H
    wide = xp.broadcast_to(x[:, :, None, ...], (B, H, G, *x.shape[2:]))
    return xp.reshape(wide, (B, HV, *x.shape[2:]))


def sum_heads(xp: Any, dx: Any, H: int) -> Any:
    """The transpose of :func:`expand_heads`: ``[B, HV, T, K]`` -> ``[B, H, T, K]``."""
    B, HV = dx.shape[:2]
    if H == HV:
        return dx
    return xp.sum(xp.reshape(dx, (B, H, HV // H, *dx.shape[2:])), axis=2)


def gate_backward(xp: Any, dlog: Any, c: CoreInputs, o: Options) -> tuple[Any, dict[str, Any]]:
    """The gradient of the raw ``g`` and of the gate's parameters (by name, None where unused)
    from that of the log decay: the gate law's backward."""
    return o.law.backward(xp, dlog, c.g, c.gate_saved, o.gate_params(), o.lower_bound)


def _activate_beta(xp: Any, beta: Any, o: Options) -> tuple[Any, Any]:
    if o.beta_activation is None:
        return beta, None
    s = _sigmoid(xp, beta)
    return (2 * s if o.beta_activation == "sigmoid2" else s), s


def beta_backward(xp: Any, dbeta: Any, c: CoreInputs, o: Options) -> Any:
    """Gradient of the raw ``beta`` from that of the activated one."""
    if o.beta_activation is None:
        return dbeta
    s = c.beta_sig
    d = dbeta * s * (1 - s)
    return 2 * d if o.beta_activation == "sigmoid2" else d


def prepare_core_inputs(xp: Any, q, k, v, g, beta, o: Options, HV: int) -> CoreInputs:
    """Apply the options to head-first inputs of the compute dtype: the core's inputs."""
    q_unit = k_unit = q_norm = k_norm = None
    if o.qk_l2norm:
        q_unit, q_norm = _l2norm(xp, q)
        k_unit, k_norm = _l2norm(xp, k)
        q, k = q_unit, k_unit
    log_decay, gate_saved = o.law.log_decay(xp, g, o.gate_params(), o.lower_bound)
    activated, beta_sig = _activate_beta(xp, beta, o)
    return CoreInputs(
        q=expand_heads(xp, q, HV),
        k=expand_heads(xp, k, HV),
        v=v,
        g=log_decay,
        beta=activated,
        q_unit=q_unit,
        k_unit=k_unit,
        q_norm=q_norm,
        k_norm=k_norm,
        gate_saved=gate_saved,
        beta_sig=beta_sig,
    )


def qk_backward(xp: Any, dq: Any, dk: Any, c: CoreInputs, o: Options, H: int) -> tuple[Any, Any]:
    """Gradients of the raw q and k from those of the core's (expanded, normalised) q and k."""
    dq, dk = sum_heads(xp, dq, H), sum_heads(xp, dk, H)
    if o.qk_l2norm:
        dq = l2norm_backward(xp, dq, c.q_unit, c.q_norm)
        dk = l2norm_backward(xp, dk, c.k_unit, c.k_norm)
    return dq, dk
