"""State pools as serving engines keep them: V-major pools (``state_v_first``), float16 and
bfloat16 pools (read as they are, computed in float32, rounded on store), a request naming its own
slot at several steps, and ``pad_slot_id``; against a float64 step recurrence written out here, on
every backend (cuda on Numba's simulator), with speculative verification (``num_accepted_tokens``)
in each; rows no request names bitwise unchanged; the refusals write nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import BACKENDS
from hypothesis import given, settings
from hypothesis import strategies as st

import kda
from kda.testing import gates

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes comes with jax
    ml_dtypes = None

POOL_DTYPES = ("float32", "float16") + (("bfloat16",) if ml_dtypes is not None else ())
MANTISSA = {"float32": 23, "float16": 10, "bfloat16": 7}  # bits after the point


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _bits(pool: np.ndarray) -> np.ndarray:
    """The pool's bytes, to compare bitwise (a NaN equals itself)."""
    return np.ascontiguousarray(pool).view(np.uint8)


def oracle(q, k, v, g, beta, start_pool, slots, accepted, pad=-1):
    """The float64 step recurrence per request (head-first ``[N, HV, T, *]``), from the K-major
    float64 pool ``start_pool [P, HV, K, V]``; ``slots [N]`` or ``[N, T]`` (entries ``-1`` or
    ``pad``: padding / not kept). Returns ``(output, {row: state written last})``, rows written in
    step order (a request naming its row at several steps leaves the last)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    slots = np.where(np.asarray(slots) == pad, -1, np.asarray(slots))
    N, _, T, K = q.shape
    out, written = np.zeros(v.shape), {}
    for n in range(N):
        per_step = slots.ndim == 2
        row = slots[n, accepted[n] - 1] if per_step else slots[n]
        if row < 0:
            continue
        S = start_pool[row].copy()
        for t in range(T):
            S = np.exp(g[n, :, t])[:, :, None] * S
            u = beta[n, :, t, None] * (v[n, :, t] - np.einsum("hk,hkv->hv", k[n, :, t], S))
            S = S + k[n, :, t, :, None] * u[:, None, :]
            out[n, :, t] = K**-0.5 * np.einsum("hk,hkv->hv", q[n, :, t], S)
            slot = slots[n, t] if per_step else (slots[n] if t == T - 1 else -1)
            if slot >= 0:
                written[int(slot)] = S.copy()
    return out, written


def _inputs(rng, N, HV, T, K, V, regime="mild"):
    q = rng.standard_normal((N, HV, T, K))
    k = rng.standard_normal((N, HV, T, K))
    k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    v = rng.standard_normal((N, HV, T, V))
    x = (q, k, v, gates(rng, (N, HV, T, K), regime), rng.uniform(0.0, 1.5, (N, HV, T)))
    return tuple(a.astype(np.float32) for a in x)


def _slots(rng, N, T, P, pad, per_step, own_repeats, n_pad):
    """``[N]`` or ``[N, T]`` slots and ``num_accepted_tokens``: each running request owns one or
    two rows (never ``pad``'s row), named at its steps (with ``own_repeats`` the same row at
    several steps) or left out (``pad`` / -1: not kept, never at the start slot); ``n_pad``
    padding requests (``pad`` throughout)."""
    free = [r for r in rng.permutation(P).tolist() if r != pad]
    accepted = np.ones(N, np.int64)
    if not per_step:
        slots = np.array([pad if n < n_pad else free[n] for n in range(N)], np.int64)
        return slots, None
    slots = np.full((N, T), pad, np.int64)
    for n in range(N):
        if n < n_pad:
            continue
        mine = [free.pop(), free.pop()]
        accepted[n] = rng.integers(1, T + 1)
        for t in range(T):
            if t == accepted[n] - 1 or rng.random() < 0.7:
                slots[n, t] = mine[0] if own_repeats and rng.random() < 0.7 else mine[t % 2]
            elif rng.random() < 0.5:
                slots[n, t] = -1  # -1 stays padding whatever pad_slot_id is
    return slots, accepted


def _check(out, pool_after, pool_before, x, slots, accepted, pad, dtype, v_first):
    """Outputs within 1e-5 of the recurrence from the (rounded) start rows, every written row
    within one rounding of it, every other row bitwise unchanged."""
    start = pool_before.astype(np.float64)
    if v_first:
        start = np.swapaxes(start, -1, -2)
    want_out, written = oracle(*x, start, slots, accepted if accepted is not None else [1] * len(slots), pad)
    scale = max(float(np.abs(want_out).max()), 1e-30)
    err = float(np.abs(out.astype(np.float64) - want_out).max())
    assert err <= 1e-5 * scale, f"output: {err:.3g} over {scale:.3g}"
    after = pool_after.astype(np.float64)
    if v_first:
        after = np.swapaxes(after, -1, -2)
    for row, want in written.items():
        got = after[row]
        # one rounding of the state to the pool's dtype (half an ulp), plus float32's own error
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - MANTISSA[dtype])
        slack = 1e-5 * max(float(np.abs(want).max()), 1e-30)
        excess = float((np.abs(got - want) - 0.5 * ulp - slack).max())
        assert excess <= 0, f"row {row}: off by {excess:.3g} more than one rounding to {dtype}"
    named = set(written) | {int(r) for r in np.asarray(slots).reshape(-1) if r >= 0 and r != pad}
    for row in range(pool_before.shape[0]):
        if row not in named:
            assert np.array_equal(_bits(pool_after[row]), _bits(pool_before[row])), f"row {row} changed"


def _pool(rng, P, HV, K, V, dtype, v_first, poison=True):
    pool = (0.5 * rng.standard_normal((P, HV, K, V))).astype(np.float32)
    if poison:
        pool[-1] = np.nan  # never named: a NaN there must not matter
    pool = pool.astype(_dtype(dtype))
    return np.ascontiguousarray(np.swapaxes(pool, -1, -2)) if v_first else pool


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", POOL_DTYPES)
@pytest.mark.parametrize("v_first", [False, True])
@settings(max_examples=6, deadline=None)
@given(
    N=st.integers(1, 3),
    HV=st.integers(1, 2),
    T=st.integers(1, 3),
    K=st.sampled_from([1, 4, 6, 8]),
    V=st.sampled_from([1, 3, 5, 8]),
    per_step=st.booleans(),
    own_repeats=st.booleans(),
    pad=st.sampled_from([-1, 0]),
    n_pad=st.integers(0, 1),
    regime=st.sampled_from(["mild", "strong", "reset"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_pools_match_the_recurrence(
    backend, dtype, v_first, N, HV, T, K, V, per_step, own_repeats, pad, n_pad, regime, seed
):
    """Every pool layout and dtype, 1-D and per-step slots (verify), own slots repeated, either
    padding id: the recurrence from the rounded start rows; unnamed rows bitwise kept."""
    rng = np.random.default_rng(seed)
    if not per_step:
        T = 1 if rng.random() < 0.5 else T
    P = 2 * N + 3
    x = _inputs(rng, N, HV, T, K, V, regime)
    slots, accepted = _slots(rng, N, T, P - 1, pad, per_step, own_repeats, min(n_pad, N))
    pool = _pool(rng, P, HV, K, V, dtype, v_first)
    before = pool.copy()
    kw = {"num_accepted_tokens": accepted, "state_v_first": v_first, "pad_slot_id": pad}
    out = kda.decode_kda(*x, pool, slots, backend=backend, **kw)
    assert out.dtype == np.float32
    _check(out, pool, before, x, slots, accepted, pad, dtype, v_first)


@pytest.mark.parametrize("dtype", [d for d in POOL_DTYPES if d != "float32"])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("width", [16, 40, 128])
@pytest.mark.parametrize("T", [1, 3])
def test_16bit_rows_are_the_rounded_float32_rows(dtype, v_first, width, T):
    """A 16-bit pool's step is the float32 pool's step from the same values, rounded on store: the
    same outputs, and stored rows bitwise the float32 pool's rows rounded (ml_dtypes / NumPy), on
    rows wide enough for the cpu kernel's bfloat16 vector stores (16 columns at a time, a scalar
    tail where the row is not a multiple of 16), in place (``T = 1``) and from the float32 private
    state (``T = 3``, own slots at every step), with a number of rows that leaves two rows past the
    cpu kernels' groups of four; and within one rounding of the recurrence."""
    if "cpu" not in BACKENDS:
        pytest.skip("no cpu backend")
    rng = np.random.default_rng(width + T)
    N, HV, P = 3, 2, 6
    K, V = (width, 26) if v_first else (26, width)  # the rows run over V (K-major) or K (V-major)
    rows = np.array([4, 0, 2])
    x = _inputs(rng, N, HV, T, K, V, "strong")
    slots = np.repeat(rows[:, None], T, axis=1) if T > 1 else rows
    pool = _pool(rng, P, HV, K, V, dtype, v_first)
    before, wide = pool.copy(), pool.astype(np.float32)
    out = kda.decode_kda(*x, pool, slots, state_v_first=v_first, backend="cpu")
    assert np.array_equal(out, kda.decode_kda(*x, wide, slots, state_v_first=v_first, backend="cpu"))
    assert np.array_equal(_bits(pool[rows]), _bits(wide[rows].astype(pool.dtype)))
    _check(out, pool, before, x, slots, None, -1, dtype, v_first)


@pytest.mark.slow
@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
def test_bfloat16_stores_without_the_bfloat16_instruction(tmp_path):
    """Where the target has AVX512-BF16 the bfloat16 vector stores are its ``vcvtneps2bf16``;
    the integer rounding the kernel compiles elsewhere, forced here in a fresh process and cache,
    stores the same bits (:func:`test_16bit_rows_are_the_rounded_float32_rows`)."""
    if "cpu" not in BACKENDS:
        pytest.skip("no cpu backend")
    from kda.cpu import _decode_kernels

    if not _decode_kernels.BF16_INSTRUCTION:
        pytest.skip("the kernel compiles the integer rounding here already (no AVX512-BF16)")
    here = os.path.dirname(os.path.abspath(__file__))
    script = f"""
import sys
sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]
from kda.cpu import _decode_kernels
_decode_kernels.BF16_INSTRUCTION = False
from test_decode_pools import test_16bit_rows_are_the_rounded_float32_rows as check
from test_decode_pools import test_cpu_bfloat16_row_stores_match_ml_dtypes
test_cpu_bfloat16_row_stores_match_ml_dtypes()
for v_first in (False, True):
    for width in (40, 128):
        for T in (1, 3):
            check("bfloat16", v_first, width, T)
asm = next(iter(_decode_kernels.decode.inspect_asm().values()))
print("vcvtneps2bf16" in asm)
"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.split() == ["False"], r.stdout


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", POOL_DTYPES)
def test_own_slot_at_every_step(backend, dtype):
    """vLLM's slots ``arange(N)[:, None].expand(N, T)``: each request's row ends with the state
    after its last step (T = 4, K = V = 16, V-major and K-major give the same rows)."""
    rng = np.random.default_rng(4)
    N, HV, T, K, V, P = 3, 2, 4, 16, 16, 5
    x = _inputs(rng, N, HV, T, K, V)
    slots = np.repeat(np.arange(N)[:, None], T, axis=1)
    results = []
    for v_first in (False, True):
        pool = _pool(np.random.default_rng(5), P, HV, K, V, dtype, v_first)
        before = pool.copy()
        out = kda.decode_kda(*x, pool, slots, state_v_first=v_first, backend=backend)
        _check(out, pool, before, x, slots, None, -1, dtype, v_first)
        results.append(np.swapaxes(pool, -1, -2) if v_first else pool)
    tol = 1e-5 if dtype == "float32" else 2.0 ** -MANTISSA[dtype]
    assert np.allclose(results[0].astype(np.float64)[:N], results[1].astype(np.float64)[:N], atol=tol * 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_slot_zero_leaves_row_zero(backend):
    """``pad_slot_id=0`` (vLLM's KDA layers): requests on row 0 are padding (zero output), row 0
    is neither read nor written (a NaN there stays and reaches no output), -1 is padding too."""
    rng = np.random.default_rng(6)
    x = _inputs(rng, 4, 2, 1, 4, 4)
    pool = _pool(rng, 6, 2, 4, 4, "float32", False, poison=False)
    pool[0] = np.nan
    before = pool.copy()
    out = kda.decode_kda(*x, pool, np.array([0, 3, -1, 2]), pad_slot_id=0, backend=backend)
    assert np.all(out[[0, 2]] == 0) and np.isfinite(out).all()
    assert np.array_equal(_bits(pool[[0, 1, 4, 5]]), _bits(before[[0, 1, 4, 5]]))
    _check(out, pool, before, x, np.array([0, 3, -1, 2]), None, 0, "float32", False)
    # the same call with -1 for the padding gives the same bits
    again = before.copy()
    ref = kda.decode_kda(*x, again, np.array([-1, 3, -1, 2]), backend=backend)
    assert np.array_equal(out, ref) and np.array_equal(_bits(again), _bits(pool))


@pytest.mark.parametrize("dtype", POOL_DTYPES)
@pytest.mark.parametrize("v_first", [False, True])
def test_backends_agree_and_routes_are_bitwise(dtype, v_first):
    """NumPy's direct route and a prepared plan give the same bits (one kernel), at K = V = 32
    with own slots repeated; the reference backend within 1e-5 of them."""
    if "cpu" not in BACKENDS:
        pytest.skip("no cpu backend")
    rng = np.random.default_rng(7)
    N, HV, T, K, V, P = 3, 2, 2, 32, 32, 8
    x = _inputs(rng, N, HV, T, K, V)
    slots = np.array([[1, 1], [4, 2], [0, 0]])
    accepted = np.array([2, 1, 1])
    pools = [_pool(np.random.default_rng(8), P, HV, K, V, dtype, v_first) for _ in range(3)]
    out = kda.decode_kda(*x, pools[0], slots, num_accepted_tokens=accepted, state_v_first=v_first)
    plan = kda.prepare_decode_kda(*x, pools[1], slots, num_accepted_tokens=accepted, state_v_first=v_first)
    assert np.array_equal(plan.run(), out) and np.array_equal(_bits(pools[1]), _bits(pools[0]))
    ref = kda.decode_kda(
        *x, pools[2], slots, num_accepted_tokens=accepted, state_v_first=v_first, backend="reference"
    )
    assert np.abs(ref - out).max() <= 1e-5 * np.abs(ref).max()


def test_plan_with_pad_slot_and_refilled_indices():
    """A prepared plan keeps ``pad_slot_id`` and ``state_v_first``; refilled indices are
    re-checked (a row named by two requests is refused naming both, nothing written)."""
    rng = np.random.default_rng(9)
    x = _inputs(rng, 2, 1, 1, 4, 6)
    pool = _pool(rng, 5, 1, 4, 6, "float16", True, poison=False)
    idx = np.array([0, 3])
    plan = kda.prepare_decode_kda(*x, pool, idx, state_v_first=True, pad_slot_id=0)
    before = pool.copy()
    out = plan.run().copy()
    assert np.all(out[0] == 0)
    _check(out, pool, before, x, idx, None, 0, "float16", True)
    idx[:] = [2, 2]
    kept = pool.copy()
    with pytest.raises(kda.InvalidInputError, match=r"\[2\] named by requests 0 and 1"):
        plan.run()
    assert np.array_equal(_bits(pool), _bits(kept))


# ---------------------------------------------------------------- refusals: nothing written

IIE, ITE = kda.InvalidInputError, kda.InvalidTypeError


def _small(dtype="float32", v_first=False, K=4, V=6):
    rng = np.random.default_rng(10)
    return _inputs(rng, 2, 1, 2, K, V), _pool(rng, 4, 1, K, V, dtype, v_first, poison=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"pool_dtype": "int32"}, ITE, r"state_pool must have dtype float32, float16 or bfloat16"),
        ({"pool_dtype": "float64"}, ITE, r"state_pool must have dtype.*got float64"),
        ({"v_first": True}, IIE, r"state_pool must have shape \[P, HV, V, K\].*pass state_v_first=False"),
        ({"transposed": True}, IIE, r"state_pool must have shape \[P, HV, K, V\].*pass state_v_first=True"),
        ({"state_v_first": 1}, ITE, r"state_v_first must be a bool"),
        ({"pad_slot_id": -2}, IIE, r"pad_slot_id must be -1 or a pool row in \[0, 4\).*got -2"),
        ({"pad_slot_id": 4}, IIE, r"pad_slot_id must be -1 or a pool row in \[0, 4\).*got 4"),
        ({"pad_slot_id": True}, ITE, r"pad_slot_id must be an int"),
        ({"pad_slot_id": 0.0}, ITE, r"pad_slot_id must be an int"),
        ({"slots": [[1, 1], [2, 1]]}, IIE, r"\[1\] named by requests 0 and 1"),
        ({"slots": [3, 3]}, IIE, r"\[3\] named by requests 0 and 1"),
        ({"slots": [[1, 0], [0, 2]], "pad_slot_id": 0}, IIE, r"state_indices\[1\] starts from slot 0"),
    ],
)
def test_bad_pools_and_ids_write_nothing(backend, change, error, match):
    inputs, pool = _small(change.get("pool_dtype", "float32"))
    if change.get("pool_dtype") == "int32":
        pool = (pool * 10).astype(np.int32)
    if change.get("pool_dtype") == "float64":
        pool = pool.astype(np.float64)
    if change.get("transposed"):
        pool = np.ascontiguousarray(np.swapaxes(pool, -1, -2))
    before = pool.copy()
    kw = {"state_v_first": change.get("state_v_first", change.get("v_first", False))}
    if "pad_slot_id" in change:
        kw["pad_slot_id"] = change["pad_slot_id"]
    slots = change.get("slots", [[1, 2], [3, -1]])
    with pytest.raises(error, match=match):
        kda.decode_kda(*inputs, pool, slots, backend=backend, **kw)
    with pytest.raises(error, match=match):
        kda.prepare_decode_kda(*inputs, pool, slots, backend=backend, **kw)
    assert np.array_equal(pool, before)


def test_float64_inputs_need_a_float64_pool():
    inputs, pool = _small()
    x64 = tuple(a.astype(np.float64) for a in inputs)
    for half in ("float16", "float32"):
        p = pool.astype(half)
        with pytest.raises(kda.InvalidTypeError, match=r"state_pool must have dtype float64.*got " + half):
            kda.decode_kda(*x64, p, [1, 2])


# ---------------------------------------------------------------- kda.torch: vLLM's pool call

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", POOL_DTYPES)
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("pad", [-1, 0])
def test_torch_pool_call(dtype, v_first, pad):
    """``fused_recurrent_kda(..., initial_state=pool, ssm_state_indices, num_accepted_tokens,
    inplace_final_state=True, state_v_first, pad_slot_id)`` on float32 / float16 / bfloat16 and
    K- / V-major pools: the pool tensor itself written (bitwise NumPy's ``decode_kda``)."""
    from kda.torch import fused_recurrent_kda

    rng = np.random.default_rng(11)
    N, HV, T, K, V, P = 3, 2, 2, 8, 12, 9
    x = _inputs(rng, N, HV, T, K, V)
    slots = np.array([[1, 1], [pad, pad], [5, 3]])
    accepted = np.array([1, 1, 2])
    pool = _pool(rng, P, HV, K, V, dtype, v_first)
    want_pool = pool.copy()
    want = kda.decode_kda(
        *x, want_pool, slots, num_accepted_tokens=accepted, state_v_first=v_first, pad_slot_id=pad
    )
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    if dtype == "bfloat16":
        t_pool = torch.from_numpy(pool.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t_pool = torch.from_numpy(pool.copy())
    assert t_pool.dtype == tdt
    ptr = t_pool.data_ptr()
    tq, tk, tv, tg, tb = (torch.from_numpy(np.ascontiguousarray(np.swapaxes(a, 1, 2))) for a in x)
    with torch.inference_mode():
        o, final = fused_recurrent_kda(
            tq,
            tk,
            tv,
            tg,
            tb,
            initial_state=t_pool,
            inplace_final_state=True,
            state_v_first=v_first,
            ssm_state_indices=torch.from_numpy(slots.astype(np.int32)),
            num_accepted_tokens=torch.from_numpy(accepted),
            pad_slot_id=pad,
        )
    assert final is t_pool and t_pool.data_ptr() == ptr
    assert np.array_equal(o.numpy(), np.swapaxes(want, 1, 2))
    got = t_pool.view(torch.int16).numpy() if dtype == "bfloat16" else t_pool.numpy()
    assert np.array_equal(_bits(got), _bits(want_pool))


def test_torch_pool_refusals():
    from kda.torch import fused_recurrent_kda

    rng = np.random.default_rng(12)
    x = _inputs(rng, 2, 1, 1, 4, 4)
    tq, tk, tv, tg, tb = (torch.from_numpy(np.ascontiguousarray(np.swapaxes(a, 1, 2))) for a in x)
    pool = torch.zeros((3, 1, 4, 4), dtype=torch.int32)
    with pytest.raises(
        kda.InvalidTypeError,
        match=r"initial_state \(the state pool, updated in place\) must have dtype float32, float16 or "
        r"bfloat16",
    ):
        fused_recurrent_kda(
            tq,
            tk,
            tv,
            tg,
            tb,
            initial_state=pool,
            inplace_final_state=True,
            ssm_state_indices=torch.tensor([0, 1]),
        )
    pool = torch.zeros((3, 1, 4, 4))
    for pad, err in ((torch.tensor(0), kda.InvalidTypeError), (7, kda.InvalidInputError)):
        with pytest.raises(err, match="pad_slot_id"):
            fused_recurrent_kda(
                tq,
                tk,
                tv,
                tg,
                tb,
                initial_state=pool,
                inplace_final_state=True,
                ssm_state_indices=torch.tensor([0, 1]),
                pad_slot_id=pad,
            )
    assert torch.count_nonzero(pool) == 0
    from kda.torch import chunk_kda

    with pytest.raises(TypeError, match="pad_slot_id"):  # chunk_kda takes no decode keyword
        chunk_kda(tq, tk, tv, tg, tb, pad_slot_id=0)


def _bfloat16_cases(rng, n):
    """float32 values to round to bfloat16: random magnitudes over the normal range, every tie
    (lower half ``0x8000``), overflow, inf, NaN (no subnormals: the kernels flush them; no -0:
    ``1 * S + 0 * y`` is +0 there)."""
    every = np.arange(0, 2**15, dtype=np.int64).astype(np.int16)
    ties = every.view(ml_dtypes.bfloat16).astype(np.float32).view(np.int32) + 0x8000
    ties = ties.view(np.float32)[np.abs(ties.view(np.float32)) >= np.finfo(np.float32).tiny]
    x = np.ldexp(rng.uniform(-1, 1, n).astype(np.float32), rng.integers(-124, 128, n).astype(np.int32))
    x = x[np.abs(x) >= np.finfo(np.float32).tiny]
    edges = np.array([0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1.1754944e-38], np.float32)
    return np.concatenate([x, ties, -ties, edges])


def test_cpu_bfloat16_row_stores_match_ml_dtypes():
    """The cpu kernel's bfloat16 row store (:func:`kda.cpu._decode_kernels.blend_row`: 16 columns
    at a time as one vector, rows of 40 leaving a scalar tail): ``a * S + b * y`` with ``a = 1,
    b = 0`` rounds ``S`` to nearest even as ml_dtypes does (ties, overflow, inf, NaN quieted);
    with random ``a, b, y`` and ``S`` in bfloat16 bits, lane for lane the scalar loop's
    ``store(D, fma(b, y, a * load(S, S[c])))``, near cancellation where the rounding shows it."""
    if ml_dtypes is None or "cpu" not in BACKENDS:
        pytest.skip("needs ml_dtypes and the cpu backend")
    import numba

    from kda.cpu._decode_kernels import blend_row, fma, load, store

    @numba.njit
    def rows(D, S, a, b, y, vector):
        for r in range(D.shape[0]):
            Dr, Sr = D[r], S[r]
            start = blend_row(Dr, Sr, a[r], b[r], y[r]) if vector else 0
            for c in range(start, Dr.shape[0]):
                Dr[c] = store(Dr, fma(b[r], y[r, c], a[r] * load(Sr, Sr[c])))

    rng = np.random.default_rng(15)
    x = _bfloat16_cases(rng, 40 * 5000)
    x = np.concatenate([x, np.zeros(-len(x) % 40, np.float32)]).reshape(-1, 40)
    R = x.shape[0]
    D = np.zeros(x.shape, np.int16)
    rows(D, x, np.ones(R, np.float32), np.zeros(R, np.float32), np.zeros(x.shape, np.float32), True)
    with np.errstate(invalid="ignore", over="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.int16)
    nan = np.isnan(x)
    assert np.array_equal(D[~nan], want[~nan])
    assert np.isnan(D[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    # random steps near cancellation: a * S close to -b * y
    S = rng.standard_normal((R, 40)).astype(ml_dtypes.bfloat16).view(np.int16)
    a = rng.uniform(0.1, 1, R).astype(np.float32)
    b = rng.uniform(0.1, 1, R).astype(np.float32)
    y = (-a[:, None] * S.view(ml_dtypes.bfloat16).astype(np.float32) / b[:, None]).astype(np.float32)
    y *= np.float32(1) + rng.uniform(-1e-3, 1e-3, y.shape).astype(np.float32)
    got, scalar = np.zeros_like(S), np.zeros_like(S)
    rows(got, S, a, b, y, True)
    rows(scalar, S, a, b, y, False)
    assert np.array_equal(got, scalar)


def test_cuda_bfloat16_conversions_match_ml_dtypes():
    """The CUDA kernel's bfloat16 conversions (arithmetic, no bit casts) against ml_dtypes: every
    bfloat16 value read exactly; float32 values (ties, subnormals, overflow, inf, NaN, -0) rounded
    to nearest even."""
    if ml_dtypes is None or "cuda" not in BACKENDS:
        pytest.skip("needs ml_dtypes and numba-cuda")
    from kda.cuda._decode import _bfloat_to_float, _float_to_bfloat

    every = np.arange(-(2**15), 2**15, dtype=np.int64).astype(np.int16)
    want = every.view(ml_dtypes.bfloat16).astype(np.float32)
    got = np.array([_bfloat_to_float(b) for b in every], np.float32)
    assert np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want))
    rng = np.random.default_rng(13)
    ties = every[every >= 0].view(ml_dtypes.bfloat16).astype(np.float32).view(np.int32) + 0x8000
    xs = np.concatenate(
        [
            np.ldexp(
                rng.uniform(-1, 1, 3000).astype(np.float32), rng.integers(-140, 128, 3000).astype(np.int32)
            ),
            ties.view(np.float32),
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45, 1.1754942e-38], np.float32),
        ]
    )
    got = np.array([_float_to_bfloat(np.float32(x)) for x in xs], np.int64).astype(np.int16)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and overflow are what is tested
        want = xs.astype(ml_dtypes.bfloat16)
    nan = np.isnan(xs)
    assert np.array_equal(got[~nan], want[~nan].view(np.int16))
    assert np.isnan(got[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()


@pytest.mark.parametrize("grad", [False, True])
def test_torch_fla_form_with_v_major_states(grad, monkeypatch):
    """``fused_recurrent_kda(..., initial_state=s0, output_final_state=True, state_v_first=True)``:
    in inference the decode kernel reads and writes V-major states as they are; the result equals
    the K-major call's transposed (and the differentiable path's)."""
    from kda.torch import fused_recurrent_kda

    rng = np.random.default_rng(14)
    x = _inputs(rng, 2, 2, 1, 8, 12)
    tx = [torch.from_numpy(np.ascontiguousarray(np.swapaxes(a, 1, 2))) for a in x]
    s0 = torch.from_numpy((0.5 * rng.standard_normal((2, 2, 8, 12))).astype(np.float32))
    s0_v = s0.transpose(-1, -2).contiguous()
    if grad:
        tx[0].requires_grad_(True)
    elif "cpu" in BACKENDS:  # inference: the kernel reads the V-major state itself, no row copies
        import kda.cpu._decode as cpu_decode

        def no_copies(*args):
            raise AssertionError("a V-major state was served through row copies")

        monkeypatch.setattr(cpu_decode, "_through_copies", no_copies)
    with torch.inference_mode(not grad):
        o_k, f_k = fused_recurrent_kda(*tx, initial_state=s0, output_final_state=True)
        o_v, f_v = fused_recurrent_kda(*tx, initial_state=s0_v, output_final_state=True, state_v_first=True)
    assert f_v.shape == (2, 2, 12, 8)
    assert torch.allclose(o_v, o_k, atol=1e-6) and torch.allclose(f_v, f_k.transpose(-1, -2), atol=1e-6)
    _, written = oracle(*x, s0.double().numpy(), np.arange(2), None)
    assert (
        np.abs(f_v.detach().transpose(-1, -2).double().numpy() - np.stack([written[0], written[1]])).max()
        < 1e-5
    )


def test_torch_eager_calls_are_the_ops():
    """In eager inference ``kda.torch`` runs the inference ops' implementations directly (their
    dispatch costs more than a small step): bitwise what the ops give (``no_grad``: the pool op;
    ``torch.ops.kda.recurrent_inference`` called as such), and both forms write the same pool rows."""
    from kda.torch import fused_recurrent_kda

    rng = np.random.default_rng(15)
    x = _inputs(rng, 2, 2, 1, 8, 8)
    tx = [torch.from_numpy(np.ascontiguousarray(np.swapaxes(a, 1, 2))) for a in x]
    s0 = torch.from_numpy((0.5 * rng.standard_normal((2, 2, 8, 8))).astype(np.float32))
    pools = [torch.from_numpy(_pool(rng, 5, 2, 8, 8, "float32", True, poison=False)) for _ in range(2)]
    pools[1].copy_(pools[0])
    kw = {
        "ssm_state_indices": torch.tensor([3, 1], dtype=torch.int32),
        "inplace_final_state": True,
        "state_v_first": True,
    }
    with torch.inference_mode():
        o1, f1 = fused_recurrent_kda(*tx, initial_state=s0, output_final_state=True)
        p1, _ = fused_recurrent_kda(*tx, initial_state=pools[0], **kw)
    static = (*tx, s0, None, None, None, False, "recurrent", 8**-0.5, 64, False, "log", None, "")
    o2, f2 = torch.ops.kda.recurrent_inference(*static)
    with torch.no_grad():
        p2, _ = fused_recurrent_kda(*tx, initial_state=pools[1], **kw)
    assert torch.equal(o1, o2) and torch.equal(f1, f2)
    assert torch.equal(p1, p2) and torch.equal(pools[0], pools[1])


@pytest.mark.skipif(ml_dtypes is None or "cpu" not in BACKENDS, reason="needs ml_dtypes and the cpu backend")
def test_pools_benchmark_runs(capsys):
    """``python -m benchmarks.decode --pools`` (one head, one timed call): a row per request count
    and API with every pool kind and ratio, and the machine (CPU model, load average) printed."""
    from benchmarks import decode as bench

    assert bench.main(["--pools", "--heads", "1", "--repeats", "1", "--many-repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "load average" in out and "cpu:" in out and "bfloat16 V" in out and "bf16/f32 V" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("1 | ")]
    assert {(r[1], r[2]) for r in rows} >= {("1", "decode_kda"), ("64", "decode_kda")}
    assert all(len(r) == 3 + 6 + 7 for r in rows)
    verdicts = [line for line in out.splitlines() if line.startswith("target ")]
    assert [v.split(" <= ")[0] for v in verdicts] == ["target V-major/K-major", "target 16-bit/float32"]
    assert all(("met (worst" in v) != ("MISSED (worst" in v) for v in verdicts)


@pytest.mark.parametrize("dtype", POOL_DTYPES)
@pytest.mark.parametrize("v_first", [False, True])
def test_jax_pool_call_keeps_the_pool_dtype(dtype, v_first):
    """kda.jax's pool call on float32 / float16 / bfloat16 pools in either layout (jitted or
    not): the new pool keeps the pool's dtype and is bitwise NumPy's ``decode_kda`` in place
    (the recurrence from the rounded start rows); the input pool is unchanged."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    from kda.jax import fused_recurrent_kda

    rng = np.random.default_rng(40)
    N, HV, T, K, V, P = 3, 2, 2, 20, 36, 7  # rows past 16 columns: the cpu kernel's vector stores
    x = _inputs(rng, N, HV, T, K, V)
    slots, accepted = np.array([[1, 1], [0, 0], [5, 3]]), np.array([1, 1, 2])
    pool = _pool(rng, P, HV, K, V, dtype, v_first)
    want_pool = pool.copy()
    want = kda.decode_kda(
        *x, want_pool, slots, num_accepted_tokens=accepted, state_v_first=v_first, pad_slot_id=0
    )
    _check(want, want_pool, pool, x, slots, accepted, 0, dtype, v_first)

    def run(q, k, v, g, beta, pool, slots, accepted):
        return fused_recurrent_kda(
            q,
            k,
            v,
            g,
            beta,
            initial_state=pool,
            inplace_final_state=True,
            ssm_state_indices=slots,
            num_accepted_tokens=accepted,
            state_v_first=v_first,
            pad_slot_id=0,
        )

    j_pool = jnp.asarray(pool)
    assert j_pool.dtype == pool.dtype
    args = (
        *(jnp.asarray(np.swapaxes(a, 1, 2)) for a in x),
        j_pool,
        jnp.asarray(slots, jnp.int32),
        jnp.asarray(accepted, jnp.int32),
    )
    for f in (run, jax.jit(run)):
        o, new = f(*args)
        assert new.dtype == pool.dtype and new.shape == pool.shape
        assert np.array_equal(np.asarray(o), np.swapaxes(want, 1, 2))
        assert np.array_equal(_bits(np.asarray(new)), _bits(want_pool))
    assert np.array_equal(_bits(np.asarray(j_pool)), _bits(pool)), "the input pool changed"
