"""Packed sequences (``cu_seqlens``): group the sequences, run the core per group, put back.

A row ``[1, HV, T, ...]`` holds ``N`` sequences, sequence ``i`` at steps
``[cu[i], cu[i + 1])``. Sequences with the same number of chunks ``ceil(len_i / C)`` form one
group, run by the core as a batch of ``n`` rows of ``steps`` (the group's longest length) steps;
shorter ones end in steps that change nothing (``q = k = v = 0``, log decay 0, ``beta = 0``). The
work is therefore proportional to ``NT = sum(ceil(len_i / C))``, never to ``N * max(len_i)``, and
the number of core calls is the number of distinct chunk counts.

Everything is slicing and ``concat``, so it works on every array-API namespace, immutable ones
included: a group of one sequence is a view of the row, and putting results back is one
concatenation of views in sequence order (every step, state and boundary belongs to exactly one
sequence).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

__all__ = ["Group", "SeqPlan", "plan_sequences"]


@dataclass(frozen=True)
class Group:
    """Sequences run together by one core call."""

    seqs: tuple[int, ...]  # sequence numbers, ascending
    steps: int  # padded length: the longest of the group
    chunks: int  # chunks per sequence


@dataclass(frozen=True)
class SeqPlan:
    """The grouping of packed sequences."""

    offsets: tuple[int, ...]
    groups: tuple[Group, ...]
    chunk_size: int
    slots: tuple[tuple[int, int], ...]  # (group, row in it) per sequence; (-1, -1) when empty

    def length(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def chunks(self, i: int) -> int:
        return -(-self.length(i) // self.chunk_size)

    def slot(self, i: int) -> tuple[int, int]:
        """``(group number, row in the group)`` of sequence ``i``, or ``(-1, -1)`` when it is empty."""
        return self.slots[i]


def plan_sequences(offsets: tuple[int, ...], chunk_size: int) -> SeqPlan:
    """Group the sequences by their number of chunks (empty sequences run in no group)."""
    by_chunks: dict[int, list[int]] = {}
    for i, (a, b) in enumerate(itertools.pairwise(offsets)):
        n = -(-(b - a) // chunk_size)
        if n:
            by_chunks.setdefault(n, []).append(i)
    groups = []
    slots = [(-1, -1)] * (len(offsets) - 1)
    for n, seqs in sorted(by_chunks.items()):
        steps = max(offsets[i + 1] - offsets[i] for i in seqs)
        for j, i in enumerate(seqs):
            slots[i] = (len(groups), j)
        groups.append(Group(seqs=tuple(seqs), steps=steps, chunks=n))
    return SeqPlan(offsets=tuple(offsets), groups=tuple(groups), chunk_size=chunk_size, slots=tuple(slots))


def _time(x: Any, a: int, b: int) -> Any:
    """Steps ``[a, b)`` of a ``[rows, HV, T, ...]`` array (a view)."""
    return x[:, :, a:b, ...]


def gather(xp: Any, x: Any, plan: SeqPlan, group: Group) -> Any:
    """``[1, HV, T, ...]`` -> ``[n, HV, steps, ...]``, zeros past each sequence's end."""
    rows = []
    for i in group.seqs:
        a, b = plan.offsets[i], plan.offsets[i + 1]
        row = _time(x, a, b)
        if b - a < group.steps:
            pad = xp.zeros(
                (1, x.shape[1], group.steps - (b - a), *x.shape[3:]), dtype=x.dtype, device=x.device
            )
            row = xp.concat([row, pad], axis=2)
        rows.append(row)
    return _joined(xp, rows, axis=0)


def gather_rows(xp: Any, x: Any, plan: SeqPlan, group: Group) -> Any:
    """Rows ``[N, ...]`` (states) of a group's sequences -> ``[n, ...]``."""
    rows = [x[i : i + 1, ...] for i in group.seqs]
    return _joined(xp, rows, axis=0)


def _joined(xp: Any, pieces: list[Any], axis: int) -> Any:
    """The pieces concatenated along ``axis``; a single piece itself (no copy)."""
    if len(pieces) > 1:
        return xp.concat(pieces, axis=axis)
    (only,) = pieces
    return only


def scatter(xp: Any, parts: list[Any], plan: SeqPlan) -> Any:
    """Per-group ``[n, HV, steps, ...]`` -> the packed ``[1, HV, T, ...]``."""
    pieces = []
    for i in range(len(plan.offsets) - 1):
        g, j = plan.slot(i)
        if g >= 0:
            pieces.append(parts[g][j : j + 1, :, : plan.length(i), ...])
    return _joined(xp, pieces, axis=2)


def scatter_into(buffers: list[Any], parts: list[Any], plan: SeqPlan, group: Group) -> None:
    """Copy a group's ``[n, HV, steps, ...]`` results into the packed ``[1, HV, T, ...]`` buffers."""
    for j, i in enumerate(group.seqs):
        a, b = plan.offsets[i], plan.offsets[i + 1]
        for buf, part in zip(buffers, parts, strict=True):
            buf[:, :, a:b, ...] = part[j : j + 1, :, : b - a, ...]


def scatter_rows(xp: Any, parts: list[Any], plan: SeqPlan, default: Any) -> Any:
    """Per-group rows ``[n, ...]`` -> ``[N, ...]``; sequences in no group take ``default``'s row."""
    pieces = []
    for i in range(len(plan.offsets) - 1):
        g, j = plan.slot(i)
        pieces.append(parts[g][j : j + 1, ...] if g >= 0 else default[i : i + 1, ...])
    return xp.concat(pieces, axis=0)


def gather_boundaries(xp: Any, boundaries: Any, plan: SeqPlan, group: Group) -> Any:
    """``[NT, 1, HV, K, V]`` (sequence order) -> the group's ``[NT_g, n, HV, K, V]``."""
    starts = list(itertools.accumulate((plan.chunks(i) for i in range(len(plan.offsets) - 1)), initial=0))
    rows = [boundaries[starts[i] : starts[i] + group.chunks, ...] for i in group.seqs]
    return _joined(xp, rows, axis=1)


def scatter_boundaries(xp: Any, parts: list[Any], plan: SeqPlan, empty: Any) -> Any:
    """Per-group ``[NT_g, n, HV, K, V]`` -> ``[NT, 1, HV, K, V]`` in sequence order."""
    pieces = []
    for i in range(len(plan.offsets) - 1):
        g, j = plan.slot(i)
        if g >= 0:
            pieces.append(parts[g][:, j : j + 1, ...])
    return _joined(xp, pieces, axis=0) if pieces else empty
