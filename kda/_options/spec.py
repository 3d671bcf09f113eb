"""A call's non-array choices, one record: :class:`CallSpec`.

Everything about a KDA call that is not an array (the method, scale, chunk size, layout,
backend and the model-level options of the table that are not arrays) is one hashable, picklable
named tuple. It is what the entry points build a call from (:func:`kda._entry.call.build_call`,
the validating door; :func:`kda._entry.call.bind_call`, the non-validating one) and what context
parallelism and Dask pass to their steps and tasks. The fla-style adapters' static options
(:class:`kda._entry.fla.OpOptions`: the torch ops' non-tensor arguments, whose public schemas
predate this record, and JAX's static argument) are made into one (``OpOptions.spec``). The arrays that
go with it are :class:`~kda._entry.call.Inputs` (the gate law's parameters among them) and the
packed-sequence offsets (``cu_seqlens``).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

from .gates import PARAMETER_NAMES
from .table import OPTIONS, Choices

__all__ = ["ARRAY_OPTIONS", "METHODS", "CallSpec"]

METHODS = ("chunk", "recurrent")  # the chunked form, the step recurrence
# the options of the table that are arrays: they travel with the arrays, not in the spec
ARRAY_OPTIONS = (*PARAMETER_NAMES, "cu_seqlens")


class CallSpec(NamedTuple):
    """The non-array choices of one call (hashable, picklable).

    ``method``: ``"chunk"`` (the chunked form, ``chunk_size`` steps a chunk) or ``"recurrent"``
    (the step recurrence; ``chunk_size`` unused); ``scale``: None for ``K ** -0.5``; ``backend``:
    None picks it from the arrays. The rest are the table's options (:mod:`kda._options.table`),
    less the arrays (:data:`ARRAY_OPTIONS`); ``beta_activation`` None for none.
    """

    method: str = "chunk"
    scale: float | None = None
    chunk_size: int = 64
    layout: str = "head_first"
    backend: str | None = None
    qk_l2norm: bool = False
    gate: str = "log"
    lower_bound: float | None = None
    beta_activation: str | None = None
    check_finite: bool = True

    @classmethod
    def from_choices(
        cls,
        opts: Choices,
        *,
        method: str = "chunk",
        scale: Any = None,
        chunk_size: Any = 64,
        backend: Any = None,
    ) -> CallSpec:
        """The spec of a public call: its own arguments and the table's options as given
        (:class:`~kda._options.table.Choices`, the arrays left out). Nothing is checked here."""
        options = dict(zip(_SPEC_OPTIONS, _spec_options(opts)))  # (one C call: every call makes one)
        return cls(method=method, scale=scale, chunk_size=chunk_size, backend=backend, **options)

    def choices(self, params: dict[str, Any] | None = None, cu_seqlens: Any = None) -> Choices:
        """The table's :class:`~kda._options.table.Choices` of this spec with the gate parameters
        ``params`` (by name) and ``cu_seqlens``."""
        options = dict(zip(_SPEC_OPTIONS, _spec_options(self)))
        return Choices(**options, **(params or {}), cu_seqlens=cu_seqlens)


# the table's non-array options, each a field of CallSpec: a new option's row needs its field here
_SPEC_OPTIONS = tuple(o.name for o in OPTIONS if o.name not in ARRAY_OPTIONS)
_spec_options = operator.attrgetter(*_SPEC_OPTIONS)  # a record's values of them, as a tuple
_missing = [name for name in _SPEC_OPTIONS if name not in CallSpec._fields]
if _missing:  # pragma: no cover - a table row without its field
    msg = f"options {_missing} of the table have no field in CallSpec"
    raise ImportError(msg)
