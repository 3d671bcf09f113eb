"""Speculative verification from a state pool: ``decode_kda(..., state_indices [N, T],
num_accepted_tokens [N])`` against a float64 step recurrence written out here (the oracle), on
every backend; packed requests (``cu_seqlens``), skipped writes (``-1``), padding requests, the
prepared form, and the refusals (nothing written)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BACKENDS, assert_within, decline_direct_decode_route, spy_direct_decode_route
from hypothesis import given, settings
from hypothesis import strategies as st

import kda
from kda.testing import LOG_REGIMES, gates


def oracle(q, k, v, g, beta, pool, slots, accepted, lengths, offsets=None, scale=None):
    """The step recurrence in float64 per request, head-first inputs ``[B, HV, T, *]`` (``B == 1``
    with ``offsets``), ``q, k`` already at ``HV`` heads. Request ``n`` starts from
    ``slots[n, accepted[n] - 1]`` (1-D ``slots``: from ``slots[n]``, final state back there) and
    its state after step ``t`` goes to ``slots[n, t]``. Returns ``(output, pool after)``."""
    q, k, v, g, beta, before = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, pool))
    after, out = before.copy(), np.zeros(v.shape)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    for n, steps in enumerate(lengths):
        b, t0 = (0, offsets[n]) if offsets is not None else (n, 0)
        per_step = slots.ndim == 2
        row = (slots[n, accepted[n] - 1] if per_step else slots[n]) if steps else -1
        if row < 0:
            continue
        S = before[row].copy()  # [HV, K, V]
        for t in range(steps):
            i = t0 + t
            S = np.exp(g[b, :, i])[:, :, None] * S
            u = beta[b, :, i, None] * (v[b, :, i] - np.einsum("hk,hkv->hv", k[b, :, i], S))
            S = S + k[b, :, i, :, None] * u[:, None, :]
            out[b, :, i] = scale * np.einsum("hk,hkv->hv", q[b, :, i], S)
            slot = slots[n, t] if per_step else (slots[n] if t == steps - 1 else -1)
            if slot >= 0:
                after[slot] = S
    return out, after


def _inputs(rng, B, HV, T, K, V, regime="mild"):
    q = rng.standard_normal((B, HV, T, K))
    k = rng.standard_normal((B, HV, T, K))
    k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    v = rng.standard_normal((B, HV, T, V))
    return q, k, v, gates(rng, (B, HV, T, K), regime), rng.uniform(0.0, 1.5, (B, HV, T))


def _verify_slots(rng, N, W, P, lengths, holes, n_pad, accepted=None):
    """``[N, W]`` distinct rows of ``[0, P)``, some ``-1`` (never at the start slot), ``n_pad``
    padding requests (``-1`` throughout); and ``num_accepted_tokens`` in ``1..T_n`` (drawn, or
    ``accepted`` as given)."""
    rows = iter(rng.permutation(P)[: N * W].tolist())
    slots = np.full((N, W), -1, np.int64)
    given, accepted = accepted, np.ones(N, np.int64)
    for n, steps in enumerate(lengths):
        if n < n_pad or steps == 0:
            continue
        accepted[n] = rng.integers(1, steps + 1) if given is None else given[n]
        for t in range(steps):
            if t == accepted[n] - 1 or rng.random() >= holes:
                slots[n, t] = next(rows)
    return slots, accepted


def _untouched(pool_after, pool_before, slots):
    named = {int(r) for r in np.asarray(slots).reshape(-1) if r >= 0}
    for row in range(pool_before.shape[0]):
        if row not in named:
            assert np.array_equal(pool_after[row], pool_before[row]), (
                f"row {row}, named by no request, changed"
            )


def _pools(rng, P, HV, K, V):
    return rng.standard_normal((P, HV, K, V)) * 0.5


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20)
@given(
    N=st.integers(1, 4),
    HV=st.integers(1, 2),
    T=st.integers(1, 4),
    K=st.integers(1, 6),
    V=st.integers(1, 5),
    holes=st.sampled_from([0.0, 0.5]),
    n_pad=st.integers(0, 1),
    regime=st.sampled_from(LOG_REGIMES),
    seed=st.integers(0, 2**32 - 1),
)
def test_verify_matches_the_recurrence(backend, N, HV, T, K, V, holes, n_pad, regime, seed):
    """float64: outputs and every written slot within 1e-10 of the oracle; other rows bitwise kept."""
    rng = np.random.default_rng(seed)
    P = N * T + 2
    inputs = _inputs(rng, N, HV, T, K, V, regime)
    pool = _pools(rng, P, HV, K, V)
    slots, accepted = _verify_slots(rng, N, T, P, [T] * N, holes, min(n_pad, N))
    want_out, want_pool = oracle(*inputs, pool, slots, accepted, [T] * N)
    got = pool.copy()
    out = kda.decode_kda(*inputs, got, slots, num_accepted_tokens=accepted, backend=backend)
    assert_within(out, want_out, tol=1e-10, name="output")
    assert_within(got, want_pool, tol=1e-10, name="state_pool")
    _untouched(got, pool, slots)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("regime", ["mild", "reset", "strong"])
def test_verify_float32_against_float64(backend, regime):
    """float32 inputs and pool: within 1e-5 of the float64 oracle, at K = V = 32."""
    rng = np.random.default_rng(LOG_REGIMES.index(regime))
    N, HV, T, K, V, P = 3, 2, 4, 32, 32, 16
    inputs = _inputs(rng, N, HV, T, K, V, regime)
    pool = _pools(rng, P, HV, K, V)
    slots, accepted = _verify_slots(rng, N, T, P, [T] * N, 0.3, 0)
    want_out, want_pool = oracle(*inputs, pool, slots, accepted, [T] * N)
    got = pool.astype(np.float32)
    out = kda.decode_kda(
        *(x.astype(np.float32) for x in inputs), got, slots, num_accepted_tokens=accepted, backend=backend
    )
    assert out.dtype == np.float32
    assert_within(out, want_out.astype(np.float32), tol=1e-5, name="output")
    assert_within(got, want_pool.astype(np.float32), tol=1e-5, name="state_pool")
    _untouched(got, pool.astype(np.float32), slots)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_step", [True, False])
def test_packed_requests(backend, per_step):
    """cu_seqlens: requests of different lengths (one empty) in one row, time-major as fla's."""
    rng = np.random.default_rng(11)
    lengths = [3, 1, 0, 2]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    N, HV, K, V, P = len(lengths), 2, 5, 4, 20
    q, k, v, g, beta = _inputs(rng, 1, HV, int(offsets[-1]), K, V)
    pool = _pools(rng, P, HV, K, V)
    if per_step:
        slots, accepted = _verify_slots(rng, N, max(lengths), P, lengths, 0.4, 0)
    else:
        slots, accepted = np.array([7, -1, 3, 12], np.int64), None
    want_out, want_pool = oracle(q, k, v, g, beta, pool, slots, accepted, lengths, offsets)
    tm = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v, g, beta)]
    got = pool.copy()
    out = kda.decode_kda(
        *tm,
        got,
        slots,
        num_accepted_tokens=accepted,
        cu_seqlens=offsets,
        layout="time_major",
        backend=backend,
    )
    assert_within(out, np.swapaxes(want_out, 1, 2), tol=1e-10, name="output")
    assert_within(got, want_pool, tol=1e-10, name="state_pool")
    _untouched(got, pool, slots)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_d_indices_keep_their_meaning(backend):
    """1-D state_indices with T > 1: only the final state is written, into the start row."""
    rng = np.random.default_rng(5)
    inputs = _inputs(rng, 3, 2, 3, 4, 3)
    pool = _pools(rng, 6, 2, 4, 3)
    idx = np.array([4, -1, 1], np.int64)
    want_out, want_pool = oracle(*inputs, pool, idx, None, [3, 3, 3])
    got = pool.copy()
    out = kda.decode_kda(*inputs, got, idx, backend=backend)
    assert_within(out, want_out, tol=1e-10, name="output")
    assert_within(got, want_pool, tol=1e-10, name="state_pool")
    assert not out[1].any()
    _untouched(got, pool, idx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_untouched_rows_are_not_read(backend):
    """NaN in rows no request names: no error, no NaN in the results, those rows kept bitwise."""
    rng = np.random.default_rng(9)
    inputs = _inputs(rng, 2, 1, 2, 4, 4)
    pool = _pools(rng, 8, 1, 4, 4)
    slots = np.array([[2, 5], [6, -1]], np.int64)
    pool[[0, 1, 3, 4, 7]] = np.nan
    _, want_pool = oracle(*inputs, pool, slots, np.array([2, 1]), [2, 2])
    got = pool.copy()
    out = kda.decode_kda(*inputs, got, slots, num_accepted_tokens=[2, 1], backend=backend)
    assert np.isfinite(out).all()
    assert_within(got[[2, 5, 6]], want_pool[[2, 5, 6]], tol=1e-10, name="state_pool")
    assert np.isnan(got[[0, 1, 3, 4, 7]]).all()


# ---------------------------------------------------------------- the direct NumPy route

# slot forms of 4 requests of T = 2 steps in a pool of 9 (request 2 is padding)
SLOT_FORMS = {
    "int64 [N]": (np.array([8, 0, -1, 3], np.int64), None),
    "int32 [N]": (np.array([8, 0, -1, 3], np.int32), None),
    "list [N]": ([8, 0, -1, 3], None),
    "strided int64 [N]": (np.array([8, 7, 0, 7, -1, 7, 3, 7], np.int64)[::2], None),
    "int64 [N, T]": (np.array([[8, 1], [0, -1], [-1, -1], [3, 5]], np.int64), [2, 1, 1, 2]),
    "int32 [N, T]": (np.array([[8, 1], [0, -1], [-1, -1], [3, 5]], np.int32), np.array([1, 1, 1, 2])),
}


@pytest.mark.parametrize("form", list(SLOT_FORMS))
@pytest.mark.parametrize("layout", ["head_first", "time_major"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_direct_route_is_bitwise_the_general_route(form, layout, dtype, monkeypatch):
    """Every slot form, layout and dtype the direct route serves: bitwise the general route's
    output and pool (the spy asserts that the direct route did serve the first call)."""
    rng = np.random.default_rng(2)
    inputs = [x.astype(dtype) for x in _inputs(rng, 4, 3, 2, 16, 8)]
    if layout == "time_major":
        inputs = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in inputs]
    pool = _pools(rng, 9, 3, 16, 8).astype(dtype)
    slots, accepted = SLOT_FORMS[form]
    a, b = pool.copy(), pool.copy()
    served = spy_direct_decode_route(monkeypatch)
    fast = kda.decode_kda(*inputs, a, slots, num_accepted_tokens=accepted, layout=layout)
    assert served == [True]
    decline_direct_decode_route(monkeypatch)
    slow = kda.decode_kda(*inputs, b, slots, num_accepted_tokens=accepted, layout=layout)
    assert np.array_equal(fast, slow) and np.array_equal(a, b)
    assert not np.array_equal(a, pool)  # something was written


@pytest.mark.parametrize("layout", ["head_first", "time_major"])
@pytest.mark.parametrize("read_only", [False, True])
def test_decode_states_direct_route_is_the_general_route(layout, read_only, monkeypatch):
    """The adapters' recurrent forward (decode_states): the direct route's output and final state
    are bitwise the general route's, and the initial state is only read (a read-only one, as a
    JAX callback passes it, takes the direct route too)."""
    from kda._entry.decode import decode_states

    rng = np.random.default_rng(5)
    inputs = [x.astype(np.float32) for x in _inputs(rng, 2, 3, 1, 16, 8)]
    if layout == "time_major":
        inputs = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in inputs]
    s0 = _pools(rng, 2, 3, 16, 8).astype(np.float32)
    before = s0.copy()
    s0.flags.writeable = not read_only
    served = spy_direct_decode_route(monkeypatch)
    fast = decode_states(*inputs, s0, layout=layout)
    assert served == [True] and np.array_equal(s0, before)
    decline_direct_decode_route(monkeypatch)
    slow = decode_states(*inputs, s0, layout=layout)
    assert np.array_equal(fast.output, slow.output) and np.array_equal(fast.final_state, slow.final_state)
    assert np.array_equal(s0, before)


@pytest.mark.parametrize(
    ("slots", "accepted", "match"),
    [
        (np.array([1, 1], np.int64), None, r"at most once.*\[1\]"),
        (np.array([0, 6], np.int64), None, r"row in \[0, 6\).*\[6\]"),
        (np.array([-2, 0], np.int32), None, r"state_indices must be -1.*\[-2\]"),
        (np.array([[0, 3], [3, 2]], np.int64), [1, 1], r"at most once.*\[3\]"),
        (np.array([[0, 3], [1, 2]], np.int32), np.array([1, 3]), r"num_accepted_tokens must be in 1..T"),
        (np.array([0, 1], np.int64), [1, 1], r"num_accepted_tokens needs 2-D state_indices"),
    ],
)
def test_direct_route_refusals_name_the_argument(slots, accepted, match, monkeypatch):
    """Bad slots of a call the direct route would serve (float32, plain): the named KdaError, nothing
    written; the direct route declined the call (the general route words the error)."""
    inputs, pool = _small()
    inputs, pool = [x.astype(np.float32) for x in inputs], pool.astype(np.float32)
    before = pool.copy()
    served = spy_direct_decode_route(monkeypatch)
    with pytest.raises(kda.InvalidInputError, match=match):
        kda.decode_kda(*inputs, pool, slots, num_accepted_tokens=accepted)
    assert served == [False] and np.array_equal(pool, before)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_cpu_screen(dtype):
    """kda.cpu.decode_screen (the direct route's value check, branch-free): g <= 0 with -inf and
    -0.0 allowed, NaN and any positive value refused; q, k, v, beta finite, however large."""
    import kda.cpu

    screen = kda.cpu.decode_screen
    rng = np.random.default_rng(0)
    shape = (1, 3, 1, 37)  # odd sizes: the vector loops' tails
    x = [rng.standard_normal(shape).astype(dtype) for _ in range(3)]
    g = -rng.uniform(0, 1, shape).astype(dtype)
    beta = rng.uniform(0, 1, shape[:3]).astype(dtype)
    assert screen(*x, g, beta, finite=True)
    huge = np.finfo(dtype).max
    large = [np.full(shape, huge, dtype) for _ in range(3)]
    assert screen(*large, g, np.full(shape[:3], huge, dtype), finite=True)
    g[0, 0, 0, :3] = [-np.inf, -0.0, 0.0]
    assert screen(*x, g, beta, finite=True)
    for bad in (np.nan, np.finfo(dtype).smallest_subnormal, 1.0, np.inf):
        for i in (0, 40, g.size - 1):
            worse = g.copy()
            worse.reshape(-1)[i] = bad
            assert not screen(*x, worse, beta, finite=True) and not screen(*x, worse, beta, finite=False)
    arrays = [*x, beta]
    for j in range(4):
        for bad in (np.nan, np.inf, -np.inf):
            for i in (0, arrays[j].size - 1):
                worse = [a.copy() for a in arrays]
                worse[j].reshape(-1)[i] = bad
                assert not screen(*worse[:3], g, worse[3], finite=True)
                assert screen(*worse[:3], g, worse[3], finite=False)  # finite=False: the gate alone
    assert not screen(*x, g.astype(np.float64 if dtype == np.float32 else np.float32), beta, finite=True)
    assert not screen(x[0][..., ::-1], *x[1:], g, beta, finite=True)  # not C-contiguous: the caller decides


# ---------------------------------------------------------------- refusals: nothing written


def _small(T=2):
    rng = np.random.default_rng(1)
    inputs = _inputs(rng, 2, 1, T, 3, 3)
    return inputs, _pools(rng, 6, 1, 3, 3)


IIE, ITE = kda.InvalidInputError, kda.InvalidTypeError


@pytest.mark.parametrize(
    ("slots", "accepted", "error", "match"),
    [
        ([[0, 6], [1, 2]], [1, 1], IIE, r"state_indices must be -1 \(padding\) or a row in \[0, 6\).*\[6\]"),
        ([[0, -2], [1, 2]], [1, 1], IIE, r"state_indices must be -1.*\[-2\]"),
        ([[0, 1], [1, 2]], [1, 1], IIE, r"at most once across requests.*\[1\] named by requests 0 and 1"),
        ([[0, 3], [3, 2]], [1, 1], IIE, r"at most once.*\[3\]"),
        ([[0, 3], [1, 2]], [0, 1], IIE, r"num_accepted_tokens must be in 1..T.*got 0 for request 0"),
        ([[0, 3], [1, 2]], [1, 3], IIE, r"num_accepted_tokens must be in 1..T.*got 3 for request 1"),
        ([[0, 3], [1, 2]], [1], IIE, r"num_accepted_tokens must have shape \[N\] = \(2,\)"),
        ([[0, 3], [1, 2]], [1.0, 1.0], ITE, r"num_accepted_tokens must be a 1-D integer array"),
        ([[0, 3]], [1, 1], IIE, r"state_indices must have shape \[N, T\] = \(2, 2\)"),
        ([[0], [1]], [1, 1], IIE, r"state_indices must have shape \[N, T\] = \(2, 2\)"),
        ([[-1, 4], [1, 2]], [1, 1], IIE, r"state_indices\[0\] starts from slot 0, which is -1"),
        ([0, 1], [1, 1], IIE, r"num_accepted_tokens needs 2-D state_indices"),
        ([[[0]]], None, ITE, r"state_indices must be a 1-D integer array or list"),
    ],
)
def test_bad_slots_write_nothing(slots, accepted, error, match):
    inputs, pool = _small()
    before = pool.copy()
    for backend in BACKENDS:
        with pytest.raises(error, match=match):
            kda.decode_kda(*inputs, pool, np.array(slots), num_accepted_tokens=accepted, backend=backend)
        assert np.array_equal(pool, before)


def test_bad_pools_write_nothing():
    inputs, pool = _small()
    slots = np.array([[0, 3], [1, 2]])
    ro = pool.copy()
    ro.flags.writeable = False
    with pytest.raises(kda.InvalidInputError, match="state_pool must be writable in place"):
        kda.decode_kda(*inputs, ro, slots)
    wrong = pool.astype(np.float32)
    with pytest.raises(kda.InvalidTypeError, match="state_pool must have dtype float64"):
        kda.decode_kda(*inputs, wrong, slots)
    assert np.array_equal(wrong, pool.astype(np.float32))


def test_bad_values_write_nothing():
    """A NaN input or a positive gate: refused before the pool is written, on either route."""
    inputs, pool = _small(T=1)
    before = pool.copy()
    for i, name in enumerate("qkvg"):
        bad = [x.copy() for x in inputs]
        bad[i][0, 0, 0, 0] = np.nan if name != "g" else 1.0
        for idx in (np.array([0, 1]), np.array([[0], [1]])):  # 1-D and 2-D slots
            with pytest.raises(kda.InvalidInputError, match=f"^{name} must"):
                kda.decode_kda(*bad, pool, idx)
            assert np.array_equal(pool, before)


# ---------------------------------------------------------------- the prepared form


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_runs_refilled_slots(backend):
    """A plan re-reads refilled inputs and slots each run: bitwise the plain call's results."""
    rng = np.random.default_rng(4)
    q, k, v, g, beta = (x.astype(np.float32) for x in _inputs(rng, 2, 2, 3, 8, 4))
    pool = _pools(rng, 10, 2, 8, 4).astype(np.float32)
    slots = np.array([[0, 1, 2], [3, -1, 5]], np.int64)
    accepted = np.array([1, 1], np.int64)
    plain_pool = pool.copy()
    plan = kda.prepare_decode_kda(
        q, k, v, g, beta, pool, slots, num_accepted_tokens=accepted, backend=backend
    )
    for step in range(3):
        new = _inputs(rng, 2, 2, 3, 8, 4)
        for buf, x in zip((q, k, v, g, beta), new):
            buf[...] = x
        slots[...] = np.array([[step + 6, 1, 2], [3, -1, 0]]) if step % 2 else slots
        accepted[...] = [1 + step % 3, 1]
        want = kda.decode_kda(
            q, k, v, g, beta, plain_pool, slots, num_accepted_tokens=accepted, backend=backend
        )
        got = plan.run()
        assert got is plan.out
        assert np.array_equal(got, want) and np.array_equal(pool, plain_pool)
    accepted[0] = 4
    with pytest.raises(kda.InvalidInputError, match=r"num_accepted_tokens must be in 1\.\.T"):
        plan.run()
    assert np.array_equal(pool, plain_pool)


def test_plan_refuses_a_refilled_positive_gate():
    rng = np.random.default_rng(6)
    q, k, v, g, beta = _inputs(rng, 1, 1, 1, 4, 4)
    pool = _pools(rng, 2, 1, 4, 4)
    plan = kda.prepare_decode_kda(q, k, v, g, beta, pool, np.array([1]))
    before = pool.copy()
    g[0, 0, 0, 0] = 0.5
    with pytest.raises(kda.InvalidInputError, match="g must hold log decays <= 0"):
        plan.run()
    assert np.array_equal(pool, before)


def test_plan_allocates_only_the_output():
    """On NumPy a plain plan's run allocates nothing that grows with the pool or the heads."""
    import tracemalloc

    rng = np.random.default_rng(3)
    q, k, v, g, beta = (x.astype(np.float32) for x in _inputs(rng, 1, 8, 1, 64, 64))
    pool = _pools(rng, 4, 8, 64, 64).astype(np.float32)
    plan = kda.prepare_decode_kda(q, k, v, g, beta, pool, np.array([2]))
    plan.run()
    tracemalloc.start()
    try:
        plan.run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4096, f"run() allocated {peak} bytes (the output buffer is bound: expected ~0)"


# ---------------------------------------------------------------- the adapters: vLLM's call


def _packed_problem(dtype, seed=12):
    """Time-major packed requests ``[1, T_total, HV, *]`` with 2-D slots (holes, a padding request)."""
    rng = np.random.default_rng(seed)
    lengths = [3, 2, 1, 3]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    N, HV, K, V, P = len(lengths), 2, 8, 6, 24
    head_first = _inputs(rng, 1, HV, int(offsets[-1]), K, V)
    pool = _pools(rng, P, HV, K, V)
    slots, accepted = _verify_slots(rng, N, max(lengths), P, lengths, 0.3, 1, accepted=[1, 2, 1, 3])
    want_out, want_pool = oracle(*head_first, pool, slots, accepted, lengths, offsets)
    tm = [np.ascontiguousarray(np.swapaxes(x, 1, 2)).astype(dtype) for x in head_first]
    return tm, pool.astype(dtype), slots, accepted, offsets, np.swapaxes(want_out, 1, 2), want_pool


@pytest.mark.parametrize(("dtype", "v_first"), [(np.float64, False), (np.float32, False), (np.float32, True)])
def test_torch_verify_as_vllm_calls_it(dtype, v_first):
    """kda.torch.fused_recurrent_kda(initial_state=pool, ssm_state_indices, num_accepted_tokens,
    inplace_final_state=True, cu_seqlens): the pool is updated in place, as the oracle says (also
    a pool of [V, K] states with state_v_first)."""
    torch = pytest.importorskip("torch")
    from kda.torch import fused_recurrent_kda

    tm, pool, slots, accepted, offsets, want_out, want_pool = _packed_problem(dtype)
    tol = 1e-10 if dtype == np.float64 else 1e-5
    if v_first:
        pool, want_pool = np.ascontiguousarray(pool.swapaxes(-1, -2)), want_pool.swapaxes(-1, -2)
    before = pool.copy()
    tpool = torch.from_numpy(pool)
    with torch.inference_mode():
        o, final = fused_recurrent_kda(
            *(torch.from_numpy(x) for x in tm),
            initial_state=tpool,
            inplace_final_state=True,
            ssm_state_indices=torch.from_numpy(slots).to(torch.int32),
            num_accepted_tokens=torch.from_numpy(accepted).to(torch.int32),
            cu_seqlens=torch.from_numpy(offsets),
            state_v_first=v_first,
        )
    assert final is tpool
    assert_within(o.numpy(), want_out.astype(dtype), tol=tol, name="output")
    assert_within(pool, want_pool.astype(dtype), tol=tol, name="state_pool")
    _untouched(pool, before, slots)


def test_torch_pool_refusals_write_nothing():
    torch = pytest.importorskip("torch")
    from kda.torch import fused_recurrent_kda

    tm, pool, slots, accepted, offsets, _, _ = _packed_problem(np.float32)
    before = pool.copy()
    x = [torch.from_numpy(a) for a in tm]
    kw = dict(ssm_state_indices=torch.from_numpy(slots), cu_seqlens=torch.from_numpy(offsets))
    tpool = torch.from_numpy(pool)
    with torch.inference_mode():
        with pytest.raises(kda.InvalidInputError, match="need inplace_final_state=True"):
            fused_recurrent_kda(*x, initial_state=tpool, **kw)
        with pytest.raises(kda.InvalidTypeError, match="the state pool, updated in place"):
            fused_recurrent_kda(*x, initial_state=tpool.double(), inplace_final_state=True, **kw)
        bad = torch.from_numpy(accepted.copy())
        bad[1] = 3  # request 1 has 2 steps
        with pytest.raises(kda.InvalidInputError, match="num_accepted_tokens must be in 1"):
            fused_recurrent_kda(
                *x, initial_state=tpool, inplace_final_state=True, num_accepted_tokens=bad, **kw
            )
    with pytest.raises(kda.InvalidInputError, match="inference only"):
        fused_recurrent_kda(
            x[0].requires_grad_(), *x[1:], initial_state=tpool, inplace_final_state=True, **kw
        )
    assert np.array_equal(pool, before)
    with pytest.raises(TypeError, match="unexpected keyword"):
        from kda.torch import chunk_kda

        chunk_kda(*x, ssm_state_indices=kw["ssm_state_indices"])


def test_jax_verify_returns_the_new_pool():
    """kda.jax: the same call returns the updated pool (a new array), also under jit."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    from kda.jax import fused_recurrent_kda

    tm, pool, slots, accepted, offsets, want_out, want_pool = _packed_problem(np.float32)

    def run(q, k, v, g, beta, pool, slots, accepted, offsets):
        keywords = dict(ssm_state_indices=slots, num_accepted_tokens=accepted, cu_seqlens=offsets)
        return fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, inplace_final_state=True, **keywords)

    args = (
        *(jnp.asarray(x) for x in tm),
        jnp.asarray(pool),
        jnp.asarray(slots, jnp.int32),
        jnp.asarray(accepted, jnp.int32),
        jnp.asarray(offsets, jnp.int32),
    )
    for f in (run, jax.jit(run)):
        o, new = f(*args)
        assert_within(np.asarray(o), want_out.astype(np.float32), tol=1e-5, name="output")
        assert_within(np.asarray(new), want_pool.astype(np.float32), tol=1e-5, name="state_pool")
        _untouched(np.asarray(new), pool, slots)
    assert np.array_equal(np.asarray(args[5]), pool), "the input pool changed"


def test_two_threads_are_bitwise_one(monkeypatch):
    """The cpu backend's split over two cores gives bitwise the one-thread results."""
    pytest.importorskip("numba")
    import kda.cpu._decode as cpu_decode

    rng = np.random.default_rng(13)
    inputs = [x.astype(np.float32) for x in _inputs(rng, 6, 3, 2, 16, 16)]
    pool = _pools(rng, 20, 3, 16, 16).astype(np.float32)
    slots, accepted = _verify_slots(rng, 6, 2, 20, [2] * 6, 0.3, 1)
    results = []
    for split in (1 << 62, 0):
        monkeypatch.setattr(cpu_decode, "SPLIT_WORK", split)
        monkeypatch.setattr(cpu_decode, "_cores", lambda: 2)
        got = pool.copy()
        out = kda.decode_kda(*inputs, got, slots, num_accepted_tokens=accepted, backend="cpu")
        results.append((out, got))
    # a mismatch was seen once in CI and not reproduced since: say how many elements and how far
    (one_out, one_pool), (split_out, split_pool) = results
    for name, split, one in (("output", split_out, one_out), ("pool", split_pool, one_pool)):
        assert np.array_equal(split, one), (
            f"{name}: split vs one thread differ in {np.count_nonzero(split != one)} elements, "
            f"max |difference| {np.max(np.abs(split - one))}"
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_pool_is_written_in_place(backend):
    """A pool that is a strided view (every other row of a buffer): slots with holes, in place;
    the buffer's other rows are not touched."""
    rng = np.random.default_rng(14)
    inputs = _inputs(rng, 3, 2, 3, 4, 5)
    pool = _pools(rng, 7, 2, 4, 5)
    slots, accepted = _verify_slots(rng, 3, 3, 7, [3, 3, 3], 0.4, 0)
    want_out, want_pool = oracle(*inputs, pool, slots, accepted, [3] * 3)
    buffer = np.stack([pool, np.full_like(pool, 7.0)], axis=1).reshape(14, 2, 4, 5)
    view = buffer[::2]
    assert not view.flags.c_contiguous
    out = kda.decode_kda(*inputs, view, slots, num_accepted_tokens=accepted, backend=backend)
    assert_within(out, want_out, tol=1e-10, name="output")
    assert_within(view, want_pool, tol=1e-10, name="state_pool")
    _untouched(np.ascontiguousarray(view), pool, slots)
    assert np.all(buffer[1::2] == 7.0), "rows outside the view changed"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True])
def test_decode_states_is_the_recurrence(backend, packed):
    """decode_states (the adapters' recurrent forward): recurrent_kda's output and final state;
    the initial state is only read (also a read-only one)."""
    from kda._entry.decode import decode_states

    rng = np.random.default_rng(15)
    B, T = (1, 7) if packed else (3, 2)
    q, k, v, g, beta = _inputs(rng, B, 2, T, 4, 3)
    offsets = np.array([0, 3, 3, 7]) if packed else None
    s0 = _pools(rng, 3, 2, 4, 3)
    s0.flags.writeable = False
    kept = s0.copy()
    for state in (s0, None):
        want = kda.recurrent_kda(
            q, k, v, g, beta, initial_state=state, cu_seqlens=offsets, backend="reference"
        )
        got = decode_states(q, k, v, g, beta, state, cu_seqlens=offsets, backend=backend)
        assert_within(got.output, want.output, tol=1e-10, name="output")
        assert_within(got.final_state, want.final_state, tol=1e-10, name="final_state")
    assert np.array_equal(s0, kept)


def test_large_finite_outputs_do_not_warn():
    """Outputs whose float32 sum overflows but which are finite: no warning (filterwarnings=error)."""
    q = np.full((1, 1, 1, 2), 1.0, np.float32)
    k = np.array([[[[1.0, 0.0]]]], np.float32)
    v = np.full((1, 1, 1, 4096), 3e35, np.float32)
    g = np.zeros((1, 1, 1, 2), np.float32)
    beta = np.ones((1, 1, 1), np.float32)
    pool = np.zeros((2, 1, 2, 4096), np.float32)
    out = kda.decode_kda(q, k, v, g, beta, pool, np.array([1]), scale=1.0)
    with np.errstate(over="ignore"):
        assert np.isfinite(out).all() and not np.isfinite(out.sum(dtype=np.float32))


def test_torch_compile_traces_the_pool_op():
    """torch.compile(fullgraph=True) traces vLLM's call (the mutating op kda::decode) and the
    inference recurrent op; results equal eager, the pool written the same."""
    torch = pytest.importorskip("torch")
    from kda.torch import fused_recurrent_kda

    tm, pool, slots, accepted, offsets, _, _ = _packed_problem(np.float32)
    x = [torch.from_numpy(a) for a in tm]

    def step(q, k, v, g, beta, pool, slots, accepted, offsets):
        keywords = dict(ssm_state_indices=slots, num_accepted_tokens=accepted, cu_seqlens=offsets)
        o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, inplace_final_state=True, **keywords)
        return o * 2

    ints = [torch.from_numpy(a) for a in (slots, accepted, offsets)]
    with torch.inference_mode():
        eager_pool, compiled_pool = torch.from_numpy(pool.copy()), torch.from_numpy(pool.copy())
        want = step(*x, eager_pool, *ints)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(*x, compiled_pool, *ints)
    assert torch.equal(want, got) and torch.equal(eager_pool, compiled_pool)
    assert not torch.equal(eager_pool, torch.from_numpy(pool))
