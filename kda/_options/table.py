"""The model-level options, declared once.

Every public entry point takes the same keyword options. Each is declared here, once: its name,
default, allowed values, type hint, documentation and the values that leave a call plain. The
entry points write them out in their own ``def`` (keyword-only, after their own parameters, in
the table's order, with the table's defaults and type hints), document each with the table's
text (:func:`options_doc` gives the entries) and gather them into one :class:`Choices`;
``tests/entry/test_signatures.py`` holds every public signature and docstring to this table.
The allowed values are checked by :func:`kda._options.validation.validate_options`.

Adding an option: a row here (its ``plain`` values included), its field in :class:`Choices` and
its test in :func:`is_plain` (and :attr:`kda._options.maps.Options.is_identity` where that record
holds it), its check in ``validation.py``, its map in ``maps.py``, and its keyword, docstring
entry and ``Choices`` field in every public entry point (the signature test names each one that
lacks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import gates

__all__ = ["ANY", "OPTIONS", "Array", "Choices", "Option", "is_plain", "option_names", "options_doc"]

Array = Any  # an array of the caller's array-API namespace (in signatures)

LAYOUTS = ("head_first", "time_major")
GATES = gates.BUILT_IN  # the built-in gate laws' names (the option's choices: every registered law)
BETA_ACTIVATIONS = (None, "sigmoid", "sigmoid2")


class _Any:
    """Every value of an option leaves a call plain (:attr:`Option.plain`)."""

    def __repr__(self) -> str:
        return "ANY"


ANY = _Any()


@dataclass(frozen=True)
class Option:
    """One model-level option: its keyword's ``name``, ``default`` and type hint (``annotation``),
    its numpydoc entry's body ``doc`` (continuation lines indented by 8 spaces), its allowed values
    (``choices``, None: any that its check accepts) and its ``plain`` values."""

    name: str
    default: Any
    annotation: str
    doc: str
    choices: tuple[Any, ...] | None = None
    # the values with which the option leaves a call plain: the inputs reach the kernels as they
    # are (no element-wise map, no packing); ANY: every value (a view or a check, not a map).
    # Required, so that a new option states it and no fast path can ignore it (:func:`is_plain`).
    plain: tuple[Any, ...] | Any = field(kw_only=True)


OPTIONS: tuple[Option, ...] = (
    Option(
        name="layout",
        default="head_first",
        annotation="str",
        doc="""``"time_major"`` takes and returns ``[B, T, heads, ...]`` arrays. States are always
        ``[B, HV, K, V]``, boundaries ``[NT, B, HV, K, V]``.""",
        choices=LAYOUTS,
        plain=LAYOUTS,
    ),
    Option(
        name="qk_l2norm",
        default=False,
        annotation="bool",
        doc="""Replace q and k by ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head.""",
        plain=(False,),
    ),
    Option(
        name="gate",
        default="log",
        annotation="str",
        doc="The gate law (:mod:`kda._options.gates`), the log decay from ``g``: "
        + "; ".join(f'``"{law.name}"``: {law.doc}' for law in gates.LAWS.values())
        + ".",
        choices=gates.LAWS,
        plain=("log",),
    ),
    Option(
        name="A_log",
        default=None,
        annotation="Array | None",
        doc="""shape ``[HV]``. Required for ``"softplus"``, optional for ``"lower_bound"``, refused
        for ``"log"``.""",
        plain=(None,),
    ),
    Option(
        name="dt_bias",
        default=None,
        annotation="Array | None",
        doc="""shape ``[HV, K]``. Gate bias (zeros when None); refused for ``"log"``.""",
        plain=(None,),
    ),
    Option(
        name="lower_bound",
        default=None,
        annotation="float | None",
        doc="""A float < 0, required for ``"lower_bound"`` only.""",
        plain=(None,),
    ),
    Option(
        name="beta_activation",
        default=None,
        annotation="str | None",
        doc="""Use ``beta``, ``sigmoid(beta)`` or ``2 * sigmoid(beta)`` (negative eigenvalues allowed).""",
        choices=BETA_ACTIVATIONS,
        plain=(None,),
    ),
    Option(
        name="cu_seqlens",
        default=None,
        annotation="Array | None",
        doc="""1-D integer array of ``N + 1`` offsets. With ``B == 1``: the row holds ``N``
        independent sequences, sequence ``i`` at steps ``cu_seqlens[i]:cu_seqlens[i + 1]``;
        states are ``[N, HV, K, V]``, boundaries ``[NT, 1, HV, K, V]`` with
        ``NT = sum(ceil(len_i / C))``, in sequence order.""",
        plain=(None,),
    ),
    Option(
        name="check_finite",
        default=True,
        annotation="bool",
        doc="""Refuse NaN or infinite inputs (``-inf`` stays legal in a log gate) with
        :class:`~kda.InvalidInputError`, and warn with :class:`~kda.KdaWarning` when finite
        inputs give non-finite results (the delta rule diverged). False skips both.""",
        plain=ANY,
    ),
)


def is_plain(v: Any) -> bool:
    """Whether the options leave a call plain: the inputs reach the kernels as they are.

    ``v``: a :class:`Choices`, or any record with every option as an attribute. Each option at one
    of its :attr:`Option.plain` values (``is`` for None and bools, ``==`` for strings; an option
    whose every value is plain, :data:`ANY`, is not asked). The one definition of a plain call,
    asked by the NumPy decode route, the plans' direct runs and the chain rules' shortcuts
    (:attr:`kda._options.maps.Options.is_identity` asks the same of the options it holds), so a
    fast path cannot ignore an option; ``tests/entry/test_signatures.py`` holds it to the table.
    """
    return (
        (v.layout == "head_first" or v.layout == "time_major")
        and v.qk_l2norm is False
        and v.gate == "log"
        and v.A_log is None
        and v.dt_bias is None
        and v.lower_bound is None
        and v.beta_activation is None
        and v.cu_seqlens is None
    )


def option_names() -> tuple[str, ...]:
    """The options' names in table order."""
    return tuple(o.name for o in OPTIONS)


@dataclass(frozen=True)
class Choices:
    """The options of one call, as given (validated by
    :func:`kda._options.validation.validate_options`): one field per row of :data:`OPTIONS`, in
    its order, with its default."""

    layout: str = "head_first"
    qk_l2norm: bool = False
    gate: str = "log"
    A_log: Array | None = None
    dt_bias: Array | None = None
    lower_bound: float | None = None
    beta_activation: str | None = None
    cu_seqlens: Array | None = None
    check_finite: bool = True


def option_header(o: Option) -> str:
    """The first line of option ``o``'s numpydoc entry: ``name : kind, default value``."""
    if o.choices:
        kind = "{" + ", ".join(_literal(c) for c in o.choices) + "}"
    else:
        kind = o.annotation
    return f"{o.name} : {kind}, default {_literal(o.default)}"


def _literal(value: Any) -> str:
    """A value as the docstrings write it (strings in double quotes)."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def options_doc() -> str:
    """The numpydoc entries of the options, in table order: each :func:`option_header` and the
    option's :attr:`Option.doc`, as every public docstring holds them (the docstrings wrap the
    text as they like; a remark of the entry point may follow an entry)."""
    return "\n".join(f"{option_header(o)}\n        {o.doc}" for o in OPTIONS)
