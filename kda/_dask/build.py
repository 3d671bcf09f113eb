"""The steps of a :mod:`kda.dask` call as tasks of its graph (``docs/sequence_parallel.md``): the
scans over time shards (every shard's map, then its start state or end-state gradient), the same
for packed sequences (only the sequence crossing a shard boundary carries a state across it,
exactly as in context parallelism: :mod:`kda._entry.cp`), and the gradients gathered from the
blocks' records by field name."""

from __future__ import annotations

from functools import partial
from typing import Any

from .._entry.call import Inputs, KdaGradients, KdaOutput
from .._options.spec import CallSpec
from . import tasks as _tasks
from .graph import Blocks, Graph, sequence_index
from .plan import shards as _shards

__all__ = [
    "backward_scan",
    "check_with_blocks",
    "forward_scan",
    "gradients",
    "packed_backward",
    "packed_forward",
]


def forward_scan(x: Blocks, ib: int, ih: int, start: Any, options: CallSpec) -> tuple[list, list]:
    """Steps 1 and 2 of the forward: every shard's map (the last one needs none), then the scan.

    Returns the keys of every shard's start state and of the maps of all shards but the last.
    """
    g, maps, starts = x.graph, [], [start]
    for it in range(len(g.plan.times) - 1):
        maps.append(
            g.task(
                "map", (ib, ih, it), partial(_tasks.transition_block, options=options), *x.args(ib, ih, it)
            )
        )
        starts.append(g.task("start", (ib, ih, it + 1), _tasks.advance, maps[-1], starts[-1]))
    return starts, maps


def backward_scan(x: Blocks, ib: int, ih: int, dend: Any, maps: list, do: Any, options: CallSpec) -> list:
    """Steps 1 and 2 of the backward: every shard's ``(A, D)`` (the first needs none), then the scan.

    ``maps`` are forward maps already in the graph (reused). Returns every shard's end-state gradient.
    """
    g, dends = x.graph, [dend]
    for it in range(len(g.plan.times) - 1, 0, -1):
        args, index = x.args(ib, ih, it), (ib, ih, it)
        transition = (
            maps[it]
            if it < len(maps)
            else g.task("map", index, partial(_tasks.transition_block, options=options), *args)
        )
        do_key = g.key(do, *sequence_index(g.plan, ib, ih, it, 4))
        D = g.task("dmap", index, partial(_tasks.state_gradient_block, options=options), *args, do_key)
        dends.append(g.task("dend", (ib, ih, it - 1), _tasks.retreat, transition, D, dends[-1]))
    return dends[::-1]


def check_with_blocks(
    x: Blocks, *, initial: dict, dfinal: dict | None = None, do: Any = None, boundaries: Any = None
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
                extras["grad_output"] = g.key(do, *sequence_index(plan, ib, ih, it, 4))
            if boundaries is not None:
                extras["boundaries"] = g.key(boundaries, it, ib, ih, 0, 0)
            x.extras[ib, ih, it] = extras


def _packed_forward_scan(x: Blocks, ih: int, shards: list, states: Any, options: CallSpec) -> list:
    """The state carried into every shard (None where no sequence enters it)."""
    g, carried = x.graph, [None]
    for it, shard in enumerate(shards[:-1]):
        if not shard.leaves:
            carried.append(None)
            continue
        a = shard.local[-2]
        tmap = g.task(
            "pmap",
            (0, ih, it),
            partial(_tasks.packed_transition, a=a, b=shard.local[-1], shard=shard, options=options),
            *x.args(0, ih, it),
        )
        step = partial(_tasks.packed_carry, n=shard.seqs[-1], through=shard.through)
        carried.append(g.task("pcarry", (0, ih, it + 1), step, tmap, carried[-1], states))
    return carried


def _packed_backward_scan(x: Blocks, ih: int, shards: list, dfinal: Any, do: Any, options: CallSpec) -> list:
    """The end-state gradient carried out of every shard (None where no sequence leaves it)."""
    g, plan = x.graph, x.graph.plan
    dcarried = [None] * len(shards)
    for it in range(len(shards) - 1, 0, -1):
        shard = shards[it]
        if not shard.enters:
            continue
        do_key = g.key(do, *sequence_index(plan, 0, ih, it, 4))
        tmap = g.task(
            "pdmap",
            (0, ih, it),
            partial(_tasks.packed_state_gradient, a=0, b=shard.local[1], shard=shard, options=options),
            *x.args(0, ih, it),
            do_key,
        )
        step = partial(_tasks.packed_dcarry, n=shard.seqs[0], through=shard.through)
        dcarried[it - 1] = g.task("pdcarry", (0, ih, it - 1), step, tmap, dcarried[it], dfinal)
    return dcarried


def packed_forward(graph: Graph, x: Blocks, initial: dict, options: CallSpec, v: Any) -> KdaOutput:
    """The forward of a packed batch: every shard's carried state, then its forward (``v``: the
    caller's, whose chunks the output takes)."""
    plan = graph.plan
    shards = _shards(plan.offsets, plan.times)
    outputs, finals = {}, {}
    for ib, ih in plan.rows():
        carried = _packed_forward_scan(x, ih, shards, initial[ib, ih], options)
        results = []
        for it, shard in enumerate(shards):
            block = partial(_tasks.packed_forward_block, shard=shard, options=options)
            results.append(
                graph.task("pforward", (ib, ih, it), block, *x.args(ib, ih, it), initial[ib, ih], carried[it])
            )
            outputs[ib, ih, it] = (results[-1], "output")
        collect = partial(
            _tasks.packed_collect,
            shards=tuple(shards),
            N=len(plan.offsets) - 1,
            name="final_state",
            first=False,
        )
        finals[ib, ih] = (graph.task("pfinal", (ib, ih), collect, initial[ib, ih], *results), None)
    output = graph.sequence_array("output", outputs, plan.heads, plan.V, v)
    return KdaOutput(output=output, final_state=graph.state_array("final-state", finals), boundaries=None)


def packed_backward(
    graph: Graph, x: Blocks, initial: dict, dfinal: dict, do: Any, options: CallSpec, like: Inputs
) -> KdaGradients:
    """The backward of a packed batch: every shard's carried state and end-state gradient, then
    its backward (``like``: the caller's arrays, whose chunks the gradients take)."""
    plan = graph.plan
    shards = _shards(plan.offsets, plan.times)
    results, dinitial = {}, {}
    for ib, ih in plan.rows():
        carried = _packed_forward_scan(x, ih, shards, initial[ib, ih], options)
        dcarried = _packed_backward_scan(x, ih, shards, dfinal[ib, ih], do, options)
        row = []
        for it, shard in enumerate(shards):
            do_key = graph.key(do, *sequence_index(plan, ib, ih, it, 4))
            block = partial(_tasks.packed_backward_block, shard=shard, options=options)
            args = (*x.args(ib, ih, it), initial[ib, ih], carried[it], do_key, dfinal[ib, ih], dcarried[it])
            results[ib, ih, it] = graph.task("pbackward", (ib, ih, it), block, *args)
            row.append(results[ib, ih, it])
        collect = partial(
            _tasks.packed_collect,
            shards=tuple(shards),
            N=len(plan.offsets) - 1,
            name="initial_state",
            first=True,
        )
        dinitial[ib, ih] = graph.task("pdinit", (ib, ih), collect, dfinal[ib, ih], *row)
    return gradients(graph, results, like, dinitial)


def gradients(graph: Graph, results: dict, like: Inputs, dinitial: dict | None = None) -> KdaGradients:
    """The gradients as Dask arrays, read by field name from the blocks' records ``results``
    (per-head parameters summed over batch and time blocks); ``like``: the call's arrays (each
    gradient is chunked like its input; None where an input is absent); ``dinitial``: the keys of
    the initial state's gradient per (batch, head) block, where not a field of ``results``."""
    plan = graph.plan
    qk_heads = tuple(h // plan.group for h in plan.heads)
    cuts = {
        "q": (qk_heads, plan.K),
        "k": (qk_heads, plan.K),
        "v": (plan.heads, plan.V),
        "g": (plan.heads, plan.K),
        "beta": (plan.heads, None),
    }
    grads = {}
    for name, (heads, width) in cuts.items():
        parts = {index: (key, name) for index, key in results.items()}
        grads[name] = graph.sequence_array(f"d{name}", parts, heads, width, getattr(like, name))
    if dinitial is None:
        parts = {(ib, ih): (results[ib, ih, 0], "initial_state") for ib, ih in plan.rows()}
    else:
        parts = {index: (key, None) for index, key in dinitial.items()}
    grads["initial_state"] = graph.state_array("dinitial-state", parts)
    for name, tail in (("A_log", ()), ("dt_bias", (plan.K,))):
        param = getattr(like, name)
        if param is None:
            grads[name] = None
            continue
        summed = {}
        for ih in range(len(plan.heads)):
            keys = [key for index, key in results.items() if index[1] == ih]
            summed[(ih, *(0 for _ in tail))] = (
                graph.task(f"sum-{name}", (ih,), partial(_tasks.total, name=name), *keys),
                None,
            )
        chunks = (plan.heads, *((w,) for w in tail))
        grads[name] = graph.array(f"d{name}", summed, chunks, param.dtype)
    return KdaGradients(**grads)
