"""The model-level options: element-wise maps before the core and their chain rules after it.

Everything here is backend-neutral array-API code on the namespace ``xp`` of the inputs, so every
backend (and the recurrence, the oracle) gets every option without new kernels:

- ``qk_l2norm``: ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head, for q and k.
- grouped value heads: q/k head ``h`` serves value heads ``h * G .. h * G + G - 1``,
  ``G = HV // H``; their gradients are summed over each group.
- ``gate``: the log decay that the core consumes, from the raw gate ``g``
  (``"softplus"``: ``-exp(A_log) * softplus(g + dt_bias)``;
  ``"lower_bound"``: ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``).
- ``beta_activation``: ``sigmoid(beta)`` or ``2 * sigmoid(beta)``.

softplus and sigmoid are written with ``exp(-|x|)`` only, so they neither overflow nor switch
formula at a threshold: ``softplus(x) = max(x, 0) + log1p(exp(-|x|))`` equals ``log1p(exp(x))``
to rounding for every finite ``x``. No gate produces a positive log decay.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .table import plain_predicate

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
    def is_identity(self) -> bool:
        """No element-wise map at all: the core's inputs are the raw inputs (every option held here
        at a plain value of the table, :func:`kda._options.table.is_plain`)."""
        return _plain_maps(self)


# the table's plain-call test over the options this record holds
_plain_maps = plain_predicate(tuple(f.name for f in fields(Options)))


def head_first(xp: Any, x: Any, layout: str) -> Any:
    """Swap the time and head axes of a time-major array (its own inverse); a view.

    ``[B, T, heads, ...]`` <-> ``[B, heads, T, ...]``; head-first arrays and None pass through.
    """
    if layout == "head_first" or x is None:
        return x
    return xp.permute_dims(x, (0, 2, 1, *range(3, x.ndim)))


def _sigmoid(xp: Any, x: Any) -> Any:
    """``1 / (1 + exp(-x))`` without overflow for any ``x``."""
    z = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + z), z / (1 + z))


def _softplus(xp: Any, x: Any) -> Any:
    """``log1p(exp(x))`` without overflow for any ``x``."""
    return xp.maximum(x, xp.zeros_like(x)) + xp.log1p(xp.exp(-xp.abs(x)))


def _head_param(x: Any) -> Any:
    """``[HV]`` -> ``[1, HV, 1, 1]`` (broadcasts over ``[B, HV, T, K]``)."""
    return x[None, :, None, None]


def _gate_argument(xp: Any, g: Any, o: Options) -> Any:
    """``g + dt_bias`` (broadcast over batch and steps)."""
    return g if o.dt_bias is None else g + o.dt_bias[None, :, None, :]


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
    gate_arg: Any = None  # g + dt_bias (raw gates)
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


def _log_decay(xp: Any, g: Any, o: Options) -> tuple[Any, Any]:
    """The log decay (``<= 0``) from the raw gate, and the gate's argument ``g + dt_bias``."""
    if o.gate == "log":
        return g, None
    x = _gate_argument(xp, g, o)
    if o.gate == "softplus":
        return -xp.exp(_head_param(o.A_log)) * _softplus(xp, x), x
    scaled = x if o.A_log is None else xp.exp(_head_param(o.A_log)) * x
    return o.lower_bound * _sigmoid(xp, scaled), x


def gate_backward(xp: Any, dlog: Any, c: CoreInputs, o: Options) -> tuple[Any, Any, Any]:
    """Gradients of the raw ``g``, ``A_log`` and ``dt_bias`` from that of the log decay.

    Returns ``(dg, dA_log, ddt_bias)``; the last two are None where the option is unused.
    """
    if o.gate == "log":
        return dlog, None, None
    x = c.gate_arg
    if o.gate == "softplus":
        a = xp.exp(_head_param(o.A_log))
        dx = -a * _sigmoid(xp, x) * dlog
        dA = xp.sum(dlog * c.g, axis=(0, 2, 3))  # d(-a softplus)/dA_log = the log decay itself
    else:
        a = 1.0 if o.A_log is None else xp.exp(_head_param(o.A_log))
        s = _sigmoid(xp, a * x)
        ds = o.lower_bound * s * (1 - s) * dlog  # gradient of the sigmoid's argument
        dx = a * ds
        dA = None if o.A_log is None else xp.sum(ds * a * x, axis=(0, 2, 3))
    ddt = None if o.dt_bias is None else xp.sum(dx, axis=(0, 2))
    return dx, dA, ddt


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
    log_decay, gate_arg = _log_decay(xp, g, o)
    activated, beta_sig = _activate_beta(xp, beta, o)
    return CoreInputs(
        q=expand_heads(xp, q, HV), k=expand_heads(xp, k, HV), v=v, g=log_decay, beta=activated,
        q_unit=q_unit, k_unit=k_unit, q_norm=q_norm, k_norm=k_norm, gate_arg=gate_arg, beta_sig=beta_sig,
    )  # fmt: skip


def qk_backward(xp: Any, dq: Any, dk: Any, c: CoreInputs, o: Options, H: int) -> tuple[Any, Any]:
    """Gradients of the raw q and k from those of the core's (expanded, normalised) q and k."""
    dq, dk = sum_heads(xp, dq, H), sum_heads(xp, dk, H)
    if o.qk_l2norm:
        dq = l2norm_backward(xp, dq, c.q_unit, c.q_norm)
        dk = l2norm_backward(xp, dk, c.k_unit, c.k_norm)
    return dq, dk
