"""The model-level options: layout, grouped value heads, qk_l2norm, gates, beta activations,
packed sequences.

The chunked functions and the recurrence share the option code (kda/_options.py), so besides
chunked-against-recurrence property tests this file checks that code independently: central
finite differences of the full model-level recurrence in float64, packed sequences against each
sequence run alone, the gate maps against closed forms and fla's naive gates, and every misuse.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import ModelProblem, assert_within, fla_naive, fla_naive_gates, make_model_problem
from hypothesis import example, given
from hypothesis import strategies as st

import kda

GRADS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-10}
OPTION_SETS = {
    "plain": {},
    "gva+time_major": {"layout": "time_major", "G": 2},
    "softplus+l2norm+sigmoid": {"gate": "softplus", "qk_l2norm": True, "beta_activation": "sigmoid"},
    "lower_bound+sigmoid2": {"gate": "lower_bound", "beta_activation": "sigmoid2", "G": 3},
    "lower_bound, no A_log": {"gate": "lower_bound", "no_A_log": True},
    "varlen": {"cu_seqlens": (0, 3, 3, 17, 20)},
    "everything": {
        "layout": "time_major",
        "G": 2,
        "gate": "softplus",
        "qk_l2norm": True,
        "beta_activation": "sigmoid2",
        "cu_seqlens": (0, 9, 10, 25),
    },
}


def run(p: ModelProblem, fn: str, **extra):
    """Forward and backward of ``kda.<fn>`` on ``p``."""
    fwd = getattr(kda, fn)
    bwd = getattr(kda, fn + "_backward")
    if fn == "chunk_kda":
        out = fwd(*p.inputs, initial_state=p.initial_state, save_boundaries=True, **p.kwargs, **extra)
        grads = bwd(
            *p.inputs,
            out.boundaries,
            p.grad_output,
            p.grad_final_state,
            initial_state=p.initial_state,
            **p.kwargs,
            **extra,
        )
    else:
        out = fwd(*p.inputs, initial_state=p.initial_state, **p.kwargs, **extra)
        grads = bwd(
            *p.inputs, p.grad_output, p.grad_final_state, initial_state=p.initial_state, **p.kwargs, **extra
        )
    return out, grads


def oracle(p: ModelProblem):
    return run(p.astype(np.float64), "recurrent_kda", backend="reference")


def check(p: ModelProblem, out, grads, ref_out, ref_grads, dtype, tol=None) -> None:
    tol = TOL[np.dtype(dtype)] if tol is None else tol
    assert_within(out.output, ref_out.output, tol=tol, dtype="any", name="output")
    assert_within(out.final_state, ref_out.final_state, tol=tol, dtype="any", name="final_state")
    for name, got, want in zip(GRADS, grads, ref_grads, strict=True):
        assert (got is None) == (want is None), name
        if got is not None:
            assert_within(got, want, tol=tol, dtype="any", name=f"d{name}")


def _offsets(draw, T: int) -> tuple[int, ...]:
    cuts = sorted(draw(st.lists(st.integers(0, T), min_size=0, max_size=4)))
    return (0, *cuts, T)


@st.composite
def model_problems(draw):
    """Options drawn together with shapes; every option value is reachable."""
    varlen = draw(st.booleans())
    B = 1 if varlen else draw(st.integers(1, 2))
    T = draw(st.integers(1, 70))
    options = {
        "G": draw(st.sampled_from([1, 2, 3])),
        "layout": draw(st.sampled_from(["head_first", "time_major"])),
        "gate": draw(st.sampled_from(["log", "softplus", "lower_bound"])),
        "qk_l2norm": draw(st.booleans()),
        "beta_activation": draw(st.sampled_from([None, "sigmoid", "sigmoid2"])),
        "cu_seqlens": _offsets(draw, T) if varlen else None,
        "regime": draw(st.sampled_from(["zero", "mild", "strong", "reset"])),
    }
    shape = {
        "B": B,
        "H": draw(st.integers(1, 2)),
        "T": T,
        "K": draw(st.integers(2, 12)),
        "V": draw(st.integers(1, 9)),
    }
    return make_model_problem(draw(st.integers(0, 2**16)), **shape, **options)


@given(
    p=model_problems(),
    chunk_size=st.sampled_from([1, 3, 8, 16, 64]),
    dtype=st.sampled_from([np.float32, np.float64]),
)
@example(
    p=make_model_problem(1, 1, 2, 130, 16, 8, **OPTION_SETS["everything"] | {"cu_seqlens": (0, 50, 51, 130)}),
    chunk_size=16,
    dtype=np.float32,
)
@example(
    p=make_model_problem(2, 2, 1, 100, 8, 8, G=4, gate="lower_bound", beta_activation="sigmoid2"),
    chunk_size=64,
    dtype=np.float64,
)
def test_chunked_matches_recurrence_with_options(p, chunk_size, dtype):
    pd = p.astype(dtype)
    out, grads = run(pd, "chunk_kda", chunk_size=chunk_size)
    ref_out, ref_grads = oracle(pd)
    check(pd, out, grads, ref_out, ref_grads, dtype)


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_model_recurrence_matches_central_differences(name):
    """Every gradient of the model-level recurrence (options' chain rules included), float64."""
    T = OPTION_SETS[name].get("cu_seqlens", (20,))[-1]
    p = make_model_problem(3, 1, 2, T, 3, 2, **OPTION_SETS[name])
    _out, grads = run(p, "recurrent_kda")
    rng = np.random.default_rng(7)
    variables = {n: x for n, x in zip(GRADS, (*p.inputs, p.initial_state))}
    variables |= {n: p.kwargs[n] for n in ("A_log", "dt_bias") if n in p.kwargs}

    def loss(values: dict[str, np.ndarray]) -> float:
        kwargs = p.kwargs | {n: values[n] for n in ("A_log", "dt_bias") if n in values}
        o = kda.recurrent_kda(
            *(values[n] for n in GRADS[:5]),
            initial_state=values["initial_state"],
            **{n: x for n, x in kwargs.items()},
        )
        return float(np.sum(o.output * p.grad_output) + np.sum(o.final_state * p.grad_final_state))

    eps = 1e-6
    for name_, x in variables.items():
        d = rng.standard_normal(x.shape)
        plus = loss(variables | {name_: x + eps * d})
        minus = loss(variables | {name_: x - eps * d})
        numeric = (plus - minus) / (2 * eps)
        analytic = float(np.sum(getattr(grads, name_) * d))
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), (name_, numeric, analytic)


@pytest.mark.parametrize("fn", ["chunk_kda", "recurrent_kda"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_packed_sequences_equal_each_sequence_alone(fn, dtype):
    cu = (0, 7, 7, 40, 41, 105)
    p = make_model_problem(5, 1, 2, cu[-1], 8, 4, G=2, cu_seqlens=cu, gate="softplus", qk_l2norm=True).astype(
        dtype
    )
    out, grads = run(p, fn, **({"chunk_size": 16} if fn == "chunk_kda" else {}))
    kwargs = {n: x for n, x in p.kwargs.items() if n != "cu_seqlens"}
    for i, (a, b) in enumerate(itertools.pairwise(cu)):
        piece = ModelProblem(
            tuple(x[:, :, a:b, ...] for x in p.inputs),
            p.initial_state[i : i + 1],
            p.grad_output[:, :, a:b],
            p.grad_final_state[i : i + 1],
            kwargs,
        )
        alone, alone_grads = run(piece, fn, **({"chunk_size": 16} if fn == "chunk_kda" else {}))
        tol = 1e-6 if dtype == np.float32 else 1e-12
        assert_within(out.output[:, :, a:b], alone.output, tol=tol, name=f"output {i}")
        assert_within(out.final_state[i : i + 1], alone.final_state, tol=tol, name=f"final {i}")
        for n in GRADS[:5]:
            assert_within(
                getattr(grads, n)[..., a:b, :] if n != "beta" else grads.beta[..., a:b],
                getattr(alone_grads, n),
                tol=tol,
                name=f"d{n} {i}",
            )
        assert_within(grads.initial_state[i : i + 1], alone_grads.initial_state, tol=tol, name=f"dstate {i}")
    # the shared parameters' gradients are the sums over the sequences: checked by the oracle test


def test_packed_boundaries_are_in_sequence_order():
    cu = (0, 5, 5, 21, 30)
    p = make_model_problem(6, 1, 1, 30, 4, 3, cu_seqlens=cu)
    out = kda.chunk_kda(
        *p.inputs, initial_state=p.initial_state, chunk_size=8, save_boundaries=True, **p.kwargs
    )
    assert out.boundaries.shape == (1 + 0 + 2 + 2, 1, 1, 4, 3)
    # the first boundary of each non-empty sequence is its initial state
    np.testing.assert_array_equal(out.boundaries[0, 0], p.initial_state[0])
    np.testing.assert_array_equal(out.boundaries[1, 0], p.initial_state[2])
    np.testing.assert_array_equal(out.boundaries[3, 0], p.initial_state[3])
    # an empty sequence's final state is its initial state
    np.testing.assert_array_equal(out.final_state[1], p.initial_state[1])
    # the second boundary of sequence 2 is the state after its first 8 steps
    alone = kda.recurrent_kda(*(x[:, :, 5:13] for x in p.inputs), initial_state=p.initial_state[2:3])
    assert_within(out.boundaries[2], alone.final_state, tol=1e-12)


def _softplus_exact(x: np.ndarray) -> np.ndarray:
    return np.array([float(np.log1p(np.exp(np.longdouble(v)))) for v in x.ravel()]).reshape(x.shape)


def test_gate_maps_are_exact_at_extremes():
    """softplus and sigmoid neither overflow nor switch formula: log1p(exp(x)) to rounding."""
    from kda._options.gates import sigmoid as _sigmoid
    from kda._options.gates import softplus as _softplus

    x = np.array([-1e4, -745.0, -100.0, -30.0, -20.0, -1e-8, 0.0, 1e-8, 15.0, 20.0, 30.0, 100.0, 1e4])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        sp = _softplus(np, x)
        sg = _sigmoid(np, x)
    exact = _softplus_exact(x)
    np.testing.assert_allclose(sp, exact, rtol=4e-16, atol=0)
    exact_sig = np.array([float(1 / (1 + np.exp(-np.longdouble(v)))) for v in x])
    np.testing.assert_allclose(sg, exact_sig, rtol=4e-16, atol=0)
    # float32 too
    sp32 = _softplus(np, x.astype(np.float32))
    assert sp32.dtype == np.float32
    np.testing.assert_allclose(sp32, exact.astype(np.float32), rtol=2e-7, atol=0)


def _load_fla_gates():
    torch = pytest.importorskip("torch")
    return torch, fla_naive_gates(), fla_naive()


def test_gates_and_core_match_fla_naive():
    """The gate maps against fla's naive_kda_gate / naive_kda_lowerbound_gate, the core against its
    naive_recurrent_kda (GVA, time-major); fla's naive code computes in float32."""
    torch, gates_fla, naive = _load_fla_gates()
    rng = np.random.default_rng(11)
    B, T, H, HV, K, V = 1, 9, 2, 4, 5, 3
    g_raw = 4 * rng.standard_normal((B, T, HV, K))
    A_log = rng.uniform(-2, 1, HV)
    dt_bias = rng.standard_normal((HV, K))
    t = torch.from_numpy
    for gate, fla_fn, extra in (
        ("softplus", "naive_kda_gate", {}),
        ("lower_bound", "naive_kda_lowerbound_gate", {"lower_bound": -3.0}),
    ):
        # fla computes its gates in float32 whatever the output dtype: compare in float32
        want = gates_fla[fla_fn](
            t(g_raw), t(A_log), t(dt_bias.reshape(-1)), **extra, output_dtype=torch.float32
        ).numpy()
        from kda._options.maps import Options

        f32 = [x.astype(np.float32) for x in (g_raw, A_log, dt_bias)]
        options = Options(gate=gate, A_log=f32[1], dt_bias=f32[2], lower_bound=extra.get("lower_bound"))
        got, _ = options.law.log_decay(
            np, np.swapaxes(f32[0], 1, 2), options.gate_params(), options.lower_bound
        )
        assert got.dtype == np.float32
        np.testing.assert_allclose(np.swapaxes(got, 1, 2), want, rtol=1e-6, atol=1e-30)
    q, k = rng.standard_normal((2, B, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, HV, V))
    g = -rng.uniform(0, 1, (B, T, HV, K))
    beta = rng.uniform(0, 1, (B, T, HV))
    s0 = rng.standard_normal((B, HV, K, V))
    o_fla, s_fla = naive.naive_recurrent_kda(
        *(t(x) for x in (q, k, v, g, beta)), initial_state=t(s0), output_final_state=True
    )
    out = kda.chunk_kda(q, k, v, g, beta, initial_state=s0, layout="time_major", chunk_size=4)
    # fla's naive recurrence computes in float32 (x.to(torch.float)) whatever the input dtype:
    # agreement is to float32 rounding, about 1e-7 here
    assert_within(out.output, o_fla.numpy(), tol=1e-6, dtype="any")
    assert_within(out.final_state, s_fla.numpy(), tol=1e-6, dtype="any")


@pytest.mark.parametrize("name", ["array_api_strict", "torch"])
def test_options_on_other_namespaces(name):
    """Every option on array-api-strict and on torch CPU tensors, values against NumPy."""
    xp = pytest.importorskip(name)
    p = make_model_problem(9, 1, 1, 25, 6, 5, **OPTION_SETS["everything"])
    ref_out, ref_grads = run(p, "chunk_kda", chunk_size=16)
    conv = (lambda x: xp.from_numpy(x)) if name == "torch" else (lambda x: xp.asarray(x))
    kwargs = {n: (conv(x) if n in ("A_log", "dt_bias") else x) for n, x in p.kwargs.items()}
    states = (conv(p.initial_state), conv(p.grad_output), conv(p.grad_final_state))
    moved = ModelProblem(tuple(conv(x) for x in p.inputs), *states, kwargs)
    out, grads = run(moved, "chunk_kda", chunk_size=16)
    check(p, out, grads, ref_out, ref_grads, np.float64, tol=1e-12)


def test_cuda_backend_takes_every_option():
    """The cuda backend (simulator here) with every option, against the reference."""
    pytest.importorskip("numba")
    p = make_model_problem(4, 1, 1, 25, 4, 3, **OPTION_SETS["everything"])
    ref_out, ref_grads = run(p, "chunk_kda", chunk_size=8)
    out, grads = run(p, "chunk_kda", chunk_size=8, backend="cuda")
    check(p, out, grads, ref_out, ref_grads, np.float64, tol=1e-12)


def test_short_sequences_clamp_the_chunk():
    """T < chunk_size computes one T-step chunk: a huge chunk_size is fine, and T=1 is one step."""
    p = make_model_problem(8, 1, 2, 50, 4, 3)
    out = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, chunk_size=10**6, save_boundaries=True)
    assert out.boundaries.shape == (1, 1, 2, 4, 3)
    ref = kda.recurrent_kda(*p.inputs, initial_state=p.initial_state)
    assert_within(out.output, ref.output, tol=1e-12)
    one = make_model_problem(8, 2, 2, 1, 4, 3)
    out = kda.chunk_kda(*one.inputs, initial_state=one.initial_state, save_boundaries=True)
    ref = kda.recurrent_kda(*one.inputs, initial_state=one.initial_state)
    np.testing.assert_array_equal(out.output, ref.output)  # the same step recurrence
    np.testing.assert_array_equal(out.boundaries[0], one.initial_state)
    grads = kda.chunk_kda_backward(
        *one.inputs, out.boundaries, one.grad_output
    )  # initial state from boundaries
    ref_g = kda.recurrent_kda_backward(*one.inputs, one.grad_output, initial_state=one.initial_state)
    for a, b in zip(grads[:6], ref_g[:6], strict=True):
        np.testing.assert_array_equal(a, b)


def test_chunk_too_large_for_memory_is_refused():
    p = make_model_problem(8, 1, 1, 70000, 2, 2)
    with pytest.raises(kda.InvalidInputError, match=r"at most chunk_size=\d+ fits"):
        kda.chunk_kda(*p.inputs, chunk_size=70000)


def _bad(p: ModelProblem, **change):
    kwargs = p.kwargs | change
    return lambda: kda.chunk_kda(*p.inputs, **kwargs)


def test_time_major_shapes_named_in_errors():
    p = make_model_problem(1, 1, 2, 6, 4, 3, layout="time_major")
    q, k, v, g, beta = p.inputs
    with pytest.raises(kda.InvalidInputError, match=r"beta must have shape \[B, T, HV\]"):
        kda.chunk_kda(q, k, v, g, beta[..., :1], layout="time_major")


MISUSE = [
    (
        {"layout": "bshd"},
        kda.InvalidInputError,
        r"layout must be one of 'head_first', 'time_major'; got 'bshd'",
    ),
    ({"gate": "exp"}, kda.InvalidInputError, r"gate must be one of"),
    ({"beta_activation": "tanh"}, kda.InvalidInputError, r"beta_activation must be one of"),
    ({"A_log": np.zeros(2)}, kda.InvalidInputError, r"A_log must be None with gate='log'"),
    ({"lower_bound": -1.0}, kda.InvalidInputError, r"lower_bound must be None with gate='log'"),
    ({"gate": "softplus"}, kda.InvalidInputError, r"A_log \(shape \[HV\]\) is required"),
    (
        {"gate": "lower_bound", "lower_bound": 0.0},
        kda.InvalidInputError,
        r"lower_bound must be a finite float < 0; got 0.0",
    ),
    ({"gate": "lower_bound"}, kda.InvalidTypeError, r"lower_bound must be a float < 0 .*got None"),
    (
        {"gate": "softplus", "A_log": np.zeros(3)},
        kda.InvalidInputError,
        r"A_log must have shape \[HV\] = \(2,\); got \(3,\)",
    ),
    (
        {"gate": "softplus", "A_log": np.zeros(2), "dt_bias": np.zeros((2, 3))},
        kda.InvalidInputError,
        r"dt_bias must have shape \[HV, K\] = \(2, 4\)",
    ),
    ({"qk_l2norm": 1}, kda.InvalidTypeError, r"qk_l2norm must be True or False"),
    ({"cu_seqlens": np.array([0.0, 6.0])}, kda.InvalidTypeError, r"cu_seqlens must be a 1-D integer array"),
    ({"cu_seqlens": np.array([[0, 6]])}, kda.InvalidTypeError, r"cu_seqlens must be a 1-D integer array"),
    (
        {"cu_seqlens": np.array([1, 6])},
        kda.InvalidInputError,
        r"cu_seqlens must start at 0 and end at T=6; got first 1",
    ),
    ({"cu_seqlens": np.array([0, 5])}, kda.InvalidInputError, r"end at T=6; got first 0, last 5"),
    (
        {"cu_seqlens": np.array([0, 4, 3, 6])},
        kda.InvalidInputError,
        r"non-decreasing; got 4 then 3 at index 1",
    ),
]


@pytest.mark.parametrize(("change", "error", "match"), MISUSE)
def test_misuse_is_refused(change, error, match):
    p = make_model_problem(1, 1, 2, 6, 4, 3)
    with pytest.raises(error, match=match):
        _bad(p, **change)()


def test_value_heads_must_be_a_multiple():
    p = make_model_problem(1, 1, 2, 6, 4, 3)
    q, k, v, g, beta = p.inputs
    with pytest.raises(kda.InvalidInputError, match=r"HV a multiple of the 2 q/k heads"):
        kda.chunk_kda(q, k, v[:, :1], g[:, :1], beta[:, :1])


def test_cu_seqlens_needs_one_row_and_states_per_sequence():
    p = make_model_problem(1, 2, 1, 6, 4, 3)
    with pytest.raises(kda.InvalidInputError, match=r"batch size B must be 1; got B=2"):
        kda.chunk_kda(*p.inputs, cu_seqlens=np.array([0, 6]))
    p = make_model_problem(1, 1, 1, 6, 4, 3, cu_seqlens=(0, 2, 6))
    with pytest.raises(
        kda.InvalidInputError, match=r"initial_state must have shape \[N, HV, K, V\] = \(2, 1, 4, 3\)"
    ):
        kda.chunk_kda(*p.inputs, initial_state=p.initial_state[:1], **p.kwargs)


def test_raw_gates_take_any_finite_value_and_inputs_are_not_modified():
    p = make_model_problem(2, 1, 1, 12, 4, 3, gate="softplus", beta_activation="sigmoid")
    g = p.inputs[3]
    g[..., 0] = 1e4  # large positive raw gates are legal: decay exp(-exp(A_log) * 1e4)
    g[..., 1] = -1e4
    copies = [x.copy() for x in (*p.inputs, p.kwargs["A_log"], p.kwargs["dt_bias"])]
    out, grads = run(p, "chunk_kda", chunk_size=4)
    ref_out, ref_grads = oracle(p)
    check(p, out, grads, ref_out, ref_grads, np.float64)
    for a, b in zip(copies, (*p.inputs, p.kwargs["A_log"], p.kwargs["dt_bias"]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_gate_check_deferred_to_the_device(monkeypatch):
    """On a GPU namespace the g <= 0 check is one device kernel read after the work is queued;
    here the cuda backend's kernel runs under the simulator on NumPy arrays."""
    pytest.importorskip("numba")
    import kda.cuda as kc

    monkeypatch.setattr(kc, "launch_gate_check", lambda g: kc._GateFlags(kc.gate_flags(g)))
    p = make_model_problem(3, 1, 1, 12, 4, 3)
    out = kda.chunk_kda(*p.inputs, chunk_size=4, backend="cuda")
    ref = kda.recurrent_kda(*p.inputs)
    assert_within(out.output, ref.output, tol=1e-12)
    q, k, v, g, beta = p.inputs
    bad = g.copy()
    bad[0, 0, 5, 1] = 0.5
    bad[0, 0, 7, 2] = np.nan
    for fn in (kda.chunk_kda, kda.recurrent_kda):
        with pytest.raises(kda.InvalidInputError, match="got 1 positive and 1 NaN elements"):
            fn(q, k, v, bad, beta, check_finite=False, backend="cuda")


# ---------------------------------------------------------------- a gate law added in one class


def _sigmoid64(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


class _ScaledSigmoidGate:
    """A bounded law that exists nowhere in kda: ``log decay = -exp(A_log[h]) * sigmoid(g + dt_bias[h])``
    (each step decays by at most ``exp(-exp(A_log))``), written here once as a gate-law class."""

    @staticmethod
    def make():
        from kda._options import gates

        class ScaledSigmoidGate(gates.GateLaw):
            name = "test_scaled_sigmoid"
            params = (gates.A_LOG, gates.DT_BIAS)
            required = ("A_log",)
            doc = "``-exp(A_log[h]) * sigmoid(g + dt_bias[h])``"

            def log_decay(self, xp, g, params, lower_bound):
                x = g if params["dt_bias"] is None else g + gates.DT_BIAS.broadcast(params["dt_bias"])
                return -xp.exp(gates.A_LOG.broadcast(params["A_log"])) * gates.sigmoid(xp, x), x

            def backward(self, xp, dlog, log, saved, params, lower_bound):
                s = gates.sigmoid(xp, saved)
                dx = -xp.exp(gates.A_LOG.broadcast(params["A_log"])) * s * (1 - s) * dlog
                dA = xp.sum(dlog * log, axis=gates.A_LOG.reduce_axes())
                ddt = None if params["dt_bias"] is None else xp.sum(dx, axis=gates.DT_BIAS.reduce_axes())
                return dx, {"A_log": dA, "dt_bias": ddt}

        return ScaledSigmoidGate


@pytest.fixture
def scaled_sigmoid_gate():
    """The law registered for one test, and unregistered after it."""
    from kda._options import gates

    law = gates.register(_ScaledSigmoidGate.make())
    try:
        yield law.name
    finally:
        gates.unregister(law.name)
    assert law.name not in gates.LAWS


def _new_law_problem(dtype, B=1, H=2, T=37, K=8, V=6, seed=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, T, K))
    k = rng.standard_normal((B, H, T, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, H, T, V))
    g = 3 * rng.standard_normal((B, H, T, K))
    beta = rng.uniform(0, 1, (B, H, T))
    A_log = rng.uniform(-1, 1, H)
    dt_bias = rng.standard_normal((H, K))
    do = rng.standard_normal((B, H, T, V))
    return [x.astype(dtype) for x in (q, k, v, g, beta, A_log, dt_bias, do)]


def _new_law_oracle(q, k, v, g, beta, A_log, dt_bias, do):
    """The float64 recurrence on the log decay computed here from the law's formula, and the
    chain rule of the formula written out: the output and every gradient."""
    f64 = [np.asarray(x, np.float64) for x in (q, k, v, g, beta, A_log, dt_bias, do)]
    q, k, v, g, beta, A_log, dt_bias, do = f64
    x = g + dt_bias[None, :, None, :]
    a = np.exp(A_log)[None, :, None, None]
    s = _sigmoid64(x)
    log = -a * s
    out = kda.recurrent_kda(q, k, v, log, beta)
    grads = kda.recurrent_kda_backward(q, k, v, log, beta, do)
    dx = grads.g * (-a * s * (1 - s))
    return out.output, {
        "q": grads.q,
        "k": grads.k,
        "v": grads.v,
        "g": dx,
        "beta": grads.beta,
        "A_log": (grads.g * log).sum(axis=(0, 2, 3)),
        "dt_bias": dx.sum(axis=(0, 2)),
    }


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_new_gate_law_runs_through_chunk_kda(scaled_sigmoid_gate, dtype):
    """One class registered is the whole of a new law: validation, the maps, the chunked forward
    and backward and the gradients of its parameters, against the float64 oracle."""
    q, k, v, g, beta, A_log, dt_bias, do = _new_law_problem(dtype)
    want_o, want = _new_law_oracle(q, k, v, g, beta, A_log, dt_bias, do)
    options = dict(gate=scaled_sigmoid_gate, A_log=A_log, dt_bias=dt_bias)
    out = kda.chunk_kda(q, k, v, g, beta, chunk_size=16, save_boundaries=True, **options)
    assert_within(out.output, want_o, tol=TOL[np.dtype(dtype)], dtype="any")
    grads = kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, do, chunk_size=16, **options)
    for name, expected in want.items():
        assert_within(getattr(grads, name), expected, tol=TOL[np.dtype(dtype)], dtype="any", name=name)
    # its check: A_log is required, lower_bound refused
    with pytest.raises(kda.InvalidInputError, match=r"A_log .* is required"):
        kda.chunk_kda(q, k, v, g, beta, gate=scaled_sigmoid_gate)
    with pytest.raises(kda.InvalidInputError, match="lower_bound must be None"):
        kda.chunk_kda(q, k, v, g, beta, lower_bound=-1.0, **options)


def test_an_unregistered_gate_law_is_refused(scaled_sigmoid_gate):
    from kda._options import gates

    gates.unregister(scaled_sigmoid_gate)
    try:
        q, k, v, g, beta, A_log, _, _ = _new_law_problem(np.float64)
        with pytest.raises(kda.InvalidInputError, match="gate must be one of"):
            kda.chunk_kda(q, k, v, g, beta, gate=scaled_sigmoid_gate, A_log=A_log)
        with pytest.raises(ValueError, match="built-in"):
            gates.unregister("log")
    finally:
        gates.register(_ScaledSigmoidGate.make())


def _time_major(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(x, 1, 2))


def test_a_new_gate_law_runs_through_kda_torch(scaled_sigmoid_gate):
    """The same law through kda.torch's fla-style chunk_kda (kda's ``gate`` keyword with
    ``use_gate_in_kernel=True``) and its autograd: output and every gradient against the oracle."""
    torch = pytest.importorskip("torch")
    import kda.torch as kt

    q, k, v, g, beta, A_log, dt_bias, do = _new_law_problem(np.float32)
    want_o, want = _new_law_oracle(q, k, v, g, beta, A_log, dt_bias, do)
    leaf = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    steps = {n: torch.from_numpy(_time_major(x)).requires_grad_() for n, x in leaf.items()}
    params = {n: torch.from_numpy(x).requires_grad_() for n, x in (("A_log", A_log), ("dt_bias", dt_bias))}
    o, _ = kt.chunk_kda(
        *steps.values(), use_gate_in_kernel=True, gate=scaled_sigmoid_gate, chunk_size=16, **params
    )
    assert_within(_time_major(o.detach().numpy()), want_o, tol=1e-5, dtype="any")
    (o * torch.from_numpy(_time_major(do))).sum().backward()
    for name, t in steps.items():
        assert_within(_time_major(t.grad.numpy()), want[name], tol=1e-5, dtype="any", name=name)
    for name, t in params.items():
        assert_within(t.grad.numpy(), want[name], tol=1e-5, dtype="any", name=name)


def test_a_new_gate_law_runs_through_kda_jax(scaled_sigmoid_gate):
    """The same law through kda.jax's chunk_kda (its custom_vjp, the law's name in the static
    options): output and every gradient against the oracle."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import kda.jax as kj

    q, k, v, g, beta, A_log, dt_bias, do = _new_law_problem(np.float32)
    want_o, want = _new_law_oracle(q, k, v, g, beta, A_log, dt_bias, do)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
    arrays = [jnp.asarray(_time_major(x)) for x in (q, k, v, g, beta)] + [
        jnp.asarray(A_log),
        jnp.asarray(dt_bias),
    ]

    def f(q, k, v, g, beta, A_log, dt_bias):
        return kj.chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            use_gate_in_kernel=True,
            gate=scaled_sigmoid_gate,
            chunk_size=16,
            A_log=A_log,
            dt_bias=dt_bias,
        )[0]

    o, vjp = jax.vjp(f, *arrays)
    assert_within(_time_major(np.asarray(o)), want_o, tol=1e-5, dtype="any")
    for name, got in zip(names, vjp(jnp.asarray(_time_major(do)))):
        got = np.asarray(got)
        assert_within(
            got if name in ("A_log", "dt_bias") else _time_major(got),
            want[name],
            tol=1e-5,
            dtype="any",
            name=name,
        )


def test_divergence_warnings_name_the_callers_line_on_every_path():
    """The divergence warning is attributed to the caller's line whatever the depth of kda's frames
    above it (a plain call, a transition map, decode's general route): the
    first frame outside the kda package, never a fixed stack level."""
    import warnings

    rng = np.random.default_rng(4)
    B, H, T, K, V = 1, 1, 96, 3, 4
    q, k = (3 * rng.standard_normal((B, H, T, K)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, H, T, V)).astype(np.float32)
    g = np.zeros((B, H, T, K), np.float32)
    beta = np.full((B, H, T), 1.9, np.float32)
    wide = (q, k, np.repeat(v, 2, axis=1), np.repeat(g, 2, axis=1), np.repeat(beta, 2, axis=1))
    pool, rows = np.zeros((1, 2, K, V), np.float32), np.array([0])
    paths = {
        "chunk_kda": lambda: kda.chunk_kda(q, k, v, g, beta, chunk_size=8),
        "transition": lambda: kda.chunk_kda_transition(q, k, v, g, beta, chunk_size=8),
        "decode, grouped heads": lambda: kda.decode_kda(*wide, pool, rows),
    }
    for name, run in paths.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        kinds = [w.category for w in caught]
        assert kinds == [kda.KdaWarning], (name, [str(w.message) for w in caught])
        where = (caught[0].filename, caught[0].lineno)
        assert where == (__file__, run.__code__.co_firstlineno), (name, where)  # the lambda's own line
