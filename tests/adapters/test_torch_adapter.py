"""kda.torch: fla-style keywords, autograd (gradcheck and values), fla's naive reference,
torch.compile, dtypes, zero-copy exchange, refusals. CUDA tests run where a GPU is present."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import TOLERANCE, assert_within, fla_naive  # noqa: E402

import kda  # noqa: E402
import kda.torch as kt  # noqa: E402

F64 = torch.float64
NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def make_inputs(
    seed: int = 0, B=1, T=7, H=1, HV=None, K=3, V=2, *, gate="log", beta_logits=False, N=None, dtype=F64
) -> dict[str, torch.Tensor]:
    """Time-major leaf tensors (requires_grad): raw gates when ``gate != "log"``, beta logits when
    ``beta_logits``; ``N`` initial states (default ``B``)."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    k = randn(B, T, H, K)
    x = {
        "q": randn(B, T, H, K),
        "k": k / k.norm(dim=-1, keepdim=True),
        "v": randn(B, T, HV, V),
        "g": randn(B, T, HV, K) if gate != "log" else -torch.rand(B, T, HV, K, generator=gen, dtype=F64),
        "beta": randn(B, T, HV) if beta_logits else torch.rand(B, T, HV, generator=gen, dtype=F64) * 1.5,
        "initial_state": randn(N or B, HV, K, V),
    }
    if gate != "log":
        x["A_log"] = randn(HV) * 0.5
        x["dt_bias"] = randn(HV * K) * 0.5
    return {n: t.to(dtype if n not in ("initial_state",) else F64).requires_grad_() for n, t in x.items()}


# option sets: how the inputs are drawn (heads, gate, beta logits) and the kda.torch keywords for them
OPTION_SETS = {
    "plain": ({}, {}),
    "gva": ({"H": 1, "HV": 2}, {}),
    "softplus+l2norm+sigmoid": (
        {"H": 1, "HV": 2, "gate": "softplus", "beta_logits": True},
        {"use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True},
    ),
    "lower_bound+sigmoid2": (
        {"gate": "lower_bound", "beta_logits": True},
        {
            "use_gate_in_kernel": True,
            "lower_bound": -2.0,
            "use_beta_sigmoid_in_kernel": True,
            "allow_neg_eigval": True,
        },
    ),
    "cu_seqlens": ({"T": 11, "N": 4}, {"cu_seqlens": torch.tensor([0, 4, 4, 9, 11])}),
}
FUNCTIONS = {"chunk": kt.chunk_kda, "recurrent": kt.fused_recurrent_kda}


def call(fn, x: dict[str, torch.Tensor], **kw):
    extra = {"chunk_size": 3} if fn is kt.chunk_kda else {}
    extra.update(kw)
    params = {n: x[n] for n in ("A_log", "dt_bias") if n in x}
    return fn(
        *(x[n] for n in NAMES[:5]),
        initial_state=x["initial_state"],
        output_final_state=True,
        **params,
        **extra,
    )


@pytest.mark.parametrize("name", OPTION_SETS)
@pytest.mark.parametrize("method", FUNCTIONS)
def test_gradcheck(name, method):
    shape, kw = OPTION_SETS[name]
    x = make_inputs(1, **shape)
    keys = list(x)

    def f(*tensors):
        return call(FUNCTIONS[method], dict(zip(keys, tensors)), **kw)

    # fast mode checks random projections u^T J v of the full Jacobian (one numerical derivative
    # per output instead of one per input element); test_gradient_values_* compare every element
    assert torch.autograd.gradcheck(f, tuple(x.values()), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


def _kda_options(shape: dict, kw: dict) -> dict:
    """The same option set for kda's own (NumPy) functions."""
    o: dict = {"layout": "time_major"}
    if kw.get("use_gate_in_kernel"):
        o["gate"] = "lower_bound" if "lower_bound" in kw else "softplus"
        if "lower_bound" in kw:
            o["lower_bound"] = kw["lower_bound"]
    if kw.get("use_qk_l2norm_in_kernel"):
        o["qk_l2norm"] = True
    if kw.get("use_beta_sigmoid_in_kernel"):
        o["beta_activation"] = "sigmoid2" if kw.get("allow_neg_eigval") else "sigmoid"
    if "cu_seqlens" in kw:
        o["cu_seqlens"] = kw["cu_seqlens"].numpy()
    return o


@pytest.mark.parametrize("name", OPTION_SETS)
@pytest.mark.parametrize("method", FUNCTIONS)
def test_adapter_is_bitwise_the_public_functions(name, method):
    """The adapter's forward and backward (which rebuilds the forward's validated call) give the
    bits of kda's public functions on the same arrays with the same options, a scale included."""
    shape, kw = OPTION_SETS[name]
    x = make_inputs(21, **{**shape, "T": 13 if "cu_seqlens" not in kw else shape["T"]})
    o, s = call(FUNCTIONS[method], x, **kw, scale=0.37)
    gen = torch.Generator().manual_seed(4)
    do, ds = torch.randn(o.shape, generator=gen, dtype=F64), torch.randn(s.shape, generator=gen, dtype=F64)
    ((o * do).sum() + (s * ds).sum()).backward()

    n = {k_: t.detach().numpy() for k_, t in x.items()}
    if "dt_bias" in n:
        n["dt_bias"] = n["dt_bias"].reshape(n["A_log"].shape[0], -1)
    opts = {**_kda_options(shape, kw), "scale": 0.37}
    params = {p: n[p] for p in ("initial_state", "A_log", "dt_bias") if p in n}
    inputs = [n[m] for m in NAMES[:5]]
    if method == "chunk":
        out = kda.chunk_kda(*inputs, **params, **opts, chunk_size=3, save_boundaries=True)
        grads = kda.chunk_kda_backward(
            *inputs, out.boundaries, do.numpy(), ds.numpy(), **params, **opts, chunk_size=3
        )
    else:  # the recurrent forward runs the decode kernel: kda.decode_kda on a pool of the states
        grads = kda.recurrent_kda_backward(*inputs, do.numpy(), ds.numpy(), **params, **opts)
        pool = np.array(params["initial_state"]) if "initial_state" in params else np.zeros(s.shape)
        gate = {p: params[p] for p in ("A_log", "dt_bias") if p in params}
        output = kda.decode_kda(*inputs, pool, np.arange(pool.shape[0]), **gate, **opts)
        out = kda.KdaOutput(output, pool, None)
    np.testing.assert_array_equal(o.detach().numpy(), out.output)
    np.testing.assert_array_equal(s.detach().numpy(), out.final_state)
    for name_ in x:
        want = getattr(grads, name_).reshape(x[name_].shape)
        np.testing.assert_array_equal(x[name_].grad.numpy(), want, err_msg=name_)


@pytest.mark.parametrize("name", OPTION_SETS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradient_values_match_the_recurrence(name, dtype):
    """Adapter gradients (chunked) against kda.recurrent_kda_backward in float64, every input."""
    shape, kw = OPTION_SETS[name]
    shape = {**shape, "T": 40, "K": 5, "V": 4}
    if "cu_seqlens" in kw:
        kw = {"cu_seqlens": torch.tensor([0, 13, 13, 30, 40])}
    x = make_inputs(2, **shape, dtype=dtype)
    o, s = call(kt.chunk_kda, x, **{**kw, "chunk_size": 8})
    gen = torch.Generator().manual_seed(3)
    do, ds = torch.randn(o.shape, generator=gen, dtype=F64), torch.randn(s.shape, generator=gen, dtype=F64)
    ((o * do.to(dtype)).sum() + (s * ds.to(s.dtype)).sum()).backward()

    n = {k_: t.detach().double().numpy() for k_, t in x.items()}
    if "dt_bias" in n:
        n["dt_bias"] = n["dt_bias"].reshape(n["A_log"].shape[0], -1)
    opts = _kda_options(shape, kw)
    params = {p: n[p] for p in ("initial_state", "A_log", "dt_bias") if p in n}
    ref = kda.recurrent_kda(*(n[m] for m in NAMES[:5]), **params, **opts)
    grads = kda.recurrent_kda_backward(*(n[m] for m in NAMES[:5]), do.numpy(), ds.numpy(), **params, **opts)
    tol = TOLERANCE[np.dtype(np.float64 if dtype == F64 else np.float32)]
    assert_within(o.detach(), ref.output, tol=tol, dtype="any", name="o")
    assert_within(s.detach(), ref.final_state, tol=tol, dtype="any", name="final_state")
    for name_ in x:
        expected = getattr(grads, name_).reshape(x[name_].shape)
        assert_within(x[name_].grad, expected, tol=tol, dtype="any", name=f"d{name_}")


def test_fused_recurrent_gradients_equal_kda_recurrent_backward():
    shape, kw = OPTION_SETS["softplus+l2norm+sigmoid"]
    x = make_inputs(4, **{**shape, "T": 20})
    o, _ = call(kt.fused_recurrent_kda, x, **kw)
    do = torch.ones_like(o)
    (o * do).sum().backward()
    n = {k_: t.detach().numpy() for k_, t in x.items()}
    n["dt_bias"] = n["dt_bias"].reshape(2, -1)
    opts = _kda_options(shape, kw)
    params = {p: n[p] for p in ("initial_state", "A_log", "dt_bias")}
    grads = kda.recurrent_kda_backward(*(n[m] for m in NAMES[:5]), do.numpy(), **params, **opts)
    for name_ in x:
        np.testing.assert_array_equal(x[name_].grad.numpy(), getattr(grads, name_).reshape(x[name_].shape))


# ----------------------------------------------------------------------------------------------
# flash-linear-attention's naive reference


def _load_fla_naive():
    """``fla/ops/kda/naive.py`` by path (``import fla.ops`` needs triton), made to compute in
    float64: it casts its inputs with ``x.to(torch.float)``, so its ``torch`` is given a
    ``float`` that is float64 (everything else is torch itself)."""
    mod = fla_naive(fresh=True)  # a module of its own: its torch is replaced below
    mod.torch = _Float64Torch()
    return mod


class _Float64Torch:
    """``torch`` with ``torch.float`` meaning float64."""

    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _fla_gate(g, A_log, dt_bias, lower_bound):
    """fla 0.6's ``naive_kda_gate`` / ``naive_kda_lowerbound_gate`` (gate.py imports triton)."""
    HV = g.shape[-2]
    x = g + dt_bias.view(HV, -1)
    if lower_bound is None:
        return -A_log.view(HV, 1).exp() * torch.nn.functional.softplus(x)
    return lower_bound * torch.sigmoid(A_log.view(HV, 1).exp() * x)


def _fla_l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("lower_bound", [None, -3.0])
def test_matches_fla_naive_recurrent_kda(lower_bound):
    """Forward and every gradient against fla's naive_recurrent_kda (options applied the way
    fla's kernels apply them), float64."""
    fla = _load_fla_naive()
    x = make_inputs(5, T=45, H=2, HV=4, K=6, V=5, gate="softplus", beta_logits=True)
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if lower_bound is not None:
        kw["lower_bound"] = lower_bound
    o, s = call(kt.chunk_kda, x, **{**kw, "chunk_size": 16})
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(6), dtype=F64)
    ours = torch.autograd.grad((o * w).sum() + s.sum(), list(x.values()))

    g = _fla_gate(x["g"], x["A_log"], x["dt_bias"], lower_bound)
    q, k = _fla_l2norm(x["q"]), _fla_l2norm(x["k"])
    o_ref, s_ref = fla.naive_recurrent_kda(
        q, k, x["v"], g, torch.sigmoid(x["beta"]), initial_state=x["initial_state"], output_final_state=True
    )
    assert o_ref.dtype == F64
    theirs = torch.autograd.grad((o_ref * w).sum() + s_ref.sum(), list(x.values()))
    tol = TOLERANCE[np.dtype(np.float64)]
    assert_within(o.detach(), o_ref.detach(), tol=tol, name="o")
    assert_within(s.detach(), s_ref.detach(), tol=tol, name="final_state")
    for name_, a, b in zip(x, ours, theirs):
        assert_within(a, b, tol=tol, name=f"d{name_}")


# ----------------------------------------------------------------------------------------------
# torch.compile and the custom ops


class TinyKda(torch.nn.Module):
    """Projections, gate and beta as a KDA layer computes them, then kda.torch.chunk_kda."""

    def __init__(self, D=8, H=2, K=4):
        super().__init__()
        self.H, self.K = H, K
        self.qkv = torch.nn.Linear(D, 3 * H * K)
        self.gate = torch.nn.Linear(D, H * K)
        self.beta = torch.nn.Linear(D, H)
        self.A_log = torch.nn.Parameter(torch.zeros(H))
        self.dt_bias = torch.nn.Parameter(torch.zeros(H * K))
        self.out = torch.nn.Linear(H * K, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, self.K).unbind(2)
        o, _ = kt.chunk_kda(
            q,
            k,
            v,
            self.gate(x).view(B, T, self.H, self.K),
            self.beta(x),
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            chunk_size=4,
        )
        return self.out(o.reshape(B, T, -1))


def test_torch_compile_fullgraph():
    """fullgraph=True traces the custom op (fake implementation, autograd formula); aot_eager
    keeps it quick (the inductor backend compiles C++: measured 114 s here)."""
    torch.manual_seed(0)
    model, x = TinyKda(), torch.randn(2, 10, 8)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.square().sum().backward()
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_opcheck(method):
    """torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch."""
    x = make_inputs(7, T=6, H=1, HV=2, N=2, gate="softplus")
    x["dt_bias"] = x["dt_bias"].detach().reshape(2, 3).requires_grad_()
    args = (*(x[n] for n in NAMES), torch.tensor([0, 2, 6]))
    options = (method, 0.5, 4, True, "softplus", None, "sigmoid")
    result = torch.library.opcheck(torch.ops.kda.forward.default, (*args, *options))
    assert set(result.values()) == {"SUCCESS"}, result


# ----------------------------------------------------------------------------------------------
# Keywords


def _plain(seed=8, **shape):
    x = make_inputs(seed, **shape)
    return [t.detach() for t in (x[n] for n in NAMES[:5])], x["initial_state"].detach()


def test_final_state_only_when_asked_and_state_v_first():
    (q, k, v, g, beta), s0 = _plain()
    o, s = kt.chunk_kda(q, k, v, g, beta, initial_state=s0)
    assert s is None
    o2, s2 = kt.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o3, s3 = kt.chunk_kda(
        q, k, v, g, beta, initial_state=s0.transpose(-1, -2), output_final_state=True, state_v_first=True
    )
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    torch.testing.assert_close(o3, o2, rtol=0, atol=0)
    torch.testing.assert_close(s3, s2.transpose(-1, -2), rtol=0, atol=0)
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        _, s4 = kt.chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            initial_state=s0.transpose(-1, -2),
            output_final_state=True,
            transpose_state_layout=True,
        )
    torch.testing.assert_close(s4, s3, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kw",
    [
        {"safe_gate": True, "lower_bound": -5.0},
        {"disable_recompute": True},
        {"use_graph": True, "max_num_seqs": 1},
        {"cp_context": None, "return_intermediate_states": False},
    ],
)
def test_no_effect_keywords(kw):
    (q, k, v, g, beta), s0 = _plain()
    expected = kt.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    got = kt.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, **kw)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_scale_and_chunk_size_are_honoured():
    (q, k, v, g, beta), _ = _plain(T=20)
    base, _ = kt.chunk_kda(q, k, v, g, beta, chunk_size=64)
    scaled, _ = kt.chunk_kda(q, k, v, g, beta, scale=2 * 3**-0.5, chunk_size=5)
    torch.testing.assert_close(scaled, 2 * base, rtol=1e-12, atol=1e-12)


def test_unknown_keyword_is_a_type_error():
    (q, k, v, g, beta), _ = _plain()
    with pytest.raises(TypeError, match="'use_qk_l2norm'"):
        kt.chunk_kda(q, k, v, g, beta, use_qk_l2norm=True)
    with pytest.raises(TypeError, match="'use_qk_l2norm'"):
        kt.fused_recurrent_kda(q, k, v, g, beta, chunk_size=16, use_qk_l2norm=True)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"A_log": torch.zeros(1)}, "A_log given without use_gate_in_kernel"),
        ({"dt_bias": torch.zeros(3)}, "dt_bias given without use_gate_in_kernel"),
        ({"lower_bound": -1.0}, "lower_bound=-1.0 given without use_gate_in_kernel"),
        ({"use_gate_in_kernel": True}, "A_log must be given"),
        ({"use_gate_in_kernel": True, "A_log": torch.zeros(1), "safe_gate": True}, "lower_bound must be set"),
        ({"use_gate_in_kernel": True, "safe_gate": True, "lower_bound": -6.0}, r"safe range \[-5, 0\)"),
        ({"use_gate_in_kernel": True, "lower_bound": 0.5}, "lower_bound must be a finite float < 0"),
        (
            {"use_gate_in_kernel": True, "A_log": torch.zeros(1), "dt_bias": torch.zeros(4)},
            r"dt_bias must have HV \* K = 1 \* 3 = 3 elements",
        ),
        ({"allow_neg_eigval": True}, "requires use_beta_sigmoid_in_kernel"),
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
        (
            {"cu_seqlens": torch.tensor([0, 7]), "initial_state": torch.zeros(2, 1, 3, 2, dtype=F64)},
            "initial_state",
        ),
    ],
)
def test_refusals(kw, match):
    (q, k, v, g, beta), _ = _plain()
    with pytest.raises(kda.InvalidInputError, match=match):
        kt.chunk_kda(q, k, v, g, beta, **kw)


def test_kda_errors_pass_through_and_types():
    (q, k, v, g, beta), _ = _plain()
    with pytest.raises(kda.InvalidInputError, match="g must"):
        kt.chunk_kda(q, k, v, -g, beta)
    with pytest.raises(kda.InvalidTypeError, match=r"q must be a torch\.Tensor"):
        kt.chunk_kda(q.numpy(), k, v, g, beta)
    with pytest.raises(kda.InvalidInputError, match="time-major"):
        kt.chunk_kda(q[0], k, v, g, beta)
    with pytest.raises(kda.InvalidInputError, match="batch size must be 1"):
        kt.chunk_kda(*(torch.cat([x, x]) for x in (q, k, v, g, beta)), cu_seqlens=torch.tensor([0, 7]))


# ----------------------------------------------------------------------------------------------
# dtypes, copies, inputs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_computes_in_float32(dtype):
    x = make_inputs(9, T=12, H=2, gate="softplus", beta_logits=True, dtype=dtype)
    x["A_log"], x["dt_bias"] = (x[n].detach().float().requires_grad_() for n in ("A_log", "dt_bias"))
    x["initial_state"] = x["initial_state"].detach().float().requires_grad_()
    kw = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    o, s = call(kt.chunk_kda, x, **kw)
    assert o.dtype == dtype and s.dtype == torch.float32
    o.float().sum().backward()
    x32 = {n: t.detach().float().requires_grad_() for n, t in x.items()}
    o32, s32 = call(kt.chunk_kda, x32, **kw)
    o32.sum().backward()
    torch.testing.assert_close(o, o32.to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(s, s32, rtol=0, atol=0)
    for n in x:
        assert x[n].grad.dtype == x[n].dtype
        torch.testing.assert_close(x[n].grad, x32[n].grad.to(x[n].dtype), rtol=0, atol=0)


def test_cpu_tensors_reach_kda_without_copies(monkeypatch):
    (q, k, v, g, beta), s0 = _plain()
    seen = {}
    real = kda._entry.host.forward

    def spy(static, arrays, offsets):
        seen.update(zip(NAMES, arrays))
        return real(static, arrays, offsets)

    monkeypatch.setattr(kda._entry.host, "forward", spy)
    kt.chunk_kda(q, k, v, g, beta, initial_state=s0)
    for name, t in zip(NAMES, (q, k, v, g, beta, s0)):
        assert isinstance(seen[name], np.ndarray)
        assert seen[name].__array_interface__["data"][0] == t.data_ptr(), name


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_backward_reuses_the_forward_validation(monkeypatch, fn):
    """The backward rebuilds the call the forward validated: no option checks, no finiteness scan
    of the inputs again; only the cotangents, new in the backward, are scanned."""
    x = make_inputs(13, T=9, H=1, HV=2, gate="softplus")
    o, s = call(FUNCTIONS[fn], x, use_gate_in_kernel=True)
    checked, scanned = [], []
    real_check, real_scan = kda._entry.call.check_options_call, kda._entry.call._check_finite
    monkeypatch.setattr(kda._entry.call, "check_options_call", lambda *a: checked.append(1) or real_check(*a))
    monkeypatch.setattr(
        kda._entry.call,
        "_check_finite",
        lambda xp, name, a, **kw: scanned.append(name) or real_scan(xp, name, a, **kw),
    )
    (o.sum() + s.sum()).backward()
    assert checked == [] and scanned == ["grad_output", "grad_final_state"]
    assert all(x[n].grad is not None for n in x)


def test_backward_refuses_a_non_finite_output_gradient():
    x = make_inputs(14, T=9)
    o, _ = call(kt.chunk_kda, x)
    do = torch.ones_like(o)
    do[0, 3, 0, 1] = math.nan
    with pytest.raises(kda.InvalidInputError, match="grad_output"):
        o.backward(do)


def test_inputs_are_not_modified_and_outputs_do_not_alias_them():
    x = make_inputs(10, T=9, H=1, HV=2, gate="softplus")
    before = {n: t.detach().clone() for n, t in x.items()}
    o, s = call(kt.chunk_kda, x, use_gate_in_kernel=True)
    (o.sum() + s.sum()).backward()
    for n, t in x.items():
        torch.testing.assert_close(t.detach(), before[n], rtol=0, atol=0)
        assert t.grad.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_no_warnings_and_no_grad_mode():
    (q, k, v, g, beta), s0 = _plain()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            o, _ = kt.chunk_kda(q, k, v, g, beta, initial_state=s0)
        with torch.inference_mode():
            o2, _ = kt.chunk_kda(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    assert not o.requires_grad and math.isfinite(float(o.sum()))


# ----------------------------------------------------------------------------------------------
# CUDA tensors: kda's cuda backend through CuPy, zero-copy, on PyTorch's current stream


@cuda
@pytest.mark.parametrize("name", ["plain", "softplus+l2norm+sigmoid", "cu_seqlens"])
def test_cuda_tensors_match_cpu(name):
    pytest.importorskip("cupy")
    shape, kw = OPTION_SETS[name]
    shape = {**shape, "T": 70, "K": 16, "V": 8}
    if "cu_seqlens" in kw:
        kw = {"cu_seqlens": torch.tensor([0, 20, 20, 51, 70])}
    x = make_inputs(11, **shape)
    xc = {n: t.detach().cuda().requires_grad_() for n, t in x.items()}
    kwc = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        o, s = call(kt.chunk_kda, xc, **kwc, chunk_size=16)
        (o.sum() + s.square().sum()).backward()
    stream.synchronize()
    o_ref, s_ref = call(kt.chunk_kda, x, **kw, chunk_size=16)
    (o_ref.sum() + s_ref.square().sum()).backward()
    assert o.device.type == "cuda" and s.device.type == "cuda"
    tol = TOLERANCE[np.dtype(np.float64)]
    assert_within(o.detach().cpu(), o_ref.detach(), tol=tol, name="o")
    for n in x:
        assert_within(xc[n].grad.cpu(), x[n].grad, tol=tol, name=f"d{n}")


@cuda
def test_cuda_bfloat16_and_zero_copy(monkeypatch):
    cupy = pytest.importorskip("cupy")
    x = make_inputs(12, T=64, H=2, K=16, V=16, dtype=torch.float32)
    xc = {n: t.detach().cuda() for n, t in x.items()}
    seen = {}
    real = kda._entry.host.forward

    def spy(static, arrays, offsets):
        seen["q"] = arrays[0]
        return real(static, arrays, offsets)

    monkeypatch.setattr(kda._entry.host, "forward", spy)
    call(kt.chunk_kda, xc, chunk_size=16)
    assert isinstance(seen["q"], cupy.ndarray) and seen["q"].data.ptr == xc["q"].data_ptr()
    ob, _ = call(kt.chunk_kda, {n: t.bfloat16() if n != "initial_state" else t for n, t in xc.items()})
    assert ob.dtype == torch.bfloat16 and ob.device.type == "cuda"


# ----------------------------------------------------------------------------------------------
# fla's conventions (issue 19): A_log by element count, one keyword dict, intermediate states


def _varlen_like_fla(seed=11, cu=(0, 15, 40, 40, 64), H=2, D=8, dtype=F64):
    """fla's test_chunk_varlen inputs, scaled down: A_log ``[1, 1, H, 1]``, dt_bias ``[H * D]``."""
    gen = torch.Generator().manual_seed(seed)
    T, N = cu[-1], len(cu) - 1

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(dtype).requires_grad_()

    x = {
        "q": randn(1, T, H, D),
        "k": randn(1, T, H, D),
        "v": randn(1, T, H, D),
        "g": randn(1, T, H, D),
        "beta": randn(1, T, H),
        "initial_state": randn(N, H, D, D),
        "A_log": torch.log(torch.empty(1, 1, H, 1, dtype=F64).uniform_(1, 4, generator=gen))
        .to(dtype)
        .requires_grad_(),
        "dt_bias": randn(H * D),
    }
    return x, torch.tensor(cu)


def test_fla_varlen_case_with_A_log_1_1_H_1():
    """fla's failing case: ``A_log [1, 1, H, 1]`` with cu_seqlens; every gradient against fla's
    naive recurrence per sequence, ``dA_log`` in the shape given."""
    fla = _load_fla_naive()
    x, cu = _varlen_like_fla()
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    o, s = call(kt.chunk_kda, x, cu_seqlens=cu, cu_seqlens_cpu=cu, **kw)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    ours = torch.autograd.grad((o * w).sum() + s.sum(), list(x.values()))
    assert ours[NAMES.index("A_log")].shape == (1, 1, 2, 1)
    g = _fla_gate(x["g"], x["A_log"], x["dt_bias"], None)
    q, k, beta = _fla_l2norm(x["q"]), _fla_l2norm(x["k"]), torch.sigmoid(x["beta"])
    outs, states = [], []
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_i, s_i = fla.naive_recurrent_kda(
            q[:, a:b],
            k[:, a:b],
            x["v"][:, a:b],
            g[:, a:b],
            beta[:, a:b],
            initial_state=x["initial_state"][i : i + 1],
            output_final_state=True,
        )
        outs.append(o_i)
        states.append(s_i)
    o_ref, s_ref = torch.cat(outs, 1), torch.cat(states)
    theirs = torch.autograd.grad((o_ref * w).sum() + s_ref.sum(), list(x.values()))
    tol = TOLERANCE[np.dtype(np.float64)]
    assert_within(o.detach(), o_ref.detach(), tol=tol, name="o")
    assert_within(s.detach(), s_ref.detach(), tol=tol, name="final_state")
    for name_, a, b in zip(x, ours, theirs):
        assert_within(a, b, tol=tol, name=f"d{name_}")


def test_one_keyword_dict_serves_both_ops():
    """fla's layer passes one dict to chunk_kda and fused_recurrent_kda; the recurrent output
    follows v's dtype."""
    x, cu = _varlen_like_fla(cu=(0, 10, 24))
    kw = dict(
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        initial_state=x["initial_state"],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        safe_gate=True,
        lower_bound=-5.0,
        chunk_size=32,
        disable_recompute=False,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu,
        use_graph=False,
        max_num_seqs=None,
        return_intermediate_states=False,
        cp_context=None,
    )
    args = [x[n] for n in NAMES[:5]]
    o1, s1 = kt.chunk_kda(*args, **kw)
    o2, s2 = kt.fused_recurrent_kda(*args, **kw)
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s1, rtol=1e-10, atol=1e-10)
    mixed = [t.detach().float() for t in args]
    mixed[2] = mixed[2].bfloat16()
    kw32 = {
        **kw,
        "A_log": x["A_log"].detach().float(),
        "dt_bias": x["dt_bias"].detach().float(),
        "initial_state": x["initial_state"].detach().float(),
    }
    assert kt.fused_recurrent_kda(*mixed, **kw32)[0].dtype == torch.bfloat16  # v's dtype, as fla
    assert kt.chunk_kda(*mixed, **kw32)[0].dtype == torch.float32  # q's
    with pytest.raises(kda.InvalidInputError, match="fused_recurrent_kda"):
        kt.fused_recurrent_kda(*args, return_intermediate_states=True)
    with pytest.raises(TypeError, match="'unknown'"):
        kt.fused_recurrent_kda(*args, **kw, unknown=1)
    with pytest.raises(kda.InvalidInputError, match=r"A_log must have HV = 2 elements"):
        kt.chunk_kda(*args, **{**kw, "A_log": torch.zeros(1, 3)})


@pytest.mark.parametrize("state_v_first", [False, True])
def test_intermediate_states_values_and_gradients(state_v_first):
    """``h[:, t]`` is the state at the start of chunk ``t`` (from the recurrence over the prefix),
    packed in sequence order with cu_seqlens; gradients through ``h`` pass gradcheck."""
    x, cu = _varlen_like_fla(cu=(0, 9, 9, 20), D=3)
    s0 = x["initial_state"]
    if state_v_first:
        s0 = s0.detach().transpose(-1, -2).contiguous().requires_grad_()
    args = [x[n] for n in NAMES[:5]]
    kw = dict(use_gate_in_kernel=True, cu_seqlens=cu, chunk_size=4, state_v_first=state_v_first)

    def fn(*a):
        return kt.chunk_kda(
            *a[:5],
            initial_state=a[5],
            A_log=a[6],
            dt_bias=a[7],
            output_final_state=True,
            return_intermediate_states=True,
            **kw,
        )

    _, _, h = fn(*args, s0, x["A_log"], x["dt_bias"])
    assert h.shape == ((1, 3 + 0 + 3, 2, 3, 3)) and h.dtype == F64
    # chunk 4 of the packed order is sequence 2's second chunk: the state after its first 4 steps
    sl = slice(9, 13)
    _, s_pre = kt.fused_recurrent_kda(
        *(t[:, sl] for t in args),
        initial_state=s0[2:3],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        output_final_state=True,
        use_gate_in_kernel=True,
        state_v_first=state_v_first,
    )
    torch.testing.assert_close(h[0, 4], s_pre[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h[0, 3], s0[2], rtol=0, atol=0)
    assert torch.autograd.gradcheck(fn, (*args, s0, x["A_log"], x["dt_bias"]), fast_mode=True)
    with torch.inference_mode():
        h2 = fn(*args, s0, x["A_log"], x["dt_bias"])[2]
    torch.testing.assert_close(h2, h.detach(), rtol=0, atol=0)


def test_intermediate_states_like_fla_test():
    """fla's test_chunk_return_intermediate_states (scaled down): bfloat16, inference mode."""
    B, T, H, D = 2, 100, 2, 8
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D)).to(torch.bfloat16)
    beta = torch.rand(B, T, H).to(torch.bfloat16)
    with torch.inference_mode():
        o, s, h = kt.chunk_kda(q, k, v, g, beta, output_final_state=True, return_intermediate_states=True)
        assert o.shape == (B, T, H, D) and s.shape == (B, H, D, D)
        assert h.shape == (B, math.ceil(T / 64), H, D, D) and h.dtype == torch.bfloat16
        cu = torch.tensor([0, 50, 200])
        flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
        o, s, h = kt.chunk_kda(*flat, output_final_state=True, return_intermediate_states=True, cu_seqlens=cu)
        assert o.shape == (1, B * T, H, D) and s.shape == (2, H, D, D)
        assert h.shape == (1, 1 + 3, H, D, D) and h.dtype == torch.bfloat16
