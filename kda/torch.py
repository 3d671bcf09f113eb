"""PyTorch autograd adapter with flash-linear-attention 0.6's call signature (``pip install kda[torch]``).

>>> from kda.torch import chunk_kda                                     # doctest: +SKIP
>>> o, state = chunk_kda(q, k, v, g, beta, output_final_state=True)     # doctest: +SKIP
>>> o.sum().backward()                                                  # doctest: +SKIP

Tensors are time-major as in fla: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``,
``beta [B, T, HV]``, states ``[N, HV, K, V]``. Each call is one ``torch.library`` custom op
(``torch.ops.kda.forward``) with a fake (meta) implementation and an autograd formula whose
backward is another custom op (``torch.ops.kda.backward``): :func:`kda.chunk_kda_backward` with the
chunk-start states saved by the forward, or :func:`kda.recurrent_kda_backward`. ``torch.compile``
therefore traces a model that calls it with ``fullgraph=True``.

CPU tensors reach kda's NumPy path as NumPy views (no copy); CUDA tensors reach the ``cuda``
backend as CuPy arrays through DLPack (no copy), on PyTorch's current stream. float16 and
bfloat16 compute in float32 and return their own dtype. The keywords are fla 0.6's; see
:data:`kda._entry.fla.KEYWORD_TABLE` for what each does here. Unknown keywords raise ``TypeError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ._entry import api as _api
from ._entry.fla import (
    CHUNK_DOC,
    RECURRENT_DOC,
    FlaCall,
    boundary_bound,
    core_options,
    fla_function,
    packed_chunks,
    translate,
)
from ._errors import InvalidInputError, InvalidTypeError

__all__ = ["chunk_kda", "fused_recurrent_kda"]

_OPTION_ARGS = (
    "str method, float scale, int chunk_size, bool qk_l2norm, str gate, float? lower_bound, "
    "str beta_activation"
)
_INPUT_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state, Tensor? A_log, "
    "Tensor? dt_bias, Tensor? cu_seqlens"
)
_HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Tensors <-> arrays


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@contextlib.contextmanager
def _on_stream(device: torch.device) -> Iterator[None]:
    """CUDA: make CuPy's current stream PyTorch's current stream on ``device``; CPU: nothing."""
    if device.type != "cuda":
        yield
        return
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream, device.index):
        yield


def _array(t: torch.Tensor | None) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) view of ``t``; half-precision floats as float32 first."""
    if t is None:
        return None
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


def _tensor(a: Any, dtype: torch.dtype, inputs: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """``a`` as a contiguous tensor of ``dtype`` that shares no memory with ``inputs``."""
    if isinstance(a, np.ndarray):
        t = torch.from_numpy(a if a.flags.writeable else a.copy())
    else:
        t = torch.from_dlpack(a)
    t = t.to(dtype).contiguous()
    owners = {x.untyped_storage().data_ptr() for x in inputs if x is not None}
    return t.clone() if t.untyped_storage().data_ptr() in owners else t


def _offsets(cu_seqlens: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if cu_seqlens is None else tuple(int(n) for n in cu_seqlens.tolist())


def _num_boundaries(T: Any, chunk_size: int, cu_seqlens: torch.Tensor | None) -> Any:
    return boundary_bound(T, chunk_size, None if cu_seqlens is None else cu_seqlens.shape[0] - 1)


# ----------------------------------------------------------------------------------------------
# The custom ops


@torch.library.custom_op(
    "kda::forward", mutates_args=(), schema=f"({_INPUT_ARGS}, {_OPTION_ARGS}) -> (Tensor, Tensor, Tensor)"
)
def _forward_op(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, *options):
    """``(o [B, T, HV, V], final_state [N, HV, K, V], boundaries)``; boundaries are ``[0]`` for the
    recurrence and padded to :func:`_num_boundaries` chunks for ``cu_seqlens``."""
    method, _, chunk_size = options[:3]
    inputs = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    opts = core_options(*options, _offsets(cu_seqlens))
    with _on_stream(q.device):
        x = [_array(t) for t in inputs]
        if method == "chunk":
            out = _api.chunk_kda(
                *x[:5], initial_state=x[5], A_log=x[6], dt_bias=x[7], save_boundaries=True, **opts
            )
        else:
            out = _api.recurrent_kda(*x[:5], initial_state=x[5], A_log=x[6], dt_bias=x[7], **opts)
        cd = _compute_dtype(q.dtype)
        o = _tensor(out.output, q.dtype, inputs)
        final = _tensor(out.final_state, cd, inputs)
        if method != "chunk":
            return o, final, q.new_empty((0,), dtype=cd)
        saved = _tensor(out.boundaries, cd, inputs)
    NT = _num_boundaries(q.shape[1], chunk_size, cu_seqlens)
    if saved.shape[0] < NT:  # packed sequences: pad to the static bound
        saved = torch.cat([saved, saved.new_zeros((NT - saved.shape[0], *saved.shape[1:]))])
    return o, final, saved


@_forward_op.register_fake
def _forward_fake(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, *options):
    method, _, chunk_size = options[:3]
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cd = _compute_dtype(q.dtype)
    o = q.new_empty((B, T, HV, V))
    final = q.new_empty((N, HV, K, V), dtype=cd)
    if method != "chunk":
        return o, final, q.new_empty((0,), dtype=cd)
    NT = _num_boundaries(T, chunk_size, cu_seqlens)
    return o, final, q.new_empty((NT, B, HV, K, V), dtype=cd)


@torch.library.custom_op(
    "kda::backward",
    mutates_args=(),
    schema=f"({_INPUT_ARGS}, Tensor boundaries, Tensor grad_output, Tensor? grad_final_state, "
    f"{_OPTION_ARGS}) -> Tensor[]",
)
def _backward_op(
    q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, boundaries, do, dfinal, *options
):
    """Gradients of ``q, k, v, g, beta, initial_state, A_log, dt_bias``, each shaped and typed like
    its input; an empty tensor for an input that is None."""
    method, _, chunk_size = options[:3]
    inputs = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    cu = _offsets(cu_seqlens)
    opts = core_options(*options, cu)
    with _on_stream(q.device):
        x = [_array(t) for t in inputs]
        states = dict(initial_state=x[5], A_log=x[6], dt_bias=x[7])
        do_, dfinal_ = _array(do), _array(dfinal)
        if method == "chunk":
            NT = boundaries.shape[0] if cu is None else packed_chunks(cu, chunk_size)
            saved = _array(boundaries[:NT])
            grads = _api.chunk_kda_backward(*x[:5], saved, do_, dfinal_, **states, **opts)
        else:
            grads = _api.recurrent_kda_backward(*x[:5], do_, dfinal_, **states, **opts)
        return [
            q.new_empty((0,)) if t is None or gr is None else _tensor(gr, t.dtype, inputs)
            for t, gr in zip(inputs, grads)
        ]


@_backward_op.register_fake
def _backward_fake(q, k, v, g, beta, initial_state, A_log, dt_bias, *rest):
    inputs = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    return [
        q.new_empty((0,)) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
        for t in inputs
    ]


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:9], output[2])
    ctx.options = inputs[9:]
    ctx.mark_non_differentiable(output[2])


def _backward(ctx, do, dfinal, _dboundaries):
    *inputs, boundaries = ctx.saved_tensors
    if do is None:
        do = inputs[2].new_zeros((*inputs[2].shape[:3], inputs[2].shape[3]), dtype=inputs[0].dtype)
    grads = _backward_op(*inputs, boundaries, do, dfinal, *ctx.options)
    tensor_grads = [None if t is None else gr for t, gr in zip(inputs[:8], grads)]
    return (*tensor_grads, None, *(None for _ in ctx.options))


torch.library.register_autograd("kda::forward", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# The fla-style functions


def _check_tensors(**tensors: Any) -> None:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            msg = f"{name} must be a torch.Tensor; got {type(t).__name__}"
            raise InvalidTypeError(msg)


def _gate_params(call: FlaCall, A_log: Any, dt_bias: Any, cd: torch.dtype) -> tuple[Any, Any]:
    """``A_log [HV]`` and ``dt_bias`` (``HV * K`` elements read as ``[HV, K]``) in the compute dtype."""
    if dt_bias is not None:
        HV, K = call.dt_bias_shape
        if dt_bias.numel() != HV * K:
            shape = tuple(dt_bias.shape)
            msg = f"dt_bias must have HV * K = {HV} * {K} = {HV * K} elements; got shape {shape}"
            raise InvalidInputError(msg)
        dt_bias = dt_bias.reshape(HV, K).to(cd)
    return (None if A_log is None else A_log.to(cd)), dt_bias


def _apply(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, call: FlaCall):
    cd = _compute_dtype(q.dtype)
    A_log, dt_bias = _gate_params(call, A_log, dt_bias, cd)
    if initial_state is not None:
        initial_state = (initial_state.transpose(-1, -2) if call.state_v_first else initial_state).to(cd)
    if cu_seqlens is not None:
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    o, final, _ = _forward_op(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, *call.static)
    if not call.output_final_state:
        return o, None
    return o, (final.transpose(-1, -2) if call.state_v_first else final)


def _chunk(q, k, v, g, beta, kw: dict[str, Any]):
    return _call("chunk", q, k, v, g, beta, kw)


def _recurrent(q, k, v, g, beta, kw: dict[str, Any]):
    return _call("recurrent", q, k, v, g, beta, kw)


chunk_kda = fla_function("chunk_kda", _chunk, __name__, CHUNK_DOC.format(array="Tensor", framework="PyTorch"))
fused_recurrent_kda = fla_function("fused_recurrent_kda", _recurrent, __name__, RECURRENT_DOC)


def _call(method: str, q, k, v, g, beta, kw: dict[str, Any]):
    A_log, dt_bias, cu = kw.get("A_log"), kw.get("dt_bias"), kw.get("cu_seqlens")
    s0 = kw.get("initial_state")
    _check_tensors(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, A_log=A_log, dt_bias=dt_bias)
    name = "chunk_kda" if method == "chunk" else "fused_recurrent_kda"
    call = translate(
        name, tuple(q.shape), tuple(v.shape), kw,
        has_A_log=A_log is not None, has_dt_bias=dt_bias is not None, has_cu_seqlens=cu is not None,
    )  # fmt: skip
    return _apply(q, k, v, g, beta, s0, A_log, dt_bias, cu, call)
