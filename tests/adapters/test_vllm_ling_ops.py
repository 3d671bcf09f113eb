"""kda.vllm.ling: Ling-3's four KDA functions (the gate, prefill, decode, speculative verify)
against a float64 step recurrence written out here in vLLM's conventions: the log decay
``lower_bound * sigmoid(exp(A_log) (g + dt_bias))`` or ``-exp(A_log) softplus(g + dt_bias)``
(fla's softplus: ``beta``, ``threshold``), ``beta`` already sigmoided, l2-normalised q and k (eps
1e-6), V-major pools ``[slots, H, V, K]`` with a padded row stride, slot 0 (and -1) as padding,
int32 indices as row-strided views.

The ops tests need torch only; ``test_signatures_are_vllms`` compares the signatures with vLLM's
own functions where vLLM imports (and is skipped elsewhere).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from helpers import assert_within

import kda

torch = pytest.importorskip("torch")
ling = pytest.importorskip("kda.vllm.ling")

TOL = 1e-5  # float32 kernels against the float64 recurrence, relative to the largest element
LOWER_BOUND = -5.0  # the released checkpoints' kda_lower_bound


# ----------------------------------------------------------------------------------------------
# the oracle


def _gate64(g, A_log, dt_bias, lower_bound, beta=1.0, threshold=20.0):
    """The log decay in float64, fla's formula. ``g [..., H * K]`` -> ``[..., H, K]``."""
    H = A_log.numel()
    x = g.double().reshape(*g.shape[:-1], H, -1) + dt_bias.double().reshape(H, -1)
    a = torch.exp(A_log.double().reshape(H))[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * torch.nn.functional.softplus(x, beta=beta, threshold=threshold)


def _step(S, q, k, v, glog, b, scale):
    """One step of every head in float64: ``S [H, V, K]``, ``glog [H, K]`` the log decay, ``b
    [H]`` the step size. Returns ``(S, o [H, V])``."""
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    S = S * torch.exp(glog)[:, None, :]
    u = b[:, None] * (v - torch.einsum("hvk,hk->hv", S, k))
    S = S + u[:, :, None] * k[:, None, :]
    return S, scale * torch.einsum("hvk,hk->hv", S, q)


def _f64(*xs):
    return [x.detach().double() for x in xs]


def _pool(P, H, V, K, pad=7, seed=0):
    """A float32 V-major pool whose rows are dense but whose row stride is padded (Mamba pages)."""
    gen = torch.Generator().manual_seed(seed)
    store = torch.randn(P, H * V * K + pad, generator=gen) * 0.5
    return store[:, : H * V * K].view(P, H, V, K)


def _layer_inputs(T, H, K, V, seed, dtype=torch.float32):
    """What Ling-3's layer hands the kernels: q, k, v (column slices of one projection: row-strided),
    the log decay from fused_kda_gate (float32), beta sigmoided (float32)."""
    gen = torch.Generator().manual_seed(seed)
    proj = (torch.randn(T, 2 * H * K + H * V + 5, generator=gen) * 2).to(dtype)
    q = proj[:, : H * K].unflatten(1, (H, K))[None]
    k = proj[:, H * K : 2 * H * K].unflatten(1, (H, K))[None]
    v = proj[:, 2 * H * K : 2 * H * K + H * V].unflatten(1, (H, V))[None]
    A_log = torch.randn(1, 1, H, 1, generator=gen) * 0.5
    dt_bias = torch.randn(H * K, generator=gen)
    raw_g = torch.randn(T, H * K, generator=gen).to(dtype)
    g = ling.fused_kda_gate(raw_g, A_log, K, g_bias=dt_bias, lower_bound=LOWER_BOUND)[None]
    beta = torch.randn(T, H, generator=gen).sigmoid()[None]
    return q, k, v, g, beta


def _indices(rows, stride=3):
    """int32 ``rows`` as a row-strided view (a column of a wider table, as vLLM slices them)."""
    table = torch.full((len(rows), stride), 99, dtype=torch.int32)
    table[:, 1] = torch.tensor(rows, dtype=torch.int32)
    return table[:, 1]


def _cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# the gate


@pytest.mark.parametrize("lower_bound", [LOWER_BOUND, -1.5, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate(lower_bound, dtype):
    H, K, T = 3, 8, 11
    gen = torch.Generator().manual_seed(1)
    wide = (torch.randn(T, H * K + 4, generator=gen) * 6).to(dtype)
    g = wide[:, : H * K]  # row-strided, as the layer's f_proj output slices may be
    A_log = torch.randn(1, 1, H, 1, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    y = ling.fused_kda_gate(g, A_log, K, g_bias=dt_bias, lower_bound=lower_bound)
    assert y.shape == (T, H, K) and y.dtype == torch.float32
    assert bool((y <= 0).all())
    assert_within(y.double(), _gate64(g, A_log, dt_bias, lower_bound), tol=1e-6, name="log decay")
    if lower_bound is not None:
        assert bool((y >= lower_bound).all())


def test_gate_softplus_beta_threshold_and_shapes():
    """fla's softplus parameters (``x`` itself above the threshold), leading dims kept, ``A`` of
    shape ``[H]``, no bias."""
    H, K = 2, 4
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(2, 5, H * K, generator=gen) * 4
    A_log = torch.randn(H, generator=gen)
    y = ling.fused_kda_gate(g, A_log, K, beta=2.0, threshold=3.0)
    assert y.shape == (2, 5, H, K)
    expect = _gate64(g, A_log, torch.zeros(H * K), None, beta=2.0, threshold=3.0)
    assert_within(y.double(), expect, tol=1e-6)
    assert bool((2.0 * g > 3.0).any()), "the threshold must be crossed somewhere"


def test_gate_refusals():
    g, A = torch.zeros(3, 8), torch.zeros(2)
    with pytest.raises(kda.KdaError, match=r"g must be \[..., H \* head_k_dim\] = \[..., 6\]"):
        ling.fused_kda_gate(g, torch.zeros(2), 3)
    with pytest.raises(kda.KdaError, match="g_bias"):
        ling.fused_kda_gate(g, A, 4, g_bias=torch.zeros(7))
    with pytest.raises(kda.KdaError, match="lower_bound"):
        ling.fused_kda_gate(g, A, 4, lower_bound=0.5)
    with pytest.raises(kda.KdaError, match="head_k_dim"):
        ling.fused_kda_gate(g, A, 4.0)


# ----------------------------------------------------------------------------------------------
# prefill (the layer gathers the initial states and writes the final ones back itself)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill(dtype):
    H, K, V = 2, 16, 16
    lengths = [70, 1, 33]  # across a chunk boundary, one token, a partial chunk
    T = sum(lengths)
    q, k, v, g, beta = _layer_inputs(T, H, K, V, seed=3, dtype=dtype)
    pool = _pool(5, H, V, K)
    rows = [3, 1, 4]
    initial = pool[rows].contiguous()  # the layer's recurrent_state[state_indices].contiguous()
    cu = _cu(lengths)
    o, final = ling.chunk_kda(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND,
                              cu_seqlens=cu)  # fmt: skip
    assert o.shape == (1, T, H, V) and o.dtype == dtype
    assert final.shape == (3, H, V, K) and final.dtype == torch.float32
    qq, kk, vv, gg, bb = _f64(q, k, v, g, beta)
    tol = TOL if dtype == torch.float32 else 1e-2
    for n, (start, L) in enumerate(zip(cu.tolist(), lengths)):
        S, outs = initial[n].double(), []
        for j in range(start, start + L):
            S, out = _step(S, qq[0, j], kk[0, j], vv[0, j], gg[0, j], bb[0, j], K**-0.5)
            outs.append(out)
        assert_within(o[0, start : start + L].double(), torch.stack(outs), tol=tol, name=f"o of {n}")
        assert_within(final[n].double(), S, tol=tol, name=f"final state of {n}")


def test_prefill_without_state_and_scale():
    """No initial state (zeros), no final state asked, a given scale, batch of two without cu_seqlens."""
    H, K, V, B, T = 2, 8, 8, 2, 9
    q, k, v, g, beta = (x.reshape(B, T, *x.shape[2:]) for x in _layer_inputs(B * T, H, K, V, seed=4))
    o, final = ling.chunk_kda(q, k, v, g, beta, scale=0.3, use_qk_l2norm_in_kernel=True)
    assert final is None
    qq, kk, vv, gg, bb = _f64(q, k, v, g, beta)
    for b in range(B):
        S = torch.zeros(H, V, K, dtype=torch.float64)
        for t in range(T):
            S, out = _step(S, qq[b, t], kk[b, t], vv[b, t], gg[b, t], bb[b, t], 0.3)
            assert_within(o[b, t].double(), out, tol=TOL, name=f"o[{b}, {t}]")


# ----------------------------------------------------------------------------------------------
# decode: one token a request, from the pool, in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_from_pool(dtype):
    H, K, V, P = 2, 16, 16, 9
    rows = [4, 0, 7, -1, 2]  # slot 0 and -1: padding
    N = len(rows)
    q, k, v, g, beta = _layer_inputs(N, H, K, V, seed=5, dtype=dtype)
    pool = _pool(P, H, V, K)
    before, ptr = pool.clone(), pool.data_ptr()
    o, same = ling.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, use_qk_l2norm_in_kernel=True,
                                       safe_gate=True, lower_bound=LOWER_BOUND,
                                       cu_seqlens=torch.arange(N + 1, dtype=torch.int32),
                                       ssm_state_indices=_indices(rows))  # fmt: skip
    assert same is pool and pool.data_ptr() == ptr
    assert o.shape == (1, N, H, V) and o.dtype == dtype
    qq, kk, vv, gg, bb = _f64(q, k, v, g, beta)
    tol = TOL if dtype == torch.float32 else 1e-2
    for n, r in enumerate(rows):
        if r <= 0:
            assert torch.equal(o[0, n], torch.zeros_like(o[0, n])), "padding must give zeros"
            continue
        S, out = _step(before[r].double(), qq[0, n], kk[0, n], vv[0, n], gg[0, n], bb[0, n], K**-0.5)
        assert_within(o[0, n].double(), out, tol=tol, name=f"o[{n}]")
        assert_within(pool[r].double(), S, tol=TOL, name=f"pool[{r}]")
    for r in set(range(P)) - set(rows):
        assert torch.equal(pool[r], before[r]), f"row {r} is named by no request"


def test_prefill_then_decode_continues_the_state():
    """The layer's sequence: a prefill whose final state is written to the pool, then decode steps
    from that slot: the outputs are those of one recurrence over the whole sequence."""
    H, K, V, T, steps, slot = 2, 16, 16, 40, 5, 3
    q, k, v, g, beta = _layer_inputs(T + steps, H, K, V, seed=6)
    pool = _pool(5, H, V, K)
    pool[slot] = 0
    o, final = ling.chunk_kda(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T],
                              initial_state=pool[[slot]].contiguous(), output_final_state=True,
                              use_qk_l2norm_in_kernel=True, cu_seqlens=_cu([T]))  # fmt: skip
    pool[[slot]] = final
    outs = [o[0]]
    for t in range(T, T + steps):
        d, _ = ling.fused_recurrent_kda(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                        beta[:, t : t + 1], initial_state=pool, cu_seqlens=_cu([1]),
                                        ssm_state_indices=_indices([slot]))  # fmt: skip
        outs.append(d[0])
    got = torch.cat(outs)
    qq, kk, vv, gg, bb = _f64(q, k, v, g, beta)
    S = torch.zeros(H, V, K, dtype=torch.float64)
    for t in range(T + steps):
        S, out = _step(S, qq[0, t], kk[0, t], vv[0, t], gg[0, t], bb[0, t], K**-0.5)
        assert_within(got[t].double(), out, tol=TOL, name=f"token {t}")
    assert_within(pool[slot].double(), S, tol=TOL)


# ----------------------------------------------------------------------------------------------
# speculative verify


def test_verify():
    """Requests of 3, 1, 2 and 3 tokens and a padding request; accepted counts, one of them past its
    request's steps (2 accepted, 1 token: no draft found); more index rows than requests; slot 0
    past the start (a write skipped)."""
    H, K, V, P = 2, 16, 8, 20
    lengths = [3, 1, 2, 3, 1]
    accepted = [2, 2, 1, 3, 1]
    slots = [[5, 6, 7], [8, 15, 0], [9, 0, 11], [12, 13, 14], [0, 0, 0]]  # last: padding request
    N, W, T = len(lengths), 3, sum(lengths)
    q, k, v, g, beta = _layer_inputs(T, H, K, V, seed=7)
    pool = _pool(P, H, V, K)
    before = pool.clone()
    cu = _cu(lengths)
    table = torch.zeros(N + 2, W + 2, dtype=torch.int32)  # rows past N and columns past W: unused
    table[:N, :W] = torch.tensor(slots, dtype=torch.int32)
    acc = torch.tensor([*accepted, 1, 1], dtype=torch.int32)
    o, same = ling.fused_recurrent_kda_fwd(q, k, v, g, beta, K**-0.5, pool, inplace_final_state=True,
                                           cu_seqlens=cu, ssm_state_indices=table[:, :W],
                                           num_accepted_tokens=acc, use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert same is pool and o.shape == (1, T, H, V)
    assert acc.tolist() == [*accepted, 1, 1], "vLLM's counts are not modified"
    qq, kk, vv, gg, bb = _f64(q, k, v, g, beta)
    expect, written = before.double().clone(), set()
    for n, (start, L) in enumerate(zip(cu.tolist(), lengths)):
        first = slots[n][accepted[n] - 1]
        if first <= 0:
            assert torch.equal(o[0, start], torch.zeros_like(o[0, start]))
            continue
        S = before[first].double()
        for t in range(L):
            j = start + t
            S, out = _step(S, qq[0, j], kk[0, j], vv[0, j], gg[0, j], bb[0, j], K**-0.5)
            assert_within(o[0, j].double(), out, tol=TOL, name=f"o[{j}]")
            if slots[n][t] > 0:
                expect[slots[n][t]] = S
                written.add(slots[n][t])
    for r in range(P):
        if r in written:
            assert_within(pool[r].double(), expect[r], tol=TOL, name=f"pool[{r}]")
        else:
            assert torch.equal(pool[r], before[r]), f"row {r} must not be written"


def test_recurrent_refusals():
    H, K = 2, 8
    q, k, v, g, beta = _layer_inputs(2, H, K, K, seed=8)
    pool, idx = _pool(4, H, K, K), _indices([1, 2])
    cu = torch.arange(3, dtype=torch.int32)
    with pytest.raises(kda.KdaError, match="inplace_final_state must be True"):
        ling.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, inplace_final_state=False,
                                 cu_seqlens=cu, ssm_state_indices=idx)  # fmt: skip
    with pytest.raises(kda.KdaError, match="ssm_state_indices must be given"):
        ling.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu)
    with pytest.raises(kda.KdaError, match=r"num_accepted_tokens needs ssm_state_indices \[N, W\]"):
        ling.fused_recurrent_kda_fwd(q, k, v, g, beta, K**-0.5, pool, cu_seqlens=cu, ssm_state_indices=idx,
                                     num_accepted_tokens=torch.ones(2, dtype=torch.int32))  # fmt: skip
    with pytest.raises(kda.KdaError, match="state pool"):
        ling.fused_recurrent_kda(q, k, v, g, beta, initial_state=_pool(4, H, K, K + 1), cu_seqlens=cu,
                                 ssm_state_indices=idx)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# vLLM's own signatures


def _parameters(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_signatures_are_vllms():
    """Each function has vLLM 0.32's parameters: names, kinds, defaults, in order (annotations
    aside: vLLM's are objects, these are strings)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("vLLM is not installed here")
    import importlib

    theirs = importlib.import_module(ling.OPS_MODULE)
    for name in ling.NAMES:
        original = getattr(theirs, name)
        if getattr(original, "__module__", "") == ling.__name__:  # kda.vllm installed them already
            pytest.skip("vLLM's functions are replaced in this process")
        assert _parameters(getattr(ling, name)) == _parameters(original), name
