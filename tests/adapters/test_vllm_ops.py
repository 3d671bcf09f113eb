"""kda.vllm.ops: vLLM's four KDA functions (prefill, packed decode, speculative verify, the initial
states gather) against a float64 step recurrence written out here in vLLM's conventions: V-major
pools ``[slots, H, V, K]`` with a padded row stride, block 0 (and -1) as padding, raw gates
(``-exp(A_log) softplus(g + dt_bias)`` with softplus's threshold 20, or the lower-bound sigmoid),
``sigmoid(raw_beta)``, l2-normalised q and k (eps 1e-6), int32 indices as row-strided views.

Needs torch only: vLLM is not imported (the plugin's parts that need it are tested by
``tests/adapters/test_vllm_e2e.py``).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, assert_within

import kda

torch = pytest.importorskip("torch")
ops = pytest.importorskip("kda.vllm.ops")
kv = pytest.importorskip("kda.vllm")

TOL = 1e-5  # float32 kernels against the float64 recurrence, relative to the largest element


# ----------------------------------------------------------------------------------------------
# the oracle


def _step(S, q, k, v, g, b, A_log, dt_bias, lower_bound, scale):
    """One step of every head in float64, vLLM's way. ``S [H, V, K]``; returns ``(S, o [H, V])``."""
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    H, K = k.shape
    x = g + (0 if dt_bias is None else dt_bias.reshape(H, K))
    a = torch.exp(A_log.reshape(H))[:, None]
    if lower_bound is None:
        gate = -a * torch.nn.functional.softplus(x, beta=1.0, threshold=20.0)
    else:
        gate = lower_bound * torch.sigmoid(a * x)
    S = S * torch.exp(gate)[:, None, :]
    u = torch.sigmoid(b)[:, None] * (v - torch.einsum("hvk,hk->hv", S, k))
    S = S + u[:, :, None] * k[:, None, :]
    return S, scale * torch.einsum("hvk,hk->hv", S, q)


def _f64(*xs):
    return [None if x is None else x.detach().double() for x in xs]


def _pool(P, H, V, K, pad=7, seed=0):
    """A float32 V-major pool whose rows are dense but whose row stride is padded (Mamba pages)."""
    gen = torch.Generator().manual_seed(seed)
    store = torch.randn(P, H * V * K + pad, generator=gen) * 0.5
    return store[:, : H * V * K].view(P, H, V, K)


def _gates(H, K, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen)


def _indices(rows, stride=3):
    """int32 ``rows`` as a row-strided view (a column of a wider table, as vLLM slices them)."""
    table = torch.full((len(rows), stride), 99, dtype=torch.int32)
    table[:, 1] = torch.tensor(rows, dtype=torch.int32)
    return table[:, 1]


# ----------------------------------------------------------------------------------------------
# decode from packed q, k, v


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_decode(lower_bound, dtype):
    H, K, V, P, B = 2, 16, 8, 9, 5
    gen = torch.Generator().manual_seed(2)
    width = 2 * H * K + H * V
    mixed = (torch.randn(B, width + 11, generator=gen) * 2).to(dtype)[:, :width]  # row-strided
    raw_g = torch.randn(1, B, H, K, generator=gen).to(dtype)
    raw_beta = torch.randn(1, B, H, generator=gen).to(dtype)
    A_log, dt_bias = _gates(H, K)
    pool = _pool(P, H, V, K)
    before = pool.clone()
    rows = [4, 0, 7, -1, 2]  # block 0 and -1: padding
    idx = _indices(rows)
    ptr = pool.data_ptr()

    o, same = ops.fused_recurrent_kda_packed_decode(mixed, raw_g, raw_beta, A_log, dt_bias, lower_bound,
                                                    pool, idx)  # fmt: skip
    assert same is pool and pool.data_ptr() == ptr  # the pool, written in place
    assert o.shape == (1, B, H, V) and o.dtype == dtype
    m, g, b, A, dt = _f64(mixed, raw_g, raw_beta, A_log, dt_bias)
    expect_pool = before.double().clone()
    for n, r in enumerate(rows):
        if r <= 0:
            assert torch.equal(o[0, n], torch.zeros_like(o[0, n])), "padding must give zeros"
            continue
        q, k, v = m[n, : H * K].view(H, K), m[n, H * K : 2 * H * K].view(H, K), m[n, 2 * H * K :].view(H, V)
        S, out = _step(expect_pool[r], q, k, v, g[0, n], b[0, n], A, dt, lower_bound, K**-0.5)
        expect_pool[r] = S
        tol = TOL if dtype == torch.float32 else 1e-2  # the output rounded to bfloat16
        assert_within(o[0, n].double(), out, tol=tol, name=f"o[{n}]")
    for r in range(P):
        if r in rows:
            assert_within(pool[r].double(), expect_pool[r], tol=TOL, name=f"pool[{r}]")
        else:
            assert torch.equal(pool[r], before[r]), f"row {r} is named by no request"


def test_packed_decode_out_and_bfloat16_pool():
    pytest.importorskip("ml_dtypes")
    H, K, V, P, B = 2, 8, 8, 4, 2
    gen = torch.Generator().manual_seed(3)
    mixed = torch.randn(B, 2 * H * K + H * V, generator=gen)
    raw_g, raw_beta = torch.randn(1, B, H, K, generator=gen), torch.randn(1, B, H, generator=gen)
    A_log, dt_bias = _gates(H, K)
    pool32 = _pool(P, H, V, K, pad=0)
    pool16 = pool32.to(torch.bfloat16)
    idx = torch.tensor([1, 3], dtype=torch.int32)
    start = pool16.float()  # the rounded rows the kernel starts from
    out = torch.full((1, B, H, V), 5.0)
    o, _ = ops.fused_recurrent_kda_packed_decode(mixed, raw_g, raw_beta, A_log, dt_bias, None, pool16, idx,
                                                 out=out)  # fmt: skip
    assert o is out
    # the bfloat16 pool: computed in float32 from the rounded rows, rounded on store
    ref, _ = ops.fused_recurrent_kda_packed_decode(mixed, raw_g, raw_beta, A_log, dt_bias, None, start, idx)
    assert_within(out, ref, tol=TOL)
    assert torch.equal(pool16[[1, 3]], start[[1, 3]].to(torch.bfloat16))
    assert torch.equal(pool16[[0, 2]], pool32[[0, 2]].to(torch.bfloat16))


def test_packed_decode_refusals():
    H, K, V, P, B = 2, 8, 8, 4, 2
    mixed = torch.randn(B, 2 * H * K + H * V)
    raw_g, raw_beta = torch.randn(1, B, H, K), torch.randn(1, B, H)
    A_log, dt_bias = _gates(H, K)
    pool = _pool(P, H, V, K)
    before = pool.clone()
    idx = torch.tensor([1, 2], dtype=torch.int32)
    bad = [
        (mixed[:, :-1], raw_g, raw_beta, pool, idx, "mixed_qkv"),
        (mixed, raw_g[:, :1], raw_beta, pool, idx, "raw_g"),
        (mixed, raw_g, raw_beta, pool.transpose(-1, -2), idx, "initial_state"),  # K-major: not vLLM's
        (mixed, raw_g, raw_beta, pool, idx[:1], "state_indices"),
        (mixed, raw_g, raw_beta, pool, torch.tensor([1, 1], dtype=torch.int32), "state_indices"),
        (mixed, raw_g, raw_beta, pool, torch.tensor([1, 4], dtype=torch.int32), "state_indices"),
    ]
    for m, g, b, p, i, name in bad:
        with pytest.raises(kda.KdaError, match=name):
            ops.fused_recurrent_kda_packed_decode(m, g, b, A_log, dt_bias, None, p, i)
    assert torch.equal(pool, before), "a refused call writes nothing"


# ----------------------------------------------------------------------------------------------
# speculative verify


def test_verify_packed_requests():
    """Requests of 3, 1, 2 and 3 tokens, a padding request, a skipped write (slot 0 past the
    start), accepted counts, more index rows than requests, tokens past the requests."""
    H, K, V, P = 2, 16, 8, 20
    lengths = [3, 1, 2, 3, 2]
    accepted = [2, 1, 1, 3, 1]
    slots = [[5, 6, 7], [8, 0, 0], [9, 0, 11], [12, 13, 14], [0, 0, 0]]  # last: padding request
    N, W = len(lengths), 3
    T = sum(lengths) + 2  # two tokens past cu_seqlens[-1]
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(1, T, 3, H, K, generator=gen)  # q, k, v interleaved per token: row-strided views
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2, :, :V]
    raw_g, raw_beta = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, generator=gen)
    A_log, dt_bias = _gates(H, K)
    pool = _pool(P, H, V, K)
    before = pool.clone()
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    table = torch.zeros(N + 2, W + 2, dtype=torch.int32)  # rows past N and columns past W: unused
    table[:N, :W] = torch.tensor(slots, dtype=torch.int32)
    indices = table[:, :W]
    acc = torch.tensor([*accepted, 1, 1], dtype=torch.int32)

    o, same = ops.fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, None, pool, cu, indices, acc)
    assert same is pool and o.shape == (1, T, H, V) and o.dtype == v.dtype
    qq, kk, vv, g, b, A, dt = _f64(q, k, v, raw_g, raw_beta, A_log, dt_bias)
    expect = before.double().clone()
    written = set()
    for n, (start, L) in enumerate(zip(cu.tolist(), lengths)):
        first = slots[n][accepted[n] - 1]
        if first <= 0:
            assert torch.equal(o[0, start], torch.zeros_like(o[0, start]))
            continue
        S = expect[first].clone()
        for t in range(L):
            j = start + t
            S, out = _step(S, qq[0, j], kk[0, j], vv[0, j], g[0, j], b[0, j], A, dt, None, K**-0.5)
            assert_within(o[0, j].double(), out, tol=TOL, name=f"o[{j}]")
            if slots[n][t] > 0:
                expect[slots[n][t]] = S
                written.add(slots[n][t])
    assert torch.equal(o[0, sum(lengths) :], torch.zeros_like(o[0, sum(lengths) :]))
    for r in range(P):
        if r in written:
            assert_within(pool[r].double(), expect[r], tol=TOL, name=f"pool[{r}]")
        else:
            assert torch.equal(pool[r], before[r]), f"row {r} must not be written"


def test_verify_start_past_the_step():
    """vLLM's start slot ``[n, num_accepted_tokens[n] - 1]`` past the request's own steps (the step
    before accepted more tokens than this one has: no draft found): each request continues the
    state of that slot, writes its steps' states to its first slots, and leaves the start slot and
    every other row unchanged; vLLM's counts are not modified."""
    H, K, V, P = 2, 16, 8, 24
    lengths = [1, 2, 1, 4]
    accepted = [2, 4, 4, 3]
    slots = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]]
    T = sum(lengths)
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    raw_g, raw_beta = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, generator=gen)
    A_log, dt_bias = _gates(H, K)
    pool = _pool(P, H, V, K)
    before = pool.clone()
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    indices = torch.tensor(slots, dtype=torch.int32)
    acc = torch.tensor(accepted, dtype=torch.int32)
    o, _ = ops.fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, None, pool, cu, indices, acc)
    assert acc.tolist() == accepted
    qq, kk, vv, g, b, A, dt = _f64(q, k, v, raw_g, raw_beta, A_log, dt_bias)
    expect, written = before.double().clone(), set()
    for n, (start, L) in enumerate(zip(cu.tolist(), lengths)):
        S = before[slots[n][accepted[n] - 1]].double()
        for t in range(L):
            j = start + t
            S, out = _step(S, qq[0, j], kk[0, j], vv[0, j], g[0, j], b[0, j], A, dt, None, K**-0.5)
            assert_within(o[0, j].double(), out, tol=TOL, name=f"o[{j}]")
            expect[slots[n][t]] = S
            written.add(slots[n][t])
    for r in range(P):
        if r in written:
            assert_within(pool[r].double(), expect[r], tol=TOL, name=f"pool[{r}]")
        else:
            assert torch.equal(pool[r], before[r]), f"row {r} must not be written"


@pytest.mark.parametrize("lower_bound", [None, -3.0])
def test_verify_one_token_per_request_and_out(lower_bound):
    """1-D indices with one token per request (vLLM's assertion T == N); ``out`` written."""
    H, K, V, P, N = 2, 8, 16, 6, 3
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, N, H, K, generator=gen), torch.randn(1, N, H, K, generator=gen)
    v = torch.randn(1, N, H, V, generator=gen)
    raw_g, raw_beta = torch.randn(1, N, H, K, generator=gen), torch.randn(1, N, H, generator=gen)
    A_log, dt_bias = _gates(H, K)
    pool = _pool(P, H, V, K)
    before = pool.clone()
    cu = torch.arange(N + 1, dtype=torch.int32)
    rows = [3, 1, 5]
    out = torch.empty(1, N, H, V)
    o, _ = ops.fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, pool, cu,
                                   _indices(rows), None, out=out)  # fmt: skip
    assert o is out
    qq, kk, vv, g, b, A, dt = _f64(q, k, v, raw_g, raw_beta, A_log, dt_bias)
    for n, r in enumerate(rows):
        S, ref = _step(before[r].double(), qq[0, n], kk[0, n], vv[0, n], g[0, n], b[0, n], A, dt,
                       lower_bound, K**-0.5)  # fmt: skip
        assert_within(o[0, n].double(), ref, tol=TOL)
        assert_within(pool[r].double(), S, tol=TOL)


# ----------------------------------------------------------------------------------------------
# prefill: gather the initial states, chunked KDA, write the final states back (vLLM's layer)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_from_pool(lower_bound, dtype):
    H, K, V, P = 2, 16, 16, 8
    lengths = [70, 1, 33]  # across a chunk boundary, one token, a partial chunk
    rows, has = [6, 2, 4], [True, False, True]
    T = sum(lengths)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, T, H, d, generator=gen).to(dtype) for d in (K, K, V))
    raw_g = torch.randn(1, T, H, K, generator=gen).to(dtype)
    raw_beta = torch.randn(1, T, H, generator=gen).to(dtype)
    A_log, dt_bias = _gates(H, K)
    pool = _pool(P, H, V, K)
    before = pool.clone()
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    idx, has_t = _indices(rows), torch.tensor(has)

    s0 = ops.gather_initial_states(pool, idx, has_t)
    o, final = ops.chunk_kda_with_fused_gate(q, k, v, raw_g, raw_beta, A_log, dt_bias,
                                             initial_state=s0, output_final_state=True,
                                             lower_bound=lower_bound, use_qk_l2norm_in_kernel=True,
                                             cu_seqlens=cu)  # fmt: skip
    pool[idx.long()] = final  # as vLLM's layer writes them back
    assert o.shape == (1, T, H, V) and o.dtype == dtype
    assert final.shape == (len(rows), H, V, K) and final.dtype == torch.float32
    qq, kk, vv, g, b, A, dt = _f64(q, k, v, raw_g, raw_beta, A_log, dt_bias)
    tol = TOL if dtype == torch.float32 else 1e-2
    for n, (start, L) in enumerate(zip(cu.tolist(), lengths)):
        S = before[rows[n]].double() if has[n] else torch.zeros(H, V, K, dtype=torch.float64)
        outs = []
        for j in range(start, start + L):
            S, out = _step(S, qq[0, j], kk[0, j], vv[0, j], g[0, j], b[0, j], A, dt, lower_bound, K**-0.5)
            outs.append(out)
        assert_within(o[0, start : start + L].double(), torch.stack(outs), tol=tol, name=f"o of {n}")
        assert_within(pool[rows[n]].double(), S, tol=TOL if dtype == torch.float32 else 1e-2)
    for r in set(range(P)) - set(rows):
        assert torch.equal(pool[r], before[r])


def test_gather_initial_states():
    pool = _pool(6, 2, 4, 3)
    idx = torch.tensor([[5, 0], [0, 0], [2, 0], [-1, 0]], dtype=torch.int64)[:, 0]  # row-strided
    has = torch.tensor([True, False, True, False])
    s0 = ops.gather_initial_states(pool, idx, has)
    assert s0.shape == (4, 2, 4, 3) and s0.dtype == pool.dtype and s0.is_contiguous()
    assert torch.equal(s0[0], pool[5]) and torch.equal(s0[2], pool[2])
    assert torch.equal(s0[1], torch.zeros_like(s0[1])) and torch.equal(s0[3], torch.zeros_like(s0[3]))
    s0[0].fill_(1.0)
    assert not torch.equal(pool[5], s0[0]), "a new tensor, not a view of the pool"
    with pytest.raises(kda.KdaError, match="indices"):
        ops.gather_initial_states(pool, idx.float(), has)
    with pytest.raises(kda.KdaError, match="one length"):
        ops.gather_initial_states(pool, idx, has[:2])
    with pytest.raises(kda.KdaError, match="rows of state"):
        ops.gather_initial_states(pool, torch.tensor([6]), torch.tensor([True]))


# ----------------------------------------------------------------------------------------------
# the plugin's parts that do not need vLLM


def test_version_check():
    assert kv.check_vllm_version("0.32.0") == "0.32.0"
    assert kv.check_vllm_version("0.32.3+cpu") == "0.32.3+cpu"
    for bad in ("0.31.9", "0.33.0", "1.0.0", "dev"):
        with pytest.raises(kv.VllmVersionError, match=r"supports vLLM 0\.32\.0") as e:
            kv.check_vllm_version(bad)
        assert isinstance(e.value, kda.KdaError) and "KDA_VLLM=0" in str(e.value)


def test_import_kda_imports_neither_torch_nor_vllm():
    code = "import sys, kda; bad = [m for m in ('torch', 'vllm') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------------------
# the pool is passed through, not copied


def test_adapters_pass_the_pool_view_through(monkeypatch):
    """Each pool adapter (Kimi's packed decode and verify, GLM-5.3-Flash's recurrent op) hands
    kda.torch vLLM's pool view itself: the same tensor (no ``.contiguous()``, no gathered rows),
    with its padded slot stride, which the cpu kernel updates in place (its route through copies
    of the rows made to fail); the rows are written through the view into vLLM's page store,
    whose padding between slots stays bitwise as it was."""
    glm = pytest.importorskip("kda.vllm.glm")
    H, K, P, B, pad = 2, 8, 6, 2, 5
    real, seen = ops._kt.fused_recurrent_kda, []

    def spy(*args, **kwargs):
        seen.append(kwargs["initial_state"])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops._kt, "fused_recurrent_kda", spy)  # kda.vllm.glm calls the same module's
    decode = pytest.importorskip("kda.cpu._decode")

    def through_copies(*args, **kwargs):
        raise AssertionError("the pool went through copies of its rows")

    monkeypatch.setattr(decode, "_through_copies", through_copies)  # the cpu kernel's copy route
    gen = torch.Generator().manual_seed(9)
    A_log, dt_bias = _gates(H, K)
    idx = torch.tensor([4, 2], dtype=torch.int32)
    mixed = torch.randn(B, 3 * H * K, generator=gen)
    q, k, v = (x.view(1, B, H, K) for x in mixed.split(H * K, dim=-1))
    raw_g, raw_beta = torch.randn(1, B, H, K, generator=gen), torch.randn(1, B, H, generator=gen)
    cu = torch.arange(B + 1, dtype=torch.int32)
    glm_kw = {"cu_seqlens": cu, "ssm_state_indices": idx, "sigmoid_beta": True, "a_log": A_log,
              "g_bias": dt_bias, "compute_gate": True}  # fmt: skip
    calls = {
        "packed decode": lambda p: ops.fused_recurrent_kda_packed_decode(
            mixed, raw_g, raw_beta, A_log, dt_bias, None, p, idx
        ),
        "verify": lambda p: ops.fused_recurrent_kda(
            q, k, v, raw_g, raw_beta, A_log, dt_bias, None, p, cu, idx[:, None]
        ),
        "glm": lambda p: glm.fused_recurrent_kda(q, k, v, raw_g, raw_beta, initial_state=p, **glm_kw),
    }
    for name, call in calls.items():
        store = torch.randn(P, H * K * K + pad, generator=gen)
        pool = store[:, : H * K * K].view(P, H, K, K)
        before = store.clone()
        seen.clear()
        call(pool)
        assert len(seen) == 1 and seen[0] is pool, f"{name}: kda.torch must get vLLM's pool view itself"
        assert torch.equal(store[:, H * K * K :], before[:, H * K * K :]), f"{name}: slot padding touched"
        assert not torch.equal(store[[4, 2]], before[[4, 2]]), f"{name}: rows written through the view"
        assert torch.equal(store[[0, 1, 3, 5]], before[[0, 1, 3, 5]]), f"{name}: other rows untouched"
