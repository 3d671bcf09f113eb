"""The public functions: open a :class:`~kda._entry.call.Call` (validation), then run it.

The chunked functions run the core's chunked algorithm; the recurrent ones the step recurrence
(the oracle). Each writes out the model-level options of the table (:mod:`kda._options.table`)
as its last keywords and gathers them into one :class:`~kda._options.table.Choices`.
"""

from __future__ import annotations

from .._backend import backend_doc
from .._backend.expect import backward_follows
from .._options.table import Array, Choices
from .call import Inputs, KdaGradients, KdaOutput, open_call
from .layout import check_state_v_first, k_major_state, v_major_output

__all__ = [
    "KdaGradients",
    "KdaOutput",
    "chunk_kda",
    "chunk_kda_backward",
    "recurrent_kda",
    "recurrent_kda_backward",
]

INPUTS_DOC = """
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


def chunk_kda(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    *,
    scale: float | None = None,
    initial_state: Array | None = None,
    chunk_size: int = 64,
    save_boundaries: bool = False,
    state_v_first: bool = False,
    backend: str | None = None,
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Array | None = None,
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
    state_v_first : bool, default False
        The states are V-major: ``initial_state`` ``[B, HV, V, K]``, and so are the returned
        final state and boundaries (``[NT, B, HV, V, K]``); bitwise the K-major call's states,
        transposed (the entry layer transposes them around the K-major chunk kernels).
    {backend}
    layout : {"head_first", "time_major"}, default "head_first"
        ``"time_major"`` takes and returns ``[B, T, heads, ...]`` arrays. States are always
        ``[B, HV, K, V]``, boundaries ``[NT, B, HV, K, V]``.
    qk_l2norm : bool, default False
        Replace q and k by ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head.
    gate : {"log", "softplus", "lower_bound"}, default "log"
        The gate law (:mod:`kda._options.gates`), the log decay from ``g``: ``"log"``: ``g`` itself;
        ``"softplus"``: ``-exp(A_log[h]) * softplus(g + dt_bias[h])``; ``"lower_bound"``:
        ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (factor 1 when ``A_log`` is
        None).
    A_log : Array | None, default None
        shape ``[HV]``. Required for ``"softplus"``, optional for ``"lower_bound"``, refused
        for ``"log"``.
    dt_bias : Array | None, default None
        shape ``[HV, K]``. Gate bias (zeros when None); refused for ``"log"``.
    lower_bound : float | None, default None
        A float < 0, required for ``"lower_bound"`` only.
    beta_activation : {None, "sigmoid", "sigmoid2"}, default None
        Use ``beta``, ``sigmoid(beta)`` or ``2 * sigmoid(beta)`` (negative eigenvalues allowed).
    cu_seqlens : Array | None, default None
        1-D integer array of ``N + 1`` offsets. With ``B == 1``: the row holds ``N``
        independent sequences, sequence ``i`` at steps ``cu_seqlens[i]:cu_seqlens[i + 1]``;
        states are ``[N, HV, K, V]``, boundaries ``[NT, 1, HV, K, V]`` with
        ``NT = sum(ceil(len_i / C))``, in sequence order.
    check_finite : bool, default True
        Refuse NaN or infinite inputs (``-inf`` stays legal in a log gate) with
        :class:`~kda.InvalidInputError`, and warn with :class:`~kda.KdaWarning` when finite
        inputs give non-finite results (the delta rule diverged). False skips both.

    Returns
    -------
    KdaOutput
        ``(output, final_state, boundaries or None)``. float16 and bfloat16 inputs compute in
        float32 and return their own dtype.
    """
    choices = Choices(
        layout=layout,
        qk_l2norm=qk_l2norm,
        gate=gate,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        beta_activation=beta_activation,
        cu_seqlens=cu_seqlens,
        check_finite=check_finite,
    )
    call = open_call(
        q, k, v, g, beta, scale, choices, backend=backend, chunk_size=chunk_size, defer_gate=True
    )
    v_first = check_state_v_first(state_v_first)
    if v_first:
        initial_state = k_major_state("initial_state", initial_state, call.problem)
    state = call.state_or_zeros("initial_state", initial_state)
    finite = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    with backward_follows(save_boundaries):  # a hint: the cpu backend compiles its backward ahead
        out = call.forward(Inputs(q, k, v, g, beta), state, save_boundaries, check_inputs=finite)
    return v_major_output(call.problem.xp, out) if v_first else out


def chunk_kda_backward(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    boundaries: Array,
    grad_output: Array,
    grad_final_state: Array | None = None,
    *,
    scale: float | None = None,
    initial_state: Array | None = None,
    chunk_size: int = 64,
    state_v_first: bool = False,
    backend: str | None = None,
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Array | None = None,
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
        As for :func:`chunk_kda`.
    state_v_first : bool, default False
        ``initial_state``, ``boundaries``, ``grad_final_state`` and the returned
        ``initial_state`` gradient are V-major (``[.., HV, V, K]``), as :func:`chunk_kda` with
        ``state_v_first=True`` returns them.
    layout : {"head_first", "time_major"}, default "head_first"
        ``"time_major"`` takes and returns ``[B, T, heads, ...]`` arrays. States are always
        ``[B, HV, K, V]``, boundaries ``[NT, B, HV, K, V]``.
    qk_l2norm : bool, default False
        Replace q and k by ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head.
    gate : {"log", "softplus", "lower_bound"}, default "log"
        The gate law (:mod:`kda._options.gates`), the log decay from ``g``: ``"log"``: ``g`` itself;
        ``"softplus"``: ``-exp(A_log[h]) * softplus(g + dt_bias[h])``; ``"lower_bound"``:
        ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (factor 1 when ``A_log`` is
        None).
    A_log : Array | None, default None
        shape ``[HV]``. Required for ``"softplus"``, optional for ``"lower_bound"``, refused
        for ``"log"``.
    dt_bias : Array | None, default None
        shape ``[HV, K]``. Gate bias (zeros when None); refused for ``"log"``.
    lower_bound : float | None, default None
        A float < 0, required for ``"lower_bound"`` only.
    beta_activation : {None, "sigmoid", "sigmoid2"}, default None
        Use ``beta``, ``sigmoid(beta)`` or ``2 * sigmoid(beta)`` (negative eigenvalues allowed).
    cu_seqlens : Array | None, default None
        1-D integer array of ``N + 1`` offsets. With ``B == 1``: the row holds ``N``
        independent sequences, sequence ``i`` at steps ``cu_seqlens[i]:cu_seqlens[i + 1]``;
        states are ``[N, HV, K, V]``, boundaries ``[NT, 1, HV, K, V]`` with
        ``NT = sum(ceil(len_i / C))``, in sequence order.
    check_finite : bool, default True
        Refuse NaN or infinite inputs (``-inf`` stays legal in a log gate) with
        :class:`~kda.InvalidInputError`, and warn with :class:`~kda.KdaWarning` when finite
        inputs give non-finite results (the delta rule diverged). False skips both.

    Returns
    -------
    KdaGradients
        ``(q, k, v, g, beta, initial_state, A_log, dt_bias)``, each shaped like its input.
    """
    choices = Choices(
        layout=layout,
        qk_l2norm=qk_l2norm,
        gate=gate,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        beta_activation=beta_activation,
        cu_seqlens=cu_seqlens,
        check_finite=check_finite,
    )
    call = open_call(
        q, k, v, g, beta, scale, choices, backend=backend, chunk_size=chunk_size, defer_gate=True
    )
    v_first = check_state_v_first(state_v_first)
    if v_first:
        initial_state = k_major_state("initial_state", initial_state, call.problem)
        boundaries = k_major_state("boundaries", boundaries, call.problem, call.boundaries_shape())
        grad_final_state = k_major_state("grad_final_state", grad_final_state, call.problem)
    state = call.state_or_zeros("initial_state", initial_state)
    call.check_boundaries(boundaries)
    do = call.grad_output(grad_output)
    dfinal = call.state_or_zeros("grad_final_state", grad_final_state)
    finite = dict(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=initial_state,
        boundaries=boundaries,
        grad_output=grad_output,
        grad_final_state=grad_final_state,
    )
    inputs = Inputs.of(q, k, v, g, beta, choices)
    grads = call.backward(inputs, state, boundaries, do, dfinal, check_inputs=finite)
    return v_major_output(call.problem.xp, grads) if v_first else grads


def recurrent_kda(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    *,
    scale: float | None = None,
    initial_state: Array | None = None,
    backend: str | None = None,
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Array | None = None,
    check_finite: bool = True,
) -> KdaOutput:
    """Kimi Delta Attention, step by step: the definition, and the oracle of the chunked form.

    Parameters
    ----------{inputs}
    scale, initial_state, backend
        As for :func:`chunk_kda`.
    layout : {"head_first", "time_major"}, default "head_first"
        ``"time_major"`` takes and returns ``[B, T, heads, ...]`` arrays. States are always
        ``[B, HV, K, V]``, boundaries ``[NT, B, HV, K, V]``.
    qk_l2norm : bool, default False
        Replace q and k by ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head.
    gate : {"log", "softplus", "lower_bound"}, default "log"
        The gate law (:mod:`kda._options.gates`), the log decay from ``g``: ``"log"``: ``g`` itself;
        ``"softplus"``: ``-exp(A_log[h]) * softplus(g + dt_bias[h])``; ``"lower_bound"``:
        ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (factor 1 when ``A_log`` is
        None).
    A_log : Array | None, default None
        shape ``[HV]``. Required for ``"softplus"``, optional for ``"lower_bound"``, refused
        for ``"log"``.
    dt_bias : Array | None, default None
        shape ``[HV, K]``. Gate bias (zeros when None); refused for ``"log"``.
    lower_bound : float | None, default None
        A float < 0, required for ``"lower_bound"`` only.
    beta_activation : {None, "sigmoid", "sigmoid2"}, default None
        Use ``beta``, ``sigmoid(beta)`` or ``2 * sigmoid(beta)`` (negative eigenvalues allowed).
    cu_seqlens : Array | None, default None
        1-D integer array of ``N + 1`` offsets. With ``B == 1``: the row holds ``N``
        independent sequences, sequence ``i`` at steps ``cu_seqlens[i]:cu_seqlens[i + 1]``;
        states are ``[N, HV, K, V]``, boundaries ``[NT, 1, HV, K, V]`` with
        ``NT = sum(ceil(len_i / C))``, in sequence order.
    check_finite : bool, default True
        Refuse NaN or infinite inputs (``-inf`` stays legal in a log gate) with
        :class:`~kda.InvalidInputError`, and warn with :class:`~kda.KdaWarning` when finite
        inputs give non-finite results (the delta rule diverged). False skips both.

    Returns
    -------
    KdaOutput
        ``(output, final_state, None)``.
    """
    choices = Choices(
        layout=layout,
        qk_l2norm=qk_l2norm,
        gate=gate,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        beta_activation=beta_activation,
        cu_seqlens=cu_seqlens,
        check_finite=check_finite,
    )
    call = open_call(q, k, v, g, beta, scale, choices, backend=backend, defer_gate=True)
    state = call.state_or_zeros("initial_state", initial_state)
    call.check_inputs_finite(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    return call.forward(Inputs(q, k, v, g, beta), state, False)


def recurrent_kda_backward(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    grad_output: Array,
    grad_final_state: Array | None = None,
    *,
    scale: float | None = None,
    initial_state: Array | None = None,
    backend: str | None = None,
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Array | None = None,
    check_finite: bool = True,
) -> KdaGradients:
    """Gradients of :func:`recurrent_kda`, by a hand-written backward through the steps.

    Parameters
    ----------{inputs}
    grad_output, grad_final_state
        As for :func:`chunk_kda_backward`.
    scale, initial_state, backend
        As for :func:`chunk_kda`.
    layout : {"head_first", "time_major"}, default "head_first"
        ``"time_major"`` takes and returns ``[B, T, heads, ...]`` arrays. States are always
        ``[B, HV, K, V]``, boundaries ``[NT, B, HV, K, V]``.
    qk_l2norm : bool, default False
        Replace q and k by ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head.
    gate : {"log", "softplus", "lower_bound"}, default "log"
        The gate law (:mod:`kda._options.gates`), the log decay from ``g``: ``"log"``: ``g`` itself;
        ``"softplus"``: ``-exp(A_log[h]) * softplus(g + dt_bias[h])``; ``"lower_bound"``:
        ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (factor 1 when ``A_log`` is
        None).
    A_log : Array | None, default None
        shape ``[HV]``. Required for ``"softplus"``, optional for ``"lower_bound"``, refused
        for ``"log"``.
    dt_bias : Array | None, default None
        shape ``[HV, K]``. Gate bias (zeros when None); refused for ``"log"``.
    lower_bound : float | None, default None
        A float < 0, required for ``"lower_bound"`` only.
    beta_activation : {None, "sigmoid", "sigmoid2"}, default None
        Use ``beta``, ``sigmoid(beta)`` or ``2 * sigmoid(beta)`` (negative eigenvalues allowed).
    cu_seqlens : Array | None, default None
        1-D integer array of ``N + 1`` offsets. With ``B == 1``: the row holds ``N``
        independent sequences, sequence ``i`` at steps ``cu_seqlens[i]:cu_seqlens[i + 1]``;
        states are ``[N, HV, K, V]``, boundaries ``[NT, 1, HV, K, V]`` with
        ``NT = sum(ceil(len_i / C))``, in sequence order.
    check_finite : bool, default True
        Refuse NaN or infinite inputs (``-inf`` stays legal in a log gate) with
        :class:`~kda.InvalidInputError`, and warn with :class:`~kda.KdaWarning` when finite
        inputs give non-finite results (the delta rule diverged). False skips both.

    Returns
    -------
    KdaGradients
        ``(q, k, v, g, beta, initial_state, A_log, dt_bias)``, each shaped like its input.
    """
    choices = Choices(
        layout=layout,
        qk_l2norm=qk_l2norm,
        gate=gate,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        beta_activation=beta_activation,
        cu_seqlens=cu_seqlens,
        check_finite=check_finite,
    )
    call = open_call(q, k, v, g, beta, scale, choices, backend=backend, defer_gate=True)
    state = call.state_or_zeros("initial_state", initial_state)
    do = call.grad_output(grad_output)
    dfinal = call.state_or_zeros("grad_final_state", grad_final_state)
    call.check_inputs_finite(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=initial_state,
        grad_output=grad_output,
        grad_final_state=grad_final_state,
    )
    inputs = Inputs.of(q, k, v, g, beta, choices)
    return call.backward(inputs, state, None, do, dfinal)


for _f in (chunk_kda, chunk_kda_backward, recurrent_kda, recurrent_kda_backward):
    _f.__doc__ = _f.__doc__.replace("{inputs}", INPUTS_DOC.rstrip()).replace("{backend}", backend_doc())
