"""Packed sequences (``cu_seqlens``): group the sequences, run the core per group, scatter back.

A row ``[1, HV, T, ...]`` holds ``N`` sequences, sequence ``i`` at steps
``[cu[i], cu[i + 1])``. Sequences with the same number of chunks ``ceil(len_i / C)`` form one
group, run by the core as a batch of ``n`` rows of ``NT_g * C`` steps at most (shorter ones end in
steps that change nothing: ``q = k = v = 0``, log decay 0, ``beta = 0``). The work is therefore
proportional to ``NT = sum(ceil(len_i / C))``, never to ``N * max(len_i)``, and the number of core
calls is the number of distinct chunk counts.

Gathers and scatters are ``take`` with precomputed indices and ``where`` with masks, so they work
on every array-API namespace, immutable ones included.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Group", "SeqPlan", "plan_sequences"]


@dataclass(frozen=True)
class Group:
    """Sequences run together by one core call."""

    seqs: tuple[int, ...]  # sequence numbers, ascending
    steps: int  # padded length: the longest of the group
    chunks: int  # chunks per sequence


@dataclass(frozen=True)
class SeqPlan:
    """The grouping of packed sequences, with host index arrays for gathers and scatters."""

    offsets: tuple[int, ...]
    groups: tuple[Group, ...]
    chunk_size: int

    @property
    def N(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_chunks(self) -> int:
        return sum(-(-(b - a) // self.chunk_size) for a, b in zip(self.offsets, self.offsets[1:]))

    def chunk_starts(self) -> list[int]:
        """Index of each sequence's first boundary in the ``[NT, ...]`` boundaries."""
        starts, n = [], 0
        for a, b in zip(self.offsets, self.offsets[1:]):
            starts.append(n)
            n += -(-(b - a) // self.chunk_size)
        return starts


def plan_sequences(offsets: tuple[int, ...], chunk_size: int) -> SeqPlan:
    """Group the sequences by their number of chunks (empty sequences run in no group)."""
    by_chunks: dict[int, list[int]] = {}
    for i, (a, b) in enumerate(itertools.pairwise(offsets)):
        n = -(-(b - a) // chunk_size)
        if n:
            by_chunks.setdefault(n, []).append(i)
    groups = []
    for n, seqs in sorted(by_chunks.items()):
        steps = max(offsets[i + 1] - offsets[i] for i in seqs)
        groups.append(Group(tuple(seqs), steps, n))
    return SeqPlan(tuple(offsets), tuple(groups), chunk_size)


def _gather_index(plan: SeqPlan, group: Group) -> tuple[np.ndarray, np.ndarray]:
    """Packed step of each ``[n, steps]`` slot (clamped into its sequence), and the valid mask."""
    t = np.arange(group.steps)
    starts = np.array([plan.offsets[i] for i in group.seqs])
    lengths = np.array([plan.offsets[i + 1] - plan.offsets[i] for i in group.seqs])
    index = starts[:, None] + np.minimum(t[None, :], lengths[:, None] - 1)
    return index, t[None, :] < lengths[:, None]


def gather(xp: Any, x: Any, plan: SeqPlan, group: Group) -> Any:
    """``[1, HV, T, ...]`` -> ``[n, HV, steps, ...]``, zeros past each sequence's end."""
    index, valid = _gather_index(plan, group)
    n = len(group.seqs)
    flat = xp.take(x[0, ...], xp.asarray(index.reshape(-1), device=x.device), axis=1)
    rows = xp.reshape(flat, (x.shape[1], n, group.steps, *x.shape[3:]))
    rows = xp.permute_dims(rows, (1, 0, 2, *range(3, rows.ndim)))
    mask = xp.asarray(valid.reshape(n, 1, group.steps, *(1,) * (x.ndim - 3)), device=x.device)
    return xp.where(mask, rows, xp.zeros_like(rows))


def gather_rows(xp: Any, x: Any, plan: SeqPlan, group: Group) -> Any:
    """Rows ``[N, ...]`` (states) of a group's sequences -> ``[n, ...]``."""
    return xp.take(x, xp.asarray(np.array(group.seqs), device=x.device), axis=0)


def scatter(xp: Any, parts: list[Any], plan: SeqPlan, T: int) -> Any:
    """Per-group ``[n, HV, steps, ...]`` -> the packed ``[1, HV, T, ...]`` (zeros nowhere needed).

    Every packed step belongs to exactly one sequence, so the result is a ``take`` from the
    concatenation of all groups' steps.
    """
    flat, index, offset = [], np.zeros(T, dtype=np.int64), 0
    for part, group in zip(parts, plan.groups):
        n, HV, steps = part.shape[:3]
        rows = xp.permute_dims(part, (1, 0, 2, *range(3, part.ndim)))
        flat.append(xp.reshape(rows, (HV, n * steps, *part.shape[3:])))
        for j, i in enumerate(group.seqs):
            a, b = plan.offsets[i], plan.offsets[i + 1]
            index[a:b] = offset + j * steps + np.arange(b - a)
        offset += n * steps
    joined = flat[0] if len(flat) == 1 else xp.concat(flat, axis=1)
    return xp.take(joined, xp.asarray(index, device=joined.device), axis=1)[None, ...]


def scatter_rows(xp: Any, parts: list[Any], plan: SeqPlan, default: Any) -> Any:
    """Per-group rows ``[n, ...]`` -> ``[N, ...]``; sequences in no group take ``default``'s row."""
    index = np.arange(plan.N) + sum(len(g.seqs) for g in plan.groups)
    offset = 0
    for group in plan.groups:
        index[list(group.seqs)] = offset + np.arange(len(group.seqs))
        offset += len(group.seqs)
    joined = xp.concat([*parts, default], axis=0)
    return xp.take(joined, xp.asarray(index, device=joined.device), axis=0)


def gather_boundaries(xp: Any, boundaries: Any, plan: SeqPlan, group: Group) -> Any:
    """``[NT, 1, HV, K, V]`` (sequence order) -> the group's ``[NT_g, n, HV, K, V]``."""
    starts = plan.chunk_starts()
    index = np.array([[starts[i] + c for i in group.seqs] for c in range(group.chunks)])
    flat = xp.take(boundaries[:, 0, ...], xp.asarray(index.reshape(-1), device=boundaries.device), axis=0)
    return xp.reshape(flat, (group.chunks, len(group.seqs), *boundaries.shape[2:]))


def scatter_boundaries(xp: Any, parts: list[Any], plan: SeqPlan, empty: Any) -> Any:
    """Per-group ``[NT_g, n, HV, K, V]`` -> ``[NT, 1, HV, K, V]`` in sequence order."""
    if not parts:
        return empty
    starts = plan.chunk_starts()
    index = np.zeros(plan.num_chunks, dtype=np.int64)
    flat, offset = [], 0
    for part, group in zip(parts, plan.groups):
        n = len(group.seqs)
        flat.append(xp.reshape(part, (group.chunks * n, *part.shape[2:])))  # row c * n + j
        for j, i in enumerate(group.seqs):
            index[starts[i] : starts[i] + group.chunks] = offset + np.arange(group.chunks) * n + j
        offset += group.chunks * n
    joined = flat[0] if len(flat) == 1 else xp.concat(flat, axis=0)
    return xp.take(joined, xp.asarray(index, device=joined.device), axis=0)[:, None, ...]
