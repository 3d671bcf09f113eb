"""The model-level options, declared once.

Every public entry point takes the same keyword options. Each is declared here, once: its name,
default, allowed values and documentation. From this table come

- the options part of every public signature (:func:`takes_options` appends them, keyword-only,
  to the function it decorates: ``inspect.signature`` and ``help`` show them, an unknown keyword
  raises ``TypeError`` as for any Python function);
- the :class:`Choices` object an entry point receives them in, and its forwarding as keywords
  (:meth:`Choices.keywords`) to plans, transitions, Dask blocks and the adapters;
- the "options" section of every docstring (:func:`options_doc`);
- the checks of the allowed values (:func:`kda._options.validation.validate_options`).

Adding an option: a row here (its ``plain`` values included: :func:`is_plain`), its check in
``validation.py`` and its map in ``maps.py``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

from . import gates

__all__ = [
    "ANY", "OPTIONS", "Array", "Choices", "Option", "is_plain", "option_names", "options_doc",
    "plain_predicate", "takes_options",
]  # fmt: skip

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
    """One model-level option: ``doc`` is its numpydoc entry's body (indented by 8 spaces)."""

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
        "layout", "head_first", "str",
        """``"time_major"`` takes and returns ``[B, T, heads, ...]`` arrays. States are always
        ``[B, HV, K, V]``, boundaries ``[NT, B, HV, K, V]``.""",
        LAYOUTS, plain=LAYOUTS,
    ),
    Option(
        "qk_l2norm", False, "bool",
        """Replace q and k by ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head.""",
        plain=(False,),
    ),
    Option(
        "gate", "log", "str",
        "The gate law (:mod:`kda._options.gates`), the log decay from ``g``: "
        + "; ".join(f'``"{law.name}"``: {law.doc}' for law in gates.LAWS.values()) + ".",
        gates.LAWS, plain=("log",),
    ),
    Option(
        "A_log", None, "Any",
        """shape ``[HV]``. Required for ``"softplus"``, optional for ``"lower_bound"``, refused
        for ``"log"``.""",
        plain=(None,),
    ),
    Option(
        "dt_bias", None, "Any", """shape ``[HV, K]``. Gate bias (zeros when None); refused for ``"log"``.""",
        plain=(None,),
    ),
    Option(
        "lower_bound", None, "float | None", """A float < 0, required for ``"lower_bound"`` only.""",
        plain=(None,),
    ),
    Option(
        "beta_activation", None, "str | None",
        """Use ``beta``, ``sigmoid(beta)`` or ``2 * sigmoid(beta)`` (negative eigenvalues allowed).""",
        BETA_ACTIVATIONS, plain=(None,),
    ),
    Option(
        "cu_seqlens", None, "Any",
        """1-D integer array of ``N + 1`` offsets. With ``B == 1``: the row holds ``N``
        independent sequences, sequence ``i`` at steps ``cu_seqlens[i]:cu_seqlens[i + 1]``;
        states are ``[N, HV, K, V]``, boundaries ``[NT, 1, HV, K, V]`` with
        ``NT = sum(ceil(len_i / C))``, in sequence order.""",
        plain=(None,),
    ),
    Option(
        "check_finite", True, "bool",
        """Refuse NaN or infinite inputs (``-inf`` stays legal in a log gate) with
        :class:`~kda.InvalidInputError`, and warn with :class:`~kda.KdaWarning` when finite
        inputs give non-finite results (the delta rule diverged). False skips both.""",
        plain=ANY,
    ),
)  # fmt: skip

_BY_NAME = {o.name: o for o in OPTIONS}


def _plain_test(o: Option) -> str:
    """Python source of the test that option ``o`` is plain, on a record ``v``."""
    terms = [
        f"v.{o.name} is {p!r}" if p is None or isinstance(p, bool) else f"v.{o.name} == {p!r}"
        for p in o.plain
    ]
    return "(" + " or ".join(terms) + ")"


def plain_predicate(names: Any = None) -> Callable[[Any], bool]:
    """The test that a record's options leave a call plain, generated from the table.

    ``names``: the options the record holds (a validated record holds a part of them; the rest
    are the problem's); default every option. The test reads each as an attribute and requires
    one of its :attr:`Option.plain` values (``is`` for None and bools, ``==`` for strings). One
    expression, generated once: a fast path asks it at every call.
    """
    tests = [_plain_test(o) for o in OPTIONS if o.plain is not ANY and (names is None or o.name in names)]
    source = f"def is_plain(v):\n    return {' and '.join(tests) or 'True'}\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "<kda option table: is_plain>", "exec"), namespace)
    return namespace["is_plain"]


# Whether the options (a Choices, or any record with every option as an attribute) leave a call
# plain: the one definition of a plain call, asked by the NumPy decode route, the plans' direct
# runs and the chain rules' shortcuts (through kda._options.maps.Options.is_identity), so a new
# option, whose row must state its plain values, cannot be ignored by a fast path.
is_plain = plain_predicate()


def option_names(exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The options' names in table order, less ``exclude``."""
    return tuple(o.name for o in OPTIONS if o.name not in exclude)


def _keywords(self: Any) -> dict[str, Any]:
    """The options as keywords for another entry point (no copies of arrays)."""
    return {f.name: getattr(self, f.name) for f in fields(self)}


# The options of one call, as given (validated by kda._options.validation.validate_options).
Choices = make_dataclass(
    "Choices",
    [(o.name, Any, field(default=o.default)) for o in OPTIONS],
    frozen=True,
    namespace={"keywords": _keywords, "__module__": __name__},
)


def options_doc(exclude: tuple[str, ...] = ()) -> str:
    """The numpydoc entries of the options (each ``name : type, default ...``), to stand in for a
    ``{options}`` placeholder indented like a parameter entry."""
    entries = []
    for o in OPTIONS:
        if o.name in exclude:
            continue
        kind = " | ".join(map(repr, o.choices)).replace("'", '"') if o.choices else o.annotation
        kind = f"{{{kind}}}" if o.choices else kind
        entries.append(f"{o.name} : {kind}, default {o.default!r}\n        {o.doc}")
    return "\n    ".join(entries)


def _public_signature(impl: Callable, exclude: tuple[str, ...]) -> inspect.Signature:
    sig = inspect.signature(impl)
    own = [p for p in sig.parameters.values() if p.name != "opts"]
    added = [
        inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.annotation)
        for o in OPTIONS
        if o.name not in exclude
    ]
    return sig.replace(parameters=own + added)


def takes_options(exclude: tuple[str, ...] = (), name: str | None = None) -> Callable[[Callable], Callable]:
    """Make ``impl(..., opts)`` an entry point that takes the table's options as keywords.

    ``impl``'s last parameter is ``opts`` (a :class:`Choices`); the entry point's signature is
    ``impl``'s own parameters followed by the options (keyword-only), ``exclude`` left out (they
    keep their defaults). ``{options}`` in ``impl``'s docstring becomes the options' entries.
    ``name``: the entry point's name where ``impl`` keeps its own (a body that other layers call
    with a :class:`Choices` directly, ``entry = takes_options(name="entry")(_body)``).
    """

    def wrap(impl: Callable) -> Callable:
        signature = _public_signature(impl, exclude)
        entry = _generated_entry(impl, signature, option_names(exclude), name or impl.__name__)
        functools.update_wrapper(entry, impl)
        if name is not None:
            entry.__name__ = entry.__qualname__ = name
        entry.__signature__ = signature  # type: ignore[attr-defined]
        entry.__doc__ = (impl.__doc__ or "").replace("{options}", options_doc(exclude))
        return entry

    return wrap


def _generated_entry(
    impl: Callable, signature: inspect.Signature, names: tuple[str, ...], public: str
) -> Callable:
    """A plain function with ``signature`` that calls ``impl(..., opts=Choices(<options>))``.

    Generated as Python source (the parameters, their defaults by reference) rather than binding
    arguments at every call: Python itself then refuses an unknown keyword or a missing argument,
    and a call costs what a hand-written function with these parameters costs.
    """
    params, forwarded, defaults = [], [], {}
    star_done = False
    for i, p in enumerate(signature.parameters.values()):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star_done:
            params.append("*")
            star_done = True
        text = p.name
        if p.default is not inspect.Parameter.empty:
            defaults[f"_d{i}"] = p.default
            text += f"=_d{i}"
        params.append(text)
        if p.name not in names:
            forwarded.append(f"{p.name}={p.name}")
    chosen = ", ".join(f"{n}={n}" for n in names)
    source = (
        f"def {public}({', '.join(params)}):\n"
        f"    return _impl({', '.join(forwarded)}, opts=_Choices({chosen}))\n"
    )
    namespace = {"_impl": impl, "_Choices": Choices, **defaults}
    exec(compile(source, f"<kda entry point {public}>", "exec"), namespace)
    return namespace[public]
