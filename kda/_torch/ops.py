"""The ``torch.ops.kda`` custom ops: their schemas, implementations, fake (meta) implementations and
the autograd formula of ``kda::forward``.

``kda::forward`` and ``kda::backward`` are ``torch.library`` custom ops with registered autograd
(``torch.compile`` traces them with ``fullgraph=True``); the inference ops ``kda::decode`` (a state
pool written in place) and ``kda::recurrent_inference`` are declared with ``torch.library.Library``
directly (a cheaper call). Every schema is generated from the records the op carries: the host
arrays (:class:`kda._entry.call.Inputs`: a field with a default may be None) and the options that
are not arrays (:class:`kda._entry.fla.OpOptions`, by their annotations); each implementation reads
its arguments through a record made from its own schema, by name, never by position
(``tests/interior/test_records.py`` ties each op to them). All of them run the host layer shared
with :mod:`kda.jax` (:mod:`kda._entry.host`).
"""

from __future__ import annotations

import collections
import operator
from typing import Any

import torch

from .._entry import host as _host
from .._entry.call import Inputs
from .._entry.fla import OpOptions
from .convert import array, compute_dtype, fresh, offsets, on_stream, pool_array, tensor

__all__ = [
    "BACKWARD_SCHEMA",
    "DECODE_SCHEMA",
    "FORWARD_SCHEMA",
    "RECURRENT_INFERENCE_SCHEMA",
    "BackwardArgs",
    "DecodeArgs",
    "ForwardArgs",
    "RecurrentInferenceArgs",
    "Residuals",
    "decode",
    "forward_op",
    "recurrent_inference",
]

_SCHEMA_TYPES = {"str": "str", "float": "float", "int": "int", "bool": "bool", "float | None": "float?"}


def _input_args() -> str:
    tensors = [f"Tensor{'?' if n in Inputs._field_defaults else ''} {n}" for n in Inputs._fields]
    return ", ".join([*tensors, "Tensor? cu_seqlens"])


def _option_args() -> str:
    hints = {n: getattr(a, "__forward_arg__", a) for n, a in OpOptions.__annotations__.items()}  # as written
    return ", ".join(f"{_SCHEMA_TYPES[hints[n]]} {n}" for n in OpOptions._fields)


_INPUT_ARGS, _OPTION_ARGS = _input_args(), _option_args()
_STEP_ARGS = ", ".join(f"Tensor {n}" for n in Inputs._fields if n not in Inputs._field_defaults)
_INPUTS_OF, _OPTIONS_OF = operator.attrgetter(*Inputs._fields), operator.attrgetter(*OpOptions._fields)


def _arguments(schema: str) -> tuple[str, ...]:
    """The argument names of an op's schema ``(...) -> ...``, in order."""
    inner = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    return tuple(a.split()[-1] for a in inner.split(", "))


def _op_record(name: str, schema: str) -> type:
    """A named tuple of an op's arguments, from its schema: the op's implementation reads them by
    name (``a = Record._make(args)``), never by position."""
    return collections.namedtuple(name, _arguments(schema))


def _inputs(a: Any) -> Inputs:
    """The host tensors of an op's argument record ``a``."""
    return Inputs._make(_INPUTS_OF(a))


def _options(a: Any) -> OpOptions:
    """The options of an op's argument record ``a``."""
    return OpOptions._make(_OPTIONS_OF(a))


def _num_seqs(cu_seqlens: torch.Tensor | None) -> int | None:
    return None if cu_seqlens is None else cu_seqlens.shape[0] - 1


# ----------------------------------------------------------------------------------------------
# kda::forward and kda::backward, with autograd


FORWARD_SCHEMA = f"({_INPUT_ARGS}, {_OPTION_ARGS}) -> (Tensor, Tensor, Tensor)"
ForwardArgs = _op_record("ForwardArgs", FORWARD_SCHEMA)


@torch.library.custom_op("kda::forward", mutates_args=(), schema=FORWARD_SCHEMA)
def forward_op(*args):
    """``(o [B, T, HV, V], final_state [N, HV, K, V], boundaries)`` (:func:`kda._entry.host.forward`)."""
    a = ForwardArgs._make(args)
    inputs, options = _inputs(a), _options(a)
    with on_stream(a.q):
        x = Inputs._make(map(array, inputs))
        o, final, boundaries = _host.forward(options, x, offsets(a.cu_seqlens))
        cd = compute_dtype(a.q.dtype)
        if options.method != "chunk":  # the decode kernel's results: new arrays, no input's memory
            return fresh(o, a.v.dtype), fresh(final, cd), a.q.new_empty((0,), dtype=cd)
        o = tensor(o, a.q.dtype, inputs)
        return o, tensor(final, cd, inputs), tensor(boundaries, cd, inputs)


@forward_op.register_fake
def _forward_fake(*args):
    a = ForwardArgs._make(args)
    options = _options(a)
    o, final, boundaries = _host.shapes(options, tuple(a.q.shape), tuple(a.v.shape), _num_seqs(a.cu_seqlens))
    cd = compute_dtype(a.q.dtype)
    out_dtype = a.q.dtype if options.method == "chunk" else a.v.dtype
    q = a.q
    return q.new_empty(o, dtype=out_dtype), q.new_empty(final, dtype=cd), q.new_empty(boundaries, dtype=cd)


BACKWARD_SCHEMA = (
    f"({_INPUT_ARGS}, Tensor boundaries, Tensor grad_output, Tensor? grad_final_state, "
    f"Tensor? grad_boundaries, {_OPTION_ARGS}) -> Tensor[]"
)
BackwardArgs = _op_record("BackwardArgs", BACKWARD_SCHEMA)


@torch.library.custom_op("kda::backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _backward_op(*args):
    """Gradients of ``q, k, v, g, beta, initial_state, A_log, dt_bias``, each shaped and typed like
    its input; an empty tensor for an input that is None (:func:`kda._entry.host.backward`)."""
    a = BackwardArgs._make(args)
    inputs = _inputs(a)
    with on_stream(a.q):
        x = Inputs._make(map(array, inputs))
        grads = _host.backward(
            _options(a),
            x,
            offsets(a.cu_seqlens),
            array(a.boundaries),
            array(a.grad_output),
            array(a.grad_final_state),
            array(a.grad_boundaries),
        )()
        return [
            a.q.new_empty((0,)) if t is None or gr is None else tensor(gr, t.dtype, inputs)
            for t, gr in zip(inputs, grads)
        ]


@_backward_op.register_fake
def _backward_fake(*args):
    a = BackwardArgs._make(args)
    return [
        a.q.new_empty((0,)) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
        for t in _INPUTS_OF(a)
    ]


# What kda::forward's autograd keeps for the backward, one record: the host tensors (the fields of
# Inputs), the offsets and the forward's boundaries. Saved as the record's fields
# (ctx.save_for_backward(*record)) and read back as the record (Residuals._make(ctx.saved_tensors)).
Residuals = collections.namedtuple("Residuals", (*Inputs._fields, "cu_seqlens", "boundaries"))


def _setup_context(ctx, inputs, output) -> None:
    a = ForwardArgs._make(inputs)
    _, _, boundaries = output
    ctx.save_for_backward(*Residuals(*_INPUTS_OF(a), cu_seqlens=a.cu_seqlens, boundaries=boundaries))
    ctx.options = _options(a)


def _backward(ctx, do, dfinal, dboundaries):
    res = Residuals._make(ctx.saved_tensors)
    x = _inputs(res)
    options = ctx.options
    if do is None:
        dtype = x.q.dtype if options.method == "chunk" else x.v.dtype
        do = x.v.new_zeros(x.v.shape, dtype=dtype)
    args = BackwardArgs(
        **x._asdict(),
        cu_seqlens=res.cu_seqlens,
        boundaries=res.boundaries,
        grad_output=do,
        grad_final_state=dfinal,
        grad_boundaries=dboundaries,
        **options._asdict(),
    )
    grads = _backward_op(*args)  # the op's own record, in its schema's order
    grad = {n: None if t is None else gr for n, t, gr in zip(Inputs._fields, x, grads)}
    # one gradient per argument of kda::forward, by name: none for cu_seqlens and the options
    return tuple(map(grad.get, ForwardArgs._fields))


torch.library.register_autograd("kda::forward", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
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
DecodeArgs = _op_record("DecodeArgs", DECODE_SCHEMA)
RecurrentInferenceArgs = _op_record("RecurrentInferenceArgs", RECURRENT_INFERENCE_SCHEMA)


def _decode_impl(*args):
    """``o [B, T, HV, V]``; the rows of ``state_pool`` the slots name are written in place
    (:func:`kda._entry.host.decode`)."""
    return decode(DecodeArgs._make(args))


def decode(a: Any) -> torch.Tensor:
    """``kda::decode`` on its arguments' record ``a`` (a :data:`DecodeArgs`): the op's
    implementation, which eager inference calls directly."""
    with on_stream(a.q):
        x = Inputs(
            q=array(a.q),
            k=array(a.k),
            v=array(a.v),
            g=array(a.g),
            beta=array(a.beta),
            A_log=array(a.A_log),
            dt_bias=array(a.dt_bias),
        )
        o = _host.decode(
            _options(a),
            x,
            pool_array(a.state_pool),
            array(a.state_indices),
            num_accepted_tokens=array(a.num_accepted_tokens),
            offsets=offsets(a.cu_seqlens),
            v_first=a.state_v_first,
            pad_slot_id=a.pad_slot_id,
        )
        return fresh(o, a.v.dtype)


def _recurrent_inference_impl(*args):
    """``(o [B, T, HV, V], final_state [N, HV, K, V])`` (``[N, HV, V, K]`` with ``state_v_first``)
    of the recurrence without autograd (:func:`kda._entry.host.forward`'s recurrent branch: the
    decode kernel)."""
    a = RecurrentInferenceArgs._make(args)
    return recurrent_inference(_inputs(a), a.cu_seqlens, a.state_v_first, _options(a))


def recurrent_inference(
    inputs: Inputs, cu_seqlens: torch.Tensor | None, state_v_first: bool, options: OpOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda::recurrent_inference`` on its arguments as records (the host tensors, the options):
    the op's implementation, which eager inference calls directly."""
    q = inputs.q
    with on_stream(q):
        x = Inputs._make(map(array, inputs))
        o, final, _ = _host.forward(options, x, offsets(cu_seqlens), state_v_first)
        return fresh(o, inputs.v.dtype), fresh(final, compute_dtype(q.dtype))


for _key in ("CPU", "CUDA"):
    _LIB.impl("decode", _decode_impl, _key)
    _LIB.impl("recurrent_inference", _recurrent_inference_impl, _key)


@torch.library.register_fake("kda::decode", lib=_LIB)
def _decode_fake(*args):
    a = DecodeArgs._make(args)
    return torch.empty_like(a.v, memory_format=torch.contiguous_format)


@torch.library.register_fake("kda::recurrent_inference", lib=_LIB)
def _recurrent_inference_fake(*args):
    a = RecurrentInferenceArgs._make(args)
    o, final, _ = _host.shapes(_options(a), tuple(a.q.shape), tuple(a.v.shape), _num_seqs(a.cu_seqlens))
    if a.state_v_first:
        final = (*final[:2], final[3], final[2])
    return a.q.new_empty(o, dtype=a.v.dtype), a.q.new_empty(final, dtype=compute_dtype(a.q.dtype))
