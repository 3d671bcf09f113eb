"""PyTorch autograd adapter with flash-linear-attention 0.6's call signature (``pip install kda[torch]``).

>>> from kda.torch import chunk_kda                                     # doctest: +SKIP
>>> o, state = chunk_kda(q, k, v, g, beta, output_final_state=True)     # doctest: +SKIP
>>> o.sum().backward()                                                  # doctest: +SKIP

Tensors are time-major as in fla: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``,
``beta [B, T, HV]``, states ``[N, HV, K, V]``. Each call is one ``torch.library`` custom op
(``torch.ops.kda.forward``) with a fake (meta) implementation and an autograd formula whose
backward is another custom op (``torch.ops.kda.backward``). Both run the host layer shared with
:mod:`kda.jax` (:mod:`kda._entry.host`): the forward validates the call once and saves the
chunk-start states; the backward reuses them and the forward's validated call (the gradients of
:func:`kda.chunk_kda_backward`, or :func:`kda.recurrent_kda_backward`). ``torch.compile``
therefore traces a model that calls it with ``fullgraph=True``.

Inference (no input needs a gradient) skips autograd: ``fused_recurrent_kda`` then calls
``torch.ops.kda.recurrent_inference``, and the pool form (``ssm_state_indices``, ``num_accepted_tokens``,
``inplace_final_state=True``, as vLLM calls it) ``torch.ops.kda.decode``, which writes the pool in
place (``docs/decode.md``); both are declared with ``torch.library.Library`` (a cheaper call).

CPU tensors reach kda's NumPy path as NumPy views (no copy); CUDA tensors reach the ``cuda``
backend as CuPy arrays through DLPack (no copy), on PyTorch's current stream. float16 and
bfloat16 compute in float32 and return their own dtype. The keywords are fla 0.6's; see
:data:`kda._entry.fla.KEYWORD_TABLE` for what each does here. Unknown keywords raise ``TypeError``.

``return_intermediate_states=True`` also returns the chunk-start states ``h`` (the saved
boundaries, differentiable: :mod:`kda._entry.states`). Context parallelism: :func:`build_cp_context`
and ``chunk_kda(..., cp_context=ctx)`` run one packed sequence batch split over the ranks of a
``torch.distributed`` group (an autograd function around :mod:`kda._entry.cp`; gloo on CPU tensors
is tested, nccl on CUDA tensors is written but has not run; ``docs/context_parallel.md``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.compiler import is_compiling
from torch.utils._python_dispatch import _get_current_dispatch_mode as current_dispatch_mode

from ._entry import cp as _cp
from ._entry import host as _host
from ._entry.call import Inputs
from ._entry.fla import (
    CHUNK_DOC,
    RECURRENT_DOC,
    FlaCall,
    OpOptions,
    chunk_keywords,
    fla_function,
    packed_chunks,
)
from ._errors import InvalidInputError, InvalidTypeError

__all__ = ["KdaCPContext", "build_cp_context", "chunk_kda", "fused_recurrent_kda"]

# The ops' schemas, generated from the records they carry: the host arrays (kda._entry.call.Inputs:
# a field with a default may be None) and the options that are not arrays (kda._entry.fla.OpOptions,
# by their annotations). tests/interior/test_records.py ties each op to them.
_SCHEMA_TYPES = {"str": "str", "float": "float", "int": "int", "bool": "bool", "float | None": "float?"}


def _input_args() -> str:
    tensors = [f"Tensor{'?' if n in Inputs._field_defaults else ''} {n}" for n in Inputs._fields]
    return ", ".join([*tensors, "Tensor? cu_seqlens"])


def _option_args() -> str:
    hints = {n: getattr(a, "__forward_arg__", a) for n, a in OpOptions.__annotations__.items()}  # as written
    return ", ".join(f"{_SCHEMA_TYPES[hints[n]]} {n}" for n in OpOptions._fields)


_INPUT_ARGS, _OPTION_ARGS = _input_args(), _option_args()
_STEP_ARGS = ", ".join(f"Tensor {n}" for n in Inputs._fields if n not in Inputs._field_defaults)
_HALF = (torch.float16, torch.bfloat16)
_INPUTS_OF, _OPTIONS_OF = operator.attrgetter(*Inputs._fields), operator.attrgetter(*OpOptions._fields)


def _arguments(schema: str) -> tuple[str, ...]:
    """The argument names of an op's schema ``(...) -> ...``, in order."""
    inner = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    return tuple(a.split()[-1] for a in inner.split(", "))


def _op_record(name: str, schema: str) -> type:
    """A named tuple of an op's arguments, from its schema: the op's implementation reads them by
    name (``a = Record._make(args)``), never by position."""
    return collections.namedtuple(name, _arguments(schema))


def _split(a: Any) -> tuple[Inputs, OpOptions]:
    """The host arrays and the options of an op's argument record ``a``."""
    return Inputs._make(_INPUTS_OF(a)), OpOptions._make(_OPTIONS_OF(a))


# ----------------------------------------------------------------------------------------------
# Tensors <-> arrays


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_NO_STREAM = contextlib.nullcontext()  # reusable: entering it does nothing


def _on_stream(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """A CUDA tensor: make CuPy's current stream PyTorch's current stream on ``t``'s device; a
    CPU tensor: nothing."""
    return _cuda_stream(t.device) if t.is_cuda else _NO_STREAM


@contextlib.contextmanager
def _cuda_stream(device: torch.device) -> Iterator[None]:
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream, device.index):
        yield


# dtypes a CPU tensor's own NumPy view serves as is (the states and steps; the slot indices)
_VIEWED = (torch.float32, torch.float64, torch.int32, torch.int64)


def _array(t: torch.Tensor | None) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) view of ``t``; half-precision floats as float32 first."""
    if t is None:
        return None
    if t.dtype in _VIEWED and t.is_cpu:
        try:
            return t.numpy()  # the common case, a view; refused if t requires a gradient
        except RuntimeError:
            pass
    t = t.detach()
    if t.dtype in _HALF:
        t = t.float()
    if t.device.type == "cpu":
        return t.resolve_conj().resolve_neg().numpy()
    if t.device.type == "cuda":
        import cupy

        return cupy.from_dlpack(t)
    msg = f"kda.torch runs on CPU and CUDA tensors; got a tensor on {t.device}"
    raise InvalidTypeError(msg)


# id of a bfloat16 pool tensor -> (a weak reference to it, (data_ptr, shape, strides), its
# ml_dtypes view): the view made once per pool tensor, dropped with the tensor
_BF16_VIEWS: dict[int, tuple[Any, tuple, Any]] = {}


def _forget_view(key: int, _ref: Any) -> None:
    _BF16_VIEWS.pop(key, None)


def _pool_array(t: torch.Tensor) -> Any:
    """A view of the state pool ``t`` (updated in place: never a copy), float16 and bfloat16 as
    they are (``ml_dtypes.bfloat16`` on the host)."""
    if t.is_cpu and t.dtype != torch.bfloat16:
        return t.numpy()
    if t.is_cpu:
        try:
            import ml_dtypes
        except ImportError as err:
            msg = (
                "a bfloat16 state pool on the CPU needs ml_dtypes (pip install ml_dtypes): it is read as such"
            )
            raise InvalidTypeError(msg) from err
        key = (t.data_ptr(), t.shape, t.stride())
        seen = _BF16_VIEWS.get(id(t))
        if seen is None or seen[0]() is not t or seen[1] != key:  # torch's view(dtype): ~6 us
            ref = weakref.ref(t, functools.partial(_forget_view, id(t)))
            seen = _BF16_VIEWS[id(t)] = (ref, key, t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
        return seen[2]
    if t.device.type == "cuda":
        if t.dtype == torch.bfloat16:
            msg = "a bfloat16 state pool on CUDA is not supported (CuPy has no bfloat16); use float16"
            raise InvalidTypeError(msg)
        import cupy

        return cupy.from_dlpack(t)
    msg = f"kda.torch runs on CPU and CUDA tensors; got a tensor on {t.device}"
    raise InvalidTypeError(msg)


def _tensor(a: Any, dtype: torch.dtype, inputs: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """``a`` as a contiguous tensor of ``dtype`` that shares no memory with ``inputs``."""
    if isinstance(a, np.ndarray):  # NumPy's copy: torch's parallel one costs ms on small arrays
        t = torch.from_numpy(a if a.flags.writeable and a.flags.c_contiguous else np.array(a, order="C"))
    else:
        t = torch.from_dlpack(a)
    t = t.to(dtype).contiguous()
    owners = {x.untyped_storage().data_ptr() for x in inputs if x is not None}
    return t.clone() if t.untyped_storage().data_ptr() in owners else t


def _fresh(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """``a``, a new array of this call (it shares no input's memory), as a contiguous tensor of
    ``dtype``: no copy where it already is one."""
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _offsets(cu_seqlens: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if cu_seqlens is None else tuple(int(n) for n in cu_seqlens.tolist())


# ----------------------------------------------------------------------------------------------
# The custom ops


FORWARD_SCHEMA = f"({_INPUT_ARGS}, {_OPTION_ARGS}) -> (Tensor, Tensor, Tensor)"
_ForwardArgs = _op_record("ForwardArgs", FORWARD_SCHEMA)


@torch.library.custom_op("kda::forward", mutates_args=(), schema=FORWARD_SCHEMA)
def _forward_op(*args):
    """``(o [B, T, HV, V], final_state [N, HV, K, V], boundaries)`` (:func:`kda._entry.host.forward`)."""
    a = _ForwardArgs._make(args)
    inputs, options = _split(a)
    with _on_stream(a.q):
        x = Inputs._make(map(_array, inputs))
        o, final, boundaries = _host.forward(options, x, _offsets(a.cu_seqlens))
        cd = _compute_dtype(a.q.dtype)
        if options.method != "chunk":  # the decode kernel's results: new arrays, no input's memory
            return _fresh(o, a.v.dtype), _fresh(final, cd), a.q.new_empty((0,), dtype=cd)
        o = _tensor(o, a.q.dtype, inputs)
        return o, _tensor(final, cd, inputs), _tensor(boundaries, cd, inputs)


# The inference ops (no autograd): registered with torch.library.Library directly. Measured:
# calling a torch.library.custom_op costs tens of microseconds of Python (its aliasing checks and
# wrappers), a Library-registered op about 3 us, and a decode step is a few tens of microseconds.
_LIB = torch.library.Library("kda", "FRAGMENT")
DECODE_SCHEMA = (
    f"({_STEP_ARGS}, Tensor(a!) state_pool, Tensor state_indices, Tensor? num_accepted_tokens, "
    f"Tensor? A_log, Tensor? dt_bias, Tensor? cu_seqlens, bool state_v_first, int pad_slot_id, "
    f"{_OPTION_ARGS}) -> Tensor"
)
RECURRENT_INFERENCE_SCHEMA = f"({_INPUT_ARGS}, bool state_v_first, {_OPTION_ARGS}) -> (Tensor, Tensor)"
_LIB.define("decode" + DECODE_SCHEMA)
_LIB.define("recurrent_inference" + RECURRENT_INFERENCE_SCHEMA)
_DecodeArgs = _op_record("DecodeArgs", DECODE_SCHEMA)
_RecurrentInferenceArgs = _op_record("RecurrentInferenceArgs", RECURRENT_INFERENCE_SCHEMA)


def _decode_impl(*args):
    """``o [B, T, HV, V]``; the rows of ``state_pool`` the slots name are written in place
    (:func:`kda._entry.host.decode`)."""
    return _decode(_DecodeArgs._make(args))


def _decode(a: Any) -> torch.Tensor:
    """:func:`_decode_impl` on its arguments' record."""
    with _on_stream(a.q):
        x = Inputs(
            *map(_array, (a.q, a.k, a.v, a.g, a.beta)), A_log=_array(a.A_log), dt_bias=_array(a.dt_bias)
        )
        o = _host.decode(
            OpOptions._make(_OPTIONS_OF(a)), x, _pool_array(a.state_pool), _array(a.state_indices),
            num_accepted_tokens=_array(a.num_accepted_tokens), offsets=_offsets(a.cu_seqlens),
            v_first=a.state_v_first, pad_slot_id=a.pad_slot_id,
        )  # fmt: skip
        return _fresh(o, a.v.dtype)


def _recurrent_inference_impl(*args):
    """``(o [B, T, HV, V], final_state [N, HV, K, V])`` (``[N, HV, V, K]`` with ``state_v_first``)
    of the recurrence without autograd (:func:`kda._entry.host.forward`'s recurrent branch: the
    decode kernel)."""
    a = _RecurrentInferenceArgs._make(args)
    inputs, options = _split(a)
    with _on_stream(a.q):
        x = Inputs._make(map(_array, inputs))
        o, final, _ = _host.forward(options, x, _offsets(a.cu_seqlens), a.state_v_first)
        return _fresh(o, a.v.dtype), _fresh(final, _compute_dtype(a.q.dtype))


for _key in ("CPU", "CUDA"):
    _LIB.impl("decode", _decode_impl, _key)
    _LIB.impl("recurrent_inference", _recurrent_inference_impl, _key)


@torch.library.register_fake("kda::decode", lib=_LIB)
def _decode_fake(*args):
    a = _DecodeArgs._make(args)
    return torch.empty_like(a.v, memory_format=torch.contiguous_format)


@torch.library.register_fake("kda::recurrent_inference", lib=_LIB)
def _recurrent_inference_fake(*args):
    a = _RecurrentInferenceArgs._make(args)
    num_seqs = None if a.cu_seqlens is None else a.cu_seqlens.shape[0] - 1
    options = OpOptions._make(_OPTIONS_OF(a))
    o, final, _ = _host.shapes(options, tuple(a.q.shape), tuple(a.v.shape), num_seqs)
    if a.state_v_first:
        final = (*final[:2], final[3], final[2])
    return a.q.new_empty(o, dtype=a.v.dtype), a.q.new_empty(final, dtype=_compute_dtype(a.q.dtype))


@_forward_op.register_fake
def _forward_fake(*args):
    a = _ForwardArgs._make(args)
    options = OpOptions._make(_OPTIONS_OF(a))
    num_seqs = None if a.cu_seqlens is None else a.cu_seqlens.shape[0] - 1
    o, final, boundaries = _host.shapes(options, tuple(a.q.shape), tuple(a.v.shape), num_seqs)
    cd = _compute_dtype(a.q.dtype)
    out_dtype = a.q.dtype if options.method == "chunk" else a.v.dtype
    q = a.q
    return q.new_empty(o, dtype=out_dtype), q.new_empty(final, dtype=cd), q.new_empty(boundaries, dtype=cd)


BACKWARD_SCHEMA = (
    f"({_INPUT_ARGS}, Tensor boundaries, Tensor grad_output, Tensor? grad_final_state, "
    f"Tensor? grad_boundaries, {_OPTION_ARGS}) -> Tensor[]"
)
_BackwardArgs = _op_record("BackwardArgs", BACKWARD_SCHEMA)


@torch.library.custom_op("kda::backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _backward_op(*args):
    """Gradients of ``q, k, v, g, beta, initial_state, A_log, dt_bias``, each shaped and typed like
    its input; an empty tensor for an input that is None (:func:`kda._entry.host.backward`)."""
    a = _BackwardArgs._make(args)
    inputs, options = _split(a)
    with _on_stream(a.q):
        x = Inputs._make(map(_array, inputs))
        cotangents = (_array(a.grad_output), _array(a.grad_final_state), _array(a.grad_boundaries))
        grads = _host.backward(options, x, _offsets(a.cu_seqlens), _array(a.boundaries), *cotangents)()
        return [
            a.q.new_empty((0,)) if t is None or gr is None else _tensor(gr, t.dtype, inputs)
            for t, gr in zip(inputs, grads)
        ]


@_backward_op.register_fake
def _backward_fake(*args):
    a = _BackwardArgs._make(args)
    return [
        a.q.new_empty((0,)) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
        for t in _INPUTS_OF(a)
    ]


def _setup_context(ctx, inputs, output) -> None:
    a = _ForwardArgs._make(inputs)
    _, _, boundaries = output
    ctx.save_for_backward(*_INPUTS_OF(a), a.cu_seqlens, boundaries)
    ctx.options = OpOptions._make(_OPTIONS_OF(a))


def _backward(ctx, do, dfinal, dboundaries):
    *arrays, cu_seqlens, boundaries = ctx.saved_tensors
    x = Inputs._make(arrays)
    if do is None:
        dtype = x.q.dtype if ctx.options.method == "chunk" else x.v.dtype
        do = x.v.new_zeros(x.v.shape, dtype=dtype)
    grads = _backward_op(*x, cu_seqlens, boundaries, do, dfinal, dboundaries, *ctx.options)
    tensor_grads = [None if t is None else gr for t, gr in zip(x, grads)]
    return (*tensor_grads, None, *(None for _ in ctx.options))  # (cu_seqlens and the options: none)


torch.library.register_autograd("kda::forward", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# The fla-style functions


def _check_tensors(**tensors: Any) -> None:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            msg = f"{name} must be a torch.Tensor; got {type(t).__name__}"
            raise InvalidTypeError(msg)


def _gate_params(call: FlaCall, A_log: Any, dt_bias: Any, cd: torch.dtype) -> tuple[Any, Any]:
    """``A_log`` (``HV`` elements, as ``[HV]``) and ``dt_bias`` (``HV * K`` elements, as
    ``[HV, K]``) in the compute dtype; reshapes, so autograd returns their gradients in the
    shapes given."""
    if A_log is None and dt_bias is None:
        return None, None  # (their element counts: checked by kda._entry.host.route)
    HV, K = call.dt_bias_shape
    A_log = None if A_log is None else A_log.reshape(HV).to(cd)
    dt_bias = None if dt_bias is None else dt_bias.reshape(HV, K).to(cd)
    return A_log, dt_bias


def _eager(q: torch.Tensor, tensors: tuple[Any, ...]) -> bool:
    """Whether an inference op may run its implementation directly: plain CPU / CUDA tensors, not
    under ``torch.compile`` (nor export), a dispatch mode (fake tensors, ``make_fx``) or a torch
    function mode, which must see the op. Calling the op costs its dispatch (about 20 us on a
    2-core AMD EPYC, against a 25 us decode step at H = 4)."""
    if is_compiling() or current_dispatch_mode() is not None or torch._C._is_torch_function_mode_enabled():
        return False
    if not (q.is_cpu or q.is_cuda):
        return False
    tt = torch.Tensor
    return all(t is None or type(t) is tt for t in tensors)


def _needs_grad(tensors: tuple[Any, ...]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _apply(x: Inputs, cu_seqlens: Any, call: FlaCall):
    """``chunk_kda`` / ``fused_recurrent_kda`` on the tensors ``x`` (the plain forward)."""
    q, k = x.q, x.k
    cd = _compute_dtype(q.dtype)
    A_log, dt_bias = _gate_params(call, x.A_log, x.dt_bias, cd)
    initial_state = x.initial_state
    if initial_state is not None and initial_state.dtype != cd:
        initial_state = initial_state.to(cd)
    if cu_seqlens is not None:
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    inputs = x._replace(initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    if call.static.method != "chunk" and not _needs_grad(inputs):
        # inference: the decode kernel, no autograd node; a V-major state read and written as such
        args = (*inputs, cu_seqlens, call.state_v_first, *call.static)
        direct = _eager(inputs.q, inputs)
        o, final = _recurrent_inference_impl(*args) if direct else torch.ops.kda.recurrent_inference(*args)
        return o, (final if call.output_final_state else None)
    if initial_state is not None and call.state_v_first:
        inputs = inputs._replace(initial_state=initial_state.transpose(-1, -2))
    o, final, boundaries = _forward_op(*inputs, cu_seqlens, *call.static)
    final = (
        None if not call.output_final_state else (final.transpose(-1, -2) if call.state_v_first else final)
    )
    if not call.intermediate_states:
        return o, final
    chunk_size = call.static.chunk_size
    NT = boundaries.shape[0] if cu_seqlens is None else packed_chunks(_offsets(cu_seqlens), chunk_size)
    h = boundaries[:NT].movedim(0, 1)  # [B, NT, HV, K, V]
    h = (h.transpose(-1, -2) if call.state_v_first else h).to(k.dtype)
    return o, final, h


def _apply_pool(x: Inputs, cu_seqlens: Any, call: FlaCall, kw: dict[str, Any]):
    """``fused_recurrent_kda(..., initial_state=pool, ssm_state_indices=..., num_accepted_tokens=...,
    inplace_final_state=True)`` as vLLM calls it (``x.initial_state`` the pool): the pool updated in
    place, returned as the final state."""
    q, k, v, g, beta = x.steps
    pool, A_log, dt_bias = x.initial_state, x.A_log, x.dt_bias
    indices, accepted = kw.get("ssm_state_indices"), kw.get("num_accepted_tokens")
    _check_tensors(ssm_state_indices=indices, num_accepted_tokens=accepted)
    if _needs_grad((q, k, v, g, beta, pool, A_log, dt_bias)):
        msg = (
            "decoding from a state pool (inplace_final_state=True) is inference only: no input may "
            "require a gradient"
        )
        raise InvalidInputError(msg)
    cd = _compute_dtype(q.dtype)
    if pool.dtype != cd and not (cd == torch.float32 and pool.dtype in _HALF):
        want = cd if cd == torch.float64 else "torch.float32, torch.float16 or torch.bfloat16"
        msg = f"initial_state (the state pool, updated in place) must have dtype {want}; got {pool.dtype}"
        raise InvalidTypeError(msg)
    pad = kw.get("pad_slot_id", -1)
    if isinstance(pad, torch.Tensor) or isinstance(pad, bool) or not isinstance(pad, int):
        msg = f"pad_slot_id must be an int (-1, or a pool row reserved for padding); got {type(pad).__name__}"
        raise InvalidTypeError(msg)
    if cu_seqlens is not None:
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    if indices is None:  # request n continues row n
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        indices = torch.arange(N, dtype=torch.int64)
    A_log, dt_bias = _gate_params(call, A_log, dt_bias, cd)
    args = _DecodeArgs(
        q=q, k=k, v=v, g=g, beta=beta, state_pool=pool, state_indices=indices, num_accepted_tokens=accepted,
        A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, state_v_first=call.state_v_first,
        pad_slot_id=pad, **call.static._asdict(),
    )  # fmt: skip
    # in eager inference mode (no version counters) the implementation directly: the op's
    # dispatch costs more than a small step; elsewhere the mutating op, which torch sees (the
    # compile check first: dynamo does not trace is_inference_mode_enabled)
    direct = _eager(q, (q, k, v, g, beta, pool, indices, accepted)) and torch.is_inference_mode_enabled()
    o = _decode(args) if direct else torch.ops.kda.decode(*args)
    return o, pool


def _chunk(q, k, v, g, beta, kw: dict[str, Any]):
    return _call("chunk", q, k, v, g, beta, kw)


def _recurrent(q, k, v, g, beta, kw: dict[str, Any]):
    return _call("recurrent", q, k, v, g, beta, kw)


chunk_kda = fla_function("chunk_kda", _chunk, __name__, CHUNK_DOC.format(array="Tensor", framework="PyTorch"))
fused_recurrent_kda = fla_function("fused_recurrent_kda", _recurrent, __name__, RECURRENT_DOC)


def _call(method: str, q, k, v, g, beta, kw: dict[str, Any]):
    A_log, dt_bias, cu = kw.get("A_log"), kw.get("dt_bias"), kw.get("cu_seqlens")
    s0 = kw.get("initial_state")
    tt = torch.Tensor  # the common call, plain tensors, in a few identity tests
    if not (type(q) is tt and type(k) is tt and type(v) is tt and type(g) is tt and type(beta) is tt
            and (s0 is None or type(s0) is tt) and A_log is None and dt_bias is None):  # fmt: skip
        _check_tensors(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, A_log=A_log, dt_bias=dt_bias)
    name = "chunk_kda" if method == "chunk" else "fused_recurrent_kda"
    ctx = kw.get("cp_context") if method == "chunk" else None
    if ctx is not None:
        if not isinstance(ctx, KdaCPContext):
            msg = f"cp_context must come from kda.torch.build_cp_context; got {type(ctx).__name__}"
            raise InvalidTypeError(msg)
        if kw.get("return_intermediate_states", False):
            msg = "return_intermediate_states=True is not supported with cp_context"
            raise InvalidInputError(msg)
        cu = ctx.cu_seqlens  # as fla: the context's rank-local offsets replace cu_seqlens
    path, call = _host.route(
        name, tuple(q.shape), tuple(v.shape), kw, A_log, dt_bias, cu is not None, cp=ctx is not None
    )
    x = Inputs(q, k, v, g, beta, initial_state=s0, A_log=A_log, dt_bias=dt_bias)
    if path == "cp":
        return _apply_cp(x, ctx, call)
    if path == "pool":
        return _apply_pool(x, cu, call, kw)
    return _apply(x, cu, call)


# ----------------------------------------------------------------------------------------------
# Context parallelism over torch.distributed


@dataclass
class KdaCPContext:
    """One rank's share of a packed ``B == 1`` batch cut into equal contiguous slices (fla's
    ``FLACPContext`` fields, plus kda's partition).

    Attributes
    ----------
    group : ProcessGroup or None
        The ranks sharing the sequence (None: the default group).
    cu_seqlens, cu_seqlens_cpu : Tensor, shape ``[N_local + 1]``
        This rank's local offsets (int32; on the device of the ``cu_seqlens`` given, and on the CPU).
    is_first_rank, is_last_rank : bool
        Whether this rank holds the first (last) token of its first (last) local sequence.
    pre_num_ranks, post_num_ranks : int
        Earlier (later) ranks holding part of this rank's first (last) local sequence.
    conv1d_kernel_size, pre_num_conv_tokens : int or None, int
        As fla (for a short convolution's halo; kda does not use them).
    partition : kda._entry.cp.Partition
        The global offsets and which ranks hold which sequence.
    """

    group: Any
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    is_first_rank: bool
    is_last_rank: bool
    pre_num_ranks: int
    post_num_ranks: int
    conv1d_kernel_size: int | None
    pre_num_conv_tokens: int
    partition: _cp.Partition

    @property
    def num_seqs(self) -> int:
        """Local sequences."""
        return len(self.partition.local_seqs)

    @property
    def is_cp_enabled(self) -> bool:
        return True

    def copy_for_backward(self) -> KdaCPContext:
        """A copy with its own offset tensors (as fla's)."""
        return replace(self, cu_seqlens=self.cu_seqlens.clone(), cu_seqlens_cpu=self.cu_seqlens_cpu.clone())


def build_cp_context(
    cu_seqlens: torch.Tensor,
    group: Any,
    conv1d_kernel_size: int | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> KdaCPContext:
    """This rank's context for ``chunk_kda(..., cp_context=ctx)`` (fla's ``build_cp_context``).

    Parameters
    ----------
    cu_seqlens : Tensor, shape ``[N + 1]``
        Global offsets of the packed batch; its total ``T`` must be a positive multiple of the
        group's size ``W``. Rank ``r`` holds tokens ``r T / W`` to ``(r + 1) T / W``.
    group : ProcessGroup or None
        ``torch.distributed`` group of the ranks (None: the default group); the process group must
        be initialised.
    conv1d_kernel_size : int, optional
        Recorded (with ``pre_num_conv_tokens``) for a short convolution's halo, as fla.
    cu_seqlens_cpu : Tensor, optional
        A host copy of ``cu_seqlens`` (read instead of copying ``cu_seqlens`` to the host).

    Returns
    -------
    KdaCPContext
        Every rank must call with the same ``cu_seqlens``.
    """
    import torch.distributed as dist

    if not isinstance(cu_seqlens, torch.Tensor):
        msg = f"cu_seqlens must be a torch.Tensor; got {type(cu_seqlens).__name__}"
        raise InvalidTypeError(msg)
    if not dist.is_available() or not dist.is_initialized():
        msg = "build_cp_context needs an initialised torch.distributed process group (group)"
        raise InvalidInputError(msg)
    host = cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu
    if host.dtype.is_floating_point or host.dtype.is_complex or host.dtype == torch.bool or host.ndim != 1:
        msg = f"cu_seqlens must be a 1-D integer tensor; got {host.dtype} of shape {tuple(host.shape)}"
        raise InvalidTypeError(msg)
    p = _cp.partition(host.tolist(), dist.get_world_size(group), dist.get_rank(group))
    local_cpu = torch.tensor(p.local_offsets, dtype=torch.int32)
    return KdaCPContext(
        group=group,
        cu_seqlens=local_cpu.to(cu_seqlens.device),
        cu_seqlens_cpu=local_cpu,
        is_first_rank=p.pre_num_ranks == 0,
        is_last_rank=p.post_num_ranks == 0,
        pre_num_ranks=p.pre_num_ranks,
        post_num_ranks=p.post_num_ranks,
        conv1d_kernel_size=conv1d_kernel_size,
        pre_num_conv_tokens=p.pre_num_conv_tokens,
        partition=p,
    )


def _all_gather(a: Any, group: Any, like: torch.Tensor) -> Any:
    """``[W, ...]``: every rank's ``a`` (an array), through ``torch.distributed.all_gather``."""
    import torch.distributed as dist

    t = _tensor(a, _compute_dtype(like.dtype), ())
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return _array(torch.stack(out))


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    t = t.contiguous()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class _ContextParallel(torch.autograd.Function):
    """``chunk_kda`` on this rank's slice with the true start states (``kda/_entry/cp.py``):
    one all-gather of ``[HV, K, K + V]`` maps per direction (none when no sequence crosses a rank
    boundary), plus one all-reduce of ``[N, HV, K, V]`` final states (and of their gradients)
    with ``output_final_state``."""

    @staticmethod
    def forward(ctx, cp_ctx: KdaCPContext, static: tuple, want_final: bool, *tensors: Any):
        """``tensors``: the fields of :class:`~kda._entry.call.Inputs` (each its own autograd input)."""
        p, group = cp_ctx.partition, cp_ctx.group
        inputs = Inputs._make(tensors)
        q, v = inputs.q, inputs.v
        cd = _compute_dtype(q.dtype)
        with _on_stream(q):
            x = Inputs._make(map(_array, inputs))
            rank = _cp.open_rank(p, x, chunk_keywords(static, x.A_log, x.dt_bias))  # validated once
            xp, adt = _namespace(x.v), x.v.dtype
            shape = (v.shape[2], q.shape[3], v.shape[3])
            own = _cp.forward_map(p, x, rank, adt)
            maps = _all_gather(own, group, q) if p.crossing else None
            starts = _cp.start_states(p, maps, x.initial_state, shape, adt, xp)
            out = _cp.forward_local(p, x, starts, rank)
            o = _tensor(out.output, q.dtype, inputs)
            if want_final:
                share = _cp.final_state_share(p, out.final_state, x.initial_state, xp)
                final = _all_reduce(_tensor(share, cd, inputs), group)
            else:
                final = q.new_empty((0,), dtype=cd)
            kept = [_tensor(a, cd, inputs) for a in (own, starts, out.boundaries)]
        ctx.save_for_backward(*inputs, *kept)
        ctx.cp_ctx, ctx.rank_call, ctx.want_final = cp_ctx, rank.call, want_final
        if not want_final:
            ctx.mark_non_differentiable(final)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        p, group = ctx.cp_ctx.partition, ctx.cp_ctx.group
        *saved, own, starts, boundaries = ctx.saved_tensors
        inputs = Inputs._make(saved)
        q, v = inputs.q, inputs.v
        if do is None:
            do = torch.zeros_like(v, dtype=q.dtype)
        if ctx.want_final:
            if dfinal is None:
                dfinal = starts.new_zeros((p.num_seqs, *starts.shape[1:]))
            dfinal = _all_reduce(dfinal.to(starts.dtype).clone(), group)
        with _on_stream(q):
            x = Inputs._make(map(_array, inputs))
            rank = _cp.Rank(ctx.rank_call, x)  # the forward's validated call: nothing checked again
            xp, adt = _namespace(x.v), x.v.dtype
            shape = (v.shape[2], q.shape[3], v.shape[3])
            do_ = _array(do)
            dfinal_ = _array(dfinal) if ctx.want_final else None
            ctx.rank_call.check_finite(grad_output=do_, grad_final_state=dfinal_)  # the cotangents, once
            own_, starts_ = _array(own), _array(starts)
            mine = _cp.backward_map(p, x, do_, rank, adt, own_map=own_)
            maps = _all_gather(mine, group, q) if p.crossing else None
            dends = _cp.end_gradients(p, maps, dfinal_, shape, adt, xp)
            grads = _cp.backward_local(p, x, starts_, _array(boundaries), do_, dends, rank, dfinal_)
            out = [
                None if t is None or gr is None else _tensor(gr, t.dtype, inputs)
                for t, gr in zip(inputs, grads)
            ]
        return (None, None, None, *out)


def _namespace(a: Any) -> Any:
    import array_api_compat

    return array_api_compat.array_namespace(a)


def _apply_cp(x: Inputs, cp_ctx: KdaCPContext, call: FlaCall):
    """``chunk_kda`` with ``cp_context``: the rank's slice ``[1, T / W, ...]``; ``initial_state``
    the global ``[N, HV, K, V]`` (the same on every rank); returns the global final states."""
    q, initial_state = x.q, x.initial_state
    p = cp_ctx.partition
    if q.shape[0] != 1 or q.shape[1] != p.part_len:
        msg = (
            f"q: with cp_context each rank passes its slice [1, T / W, H, K] = [1, {p.part_len}, ...] "
            f"of the packed batch; got shape {tuple(q.shape)}"
        )
        raise InvalidInputError(msg)
    cd = _compute_dtype(q.dtype)
    A_log, dt_bias = _gate_params(call, x.A_log, x.dt_bias, cd)
    if initial_state is not None:
        if initial_state.ndim != 4 or initial_state.shape[0] != p.num_seqs:
            msg = (
                f"initial_state: with cp_context every rank passes the global [N, HV, K, V] states "
                f"(N = {p.num_seqs}); got shape {tuple(initial_state.shape)}"
            )
            raise InvalidInputError(msg)
        initial_state = (initial_state.transpose(-1, -2) if call.state_v_first else initial_state).to(cd)
    tensors = x._replace(initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    o, final = _ContextParallel.apply(cp_ctx, call.static, call.output_final_state, *tensors)
    if not call.output_final_state:
        return o, None
    return o, (final.transpose(-1, -2) if call.state_v_first else final)
