"""Deliberately broken KDA kernels: wrappers around kda.torch.chunk_kda (flash-linear-attention's
convention), each with one bug that kda.testing.check_kernel must catch (tests/tools/test_testing.py).

Importable without torch (``BROKEN`` lists them; the tests that call them skip)."""

from __future__ import annotations

import itertools

try:
    import torch

    from kda.torch import chunk_kda
except ImportError:  # pip install -e ".[test]" has no torch: BROKEN is listed, the tests skip
    torch = chunk_kda = None


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


def _scaled_gradient(x, factor):
    """``x`` in the forward; its gradient times ``factor`` in the backward."""

    class ScaleBy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, d):
            return d * factor

    return ScaleBy.apply(x)


def value_gradient_scaled(q, k, v, g, beta, **kw):
    """dv is 1.01 times the true one."""
    return chunk_kda(q, k, _scaled_gradient(v, 1.01), g, beta, **kw)


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


# Four kernels wrong by less than 1 %


def dropped_quadratic_term(q, k, v, g, beta, **kw):
    """Weak decays (log decay above -0.005) use ``1 + g`` for ``exp(g)``: the exponential's quadratic
    term is dropped (each such step's decay off by at most g**2 / 2 = 1.25e-5, its gate's gradient by
    the factor 1 / (1 + g), at most 1.005)."""
    if not kw.get("use_gate_in_kernel"):
        g = torch.where(g > -0.005, torch.log1p(g), g)
    return chunk_kda(q, k, v, g, beta, **kw)


def chunk_boundary_off_by_one(q, k, v, g, beta, **kw):
    """Each chunk's first step (t = 64, 128, ...) decays with the previous step's gate in the forward
    (the gradient still reaches its own gate)."""
    C = kw.get("chunk_size") or 64
    if g.shape[1] > C:
        idx = torch.arange(g.shape[1], device=g.device)
        idx = torch.where((idx % C == 0) & (idx > 0), idx - 1, idx)
        g = g + (g[:, idx] - g).detach()
    return chunk_kda(q, k, v, g, beta, **kw)


def beta_gradient_scaled(q, k, v, g, beta, **kw):
    """dbeta is 1.005 times the true one."""
    return chunk_kda(q, k, v, g, _scaled_gradient(beta, 1.005), **kw)


def stale_packed_state(q, k, v, g, beta, **kw):
    """Each packed sequence after the first starts from its initial state plus 0.5 % of the previous
    sequence's final state."""
    if kw.get("cu_seqlens") is None or len(kw["cu_seqlens"]) < 3:
        return chunk_kda(q, k, v, g, beta, **kw)
    _, s = chunk_kda(q, k, v, g, beta, **kw)
    s0 = kw.get("initial_state")
    s0 = torch.zeros_like(s) if s0 is None else s0
    stale = torch.cat([torch.zeros_like(s[:1]), s[:-1].detach()])
    return chunk_kda(q, k, v, g, beta, **{**kw, "initial_state": s0 + 0.005 * stale})


BROKEN = {
    "causality leak": (causality_leak, "causal"),
    "final state one step short": (final_state_one_step_short, "accuracy"),
    "dv scaled by 1.01": (value_gradient_scaled, "accuracy"),
    "NaN below a log decay of -100": (nan_below_threshold, "finite"),
    "packed initial state ignored": (packed_initial_state_ignored, "accuracy"),
    "wrong value-head grouping": (wrong_value_head_grouping, "accuracy"),
    "input modified in place": (modifies_input, "inputs unmodified"),
    "nondeterministic last bit": (nondeterministic_last_bit, "deterministic"),
    "exp(g) as 1 + g for decays above -0.005": (dropped_quadratic_term, "accuracy"),
    "chunk boundary off by one": (chunk_boundary_off_by_one, "accuracy"),
    "dbeta scaled by 1.005": (beta_gradient_scaled, "accuracy"),
    "stale state across packed sequences": (stale_packed_state, "accuracy"),
}
