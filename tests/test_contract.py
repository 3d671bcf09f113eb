"""Causality, immutability, dtypes and namespaces, and every error path."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, make_problem, to_numpy

import kda


@pytest.mark.parametrize("t0", [0, 15, 16, 30, 46])
@pytest.mark.parametrize("regime", ["mild", "strong", "reset"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_output_is_causal_bitwise(t0, regime, dtype):
    """Changing inputs after step t0 leaves output[..., :t0 + 1, :] bitwise unchanged."""
    p = make_problem(t0, 2, 2, 48, 8, 5, regime).astype(dtype)
    other = make_problem(t0 + 1000, 2, 2, 48, 8, 5, regime).astype(dtype)
    mixed = []
    for a, b in zip(p.inputs, other.inputs, strict=True):
        c = a.copy()
        c[:, :, t0 + 1 :] = b[:, :, t0 + 1 :]
        mixed.append(c)
    for chunk_size in (1, 16, 64):
        a = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, chunk_size=chunk_size).output
        b = kda.chunk_kda(*mixed, initial_state=p.initial_state, chunk_size=chunk_size).output
        np.testing.assert_array_equal(a[:, :, : t0 + 1], b[:, :, : t0 + 1])
        assert not np.array_equal(a[:, :, t0 + 1 :], b[:, :, t0 + 1 :])


def test_inputs_are_not_modified():
    p = make_problem(1, 2, 2, 40, 6, 4, "reset").astype(np.float32)
    arrays = [*p.inputs, p.initial_state, p.grad_output, p.grad_final_state]
    copies = [x.copy() for x in arrays]
    out = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, chunk_size=16, save_boundaries=True)
    saved = out.boundaries.copy()
    kda.chunk_kda_backward(
        *p.inputs,
        out.boundaries,
        p.grad_output,
        p.grad_final_state,
        initial_state=p.initial_state,
        chunk_size=16,
    )
    kda.recurrent_kda(*p.inputs, initial_state=p.initial_state)
    kda.recurrent_kda_backward(*p.inputs, p.grad_output, p.grad_final_state, initial_state=p.initial_state)
    for x, c in zip(arrays, copies, strict=True):
        np.testing.assert_array_equal(x, c)
    np.testing.assert_array_equal(out.boundaries, saved)


def test_float16_computes_in_float32():
    """float16 inputs give exactly the float32 computation on the same values, rounded."""
    p = make_problem(2, 1, 2, 33, 8, 4, "mild", with_state=False, with_grad_state=False)
    p16 = p.astype(np.float16)
    p32 = p16.astype(np.float32)
    out16 = kda.chunk_kda(*p16.inputs, chunk_size=16, save_boundaries=True)
    out32 = kda.chunk_kda(*p32.inputs, chunk_size=16, save_boundaries=True)
    assert out16.output.dtype == np.float16
    assert out16.final_state.dtype == np.float32
    np.testing.assert_array_equal(out16.output, out32.output.astype(np.float16))
    np.testing.assert_array_equal(out16.final_state, out32.final_state)
    g16 = kda.chunk_kda_backward(*p16.inputs, out16.boundaries, p16.grad_output, chunk_size=16)
    g32 = kda.chunk_kda_backward(*p32.inputs, out32.boundaries, p32.grad_output, chunk_size=16)
    for a, b in zip(g16[:5], g32[:5], strict=True):
        assert a.dtype == np.float16
        np.testing.assert_array_equal(a, b.astype(np.float16))
    assert g16.initial_state.dtype == np.float32


def test_array_api_strict_inputs():
    xp = pytest.importorskip("array_api_strict")
    p = make_problem(3, 1, 2, 21, 5, 3, "reset").astype(np.float64)

    def wrap(x):
        return None if x is None else xp.asarray(x)

    inputs = [wrap(x) for x in p.inputs]
    out = kda.chunk_kda(*inputs, initial_state=wrap(p.initial_state), chunk_size=8, save_boundaries=True)
    assert isinstance(out.output, type(inputs[0]))
    ref = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, chunk_size=8, save_boundaries=True)
    assert_close(out.output, ref.output, tol=1e-14)
    assert_close(out.boundaries, ref.boundaries, tol=1e-14)
    grads = kda.chunk_kda_backward(
        *inputs,
        out.boundaries,
        wrap(p.grad_output),
        wrap(p.grad_final_state),
        initial_state=wrap(p.initial_state),
        chunk_size=8,
    )
    ref_grads = kda.chunk_kda_backward(
        *p.inputs,
        ref.boundaries,
        p.grad_output,
        p.grad_final_state,
        initial_state=p.initial_state,
        chunk_size=8,
    )
    for a, b in zip(grads[:6], ref_grads[:6], strict=True):
        assert isinstance(a, type(inputs[0]))
        assert_close(a, b, tol=1e-13)
    rec = kda.recurrent_kda(*inputs, initial_state=wrap(p.initial_state))
    assert_close(rec.output, ref.output, tol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_torch_cpu_tensors(dtype):
    torch = pytest.importorskip("torch")
    tdtype = getattr(torch, dtype)
    p = make_problem(4, 1, 2, 19, 4, 3, "mild")
    inputs = [torch.from_numpy(x).to(tdtype) for x in p.inputs]
    state_dtype = torch.float64 if dtype == "float64" else torch.float32
    s0 = torch.from_numpy(p.initial_state).to(state_dtype)
    out = kda.chunk_kda(*inputs, initial_state=s0, chunk_size=8, save_boundaries=True)
    assert isinstance(out.output, torch.Tensor)
    assert out.output.dtype == tdtype
    assert out.final_state.dtype == state_dtype
    np_inputs = [to_numpy(x).astype(np.float64) for x in inputs]
    ref = kda.recurrent_kda(*np_inputs, initial_state=p.initial_state)
    tol = {"float32": 1e-5, "float64": 1e-10, "bfloat16": 1e-2}[dtype]  # bfloat16: output rounding
    assert_close(out.output, ref.output, tol=tol, dtype="any")
    do = torch.from_numpy(p.grad_output).to(tdtype)
    grads = kda.chunk_kda_backward(*inputs, out.boundaries, do, initial_state=s0, chunk_size=8)
    assert all(isinstance(x, torch.Tensor) for x in grads[:6])
    assert grads.q.dtype == tdtype and grads.initial_state.dtype == state_dtype


# ---------------------------------------------------------------- errors


def _ok():
    return make_problem(0, 1, 2, 10, 4, 3, "mild").astype(np.float32)


def _call_forward(**changes):
    p = _ok()
    args = dict(q=p.q, k=p.k, v=p.v, g=p.g, beta=p.beta)
    kwargs = {}
    for name, value in changes.items():
        (args if name in args else kwargs)[name] = value
    return kda.chunk_kda(*args.values(), **kwargs)


BAD_FORWARD = [
    ("q", lambda p: p.q[0], ValueError, "q must have shape"),
    ("k", lambda p: p.k[:, :, :5], ValueError, "k must have shape"),
    ("g", lambda p: p.g[..., :2], ValueError, "g must have shape"),
    ("v", lambda p: p.v[:, :1], ValueError, "v must have shape"),
    ("beta", lambda p: p.beta[..., None], ValueError, "beta must have shape"),
    ("k", lambda p: p.k.astype(np.float64), TypeError, "k must have dtype float32"),
    ("beta", lambda p: p.beta.astype(np.float16), TypeError, "beta must have dtype float32"),
    ("q", lambda p: p.q.astype(np.int32), TypeError, "q must have a real floating dtype"),
    ("v", lambda p: p.v.tolist(), TypeError, "v must be an array"),
    ("g", lambda p: np.abs(p.g), ValueError, "g must hold log decays <= 0"),
    ("g", lambda p: np.where(p.g < -0.5, np.nan, p.g).astype(np.float32), ValueError, "NaN"),
    ("chunk_size", lambda p: 0, ValueError, "chunk_size must be >= 1; got 0"),
    ("chunk_size", lambda p: 2.5, TypeError, "chunk_size must be a positive int"),
    ("chunk_size", lambda p: True, TypeError, "chunk_size must be a positive int"),
    ("scale", lambda p: float("nan"), ValueError, "scale must be finite"),
    ("scale", lambda p: float("inf"), ValueError, "scale must be finite"),
    ("scale", lambda p: "1", TypeError, "scale must be a real number"),
    (
        "initial_state",
        lambda p: np.zeros((1, 2, 4, 4), np.float32),
        ValueError,
        "initial_state must have shape",
    ),
    (
        "initial_state",
        lambda p: np.zeros((1, 2, 4, 3), np.float64),
        TypeError,
        "initial_state must have dtype",
    ),
    ("backend", lambda p: "tpu", ValueError, "backend must be None or one of"),
]


@pytest.mark.parametrize(("name", "make", "error", "message"), BAD_FORWARD)
def test_forward_rejects(name, make, error, message):
    with pytest.raises(error, match=message) as info:
        _call_forward(**{name: make(_ok())})
    assert isinstance(info.value, kda.KdaError)


def test_q_dtype_message_names_expected_and_given():
    p = _ok()
    with pytest.raises(TypeError, match=r"q must have a real floating dtype .* got int32"):
        kda.chunk_kda(p.q.astype(np.int32), p.k, p.v, p.g, p.beta)


def test_mixed_namespaces_are_refused():
    xp = pytest.importorskip("array_api_strict")
    p = _ok()
    with pytest.raises(TypeError, match="one array library"):
        kda.chunk_kda(p.q, xp.asarray(p.k), p.v, p.g, p.beta)
    with pytest.raises(TypeError, match="initial_state must come from the same array library"):
        kda.chunk_kda(*p.inputs, initial_state=xp.zeros((1, 2, 4, 3), dtype=xp.float32))


def test_zero_sized_key_dimension_is_refused():
    p = _ok()
    with pytest.raises(ValueError, match="K and V must be >= 1"):
        kda.chunk_kda(p.q[..., :0], p.k[..., :0], p.v, p.g[..., :0], p.beta)


BAD_BACKWARD = [
    ("boundaries", lambda p, b: b[:1], ValueError, r"boundaries must have shape \[NT, B, HV, K, V\]"),
    ("boundaries", lambda p, b: b.astype(np.float64), TypeError, "boundaries must have dtype float32"),
    ("grad_output", lambda p, b: p.grad_output[..., :2], ValueError, "grad_output must have shape"),
    ("grad_output", lambda p, b: p.grad_output.astype(np.float64), TypeError, "grad_output must have dtype"),
    ("grad_final_state", lambda p, b: p.grad_final_state[0], ValueError, "grad_final_state must have shape"),
    ("grad_final_state", lambda p, b: [[0.0]], TypeError, "grad_final_state must be an array"),
]


@pytest.mark.parametrize(("name", "make", "error", "message"), BAD_BACKWARD)
def test_backward_rejects(name, make, error, message):
    p = _ok()
    b = kda.chunk_kda(*p.inputs, chunk_size=4, save_boundaries=True).boundaries
    args = {"boundaries": b, "grad_output": p.grad_output, "grad_final_state": p.grad_final_state}
    args[name] = make(p, args[name] if name != "boundaries" else b)
    with pytest.raises(error, match=message):
        kda.chunk_kda_backward(*p.inputs, *args.values(), chunk_size=4)


def test_recurrent_validates_too():
    p = _ok()
    with pytest.raises(ValueError, match="g must hold log decays"):
        kda.recurrent_kda(p.q, p.k, p.v, -p.g, p.beta)
    with pytest.raises(ValueError, match="grad_output must have shape"):
        kda.recurrent_kda_backward(*p.inputs, p.grad_output[:, :, :3])
