"""Context parallelism: one packed sequence batch cut into equal contiguous slices, one per rank.

This module holds the partition and the array-level steps; it does no communication. The
``torch.distributed`` glue (:func:`kda.torch.build_cp_context`, ``chunk_kda(..., cp_context=...)``)
calls the steps in this order, one collective between each pair (``docs/context_parallel.md``):

forward
    1. :func:`forward_map`: the map ``S_end = A S_start + N`` of the rank's *last* local
       segment (only when that sequence continues on a later rank);
    2. all-gather of the ``[HV, K, K + V]`` maps; :func:`start_states`: every local sequence's
       true start state (a fold over the maps of the earlier ranks holding the same sequence);
    3. :func:`forward_local`: the ordinary chunked forward from those states; with
       ``output_final_state``, :func:`final_state_share` and an all-reduce (sum).

backward
    1. :func:`backward_map`: ``A`` and ``D`` (``dS_start = A^T dS_end + D``) of the rank's *first*
       local segment (only when that sequence started on an earlier rank);
    2. all-gather; :func:`end_gradients`: every local sequence's true end-state gradient (a fold
       over the transposed maps of the later ranks, from the final states' gradient);
    3. :func:`backward_local`: the ordinary chunked backward; the initial-state gradient of a
       sequence is kept only on the rank where it starts (each rank's share).

The rank's slice is validated and scanned for NaN / inf once (:func:`open_rank`: its packed call
at the local offsets); every step then runs on that call or calls derived from it (a segment's
transition maps, :meth:`kda._entry.call.Call.segment`), checking nothing again. The arrays are
NumPy or CuPy, time-major with ``B == 1``. A step given the call's
:class:`~kda._options.spec.CallSpec` instead of an opened call opens one itself (the in-process
simulation of the tests).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

import array_api_compat

from .._errors import InvalidInputError
from .._options.packing import check_cu_seqlens
from .._options.spec import CallSpec
from .call import Call, Inputs, KdaGradients, KdaOutput, build_call
from .scan import advance, retreat
from .transition import transition_gradient, transition_map

__all__ = [
    "Partition",
    "Rank",
    "backward_local",
    "backward_map",
    "end_gradients",
    "final_state_share",
    "forward_local",
    "forward_map",
    "open_rank",
    "partition",
    "start_states",
]


@dataclass(frozen=True)
class Partition:
    """Where one rank's slice lies in the packed batch.

    Attributes
    ----------
    world_size, rank : int
    offsets : tuple of int
        The global ``cu_seqlens`` (``N + 1`` offsets).
    part_len : int
        Tokens per rank, ``offsets[-1] // world_size``.
    local_seqs : tuple of int
        Global indices of the sequences with tokens on this rank, in order (never empty).
    local_offsets : tuple of int
        The rank-local ``cu_seqlens`` (``len(local_seqs) + 1`` offsets from 0 to ``part_len``).
    first_rank, last_rank : tuple of int
        Per global sequence: the rank of its first and last token (``-1`` for an empty sequence).
    """

    world_size: int
    rank: int
    offsets: tuple[int, ...]
    part_len: int
    local_seqs: tuple[int, ...]
    local_offsets: tuple[int, ...]
    first_rank: tuple[int, ...]
    last_rank: tuple[int, ...]

    @property
    def start(self) -> int:
        return self.rank * self.part_len

    @property
    def num_seqs(self) -> int:
        """Global number of sequences ``N``."""
        return len(self.offsets) - 1

    @property
    def pre_num_ranks(self) -> int:
        """Earlier ranks holding part of this rank's first local sequence."""
        return self.rank - self.first_rank[self.local_seqs[0]]

    @property
    def post_num_ranks(self) -> int:
        """Later ranks holding part of this rank's last local sequence."""
        return self.last_rank[self.local_seqs[-1]] - self.rank

    @property
    def pre_num_conv_tokens(self) -> int:
        """Tokens of the first local sequence before this rank's slice."""
        return max(0, self.start - self.offsets[self.local_seqs[0]])

    @property
    def crossing(self) -> bool:
        """Whether any sequence crosses any rank boundary (same on every rank: no collective
        is needed when it is False)."""
        return any(a != b for a, b in zip(self.first_rank, self.last_rank))


def partition(offsets: Any, world_size: int, rank: int) -> Partition:
    """The slice of ``rank`` out of ``world_size`` equal contiguous slices of a packed batch.

    Parameters
    ----------
    offsets : sequence of int
        Global ``cu_seqlens``: non-decreasing, from 0 to the total token count ``T``.
    world_size, rank : int
        ``T`` must be a positive multiple of ``world_size``.

    Raises
    ------
    InvalidInputError
        For bad ``cu_seqlens`` or a ``T`` that does not split into ``world_size`` equal parts.
    InvalidTypeError
        For ``cu_seqlens`` that are not 1-D integers.
    """
    offsets = check_cu_seqlens(offsets, 1, None, sequences=1)
    if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
        msg = f"world_size must be >= 1 and 0 <= rank < world_size; got world_size={world_size}, rank={rank}"
        raise InvalidInputError(msg)
    total = offsets[-1]
    if total < world_size or total % world_size:
        msg = (
            f"cu_seqlens: the total token count ({total}) must be a positive multiple of the "
            f"world size ({world_size}) for context parallelism (each rank an equal slice)"
        )
        raise InvalidInputError(msg)
    part = total // world_size
    first = tuple(a // part if b > a else -1 for a, b in itertools.pairwise(offsets))
    last = tuple((b - 1) // part if b > a else -1 for a, b in itertools.pairwise(offsets))
    lo, hi = rank * part, (rank + 1) * part
    seqs = tuple(n for n, (a, b) in enumerate(itertools.pairwise(offsets)) if b > a and a < hi and b > lo)
    local = (0, *(min(offsets[n + 1], hi) - lo for n in seqs))
    return Partition(
        world_size=world_size,
        rank=rank,
        offsets=offsets,
        part_len=part,
        local_seqs=seqs,
        local_offsets=local,
        first_rank=first,
        last_rank=last,
    )


def _xp(x: Any) -> Any:
    return array_api_compat.array_namespace(x)


class Rank(NamedTuple):
    """A rank's slice, opened (:func:`open_rank`): its validated call and its arrays."""

    call: Call
    x: Inputs


def open_rank(p: Partition, x: Any, spec: CallSpec) -> Rank:
    """The rank's slice validated, and scanned for NaN / inf, once: its call (packed at the local
    offsets, built by the validating door :func:`~kda._entry.call.build_call`) and its arrays as
    a record.

    ``x``: the rank's ``q, k, v, g, beta`` (time-major, ``B == 1``; an
    :class:`~kda._entry.call.Inputs` with the gate law's parameters, or a tuple of the five);
    ``spec``: the call's :class:`~kda._options.spec.CallSpec` (time-major).
    """
    x = x if isinstance(x, Inputs) else Inputs(*x)
    call = build_call(spec, x, cu_seqlens=p.local_offsets)
    call.check_inputs_finite(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta)
    return Rank(call, x)


def _opened(p: Partition, x: Any, opts: Any) -> Rank:
    """``opts``: the rank's :class:`Rank` from :func:`open_rank`, or the spec to open it with."""
    return open_rank(p, x, opts) if isinstance(opts, CallSpec) else opts


def _segment(call: Call, x: Inputs, a: int, b: int) -> tuple[Call, Inputs]:
    """Steps ``a:b`` of the rank's slice (one sequence's piece) as a call of its own."""
    return call.segment(a, b), call.steps(x, a, b)


def forward_map(p: Partition, x: Any, opts: Any, dtype: Any) -> Any:
    """Step 1 of the forward: ``[HV, K, K + V]`` = ``[A, N]`` of the last local segment.

    ``x`` are the rank's ``q, k, v, g, beta`` (time-major, ``B == 1``); ``opts`` the rank's call
    (:func:`open_rank`), or the spec to open it with. Zeros when no later rank continues the
    sequence (nobody reads the map).
    """
    call, x = _opened(p, x, opts)
    xp, HV, K, V = call.problem.xp, call.problem.HV, call.problem.K, call.problem.V
    if p.post_num_ranks == 0:
        return xp.zeros((HV, K, K + V), dtype=dtype)
    a, b = p.local_offsets[-2], p.local_offsets[-1]
    t = transition_map(*_segment(call, x, a, b))
    return xp.concat([t.A[0], t.N[0]], axis=-1)


def start_states(
    p: Partition, maps: Any, initial_state: Any, shape: tuple[int, ...], dtype: Any, xp: Any
) -> Any:
    """Step 2 of the forward: ``[N_local, HV, K, V]`` true start states of the local sequences.

    ``maps``: ``[W, HV, K, K + V]`` gathered from :func:`forward_map` (None when no sequence
    crosses a rank boundary); ``initial_state``: the global ``[N, HV, K, V]`` or None (zeros);
    ``shape``: ``(HV, K, V)``.
    """
    HV, K, V = shape
    starts = []
    for i, n in enumerate(p.local_seqs):
        s = None if initial_state is None else initial_state[n]
        if i == 0:
            for j in range(p.first_rank[n], p.rank):  # the earlier ranks' maps, in order
                s = advance(maps[j][..., :K], maps[j][..., K:], s)
        starts.append(xp.zeros((HV, K, V), dtype=dtype) if s is None else s)
    return xp.stack(starts)


def forward_local(p: Partition, x: Any, starts: Any, opts: Any) -> KdaOutput:
    """Step 3 of the forward: the chunked forward over the local slice from ``starts``
    (boundaries saved for :func:`backward_local`); ``opts`` as for :func:`forward_map`.

    Raises
    ------
    InvalidInputError
        When a start state carried from the earlier ranks is not finite (the recurrence diverged
        there: unnormalised keys with large ``beta``, for example).
    """
    xp = _xp(starts)
    if not bool(xp.all(xp.isfinite(starts))):
        msg = (
            f"rank {p.rank}: the state carried into its first sequence from the earlier ranks is not "
            "finite: the recurrence diverged there (unnormalised keys with beta * |k|^2 > 2, for "
            "example; use_qk_l2norm_in_kernel=True normalises them)"
        )
        raise InvalidInputError(msg)
    call, x = _opened(p, x, opts)
    return call.forward(x, call.state_or_zeros("initial_state", starts), True)


def final_state_share(p: Partition, local_final: Any, initial_state: Any, xp: Any) -> Any:
    """``[N, HV, K, V]``: the final states of the sequences that end on this rank (empty
    sequences: their initial state, on rank 0), zeros elsewhere; summed over ranks, every final
    state."""
    share = xp.zeros((p.num_seqs, *local_final.shape[1:]), dtype=local_final.dtype)
    for i, n in enumerate(p.local_seqs):
        if p.last_rank[n] == p.rank:
            share[n, ...] = local_final[i]
    if p.rank == 0 and initial_state is not None:
        for n in range(p.num_seqs):
            if p.first_rank[n] < 0:
                share[n, ...] = initial_state[n]
    return share


def backward_map(p: Partition, x: Any, do: Any, opts: Any, dtype: Any, own_map: Any = None) -> Any:
    """Step 1 of the backward: ``[HV, K, K + V]`` = ``[A, D]`` of the first local segment.

    ``do``: the rank's output gradient (scanned by the caller); ``opts`` as for
    :func:`forward_map`; ``own_map``: this rank's :func:`forward_map` (reused for ``A`` when the
    first segment is also the last). Zeros when the sequence started on this rank.
    """
    call, x = _opened(p, x, opts)
    xp, HV, K, V = call.problem.xp, call.problem.HV, call.problem.K, call.problem.V
    if p.pre_num_ranks == 0:
        return xp.zeros((HV, K, K + V), dtype=dtype)
    a, b = p.local_offsets[0], p.local_offsets[1]
    seg_call, seg = _segment(call, x, a, b)
    if own_map is not None and len(p.local_seqs) == 1 and p.post_num_ranks > 0:
        A = own_map[..., :K]
    else:
        A = transition_map(seg_call, seg).A[0]
    D = transition_gradient(seg_call, seg, seg_call.grad_output(do[:, a:b, ...], check=False))[0]
    return xp.concat([A, D], axis=-1)


def end_gradients(p: Partition, maps: Any, dfinal: Any, shape: tuple[int, ...], dtype: Any, xp: Any) -> Any:
    """Step 2 of the backward: ``[N_local, HV, K, V]`` true end-state gradients.

    ``maps``: ``[W, HV, K, K + V]`` gathered from :func:`backward_map` (None when no sequence
    crosses a rank boundary); ``dfinal``: the global ``[N, HV, K, V]`` or None (zeros).
    """
    HV, K, V = shape
    dends = []
    last = len(p.local_seqs) - 1
    for i, n in enumerate(p.local_seqs):
        d = None if dfinal is None else dfinal[n]
        if i == last:
            for j in range(p.last_rank[n], p.rank, -1):  # the later ranks' maps, last first
                d = retreat(maps[j][..., :K], maps[j][..., K:], d)
        dends.append(xp.zeros((HV, K, V), dtype=dtype) if d is None else d)
    return xp.stack(dends)


def backward_local(
    p: Partition, x: Any, starts: Any, boundaries: Any, do: Any, dends: Any, opts: Any, dfinal: Any = None
) -> KdaGradients:
    """Step 3 of the backward: the chunked backward over the local slice (``opts`` as for
    :func:`forward_map`; ``do``, ``dfinal`` scanned by the caller).

    The returned ``initial_state`` field is the global ``[N, HV, K, V]`` share: the gradient of a
    sequence's initial state on the rank where it starts (empty sequences: ``dfinal``
    on rank 0), zeros elsewhere. ``A_log``, ``dt_bias``: this rank's share.
    """
    call, x = _opened(p, x, opts)
    xp = call.problem.xp
    grads = call.backward(x, starts, boundaries, call.grad_output(do, check=False), dends)
    local = grads.initial_state
    share = xp.zeros((p.num_seqs, *local.shape[1:]), dtype=local.dtype)
    for i, n in enumerate(p.local_seqs):
        if p.first_rank[n] == p.rank:
            share[n, ...] = local[i]
    if p.rank == 0 and dfinal is not None:
        for n in range(p.num_seqs):
            if p.first_rank[n] < 0:
                share[n, ...] = dfinal[n]
    return grads._replace(initial_state=share)
