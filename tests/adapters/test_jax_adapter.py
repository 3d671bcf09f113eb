"""kda.jax: jax.jit and jax.grad results against kda's float64 recurrence, keywords, dtypes."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from helpers import TOLERANCE, assert_within  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import kda  # noqa: E402
import kda.jax as kj  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
TOL64 = TOLERANCE[np.dtype(np.float64)]


@pytest.fixture
def x64():
    """float64 in JAX for one test (the setting is restored afterwards)."""
    with jax.enable_x64(True):
        yield


def make_inputs(seed=0, B=1, T=30, H=2, HV=4, K=5, V=4, *, gate="softplus", N=None) -> dict[str, np.ndarray]:
    """Time-major float64 NumPy inputs; raw gates and beta logits unless ``gate == "log"``."""
    rng = np.random.default_rng(seed)
    x = {
        "q": rng.standard_normal((B, T, H, K)),
        "k": rng.standard_normal((B, T, H, K)),
        "v": rng.standard_normal((B, T, HV, V)),
        "g": rng.standard_normal((B, T, HV, K)) if gate != "log" else -rng.uniform(size=(B, T, HV, K)),
        "beta": rng.standard_normal((B, T, HV)) if gate != "log" else rng.uniform(size=(B, T, HV)),
        "initial_state": rng.standard_normal((N or B, HV, K, V)),
    }
    if gate != "log":
        x["A_log"] = 0.5 * rng.standard_normal(HV)
        x["dt_bias"] = 0.5 * rng.standard_normal(HV * K)
    return x


# kda.jax keywords -> kda's own options
OPTION_SETS = {
    "plain": ({"gate": "log", "H": 1, "HV": 1}, {}, {}),
    "gva+softplus+l2norm+sigmoid": (
        {},
        {"use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True},
        {"gate": "softplus", "qk_l2norm": True, "beta_activation": "sigmoid"},
    ),
    "lower_bound+sigmoid2": (
        {},
        {
            "use_gate_in_kernel": True,
            "lower_bound": -2.5,
            "use_beta_sigmoid_in_kernel": True,
            "allow_neg_eigval": True,
        },
        {"gate": "lower_bound", "lower_bound": -2.5, "beta_activation": "sigmoid2"},
    ),
}


def _recurrence(x: dict[str, np.ndarray], opts: dict, do=None, ds=None, cu=None):
    params = {n: x[n] for n in ("initial_state", "A_log", "dt_bias") if n in x}
    if "dt_bias" in params:
        params["dt_bias"] = params["dt_bias"].reshape(x["v"].shape[2], -1)
    kw = {**params, **opts, "layout": "time_major", "cu_seqlens": cu}
    inputs = [x[n] for n in NAMES[:5]]
    if do is None:
        return kda.recurrent_kda(*inputs, **kw)
    return kda.recurrent_kda_backward(*inputs, do, ds, **kw)


def _jax_fn(fn, keys, kw, cu=None):
    """``(arrays...) -> (o, final_state)`` for the JAX adapter."""

    def f(*arrays):
        a = dict(zip(keys, arrays))
        return fn(
            *(a[n] for n in NAMES[:5]),
            **{n: a[n] for n in keys[5:]},
            output_final_state=True,
            cu_seqlens=cu,
            **kw,
        )

    return f


@pytest.mark.parametrize("name", OPTION_SETS)
def test_jit_and_grad_match_the_recurrence(x64, name):
    shape, kw, opts = OPTION_SETS[name]
    x = make_inputs(1, **shape)
    keys = tuple(x)
    rng = np.random.default_rng(2)
    ref = _recurrence(x, opts)
    do, ds = rng.standard_normal(ref.output.shape), rng.standard_normal(ref.final_state.shape)
    f = _jax_fn(kj.chunk_kda, keys, {**kw, "chunk_size": 8})

    def loss(*arrays):
        o, s = f(*arrays)
        return jnp.sum(o * do) + jnp.sum(s * ds)

    args = [jnp.asarray(x[n]) for n in keys]
    o, s = jax.jit(f)(*args)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(keys)))))(*args)
    expected = _recurrence(x, opts, do, ds)
    assert_within(np.asarray(o), ref.output, tol=TOL64, name="o")
    assert_within(np.asarray(s), ref.final_state, tol=TOL64, name="final_state")
    for n, gr in zip(keys, grads):
        assert_within(np.asarray(gr), getattr(expected, n).reshape(x[n].shape), tol=TOL64, name=f"d{n}")


def test_cu_seqlens_traced_under_jit(x64):
    """Offsets passed as a traced argument: the boundaries are kept at a static bound."""
    x = make_inputs(3, T=29, gate="log", H=1, HV=2, N=4)
    cu = np.array([0, 9, 9, 20, 29])
    opts = {}
    keys = tuple(x)

    @jax.jit
    def loss(cu, *arrays):
        o, s = _jax_fn(kj.chunk_kda, keys, {"chunk_size": 4}, cu)(*arrays)
        return jnp.sum(o**2) + jnp.sum(s)

    args = [jnp.asarray(x[n]) for n in keys]
    grads = jax.grad(loss, argnums=tuple(range(1, len(keys) + 1)))(jnp.asarray(cu), *args)
    ref = _recurrence(x, opts, cu=cu)
    expected = _recurrence(x, opts, 2 * ref.output, np.ones_like(ref.final_state), cu=cu)
    o, _ = jax.jit(lambda c, *a: _jax_fn(kj.chunk_kda, keys, {"chunk_size": 4}, c)(*a))(
        jnp.asarray(cu), *args
    )
    assert_within(np.asarray(o), ref.output, tol=TOL64, name="o")
    for n, gr in zip(keys, grads):
        assert_within(np.asarray(gr), getattr(expected, n), tol=TOL64, name=f"d{n}")


def test_fused_recurrent_and_finite_differences(x64):
    shape, kw, opts = OPTION_SETS["gva+softplus+l2norm+sigmoid"]
    x = make_inputs(4, **{**shape, "T": 6, "K": 3, "V": 2})
    keys = tuple(x)
    args = [jnp.asarray(x[n]) for n in keys]
    f = _jax_fn(kj.fused_recurrent_kda, keys, kw)
    ref = _recurrence(x, opts)
    assert_within(np.asarray(f(*args)[0]), ref.output, tol=TOL64, name="o")
    check_grads(lambda *a: f(*a)[0], args, order=1, modes=["rev"])
    check_grads(
        lambda *a: _jax_fn(kj.chunk_kda, keys, {**kw, "chunk_size": 4})(*a)[1], args, order=1, modes=["rev"]
    )


def test_float32_bfloat16_and_vmap():
    x = make_inputs(5, T=20, gate="log", H=1, HV=1)
    ref = _recurrence(x, {})
    args32 = [jnp.asarray(x[n], dtype=jnp.float32) for n in NAMES[:5]]
    s0 = jnp.asarray(x["initial_state"], dtype=jnp.float32)
    o, s = kj.chunk_kda(*args32, initial_state=s0, output_final_state=True)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert_within(np.asarray(o), ref.output, tol=TOLERANCE[np.dtype(np.float32)], dtype="any", name="o")
    ob, _ = kj.chunk_kda(*(a.astype(jnp.bfloat16) for a in args32), initial_state=s0)
    assert ob.dtype == jnp.bfloat16
    o16 = kj.chunk_kda(*(a.astype(jnp.bfloat16).astype(jnp.float32) for a in args32), initial_state=s0)[0]
    np.testing.assert_array_equal(np.asarray(ob), np.asarray(o16.astype(jnp.bfloat16)))
    # vmap over a stack of two problems: the callback runs once per element
    stacked = [jnp.stack([a, 2 * a if i == 2 else a]) for i, a in enumerate(args32)]
    ov = jax.vmap(lambda *a: kj.chunk_kda(*a)[0])(*stacked)
    np.testing.assert_allclose(np.asarray(ov[0]), np.asarray(kj.chunk_kda(*args32)[0]), rtol=0, atol=0)


def test_keywords_and_errors():
    x = make_inputs(6, T=8, gate="log", H=1, HV=1)
    args = [jnp.asarray(x[n], dtype=jnp.float32) for n in NAMES[:5]]
    with pytest.raises(TypeError, match="'use_qk_l2norm'"):
        kj.chunk_kda(*args, use_qk_l2norm=True)
    with pytest.raises(kda.InvalidInputError, match="A_log given without use_gate_in_kernel"):
        kj.chunk_kda(*args, A_log=jnp.zeros(1))
    with pytest.raises(kda.InvalidInputError, match="requires use_beta_sigmoid_in_kernel"):
        kj.chunk_kda(*args, allow_neg_eigval=True)
    with pytest.raises(kda.InvalidTypeError, match="q must be a JAX array"):
        kj.chunk_kda([1.0], *args[1:])
    with pytest.raises(kda.InvalidInputError, match=r"kda\.torch only"):
        kj.chunk_kda(*args, cp_context=object())
    o, s = kj.chunk_kda(*args, disable_recompute=True, safe_gate=True, lower_bound=-5.0)
    o2, _ = kj.chunk_kda(*args)
    assert s is None
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))


def test_pool_keywords_that_do_not_fit_together_are_refused():
    """The pool call's keywords, checked once by the host router for kda.jax as for kda.torch."""
    x = make_inputs(7, T=1, gate="log", H=1, HV=1)
    args = [jnp.asarray(x[n], dtype=jnp.float32) for n in NAMES[:5]]
    pool = jnp.zeros((3, 1, 5, 4), jnp.float32)
    slots = jnp.array([2], jnp.int32)
    with pytest.raises(kda.InvalidInputError, match="need inplace_final_state=True"):
        kj.fused_recurrent_kda(*args, initial_state=pool, ssm_state_indices=slots)
    with pytest.raises(kda.InvalidInputError, match="needs initial_state"):
        kj.fused_recurrent_kda(*args, inplace_final_state=True, ssm_state_indices=slots)
    with pytest.raises(kda.InvalidInputError, match="num_accepted_tokens needs ssm_state_indices"):
        kj.fused_recurrent_kda(
            *args, initial_state=pool, inplace_final_state=True, num_accepted_tokens=jnp.array([1], jnp.int32)
        )


def test_fla_conventions_match_kda_torch(x64):
    """``A_log [1, 1, HV, 1]`` (gradient in that shape), ``return_intermediate_states`` with its
    gradient, and the recurrent output in v's dtype: the same numbers as kda.torch."""
    torch = pytest.importorskip("torch")
    import kda.torch as kt

    x = make_inputs(9, T=21, N=3)
    x["A_log"] = x["A_log"].reshape(1, 1, -1, 1)
    x["q"], x["k"], x["v"], x["g"], x["beta"] = (x[n][:1] for n in ("q", "k", "v", "g", "beta"))
    cu = np.array([0, 5, 5, 21])
    kw = dict(use_gate_in_kernel=True, output_final_state=True, return_intermediate_states=True, chunk_size=4)
    w = np.random.default_rng(1).standard_normal((1, 2 + 4, 4, 5, 4))

    def loss_jax(*a):
        o, s, h = kj.chunk_kda(
            *a[:5], initial_state=a[5], A_log=a[6], dt_bias=a[7], cu_seqlens=jnp.asarray(cu), **kw
        )
        return jnp.sum(o**2) + jnp.sum(s) + jnp.sum(h * w), h

    (_, h), grads = jax.value_and_grad(loss_jax, argnums=tuple(range(8)), has_aux=True)(
        *(jnp.asarray(x[n]) for n in NAMES)
    )
    assert h.shape == w.shape and grads[6].shape == (1, 1, 4, 1)
    t = {n: torch.tensor(x[n], requires_grad=True) for n in NAMES}
    o, s, ht = kt.chunk_kda(
        *(t[n] for n in NAMES[:5]),
        initial_state=t["initial_state"],
        A_log=t["A_log"],
        dt_bias=t["dt_bias"],
        cu_seqlens=torch.tensor(cu),
        **kw,
    )
    ((o**2).sum() + s.sum() + (ht * torch.tensor(w)).sum()).backward()
    for n, gr in zip(NAMES, grads):
        assert_within(np.asarray(gr), t[n].grad.numpy(), tol=TOL64, name=f"d{n}")
    mixed = [jnp.asarray(x[n], dtype=jnp.float32) for n in NAMES[:5]]
    mixed[2], mixed[3] = mixed[2].astype(jnp.bfloat16), -jnp.abs(mixed[3])
    assert kj.fused_recurrent_kda(*mixed)[0].dtype == jnp.bfloat16


def test_backward_reuses_the_forward_validation(x64, monkeypatch):
    """jax.grad validates the inputs and options once, in the forward callback; the backward
    callback rebuilds that call and scans only the cotangents."""
    x = make_inputs(5)
    keys = tuple(x)
    f = _jax_fn(kj.chunk_kda, keys, {"use_gate_in_kernel": True, "chunk_size": 8})
    checked, scanned = [], []
    real_check, real_scan = kda._entry.call.check_options_call, kda._entry.call._check_finite
    monkeypatch.setattr(kda._entry.call, "check_options_call", lambda *a: checked.append(1) or real_check(*a))

    def scan(xp, name, a, **kw):
        scanned.append(name)
        return real_scan(xp, name, a, **kw)

    monkeypatch.setattr(kda._entry.call, "_check_finite", scan)
    screens, real_screen = [], kda._entry.call.Call._screen

    def screen(self, q):
        screens.append(real_screen(self, q))
        return screens[-1]

    monkeypatch.setattr(kda._entry.call.Call, "_screen", screen)
    grads = jax.grad(lambda *a: sum(jnp.sum(t) for t in f(*a)), argnums=tuple(range(len(keys))))(
        *(jnp.asarray(a) for a in x.values())
    )
    assert checked == [1]  # the forward's
    assert scanned[-2:] == ["grad_output", "grad_final_state"]
    # q is checked once, in the forward: by a scan of its own, or read off the fused pass (cpu)
    assert scanned.count("q") + sum(s is not None for s in screens) == 1
    assert all(np.all(np.isfinite(np.asarray(gr))) for gr in grads)
