"""Deliberately broken KDA kernels: wrappers around kda.torch.chunk_kda (flash-linear-attention's
convention), each with one bug that kda.testing.check_kernel must catch (tests/test_testing.py)."""

from __future__ import annotations

import itertools

import torch

from kda.torch import chunk_kda


def causality_leak(q, k, v, g, beta, **kw):
    """Output at step t reads the output at t + 1 (1e-7 of it)."""
    o, s = chunk_kda(q, k, v, g, beta, **kw)
    return torch.cat([o[:, :-1] + 1e-7 * o[:, 1:], o[:, -1:]], dim=1), s


def final_state_one_step_short(q, k, v, g, beta, **kw):
    """The final state misses the last step (of the last sequence)."""
    o, _ = chunk_kda(q, k, v, g, beta, **kw)
    g2 = torch.cat([g[:, :-1], torch.zeros_like(g[:, -1:])], dim=1)
    b2 = torch.cat([beta[:, :-1], torch.zeros_like(beta[:, -1:])], dim=1)
    if kw.get("use_gate_in_kernel"):  # a raw gate of -1e30 makes the log decay 0
        g2 = torch.cat([g[:, :-1], torch.full_like(g[:, -1:], -1e30)], 1)
    if kw.get("use_beta_sigmoid_in_kernel"):
        b2 = torch.cat([beta[:, :-1], torch.full_like(beta[:, -1:], -1e4)], dim=1)
    _, s = chunk_kda(q, k, v, g2, b2, **kw)
    return o, s


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, d):
        return d * 1.01


def value_gradient_scaled(q, k, v, g, beta, **kw):
    """dv is 1.01 times the true one."""
    return chunk_kda(q, k, _Scale.apply(v), g, beta, **kw)


def nan_below_threshold(q, k, v, g, beta, **kw):
    """NaN output once a log decay falls below -100."""
    o, s = chunk_kda(q, k, v, g, beta, **kw)
    if not kw.get("use_gate_in_kernel"):
        below = (g < -100).any(dim=-1, keepdim=True)  # [B, T, HV, 1]
        o = torch.where(below, torch.full_like(o, float("nan")), o)
    return o, s


def packed_initial_state_ignored(q, k, v, g, beta, **kw):
    """Packed sequences start from zeros whatever initial_state says."""
    if kw.get("cu_seqlens") is not None:
        kw = {**kw, "initial_state": None}
        o, s = chunk_kda(q, k, v, g, beta, **kw)
        return o, s
    return chunk_kda(q, k, v, g, beta, **kw)


def wrong_value_head_grouping(q, k, v, g, beta, **kw):
    """Value head i reads q/k head i % H instead of i // G."""
    H, HV = q.shape[2], v.shape[2]
    if HV > H:
        q, k = q.repeat(1, 1, HV // H, 1), k.repeat(1, 1, HV // H, 1)
    return chunk_kda(q, k, v, g, beta, **kw)


def modifies_input(q, k, v, g, beta, **kw):
    """Writes into v after the call."""
    o, s = chunk_kda(q, k, v, g, beta, **kw)
    v.data.view(-1)[0] += 1.0  # .data: past autograd's version counter
    return o, s


_calls = itertools.count()


def nondeterministic_last_bit(q, k, v, g, beta, **kw):
    """Every other call, one output element is one ulp up."""
    o, s = chunk_kda(q, k, v, g, beta, **kw)
    if next(_calls) % 2:
        flat = o.reshape(-1)
        up = torch.nextafter(flat[:1].detach(), torch.full_like(flat[:1], float("inf"))) - flat[:1].detach()
        o = torch.cat([flat[:1] + up, flat[1:]]).reshape(o.shape)
    return o, s


BROKEN = {
    "causality leak": (causality_leak, "causal"),
    "final state one step short": (final_state_one_step_short, "accuracy"),
    "dv scaled by 1.01": (value_gradient_scaled, "accuracy"),
    "NaN below a log decay of -100": (nan_below_threshold, "finite"),
    "packed initial state ignored": (packed_initial_state_ignored, "accuracy"),
    "wrong value-head grouping": (wrong_value_head_grouping, "accuracy"),
    "input modified in place": (modifies_input, "inputs unmodified"),
    "nondeterministic last bit": (nondeterministic_last_bit, "deterministic"),
}
