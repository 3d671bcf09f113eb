"""Decoding from a state pool on the CPU: one Numba kernel, on the calling thread.

The kernel (:mod:`._decode_kernels`, imported on the first call: ``import kda`` does not import
Numba) reads only the pool rows a call names and writes only the rows it names, in place. The
work of one decode step is small (a few heads of ``K x V`` states), so the kernel runs on the
calling thread; handing it to a thread pool costs more than the step.

What a call allocates: the output, and nothing else when the inputs are C-contiguous in the
pool's dtype and each pool row is C-contiguous (the kernel takes the pool itself, as a flat
view: :func:`flat_pool`), the rows themselves packed or a padded slot stride apart (the views
vLLM-CPU keeps). A pool whose rows are strided (a transposed view, say) is served through a
contiguous copy of the rows the call names, written back afterwards: still no read of any other
row.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from .._options.arguments import c_contiguous, slot_stride
from . import _fpenv, _pool

__all__ = ["decode_finite", "decode_forward", "decode_screen"]

_LOCK = threading.Lock()
_KERNELS: list[Any] = []  # the kernel module, once imported
_NO_OFFSETS = np.zeros(0, np.int64)
# state elements a call steps (items x steps x K x V) from which it is split over two cores
SPLIT_WORK = 1 << 20


def _kernels() -> Any:
    if not _KERNELS:
        with _LOCK:
            if not _KERNELS:
                from . import _decode_kernels

                _KERNELS.append(_decode_kernels)
    return _KERNELS[0]


def _kernel() -> Any:
    return _kernels().decode


def decode_screen(q: Any, k: Any, v: Any, g: Any, beta: Any, *, finite: bool) -> bool:
    """Whether ``g <= 0`` everywhere (NaN fails) and, with ``finite``, ``q, k, v, beta`` are finite.

    One compiled pass over C-contiguous NumPy inputs of one float dtype (False for anything else:
    the caller's own checks then decide and word the error).
    """
    dt = q.dtype
    same = k.dtype is dt and v.dtype is dt and g.dtype is dt and beta.dtype is dt
    if (dt is not _F32 and dt is not _F64) or not (same and c_contiguous(q, k, v, g, beta)):
        return False
    screen = _KERNELS[0].screen if _KERNELS else _kernels().screen
    return screen(q.reshape(-1), k.reshape(-1), v.reshape(-1), g.reshape(-1), beta.reshape(-1), finite)


def decode_finite(output: Any) -> bool:
    """Whether every element of ``output`` is finite (the decode output's divergence check): one
    compiled, branch-free pass where it is C-contiguous float32 / float64, NumPy's otherwise."""
    if not c_contiguous(output) or (output.dtype is not _F32 and output.dtype is not _F64):
        return bool(np.isfinite(output).all())
    finite = _KERNELS[0]._finite if _KERNELS else _kernels()._finite
    return bool(finite(output.reshape(-1)))


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


# 16-bit pools as the kernel reads them: their bits (kda.cpu._decode_kernels.load)
_BITS = {"float16": np.uint16, "bfloat16": np.int16}


_SEEN: dict[int, tuple[np.dtype, Any]] = {}  # id(dtype) -> (dtype, its bits type or None)


def pool_bits(pool: np.ndarray) -> np.ndarray:
    """``pool`` as the kernel reads it: a float32 / float64 pool itself, a float16 pool as a
    uint16 view and a bfloat16 one (``ml_dtypes.bfloat16``) as an int16 view, no copy."""
    dt = pool.dtype
    if dt is _F32 or dt is _F64:
        return pool
    seen = _SEEN.get(id(dt))
    if seen is None:  # a dtype's name costs microseconds (float16's 4 us): looked up once per dtype
        bits = _BITS.get(dt.name) if dt.itemsize == 2 and dt.kind in "fV" else None
        seen = _SEEN[id(dt)] = (dt, bits)  # the dtype kept alive: its id is not reused
    bits = seen[1]
    if bits is None:
        from .._errors import InvalidInputError

        msg = f"the cpu backend keeps float32, float64, float16 or bfloat16 states; got a pool of {dt}"
        raise InvalidInputError(msg)
    return pool.view(bits)


def decode_forward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    pool: Any,
    start: Any,
    dest: Any,
    *,
    scale: float,
    offsets: Any = None,
    final_pool: Any = None,
    out: Any = None,
    v_first: bool = False,
) -> np.ndarray:
    """``T`` steps of ``N`` requests from ``pool [P, HV, K, V]`` (see :class:`kda._backend.Backend`).

    ``q, k, g: [B, HV, T, K]``, ``v: [B, HV, T, V]``, ``beta: [B, HV, T]``; ``start [N]`` and
    ``dest [N, W]`` int64 host arrays; ``offsets [N + 1]`` or None; ``final_pool`` receives the
    written states (None: ``pool``, in place; the same dtype and layout as ``pool``); ``out``: a
    C-contiguous output buffer, or None. ``v_first``: the pools are ``[P, HV, V, K]``. A
    float32 / float64 pool computes in its dtype; a float16 or bfloat16 pool in float32 (each
    row read as it is, every stored state rounded to nearest even). Returns the output
    ``[B, HV, T, V]``.
    """
    dt = pool.dtype
    if dt is not _F32 and dt is not _F64:
        pool = pool_bits(pool)
        if final_pool is not None:
            final_pool = pool_bits(final_pool)
        dt = pool.dtype if pool.dtype.kind == "f" else _F32
    args = [q, k, v, g, beta]
    if not (q.dtype is dt and k.dtype is dt and v.dtype is dt and g.dtype is dt and beta.dtype is dt) or (
        not c_contiguous(*args)
    ):  # one test of the five on the common path
        args = [x if x.dtype is dt and c_contiguous(x) else np.ascontiguousarray(x, dt) for x in args]
    if out is None or out.dtype is not dt or out.shape != args[2].shape or not c_contiguous(out):
        out = np.empty(args[2].shape, dt)
    if out.size == 0:
        return out
    dst = pool if final_pool is None else final_pool
    kernel = _KERNELS[0].decode if _KERNELS else _kernel()
    offs = _NO_OFFSETS if offsets is None else np.asarray(offsets, np.int64)
    N, HV = start.shape[0], q.shape[1]
    v_first = bool(v_first)
    src_flat, src_slot = flat_pool(pool)
    dst_flat, dst_slot = (src_flat, src_slot) if dst is pool else flat_pool(dst)
    if src_flat is not None and dst_flat is not None:
        pools = (src_flat, src_slot, dst_flat, dst_slot)
        work = out.size * q.shape[3]
        if work < SPLIT_WORK:  # the common decode step: on this thread, no more checks
            _fpenv.run(kernel, *args, dt.type(scale), *pools, start, dest, offs, out, v_first, 0, N * HV)
        else:
            _run(kernel, (*args, dt.type(scale), *pools, start, dest, offs, out, v_first), N * HV, work)
        return out
    _through_copies(kernel, args, dt.type(scale), pool, dst, start, dest, offs, out, N * HV, v_first)
    return out


def flat_pool(pool: np.ndarray) -> tuple[np.ndarray | None, int]:
    """``pool [P, ...]`` as the kernel reads it: a flat 1-D view of its elements and the slot
    stride in elements (row ``r`` starts at element ``r * stride``), or ``(None, 0)``.

    A C-contiguous pool is its own flat view (stride: one row's size). A pool whose rows are
    C-contiguous but sit further apart (a view with a padded slot stride, as vLLM-CPU keeps
    them) is viewed from its first element to its last, the padding between rows included,
    which the kernel never reads or writes. Anything else (rows not C-contiguous, a negative or
    unaligned slot stride, rows that overlap) gives None: the caller copies.
    """
    if c_contiguous(pool):
        return pool.reshape(-1), max(math.prod(pool.shape[1:]), 1)
    slot = slot_stride(pool)
    if slot is None:
        return None, 0
    span = (pool.shape[0] - 1) * slot + math.prod(pool.shape[1:])
    item = pool.itemsize
    flat = np.lib.stride_tricks.as_strided(pool, (span,), (item,), writeable=pool.flags.writeable)
    return flat, slot


def _run(kernel: Any, args: tuple, items: int, work: int) -> None:
    """``kernel(*args, lo, hi)`` over ``items``: on the calling thread, or split in two halves (the
    calling thread and one thread of the backend's pool, :mod:`._pool`) where ``work`` (state
    elements stepped) passes :data:`SPLIT_WORK` and a second core is usable. Items are
    independent, so the results do not depend on the split."""
    if work < SPLIT_WORK or items < 2 or _cores() < 2:
        _fpenv.run(kernel, *args, 0, items)
        return
    _pool.run_ranges(_fpenv.run, kernel, args, (0, items // 2, items), threads=1, on_caller=True)


def _cores() -> int:
    """The cores this process may use (:func:`._pool.threads`)."""
    return _pool.threads()


def _through_copies(kernel, args, scale, pool, dst, start, dest, offs, out, items, v_first) -> None:
    """Run on contiguous copies of the named rows of strided pools; write the written rows back."""
    read, written = np.unique(start[start >= 0]), np.unique(dest[dest >= 0])
    if dst is pool:
        src_rows = dst_rows = np.union1d(read, written)
        src_work = dst_work = np.ascontiguousarray(pool[src_rows])
    else:
        src_rows, dst_rows = read, written
        src_work, dst_work = np.ascontiguousarray(pool[read]), np.ascontiguousarray(dst[written])
    starts, dests = _renumber(start, src_rows), _renumber(dest, dst_rows)
    src_slot, dst_slot = src_work[0].size if len(src_work) else 1, dst_work[0].size if len(dst_work) else 1
    _fpenv.run(
        kernel,
        *args,
        scale,
        src_work.reshape(-1),
        max(src_slot, 1),
        dst_work.reshape(-1),
        max(dst_slot, 1),
        starts,
        dests,
        offs,
        out,
        v_first,
        0,
        items,
    )
    dst[written] = dst_work[np.searchsorted(dst_rows, written)]


def _renumber(rows: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """``rows`` as positions in the sorted ``kept`` (negative entries stay -1)."""
    return np.where(rows >= 0, np.searchsorted(kept, rows), -1).astype(np.int64)
