"""Kimi Delta Attention on Dask arrays: batch, heads and the sequence itself split over workers.

``kda.dask.chunk_kda`` and ``kda.dask.chunk_kda_backward`` take Dask arrays (blocks of NumPy or
CuPy arrays) and return Dask arrays. Blocks along batch and heads are independent problems.
Blocks along time (shards) use the segment maps of :func:`kda.chunk_kda_transition` in three
steps (``docs/sequence_parallel.md``):

1. every shard computes its map ``S_end = A S_start + N`` (backward: ``dS_start = A^T dS_end + D``),
   all shards at once;
2. a scan over the small maps gives every shard its true start state (end-state gradient);
3. every shard runs the ordinary chunked forward (backward) from it, all shards at once.

The graph holds a fixed number of tasks per block, whatever the number of chunks. Each block's
arrays are validated and scanned for NaN / inf once, by the block's check task; its other tasks
(map, forward, backward) depend on it and run on calls derived without looking at the values
again (``kda._entry.call.open_call(..., scan=False)``, ``transition_map``, ``Call.forward``); each task
returns a named record, read by field name. Time blocks are
first moved to multiples of ``chunk_size`` (each boundary to the nearest one, by
:meth:`dask.array.Array.rechunk`), so every shard's chunks are those of the single-process call
and the shards' boundaries form the single-process ``boundaries``; outputs and gradients come
back in the chunks of the inputs.

Needs ``pip install 'kda[dask]'``.
"""

from __future__ import annotations

from functools import partial

try:
    import dask.array  # noqa: F401  (the message below where Dask is missing)
except ImportError as err:  # pragma: no cover - exercised without dask installed
    msg = "kda.dask needs Dask: pip install 'kda[dask]' (dask[array] and distributed)"
    raise ImportError(msg) from err

from ._dask import build as _build
from ._dask import graph as _graph
from ._dask import tasks as _tasks
from ._dask.plan import plan as _plan
from ._entry.call import Inputs, KdaGradients, KdaOutput
from ._errors import InvalidInputError
from ._options.spec import CallSpec
from ._options.table import Array, Choices

__all__ = ["chunk_kda", "chunk_kda_backward"]


def _block_options(scale, chunk_size: int, backend, opts: Choices) -> CallSpec:
    """The spec every block's call is built from (the same for all blocks): the call's non-array
    choices; the gate's arrays are blocks of their own, ``cu_seqlens`` each shard's own."""
    return CallSpec.from_choices(opts, method="chunk", scale=scale, chunk_size=chunk_size, backend=backend)


def chunk_kda(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    *,
    initial_state: Array | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    save_boundaries: bool = False,
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
    """:func:`kda.chunk_kda` on Dask arrays, split over batch, heads and time.

    Parameters
    ----------
    q, k, v, g, beta : dask.array.Array
        As for :func:`kda.chunk_kda` (shapes by ``layout``), with blocks of NumPy or CuPy arrays,
        cut along batch, heads and/or time (never along ``K`` or ``V``: such blocks are joined).
        Head blocks of ``v, g, beta`` are moved to multiples of ``HV // H`` so that each holds
        whole groups of value heads; ``q, k`` follow them. Time blocks are moved to multiples of
        ``chunk_size`` (each boundary to the nearest; blocks shorter than half a chunk merge).
    initial_state : array, shape ``[B, HV, K, V]``, optional
        Dask, NumPy or CuPy; zeros when None.
    scale, chunk_size, save_boundaries, backend
        As for :func:`kda.chunk_kda`; ``backend`` is applied to every block.
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
        ``cu_seqlens`` (packed sequences, ``B == 1``; host offsets) may cross time blocks: only
        the sequence crossing a block boundary carries a state across it. With it,
        ``save_boundaries`` must be False (:class:`~kda.InvalidInputError`).
    check_finite : bool, default True
        Refuse NaN or infinite inputs (``-inf`` stays legal in a log gate) with
        :class:`~kda.InvalidInputError`, and warn with :class:`~kda.KdaWarning` when finite
        inputs give non-finite results (the delta rule diverged). False skips both.

    Returns
    -------
    KdaOutput
        Dask arrays: ``output`` (chunked like ``v``), ``final_state [B, HV, K, V]`` and
        ``boundaries [NT, B, HV, K, V]`` (blocks along ``NT`` one per time shard) or None.
        Values are those of the single-process :func:`kda.chunk_kda` up to rounding. Bad values
        (positive ``g``, non-finite inputs, wrong dtypes) raise when computed.
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
    plan = _plan(q, k, v, g, beta, choices.layout, chunk_size, choices.cu_seqlens)
    options = _block_options(scale, plan.chunk_size, backend, choices)
    A_log, dt_bias = choices.A_log, choices.dt_bias
    graph = _graph.Graph(plan)
    x = _graph.inputs(graph, q, k, v, g, beta, A_log, dt_bias, options)
    initial = _graph.states(graph, initial_state, "initial_state")
    save = bool(save_boundaries)
    graph.name("forward", options, save, plan.offsets)
    _build.check_with_blocks(x, initial=initial)
    if plan.offsets is not None:
        if save:
            msg = (
                "save_boundaries must be False with cu_seqlens in kda.dask (each shard chunks its own "
                "pieces of the sequences); the backward recomputes the shard start states"
            )
            raise InvalidInputError(msg)
        return _build.packed_forward(graph, x, initial, options, v)
    shard = partial(_tasks.forward_block, options=options, save=save)
    outputs, finals, boundaries = {}, {}, {}
    for ib, ih in plan.rows():
        starts, _ = _build.forward_scan(x, ib, ih, initial[ib, ih], options)
        for it, start in enumerate(starts):
            result = graph.task("forward", (ib, ih, it), shard, *x.args(ib, ih, it), start)
            outputs[ib, ih, it], boundaries[it, ib, ih, 0, 0] = (result, "output"), (result, "boundaries")
        finals[ib, ih] = (result, "final_state")
    output = graph.sequence_array("output", outputs, plan.heads, plan.V, v)
    final = graph.state_array("final-state", finals)
    if not save:
        return KdaOutput(output=output, final_state=final, boundaries=None)
    chunks = (plan.chunk_counts(), *plan.state_chunks(plan.V))
    boundaries = graph.array("boundaries", boundaries, chunks, plan.state_dtype)
    return KdaOutput(output=output, final_state=final, boundaries=boundaries)


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
    initial_state: Array | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
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
    """:func:`kda.chunk_kda_backward` on Dask arrays, split over batch, heads and time.

    Parameters
    ----------
    q, k, v, g, beta : dask.array.Array
        As for :func:`chunk_kda`.
    boundaries : array, shape ``[NT, B, HV, K, V]``, or None
        From ``kda.dask.chunk_kda(..., save_boundaries=True)`` with the same ``chunk_size`` (any
        blocks); they give every time shard its start state. None recomputes the start states
        (each shard's map and the scan, as in the forward).
    grad_output : dask.array.Array
        Gradient of ``output``, shaped like ``v``.
    grad_final_state : array, shape ``[B, HV, K, V]``, optional
        Dask, NumPy or CuPy; zeros when None.
    initial_state, scale, chunk_size, backend
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
        Dask arrays, each gradient chunked like its input (``initial_state``: like batch and value
        heads; ``A_log``, ``dt_bias``: summed over batch and time blocks, None when not given).
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
    plan = _plan(q, k, v, g, beta, choices.layout, chunk_size, choices.cu_seqlens)
    options = _block_options(scale, plan.chunk_size, backend, choices)
    A_log, dt_bias = choices.A_log, choices.dt_bias
    graph = _graph.Graph(plan)
    x = _graph.inputs(graph, q, k, v, g, beta, A_log, dt_bias, options)
    do = graph.add(_graph.as_dask("grad_output", grad_output), plan.sequence_chunks(plan.heads, plan.V))
    initial = _graph.states(graph, initial_state, "initial_state")
    dfinal = _graph.states(graph, grad_final_state, "grad_final_state")
    if plan.offsets is not None and boundaries is not None:
        msg = "boundaries must be None with cu_seqlens in kda.dask (the shard start states are recomputed)"
        raise InvalidInputError(msg)
    boundaries = _graph.boundaries(graph, boundaries)
    like = Inputs(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)  # the gradients' chunks
    graph.name("backward", options, plan.offsets)
    _build.check_with_blocks(x, initial=initial, dfinal=dfinal, do=do, boundaries=boundaries)
    if plan.offsets is not None:
        return _build.packed_backward(graph, x, initial, dfinal, do, options, like)
    shard = partial(_tasks.backward_block, options=options)
    results = {}
    for ib, ih in plan.rows():
        if boundaries is None:
            starts, maps = _build.forward_scan(x, ib, ih, initial[ib, ih], options)
        else:  # each shard's backward reads its start state from its boundaries
            starts, maps = [initial[ib, ih]] + [None] * (len(plan.times) - 1), []
        dends = _build.backward_scan(x, ib, ih, dfinal[ib, ih], maps, do, options)
        for it, (start, dend) in enumerate(zip(starts, dends)):
            args = [*x.args(ib, ih, it), start, graph.key(boundaries, it, ib, ih, 0, 0)]
            do_key = graph.key(do, *_graph.sequence_index(plan, ib, ih, it, 4))
            results[ib, ih, it] = graph.task("backward", (ib, ih, it), shard, *args, do_key, dend)
    return _build.gradients(graph, results, like)
