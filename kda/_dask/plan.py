"""How a :mod:`kda.dask` call's inputs are cut into blocks: the block sizes shared by every array
of the call (:class:`Plan`; time blocks moved to multiples of ``chunk_size``, head blocks to whole
groups of value heads) and, for packed sequences, the time shards' pieces of the sequences
(:class:`Shard`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import dask.array as da
import numpy as np

from .._errors import InvalidInputError, InvalidTypeError
from .._options.packing import check_cu_seqlens
from .._options.table import LAYOUTS
from .._options.validation import check_choice, check_chunk_size

__all__ = ["Plan", "Shard", "plan", "shards"]


@dataclass(frozen=True)
class Plan:
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


def plan(q, k, v, g, beta, layout: str, chunk_size: int, cu_seqlens: Any) -> Plan:
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
    return Plan(
        layout=layout,
        chunk_size=chunk_size,
        B=B,
        H=H,
        HV=HV,
        T=T,
        K=K,
        V=V,
        dtype=np.dtype(q.dtype),
        batch=q.chunks[0],
        heads=heads,
        times=times,
        meta=meta,
        offsets=offsets,
    )


def _packed_offsets(cu_seqlens: Any, B: int, T: int) -> tuple[int, ...] | None:
    """Host ``cu_seqlens`` (NumPy, CuPy, a sequence, or a Dask array: computed), checked."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, da.Array):
        cu_seqlens = cu_seqlens.compute()
    return check_cu_seqlens(cu_seqlens, B, T, sequences=1)


@dataclass(frozen=True)
class Shard:
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


def shards(offsets: tuple[int, ...], times: tuple[int, ...]) -> list[Shard]:
    """The shard of each time block (block sizes ``times``) of a packed batch with ``offsets``."""
    out, lo = [], 0
    for t in times:
        hi = lo + t
        seqs = tuple(n for n, (a, b) in enumerate(itertools.pairwise(offsets)) if b > a and a < hi and b > lo)
        local = (0, *(min(offsets[n + 1], hi) - lo for n in seqs))
        enters = bool(seqs) and offsets[seqs[0]] < lo
        leaves = bool(seqs) and offsets[seqs[-1] + 1] > hi
        out.append(Shard(lo=lo, hi=hi, seqs=seqs, local=local, enters=enters, leaves=leaves))
        lo = hi
    return out
