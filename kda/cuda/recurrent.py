"""The step recurrence, forward and backward: one thread per (head, value column), the state column
in registers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from array_api_compat import array_namespace
from numba import cuda

from .._backend import Gradients
from ._device import INT64, SCALAR, Family, Kernel, constants, inline, offset_functions
from ._launch import (
    THREADS_PER_BLOCK,
    _check_ndim,
    _check_shape,
    _common_dtype,
    _empty,
    _grid,
    _zeros,
    launcher,
)

__all__ = ["recurrent_backward", "recurrent_forward"]


@functools.cache
def _decay_and_predict(dtype: str, index: str) -> Callable:
    """The device function ``decay_and_predict`` of ``dtype`` and ``index``, shared by both recurrence
    kernels."""
    _, _, zero, _ = constants(dtype)
    at2, at3, _ = offset_functions(index)

    @inline
    def decay_and_predict(S, g, k, step, bh, c, K, V):
        """Decay column ``c`` of head ``bh``'s state ``S`` by step ``step``'s ``exp(g)`` in place;
        return the prediction ``k . S`` of the decayed column (one step of the recurrence)."""
        pred = zero
        for kk in range(K):
            tk = at2(step, kk, K)
            kc = at3(bh, kk, c, K, V)
            s = math.exp(g[tk]) * S[kc]
            S[kc] = s
            pred += k[tk] * s
        return pred

    return decay_and_predict


def _recurrent_forward_kernel(dtype: str, index: str) -> Callable:
    """The Python function of ``recurrent_forward`` for ``dtype`` and ``index``."""
    _, _, zero, _ = constants(dtype)
    at2, at3, _ = offset_functions(index)
    decay_and_predict = _decay_and_predict(dtype, index)

    def recurrent_forward(q, k, g, v, beta, scale, state, o, final, dims):
        """One thread per (head, value column v): every column of the state evolves alone.

        ``dims = (BH, T, K, V)``; the arrays are flattened ``[BH, T, K]`` (``q, k, g``),
        ``[BH, T, V]`` (``v, o``), ``[BH, T]`` (``beta``) and ``[BH, K, V]`` (``state, final``).
        """
        idx = cuda.grid(1)
        BH, T, K, V = dims
        bh = idx // V
        if bh >= BH:
            return
        c = idx % V
        for kk in range(K):
            kc = at3(bh, kk, c, K, V)
            final[kc] = state[kc]
        for t in range(T):
            step = at2(bh, t, T)
            pred = decay_and_predict(final, g, k, step, bh, c, K, V)
            u = beta[step] * (v[at2(step, c, V)] - pred)
            out = zero
            for kk in range(K):
                tk = at2(step, kk, K)
                kc = at3(bh, kk, c, K, V)
                s = final[kc] + k[tk] * u
                final[kc] = s
                out += q[tk] * s
            o[at2(step, c, V)] = scale * out

    return recurrent_forward


def _recurrent_backward_kernel(dtype: str, index: str) -> Callable:
    """The Python function of ``recurrent_backward`` for ``dtype`` and ``index``."""
    _, _, zero, _ = constants(dtype)
    at2, at3, at4 = offset_functions(index)
    decay_and_predict = _decay_and_predict(dtype, index)

    def recurrent_backward(
        q, k, g, v, beta, scale, state, do, dfinal, stride, ckpt, seg, dq, dk, dg, dbeta, dv, dS, dims
    ):
        """One thread per (head, value column); reductions over columns by atomics.

        ``dims = (BH, T, K, V)``; the arrays are flattened ``[BH, T, K]`` (``q, k, g, dq, dk,
        dg``), ``[BH, T, V]`` (``v, do, dv``), ``[BH, T]`` (``beta, dbeta``), ``[BH, K, V]``
        (``state, dfinal, dS``) and ``[., BH, K, V]`` (``ckpt, seg``). States are kept every
        ``stride`` steps (``ckpt``) and each segment is recomputed into ``seg`` on the way back.
        ``dq, dk, dg, dbeta`` must be zero on entry.
        """
        idx = cuda.grid(1)
        BH, T, K, V = dims
        bh = idx // V
        if bh >= BH:
            return
        c = idx % V
        # forward, saving checkpoints; dS serves as the running state
        for kk in range(K):
            kc = at3(bh, kk, c, K, V)
            dS[kc] = state[kc]
        for t in range(T):
            step = at2(bh, t, T)
            if t % stride == 0:
                for kk in range(K):
                    ckpt[at4(t // stride, bh, kk, c, BH, K, V)] = dS[at3(bh, kk, c, K, V)]
            pred = decay_and_predict(dS, g, k, step, bh, c, K, V)
            u = beta[step] * (v[at2(step, c, V)] - pred)
            for kk in range(K):
                dS[at3(bh, kk, c, K, V)] += k[at2(step, kk, K)] * u
        for kk in range(K):
            kc = at3(bh, kk, c, K, V)
            dS[kc] = dfinal[kc]
        nseg = (T + stride - 1) // stride
        for sg in range(nseg - 1, -1, -1):
            start = sg * stride
            stop = min(start + stride, T)
            for kk in range(K):
                seg[at4(0, bh, kk, c, BH, K, V)] = ckpt[at4(sg, bh, kk, c, BH, K, V)]
            for t in range(start, stop - 1):
                step = at2(bh, t, T)
                s0 = t - start
                pred = zero
                for kk in range(K):
                    tk = at2(step, kk, K)
                    s = math.exp(g[tk]) * seg[at4(s0, bh, kk, c, BH, K, V)]
                    seg[at4(s0 + 1, bh, kk, c, BH, K, V)] = s
                    pred += k[tk] * s
                u = beta[step] * (v[at2(step, c, V)] - pred)
                for kk in range(K):
                    seg[at4(s0 + 1, bh, kk, c, BH, K, V)] += k[at2(step, kk, K)] * u
            for t in range(stop - 1, start - 1, -1):
                step = at2(bh, t, T)
                s0 = t - start
                pred = zero
                for kk in range(K):
                    tk = at2(step, kk, K)
                    pred += k[tk] * (math.exp(g[tk]) * seg[at4(s0, bh, kk, c, BH, K, V)])
                r = v[at2(step, c, V)] - pred
                b = beta[step]
                u = b * r
                dov = do[at2(step, c, V)]
                du = zero
                for kk in range(K):
                    tk = at2(step, kk, K)
                    kc = at3(bh, kk, c, K, V)
                    sd = math.exp(g[tk]) * seg[at4(s0, bh, kk, c, BH, K, V)]
                    cuda.atomic.add(dq, tk, scale * (sd + k[tk] * u) * dov)
                    ds = dS[kc] + scale * q[tk] * dov
                    dS[kc] = ds
                    du += k[tk] * ds
                cuda.atomic.add(dbeta, step, du * r)
                dr = b * du
                dv[at2(step, c, V)] = dr
                for kk in range(K):
                    tk = at2(step, kk, K)
                    kc = at3(bh, kk, c, K, V)
                    e = math.exp(g[tk])
                    sd = e * seg[at4(s0, bh, kk, c, BH, K, V)]
                    ds = dS[kc]
                    cuda.atomic.add(dk, tk, ds * u - sd * dr)
                    dsd = ds - k[tk] * dr
                    cuda.atomic.add(dg, tk, dsd * sd)
                    dS[kc] = e * dsd

    return recurrent_backward


RECURRENT_FORWARD = Kernel("recurrent_forward", _recurrent_forward_kernel, dims=4, types={"scale": SCALAR})
RECURRENT_BACKWARD = Kernel(
    "recurrent_backward", _recurrent_backward_kernel, dims=4, types={"scale": SCALAR, "stride": INT64}
)
KERNELS = Family("recurrent", (RECURRENT_FORWARD, RECURRENT_BACKWARD))
_launch = launcher(KERNELS)


def _check_recurrent(name: str, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any) -> tuple[int, ...]:
    _check_ndim(name, "q", q, 4)
    _check_ndim(name, "v", v, 4)
    B, H, T, K = q.shape
    V = v.shape[-1]
    _check_shape(name, "k", k, q.shape)
    _check_shape(name, "g", g, q.shape)
    _check_shape(name, "v", v, (B, H, T, V))
    _check_shape(name, "beta", beta, (B, H, T))
    _check_shape(name, "state", state, (B, H, K, V))
    return B, H, T, K, V


def recurrent_forward(
    q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, *, scale: float
) -> tuple[Any, Any]:
    """The recurrence, one kernel looping over every step: ``(output, final_state)``."""
    name = "recurrent_forward"
    xp = array_namespace(q, k, v, g, beta, state)
    dtype = _common_dtype(name, q, k, v, g, beta, state)
    B, H, T, K, V = _check_recurrent(name, q, k, v, g, beta, state)
    BH = B * H
    grid = _grid(BH * V) if K else 0
    o = (_empty if grid else _zeros)(xp, v, (BH, T, V))  # every element written by the kernel
    final = _empty(xp, state, (BH, K, V))
    args = (q, k, g, v, beta, q.dtype.type(scale), state, o, final)
    _launch(RECURRENT_FORWARD, dtype, grid, THREADS_PER_BLOCK, *args, dims=(BH, T, K, V))
    if grid == 0:
        final = xp.asarray(state, copy=True)
    return xp.reshape(o, v.shape), xp.reshape(final, state.shape)


def recurrent_backward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    state: Any,
    grad_output: Any,
    dfinal: Any,
    *,
    scale: float,
) -> Gradients:
    """Gradients of the recurrence, one kernel: ``(dq, dk, dv, dg, dbeta, dinitial)``.

    Keeps ``ceil(sqrt(T))`` checkpoint states and recomputes the steps between them.
    """
    name = "recurrent_backward"
    xp = array_namespace(q, k, v, g, beta, state, grad_output, dfinal)
    dtype = _common_dtype(name, q, k, v, g, beta, state, grad_output, dfinal)
    B, H, T, K, V = _check_recurrent(name, q, k, v, g, beta, state)
    _check_shape(name, "grad_output", grad_output, v.shape)
    _check_shape(name, "dfinal", dfinal, state.shape)
    BH = B * H
    stride = math.isqrt(max(T - 1, 0)) + 1
    nseg = max(-(-T // stride), 1)
    ckpt = _empty(xp, state, (nseg, BH, K, V))
    seg = _empty(xp, state, (stride, BH, K, V))
    dq, dk, dg = (_zeros(xp, q, (BH, T, K)) for _ in range(3))
    dbeta = _zeros(xp, q, (BH, T))
    grid = _grid(BH * V) if K else 0
    dv = (_empty if grid else _zeros)(xp, v, (BH, T, V))  # every element written by the kernel
    dS = _empty(xp, state, (BH, K, V))
    tail = (state, grad_output, dfinal, stride, ckpt, seg)
    outs = (dq, dk, dg, dbeta, dv, dS)
    args = (q, k, g, v, beta, q.dtype.type(scale), *tail, *outs)
    _launch(RECURRENT_BACKWARD, dtype, grid, THREADS_PER_BLOCK, *args, dims=(BH, T, K, V))
    if grid == 0:
        dS = xp.asarray(dfinal, copy=True)
    dq, dk, dg = (xp.reshape(x, q.shape) for x in (dq, dk, dg))
    return Gradients(
        dq=dq,
        dk=dk,
        dv=xp.reshape(dv, v.shape),
        dg=dg,
        dbeta=xp.reshape(dbeta, beta.shape),
        dinitial=xp.reshape(dS, state.shape),
    )
