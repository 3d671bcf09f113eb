"""The records of one call's arrays: :class:`Inputs` (what goes in, by name) and
:class:`KdaGradients` (what the backward gives back, in the same order)."""

from __future__ import annotations

from typing import Any, NamedTuple

from .._options.gates import parameters_of

__all__ = ["Inputs", "KdaGradients"]


class KdaGradients(NamedTuple):
    """Gradients of a KDA forward with respect to each input, each shaped like that input.

    ``q, k, v, g, beta`` have the inputs' dtype and are taken with respect to the raw inputs
    that were passed (before normalisation and activations); ``initial_state`` is float32
    (float64 for float64 inputs); ``A_log`` and ``dt_bias`` have their inputs' dtype, and are
    None when the gate does not use them.
    """

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any
    initial_state: Any
    A_log: Any = None
    dt_bias: Any = None


class Inputs(NamedTuple):
    """The arrays of one call, by name: the fields of :class:`KdaGradients`, in its order.

    ``q, k [B, H, T, K]``, ``v [B, HV, T, V]``, ``g [B, HV, T, K]``, ``beta [B, HV, T]`` (in the
    call's layout); ``initial_state [N, HV, K, V]``, ``A_log [HV]``, ``dt_bias [HV, K]``, each
    None where absent (or not needed: the forward reads ``q .. beta``, the backward also
    ``A_log`` and ``dt_bias``). The adapters' host arrays (:mod:`kda._entry.host`) are this
    record, time-major in the compute dtype.
    """

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any
    initial_state: Any = None
    A_log: Any = None
    dt_bias: Any = None

    @classmethod
    def of(cls, q: Any, k: Any, v: Any, g: Any, beta: Any, opts: Any, **arrays: Any) -> Inputs:
        """The step arrays with the gate parameters of ``opts`` (a
        :class:`~kda._options.table.Choices`, or any record with them as attributes)."""
        return cls(q, k, v, g, beta, **arrays, **parameters_of(opts))

    @property
    def steps(self) -> tuple[Any, Any, Any, Any, Any]:
        """``(q, k, v, g, beta)``: the arrays with a time axis."""
        return (self.q, self.k, self.v, self.g, self.beta)
