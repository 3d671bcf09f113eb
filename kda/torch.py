"""PyTorch autograd adapter with flash-linear-attention 0.6's call signature (``pip install kda[torch]``).

>>> from kda.torch import chunk_kda                                     # doctest: +SKIP
>>> o, state = chunk_kda(q, k, v, g, beta, output_final_state=True)     # doctest: +SKIP
>>> o.sum().backward()                                                  # doctest: +SKIP

Tensors are time-major as in fla: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``,
``beta [B, T, HV]``, states ``[N, HV, K, V]``. Each call is one ``torch.library`` custom op
(``torch.ops.kda.forward``) with a fake (meta) implementation and an autograd formula whose
backward is another custom op (``torch.ops.kda.backward``; both in :mod:`kda._torch.ops`). Both
run the host layer shared with :mod:`kda.jax` (:mod:`kda._entry.host`): the forward validates the
call once and saves the chunk-start states; the backward reuses them and the forward's validated
call (the gradients of :func:`kda.chunk_kda_backward`, or :func:`kda.recurrent_kda_backward`).
``torch.compile`` therefore traces a model that calls it with ``fullgraph=True``.

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
``torch.distributed`` group (:mod:`kda._torch.cp`: an autograd function around
:mod:`kda._entry.cp`; gloo on CPU tensors is tested, nccl on CUDA tensors is written but has not
run; ``docs/context_parallel.md``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.compiler import is_compiling
from torch.utils._python_dispatch import _get_current_dispatch_mode as current_dispatch_mode

from ._backend.expect import backward_follows
from ._entry import host as _host
from ._entry.call import Inputs
from ._entry.fla import CHUNK_KEYWORDS, RECURRENT_KEYWORDS, FlaCall, check_keywords
from ._entry.fla_front import CHUNK_DOC, RECURRENT_DOC
from ._errors import InvalidInputError, InvalidTypeError
from ._options.packing import check_pad_slot_id, check_pool_dtype, num_chunks
from ._torch.convert import compute_dtype, gate_params, offsets
from ._torch.cp import KdaCPContext, apply_cp, build_cp_context
from ._torch.ops import (
    DecodeArgs,
    ForwardArgs,
    RecurrentInferenceArgs,
    decode,
    forward_op,
    recurrent_inference,
)

__all__ = ["KdaCPContext", "build_cp_context", "chunk_kda", "fused_recurrent_kda"]


# ----------------------------------------------------------------------------------------------
# The fla-style functions


def _check_tensors(**tensors: Any) -> None:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            msg = f"{name} must be a torch.Tensor; got {type(t).__name__}"
            raise InvalidTypeError(msg)


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
    q, s0 = x.q, x.initial_state
    cd = compute_dtype(q.dtype)
    if x.A_log is not None or x.dt_bias is not None or (s0 is not None and s0.dtype != cd):
        A_log, dt_bias = gate_params(call, x.A_log, x.dt_bias, cd)
        x = x._replace(initial_state=None if s0 is None else s0.to(cd), A_log=A_log, dt_bias=dt_bias)
    if cu_seqlens is not None:
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    static = call.static
    if static.method != "chunk" and not _needs_grad(x):
        # inference: the decode kernel, no autograd node; a V-major state read and written as such
        if _eager(q, x):
            o, final = recurrent_inference(x, cu_seqlens, call.state_v_first, static)
        else:
            args = RecurrentInferenceArgs(
                **x._asdict(), cu_seqlens=cu_seqlens, state_v_first=call.state_v_first, **static._asdict()
            )
            o, final = torch.ops.kda.recurrent_inference(*args)  # (the op's own record: see _apply_pool)
        return o, (final if call.output_final_state else None)
    if x.initial_state is not None and call.state_v_first:
        x = x._replace(initial_state=x.initial_state.transpose(-1, -2))
    args = ForwardArgs(**x._asdict(), cu_seqlens=cu_seqlens, **static._asdict())
    if is_compiling():  # traced: no hint
        o, final, boundaries = forward_op(*args)
    else:
        with backward_follows(_needs_grad(x)):  # a hint: the cpu backend compiles its backward ahead
            o, final, boundaries = forward_op(*args)
    final = (
        None if not call.output_final_state else (final.transpose(-1, -2) if call.state_v_first else final)
    )
    if not call.intermediate_states:
        return o, final
    chunk_size = static.chunk_size
    NT = boundaries.shape[0] if cu_seqlens is None else num_chunks(chunk_size, offsets=offsets(cu_seqlens))
    h = boundaries[:NT].movedim(0, 1)  # [B, NT, HV, K, V]
    h = (h.transpose(-1, -2) if call.state_v_first else h).to(x.k.dtype)
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
    cd = compute_dtype(q.dtype)
    check_pool_dtype("initial_state (the state pool, updated in place)", pool.dtype, cd)
    pad = check_pad_slot_id(kw.get("pad_slot_id", -1), pool.shape[0])
    if cu_seqlens is not None:
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    if indices is None:  # request n continues row n
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        indices = torch.arange(N, dtype=torch.int64)
    A_log, dt_bias = gate_params(call, A_log, dt_bias, cd)
    args = DecodeArgs(
        q=q, k=k, v=v, g=g, beta=beta, state_pool=pool, state_indices=indices, num_accepted_tokens=accepted,
        A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, state_v_first=call.state_v_first,
        pad_slot_id=pad, **call.static._asdict(),
    )  # fmt: skip
    # in eager inference mode (no version counters) the implementation directly: the op's
    # dispatch costs more than a small step; elsewhere the mutating op, which torch sees (the
    # compile check first: dynamo does not trace is_inference_mode_enabled)
    direct = _eager(q, (q, k, v, g, beta, pool, indices, accepted)) and torch.is_inference_mode_enabled()
    # the op's arguments: its own record (built by keyword above, its fields generated from the
    # op's schema, in its order), passed positionally: keywords cost ~4 us in torch's dispatcher
    o = decode(args) if direct else torch.ops.kda.decode(*args)
    return o, pool


# fla 0.6's signatures, written out (kda._entry.fla.CHUNK_PARAMS, RECURRENT_PARAMS; held to them by
# tests/entry/test_signatures.py); the docstrings are kda._entry.fla_front's, shared by both adapters
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
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
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: Any = None,
    cp_context: KdaCPContext | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor | None, ...]:
    if kwargs:
        check_keywords("chunk_kda", kwargs, CHUNK_KEYWORDS)
    return _call(
        "chunk",
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


chunk_kda.__doc__ = CHUNK_DOC.format(array="Tensor", framework="PyTorch")


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor | None, ...]:
    if kwargs:
        check_keywords("fused_recurrent_kda", kwargs, RECURRENT_KEYWORDS)
    return _call(
        "recurrent",
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


fused_recurrent_kda.__doc__ = RECURRENT_DOC


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
        return apply_cp(x, ctx, call)
    if path == "pool":
        return _apply_pool(x, cu, call, kw)
    return _apply(x, cu, call)
