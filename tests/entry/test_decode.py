"""``kda.decode_kda``: a batch of requests against a pool of states, updated in place."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import BACKENDS, HAS_GPU, ROOT, TOLERANCE, assert_within
from hypothesis import given, settings
from hypothesis import strategies as st

import kda
from kda.testing import LOG_REGIMES, gates


def _request_problem(rng, N, H, G, T, K, V, P, regime="mild"):
    """Raw inputs of ``N`` requests (head-first, float64), a pool of ``P`` rows, unit keys."""
    HV = H * G
    q = rng.standard_normal((N, H, T, K))
    k = rng.standard_normal((N, H, T, K))
    k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    v = rng.standard_normal((N, HV, T, V))
    g = gates(rng, (N, HV, T, K), regime)
    beta = rng.uniform(0.0, 2.0, (N, HV, T))
    pool = rng.standard_normal((P, HV, K, V))
    return q, k, v, g, beta, pool


def _indices(rng, N, P, n_pad):
    """``N`` indices: ``n_pad`` of them -1, the rest distinct rows of ``[0, P)``."""
    rows = rng.choice(P, size=N - n_pad, replace=False)
    idx = np.concatenate([rows, -np.ones(n_pad, dtype=np.int64)])
    return rng.permutation(idx)


def _alone(inputs, pool, indices, **options):
    """Each request run alone with ``recurrent_kda`` from its row: (outputs, expected pool)."""
    outs = np.zeros((len(indices), *inputs[2].shape[1:]), dtype=inputs[2].dtype)
    want = pool.copy()
    for n, row in enumerate(indices):
        if row < 0:
            continue
        one = [x[n : n + 1] for x in inputs]
        ref = kda.recurrent_kda(*one, initial_state=pool[row : row + 1], backend="reference", **options)
        outs[n] = ref.output[0]
        want[row] = ref.final_state[0]
    return outs, want


def _check(got_out, got_pool, want_out, want_pool, pool_before, indices, tol):
    assert_within(got_out, want_out, tol=tol, name="output")
    assert_within(got_pool, want_pool, tol=tol, name="state_pool")
    touched = {int(i) for i in indices if i >= 0}
    for row in range(pool_before.shape[0]):
        if row not in touched:
            assert np.array_equal(got_pool[row], pool_before[row]), f"untouched row {row} changed"
    for n, row in enumerate(indices):
        if row < 0:
            assert not np.any(got_out[n]), f"padding request {n} has a non-zero output"


@settings(max_examples=60)
@given(
    N=st.integers(1, 4),
    H=st.integers(1, 2),
    G=st.integers(1, 2),
    T=st.integers(0, 3),
    K=st.integers(1, 8),
    V=st.integers(1, 8),
    extra_rows=st.integers(0, 3),
    n_pad=st.integers(0, 2),
    regime=st.sampled_from(LOG_REGIMES),
    seed=st.integers(0, 2**32 - 1),
)
def test_pool_matches_each_request_alone(N, H, G, T, K, V, extra_rows, n_pad, regime, seed):
    """float64: the pool result equals running each request alone from its row (to 1e-10)."""
    rng = np.random.default_rng(seed)
    n_pad = min(n_pad, N)
    P = N - n_pad + extra_rows
    *inputs, pool = _request_problem(rng, N, H, G, T, K, V, P, regime)
    idx = _indices(rng, N, P, n_pad)
    want_out, want_pool = _alone(inputs, pool, idx)
    before, copies = pool.copy(), [x.copy() for x in inputs]
    out = kda.decode_kda(*inputs, pool, idx)
    _check(out, pool, want_out, want_pool, before, idx, TOLERANCE[np.dtype(np.float64)])
    for x, c in zip(inputs, copies):
        assert np.array_equal(x, c), "an input was modified"


@pytest.mark.parametrize("regime", LOG_REGIMES)
def test_float32_against_float64(regime):
    """float32 inputs and pool: within 1e-5 of the float64 run; float16 inputs use a float32 pool."""
    rng = np.random.default_rng(LOG_REGIMES.index(regime))
    *inputs, pool = _request_problem(rng, 5, 2, 2, 3, 16, 12, 9, regime)
    idx = np.array([4, -1, 0, 8, 2])
    want_out, want_pool = _alone(inputs, pool, idx)
    pool32 = pool.astype(np.float32)
    out = kda.decode_kda(*(x.astype(np.float32) for x in inputs), pool32, idx)
    _check(
        out,
        pool32,
        want_out.astype(np.float32),
        want_pool.astype(np.float32),
        pool.astype(np.float32),
        idx,
        1e-5,
    )
    out16 = kda.decode_kda(*(x.astype(np.float16) for x in inputs), pool.astype(np.float32), list(idx))
    assert out16.dtype == np.float16


@pytest.mark.parametrize("layout", ["head_first", "time_major"])
def test_options_match_recurrent(layout):
    """Every model-level option gives what recurrent_kda gives with the same options."""
    rng = np.random.default_rng(7)
    N, H, G, T, K, V = 3, 2, 2, 2, 8, 4
    *inputs, pool = _request_problem(rng, N, H, G, T, K, V, 5)
    q, k, v, g, beta = inputs
    g = rng.standard_normal(g.shape)  # raw gates
    beta = rng.standard_normal(beta.shape)  # raw beta
    if layout == "time_major":
        q, k, v, g = (np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v, g))
        beta = np.ascontiguousarray(np.swapaxes(beta, 1, 2))
    options = dict(
        layout=layout,
        qk_l2norm=True,
        gate="softplus",
        A_log=rng.uniform(-1, 1, H * G),
        dt_bias=rng.standard_normal((H * G, K)),
        beta_activation="sigmoid",
    )
    idx = np.array([3, 0, -1])
    inputs = (q, k, v, g, beta)
    want_out, want_pool = _alone(inputs, pool, idx, **options)
    before = pool.copy()
    out = kda.decode_kda(*inputs, pool, idx, **options)
    _check(out, pool, want_out, want_pool, before, idx, 1e-10)


def _small():
    rng = np.random.default_rng(1)
    *inputs, pool = _request_problem(rng, 3, 2, 1, 1, 4, 4, 5)
    return inputs, pool


@pytest.mark.parametrize(
    ("indices", "match"),
    [
        ([1, 1, 2], r"state_indices must name each pool row at most once.*\[1\]"),
        ([0, 5, 1], r"state_indices must be -1 \(padding\) or a row in \[0, 5\).*\[5\]"),
        ([0, -2, 1], r"state_indices must be -1.*\[-2\]"),
        ([0, 1], r"state_indices must have shape \[N\] = \(3,\)"),
    ],
)
def test_bad_indices(indices, match):
    inputs, pool = _small()
    before = pool.copy()
    with pytest.raises(kda.InvalidInputError, match=match):
        kda.decode_kda(*inputs, pool, np.array(indices))
    assert np.array_equal(pool, before)


def test_bad_pools():
    inputs, pool = _small()
    ro = pool.copy()
    ro.flags.writeable = False
    with pytest.raises(kda.InvalidInputError, match="state_pool must be writable in place"):
        kda.decode_kda(*inputs, ro, [0, 1, 2])
    with pytest.raises(kda.InvalidTypeError, match=r"state_pool must have dtype float64"):
        kda.decode_kda(*inputs, pool.astype(np.float32), [0, 1, 2])
    with pytest.raises(kda.InvalidInputError, match=r"state_pool must have shape \[P, HV, K, V\]"):
        kda.decode_kda(*inputs, pool[:, :1], [0, 1, 2])
    with pytest.raises(kda.InvalidInputError, match="state_pool must be a 4-D array"):
        kda.decode_kda(*inputs, pool[0], [0, 1, 2])
    for bad in (np.array([0.0, 1.0, 2.0]), None, "012"):
        with pytest.raises(
            kda.InvalidTypeError, match="state_indices must be a 1-D integer array or list of ints"
        ):
            kda.decode_kda(*inputs, pool, bad)


def test_immutable_namespace_refused():
    jnp = pytest.importorskip("jax.numpy")
    inputs, pool = _small()
    with pytest.raises(kda.InvalidInputError, match="state_pool must be writable in place"):
        kda.decode_kda(*(jnp.asarray(x) for x in inputs), jnp.asarray(pool), jnp.asarray([0, 1, 2]))


def test_array_api_strict_pool():
    xps = pytest.importorskip("array_api_strict")
    inputs, pool = _small()
    want_out, want_pool = _alone(inputs, pool, [2, -1, 0])
    spool = xps.asarray(pool)
    out = kda.decode_kda(*(xps.asarray(x) for x in inputs), spool, xps.asarray([2, -1, 0]))
    assert_within(np.asarray(out), want_out, tol=1e-10, name="output")
    assert_within(np.asarray(spool), want_pool, tol=1e-10, name="state_pool")


# ---------------------------------------------------------------- the CUDA kernel


def _cuda_or_skip():
    if "cuda" not in BACKENDS:  # numba-cuda absent: numba's own numba.cuda does not count
        pytest.skip("numba-cuda is not installed (pip install kda[cuda])")
    if HAS_GPU:
        return pytest.importorskip("cupy")
    import numba

    if not numba.config.ENABLE_CUDASIM:
        pytest.skip("no GPU and the CUDA simulator is off")
    return np


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("regime", ["mild", "reset"])
def test_cuda_one_launch_matches_reference(dtype, regime):
    xp = _cuda_or_skip()
    from kda.cuda._launch import LAUNCHES

    rng = np.random.default_rng(3)
    *inputs, pool = _request_problem(rng, 3, 1, 2, 2, 5, 3, 4, regime)
    idx = np.array([3, -1, 1])
    want_out, want_pool = _alone(inputs, pool, idx)
    before = pool.astype(dtype)
    dpool = xp.asarray(before.copy())
    launches = sum(LAUNCHES.values())
    out = kda.decode_kda(
        *(xp.asarray(x.astype(dtype)) for x in inputs), dpool, xp.asarray(idx), backend="cuda"
    )
    assert sum(LAUNCHES.values()) == launches + 1 and LAUNCHES["decode_forward"] >= 1
    host = (lambda a: a.get()) if xp is not np else np.asarray
    tol = TOLERANCE[np.dtype(dtype)]
    _check(host(out), host(dpool), want_out.astype(dtype), want_pool.astype(dtype), before, idx, tol)


def test_cuda_strided_pool_is_updated_in_place():
    """A pool that is a strided view (every other row of a larger buffer) is updated in place."""
    xp = _cuda_or_skip()
    rng = np.random.default_rng(8)
    *inputs, pool = _request_problem(rng, 2, 1, 1, 2, 3, 2, 3)
    idx = np.array([2, 0])
    want_out, want_pool = _alone(inputs, pool, idx)
    buffer = xp.asarray(np.stack([pool, np.full_like(pool, 7.0)], axis=1).reshape(6, *pool.shape[1:]))
    view = buffer[::2]
    assert not view.flags.c_contiguous
    out = kda.decode_kda(*(xp.asarray(x) for x in inputs), view, list(idx), backend="cuda")
    host = (lambda a: a.get()) if xp is not np else np.asarray
    _check(host(out), host(view), want_out, want_pool, pool, idx, TOLERANCE[np.dtype(np.float64)])
    assert np.all(host(buffer[1::2]) == 7.0), "rows outside the view changed"


def test_cuda_kernel_compiled_once_per_dtype():
    xp = _cuda_or_skip()
    from kda.cuda import _decode as kd

    *inputs, pool = _request_problem(np.random.default_rng(4), 2, 1, 1, 1, 3, 2, 2)
    dpool = xp.asarray(pool.astype(np.float32))
    kernels = []
    for _ in range(2):
        kda.decode_kda(*(xp.asarray(x.astype(np.float32)) for x in inputs), dpool, [1, 0], backend="cuda")
        kernels.append(kd.compiled_decode("float32"))
    assert kernels[0] is kernels[1] and kd._COMPILED["float32", "uint32", "float32", False] is kernels[0]


PTX_SCRIPT = """
import json, re
from numba import cuda
from kda.cuda._decode import build_decode_kernel, decode_signature
report = {}
for dtype in ("float32", "float64"):
    for index in ("uint32", "uint64"):
        kernel, sig = build_decode_kernel(dtype, index), decode_signature(dtype, index)
        ptx, _ = cuda.compile_ptx(kernel, sig, cc=(9, 0))
        report[f"{dtype}/{index}"] = {"entry": ".entry" in ptx, "f64": len(re.findall(r"\\.f64", ptx))}
for pool in ("float32", "float16", "int16"):  # V-major pools, and 16-bit pools in both layouts
    for v_first in (False, True):
        kernel = build_decode_kernel("float32", "uint32", pool, v_first)
        ptx, _ = cuda.compile_ptx(kernel, decode_signature("float32", "uint32", pool), cc=(9, 0))
        report[f"{pool}/{v_first}"] = {"entry": ".entry" in ptx, "f64": len(re.findall(r"\\.f64", ptx))}
print(json.dumps(report))
"""


def test_decode_kernel_compiles_to_ptx_cc90():
    """The decode kernel compiles for compute capability 9.0; the float32 one uses no float64."""
    import importlib.util
    import json

    if importlib.util.find_spec("numba_cuda") is None:  # numba's own numba.cuda cannot compile PTX
        pytest.skip("numba-cuda is not installed (pip install kda[cuda])")
    env = {name: value for name, value in os.environ.items() if name != "NUMBA_ENABLE_CUDASIM"}
    root = str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run(
        [sys.executable, "-c", PTX_SCRIPT], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for index in ("uint32", "uint64"):
        assert report[f"float32/{index}"]["entry"] and report[f"float64/{index}"]["entry"]
        assert report[f"float32/{index}"]["f64"] == 0, f"the float32 {index} decode kernel uses float64"
    for pool in ("float32", "float16", "int16"):
        for v_first in (False, True):
            info = report[f"{pool}/{v_first}"]
            assert info["entry"] and info["f64"] == 0, f"float32 kernel, {pool} pool ({v_first=}): {info}"
