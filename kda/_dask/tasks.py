"""What runs on one block of a :mod:`kda.dask` call, on the blocks' own array library.

Every task takes its block's arrays as one :class:`~kda._entry.call.Inputs` record (built in the
task by :func:`block_inputs`) and returns a named record: :class:`~kda.KdaOutput` (a forward),
:class:`~kda.KdaGradients` (a backward), :class:`~kda.KdaTransition` (a segment's forward map,
``S_end = A S_start + N``) or :class:`Retreat` (its backward map, ``dS_start = A^T dS_end + D``).
Records pickle, so a distributed scheduler moves them as they are; the graph reads their fields
by name (:func:`field`), so a field added to a record shifts nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import array_api_compat
import numpy as np

from .._entry import scan as _scan
from .._entry.call import Call, Inputs, KdaGradients, KdaOutput, build_call
from .._entry.transition import KdaTransition, transition_gradient, transition_map
from .._options.spec import CallSpec
from .._options.validation import STATE_DTYPE_RULE, check_array
from .plan import Shard

__all__ = [
    "Retreat",
    "advance",
    "backward_block",
    "block_inputs",
    "check_block",
    "field",
    "forward_block",
    "packed_backward_block",
    "packed_carry",
    "packed_collect",
    "packed_dcarry",
    "packed_forward_block",
    "packed_state_gradient",
    "packed_transition",
    "retreat",
    "state_gradient_block",
    "total",
    "transition_block",
]


class Retreat(NamedTuple):
    """The backward map of a segment: ``dS_start = A^T dS_end + D`` (:func:`scan.retreat`)."""

    A: Any
    D: Any


def field(name: str) -> Callable[[Any], Any]:
    """A task function reading field ``name`` of a task's record (it pickles)."""
    return operator.attrgetter(name)


def block_inputs(q: Any, k: Any, v: Any, g: Any, beta: Any, A_log: Any, dt_bias: Any) -> Inputs:
    """A block's arrays as one record (the leading argument of every block task, built inside it)."""
    return Inputs(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)


def _open(blocks: Inputs, options: CallSpec, offsets: tuple[int, ...] | None, scan: bool) -> Call:
    """A block's call (``options``: the call's spec; ``offsets``: the block's cu_seqlens), built by
    the validating door; ``scan=False``: sizes, dtypes and options only (its check task looked at
    the values)."""
    return build_call(options, blocks, cu_seqlens=offsets, scan=scan)


def check_block(
    blocks: Inputs, *extras: Any, options: CallSpec, names: tuple[str, ...], offsets: tuple[int, ...] | None
) -> None:
    """A block's one validation and finiteness scan: its arrays ``blocks``, then the caller's
    arrays of the block named ``names`` (an initial state, the output gradient, a final state's
    gradient, boundaries), each checked as the single-process function checks it."""
    call = _open(blocks, options, offsets, scan=True)
    x = blocks
    call.check_inputs_finite(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta)
    p = call.problem
    for name, a in zip(names, extras, strict=True):
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


def forward_block(checked: None, blocks: Inputs, state: Any, *, options: CallSpec, save: bool) -> KdaOutput:
    """The block's forward from its start state ``state``."""
    call = _open(blocks, options, None, scan=False)
    return call.forward(blocks, call.state_or_zeros("initial_state", state), save)


def backward_block(
    checked: None,
    blocks: Inputs,
    state: Any,
    boundaries: Any,
    grad_output: Any,
    dend: Any,
    *,
    options: CallSpec,
) -> KdaGradients:
    """The block's backward from its start state (or ``boundaries``), output gradient and
    end-state gradient ``dend``."""
    call = _open(blocks, options, None, scan=False)
    state, dend = call.state_or_zeros("initial_state", state), call.state_or_zeros("grad_final_state", dend)
    return call.backward(blocks, state, boundaries, call.grad_output(grad_output, check=False), dend)


def transition_block(checked: None, blocks: Inputs, *, options: CallSpec) -> KdaTransition:
    """The block's forward map."""
    return transition_map(_open(blocks, options, None, scan=False), blocks)


def state_gradient_block(checked: None, blocks: Inputs, grad_output: Any, *, options: CallSpec) -> Any:
    """``D``: the block's start-state gradient from its output gradient alone."""
    call = _open(blocks, options, None, scan=False)
    return transition_gradient(call, blocks, call.grad_output(grad_output, check=False))


def advance(transition: KdaTransition, start: Any) -> Any:
    """A shard's end state from its start state (:func:`scan.advance`)."""
    return _scan.advance(transition.A, transition.N, start)


def retreat(transition: KdaTransition | Retreat, D: Any, dend: Any) -> Any:
    """A shard's start-state gradient from its end-state gradient (:func:`scan.retreat`): the
    map's ``A`` with ``D``."""
    return _scan.retreat(transition.A, D, dend)


def total(*results: Any, name: str) -> Any:
    """The sum of field ``name`` of several records (a per-head parameter's gradient over blocks)."""
    parts = [getattr(r, name) for r in results]
    return sum(parts[1:], parts[0])


# ----------------------------------------------------------------------------------------------
# Packed sequences: a shard's pieces of several sequences


def _time_slice(x: Any, a: int, b: int, layout: str) -> Any:
    return x[:, :, a:b, ...] if layout == "head_first" else x[:, a:b, ...]


def packed_transition(
    checked: None, blocks: Inputs, *, a: int, b: int, shard: Shard, options: CallSpec
) -> KdaTransition:
    """The forward map, ``A [HV, K, K]`` and ``N [HV, K, V]``, of the steps ``a:b`` of a shard."""
    call = _open(blocks, options, shard.local, scan=False)
    t = transition_map(call.segment(a, b), call.steps(blocks, a, b))
    return KdaTransition(A=t.A[0], N=t.N[0])


def packed_state_gradient(
    checked: None, blocks: Inputs, do: Any, *, a: int, b: int, shard: Shard, options: CallSpec
) -> Retreat:
    """The backward map ``(A, D)`` of the steps ``a:b`` of a shard (``dS_start = A^T dS_end + D``)."""
    call = _open(blocks, options, shard.local, scan=False)
    segment, x = call.segment(a, b), call.steps(blocks, a, b)
    A = transition_map(segment, x).A[0]
    D = transition_gradient(
        segment, x, segment.grad_output(_time_slice(do, a, b, options.layout), check=False)
    )
    return Retreat(A=A, D=D[0])


def packed_carry(transition: KdaTransition, carried: Any, states: Any, *, n: int, through: bool) -> Any:
    """The state leaving a shard in sequence ``n``: ``A S + N`` from the carried state (the
    sequence passes through the shard) or from ``n``'s initial state (it starts there)."""
    start = carried if through else (None if states is None else states[n])
    return advance(transition, start)


def packed_dcarry(transition: Retreat, carried: Any, dfinal: Any, *, n: int, through: bool) -> Any:
    """The end-state gradient of the sequence entering a shard: ``A^T dE + D`` from the gradient
    carried from the next shard (through) or from ``n``'s final-state gradient (it ends there)."""
    end = carried if through else (None if dfinal is None else dfinal[n])
    return retreat(transition, transition.D, end)


def _local_states(shard: Shard, carried: Any, states: Any, first: bool, like: Any, shape: tuple) -> Any:
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


def _state_like(x: Inputs, layout: str) -> tuple[Any, tuple[int, int, int]]:
    """A zero-size array of the states' type and dtype, and a state's ``(HV, K, V)``."""
    v = x.v
    shape = (v.shape[1] if layout == "head_first" else v.shape[2], x.q.shape[3], v.shape[3])
    like = array_api_compat.array_namespace(v).zeros(
        (), dtype=np.float64 if v.dtype == np.float64 else np.float32
    )
    return like, shape


def packed_forward_block(
    checked: None, blocks: Inputs, states: Any, carried: Any, *, shard: Shard, options: CallSpec
) -> KdaOutput:
    """The shard's forward from the initial states ``states`` and the carried state."""
    call = _open(blocks, options, shard.local, scan=False)
    like, shape = _state_like(blocks, options.layout)
    starts = _local_states(shard, carried, states, True, like, shape)
    return call.forward(blocks, call.state_or_zeros("initial_state", starts), False)


def packed_backward_block(
    checked: None,
    blocks: Inputs,
    states: Any,
    carried: Any,
    do: Any,
    dfinal: Any,
    dcarried: Any,
    *,
    shard: Shard,
    options: CallSpec,
) -> KdaGradients:
    """The shard's backward: ``states`` the initial states, ``carried`` the carried state, ``do``
    the output gradient, ``dfinal`` the final states' gradient and ``dcarried`` the carried
    end-state gradient."""
    call = _open(blocks, options, shard.local, scan=False)
    like, shape = _state_like(blocks, options.layout)
    starts = call.state_or_zeros("initial_state", _local_states(shard, carried, states, True, like, shape))
    dends = call.state_or_zeros(
        "grad_final_state", _local_states(shard, dcarried, dfinal, False, like, shape)
    )
    return call.backward(blocks, starts, None, call.grad_output(do, check=False), dends)


def packed_collect(states: Any, *results: Any, shards: tuple, N: int, name: str, first: bool) -> Any:
    """``[N, HV, K, V]`` from field ``name`` of the shards' local results (final states: where
    each sequence ends; initial-state gradients: where it starts); empty sequences get ``states``
    (zeros when None)."""
    parts = [getattr(r, name) for r in results]
    xp = array_api_compat.array_namespace(parts[0])
    out = xp.zeros((N, *parts[0].shape[1:]), dtype=parts[0].dtype)
    if states is not None:
        for n in range(N):
            out[n, ...] = states[n]
    for shard, part in zip(shards, parts):
        for i, n in enumerate(shard.seqs):
            crossing = (i == 0 and shard.enters) if first else (i == len(shard.seqs) - 1 and shard.leaves)
            if not crossing:
                out[n, ...] = part[i]
    return out
