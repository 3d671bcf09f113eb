"""The Numba kernel of the CPU backend's decode (imported on first use: this imports numba).

:func:`decode` runs the items ``[lo, hi)`` of ``N * HV`` (request, value head) pairs. Each item
reads its request's start state from ``src``, runs the request's steps and writes the state after
each step into ``dst`` (the same array for an in-place pool) or, where no slot is named, into a
scratch state of its own. Per step, with ``e = exp(g_t)``, the state is read once for both
products and once more for the update::

    pred = (k e)^T S        qs = (q e)^T S             # pass 1: reads S
    u    = beta (v - pred)   o = scale (qs + (q . k) u)  # = scale S_t^T q_t
    D    = e[:, None] S + k u^T                          # pass 2: reads S, writes D (D may be S)

so a step moves ``3 K V`` elements of state (two reads, one write) and nothing else of that size.
The inner loops run over the ``V`` contiguous columns and vectorise. ``g = -inf`` gives
``e = 0`` exactly. No sum crosses items, so results do not depend on how items are split.

LLVM vectorises those loops behind run-time checks that the array a loop stores to does not sit
just past one it loads from, and falls back to scalar code, whose fused multiply-adds round
differently, where the check fails. The kernel's own vectors and scratch state therefore live in
one private buffer, at fixed offsets with a guard of :data:`GUARD` elements around each, and no
loop stores to one caller's array while loading another's (but a pool row from a pool row: the
same pool on every thread): a check's answer then cannot depend on where the heap of the thread
that runs an item put its allocations. With the vectors allocated on their own and one loop
storing ``pred`` and ``o`` at once, a step's output depends on where its vectors sit, by an ulp
(seen in float64, ``K=8, V=24``), and a call split over two threads can differ from the
one-thread call.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._compile import jit

__all__ = ["decode", "load", "screen", "store"]

# kda.cpu's one Numba decorator (cached where a cache is writable). No nnan/ninf: -inf gates must
# stay exact. Reassociation lets the column loops vectorise; the compiled order is fixed, so
# results are deterministic. No kernel-files stamp: nothing here calls a compiled function of
# another file (the entries are stamped with how they are compiled: _compile.COMPILE_STAMP). The
# helpers are compiled in full, not as inner functions: inlined from their optimised modules the
# decode kernel runs faster (about 5 % at H = 16, benchmarks/results/first_call_amd-epyc-zen4.txt).
_jit = jit(fastmath={"reassoc", "contract"}, boundscheck=False, stamp=False)

# elements around each of the kernel's private vectors (512 bytes of float32, 1 KiB of float64):
# more than a vectorised loop's reach (4 x 16 float32 or 4 x 8 float64 lanes, 256 bytes)
GUARD = 128


# ----------------------------------------------------------------------------------------------
# pool elements: float32 / float64 as they are; float16 pools reach the kernel as their uint16
# bits, bfloat16 pools as their int16 bits (Numba has no 16-bit float type on the CPU)


@intrinsic
def _half_to_float(typingctx, bits):
    """float16 bits (uint16) -> float32, exactly (F16C ``vcvtph2ps`` on x86)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def _float_to_half(typingctx, x):
    """float32 -> float16 bits (uint16), rounded to nearest even (``vcvtps2ph``); overflow gives inf."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def _bfloat_to_float(typingctx, bits):
    """bfloat16 bits (int16) -> float32, exactly: the bits are float32's upper half."""
    sig = types.float32(types.int16)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        wide = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
        return builder.bitcast(wide, ir.FloatType())

    return sig, codegen


@intrinsic
def _float_to_bfloat(typingctx, x):
    """float32 -> bfloat16 bits (int16), rounded to nearest even (as ml_dtypes and torch); a NaN
    stays a (quiet) NaN. Branch-free, so the store loops vectorise."""
    sig = types.int16(types.float32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        high = builder.lshr(bits, ir.Constant(i32, 16))
        odd = builder.and_(high, ir.Constant(i32, 1))
        rounded = builder.lshr(
            builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), odd), ir.Constant(i32, 16)
        )
        quiet = builder.or_(high, ir.Constant(i32, 0x40))
        nan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.trunc(builder.select(nan, quiet, rounded), ir.IntType(16))

    return sig, codegen


def _fma_ir(builder, x, y, z):
    """``x * y + z`` rounded once (``llvm.fma``), scalars or vectors."""
    ty = x.type
    name = f"llvm.fma.v{ty.count}f32" if isinstance(ty, ir.VectorType) else f"llvm.fma.{ty.intrinsic_name}"
    return builder.call(
        cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * 3), name), [x, y, z]
    )


@intrinsic
def fma(typingctx, x, y, z):
    """``x * y + z`` rounded once, float32 or float64. The state updates are written with it so
    that their rounding is fixed (left to contraction, LLVM fused either product with the other
    depending on the loads around it: a bfloat16 pool's row and a float32 pool's row of the same
    values came out a rounding apart)."""
    if not (x == y == z and x in (types.float32, types.float64)):
        return None

    def codegen(context, builder, signature, args):
        return _fma_ir(builder, *args)

    return x(x, y, z), codegen


def load(a, x):  # pragma: no cover - replaced by its overload in compiled code
    """The compute value of ``x``, an element of the pool array ``a``."""


def store(a, x):  # pragma: no cover
    """What the pool array ``a`` holds for the compute value ``x`` (rounded to nearest even)."""


@overload(load)
def _load(a, x):
    if a.dtype == types.uint16:
        return lambda a, x: _half_to_float(x)
    if a.dtype == types.int16:
        return lambda a, x: _bfloat_to_float(x)
    return lambda a, x: x


@overload(store)
def _store(a, x):
    if a.dtype == types.uint16:
        return lambda a, x: _float_to_half(np.float32(x))
    if a.dtype == types.int16:
        return lambda a, x: _float_to_bfloat(np.float32(x))
    return lambda a, x: x


# ----------------------------------------------------------------------------------------------
# bfloat16 pool rows written LANES columns at a time. Written as a scalar loop, LLVM vectorises the
# rounding store four lanes wide (measured): a one-request step from a bfloat16 pool then took
# 1.2-1.3x the float32 step. Written as one LANES-wide vector, the store is AVX512-BF16's
# ``vcvtneps2bf16`` where the target has it and the same integer rounding as
# :func:`_float_to_bfloat` elsewhere: bitwise the same results (both round to nearest even; the
# instruction would flush a subnormal result, which the kernels' flush-to-zero mode never makes).

LANES = 16


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite has no such type)."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


def _target_features() -> list[str]:
    """Numba's target features (the host's unless ``NUMBA_CPU_FEATURES`` says otherwise); Numba's
    cache keys on them, so a cached kernel carries the store chosen for its target."""
    features = numba.config.CPU_FEATURES
    if features is None:
        from llvmlite import binding

        features = binding.get_host_cpu_features().flatten()
    return features.split(",")


BF16_INSTRUCTION = "+avx512bf16" in _target_features()


def _round_to_bfloat(builder, x, lanes):
    """``<lanes x float>`` -> ``<lanes x i16>`` bfloat16 bits, to nearest even; NaN stays NaN."""
    i16 = ir.VectorType(ir.IntType(16), lanes)
    if BF16_INSTRUCTION:
        return builder.bitcast(builder.fptrunc(x, ir.VectorType(_BFloat(), lanes)), i16)
    vi = ir.VectorType(ir.IntType(32), lanes)

    def const(c):
        return ir.Constant(vi, [c] * lanes)

    bits = builder.bitcast(x, vi)
    high = builder.lshr(bits, const(16))
    rounded = builder.lshr(
        builder.add(builder.add(bits, const(0x7FFF)), builder.and_(high, const(1))), const(16)
    )
    nan = builder.fcmp_unordered("uno", x, x)
    return builder.trunc(builder.select(nan, builder.or_(high, const(0x40)), rounded), i16)


def _lanes(context, builder, ty, value, at):
    """``value[at : at + LANES]`` as ``<LANES x float>`` (a float32 or bfloat16-bits array; ``at``
    counts elements of the array's data), or a float32 scalar broadcast."""
    vf = ir.VectorType(ir.FloatType(), LANES)
    if not isinstance(ty, types.Array):
        first = builder.insert_element(ir.Constant(vf, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(
            first,
            ir.Constant(vf, ir.Undefined),
            ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES),
        )
    data = builder.gep(context.make_array(ty)(context, builder, value).data, [at])
    if ty.dtype == types.float32:
        return builder.load(builder.bitcast(data, vf.as_pointer()), align=4)
    vi = ir.VectorType(ir.IntType(32), LANES)
    half = builder.load(builder.bitcast(data, ir.VectorType(ir.IntType(16), LANES).as_pointer()), align=2)
    return builder.bitcast(builder.shl(builder.zext(half, vi), ir.Constant(vi, [16] * LANES)), vf)


def _is_lanes(ty, *dtypes) -> bool:
    return isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" and ty.dtype in dtypes


@intrinsic
def _blend_lanes(typingctx, D, S, at, a, b, y):
    """``D[at : at + LANES] = bfloat16(fma(b, y, a * S[at : at + LANES]))``: ``D`` bfloat16 bits,
    ``S`` bfloat16 bits or float32, each of ``a, b, y`` a float32 array (its lanes at ``at``) or
    scalar: the scalar loops' arithmetic, lane by lane."""
    if not (_is_lanes(D, types.int16) and _is_lanes(S, types.int16, types.float32)):
        return None
    if not all(_is_lanes(t, types.float32) or t == types.float32 for t in (a, b, y)):
        return None
    sig = types.void(D, S, at, a, b, y)

    def codegen(context, builder, signature, args):
        at = args[2]
        s, av, bv, yv = (_lanes(context, builder, signature.args[i], args[i], at) for i in (1, 3, 4, 5))
        x = _fma_ir(builder, bv, yv, builder.fmul(av, s))
        data = builder.gep(context.make_array(signature.args[0])(context, builder, args[0]).data, [at])
        builder.store(
            _round_to_bfloat(builder, x, LANES),
            builder.bitcast(data, ir.VectorType(ir.IntType(16), LANES).as_pointer()),
            align=2,
        )
        return context.get_dummy_value()

    return sig, codegen


def blend_row(D, S, a, b, y):  # pragma: no cover - replaced by its overload in compiled code
    """``D[c] = store(D, fma(b, y, a * load(S, S[c])))`` for the first columns, ``LANES`` at a time
    where ``D`` is a bfloat16 row (none otherwise); returns how many columns it wrote."""


@overload(blend_row)
def _blend_row(D, S, a, b, y):
    if D.dtype != types.int16 or S.dtype not in (types.int16, types.float32):
        return lambda D, S, a, b, y: 0

    def impl(D, S, a, b, y):
        n = D.shape[0] - D.shape[0] % LANES
        for c in range(0, n, LANES):
            _blend_lanes(D, S, c, a, b, y)
        return n

    return impl


def _is_rows(ty, *dtypes) -> bool:
    return isinstance(ty, types.Array) and ty.ndim == 2 and ty.layout == "C" and ty.dtype in dtypes


@intrinsic
def _update_lanes4(typingctx, D, S, c, at, e, kk, u0, u1, u2, u3):
    """``D[c + r, at : at + LANES] = fma(kk, ur, e * S[c + r, at : at + LANES])`` for ``r < 4``:
    four rows of V-major states ``D: [V, K]`` float32, ``S: [V, K]`` float32 or bfloat16 bits,
    ``e, kk`` float32 vectors whose lanes are loaded once for the four rows, ``ur`` the rows'
    float32 scalars (passed as values: loaded from an array here, LLVM could not keep them out of
    the loop, the array possibly being ``D``): the scalar loop's arithmetic, lane by lane."""
    if not (_is_rows(D, types.float32) and _is_rows(S, types.int16, types.float32)):
        return None
    if not all(_is_lanes(t, types.float32) for t in (e, kk)) or {u0, u1, u2, u3} != {types.float32}:
        return None
    sig = types.void(D, S, c, at, e, kk, u0, u1, u2, u3)

    def codegen(context, builder, signature, args):
        tD, tS, _, _, te, tk = signature.args[:6]
        vD, vS, vc, vat, ve, vk = args[:6]
        ev, kv = _lanes(context, builder, te, ve, vat), _lanes(context, builder, tk, vk, vat)
        cols = cgutils.unpack_tuple(builder, context.make_array(tS)(context, builder, vS).shape)[1]
        for r in range(4):
            row = builder.add(vc, ir.Constant(vc.type, r))
            at = builder.add(builder.mul(row, cols), vat)
            ur = _lanes(context, builder, types.float32, args[6 + r], at)
            x = _fma_ir(builder, kv, ur, builder.fmul(ev, _lanes(context, builder, tS, vS, at)))
            data = builder.gep(context.make_array(tD)(context, builder, vD).data, [at])
            builder.store(x, builder.bitcast(data, x.type.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


def update_rows(D, S, e, kk, u):  # pragma: no cover - replaced by its overload in compiled code
    """``D[c, d] = store(D, fma(kk[d], u[c], e[d] * load(S, S[c, d])))`` for V-major states
    ``D, S: [V, K]`` (``D`` may be ``S``), four rows and ``LANES`` columns at a time as explicit
    vectors where ``D`` is float32 (nothing otherwise); returns ``(rows, columns)``: the block
    ``[:rows, :columns]`` it wrote. bfloat16 rows stay row by row (:func:`blend_row`): four at a
    time, one step of 64 requests from a bfloat16 pool (memory bound) measured 1.21-1.25x the
    K-major step against 1.15-1.21x row by row (AMD Zen 4, load 0.2-0.5)."""


@overload(update_rows)
def _update_rows(D, S, e, kk, u):
    if not (_is_rows(D, types.float32) and _is_rows(S, types.int16, types.float32)):
        return lambda D, S, e, kk, u: (0, 0)
    if not all(_is_lanes(t, types.float32) for t in (e, kk, u)):
        return lambda D, S, e, kk, u: (0, 0)

    def impl(D, S, e, kk, u):
        V, K = S.shape
        rows, cols = V - V % 4, K - K % LANES
        for c in range(0, rows, 4):
            u0, u1, u2, u3 = u[c], u[c + 1], u[c + 2], u[c + 3]
            for at in range(0, cols, LANES):
                _update_lanes4(D, S, c, at, e, kk, u0, u1, u2, u3)
        return rows, cols

    return impl


# ----------------------------------------------------------------------------------------------
# one step, K-major states [K, V] and V-major states [V, K]


@_jit
def _decode_step(S, D, write, q, k, v, g, b, scale, o, w, zero):
    """One step from ``S: [K, V]`` into ``D`` (``write``; ``D`` may be ``S``); ``o: [V]`` output.
    ``w``: the private vectors ``(e, ke, qe, kk, pred, qs)``."""
    e, _ke, _qe, _kk, pred, qs = w
    K, V = S.shape
    for d in range(K):
        e[d] = np.exp(g[d])
    qk = zero
    for d in range(K):  # a sum in a loop that stores nothing: one compiled order
        qk += q[d] * k[d]
    for c in range(V):
        pred[c] = 0
        qs[c] = 0
    d4 = K - K % 4
    for d in range(0, d4, 4):  # four rows per sweep: a quarter of the loads and stores of pred, qs
        k0, k1, k2, k3 = k[d] * e[d], k[d + 1] * e[d + 1], k[d + 2] * e[d + 2], k[d + 3] * e[d + 3]
        q0, q1, q2, q3 = q[d] * e[d], q[d + 1] * e[d + 1], q[d + 2] * e[d + 2], q[d + 3] * e[d + 3]
        S0, S1, S2, S3 = S[d], S[d + 1], S[d + 2], S[d + 3]
        for c in range(V):
            a0, a1, a2, a3 = load(S, S0[c]), load(S, S1[c]), load(S, S2[c]), load(S, S3[c])
            pred[c] += (k0 * a0 + k1 * a1) + (k2 * a2 + k3 * a3)
            qs[c] += (q0 * a0 + q1 * a1) + (q2 * a2 + q3 * a3)
    for d in range(d4, K):
        kd = k[d] * e[d]
        qd = q[d] * e[d]
        Sd = S[d]
        for c in range(V):
            s = load(S, Sd[c])
            pred[c] += kd * s
            qs[c] += qd * s
    for c in range(V):
        pred[c] = b * (v[c] - pred[c])  # u
    for c in range(V):
        o[c] = scale * (qs[c] + qk * pred[c])
    if write and D.ctypes.data == S.ctypes.data:
        # in place, written as such: LLVM's overlap check would send the general loop to scalar code
        for d in range(K):
            ed = e[d]
            kd = k[d]
            Dd = D[d]
            for c in range(blend_row(Dd, Dd, ed, kd, pred), V):
                Dd[c] = store(D, fma(kd, pred[c], ed * load(D, Dd[c])))
    elif write:
        for d in range(K):
            ed = e[d]
            kd = k[d]
            Dd, Sd = D[d], S[d]
            for c in range(blend_row(Dd, Sd, ed, kd, pred), V):
                Dd[c] = store(D, fma(kd, pred[c], ed * load(S, Sd[c])))


@_jit
def _decode_step_v(S, D, write, q, k, v, g, b, scale, o, w, zero):
    """:func:`_decode_step` for V-major states ``S, D: [V, K]`` (row ``c`` holds column ``c`` of the
    ``[K, V]`` state): the products are dot products along the contiguous rows, four rows a
    sweep, and the update runs along them."""
    e, ke, qe, kk, pred, qs = w
    V, K = S.shape
    for d in range(K):
        ed = np.exp(g[d])
        e[d] = ed
        ke[d] = k[d] * ed
        qe[d] = q[d] * ed
        kk[d] = k[d]
    qk = zero
    for d in range(K):
        qk += q[d] * k[d]
    c4 = V - V % 4
    for c in range(0, c4, 4):
        S0, S1, S2, S3 = S[c], S[c + 1], S[c + 2], S[c + 3]
        p0, p1, p2, p3 = zero, zero, zero, zero
        s0, s1, s2, s3 = zero, zero, zero, zero
        for d in range(K):
            a0, a1, a2, a3 = load(S, S0[d]), load(S, S1[d]), load(S, S2[d]), load(S, S3[d])
            kd, qd = ke[d], qe[d]
            p0 += kd * a0
            p1 += kd * a1
            p2 += kd * a2
            p3 += kd * a3
            s0 += qd * a0
            s1 += qd * a1
            s2 += qd * a2
            s3 += qd * a3
        pred[c], pred[c + 1], pred[c + 2], pred[c + 3] = p0, p1, p2, p3
        qs[c], qs[c + 1], qs[c + 2], qs[c + 3] = s0, s1, s2, s3
    for c in range(c4, V):
        Sc = S[c]
        p, s = zero, zero
        for d in range(K):
            a = load(S, Sc[d])
            p += ke[d] * a
            s += qe[d] * a
        pred[c] = p
        qs[c] = s
    for c in range(V):
        pred[c] = b * (v[c] - pred[c])  # u
    for c in range(V):
        o[c] = scale * (qs[c] + qk * pred[c])
    if write:
        _update_v(D, S, e, kk, pred)


@_jit
def _update_v(D, S, e, kk, u):
    """``D[c] = e * S[c] + kk u[c]`` per row ``c`` of V-major states (``D`` may be ``S``): four rows
    a sweep as explicit vectors (:func:`update_rows`), so each load of ``e`` and ``kk`` serves four
    rows (row by row, a stored vector took three loads where a K-major row's takes two: the V-major
    step was 1.15-1.24x the K-major one on an AMD Zen 4); what they leave (other pool dtypes, rows
    and columns past whole groups) by the scalar loop, whose arithmetic is the same."""
    V, K = S.shape
    rows, cols = update_rows(D, S, e, kk, u)
    if D.ctypes.data == S.ctypes.data:  # in place, written as such (see _decode_step)
        for c in range(V):
            x = u[c]
            Dc = D[c]
            for d in range(cols if c < rows else blend_row(Dc, Dc, e, kk, x), K):
                Dc[d] = store(D, fma(kk[d], x, e[d] * load(D, Dc[d])))
    else:
        for c in range(V):
            x = u[c]
            Dc, Sc = D[c], S[c]
            for d in range(cols if c < rows else blend_row(Dc, Sc, e, kk, x), K):
                Dc[d] = store(D, fma(kk[d], x, e[d] * load(S, Sc[d])))


@_jit
def _advance(v_first, S, D, write, q, k, v, g, b, scale, o, w, zero):
    if v_first:
        _decode_step_v(S, D, write, q, k, v, g, b, scale, o, w, zero)
    else:
        _decode_step(S, D, write, q, k, v, g, b, scale, o, w, zero)


@_jit
def _keep(D, S):
    """``D = S`` rounded to ``D``'s pool dtype (the state after a step that a later step follows)."""
    R, C = S.shape
    for a in range(R):
        Da, Sa = D[a], S[a]
        for c in range(C):
            Da[c] = store(D, Sa[c])


@_jit
def _state(pool, at, rows, cols):
    """The ``[rows, cols]`` state at element ``at`` of the flat pool ``pool`` (a C-contiguous view)."""
    return pool[at : at + rows * cols].reshape(rows, cols)


@_jit
def decode(q, k, v, g, beta, scale, src, src_slot, dst, dst_slot, start, dest, offsets, out, v_first, lo, hi):
    """Items ``[lo, hi)`` of ``N * HV`` (request ``n``, head ``h``) pairs.

    ``q, k, g: [B, HV, T, K]``, ``v, out: [B, HV, T, V]``, ``beta: [B, HV, T]`` in the compute
    dtype; ``src, dst``: the pools ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``v_first``; may be
    one array) as flat 1-D arrays, pool row ``r`` at elements ``r * src_slot`` (``dst_slot``)
    onwards, its ``HV`` states C-contiguous (a slot stride larger than ``HV K V``: the padded
    rows of a view, whose padding is never read or written), of one pool dtype (the compute
    dtype, or float16 / bfloat16 bits with float32: see :func:`load`); ``start: [N]``,
    ``dest: [N, W]`` int64 rows (``W == 1``: the last step writes
    row ``dest[n, 0]``; else step ``t`` writes ``dest[n, t]``; ``< 0``: not written);
    ``offsets``: ``[N + 1]`` (request ``n`` is steps ``offsets[n]:offsets[n + 1]`` of batch row
    0) or empty (request ``n`` is batch row ``n``). A request with ``start[n] < 0`` is padding:
    zero outputs, no state read or written. A step that a later one follows runs into a private
    state in the compute dtype (and its slot, if any, receives that state rounded): the state is
    rounded only on its way into the pool.
    """
    _B, HV, T, K = q.shape
    V = v.shape[3]
    W = dest.shape[1]
    packed = offsets.shape[0] > 0
    # e [K] (and ke, qe, kk [K] for V-major states) and pred, qs [V] at fixed offsets, GUARD
    # elements apart (see above)
    kvecs = 4 if v_first else 1
    work = np.empty((kvecs + 3) * GUARD + kvecs * K + 2 * V, q.dtype)
    e = work[GUARD : GUARD + K]
    at = GUARD + K + GUARD
    ke, qe, kk = e, e, e  # only V-major steps read them
    if v_first:
        ke = work[at : at + K]
        qe = work[at + K + GUARD : at + 2 * K + GUARD]
        kk = work[at + 2 * (K + GUARD) : at + 3 * K + 2 * GUARD]
        at += 3 * (K + GUARD)
    pred = work[at : at + V]
    at += V + GUARD
    qs = work[at : at + V]
    w = (e, ke, qe, kk, pred, qs)
    zero = np.zeros(1, q.dtype)[0]
    rows, cols = (V, K) if v_first else (K, V)
    KV = K * V
    none = np.empty((0, 0), dst.dtype)  # stands for "no state" (typed as the pool's rows)
    scratch = work[0:0].reshape(0, 0)  # the private state, made the first time a step needs it
    for item in range(lo, hi):
        n = item // HV
        h = item - n * HV
        b, t0, steps = n, 0, T
        if packed:
            b, t0, steps = 0, offsets[n], offsets[n + 1] - offsets[n]
        o = out[b, h]
        row = start[n]
        if row < 0:
            for t in range(t0, t0 + steps):
                for c in range(V):
                    o[t, c] = 0
            continue
        at = row * src_slot + h * KV  # read only: src may be a read-only array (a JAX buffer)
        first = src[at : at + KV].reshape(rows, cols)
        for t in range(steps):
            slot = dest[n, 0] if W == 1 else dest[n, t]
            i = t0 + t
            x = (q[b, h, i], k[b, h, i], v[b, h, i], g[b, h, i], beta[b, h, i])
            if t == steps - 1:  # the last step: straight into its slot (rounded there), if any
                write = slot >= 0
                D = _state(dst, slot * dst_slot + h * KV, rows, cols) if write else none
                if t == 0:
                    _advance(v_first, first, D, write, x[0], x[1], x[2], x[3], x[4], scale, o[i], w, zero)
                else:
                    _advance(v_first, scratch, D, write, x[0], x[1], x[2], x[3], x[4], scale, o[i], w, zero)
                continue
            if scratch.shape[0] != rows:
                guarded = np.empty(2 * GUARD + K * V, q.dtype)
                scratch = guarded[GUARD : GUARD + K * V].reshape(rows, cols)
            if t == 0:
                _advance(v_first, first, scratch, True, x[0], x[1], x[2], x[3], x[4], scale, o[i], w, zero)
            else:
                _advance(v_first, scratch, scratch, True, x[0], x[1], x[2], x[3], x[4], scale, o[i], w, zero)
            if W > 1 and slot >= 0:
                _keep(_state(dst, slot * dst_slot + h * KV, rows, cols), scratch)
        if steps == 0 and W == 1 and dest[n, 0] >= 0:
            to = dest[n, 0] * dst_slot + h * KV  # no steps: the final state is the start state
            for i in range(KV):  # element by element: a slice assignment compiles Numba's shape-error text
                dst[to + i] = src[at + i]


@_jit
def _finite(x):
    """Whether every element of ``x`` is finite: ``x * 0`` is NaN exactly where ``x`` is NaN or
    infinite (never folded to 0: no nnan / nsz), and a sum keeps a NaN; branch-free, it vectorises."""
    acc = 0.0
    for i in range(x.size):
        acc += x[i] * 0.0
    return acc == 0.0


@_jit
def _log_decays(g):
    """Whether every ``g <= 0`` (``-inf`` allowed; NaN and positive values fail); branch-free."""
    bad = 0
    for i in range(g.size):
        bad += not g[i] <= 0
    return bad == 0


@_jit
def screen(q, k, v, g, beta, finite):
    """Whether every ``g <= 0`` (``-inf`` allowed, NaN not) and, with ``finite``, every element of
    ``q, k, v, beta`` is finite: one pass over the (small) inputs, flattened C-contiguous arrays."""
    if not _log_decays(g):
        return False
    if finite:
        return _finite(q) and _finite(k) and _finite(v) and _finite(beta)
    return True
