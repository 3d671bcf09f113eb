"""Every primitive of every backend against one naive float64 oracle written from the definitions.

The oracles use explicit sums of ``g`` over the steps each factor spans and plain loops: slow, and
independent of both backends' block structure. The cuda backend runs under Numba's CUDA simulator
where no GPU is present (tests/conftest.py), on NumPy arrays.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from helpers import assert_within

from kda.testing import gates

SHAPE = (1, 2, 2, 8)  # B, H, NT, Cp
K, V = 3, 2
SCALE = 0.7


# the reference backend's own finer steps (chunk_local and chunk_local_backward are built of them)
REFERENCE = importlib.import_module("kda.reference")


def _inputs(regime: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*SHAPE, K))
    k = rng.standard_normal((*SHAPE, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = gates(rng, (*SHAPE, K), regime)
    return q, k, g, rng


def _segment(g: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``exp(sum(g[..., l, :] for lo < l <= hi))``, a sum over exactly those steps."""
    return np.exp(np.sum(g[..., lo + 1 : hi + 1, :], axis=-2))


def oracle_pairs(q, k, g):
    Cp = q.shape[-2]
    A = np.zeros((*q.shape[:-1], Cp))
    L = np.zeros_like(A)
    for i in range(Cp):
        for j in range(i + 1):
            F = _segment(g, j, i)
            A[..., i, j] = SCALE * np.sum(q[..., i, :] * k[..., j, :] * F, axis=-1)
            if j < i:
                L[..., i, j] = np.sum(k[..., i, :] * k[..., j, :] * F, axis=-1)
    return A, L


ORACLE_REGIMES = ["mild", "strong", "reset"]  # of kda.testing's LOG_REGIMES: the oracles' loops are slow


@pytest.mark.parametrize("regime", ORACLE_REGIMES)
def test_chunk_factors(regime):
    q, k, g, _ = _inputs(regime)
    f = REFERENCE.chunk_factors(q, k, g, SCALE)
    Cp = SHAPE[-1]
    prefix = np.stack([_segment(g, -1, i) for i in range(Cp)], axis=-2)
    suffix = np.stack([_segment(g, j, Cp - 1) for j in range(Cp)], axis=-2)
    for name, got, want in [
        ("prefix", f.prefix, prefix),
        ("suffix", f.suffix, suffix),
        ("total", f.total, _segment(g, -1, Cp - 1)),
        ("qg", f.qg, SCALE * q * prefix),
        ("kg", f.kg, k * prefix),
        ("k_suffix", f.k_suffix, k * suffix),
    ]:
        assert_within(got, want, tol=1e-13, name=name)


@pytest.mark.parametrize("regime", ORACLE_REGIMES)
def test_chunk_pairs(regime):
    q, k, g, _ = _inputs(regime)
    A, L = REFERENCE.chunk_pairs(q, k, REFERENCE.chunk_factors(q, k, g, SCALE), SCALE)
    A_want, L_want = oracle_pairs(q, k, g)
    assert_within(A, A_want, tol=1e-13, name="A")
    assert_within(L, L_want, tol=1e-13, name="L")


@pytest.mark.parametrize("regime", ORACLE_REGIMES)
def test_chunk_local(ops, regime):
    """The fused state-free step: factors, pairs, the inverse and ``[W, U0]`` of every chunk."""
    q, k, g, rng = _inputs(regime)
    v = rng.standard_normal((*SHAPE, V))
    beta = rng.uniform(0, 2, SHAPE)
    loc = ops.chunk_local(q, k, v, g, beta, scale=SCALE)
    Cp = SHAPE[-1]
    prefix = np.stack([_segment(g, -1, i) for i in range(Cp)], axis=-2)
    suffix = np.stack([_segment(g, j, Cp - 1) for j in range(Cp)], axis=-2)
    A, L = oracle_pairs(q, k, g)
    Tinv = np.linalg.inv(np.eye(Cp) + beta[..., :, None] * L)
    for name, got, want, tol in [
        ("qg", loc.qg, SCALE * q * prefix, 1e-13),
        ("kg", loc.kg, k * prefix, 1e-13),
        ("k_suffix", loc.k_suffix, k * suffix, 1e-13),
        ("total", loc.total, _segment(g, -1, Cp - 1), 1e-13),
        ("A", loc.A, A, 1e-13),
        ("L", loc.L, L, 1e-13),
        ("w", loc.w, Tinv @ (beta[..., None] * k * prefix), 1e-12),
        ("u0", loc.u0, Tinv @ (beta[..., None] * v), 1e-12),
    ]:
        assert_within(got, want, tol=tol, name=name)


def _local_oracle(q, k, g, v, beta):
    """``qg, kt, total, A, w, u0`` of every chunk from the definitions (float64)."""
    Cp = q.shape[-2]
    prefix = np.stack([_segment(g, -1, i) for i in range(Cp)], axis=-2)
    suffix = np.stack([_segment(g, j, Cp - 1) for j in range(Cp)], axis=-2)
    A, L = oracle_pairs(q, k, g)
    Tinv = np.linalg.inv(np.eye(Cp) + beta[..., :, None] * L)
    b = beta[..., None]
    return SCALE * q * prefix, k * suffix, _segment(g, -1, Cp - 1), A, Tinv @ (b * k * prefix), Tinv @ (b * v)


def test_chunk_local_backward(ops):
    """Against central differences of the scalar whose gradient it is, with ``S, dS, U, dU, dO`` fixed:
    ``sum(dO (qg S + A U)) + sum(dS (total S + kt^T U)) + sum(dU (u0 - w S))``."""
    q, k, g, rng = _inputs("mild")
    B, H, NT, _ = SHAPE
    v = rng.standard_normal((*SHAPE, V))
    beta = rng.uniform(0, 2, SHAPE)
    S, dS = (rng.standard_normal((NT, B, H, K, V)) for _ in range(2))
    u, du, do = (rng.standard_normal((*SHAPE, V)) for _ in range(3))
    Sh, dSh = (np.moveaxis(x, 0, 2) for x in (S, dS))
    mT = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731

    def scalar(*inputs):
        qg, kt, total, A, w, u0 = _local_oracle(*inputs)
        out = np.sum(do * (qg @ Sh + A @ u)) + np.sum(dSh * (total[..., None] * Sh + mT(kt) @ u))
        return out + np.sum(du * (u0 - w @ Sh))

    inputs = [q, k, g, v, beta]
    want = []
    for x in inputs:
        grad = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + 1e-6
            hi = scalar(*inputs)
            x[idx] = old - 1e-6
            lo = scalar(*inputs)
            x[idx] = old
            grad[idx] = (hi - lo) / 2e-6
        want.append(grad)
    loc = ops.chunk_local(q, k, v, g, beta, scale=SCALE)
    dq, dk, dv, dg, dbeta = ops.chunk_local_backward(
        q, k, v, g, beta, S, scale=SCALE, local=loc, dends=dS, u=u, du=du, grad_output=do
    )
    for name, got, w in zip(("dq", "dk", "dg", "dv", "dbeta"), (dq, dk, dg, dv, dbeta), want, strict=True):
        assert_within(got, w, tol=1e-7, name=name)


def test_unit_lower_inverse():
    q, k, g, rng = _inputs("mild")
    beta = rng.uniform(0, 2, SHAPE)
    _, L = oracle_pairs(q, k, g)
    want = np.linalg.inv(np.eye(SHAPE[-1]) + beta[..., :, None] * L)
    assert_within(REFERENCE.unit_lower_inverse(beta, L), want, tol=1e-12, name="inverse")


def _state_pass_inputs(rng):
    B, H, NT, Cp = SHAPE
    w, u0, kt, qg = (rng.standard_normal((*SHAPE, d)) for d in (K, V, K, K))
    total = rng.uniform(0, 1, (B, H, NT, K))
    A = rng.standard_normal((*SHAPE, Cp))  # full: only the lower triangle may be read
    return w, u0, kt, total, qg, A, rng.standard_normal((B, H, K, V))


def test_state_passes(ops):
    """The state pass with and without the fused output, and the state-gradient pass."""
    rng = np.random.default_rng(1)
    NT = SHAPE[2]
    w, u0, kt, total, qg, A, S0 = _state_pass_inputs(rng)
    starts, us, outs, S = [], [], [], S0
    for n in range(NT):
        starts.append(S)
        U = u0[:, :, n] - w[:, :, n] @ S
        us.append(U)
        outs.append(qg[:, :, n] @ S + np.tril(A[:, :, n]) @ U)
        S = total[:, :, n, :, None] * S + np.swapaxes(kt[:, :, n], -1, -2) @ U
    boundaries, output, final = ops.chunk_state_pass(w, u0, kt, total, S0, qg, A)
    for name, a, b in zip(
        ("boundaries", "output", "final"),
        (boundaries, output, final),
        (np.stack(starts), np.stack(outs, 2), S),
    ):
        assert_within(a, b, tol=1e-13, name=name)
    alone = ops.chunk_state_pass(w, u0, kt, total, S0)
    assert alone[1] is None
    assert_within(alone[0], np.stack(starts), tol=1e-13, name="boundaries alone")
    assert_within(alone[2], S, tol=1e-13, name="final alone")

    do = rng.standard_normal((*SHAPE, V))
    dS = rng.standard_normal(S0.shape)
    ends, dus = [None] * NT, [None] * NT
    d = dS
    mT = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    for n in reversed(range(NT)):
        ends[n] = d
        dus[n] = mT(np.tril(A[:, :, n])) @ do[:, :, n] + kt[:, :, n] @ d
        d = total[:, :, n, :, None] * d + mT(qg[:, :, n]) @ do[:, :, n] - mT(w[:, :, n]) @ dus[n]
    got = ops.chunk_state_grad_pass(w, u0, kt, total, qg, A, do, np.stack(starts), dS)
    want = (np.stack(ends), np.stack(us, 2), np.stack(dus, 2), d)
    for name, a, b in zip(("dends", "u", "du", "dinitial"), got, want, strict=True):
        assert_within(a, b, tol=1e-13, name=name)


@pytest.mark.parametrize("regime", ORACLE_REGIMES)
def test_chunk_pairs_backward(regime):
    """Gradients of sum(dA * A + dL * L) with respect to q, k and g, pair by pair."""
    q, k, g, rng = _inputs(regime)
    Cp = SHAPE[-1]
    dA = np.tril(rng.standard_normal((*SHAPE, Cp)))
    dL = np.tril(rng.standard_normal((*SHAPE, Cp)), k=-1)
    dq, dk, dg = (np.zeros_like(q) for _ in range(3))
    for i in range(Cp):
        for j in range(i + 1):
            F = _segment(g, j, i)
            a = SCALE * dA[..., i, j, None] * F
            dq[..., i, :] += a * k[..., j, :]
            dk[..., j, :] += a * q[..., i, :]
            P = a * q[..., i, :] * k[..., j, :]
            if j < i:
                b = dL[..., i, j, None] * F
                dk[..., i, :] += b * k[..., j, :]
                dk[..., j, :] += b * k[..., i, :]
                P = P + b * k[..., i, :] * k[..., j, :]
            dg[..., j + 1 : i + 1, :] += P[..., None, :]  # every step the factor spans
    f = REFERENCE.chunk_factors(q, k, g, SCALE)
    got = REFERENCE.chunk_pairs_backward(dA, dL, q, k, f, SCALE)
    for name, a, b in zip(("dq", "dk", "dg"), got, (dq, dk, dg), strict=True):
        assert_within(a, b, tol=1e-12, name=name)


def test_chunk_gate_gradient():
    rng = np.random.default_rng(2)
    prefix_terms, suffix_terms, pair_terms = (rng.standard_normal((*SHAPE, K)) for _ in range(3))
    total_terms = rng.standard_normal((*SHAPE[:-1], K))
    want = np.empty_like(pair_terms)
    for l in range(SHAPE[-1]):
        want[..., l, :] = (
            prefix_terms[..., l:, :].sum(-2)
            + suffix_terms[..., :l, :].sum(-2)
            + total_terms
            + pair_terms[..., l, :]
        )
    got = REFERENCE.chunk_gate_gradient(prefix_terms, suffix_terms, total_terms, pair_terms)
    assert_within(got, want, tol=1e-13, name="dg")


@pytest.mark.parametrize(("T", "C"), [(5, 2), (8, 4), (3, 8)])
def test_chunk_layout_round_trip(ops, T, C):
    x = np.arange(2 * 3 * T * 4, dtype=np.float64).reshape(2, 3, T, 4)
    Cp = 1 << (C - 1).bit_length()
    chunks = ops.to_chunks(x, chunk_size=C, padded_size=Cp)
    assert chunks.shape == (2, 3, -(-T // C), Cp, 4)
    np.testing.assert_array_equal(chunks[:, :, 0, : min(C, T)], x[:, :, : min(C, T)])
    np.testing.assert_array_equal(ops.from_chunks(chunks, chunk_size=C, length=T), x)


def test_every_backend_implements_the_interface(ops):
    """Each backend module provides every primitive and hook of kda._backend.Backend,
    and no backend imports another (they share only the interface module)."""
    import inspect

    from kda._backend import Backend

    names = [*Backend.__annotations__, *(n for n in vars(Backend) if not n.startswith("_"))]
    missing = [n for n in names if not hasattr(ops, n)]
    assert not missing, f"{ops.NAME} lacks {missing}"
    folder = inspect.getfile(ops).rsplit("/", 1)[0]
    import pathlib

    others = {"reference", "cuda", "cpu"} - {ops.NAME}
    import ast

    for path in pathlib.Path(folder).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module or ''}.{a.name}" for a in node.names] + [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                assert not others & set(parts), (path, name)


# --------------------------------------------------------- every backend in float32 and float64
# The same primitives at the block shapes a GPU backend tiles by (K = 18: two 16-channel tiles,
# the second partly idle; padded chunks up to 64), both dtypes, against the reference primitive in
# float64 (itself held to the naive oracles above).

TOL = {np.float32: 1e-5, np.float64: 1e-10}


def _in(dtype, *arrays):
    return [np.asarray(x, dtype=dtype) for x in arrays]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("regime", "Cp"), [("mild", 8), ("reset", 8), ("hard", 4), ("mild", 64)])
def test_chunk_local_and_its_backward_by_dtype(ops, regime, Cp, dtype):
    rng = np.random.default_rng(Cp)
    B, H, NT, K_, V_ = 2, 1, 2, 18, 3
    q = rng.standard_normal((B, H, NT, Cp, K_))
    k = rng.standard_normal((B, H, NT, Cp, K_)) / np.sqrt(K_)
    g = gates(rng, (B, H, NT, Cp, K_), regime)
    v = rng.standard_normal((B, H, NT, Cp, V_))
    beta = rng.uniform(0, 1, (B, H, NT, Cp))
    want = REFERENCE.chunk_local(q, k, v, g, beta, scale=SCALE)
    got = ops.chunk_local(*_in(dtype, q, k, v, g, beta), scale=SCALE)
    for field in ("qg", "kg", "k_suffix", "total", "A", "L", "Minv", "w", "u0"):
        assert_within(getattr(got, field), getattr(want, field), tol=TOL[dtype], dtype=dtype, name=field)
    S, dS = (rng.standard_normal((NT, B, H, K_, V_)) for _ in range(2))
    u, du, do = (rng.standard_normal((B, H, NT, Cp, V_)) for _ in range(3))
    want_grads = REFERENCE.chunk_local_backward(
        q, k, v, g, beta, S, scale=SCALE, local=want, dends=dS, u=u, du=du, grad_output=do
    )
    got_grads = ops.chunk_local_backward(
        *_in(dtype, q, k, v, g, beta, S),
        scale=SCALE,
        local=got,
        **dict(zip(("dends", "u", "du", "grad_output"), _in(dtype, dS, u, du, do))),
    )
    for name, a, w in zip(("dq", "dk", "dv", "dg", "dbeta"), got_grads, want_grads, strict=True):
        assert_within(a, w, tol=TOL[dtype], dtype=dtype, name=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("regime", ["mild", "reset"])
def test_recurrent_primitives(ops, regime, dtype):
    """The step recurrence and its backward against the reference's in float64."""
    rng = np.random.default_rng(4)
    B, H, T, K_, V_ = 1, 2, 10, 3, 4
    q, k = rng.standard_normal((B, H, T, K_)), rng.standard_normal((B, H, T, K_))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, g, beta = (
        rng.standard_normal((B, H, T, V_)),
        gates(rng, (B, H, T, K_), regime),
        rng.uniform(0, 1, (B, H, T)),
    )
    state, do, dstate = (
        rng.standard_normal((B, H, K_, V_)),
        rng.standard_normal((B, H, T, V_)),
        rng.standard_normal((B, H, K_, V_)),
    )
    args = (q, k, v, g, beta)
    for name, a, w in zip(
        ("output", "final"),
        ops.recurrent_forward(*_in(dtype, *args, state), scale=0.5),
        REFERENCE.recurrent_forward(*args, state, scale=0.5),
        strict=True,
    ):
        assert_within(a, w, tol=TOL[dtype], dtype=dtype, name=name)
    got = ops.recurrent_backward(*_in(dtype, *args, state, do, dstate), scale=0.5)
    want = REFERENCE.recurrent_backward(*args, state, do, dstate, scale=0.5)
    for name, a, w in zip(("dq", "dk", "dv", "dg", "dbeta", "dstate"), got, want, strict=True):
        assert_within(a, w, tol=TOL[dtype], dtype=dtype, name=name)
