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
again (``kda._entry.call.open_call(..., scan=False)``, ``transition_map``, ``Call.forward``). Time blocks are
first moved to multiples of ``chunk_size`` (each boundary to the nearest one, by
:meth:`dask.array.Array.rechunk`), so every shard's chunks are those of the single-process call
and the shards' boundaries form the single-process ``boundaries``; outputs and gradients come
back in the chunks of the inputs.

Needs ``pip install 'kda[dask]'``.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

try:
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
except ImportError as err:  # pragma: no cover - exercised without dask installed
    msg = "kda.dask needs Dask: pip install 'kda[dask]' (dask[array] and distributed)"
    raise ImportError(msg) from err

import array_api_compat
import numpy as np

from ._entry import scan as _scan
from ._entry.call import Call, Inputs, KdaGradients, KdaOutput, open_call
from ._entry.transition import transition_gradient, transition_map
from ._errors import InvalidInputError, InvalidTypeError
from ._options.table import LAYOUTS, Array, Choices, takes_options
from ._options.validation import STATE_DTYPE_RULE, check_array, check_choice, check_chunk_size

__all__ = ["chunk_kda", "chunk_kda_backward"]


# ----------------------------------------------------------------------------------------------
# The plan: how the inputs are cut into blocks


@dataclass(frozen=True)
class _Plan:
    """Block structure shared by every array of one call."""

    layout: str
    chunk_size: int
    B: int
    H: int
    HV: int
    T: int
    K: int
    V: int
    dtype: Any
    batch: tuple[int, ...]  # block sizes along batch
    heads: tuple[int, ...]  # along value heads (multiples of HV // H)
    times: tuple[int, ...]  # along time (multiples of chunk_size but the last)
    meta: Any  # an empty array of the blocks' type
    offsets: tuple[int, ...] | None = None  # host cu_seqlens (packed sequences, B == 1)

    @property
    def state_rows(self) -> tuple[int, ...]:
        """Block sizes of a state's first axis: batch blocks, or all ``N`` packed sequences."""
        return self.batch if self.offsets is None else (len(self.offsets) - 1,)

    @property
    def group(self) -> int:
        return self.HV // self.H if self.H else 1

    @property
    def state_dtype(self) -> Any:
        return np.float64 if self.dtype == np.float64 else np.float32

    def rows(self) -> list[tuple[int, int]]:
        """Every (batch block, head block) pair: the independent problems."""
        return list(itertools.product(range(len(self.batch)), range(len(self.heads))))

    def sequence_chunks(self, heads: tuple[int, ...], width: int | None) -> tuple[tuple[int, ...], ...]:
        """Dask chunks of a ``[B, H, T, K]``-like array in the plan's layout (``width`` None: 3-D)."""
        axes = (
            [self.batch, heads, self.times]
            if self.layout == "head_first"
            else [self.batch, self.times, heads]
        )
        return tuple(axes) if width is None else (*axes, (width,))

    def chunk_counts(self) -> tuple[int, ...]:
        """Chunks per time block: the block sizes of ``boundaries`` along ``NT``."""
        return tuple(-(-t // self.chunk_size) for t in self.times)

    def state_chunks(self, width: int) -> tuple[tuple[int, ...], ...]:
        return (self.state_rows, self.heads, (self.K,), (width,))


def _cuts(chunks: tuple[int, ...]) -> list[int]:
    return list(itertools.accumulate(chunks))[:-1]


def _moved(chunks: tuple[int, ...], step: int, total: int) -> tuple[int, ...]:
    """Block sizes: the inner boundaries of ``chunks`` moved to the nearest multiple of ``step``."""
    cuts = {(c + step // 2) // step * step for c in _cuts(chunks)}
    bounds = [0, *sorted(c for c in cuts if 0 < c < total), total]
    return tuple(b - a for a, b in itertools.pairwise(bounds)) or (0,)


def _check_dask(name: str, x: Any, ndim: int) -> None:
    if not isinstance(x, da.Array):
        msg = f"{name} must be a dask.array.Array (kda.dask); got {type(x).__module__}.{type(x).__name__}"
        raise InvalidTypeError(msg)
    if x.ndim != ndim:
        msg = f"{name} must have {ndim} dimensions; got shape {x.shape}"
        raise InvalidInputError(msg)
    if any(np.isnan(c) for cs in x.chunks for c in cs):
        msg = f"{name} must have known chunk sizes (call compute_chunk_sizes() first); got {x.chunks}"
        raise InvalidInputError(msg)


def _plan(q, k, v, g, beta, layout: str, chunk_size: int, cu_seqlens: Any) -> _Plan:
    """Check what the blocks need to fit together; the blocks' own calls check the rest."""
    layout = check_choice("layout", layout, LAYOUTS)
    chunk_size = check_chunk_size(chunk_size)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        _check_dask(name, x, 4)
    _check_dask("beta", beta, 3)
    t_axis, h_axis = (2, 1) if layout == "head_first" else (1, 2)
    B, T, K, H = q.shape[0], q.shape[t_axis], q.shape[3], q.shape[h_axis]
    HV, V = v.shape[h_axis], v.shape[3]
    expected = {"k": (B, H, K), "v": (B, HV, V), "g": (B, HV, K), "beta": (B, HV, None)}
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        b, h, w = expected[name]
        shape = [b, None, None] if w is None else [b, None, None, w]
        shape[h_axis], shape[t_axis] = h, T
        if tuple(x.shape) != tuple(shape) or (H and HV % H) or (HV and not H):
            msg = (
                f"{name} must have shape {tuple(shape)} (layout={layout!r}; HV a multiple of H) "
                f"to match q {q.shape} and v {v.shape}; got {x.shape}"
            )
            raise InvalidInputError(msg)
    heads = _moved(v.chunks[h_axis], HV // H if H else 1, HV)
    meta = da.utils.meta_from_array(q._meta, ndim=0)
    times = _moved(q.chunks[t_axis], chunk_size, T)
    offsets = _packed_offsets(cu_seqlens, B, T)
    return _Plan(
        layout, chunk_size, B, H, HV, T, K, V, np.dtype(q.dtype), q.chunks[0], heads, times, meta, offsets
    )


def _packed_offsets(cu_seqlens: Any, B: int, T: int) -> tuple[int, ...] | None:
    """Host ``cu_seqlens`` (NumPy, CuPy, a sequence, or a Dask array: computed), checked."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, da.Array):
        cu_seqlens = cu_seqlens.compute()
    host = np.asarray(cu_seqlens.get() if hasattr(cu_seqlens, "get") else cu_seqlens)
    if host.ndim != 1 or host.shape[0] < 2 or not np.issubdtype(host.dtype, np.integer):
        msg = f"cu_seqlens must be a 1-D integer array of N + 1 >= 2 offsets; got {host.dtype} {host.shape}"
        raise InvalidTypeError(msg)
    offsets = tuple(int(n) for n in host)
    if B != 1 or offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in itertools.pairwise(offsets)):
        msg = (
            f"cu_seqlens must be non-decreasing offsets from 0 to T = {T} with B == 1 (got B = {B}); "
            f"got {offsets}"
        )
        raise InvalidInputError(msg)
    return offsets


# ----------------------------------------------------------------------------------------------
# The graph: one layer of tasks on the blocks of the (rechunked) inputs


def _sequence_index(plan: _Plan, ib: int, ih: int, it: int, ndim: int) -> tuple[int, ...]:
    idx = (ib, ih, it) if plan.layout == "head_first" else (ib, it, ih)
    return idx + (0,) * (ndim - 3)


def _as_dask(name: str, x: Any) -> Any:
    if isinstance(x, da.Array):
        return x
    if not array_api_compat.is_array_api_obj(x):
        msg = f"{name} must be an array (Dask, NumPy or CuPy); got {type(x).__name__}"
        raise InvalidTypeError(msg)
    return da.from_array(x, chunks=-1)


def _checked(name: str, x: Any, shape: tuple[int, ...], letters: str) -> Any:
    x = _as_dask(name, x)
    if tuple(x.shape) != shape:
        msg = f"{name} must have shape [{letters}] = {shape}; got {tuple(x.shape)}"
        raise InvalidInputError(msg)
    return x


class _Graph:
    """The tasks of one call, keyed by block, on the blocks of the rechunked inputs.

    ``key(x, *index)`` names a block of an input; ``task`` adds a task (a function of blocks and of
    earlier tasks' results); ``array`` turns one result per block into a Dask array. Every task is
    per block (or per shard boundary): the graph never grows with the number of chunks.
    """

    def __init__(self, plan: _Plan) -> None:
        self.plan, self.token = plan, ""
        self.layer: dict[tuple, tuple] = {}
        self.inputs: list[Any] = []

    def name(self, *call: Any) -> None:
        """Name the tasks after the inputs added so far and ``call`` (deterministic keys)."""
        self.token = tokenize(*call, [x.name for x in self.inputs])

    def add(self, x: Any, chunks: tuple) -> Any:
        """An input, rechunked to ``chunks``; None stays None."""
        if x is None:
            return None
        x = x.rechunk(chunks)
        self.inputs.append(x)
        return x

    def key(self, x: Any, *index: int) -> tuple | None:
        return None if x is None else (x.name, *index)

    def task(self, kind: str, index: tuple, function: Callable, *args: Any) -> tuple:
        key = (f"kda-{kind}-{self.token}", *index)
        self.layer[key] = (function, *args)
        return key

    def array(self, kind: str, parts: dict[tuple, tuple], chunks: tuple, dtype: Any) -> Any:
        """A Dask array from ``parts[index] = (key, n)``: block ``index`` is item ``n`` of result ``key``.

        ``n = None``: the whole result.
        """
        name = f"kda-{kind}-{self.token}"
        layer = {
            (name, *index): key if n is None else (operator.getitem, key, n)
            for index, (key, n) in parts.items()
        }
        graph = HighLevelGraph.from_collections(name, {**self.layer, **layer}, dependencies=self.inputs)
        meta = da.utils.meta_from_array(self.plan.meta, ndim=len(chunks), dtype=dtype)
        return da.Array(graph, name, chunks, meta=meta)

    def sequence_array(self, kind: str, parts: dict, heads: tuple, width: int | None, like: Any) -> Any:
        """Results keyed ``(ib, ih, it)`` as one array in the plan's layout, in the chunks of ``like``."""
        chunks = self.plan.sequence_chunks(heads, width)
        keyed = {_sequence_index(self.plan, *index, len(chunks)): part for index, part in parts.items()}
        x = self.array(kind, keyed, chunks, like.dtype)
        return x if x.chunks == like.chunks else x.rechunk(like.chunks)

    def state_array(self, kind: str, parts: dict) -> Any:
        keyed = {(*index, 0, 0): part for index, part in parts.items()}
        return self.array(kind, keyed, self.plan.state_chunks(self.plan.V), self.plan.state_dtype)


@dataclass
class _Inputs:
    """The rechunked inputs of one call, and each block's check.

    A block's arrays are validated and scanned for NaN / inf once, by its check task
    (:func:`_check_block`: ``q .. dt_bias`` and the caller's arrays that belong to the block,
    :attr:`extras`); every other task of the block depends on it and opens the block's call
    without looking at the values again (:func:`_open`).
    """

    graph: _Graph
    arrays: list[Any]  # q, k, v, g, beta
    A_log: Any
    dt_bias: Any
    options: dict = field(default_factory=dict)  # the blocks' keywords (_block_options)
    local: list | None = None  # per time block: its cu_seqlens (packed sequences)
    extras: dict = field(default_factory=dict)  # (ib, ih, it) -> {name: key} checked with the block
    checks: dict = field(default_factory=dict)  # (ib, ih, it) -> the check task's key

    def blocks(self, ib: int, ih: int, it: int) -> list[Any]:
        """The keys of ``q, k, v, g, beta, A_log, dt_bias`` of one block."""
        g, plan = self.graph, self.graph.plan
        blocks = [g.key(x, *_sequence_index(plan, ib, ih, it, x.ndim)) for x in self.arrays]
        return [*blocks, g.key(self.A_log, ih), g.key(self.dt_bias, ih, 0)]

    def args(self, ib: int, ih: int, it: int) -> list[Any]:
        """The key of the block's check (made once), then :meth:`blocks`: a task's leading arguments."""
        index = (ib, ih, it)
        if index not in self.checks:
            extras = {n: k for n, k in self.extras.get(index, {}).items() if k is not None}
            offsets = None if self.local is None else self.local[it]
            check = partial(_check_block, options=self.options, names=tuple(extras), offsets=offsets)
            self.checks[index] = self.graph.task(
                "check", index, check, *self.blocks(*index), *extras.values()
            )
        return [self.checks[index], *self.blocks(ib, ih, it)]


def _inputs(graph: _Graph, q, k, v, g, beta, A_log, dt_bias, options: dict) -> _Inputs:
    plan = graph.plan
    qk_heads = tuple(h // plan.group for h in plan.heads)
    shapes = (
        (qk_heads, plan.K),
        (qk_heads, plan.K),
        (plan.heads, plan.V),
        (plan.heads, plan.K),
        (plan.heads, None),
    )
    arrays = [graph.add(x, plan.sequence_chunks(*s)) for x, s in zip((q, k, v, g, beta), shapes)]
    if A_log is not None:
        A_log = graph.add(_checked("A_log", A_log, (plan.HV,), "HV"), (plan.heads,))
    if dt_bias is not None:
        dt_bias = _checked("dt_bias", dt_bias, (plan.HV, plan.K), "HV, K")
        dt_bias = graph.add(dt_bias, (plan.heads, (plan.K,)))
    return _Inputs(graph, arrays, A_log, dt_bias, options=options)


def _states(graph: _Graph, x: Any, name: str) -> dict[tuple[int, int], Any]:
    """The keys of a ``[B, HV, K, V]`` state's blocks (None: zeros) per (batch, head) block."""
    plan = graph.plan
    if x is not None:
        rows, letter = (plan.B, "B") if plan.offsets is None else (len(plan.offsets) - 1, "N")
        x = _checked(name, x, (rows, plan.HV, plan.K, plan.V), f"{letter}, HV, K, V")
        x = graph.add(x, plan.state_chunks(plan.V))
    return {(ib, ih): graph.key(x, ib, ih, 0, 0) for ib, ih in plan.rows()}


def _boundaries(graph: _Graph, x: Any) -> Any:
    """``[NT, B, HV, K, V]`` boundaries cut like the shards, batch and value heads."""
    plan = graph.plan
    if x is None:
        return None
    shape = (sum(plan.chunk_counts()), plan.B, plan.HV, plan.K, plan.V)
    x = _checked("boundaries", x, shape, "NT, B, HV, K, V")
    return graph.add(x, (plan.chunk_counts(), *plan.state_chunks(plan.V)))


# ----------------------------------------------------------------------------------------------
# The tasks: each runs on one block, on the blocks' own array library


def _open(blocks: tuple, options: dict, offsets: tuple[int, ...] | None, scan: bool) -> tuple[Call, Inputs]:
    """A block's call (``blocks``: ``q, k, v, g, beta, A_log, dt_bias``; ``offsets``: its
    cu_seqlens) and its arrays; ``scan=False``: sizes, dtypes and options only (its check task
    looked at the values)."""
    q, k, v, g, beta, A_log, dt_bias = blocks
    keywords = dict(options)
    scale, chunk_size, backend = keywords.pop("scale"), keywords.pop("chunk_size"), keywords.pop("backend")
    choices = Choices(**keywords, A_log=A_log, dt_bias=dt_bias, cu_seqlens=offsets)
    call = open_call(q, k, v, g, beta, scale, choices, backend=backend, chunk_size=chunk_size, scan=scan)
    return call, Inputs(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias)


_BLOCK = 7  # q, k, v, g, beta, A_log, dt_bias: the leading blocks of every task (_Inputs.blocks)


def _check_block(
    *arrays: Any, options: dict, names: tuple[str, ...], offsets: tuple[int, ...] | None
) -> None:
    """A block's one validation and finiteness scan: ``q .. dt_bias``, then the caller's arrays of
    the block named ``names`` (an initial state, the output gradient, a final state's gradient,
    boundaries), each checked as the single-process function checks it."""
    blocks, extras = arrays[:_BLOCK], dict(zip(names, arrays[_BLOCK:]))
    call, x = _open(blocks, options, offsets, scan=True)
    call.check_inputs_finite(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta)
    p = call.p
    for name, a in extras.items():
        if name == "states":  # the packed call's [N, HV, K, V] states: every shard reads some rows
            check_array(
                "initial_state", a, p, tuple(a.shape), "N, HV, K, V", p.compute_dtype, STATE_DTYPE_RULE
            )
            call.check_finite(initial_state=a)
        elif name == "dfinals":
            check_array(
                "grad_final_state", a, p, tuple(a.shape), "N, HV, K, V", p.compute_dtype, STATE_DTYPE_RULE
            )
            call.check_finite(grad_final_state=a)
        elif name == "grad_output":
            call.grad_output(a)
            call.check_finite(grad_output=a)
        elif name == "boundaries":
            call.check_boundaries(a)
            call.check_finite(boundaries=a)
        else:  # initial_state, grad_final_state: the block's [B, HV, K, V] rows
            call.state_or_zeros(name, a)
            call.check_finite(**{name: a})


def _forward_block(checked: None, *arrays: Any, options: dict, save: bool) -> tuple:
    """``arrays``: the block's ``q .. dt_bias`` and its start state."""
    *blocks, state = arrays
    call, x = _open(blocks, options, None, scan=False)
    return tuple(call.forward(x, call.state_or_zeros("initial_state", state), save))


def _backward_block(checked: None, *arrays: Any, options: dict) -> tuple:
    """``arrays``: the block's ``q .. dt_bias``, its start state, boundaries, output gradient and
    end-state gradient."""
    *blocks, state, boundaries, grad_output, dend = arrays
    call, x = _open(blocks, options, None, scan=False)
    state, dend = call.state_or_zeros("initial_state", state), call.state_or_zeros("grad_final_state", dend)
    return tuple(call.backward(x, state, boundaries, call.grad_output(grad_output, check=False), dend))


def _transition_block(checked: None, *blocks: Any, options: dict) -> tuple:
    call, x = _open(blocks, options, None, scan=False)
    return tuple(transition_map(call, x))


def _state_gradient_block(checked: None, *arrays: Any, options: dict) -> Any:
    *blocks, grad_output = arrays
    call, x = _open(blocks, options, None, scan=False)
    return transition_gradient(call, x, call.grad_output(grad_output, check=False))


def _advance(transition: tuple, start: Any) -> Any:
    """A shard's end state from its start state, ``transition = (A, N)`` (:func:`scan.advance`)."""
    return _scan.advance(*transition, start)


def _retreat(transition: tuple, D: Any, dend: Any) -> Any:
    """A shard's start-state gradient from its end-state gradient (:func:`scan.retreat`)."""
    return _scan.retreat(transition[0], D, dend)


def _total(*results: tuple, field: int) -> Any:
    """The sum of one field of several results (a per-head parameter's gradient over blocks)."""
    parts = [r[field] for r in results]
    return sum(parts[1:], parts[0])


def _forward_scan(x: _Inputs, ib: int, ih: int, start: Any, options: dict) -> tuple[list, list]:
    """Steps 1 and 2 of the forward: every shard's map (the last one needs none), then the scan.

    Returns the keys of every shard's start state and of the maps of all shards but the last.
    """
    g, maps, starts = x.graph, [], [start]
    for it in range(len(g.plan.times) - 1):
        maps.append(
            g.task("map", (ib, ih, it), partial(_transition_block, options=options), *x.args(ib, ih, it))
        )
        starts.append(g.task("start", (ib, ih, it + 1), _advance, maps[-1], starts[-1]))
    return starts, maps


def _backward_scan(x: _Inputs, ib: int, ih: int, dend: Any, maps: list, do: Any, options: dict) -> list:
    """Steps 1 and 2 of the backward: every shard's ``(A, D)`` (the first needs none), then the scan.

    ``maps`` are forward maps already in the graph (reused). Returns every shard's end-state gradient.
    """
    g, dends = x.graph, [dend]
    for it in range(len(g.plan.times) - 1, 0, -1):
        args, index = x.args(ib, ih, it), (ib, ih, it)
        transition = (
            maps[it]
            if it < len(maps)
            else g.task("map", index, partial(_transition_block, options=options), *args)
        )
        do_key = g.key(do, *_sequence_index(g.plan, ib, ih, it, 4))
        D = g.task("dmap", index, partial(_state_gradient_block, options=options), *args, do_key)
        dends.append(g.task("dend", (ib, ih, it - 1), _retreat, transition, D, dends[-1]))
    return dends[::-1]


# ----------------------------------------------------------------------------------------------
# Packed sequences (cu_seqlens, B == 1): a time shard holds pieces of several sequences; only the
# sequence crossing a shard boundary carries a state (gradient) across it, exactly as in context
# parallelism (kda/_entry/cp.py, docs/context_parallel.md)


@dataclass(frozen=True)
class _Shard:
    """One time block of a packed batch: steps ``lo:hi``, the sequences with steps in it."""

    lo: int
    hi: int
    seqs: tuple[int, ...]  # global sequence indices, in order
    local: tuple[int, ...]  # local cu_seqlens
    enters: bool  # the first sequence started in an earlier shard
    leaves: bool  # the last sequence continues in a later shard

    @property
    def through(self) -> bool:
        """One sequence enters and leaves: the carried state passes through the whole shard."""
        return self.enters and self.leaves and len(self.seqs) == 1


def _shards(offsets: tuple[int, ...], times: tuple[int, ...]) -> list[_Shard]:
    shards, lo = [], 0
    for t in times:
        hi = lo + t
        seqs = tuple(n for n, (a, b) in enumerate(itertools.pairwise(offsets)) if b > a and a < hi and b > lo)
        local = (0, *(min(offsets[n + 1], hi) - lo for n in seqs))
        enters = bool(seqs) and offsets[seqs[0]] < lo
        leaves = bool(seqs) and offsets[seqs[-1] + 1] > hi
        shards.append(_Shard(lo, hi, seqs, local, enters, leaves))
        lo = hi
    return shards


def _time_slice(x: Any, a: int, b: int, layout: str) -> Any:
    return x[:, :, a:b, ...] if layout == "head_first" else x[:, a:b, ...]


def _packed_transition(checked: None, *blocks: Any, a: int, b: int, shard: _Shard, options: dict) -> tuple:
    """``(A, N)``, ``[HV, K, K]`` and ``[HV, K, V]``, of the steps ``a:b`` of a shard."""
    call, x = _open(blocks, options, shard.local, scan=False)
    t = transition_map(call.segment(a, b), call.steps(x, a, b))
    return t.A[0], t.N[0]


def _packed_state_gradient(
    checked: None, *arrays: Any, a: int, b: int, shard: _Shard, options: dict
) -> tuple:
    """``(A, D)`` of the steps ``a:b`` of a shard (``dS_start = A^T dS_end + D``)."""
    *blocks, do = arrays
    call, x = _open(blocks, options, shard.local, scan=False)
    segment, x = call.segment(a, b), call.steps(x, a, b)
    A = transition_map(segment, x).A[0]
    D = transition_gradient(
        segment, x, segment.grad_output(_time_slice(do, a, b, options["layout"]), check=False)
    )
    return A, D[0]


def _packed_carry(transition: tuple, carried: Any, states: Any, *, n: int, through: bool) -> Any:
    """The state leaving a shard in sequence ``n``: ``A S + N`` from the carried state (the
    sequence passes through the shard) or from ``n``'s initial state (it starts there)."""
    start = carried if through else (None if states is None else states[n])
    return _advance(transition, start)


def _packed_dcarry(transition: tuple, carried: Any, dfinal: Any, *, n: int, through: bool) -> Any:
    """The end-state gradient of the sequence entering a shard: ``A^T dE + D`` from the gradient
    carried from the next shard (through) or from ``n``'s final-state gradient (it ends there)."""
    end = carried if through else (None if dfinal is None else dfinal[n])
    return _retreat(transition, transition[1], end)


def _local_states(shard: _Shard, carried: Any, states: Any, first: bool, like: Any, shape: tuple) -> Any:
    """``[N_local, HV, K, *]``: the carried state for the entering (``first``) or leaving sequence,
    the given states (zeros when None) for the others."""
    xp = array_api_compat.array_namespace(like)
    edge = 0 if first else len(shard.seqs) - 1
    out = []
    for i, n in enumerate(shard.seqs):
        s = (
            carried
            if (i == edge and (shard.enters if first else shard.leaves))
            else (None if states is None else states[n])
        )
        out.append(xp.zeros(shape, dtype=like.dtype) if s is None else s)
    return xp.stack(out)


def _packed_forward_block(checked: None, *arrays: Any, shard: _Shard, options: dict):
    """``arrays``: the shard's ``q .. dt_bias``, the initial states and the carried state."""
    *blocks, states, carried = arrays
    call, x = _open(blocks, options, shard.local, scan=False)
    v = x.v
    shape = (v.shape[1] if options["layout"] == "head_first" else v.shape[2], x.q.shape[3], v.shape[3])
    like = array_api_compat.array_namespace(v).zeros(
        (), dtype=np.float64 if v.dtype == np.float64 else np.float32
    )
    starts = _local_states(shard, carried, states, True, like, shape)
    out = call.forward(x, call.state_or_zeros("initial_state", starts), False)
    return out.output, out.final_state


def _packed_backward_block(checked: None, *arrays: Any, shard: _Shard, options: dict) -> tuple:
    """``arrays``: the shard's ``q .. dt_bias``, the initial states, the carried state, the output
    gradient, the final states' gradient and the carried end-state gradient."""
    *blocks, states, carried, do, dfinal, dcarried = arrays
    call, x = _open(blocks, options, shard.local, scan=False)
    v = x.v
    shape = (v.shape[1] if options["layout"] == "head_first" else v.shape[2], x.q.shape[3], v.shape[3])
    xp = array_api_compat.array_namespace(v)
    like = xp.zeros((), dtype=np.float64 if v.dtype == np.float64 else np.float32)
    starts = call.state_or_zeros("initial_state", _local_states(shard, carried, states, True, like, shape))
    dends = call.state_or_zeros(
        "grad_final_state", _local_states(shard, dcarried, dfinal, False, like, shape)
    )
    return tuple(call.backward(x, starts, None, call.grad_output(do, check=False), dends))


def _packed_collect(states: Any, *results: Any, shards: tuple, N: int, field: int, first: bool, like: tuple):
    """``[N, HV, K, V]`` from the shards' local results (final states: where each sequence ends;
    initial-state gradients: where it starts); empty sequences get ``states`` (zeros when None)."""
    xp = array_api_compat.array_namespace(results[0][field])
    out = xp.zeros((N, *results[0][field].shape[1:]), dtype=results[0][field].dtype)
    if states is not None:
        for n in range(N):
            out[n, ...] = states[n]
    for shard, result in zip(shards, results):
        for i, n in enumerate(shard.seqs):
            crossing = (i == 0 and shard.enters) if first else (i == len(shard.seqs) - 1 and shard.leaves)
            if not crossing:
                out[n, ...] = result[field][i]
    return out


def _packed_forward_scan(x: _Inputs, ih: int, shards: list, states: Any, options: dict) -> list:
    """The state carried into every shard (None where no sequence enters it)."""
    g, carried = x.graph, [None]
    for it, shard in enumerate(shards[:-1]):
        if not shard.leaves:
            carried.append(None)
            continue
        a = shard.local[-2]
        tmap = g.task(
            "pmap", (0, ih, it),
            partial(_packed_transition, a=a, b=shard.local[-1], shard=shard, options=options),
            *x.args(0, ih, it),
        )  # fmt: skip
        step = partial(_packed_carry, n=shard.seqs[-1], through=shard.through)
        carried.append(g.task("pcarry", (0, ih, it + 1), step, tmap, carried[-1], states))
    return carried


def _packed_backward_scan(x: _Inputs, ih: int, shards: list, dfinal: Any, do: Any, options: dict) -> list:
    """The end-state gradient carried out of every shard (None where no sequence leaves it)."""
    g, plan = x.graph, x.graph.plan
    dcarried = [None] * len(shards)
    for it in range(len(shards) - 1, 0, -1):
        shard = shards[it]
        if not shard.enters:
            continue
        do_key = g.key(do, *_sequence_index(plan, 0, ih, it, 4))
        tmap = g.task(
            "pdmap", (0, ih, it),
            partial(_packed_state_gradient, a=0, b=shard.local[1], shard=shard, options=options),
            *x.args(0, ih, it), do_key,
        )  # fmt: skip
        step = partial(_packed_dcarry, n=shard.seqs[0], through=shard.through)
        dcarried[it - 1] = g.task("pdcarry", (0, ih, it - 1), step, tmap, dcarried[it], dfinal)
    return dcarried


def _packed_forward(graph: _Graph, x: _Inputs, initial: dict, options: dict, v: Any) -> KdaOutput:
    plan = graph.plan
    shards = _shards(plan.offsets, plan.times)
    outputs, finals = {}, {}
    for ib, ih in plan.rows():
        carried = _packed_forward_scan(x, ih, shards, initial[ib, ih], options)
        results = []
        for it, shard in enumerate(shards):
            block = partial(_packed_forward_block, shard=shard, options=options)
            results.append(
                graph.task("pforward", (ib, ih, it), block, *x.args(ib, ih, it), initial[ib, ih], carried[it])
            )
            outputs[ib, ih, it] = (results[-1], 0)
        collect = partial(
            _packed_collect, shards=tuple(shards), N=len(plan.offsets) - 1, field=1, first=False, like=()
        )
        finals[ib, ih] = (graph.task("pfinal", (ib, ih), collect, initial[ib, ih], *results), None)
    output = graph.sequence_array("output", outputs, plan.heads, plan.V, v)
    return KdaOutput(output, graph.state_array("final-state", finals), None)


def _packed_backward(graph: _Graph, x: _Inputs, initial: dict, dfinal: dict, do: Any, options: dict, inputs):
    plan = graph.plan
    shards = _shards(plan.offsets, plan.times)
    results, dinitial = {}, {}
    for ib, ih in plan.rows():
        carried = _packed_forward_scan(x, ih, shards, initial[ib, ih], options)
        dcarried = _packed_backward_scan(x, ih, shards, dfinal[ib, ih], do, options)
        row = []
        for it, shard in enumerate(shards):
            do_key = graph.key(do, *_sequence_index(plan, ib, ih, it, 4))
            block = partial(_packed_backward_block, shard=shard, options=options)
            args = (*x.args(ib, ih, it), initial[ib, ih], carried[it], do_key, dfinal[ib, ih], dcarried[it])
            results[ib, ih, it] = graph.task("pbackward", (ib, ih, it), block, *args)
            row.append(results[ib, ih, it])
        collect = partial(
            _packed_collect, shards=tuple(shards), N=len(plan.offsets) - 1, field=5, first=True, like=()
        )
        dinitial[ib, ih] = graph.task("pdinit", (ib, ih), collect, dfinal[ib, ih], *row)
    return _gradients(graph, results, inputs, x.A_log, x.dt_bias, dinitial)


# ----------------------------------------------------------------------------------------------
# The public functions


def _check_with_blocks(
    x: _Inputs, *, initial: dict, dfinal: dict | None = None, do: Any = None, boundaries: Any = None
) -> None:
    """Which of the caller's arrays each block's check task validates and scans (once): the
    initial state with the first time block (packed: all its rows), the final state's gradient
    with the last (packed: with the first), the output gradient and the boundaries with every block."""
    g, plan = x.graph, x.graph.plan
    last = len(plan.times) - 1
    packed = plan.offsets is not None
    if packed:
        x.local = [shard.local for shard in _shards(plan.offsets, plan.times)]
    for ib, ih in plan.rows():
        for it in range(last + 1):
            extras = {}
            if it == 0:
                extras["states" if packed else "initial_state"] = initial[ib, ih]
            if dfinal is not None and it == (0 if packed else last):
                extras["dfinals" if packed else "grad_final_state"] = dfinal[ib, ih]
            if do is not None:
                extras["grad_output"] = g.key(do, *_sequence_index(plan, ib, ih, it, 4))
            if boundaries is not None:
                extras["boundaries"] = g.key(boundaries, it, ib, ih, 0, 0)
            x.extras[ib, ih, it] = extras


def _block_options(scale, chunk_size: int, backend, opts: Choices) -> dict[str, Any]:
    """The keywords every block's call gets (the same for all blocks): the options of the table
    but the per-head arrays (``A_log``, ``dt_bias``: blocks of their own) and ``cu_seqlens``."""
    blockwise = {n: v for n, v in opts.keywords().items() if n not in ("A_log", "dt_bias", "cu_seqlens")}
    return {"scale": scale, "chunk_size": chunk_size, "backend": backend, **blockwise}


@takes_options()
def chunk_kda(
    q: Array, k: Array, v: Array, g: Array, beta: Array, *, initial_state: Array | None = None,
    scale: float | None = None, chunk_size: int = 64, save_boundaries: bool = False,
    backend: str | None = None, opts: Choices,
) -> KdaOutput:  # fmt: skip
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
    {options}
        ``cu_seqlens`` (packed sequences, ``B == 1``; host offsets) may cross time blocks: only
        the sequence crossing a block boundary carries a state across it. With it,
        ``save_boundaries`` must be False (:class:`~kda.InvalidInputError`).

    Returns
    -------
    KdaOutput
        Dask arrays: ``output`` (chunked like ``v``), ``final_state [B, HV, K, V]`` and
        ``boundaries [NT, B, HV, K, V]`` (blocks along ``NT`` one per time shard) or None.
        Values are those of the single-process :func:`kda.chunk_kda` up to rounding. Bad values
        (positive ``g``, non-finite inputs, wrong dtypes) raise when computed.
    """
    plan = _plan(q, k, v, g, beta, opts.layout, chunk_size, opts.cu_seqlens)
    options = _block_options(scale, plan.chunk_size, backend, opts)
    A_log, dt_bias = opts.A_log, opts.dt_bias
    graph = _Graph(plan)
    x = _inputs(graph, q, k, v, g, beta, A_log, dt_bias, options)
    initial = _states(graph, initial_state, "initial_state")
    save = bool(save_boundaries)
    graph.name("forward", options, save, plan.offsets)
    _check_with_blocks(x, initial=initial)
    if plan.offsets is not None:
        if save:
            msg = (
                "save_boundaries must be False with cu_seqlens in kda.dask (each shard chunks its own "
                "pieces of the sequences); the backward recomputes the shard start states"
            )
            raise InvalidInputError(msg)
        return _packed_forward(graph, x, initial, options, v)
    shard = partial(_forward_block, options=options, save=save)
    outputs, finals, boundaries = {}, {}, {}
    for ib, ih in plan.rows():
        starts, _ = _forward_scan(x, ib, ih, initial[ib, ih], options)
        for it, start in enumerate(starts):
            result = graph.task("forward", (ib, ih, it), shard, *x.args(ib, ih, it), start)
            outputs[ib, ih, it], boundaries[it, ib, ih, 0, 0] = (result, 0), (result, 2)
        finals[ib, ih] = (result, 1)
    output = graph.sequence_array("output", outputs, plan.heads, plan.V, v)
    final = graph.state_array("final-state", finals)
    if not save:
        return KdaOutput(output, final, None)
    chunks = (plan.chunk_counts(), *plan.state_chunks(plan.V))
    return KdaOutput(output, final, graph.array("boundaries", boundaries, chunks, plan.state_dtype))


@takes_options()
def chunk_kda_backward(
    q: Array, k: Array, v: Array, g: Array, beta: Array, boundaries: Array, grad_output: Array,
    grad_final_state: Array | None = None, *, initial_state: Array | None = None,
    scale: float | None = None, chunk_size: int = 64, backend: str | None = None, opts: Choices,
) -> KdaGradients:  # fmt: skip
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
    {options}

    Returns
    -------
    KdaGradients
        Dask arrays, each gradient chunked like its input (``initial_state``: like batch and value
        heads; ``A_log``, ``dt_bias``: summed over batch and time blocks, None when not given).
    """
    plan = _plan(q, k, v, g, beta, opts.layout, chunk_size, opts.cu_seqlens)
    options = _block_options(scale, plan.chunk_size, backend, opts)
    A_log, dt_bias = opts.A_log, opts.dt_bias
    graph = _Graph(plan)
    x = _inputs(graph, q, k, v, g, beta, A_log, dt_bias, options)
    do = graph.add(_as_dask("grad_output", grad_output), plan.sequence_chunks(plan.heads, plan.V))
    initial = _states(graph, initial_state, "initial_state")
    dfinal = _states(graph, grad_final_state, "grad_final_state")
    if plan.offsets is not None and boundaries is not None:
        msg = "boundaries must be None with cu_seqlens in kda.dask (the shard start states are recomputed)"
        raise InvalidInputError(msg)
    boundaries = _boundaries(graph, boundaries)
    graph.name("backward", options, plan.offsets)
    _check_with_blocks(x, initial=initial, dfinal=dfinal, do=do, boundaries=boundaries)
    if plan.offsets is not None:
        return _packed_backward(graph, x, initial, dfinal, do, options, (q, k, v, g, beta))
    shard = partial(_backward_block, options=options)
    results = {}
    for ib, ih in plan.rows():
        if boundaries is None:
            starts, maps = _forward_scan(x, ib, ih, initial[ib, ih], options)
        else:  # each shard's backward reads its start state from its boundaries
            starts, maps = [initial[ib, ih]] + [None] * (len(plan.times) - 1), []
        dends = _backward_scan(x, ib, ih, dfinal[ib, ih], maps, do, options)
        for it, (start, dend) in enumerate(zip(starts, dends)):
            args = [*x.args(ib, ih, it), start, graph.key(boundaries, it, ib, ih, 0, 0)]
            do_key = graph.key(do, *_sequence_index(plan, ib, ih, it, 4))
            results[ib, ih, it] = graph.task("backward", (ib, ih, it), shard, *args, do_key, dend)
    return _gradients(graph, results, (q, k, v, g, beta), A_log, dt_bias)


def _gradients(
    graph: _Graph, results: dict, inputs: tuple, A_log: Any, dt_bias: Any, dinitial: dict | None = None
) -> KdaGradients:
    """The gradients as Dask arrays (per-head parameters summed over batch and time blocks)."""
    plan = graph.plan
    qk_heads = tuple(h // plan.group for h in plan.heads)
    cuts = (
        (qk_heads, plan.K),
        (qk_heads, plan.K),
        (plan.heads, plan.V),
        (plan.heads, plan.K),
        (plan.heads, None),
    )
    grads = []
    for n, (name, like, (heads, width)) in enumerate(zip(("q", "k", "v", "g", "beta"), inputs, cuts)):
        parts = {index: (key, n) for index, key in results.items()}
        grads.append(graph.sequence_array(f"d{name}", parts, heads, width, like))
    if dinitial is None:
        parts = {(ib, ih): (results[ib, ih, 0], 5) for ib, ih in plan.rows()}
    else:
        parts = {index: (key, None) for index, key in dinitial.items()}
    dinitial = graph.state_array("dinitial-state", parts)
    params = []
    for slot, param, tail in ((6, A_log, ()), (7, dt_bias, (plan.K,))):
        if param is None:
            params.append(None)
            continue
        summed = {}
        for ih in range(len(plan.heads)):
            keys = [key for index, key in results.items() if index[1] == ih]
            summed[(ih, *(0 for _ in tail))] = (
                graph.task(f"sum{slot}", (ih,), partial(_total, field=slot), *keys),
                None,
            )
        chunks = (plan.heads, *((w,) for w in tail))
        params.append(graph.array(f"dparam{slot}", summed, chunks, param.dtype))
    return KdaGradients(*grads, dinitial, *params)
