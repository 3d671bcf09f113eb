"""JAX adapter with flash-linear-attention 0.6's call signature (``pip install kda[jax]``).

>>> from kda.jax import chunk_kda                                        # doctest: +SKIP
>>> o, _ = jax.jit(chunk_kda)(q, k, v, g, beta)                         # doctest: +SKIP
>>> dq = jax.grad(lambda q: chunk_kda(q, k, v, g, beta)[0].sum())(q)    # doctest: +SKIP

Arrays are time-major as in fla (``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``,
``beta [B, T, HV]``, states ``[N, HV, K, V]``), and the keywords are those of :mod:`kda.torch`.

Each call is a :func:`jax.custom_vjp` whose forward and backward are host callbacks
(:func:`jax.pure_callback`) to kda's NumPy path, the host layer shared with :mod:`kda.torch`
(:mod:`kda._entry.host`): the forward validates the call once and saves the chunk-start states;
the backward reuses them and the forward's validated call (the gradients of
:func:`kda.chunk_kda_backward`). It works under :func:`jax.jit` (the callback is
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._entry import host as _host
from ._entry.call import Inputs
from ._entry.fla import CHUNK_KEYWORDS, RECURRENT_KEYWORDS, FlaCall, OpOptions, check_keywords
from ._entry.fla_front import CHUNK_DOC, RECURRENT_DOC
from ._errors import InvalidInputError, InvalidTypeError
from ._options.gates import PARAMETERS
from ._options.packing import check_pad_slot_id, check_pool_dtype, num_chunks

__all__ = ["chunk_kda", "fused_recurrent_kda"]


def _compute_dtype(dtype: Any) -> Any:
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _struct(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


# ----------------------------------------------------------------------------------------------
# The differentiable function: host callbacks to kda._entry.host


def _host_arrays(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(None if a is None else np.asarray(a) for a in arrays)


def _host_offsets(cu: Any) -> tuple[int, ...] | None:
    return None if cu is None else tuple(int(n) for n in np.asarray(cu))


class Residuals(NamedTuple):
    """What the forward keeps for the backward (a pytree): the host arrays, the offsets and the
    forward's boundaries (chunk-start states)."""

    inputs: Inputs
    cu_seqlens: Any
    boundaries: Any


def _host_forward(static: OpOptions, x: Inputs, cu: Any):
    x = Inputs._make(_host_arrays(x))
    return tuple(np.asarray(a) for a in _host.forward(static, x, _host_offsets(cu)))


def _host_backward(static: OpOptions, res: Residuals, do: Any, dfinal: Any, dboundaries: Any):
    x = Inputs._make(_host_arrays(res.inputs))
    boundaries, do, dfinal, dboundaries = _host_arrays((res.boundaries, do, dfinal, dboundaries))
    cu = _host_offsets(res.cu_seqlens)
    grads = _host.backward(static, x, cu, boundaries, do, dfinal, dboundaries)()
    return tuple(np.asarray(gr) for gr, a in zip(grads, x) if a is not None)


def _forward(static: OpOptions, x: Inputs, cu: Any):
    num_seqs = None if cu is None else cu.shape[0] - 1
    o, final, boundaries = _host.shapes(static, x.q.shape, x.v.shape, num_seqs)
    cd = _compute_dtype(x.q.dtype)
    structs = (_struct(o, x.q.dtype), _struct(final, cd), _struct(boundaries, cd))
    host = functools.partial(_host_forward, static)
    return jax.pure_callback(host, structs, x, cu, vmap_method="sequential")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(static: OpOptions, x: Inputs, cu: Any):
    """``(o, final_state, boundaries)``; the boundaries (chunk-start states) are differentiable."""
    return _forward(static, x, cu)


def _kda_fwd(static: OpOptions, x: Inputs, cu: Any):
    o, final, boundaries = _forward(static, x, cu)
    return (o, final, boundaries), Residuals(x, cu, boundaries)


def _kda_bwd(static: OpOptions, res: Residuals, cotangents: tuple[Any, Any, Any]):
    do, dfinal, dboundaries = cotangents
    structs = tuple(_struct(a.shape, a.dtype) for a in res.inputs if a is not None)
    host = functools.partial(_host_backward, static)
    grads = iter(jax.pure_callback(host, structs, res, do, dfinal, dboundaries, vmap_method="sequential"))
    return Inputs._make(None if a is None else next(grads) for a in res.inputs), None


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


def _gate_params(call: FlaCall, A_log: Any, dt_bias: Any, cd: Any) -> tuple[Any, Any]:
    """The gate parameters (each its element count of any shape, fla's ``[1, 1, HV, 1]`` too) in
    their shapes (:data:`~kda._options.gates.PARAMETERS`) and the compute dtype; grads come back in
    the shapes given."""
    HV, K = call.dt_bias_shape
    given = zip(PARAMETERS, (A_log, dt_bias), strict=True)
    A_log, dt_bias = (None if x is None else x.reshape(p.shape(HV, K)).astype(cd) for p, x in given)
    return A_log, dt_bias


def _apply(x: Inputs, cu: Any, call: FlaCall):
    q, k, v, g, beta = x.steps
    s0, A_log, dt_bias = x.initial_state, x.A_log, x.dt_bias
    dtype = q.dtype if call.static.method == "chunk" else v.dtype  # fused_recurrent_kda: v's, as fla
    k_dtype = k.dtype
    cd = _compute_dtype(q.dtype)  # the gate arrays' sizes: checked by _host.route
    q, k, v, g, beta = (a.astype(cd) if a.dtype != cd else a for a in (q, k, v, g, beta))
    if s0 is not None:
        s0 = (jnp.swapaxes(s0, -1, -2) if call.state_v_first else s0).astype(cd)
    A_log, dt_bias = _gate_params(call, A_log, dt_bias, cd)
    if cu is not None:
        cu = cu.astype(jnp.int32) if not jnp.issubdtype(cu.dtype, jnp.integer) else cu
    nt = None
    if call.intermediate_states and cu is not None:
        try:
            nt = num_chunks(call.static.chunk_size, offsets=np.asarray(cu))
        except jax.errors.TracerArrayConversionError:
            msg = "return_intermediate_states=True with cu_seqlens needs concrete cu_seqlens (not under jit)"
            raise InvalidInputError(msg) from None
    x = Inputs(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, A_log=A_log, dt_bias=dt_bias)
    o, final, boundaries = _kda(call.static, x, cu)
    o = o.astype(dtype)
    final = (
        (jnp.swapaxes(final, -1, -2) if call.state_v_first else final) if call.output_final_state else None
    )
    if not call.intermediate_states:
        return o, final
    h = jnp.moveaxis(boundaries if nt is None else boundaries[:nt], 0, 1)  # [B, NT, HV, K, V]
    return o, final, (jnp.swapaxes(h, -1, -2) if call.state_v_first else h).astype(k_dtype)


def _host_decode(static: OpOptions, v_first: bool, pad: int, x: Inputs, pool, indices, accepted, cu):
    x = Inputs._make(_host_arrays(x))
    pool, indices, accepted = _host_arrays((pool, indices, accepted))
    pool = np.array(pool)  # JAX arrays are immutable: the updated pool is a new array
    o = _host.decode(static, x, pool, indices, num_accepted_tokens=accepted, offsets=_host_offsets(cu),
                     v_first=v_first, pad_slot_id=pad)  # fmt: skip
    return np.asarray(o), pool


def _apply_pool(x: Inputs, cu: Any, call: FlaCall, kw: dict[str, Any]):
    """``fused_recurrent_kda(..., initial_state=pool, ssm_state_indices=..., inplace_final_state=True)``
    (vLLM's call), functionally: returns ``(o, new_pool)``, the pool with the slots' rows written
    (a copy of the pool per call: JAX has no in-place update). Not differentiable. A float32,
    float16 or bfloat16 pool for float32 (and 16-bit) inputs: the new pool keeps its dtype (each
    stored state rounded to it), as :func:`kda.decode_kda`. ``x.initial_state`` is the pool."""
    q, k, v, g, beta = x.steps
    pool, A_log, dt_bias = x.initial_state, x.A_log, x.dt_bias
    indices, accepted = (
        _as_array("ssm_state_indices", kw.get("ssm_state_indices")),
        kw.get("num_accepted_tokens"),
    )
    accepted = _as_array("num_accepted_tokens", accepted)
    cd = _compute_dtype(q.dtype)
    check_pool_dtype("initial_state (the state pool)", pool.dtype, cd)
    if indices is None:  # request n continues row n
        N = q.shape[0] if cu is None else cu.shape[0] - 1
        indices = jnp.arange(N, dtype=jnp.int32)
    A_log, dt_bias = _gate_params(call, A_log, dt_bias, cd)
    q, k, v_, g, beta = (a.astype(cd) if a.dtype != cd else a for a in (q, k, v, g, beta))
    pad = check_pad_slot_id(kw.get("pad_slot_id", -1), pool.shape[0])
    structs = (_struct(v.shape, cd), _struct(pool.shape, pool.dtype))  # a 16-bit pool stays 16-bit
    host = functools.partial(_host_decode, call.static, call.state_v_first, pad)  # the pool's own layout
    steps = Inputs(q, k, v_, g, beta, A_log=A_log, dt_bias=dt_bias)
    o, new = jax.pure_callback(host, structs, steps, pool, indices, accepted, cu, vmap_method="sequential")
    return o.astype(v.dtype), new


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
    path, call = _host.route(
        name, arrays["q"].shape, arrays["v"].shape, kw, extra["A_log"], extra["dt_bias"],
        extra["cu_seqlens"] is not None,
    )  # fmt: skip
    x = Inputs(**arrays, initial_state=extra["initial_state"], A_log=extra["A_log"], dt_bias=extra["dt_bias"])
    if path == "pool":
        return _apply_pool(x, extra["cu_seqlens"], call, kw)
    return _apply(x, extra["cu_seqlens"], call)


_JAX_NOTE = """
    On JAX: differentiable (``jax.grad``) and jittable; under :func:`jax.jit` the keywords that
    are not arrays must be static. float64 needs ``jax_enable_x64``.
"""


# fla 0.6's signatures, written out (kda._entry.fla.CHUNK_PARAMS, RECURRENT_PARAMS; held to them by
# tests/entry/test_signatures.py); the docstrings are kda._entry.fla_front's, shared by both adapters
def chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: jax.Array | None = None,
    cu_seqlens_cpu: Any = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> tuple[jax.Array | None, ...]:
    if kwargs:
        check_keywords("chunk_kda", kwargs, CHUNK_KEYWORDS)
    return _call(
        "chunk_kda",
        q,
        k,
        v,
        g,
        beta,
        {
            "scale": scale,
            "initial_state": initial_state,
            "output_final_state": output_final_state,
            "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
            "use_gate_in_kernel": use_gate_in_kernel,
            "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
            "allow_neg_eigval": allow_neg_eigval,
            "safe_gate": safe_gate,
            "lower_bound": lower_bound,
            "disable_recompute": disable_recompute,
            "return_intermediate_states": return_intermediate_states,
            "state_v_first": state_v_first,
            "cu_seqlens": cu_seqlens,
            "cu_seqlens_cpu": cu_seqlens_cpu,
            "cp_context": cp_context,
            "use_graph": use_graph,
            "max_num_seqs": max_num_seqs,
            **kwargs,
        },
    )


chunk_kda.__doc__ = CHUNK_DOC.format(array="array", framework="JAX") + _JAX_NOTE


def fused_recurrent_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: jax.Array | None = None,
    **kwargs: Any,
) -> tuple[jax.Array | None, ...]:
    if kwargs:
        check_keywords("fused_recurrent_kda", kwargs, RECURRENT_KEYWORDS)
    return _call(
        "fused_recurrent_kda",
        q,
        k,
        v,
        g,
        beta,
        {
            "A_log": A_log,
            "dt_bias": dt_bias,
            "scale": scale,
            "initial_state": initial_state,
            "output_final_state": output_final_state,
            "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
            "use_gate_in_kernel": use_gate_in_kernel,
            "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
            "allow_neg_eigval": allow_neg_eigval,
            "lower_bound": lower_bound,
            "state_v_first": state_v_first,
            "cu_seqlens": cu_seqlens,
            **kwargs,
        },
    )


fused_recurrent_kda.__doc__ = RECURRENT_DOC + _JAX_NOTE
