"""The graph of a :mod:`kda.dask` call: one layer of tasks, keyed by block, on the blocks of the
rechunked inputs (:class:`Graph`), and the inputs' blocks with each block's one check task
(:class:`Blocks`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import array_api_compat
import dask.array as da
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from .._errors import InvalidInputError, InvalidTypeError
from . import tasks as _tasks
from .plan import Plan

__all__ = ["Blocks", "Graph", "as_dask", "boundaries", "inputs", "sequence_index", "states"]


def sequence_index(plan: Plan, ib: int, ih: int, it: int, ndim: int) -> tuple[int, ...]:
    idx = (ib, ih, it) if plan.layout == "head_first" else (ib, it, ih)
    return idx + (0,) * (ndim - 3)


def as_dask(name: str, x: Any) -> Any:
    if isinstance(x, da.Array):
        return x
    if not array_api_compat.is_array_api_obj(x):
        msg = f"{name} must be an array (Dask, NumPy or CuPy); got {type(x).__name__}"
        raise InvalidTypeError(msg)
    return da.from_array(x, chunks=-1)


def _checked(name: str, x: Any, shape: tuple[int, ...], letters: str) -> Any:
    x = as_dask(name, x)
    if tuple(x.shape) != shape:
        msg = f"{name} must have shape [{letters}] = {shape}; got {tuple(x.shape)}"
        raise InvalidInputError(msg)
    return x


class Graph:
    """The tasks of one call, keyed by block, on the blocks of the rechunked inputs.

    ``key(x, *index)`` names a block of an input; ``task`` adds a task (a function of blocks and of
    earlier tasks' results); ``array`` turns one result per block into a Dask array. Every task is
    per block (or per shard boundary): the graph never grows with the number of chunks.
    """

    def __init__(self, plan: Plan) -> None:
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
        """A Dask array from ``parts[index] = (key, name)``: block ``index`` is field ``name`` of the
        record that task ``key`` returns (read by :func:`~kda._dask.tasks.field`).

        ``name = None``: the whole result.
        """
        name = f"kda-{kind}-{self.token}"
        layer = {
            (name, *index): key if part is None else (_tasks.field(part), key)
            for index, (key, part) in parts.items()
        }
        graph = HighLevelGraph.from_collections(name, {**self.layer, **layer}, dependencies=self.inputs)
        meta = da.utils.meta_from_array(self.plan.meta, ndim=len(chunks), dtype=dtype)
        return da.Array(graph, name, chunks, meta=meta)

    def sequence_array(self, kind: str, parts: dict, heads: tuple, width: int | None, like: Any) -> Any:
        """Results keyed ``(ib, ih, it)`` as one array in the plan's layout, in the chunks of ``like``."""
        chunks = self.plan.sequence_chunks(heads, width)
        keyed = {sequence_index(self.plan, *index, len(chunks)): part for index, part in parts.items()}
        x = self.array(kind, keyed, chunks, like.dtype)
        return x if x.chunks == like.chunks else x.rechunk(like.chunks)

    def state_array(self, kind: str, parts: dict) -> Any:
        keyed = {(*index, 0, 0): part for index, part in parts.items()}
        return self.array(kind, keyed, self.plan.state_chunks(self.plan.V), self.plan.state_dtype)


@dataclass
class Blocks:
    """The rechunked inputs of one call, and each block's check.

    A block's arrays are validated and scanned for NaN / inf once, by its check task
    (:func:`~kda._dask.tasks.check_block`: ``q .. dt_bias`` and the caller's arrays that belong
    to the block, :attr:`extras`); every other task of the block depends on it and opens the
    block's call without looking at the values again.
    """

    graph: Graph
    arrays: list[Any]  # q, k, v, g, beta (Dask arrays, rechunked)
    A_log: Any
    dt_bias: Any
    options: Any = None  # the blocks' CallSpec (kda.dask's _block_options)
    local: list | None = None  # per time block: its cu_seqlens (packed sequences)
    extras: dict = field(default_factory=dict)  # (ib, ih, it) -> {name: key} checked with the block
    checks: dict = field(default_factory=dict)  # (ib, ih, it) -> the check task's key

    def blocks(self, ib: int, ih: int, it: int) -> tuple:
        """One block's arrays as a record: a task (run inside the task that takes it) of
        :func:`~kda._dask.tasks.block_inputs` on the keys of ``q, k, v, g, beta, A_log, dt_bias``."""
        g, plan = self.graph, self.graph.plan
        q, k, v, g_, beta = (g.key(x, *sequence_index(plan, ib, ih, it, x.ndim)) for x in self.arrays)
        A_log, dt_bias = g.key(self.A_log, ih), g.key(self.dt_bias, ih, 0)
        return (_tasks.block_inputs, q, k, v, g_, beta, A_log, dt_bias)

    def args(self, ib: int, ih: int, it: int) -> list[Any]:
        """The key of the block's check (made once), then :meth:`blocks`: a block task's leading
        arguments ``(checked, blocks)``."""
        index = (ib, ih, it)
        if index not in self.checks:
            extras = {n: k for n, k in self.extras.get(index, {}).items() if k is not None}
            offsets = None if self.local is None else self.local[it]
            check = partial(_tasks.check_block, options=self.options, names=tuple(extras), offsets=offsets)
            self.checks[index] = self.graph.task("check", index, check, self.blocks(*index), *extras.values())
        return [self.checks[index], self.blocks(ib, ih, it)]


def inputs(graph: Graph, q, k, v, g, beta, A_log, dt_bias, options: Any) -> Blocks:
    """The call's arrays added to ``graph``, rechunked to its plan (``options``: every block's
    keywords)."""
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
    return Blocks(graph=graph, arrays=arrays, A_log=A_log, dt_bias=dt_bias, options=options)


def states(graph: Graph, x: Any, name: str) -> dict[tuple[int, int], Any]:
    """The keys of a ``[B, HV, K, V]`` state's blocks (None: zeros) per (batch, head) block."""
    plan = graph.plan
    if x is not None:
        rows, letter = (plan.B, "B") if plan.offsets is None else (len(plan.offsets) - 1, "N")
        x = _checked(name, x, (rows, plan.HV, plan.K, plan.V), f"{letter}, HV, K, V")
        x = graph.add(x, plan.state_chunks(plan.V))
    return {(ib, ih): graph.key(x, ib, ih, 0, 0) for ib, ih in plan.rows()}


def boundaries(graph: Graph, x: Any) -> Any:
    """``[NT, B, HV, K, V]`` boundaries cut like the shards, batch and value heads."""
    plan = graph.plan
    if x is None:
        return None
    shape = (sum(plan.chunk_counts()), plan.B, plan.HV, plan.K, plan.V)
    x = _checked("boundaries", x, shape, "NT, B, HV, K, V")
    return graph.add(x, (plan.chunk_counts(), *plan.state_chunks(plan.V)))
