"""Causality, immutability, dtypes and namespaces, and every error path."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_within, make_model_problem, make_problem

import kda
from kda.testing import to_numpy


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
    kda.chunk_kda_backward(  # recomputed boundaries
        *p.inputs, None, p.grad_output, p.grad_final_state, initial_state=p.initial_state, chunk_size=16
    )
    kda.recurrent_kda(*p.inputs, initial_state=p.initial_state)
    kda.recurrent_kda_backward(*p.inputs, p.grad_output, p.grad_final_state, initial_state=p.initial_state)
    for x, c in zip(arrays, copies, strict=True):
        np.testing.assert_array_equal(x, c)
    np.testing.assert_array_equal(out.boundaries, saved)


def _half_dtype(name: str):
    if name == "float16":
        return np.float16
    return pytest.importorskip("ml_dtypes").bfloat16


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half_precision_computes_in_float32(half):
    """float16 and NumPy ``ml_dtypes.bfloat16`` inputs give exactly the float32 computation on the
    same values, rounded to the input dtype (forward, backward, recurrence); states are float32."""
    dtype = _half_dtype(half)
    p = make_problem(2, 1, 2, 33, 8, 4, "mild", with_state=False, with_grad_state=False)
    p16 = p.astype(dtype)
    p32 = p16.astype(np.float32)
    out16 = kda.chunk_kda(*p16.inputs, chunk_size=16, save_boundaries=True)
    out32 = kda.chunk_kda(*p32.inputs, chunk_size=16, save_boundaries=True)
    assert out16.output.dtype == dtype
    assert out16.final_state.dtype == np.float32
    np.testing.assert_array_equal(out16.output, out32.output.astype(dtype))
    np.testing.assert_array_equal(out16.final_state, out32.final_state)
    g16 = kda.chunk_kda_backward(*p16.inputs, out16.boundaries, p16.grad_output, chunk_size=16)
    g32 = kda.chunk_kda_backward(*p32.inputs, out32.boundaries, p32.grad_output, chunk_size=16)
    for a, b in zip(g16[:5], g32[:5], strict=True):
        assert a.dtype == dtype
        np.testing.assert_array_equal(a, b.astype(dtype))
    assert g16.initial_state.dtype == np.float32
    r16, r32 = kda.recurrent_kda(*p16.inputs), kda.recurrent_kda(*p32.inputs)
    assert r16.output.dtype == dtype
    np.testing.assert_array_equal(r16.output, r32.output.astype(dtype))


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half_precision_options_and_checks(half):
    """The gate's parameters may be half precision too; non-finite half inputs are refused."""
    dtype = _half_dtype(half)
    m = make_model_problem(3, 1, 2, 20, 4, 4, gate="softplus", qk_l2norm=True, beta_activation="sigmoid")
    m16 = m.astype(dtype)
    m32 = m16.astype(np.float32)
    o16 = kda.chunk_kda(*m16.inputs, chunk_size=8, **m16.kwargs).output
    o32 = kda.chunk_kda(*m32.inputs, chunk_size=8, **m32.kwargs).output
    assert o16.dtype == dtype
    np.testing.assert_array_equal(o16, o32.astype(dtype))
    bad = [x.copy() for x in m16.inputs]
    bad[2][0, 1, 5, 2] = np.inf
    with pytest.raises(kda.InvalidInputError, match="v must be finite"):
        kda.chunk_kda(*bad, **m16.kwargs)


def test_unsupported_floating_dtype_is_named_correctly():
    """A dtype outside float16, bfloat16, float32, float64 (an 8-bit float) is refused, and the
    message's list of supported dtypes is the true one."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    p = _ok()
    with pytest.raises(
        kda.InvalidTypeError, match=r"\(float16, bfloat16, float32, float64\); got float8_e4m3fn"
    ):
        kda.chunk_kda(*(x.astype(ml_dtypes.float8_e4m3fn) for x in (p.q, p.k, p.v, p.g, p.beta)))


def test_float16_inputs_take_float32_states():
    """The state rule: float16 (and bfloat16) inputs take and return float32 states, never float16."""
    p = make_problem(2, 1, 2, 33, 8, 4, "mild").astype(np.float16)
    s32 = p.initial_state.astype(np.float32)
    out = kda.chunk_kda(*p.inputs, initial_state=s32, chunk_size=16, save_boundaries=True)
    assert out.final_state.dtype == np.float32 and out.boundaries.dtype == np.float32
    grads = kda.chunk_kda_backward(
        *p.inputs,
        out.boundaries,
        p.grad_output,
        p.grad_final_state.astype(np.float32),
        initial_state=s32,
        chunk_size=16,
    )
    assert grads.initial_state.dtype == np.float32
    with pytest.raises(kda.InvalidTypeError, match="initial_state must have dtype float32"):
        kda.chunk_kda(*p.inputs, initial_state=s32.astype(np.float16), chunk_size=16)
    with pytest.raises(kda.InvalidTypeError, match="grad_final_state must have dtype float32"):
        kda.chunk_kda_backward(
            *p.inputs, out.boundaries, p.grad_output, s32.astype(np.float16), chunk_size=16
        )
    with pytest.raises(kda.InvalidTypeError, match="boundaries must have dtype float32"):
        kda.chunk_kda_backward(*p.inputs, out.boundaries.astype(np.float16), p.grad_output, chunk_size=16)


NAMESPACE_CASES = [
    ("array_api_strict", "float64"),
    ("array_api_strict", "float32"),
    ("torch", "float64"),
    ("torch", "float32"),
    ("torch", "bfloat16"),
    ("jax", "float32"),  # JAX arrays are not writable: outputs are concatenated slab by slab
]
NAMESPACE_TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 1e-2}  # bfloat16: result rounding


def _mover(library: str):
    """``move(x, dtype)``: a NumPy array as an array of ``library`` with dtype name ``dtype``."""
    if library == "array_api_strict":
        xp = pytest.importorskip("array_api_strict")
        return lambda x, d: xp.asarray(x.astype(d))
    if library == "torch":
        torch = pytest.importorskip("torch")
        return lambda x, d: torch.from_numpy(x.astype(np.float32 if d == "bfloat16" else d)).to(
            getattr(torch, d)
        )
    jnp = pytest.importorskip("jax.numpy")
    return lambda x, d: jnp.asarray(x.astype(d))


def _oracle(p) -> tuple:
    ref = kda.recurrent_kda(*p.inputs, initial_state=p.initial_state)
    grads = kda.recurrent_kda_backward(
        *p.inputs, p.grad_output, p.grad_final_state, initial_state=p.initial_state
    )
    return ref, grads


# JAX compiles each operation for each new shape on first use (about 25 s of CPU for one case):
# one chunk size there
CHUNKED_NAMESPACE_CASES = [
    (library, dtype, chunk_size)
    for library, dtype in NAMESPACE_CASES
    for chunk_size in ((24,) if library == "jax" else (16, 24, 64))
]


@pytest.mark.parametrize(("library", "dtype", "chunk_size"), CHUNKED_NAMESPACE_CASES)
def test_other_namespaces_match_the_recurrence(library, dtype, chunk_size, monkeypatch):
    """Forward and backward (saved and recomputed boundaries) on another array library, with values
    (outputs and every gradient) against the float64 recurrence, and results in that library.

    Chunk sizes >= 16 reach the generic (non-NumPy) block assembly at halving levels h >= 8; 24 is
    not a power of two; slabs of two chunks make several slabs (concatenated in order where the
    arrays are not writable).
    """
    import kda.reference

    move = _mover(library)
    state_dtype = "float64" if dtype == "float64" else "float32"
    # JAX: T = 96 at chunk 24 makes two equal slabs, so each operation compiles for one shape only
    p = make_problem(7, 1, 2, 96 if library == "jax" else 150, 6, 5, "reset")
    Cp = 1 << (chunk_size - 1).bit_length()
    monkeypatch.setattr(kda.reference, "SLAB_ELEMENTS", 2 * 2 * Cp * 6)  # two chunks a slab
    x = [move(a, dtype) for a in p.inputs]
    s0, ds = move(p.initial_state, state_dtype), move(p.grad_final_state, state_dtype)
    do = move(p.grad_output, dtype)
    rounded = type(p)(*(to_numpy(a).astype(np.float64) for a in (*x, s0, do, ds)))
    ref, ref_grads = _oracle(rounded)
    tol = NAMESPACE_TOLERANCE[dtype]

    out = kda.chunk_kda(*x, initial_state=s0, chunk_size=chunk_size, save_boundaries=True)
    assert isinstance(out.output, type(x[0])) and out.output.dtype == x[0].dtype
    assert out.final_state.dtype == s0.dtype
    assert_within(out.output, ref.output, tol=tol, dtype="any", name="output")
    assert_within(out.final_state, ref.final_state, tol=tol, dtype="any", name="final_state")
    for boundaries in (out.boundaries, None):
        grads = kda.chunk_kda_backward(*x, boundaries, do, ds, initial_state=s0, chunk_size=chunk_size)
        for name, got, want in zip(kda.KdaGradients._fields[:6], grads[:6], ref_grads[:6], strict=True):
            assert isinstance(got, type(x[0]))
            assert got.dtype == (s0.dtype if name == "initial_state" else x[0].dtype)
            assert_within(got, want, tol=tol, dtype="any", name=name)


@pytest.mark.parametrize(("library", "dtype"), [c for c in NAMESPACE_CASES if c[0] != "jax"])
def test_other_namespaces_recurrence(library, dtype):
    """The recurrence and its backward on another array library, against the NumPy float64 recurrence.

    (Not JAX: slicing one step at a time compiles an operation per step there, minutes in all.)
    """
    move = _mover(library)
    state_dtype = "float64" if dtype == "float64" else "float32"
    p = make_problem(8, 1, 2, 23, 5, 4, "reset")
    x = [move(a, dtype) for a in p.inputs]
    s0, ds = move(p.initial_state, state_dtype), move(p.grad_final_state, state_dtype)
    do = move(p.grad_output, dtype)
    ref, ref_grads = _oracle(type(p)(*(to_numpy(a).astype(np.float64) for a in (*x, s0, do, ds))))
    tol = NAMESPACE_TOLERANCE[dtype]
    out = kda.recurrent_kda(*x, initial_state=s0)
    assert isinstance(out.output, type(x[0]))
    assert_within(out.output, ref.output, tol=tol, dtype="any", name="output")
    grads = kda.recurrent_kda_backward(*x, do, ds, initial_state=s0)
    for name, got, want in zip(kda.KdaGradients._fields[:6], grads[:6], ref_grads[:6], strict=True):
        assert_within(got, want, tol=tol, dtype="any", name=name)


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
