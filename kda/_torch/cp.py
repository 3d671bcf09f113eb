"""Context parallelism over ``torch.distributed`` (``chunk_kda(..., cp_context=ctx)``): the
context (:class:`KdaCPContext`, :func:`build_cp_context`) and an autograd function around the
array-level steps of :mod:`kda._entry.cp`, with the collectives (``docs/context_parallel.md``)."""

from __future__ import annotations

import collections
import operator
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._entry import cp as _cp
from .._entry.call import Inputs
from .._entry.fla import FlaCall, OpOptions
from .._errors import InvalidInputError, InvalidTypeError
from .convert import array, compute_dtype, gate_params, on_stream, tensor

__all__ = ["KdaCPContext", "apply_cp", "build_cp_context"]


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
    host = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).cpu()
    p = _cp.partition(host, dist.get_world_size(group), dist.get_rank(group))  # cu_seqlens checked there
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

    t = tensor(a, compute_dtype(like.dtype), ())
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return array(torch.stack(out))


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    t = t.contiguous()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


# What the autograd function keeps for the backward, one record: the host tensors (the fields of
# Inputs), this rank's forward map, its chunks' start states and its boundaries. Saved as the
# record's fields and read back as the record.
_Residuals = collections.namedtuple("_Residuals", (*Inputs._fields, "own_map", "starts", "boundaries"))
_INPUTS_OF = operator.attrgetter(*Inputs._fields)


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
        cd = compute_dtype(q.dtype)
        with on_stream(q):
            x = Inputs._make(map(array, inputs))
            rank = _cp.open_rank(p, x, OpOptions.of(static).spec())  # validated once
            xp, adt = _namespace(x.v), x.v.dtype
            shape = (v.shape[2], q.shape[3], v.shape[3])
            own = _cp.forward_map(p, x, rank, adt)
            maps = _all_gather(own, group, q) if p.crossing else None
            starts = _cp.start_states(p, maps, x.initial_state, shape, adt, xp)
            out = _cp.forward_local(p, x, starts, rank)
            o = tensor(out.output, q.dtype, inputs)
            if want_final:
                share = _cp.final_state_share(p, out.final_state, x.initial_state, xp)
                final = _all_reduce(tensor(share, cd, inputs), group)
            else:
                final = q.new_empty((0,), dtype=cd)
            saved = _Residuals(
                *inputs,
                own_map=tensor(own, cd, inputs),
                starts=tensor(starts, cd, inputs),
                boundaries=tensor(out.boundaries, cd, inputs),
            )
        ctx.save_for_backward(*saved)
        ctx.cp_ctx, ctx.rank_call, ctx.want_final = cp_ctx, rank.call, want_final
        if not want_final:
            ctx.mark_non_differentiable(final)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        p, group = ctx.cp_ctx.partition, ctx.cp_ctx.group
        res = _Residuals._make(ctx.saved_tensors)
        inputs, starts = Inputs._make(_INPUTS_OF(res)), res.starts
        q, v = inputs.q, inputs.v
        if do is None:
            do = torch.zeros_like(v, dtype=q.dtype)
        if ctx.want_final:
            if dfinal is None:
                dfinal = starts.new_zeros((p.num_seqs, *starts.shape[1:]))
            dfinal = _all_reduce(dfinal.to(starts.dtype).clone(), group)
        with on_stream(q):
            x = Inputs._make(map(array, inputs))
            rank = _cp.Rank(ctx.rank_call, x)  # the forward's validated call: nothing checked again
            xp, adt = _namespace(x.v), x.v.dtype
            shape = (v.shape[2], q.shape[3], v.shape[3])
            do_ = array(do)
            dfinal_ = array(dfinal) if ctx.want_final else None
            ctx.rank_call.check_finite(grad_output=do_, grad_final_state=dfinal_)  # the cotangents, once
            own_, starts_ = array(res.own_map), array(starts)
            mine = _cp.backward_map(p, x, do_, rank, adt, own_map=own_)
            maps = _all_gather(mine, group, q) if p.crossing else None
            dends = _cp.end_gradients(p, maps, dfinal_, shape, adt, xp)
            grads = _cp.backward_local(p, x, starts_, array(res.boundaries), do_, dends, rank, dfinal_)
            out = [
                None if t is None or gr is None else tensor(gr, t.dtype, inputs)
                for t, gr in zip(inputs, grads)
            ]
        return (None, None, None, *out)


def _namespace(a: Any) -> Any:
    import array_api_compat

    return array_api_compat.array_namespace(a)


def apply_cp(x: Inputs, cp_ctx: KdaCPContext, call: FlaCall):
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
    cd = compute_dtype(q.dtype)
    A_log, dt_bias = gate_params(call, x.A_log, x.dt_bias, cd)
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
