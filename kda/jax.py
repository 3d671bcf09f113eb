"""JAX adapter with flash-linear-attention 0.6's call signature (``pip install kda[jax]``).

>>> from kda.jax import chunk_kda                                        # doctest: +SKIP
>>> o, _ = jax.jit(chunk_kda)(q, k, v, g, beta)                         # doctest: +SKIP
>>> dq = jax.grad(lambda q: chunk_kda(q, k, v, g, beta)[0].sum())(q)    # doctest: +SKIP

Arrays are time-major as in fla (``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``,
``beta [B, T, HV]``, states ``[N, HV, K, V]``), and the keywords are those of :mod:`kda.torch`.

Each call is a :func:`jax.custom_vjp` whose forward and backward are host callbacks
(:func:`jax.pure_callback`) to kda's NumPy path: :func:`kda.chunk_kda` saves the chunk-start
states and :func:`kda.chunk_kda_backward` uses them. It works under :func:`jax.jit` (the callback is
one opaque operation of the compiled program), :func:`jax.grad` and :func:`jax.vmap` (the callback
runs once per mapped element). Why a callback rather than tracing kda's array-API code with
``jax.numpy``: tracing unrolls every slab of chunks and every step of the state pass into the XLA
program. At ``T = 4096, H = 16, K = V = 128`` XLA took 134 s of CPU time to compile the traced
forward and 292 s for forward+backward, and the compiled program ran no faster than the callback
(``benchmarks/jax_strategy.py``, ``benchmarks/results/jax_strategy.json``); the callback compiles
in under 3 s. Arrays on an accelerator are copied to the host for the callback.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._entry import api as _api
from ._entry.fla import (
    CHUNK_DOC,
    RECURRENT_DOC,
    FlaCall,
    boundary_bound,
    check_gate_sizes,
    core_options,
    fla_function,
    packed_chunks,
    translate,
)
from ._entry.states import backward_with_state_gradients
from ._errors import InvalidInputError, InvalidTypeError

__all__ = ["chunk_kda", "fused_recurrent_kda"]

_GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _compute_dtype(dtype: Any) -> Any:
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _offsets(cu: Any) -> Any:
    return None if cu is None else np.asarray(cu, dtype=np.int64)


def _struct(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


# ----------------------------------------------------------------------------------------------
# Host side: NumPy arrays in, NumPy arrays out


def _host_forward(static: tuple[Any, ...], nt: int, q, k, v, g, beta, s0, A_log, dt_bias, cu):
    method = static[0]
    opts = core_options(*static, _offsets(cu))
    x = [None if a is None else np.asarray(a) for a in (q, k, v, g, beta, s0, A_log, dt_bias)]
    params = dict(initial_state=x[5], A_log=x[6], dt_bias=x[7])
    if method == "chunk":
        out = _api.chunk_kda(*x[:5], save_boundaries=True, **params, **opts)
        saved = np.asarray(out.boundaries)
        if saved.shape[0] < nt:  # packed sequences: pad to the static bound
            pad = np.zeros((nt - saved.shape[0], *saved.shape[1:]), dtype=saved.dtype)
            saved = np.concatenate([saved, pad])
    else:
        out = _api.recurrent_kda(*x[:5], **params, **opts)
        saved = np.zeros((0,), dtype=np.asarray(out.final_state).dtype)
    return np.asarray(out.output), np.asarray(out.final_state), saved


def _host_backward(static: tuple[Any, ...], present: tuple[bool, ...], *arrays):
    q, k, v, g, beta, s0, A_log, dt_bias, cu, saved, do, dfinal, dsaved = (
        None if a is None else np.asarray(a) for a in arrays
    )
    method, chunk_size = static[0], static[2]
    opts = core_options(*static, _offsets(cu))
    params = dict(initial_state=s0, A_log=A_log, dt_bias=dt_bias)
    if method == "chunk":
        nt = saved.shape[0] if cu is None else packed_chunks(cu, chunk_size)
        if dsaved is not None and np.any(dsaved[:nt]):  # the chunk-start states reached the loss
            offsets = opts.pop("cu_seqlens")
            offsets = None if offsets is None else tuple(int(n) for n in offsets)
            grads = backward_with_state_gradients(
                (q, k, v, g, beta), saved[:nt], do, dfinal, dsaved[:nt], s0, offsets,
                {**opts, "A_log": A_log, "dt_bias": dt_bias},
            )  # fmt: skip
        else:
            grads = _api.chunk_kda_backward(q, k, v, g, beta, saved[:nt], do, dfinal, **params, **opts)
    else:
        grads = _api.recurrent_kda_backward(q, k, v, g, beta, do, dfinal, **params, **opts)
    return tuple(np.asarray(gr) for gr, p in zip(grads, present) if p)


# ----------------------------------------------------------------------------------------------
# The differentiable function


def _forward(static: tuple[Any, ...], q, k, v, g, beta, s0, A_log, dt_bias, cu):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu is None else cu.shape[0] - 1
    cd = _compute_dtype(q.dtype)
    nt = boundary_bound(T, static[2], None if cu is None else N) if static[0] == "chunk" else 0
    saved_shape = (nt, B, HV, K, V) if static[0] == "chunk" else (0,)
    shapes = (_struct((B, T, HV, V), q.dtype), _struct((N, HV, K, V), cd), _struct(saved_shape, cd))
    host = functools.partial(_host_forward, static, nt)
    return jax.pure_callback(host, shapes, q, k, v, g, beta, s0, A_log, dt_bias, cu, vmap_method="sequential")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(static: tuple[Any, ...], q, k, v, g, beta, s0, A_log, dt_bias, cu):
    """``(o, final_state, boundaries)``; the boundaries (chunk-start states) are differentiable."""
    return _forward(static, q, k, v, g, beta, s0, A_log, dt_bias, cu)


def _kda_fwd(static: tuple[Any, ...], *args):
    o, final, saved = _forward(static, *args)
    return (o, final, saved), (*args, saved)


def _kda_bwd(static: tuple[Any, ...], res: tuple[Any, ...], cotangents: tuple[Any, Any, Any]):
    inputs, cu, saved = res[:8], res[8], res[9]
    do, dfinal, dsaved = cotangents
    present = tuple(x is not None for x in inputs)
    shapes = tuple(_struct(x.shape, x.dtype) for x in inputs if x is not None)
    host = functools.partial(_host_backward, static, present)
    grads = iter(
        jax.pure_callback(host, shapes, *inputs, cu, saved, do, dfinal, dsaved, vmap_method="sequential")
    )
    return (*(next(grads) if p else None for p in present), None)


_kda.defvjp(_kda_fwd, _kda_bwd)


# ----------------------------------------------------------------------------------------------
# The fla-style functions


def _as_array(name: str, x: Any) -> Any:
    if x is None:
        return None
    if not isinstance(x, (jax.Array, np.ndarray)):
        msg = f"{name} must be a JAX array; got {type(x).__name__}"
        raise InvalidTypeError(msg)
    return jnp.asarray(x)


def _apply(q, k, v, g, beta, s0, A_log, dt_bias, cu, call: FlaCall):
    dtype = q.dtype if call.static[0] == "chunk" else v.dtype  # fused_recurrent_kda: v's, as fla
    k_dtype = k.dtype
    cd = _compute_dtype(q.dtype)
    check_gate_sizes(A_log, dt_bias, call)
    q, k, v, g, beta = (x.astype(cd) if x.dtype != cd else x for x in (q, k, v, g, beta))
    if s0 is not None:
        s0 = (jnp.swapaxes(s0, -1, -2) if call.state_v_first else s0).astype(cd)
    HV, K = call.dt_bias_shape
    if A_log is not None:  # HV elements of any shape (fla's [1, 1, HV, 1]); grad in that shape
        A_log = A_log.reshape(HV).astype(cd)
    if dt_bias is not None:
        dt_bias = dt_bias.reshape(HV, K).astype(cd)
    if cu is not None:
        cu = cu.astype(jnp.int32) if not jnp.issubdtype(cu.dtype, jnp.integer) else cu
    nt = None
    if call.intermediate_states and cu is not None:
        try:
            nt = packed_chunks(np.asarray(cu), call.static[2])
        except jax.errors.TracerArrayConversionError:
            msg = "return_intermediate_states=True with cu_seqlens needs concrete cu_seqlens (not under jit)"
            raise InvalidInputError(msg) from None
    o, final, saved = _kda(call.static, q, k, v, g, beta, s0, A_log, dt_bias, cu)
    o = o.astype(dtype)
    final = (
        (jnp.swapaxes(final, -1, -2) if call.state_v_first else final) if call.output_final_state else None
    )
    if not call.intermediate_states:
        return o, final
    h = jnp.moveaxis(saved if nt is None else saved[:nt], 0, 1)  # [B, NT, HV, K, V]
    return o, final, (jnp.swapaxes(h, -1, -2) if call.state_v_first else h).astype(k_dtype)


def _call(name: str, q, k, v, g, beta, kw: dict[str, Any]):
    arrays = {n: _as_array(n, x) for n, x in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta))}
    extra = {n: _as_array(n, kw.get(n)) for n in ("initial_state", "A_log", "dt_bias", "cu_seqlens")}
    for n in ("q", "k", "v", "g", "beta"):
        if not jnp.issubdtype(arrays[n].dtype, jnp.floating):
            msg = f"{n} must have a real floating dtype; got {arrays[n].dtype}"
            raise InvalidTypeError(msg)
    if kw.get("cp_context") is not None:
        msg = "cp_context (context parallelism over torch.distributed) is supported by kda.torch only"
        raise InvalidInputError(msg)
    call = translate(
        name,
        arrays["q"].shape,
        arrays["v"].shape,
        kw,
        has_A_log=extra["A_log"] is not None,
        has_dt_bias=extra["dt_bias"] is not None,
        has_cu_seqlens=extra["cu_seqlens"] is not None,
    )
    return _apply(*arrays.values(), *extra.values(), call)


def _chunk(q, k, v, g, beta, kw: dict[str, Any]):
    return _call("chunk_kda", q, k, v, g, beta, kw)


def _recurrent(q, k, v, g, beta, kw: dict[str, Any]):
    return _call("fused_recurrent_kda", q, k, v, g, beta, kw)


_JAX_NOTE = """
    On JAX: differentiable (``jax.grad``) and jittable; under :func:`jax.jit` the keywords that
    are not arrays must be static. float64 needs ``jax_enable_x64``.
"""
chunk_kda = fla_function(
    "chunk_kda", _chunk, __name__, CHUNK_DOC.format(array="array", framework="JAX") + _JAX_NOTE
)
fused_recurrent_kda = fla_function("fused_recurrent_kda", _recurrent, __name__, RECURRENT_DOC + _JAX_NOTE)
