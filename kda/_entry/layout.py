"""V-major states (``state_v_first``): the entry layer's transposes around the K-major kernels.

:func:`kda.chunk_kda` and :func:`kda.chunk_kda_backward` take and return their states
(``initial_state``, ``final_state``, ``boundaries``, ``grad_final_state`` and the
``initial_state`` gradient) V-major, ``[.., HV, V, K]``, with ``state_v_first=True``
(:func:`k_major_state`, :func:`v_major_output`). The chunk kernels work on K-major states, so
the entry layer transposes them: a copy of the ``[N, HV, K, V]`` states (and ``[NT, B, HV, K,
V]`` boundaries) in each direction, small next to the chunk work; results are bitwise those of
the K-major call, transposed.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from .._errors import InvalidInputError, InvalidTypeError
from .._options.validation import STATE_DTYPE_RULE, Problem, check_array
from .call import KdaOutput

__all__ = ["check_state_v_first", "k_major_state", "transposed", "v_major_output"]


def check_state_v_first(state_v_first: Any) -> bool:
    """``state_v_first`` is a bool (True: states ``[.., V, K]``, V-major); returned."""
    if not isinstance(state_v_first, bool):
        msg = (
            "state_v_first must be a bool (True: states [.., V, K], V-major; False: [.., K, V]); got "
            f"{state_v_first!r} of type {type(state_v_first).__name__}"
        )
        raise InvalidTypeError(msg)
    return state_v_first


def transposed(xp: Any, a: Any) -> Any:
    """``a [..., X, Y]`` as ``[..., Y, X]``: C-contiguous for NumPy and CuPy arrays (a copy)."""
    t = xp.matrix_transpose(a)
    if array_api_compat.is_numpy_array(t) or array_api_compat.is_cupy_array(t):
        import numpy as np

        return np.ascontiguousarray(t) if array_api_compat.is_numpy_array(t) else xp.asarray(t, copy=True)
    return t


def k_major_state(name: str, state: Any, p: Problem, boundaries: tuple[int, ...] | None = None) -> Any:
    """The V-major ``state`` (``[N, HV, V, K]``; with ``boundaries``, the K-major boundaries'
    shape: ``[NT, B, HV, V, K]``) checked and transposed to K-major; None stays None."""
    if state is None:
        return None
    if boundaries is not None:
        shape, letters = (*boundaries[:3], p.V, p.K), "NT, B, HV, V, K"
    else:
        shape, letters = (p.N, p.HV, p.V, p.K), ("B" if p.offsets is None else "N") + ", HV, V, K"
    got = tuple(int(n) for n in getattr(state, "shape", ()))
    if array_api_compat.is_array_api_obj(state) and got != shape:
        msg = f"{name} must have shape [{letters}] = {shape} (V-major: state_v_first=True); got {got}"
        if got == (*shape[:-2], p.K, p.V):
            msg += " (the K-major layout: pass state_v_first=False for states of that layout)"
        raise InvalidInputError(msg)
    check_array(name, state, p, shape, letters, p.compute_dtype, STATE_DTYPE_RULE)
    return transposed(p.xp, state)


def v_major_output(xp: Any, out: Any) -> Any:
    """A :class:`KdaOutput` (its final state and boundaries) or :class:`KdaGradients` (its
    ``initial_state``) with the states transposed to V-major."""
    if isinstance(out, KdaOutput):
        boundaries = None if out.boundaries is None else transposed(xp, out.boundaries)
        return KdaOutput(out.output, transposed(xp, out.final_state), boundaries)
    return out._replace(initial_state=transposed(xp, out.initial_state))
