"""The public functions: validation, then a call into backend-neutral code."""

from __future__ import annotations

from typing import Any, NamedTuple

from ._backends import get_backend
from ._chunked import chunk_backward, chunk_forward
from ._validation import (
    STATE_DTYPE_RULE,
    Problem,
    check_array,
    check_chunk_size,
    check_state,
    validate_problem,
)

__all__ = [
    "KdaGradients",
    "KdaOutput",
    "chunk_kda",
    "chunk_kda_backward",
    "recurrent_kda",
    "recurrent_kda_backward",
]


class KdaOutput(NamedTuple):
    """Result of a KDA forward.

    Attributes
    ----------
    output : ``[B, H, T, V]``, dtype of the inputs.
    final_state : ``[B, H, K, V]``, float32 (float64 for float64 inputs).
    boundaries : ``[NT, B, H, K, V]``, the state at the start of each chunk (same dtype as
        ``final_state``), or ``None`` when not asked for.
    """

    output: Any
    final_state: Any
    boundaries: Any


class KdaGradients(NamedTuple):
    """Gradients of a KDA forward with respect to each input, each shaped like that input.

    ``q, k, v, g, beta`` have the inputs' dtype; ``initial_state`` is float32 (float64 for
    float64 inputs).
    """

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any
    initial_state: Any


_INPUTS_DOC = """
    q, k : array, shape ``[B, H, T, K]``
        Queries and keys (KDA models L2-normalise keys per step; nothing here requires it).
    v : array, shape ``[B, H, T, V]``
        Values.
    g : array, shape ``[B, H, T, K]``
        Log decays, per step and key channel: every element ``<= 0``; ``-inf`` is a hard reset
        of that channel. Positive and NaN values raise :class:`~kda.InvalidInputError`.
    beta : array, shape ``[B, H, T]``
        Delta-rule step sizes (writing strengths).
"""


def _compute_inputs(p: Problem, *arrays: Any) -> list[Any]:
    """The arrays in the compute dtype (no copy when they already have it)."""
    return [p.xp.astype(x, p.compute_dtype, copy=False) for x in arrays]


def _state_or_zeros(p: Problem, state: Any) -> Any:
    if state is not None:
        return state
    return p.xp.zeros((p.B, p.H, p.K, p.V), dtype=p.compute_dtype)


def _grad_state(p: Problem, grad_final_state: Any) -> Any:
    return _state_or_zeros(p, check_state("grad_final_state", grad_final_state, p))


def _check_grad_output(p: Problem, grad_output: Any) -> Any:
    shape = (p.B, p.H, p.T, p.V)
    return check_array("grad_output", grad_output, p, shape, "B, H, T, V", p.dtype, "the dtype of q")


def _outputs(p: Problem, o: Any, final: Any, boundaries: Any) -> KdaOutput:
    return KdaOutput(p.xp.astype(o, p.dtype, copy=False), final, boundaries)


def _gradients(p: Problem, grads: tuple[Any, ...]) -> KdaGradients:
    *inputs, dstate = grads
    cast = [p.xp.astype(x, p.dtype, copy=False) for x in inputs]
    return KdaGradients(*cast, dstate)


def chunk_kda(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    chunk_size: int = 64,
    save_boundaries: bool = False,
    backend: str | None = None,
) -> KdaOutput:
    """Kimi Delta Attention, chunked forward.

    Per batch and head, with state ``S: [K, V]``::

        S_t = diag(exp(g_t)) S_{t-1};  u_t = beta_t (v_t - S_t^T k_t)
        S_t = S_t + k_t u_t^T;         o_t = scale S_t^T q_t

    computed chunk by chunk: the state-free work of all chunks at once, then the state
    recurrence over chunks.

    Parameters
    ----------{inputs}
    scale : float, optional
        Query scale; default ``K ** -0.5``.
    initial_state : array, shape ``[B, H, K, V]``, optional
        State before the first step, float32 (float64 for float64 inputs); zeros when None.
    chunk_size : int, default 64
        Steps per chunk ``C``.
    save_boundaries : bool, default False
        Also return the chunk-start states, ``[NT, B, H, K, V]`` with ``NT = ceil(T / C)``,
        for :func:`chunk_kda_backward`.
    backend : {None, "reference"}
        ``None`` picks from the arrays' namespace.

    Returns
    -------
    KdaOutput
        ``(output [B, H, T, V], final_state [B, H, K, V], boundaries or None)``. float16 and
        bfloat16 inputs compute in float32 and return their own dtype.
    """
    p = validate_problem(q, k, v, g, beta, scale)
    chunk_size = check_chunk_size(chunk_size)
    state = _state_or_zeros(p, check_state("initial_state", initial_state, p))
    ops = get_backend(p.xp, backend)
    args = _compute_inputs(p, q, k, v, g, beta)
    o, final, boundaries = chunk_forward(ops, p.xp, *args, p.scale, state, chunk_size)
    return _outputs(p, o, final, boundaries if save_boundaries else None)


def chunk_kda_backward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    boundaries: Any,
    grad_output: Any,
    grad_final_state: Any = None,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    chunk_size: int = 64,
    backend: str | None = None,
) -> KdaGradients:
    """Kimi Delta Attention, chunked backward.

    Parameters
    ----------{inputs}
    boundaries : array, shape ``[NT, B, H, K, V]``, or None
        Chunk-start states from ``chunk_kda(..., save_boundaries=True)`` with the same
        ``chunk_size``; None recomputes them from ``initial_state`` (less memory, more time).
    grad_output : array, shape ``[B, H, T, V]``
        Gradient of ``output``, dtype of the inputs.
    grad_final_state : array, shape ``[B, H, K, V]``, optional
        Gradient of ``final_state``; zeros when None.
    scale, initial_state, chunk_size, backend
        As for :func:`chunk_kda`.

    Returns
    -------
    KdaGradients
        ``(q, k, v, g, beta, initial_state)``, each shaped like its input.
    """
    p = validate_problem(q, k, v, g, beta, scale)
    chunk_size = check_chunk_size(chunk_size)
    state = _state_or_zeros(p, check_state("initial_state", initial_state, p))
    if boundaries is not None:
        shape = (p.num_chunks(chunk_size), p.B, p.H, p.K, p.V)
        check_array("boundaries", boundaries, p, shape, "NT, B, H, K, V", p.compute_dtype, STATE_DTYPE_RULE)
    do = _check_grad_output(p, grad_output)
    dstate = _grad_state(p, grad_final_state)
    ops = get_backend(p.xp, backend)
    args = _compute_inputs(p, q, k, v, g, beta)
    (do,) = _compute_inputs(p, do)
    grads = chunk_backward(ops, p.xp, *args, p.scale, state, boundaries, do, dstate, chunk_size)
    return _gradients(p, grads)


def recurrent_kda(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    backend: str | None = None,
) -> KdaOutput:
    """Kimi Delta Attention, step by step: the definition, and the oracle of the chunked form.

    Parameters
    ----------{inputs}
    scale, initial_state, backend
        As for :func:`chunk_kda`.

    Returns
    -------
    KdaOutput
        ``(output [B, H, T, V], final_state [B, H, K, V], None)``.
    """
    p = validate_problem(q, k, v, g, beta, scale)
    state = _state_or_zeros(p, check_state("initial_state", initial_state, p))
    ops = get_backend(p.xp, backend)
    o, final = ops.recurrent_forward(*_compute_inputs(p, q, k, v, g, beta), p.scale, state)
    return _outputs(p, o, final, None)


def recurrent_kda_backward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    grad_output: Any,
    grad_final_state: Any = None,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    backend: str | None = None,
) -> KdaGradients:
    """Gradients of :func:`recurrent_kda`, by a hand-written backward through the steps.

    Parameters
    ----------{inputs}
    grad_output, grad_final_state
        As for :func:`chunk_kda_backward`.
    scale, initial_state, backend
        As for :func:`chunk_kda`.

    Returns
    -------
    KdaGradients
        ``(q, k, v, g, beta, initial_state)``, each shaped like its input.
    """
    p = validate_problem(q, k, v, g, beta, scale)
    state = _state_or_zeros(p, check_state("initial_state", initial_state, p))
    do = _check_grad_output(p, grad_output)
    dstate = _grad_state(p, grad_final_state)
    ops = get_backend(p.xp, backend)
    args = _compute_inputs(p, q, k, v, g, beta, do)
    grads = ops.recurrent_backward(*args[:5], p.scale, state, args[5], dstate)
    return _gradients(p, grads)


for _f in (chunk_kda, chunk_kda_backward, recurrent_kda, recurrent_kda_backward):
    _f.__doc__ = _f.__doc__.replace("{inputs}", _INPUTS_DOC.rstrip())
