"""The public functions: validation, then a call into backend-neutral code.

Each function validates its inputs and the model-level options (:mod:`kda._options`), maps the
raw inputs to the core's (layout, q/k normalisation, grouped heads, gate, beta activation), runs
a core (the chunked algorithm of :mod:`kda._chunked`, or the step recurrence) once per group of
packed sequences (:mod:`kda._varlen`), and applies the chain rule of the options on the way back.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._backends import get_backend
from ._checks import check_finite as _check_finite
from ._checks import floating_point_quiet, warn_if_diverged
from ._core import ChunkCore, Core, RecurrentCore, run_backward, run_forward
from ._options import (
    CoreInputs,
    Options,
    beta_backward,
    gate_backward,
    head_first,
    prepare_core_inputs,
    qk_backward,
)
from ._validation import (
    STATE_DTYPE_RULE,
    Problem,
    check_array,
    check_chunk_size,
    check_options_call,
    check_state,
    raise_for_gates,
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
    output : ``[B, HV, T, V]`` (``[B, T, HV, V]`` time-major), dtype of the inputs.
    final_state : ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``), float32 (float64
        for float64 inputs).
    boundaries : ``[NT, B, HV, K, V]``, the state at the start of each chunk (same dtype as
        ``final_state``), or ``None`` when not asked for.
    """

    output: Any
    final_state: Any
    boundaries: Any


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


_INPUTS_DOC = """
    q, k : array, shape ``[B, H, T, K]``
        Queries and keys (``[B, T, H, K]`` with ``layout="time_major"``).
    v : array, shape ``[B, HV, T, V]``
        Values; ``HV`` is a multiple of ``H`` (grouped value heads: value head ``i`` reads
        q/k head ``i // (HV // H)``).
    g : array, shape ``[B, HV, T, K]``
        With ``gate="log"``: log decays, every element ``<= 0``, ``-inf`` a hard reset of that
        channel (positive and NaN values raise :class:`~kda.InvalidInputError`). With
        ``gate="softplus"`` or ``"lower_bound"``: the raw gate, any finite value.
    beta : array, shape ``[B, HV, T]``
        Delta-rule step sizes, or their logits with ``beta_activation``.
"""

_OPTIONS_DOC = """
    layout : {"head_first", "time_major"}
        ``"time_major"`` takes and returns ``[B, T, heads, ...]`` arrays. States are always
        ``[B, HV, K, V]``, boundaries ``[NT, B, HV, K, V]``.
    qk_l2norm : bool, default False
        Replace q and k by ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head.
    gate : {"log", "softplus", "lower_bound"}
        The log decay: ``g`` itself; ``-exp(A_log[h]) * softplus(g + dt_bias[h])``; or
        ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (factor 1 when ``A_log``
        is None).
    A_log : array, shape ``[HV]``, optional
        Required for ``"softplus"``, optional for ``"lower_bound"``, refused for ``"log"``.
    dt_bias : array, shape ``[HV, K]``, optional
        Gate bias (zeros when None); refused for ``"log"``.
    lower_bound : float < 0, optional
        Required for ``"lower_bound"`` only.
    beta_activation : {None, "sigmoid", "sigmoid2"}
        Use ``beta``, ``sigmoid(beta)`` or ``2 * sigmoid(beta)`` (negative eigenvalues allowed).
    cu_seqlens : 1-D integer array of ``N + 1`` offsets, optional
        With ``B == 1``: the row holds ``N`` independent sequences, sequence ``i`` at steps
        ``cu_seqlens[i]:cu_seqlens[i + 1]``; states are ``[N, HV, K, V]``, boundaries
        ``[NT, 1, HV, K, V]`` with ``NT = sum(ceil(len_i / C))``, in sequence order.
    check_finite : bool, default True
        Refuse NaN or infinite inputs (``-inf`` stays legal in a log gate) with
        :class:`~kda.InvalidInputError`, and warn with :class:`~kda.KdaWarning` when finite
        inputs give non-finite results (the delta rule diverged). False skips both.
"""


def _check_inputs_finite(p: Problem, o: Options, check: bool, **arrays: Any) -> None:
    if not check:
        return
    for name, x in arrays.items():
        _check_finite(p.xp, name, x, allow_neg_inf=name == "g" and o.gate == "log")
    for name, x in (("A_log", o.A_log), ("dt_bias", o.dt_bias)):
        _check_finite(p.xp, name, x)


def _core_inputs(p: Problem, o: Options, q, k, v, g, beta) -> CoreInputs:
    """The core's inputs: head-first, in the compute dtype, with every option applied."""
    xp = p.xp
    arrays = [head_first(xp, xp.astype(x, p.compute_dtype, copy=False), p.layout) for x in (q, k, v, g, beta)]
    with floating_point_quiet(xp):
        return prepare_core_inputs(xp, *arrays, o, p.HV)


def _state_or_zeros(p: Problem, name: str, state: Any) -> Any:
    state = check_state(name, state, p)
    if state is not None:
        return state
    return p.xp.zeros((p.N, p.HV, p.K, p.V), dtype=p.compute_dtype)


def _grad_output(p: Problem, grad_output: Any) -> Any:
    shape, letters = p.shape(p.HV, p.V), p.letters("HV", "V")
    do = check_array("grad_output", grad_output, p, shape, letters, p.dtype, "the dtype of q")
    return head_first(p.xp, p.xp.astype(do, p.compute_dtype, copy=False), p.layout)


def _check_boundaries(p: Problem, boundaries: Any, chunk_size: int) -> None:
    if boundaries is not None:
        shape = (p.num_chunks(chunk_size), p.B, p.HV, p.K, p.V)
        check_array("boundaries", boundaries, p, shape, "NT, B, HV, K, V", p.compute_dtype, STATE_DTYPE_RULE)


def _forward(
    p: Problem, o: Options, core: Core, inputs: tuple, state: Any, check: bool, keep: bool
) -> KdaOutput:
    c = _core_inputs(p, o, *inputs)
    with floating_point_quiet(p.xp):
        out, final, boundaries = run_forward(core, p.xp, c, state, o.cu_seqlens, keep)
    raise_for_gates(p)  # a deferred device check, read once the work is queued
    if check:
        warn_if_diverged(p.xp, out, final, stacklevel=4)
    output = p.xp.astype(head_first(p.xp, out, p.layout), p.dtype, copy=False)
    return KdaOutput(output, final, boundaries if keep else None)


def _backward(
    p: Problem,
    o: Options,
    core: Core,
    inputs: tuple,
    state: Any,
    boundaries: Any,
    do: Any,
    dstate: Any,
    check: bool,
) -> KdaGradients:
    xp = p.xp
    c = _core_inputs(p, o, *inputs[:5])
    with floating_point_quiet(xp):
        dq, dk, dv, dlog, dbeta, dstate = run_backward(
            core, xp, c, state, boundaries, do, dstate, o.cu_seqlens
        )
        dg, dA_log, ddt_bias = gate_backward(xp, dlog, c, o)
        dq, dk = qk_backward(xp, dq, dk, c, o, p.H)
        dbeta = beta_backward(xp, dbeta, c, o)
    raise_for_gates(p)
    if check:
        warn_if_diverged(xp, dq, dk, dv, dg, dbeta, dstate, stacklevel=4)
    grads = [xp.astype(head_first(xp, x, p.layout), p.dtype, copy=False) for x in (dq, dk, dv, dg, dbeta)]
    params = [
        None if d is None else xp.astype(d, x.dtype, copy=False)
        for d, x in ((dA_log, inputs[5]), (ddt_bias, inputs[6]))
    ]
    return KdaGradients(*grads, dstate, *params)


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
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Any = None,
    dt_bias: Any = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Any = None,
    check_finite: bool = True,
) -> KdaOutput:
    """Kimi Delta Attention, chunked forward.

    Per batch and value head, with state ``S: [K, V]``::

        S_t = diag(exp(g_t)) S_{t-1};  u_t = beta_t (v_t - S_t^T k_t)
        S_t = S_t + k_t u_t^T;         o_t = scale S_t^T q_t

    computed chunk by chunk: the state-free work of all chunks at once, then the state
    recurrence over chunks. A chunk is never longer than the sequence (``T < chunk_size``
    computes one ``T``-step chunk), and ``T == 1`` runs one step of the recurrence.

    Parameters
    ----------{inputs}
    scale : float, optional
        Query scale; default ``K ** -0.5``.
    initial_state : array, shape ``[B, HV, K, V]``, optional
        State before the first step, float32 (float64 for float64 inputs); zeros when None.
    chunk_size : int, default 64
        Steps per chunk ``C``.
    save_boundaries : bool, default False
        Also return the chunk-start states, ``[NT, B, HV, K, V]`` with ``NT = ceil(T / C)``,
        for :func:`chunk_kda_backward`.
    backend : {None, "reference", "cuda"}
        ``None`` picks from the arrays' namespace.{options}

    Returns
    -------
    KdaOutput
        ``(output, final_state, boundaries or None)``. float16 and bfloat16 inputs compute in
        float32 and return their own dtype.
    """
    p, o = check_options_call(
        q, k, v, g, beta, scale, layout=layout, qk_l2norm=qk_l2norm, gate=gate, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, beta_activation=beta_activation, cu_seqlens=cu_seqlens,
        defer_gate_check=True,
    )  # fmt: skip
    core = ChunkCore(get_backend(p.xp, backend), p.scale, check_chunk_size(chunk_size))
    state = _state_or_zeros(p, "initial_state", initial_state)
    _check_inputs_finite(p, o, check_finite, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    return _forward(p, o, core, (q, k, v, g, beta), state, check_finite, save_boundaries)


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
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Any = None,
    dt_bias: Any = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Any = None,
    check_finite: bool = True,
) -> KdaGradients:
    """Kimi Delta Attention, chunked backward.

    Parameters
    ----------{inputs}
    boundaries : array, shape ``[NT, B, HV, K, V]``, or None
        Chunk-start states from ``chunk_kda(..., save_boundaries=True)`` with the same
        ``chunk_size``; None recomputes them from ``initial_state`` (less memory, more time).
    grad_output : array, shape of the output
        Gradient of ``output``, dtype of the inputs.
    grad_final_state : array, shape ``[B, HV, K, V]``, optional
        Gradient of ``final_state``; zeros when None.
    scale, initial_state, chunk_size, backend
        As for :func:`chunk_kda`.{options}

    Returns
    -------
    KdaGradients
        ``(q, k, v, g, beta, initial_state, A_log, dt_bias)``, each shaped like its input.
    """
    p, o = check_options_call(
        q, k, v, g, beta, scale, layout=layout, qk_l2norm=qk_l2norm, gate=gate, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, beta_activation=beta_activation, cu_seqlens=cu_seqlens,
        defer_gate_check=True,
    )  # fmt: skip
    core = ChunkCore(get_backend(p.xp, backend), p.scale, check_chunk_size(chunk_size))
    state = _state_or_zeros(p, "initial_state", initial_state)
    _check_boundaries(p, boundaries, core.chunk_size)
    do = _grad_output(p, grad_output)
    dstate = _state_or_zeros(p, "grad_final_state", grad_final_state)
    _check_inputs_finite(
        p, o, check_finite, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
        boundaries=boundaries, grad_output=grad_output, grad_final_state=grad_final_state,
    )  # fmt: skip
    return _backward(
        p, o, core, (q, k, v, g, beta, A_log, dt_bias), state, boundaries, do, dstate, check_finite
    )


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
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Any = None,
    dt_bias: Any = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Any = None,
    check_finite: bool = True,
) -> KdaOutput:
    """Kimi Delta Attention, step by step: the definition, and the oracle of the chunked form.

    Parameters
    ----------{inputs}
    scale, initial_state, backend
        As for :func:`chunk_kda`.{options}

    Returns
    -------
    KdaOutput
        ``(output, final_state, None)``.
    """
    p, o = check_options_call(
        q, k, v, g, beta, scale, layout=layout, qk_l2norm=qk_l2norm, gate=gate, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, beta_activation=beta_activation, cu_seqlens=cu_seqlens,
        defer_gate_check=True,
    )  # fmt: skip
    core = RecurrentCore(get_backend(p.xp, backend), p.scale)
    state = _state_or_zeros(p, "initial_state", initial_state)
    _check_inputs_finite(p, o, check_finite, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    return _forward(p, o, core, (q, k, v, g, beta), state, check_finite, False)


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
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Any = None,
    dt_bias: Any = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Any = None,
    check_finite: bool = True,
) -> KdaGradients:
    """Gradients of :func:`recurrent_kda`, by a hand-written backward through the steps.

    Parameters
    ----------{inputs}
    grad_output, grad_final_state
        As for :func:`chunk_kda_backward`.
    scale, initial_state, backend
        As for :func:`chunk_kda`.{options}

    Returns
    -------
    KdaGradients
        ``(q, k, v, g, beta, initial_state, A_log, dt_bias)``, each shaped like its input.
    """
    p, o = check_options_call(
        q, k, v, g, beta, scale, layout=layout, qk_l2norm=qk_l2norm, gate=gate, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, beta_activation=beta_activation, cu_seqlens=cu_seqlens,
        defer_gate_check=True,
    )  # fmt: skip
    core = RecurrentCore(get_backend(p.xp, backend), p.scale)
    state = _state_or_zeros(p, "initial_state", initial_state)
    do = _grad_output(p, grad_output)
    dstate = _state_or_zeros(p, "grad_final_state", grad_final_state)
    _check_inputs_finite(
        p, o, check_finite, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
        grad_output=grad_output, grad_final_state=grad_final_state,
    )  # fmt: skip
    return _backward(p, o, core, (q, k, v, g, beta, A_log, dt_bias), state, None, do, dstate, check_finite)


for _f in (chunk_kda, chunk_kda_backward, recurrent_kda, recurrent_kda_backward):
    _f.__doc__ = _f.__doc__.replace("{inputs}", _INPUTS_DOC.rstrip()).replace(
        "{options}", _OPTIONS_DOC.rstrip()
    )
