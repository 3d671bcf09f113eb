"""The Numba CPU backend: primitives against the reference, whole calls against the float64
recurrence, dispatch, threads (bitwise), concurrency, the read-only cache fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import BACKENDS, ROOT, TOLERANCE, assert_within, make_problem
from hypothesis import given, settings
from hypothesis import strategies as st

import kda
from kda.cpu._outputs import KERNEL_OUTPUTS
from kda.testing import LOG_REGIMES, gates

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="numba or scipy not installed")

SCALE = 0.6
# float32 primitives (fed the float64 masters cast to float32) against the float64 reference on the
# masters, relative to the max-abs of each result: a measured bound, not the contract's (which is for
# whole calls). Measured worst over every (regime, Cp, K, V) test_primitives_match_the_reference
# draws, 12 seeds each (36 000 draws per dtype): 7.5e-6 (chunk_local_backward's dg, zero gates; the
# other quantities <= 4.5e-6), under the two rules below; float64: 2.4e-14 (the contract's 1e-10).
F32_LOCAL = 3e-5
# Rule 1: kda flushes float32 subnormals (FTZ/DAZ, docs/options.md "Subnormal floats"): a result whose
# float64 value is below float32's smallest normal (strong gates' decays, e.g. a chunk's total of
# 1.4e-39: relative error 0.12 against its own max-abs) may come out 0, an error up to that floor.
F32_FLUSHED = float(np.finfo(np.float32).tiny)
# Rule 2: chunk_state_grad_pass's dinitial is total * dS + qg^T dO - w^T dU, terms of the size of the
# gradients it carries (dends) that can cancel: with K = V = 1, kimi gates, Cp = 4 the result is
# 4.2e-6 against terms of 1.5e-2, and float32's rounding of the terms (1.7e-9) is 4.0e-4 of the
# result. It is judged against max|dends| as well (measured worst then 2.5e-6).


def _ops(name: str):
    import importlib

    return importlib.import_module(f"kda.{name}")


def _chunk_inputs(rng, shape, K, V, regime):
    q = rng.standard_normal((*shape, K))
    k = rng.standard_normal((*shape, K))
    k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
    g = gates(rng, (*shape, K), regime)
    v = rng.standard_normal((*shape, V))
    beta = rng.uniform(0.0, 2.0, shape)
    return q, k, v, g, beta


def _tol(dtype) -> float:
    return 1e-10 if dtype == np.float64 else F32_LOCAL


@settings(max_examples=30)
@given(
    regime=st.sampled_from(LOG_REGIMES),
    Cp=st.sampled_from([1, 2, 4, 16, 64]),
    K=st.sampled_from([1, 2, 5, 16, 33]),
    V=st.sampled_from([1, 3, 16]),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**16),
)
def test_primitives_match_the_reference(regime, Cp, K, V, dtype, seed):
    """chunk_local, both state passes and chunk_local_backward against the reference (float64)."""
    ref, cpu = _ops("reference"), _ops("cpu")
    rng = np.random.default_rng(seed)
    B, H, NT = 1, 2, 3
    shape = (B, H, NT, Cp)
    inputs64 = _chunk_inputs(rng, shape, K, V, regime)
    inputs = [x.astype(dtype) for x in inputs64]
    tol = _tol(dtype)
    floor = F32_FLUSHED if dtype == np.float32 else 0.0
    want = ref.chunk_local(*inputs64, scale=SCALE)
    got = cpu.chunk_local(*inputs, scale=SCALE)
    for name in ("qg", "kg", "k_suffix", "total", "A", "L", "w", "u0"):
        assert_within(getattr(got, name), getattr(want, name).astype(dtype), tol=tol, name=name, floor=floor)
    assert np.all(np.triu(got.A, 1) == 0) and np.all(np.triu(got.L) == 0)
    S0 = rng.standard_normal((B, H, K, V))
    bd, out, fin = ref.chunk_state_pass(want.w, want.u0, want.k_suffix, want.total, S0, want.qg, want.A)
    c = [x.astype(dtype) for x in (want.w, want.u0, want.k_suffix, want.total, S0, want.qg, want.A)]
    got_pass = cpu.chunk_state_pass(*c)
    for name, a, b in zip(("boundaries", "output", "final"), got_pass, (bd, out, fin), strict=True):
        assert_within(a, b.astype(dtype), tol=tol, name=name, floor=floor)
    do = rng.standard_normal((*shape, V))
    dS = rng.standard_normal((B, H, K, V))
    want_g = ref.chunk_state_grad_pass(
        want.w, want.u0, want.k_suffix, want.total, want.qg, want.A, do, bd, dS
    )
    more = (x.astype(dtype) for x in (do, bd, dS))
    got_g = cpu.chunk_state_grad_pass(*c[:4], c[5], c[6], *more)
    carried = tol * float(np.max(np.abs(want_g.dends), initial=0.0))  # rule 2: the size of dinitial's terms
    for name, a, b in zip(("dends", "u", "du", "dinitial"), got_g, want_g, strict=True):
        at_least = max(floor, carried) if name == "dinitial" else floor
        assert_within(a, b.astype(dtype), tol=tol, name=name, floor=at_least)
    passed = dict(dends=want_g.dends, u=want_g.u, du=want_g.du, grad_output=do)
    want_b = ref.chunk_local_backward(*inputs64, bd, scale=SCALE, local=want, **passed)
    got_b = cpu.chunk_local_backward(
        *inputs, bd.astype(dtype), scale=SCALE, local=got, **{n: x.astype(dtype) for n, x in passed.items()}
    )
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got_b, want_b, strict=True):
        assert_within(a, b.astype(dtype), tol=tol, name=name, floor=floor)


@pytest.mark.parametrize("regime", LOG_REGIMES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("T", "K", "V", "chunk_size"), [(70, 8, 5, 16), (33, 2, 3, 64), (1, 4, 4, 16)])
def test_whole_calls_against_the_recurrence(regime, dtype, T, K, V, chunk_size):
    """chunk_kda / chunk_kda_backward / recurrent_kda(_backward) on backend='cpu' vs float64."""
    p = make_problem(7, 2, 3, T, K, V, regime).astype(dtype)
    p64 = p.astype(np.float64)
    ref = kda.recurrent_kda(*p64.inputs, initial_state=p64.initial_state, backend="reference")
    ref_g = kda.recurrent_kda_backward(
        *p64.inputs,
        p64.grad_output,
        p64.grad_final_state,
        initial_state=p64.initial_state,
        backend="reference",
    )
    tol = TOLERANCE[np.dtype(dtype)]
    out = kda.chunk_kda(
        *p.inputs, initial_state=p.initial_state, chunk_size=chunk_size, save_boundaries=True, backend="cpu"
    )
    grads = kda.chunk_kda_backward(
        *p.inputs,
        out.boundaries,
        p.grad_output,
        p.grad_final_state,
        initial_state=p.initial_state,
        chunk_size=chunk_size,
        backend="cpu",
    )
    rec = kda.recurrent_kda(*p.inputs, initial_state=p.initial_state, backend="cpu")
    rec_g = kda.recurrent_kda_backward(
        *p.inputs, p.grad_output, p.grad_final_state, initial_state=p.initial_state, backend="cpu"
    )
    for o in (out, rec):
        assert_within(o.output, ref.output, tol=tol, dtype="any", name="output")
        assert_within(o.final_state, ref.final_state, tol=tol, dtype="any", name="final_state")
    for gs in (grads, rec_g):
        for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), gs[:6], ref_g[:6], strict=True):
            assert_within(a, b, tol=tol, dtype="any", name=name)


@pytest.mark.parametrize("regime", LOG_REGIMES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_passes_read_strided_inputs_in_place_and_match_the_reference(regime, dtype):
    """The cpu backend's fused passes on time-major views (strided, read in place) give bitwise the
    results of contiguous copies, and match the reference's slab-by-slab composition (chunk 48:
    padded chunks of Cp=64 in eight sub-blocks, and a short last chunk)."""
    from kda._engine.chunked import chunk_backward, chunk_forward

    cpu, ref = _ops("cpu"), _ops("reference")
    p = make_problem(3, 2, 3, 150, 24, 7, regime).astype(dtype)
    tm = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (*p.inputs, p.grad_output)]
    views = [np.swapaxes(x, 1, 2) for x in tm]  # [B, H, T, *] views of time-major buffers
    assert not views[0].flags.c_contiguous

    def run(ops, xs, state=p.initial_state, dS=p.grad_final_state):
        o, fin, bnd = chunk_forward(ops, np, *xs[:5], state, scale=SCALE, chunk_size=48)
        grads = chunk_backward(
            ops, np, *xs[:5], state, bnd, grad_output=xs[5], dfinal=dS, scale=SCALE, chunk_size=48
        )
        return [o, fin, bnd, *grads]

    strided = run(cpu, views)
    contiguous = run(cpu, [*p.inputs, p.grad_output])
    for a, b in zip(strided, contiguous, strict=True):
        assert np.array_equal(a, b)
    p64 = p.astype(np.float64)
    want = run(ref, [*p64.inputs, p64.grad_output], p64.initial_state, p64.grad_final_state)
    # the contract's tolerance; measured worst over 40 seeds, every regime: float32 8.5e-7, float64 2.1e-15
    tol = TOLERANCE[np.dtype(dtype)]
    names = ("output", "final", "boundaries", "dq", "dk", "dv", "dg", "dbeta", "dstate")
    for name, a, b in zip(names, contiguous, want, strict=True):
        assert_within(a, b, tol=tol, dtype="any", name=name)


def test_a_forward_that_keeps_no_boundaries_writes_none():
    """The fused forward with keep=False forms no [NT, B, H, K, V] array (memory traced) and gives
    bitwise the output and final state of the forward that keeps them."""
    import tracemalloc

    from kda._engine.chunked import chunk_forward

    cpu = _ops("cpu")
    p = make_problem(4, 1, 4, 512, 32, 32, "mild").astype(np.float32)
    kept = chunk_forward(cpu, np, *p.inputs, p.initial_state, scale=SCALE, chunk_size=16)
    tracemalloc.start()
    dropped = chunk_forward(cpu, np, *p.inputs, p.initial_state, scale=SCALE, chunk_size=16, keep=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert dropped.boundaries is None and kept.boundaries.shape == (32, 1, 4, 32, 32)
    assert np.array_equal(dropped.output, kept.output)
    assert np.array_equal(dropped.final_state, kept.final_state)
    assert peak < kept.output.nbytes + kept.boundaries.nbytes // 2, peak  # the output, not the boundaries


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_of_decays_is_exact_at_the_ends_and_within_an_ulp(dtype):
    """The kernels' exp(g): exp(0) = 1, exp(-inf) = exp(-1e4) = exp(-800) = 0 exactly; elsewhere within
    1 ulp of the correctly rounded float64 value (correctly rounded in float32)."""
    import kda.cpu._kernels  # noqa: F401  (loads the kernels)
    from kda.cpu._pairs import _exp

    rng = np.random.default_rng(0)
    special = [0.0, -0.0, -np.inf, -1e4, -800.0, -708.0, -1e-30]
    g = np.concatenate([special, -rng.random(4000) * 30, -rng.random(1000) * 700]).astype(dtype)
    e = _exp(g.reshape(1, -1))[0]
    assert e.dtype == dtype
    assert e[0] == 1.0 and e[1] == 1.0 and e[2] == 0.0 and e[3] == 0.0 and e[4] == 0.0
    want = np.exp(g.astype(np.float64))
    normal = want.astype(dtype) >= np.finfo(dtype).tiny
    ulps = np.abs(e[normal] - want[normal].astype(dtype)) / np.spacing(want[normal].astype(dtype))
    assert ulps.max() <= (1.0 if dtype == np.float64 else 0.0)
    assert np.all(e[~normal] <= np.finfo(dtype).tiny)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("Cp", [1, 4, 16, 32, 64, 128])
def test_block_solves_and_blocked_products_match_numpy(Cp, dtype):
    """The fused passes' building blocks against NumPy in float64: ``U = M^-1 Y`` and ``dY = M^-T
    dU`` by blocks (``M = I + diag(beta) L``), with a zero and a large beta among the rows, and
    ``_mm`` in every transpose case on row-strided views, with and without accumulation."""
    import kda.cpu._kernels  # noqa: F401  (loads the kernels)
    from kda.cpu._compile import SOLVE_BLOCK
    from kda.cpu._products import _mm
    from kda.cpu._solve import _solve_blocks, _solve_blocks_t

    rng = np.random.default_rng(Cp)
    V = 40
    L = np.tril(rng.standard_normal((Cp, Cp)), -1) / np.sqrt(Cp)
    beta = rng.uniform(0.0, 1.0, Cp)
    beta[:: max(Cp // 3, 1)] = 0.0
    beta[Cp // 2] = 2.0
    Y, dU = rng.standard_normal((Cp, V)), rng.standard_normal((Cp, V))
    M = np.eye(Cp) + beta[:, None] * L
    args = [x.astype(dtype) for x in (L, beta, Y)]
    U = np.empty((Cp, V), dtype)
    Td, W = np.empty((Cp, SOLVE_BLOCK), dtype), np.empty((SOLVE_BLOCK, V), dtype)
    _solve_blocks(*args, U, Td, W)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert_within(U, np.linalg.solve(M, Y), tol=tol, dtype=dtype, name="U")
    dY, dR = np.empty((Cp, V), dtype), np.empty((Cp, V), dtype)
    _solve_blocks_t(args[0], args[1], Td, dU.astype(dtype), dY, dR, W)
    want = np.linalg.solve(M.T, dU)
    assert_within(dY, want, tol=tol, dtype=dtype, name="dY")
    assert_within(dR, -beta[:, None] * want, tol=tol, dtype=dtype, name="dR")
    for ta, tb in [(False, False), (True, False), (False, True), (True, True)]:
        m, n, kk = Cp + 3, 70, 33
        A = rng.standard_normal((kk, m) if ta else (m, kk))
        B = rng.standard_normal((n, kk) if tb else (kk, n))
        big = rng.standard_normal((m, n + 9)).astype(dtype)
        keep = big.copy()
        C = big[:, 4 : 4 + n]
        product = (A.T if ta else A) @ (B.T if tb else B)
        for beta_c in (0.0, 1.0):
            before = C.astype(np.float64)
            _mm(A.astype(dtype), ta, B.astype(dtype), tb, C, beta_c)
            assert_within(C, product + beta_c * before, tol=tol, dtype=dtype, name=f"_mm {ta} {tb} {beta_c}")
        assert np.array_equal(big[:, :4], keep[:, :4]) and np.array_equal(big[:, 4 + n :], keep[:, 4 + n :])


def test_decode_plan_and_transition_on_cpu():
    """decode_kda, prepared plans and transition maps run on the cpu backend and agree."""
    p = make_problem(3, 2, 3, 40, 8, 5, "mild")
    ref = kda.recurrent_kda(*p.inputs, initial_state=p.initial_state, backend="reference")
    # decode: two requests on rows 2 and 0 of a pool, one padding request
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((4, 3, 8, 5))
    before = pool.copy()
    idx = [2, -1, 0]
    qs = [np.concatenate([x, x[:1]])[:, :, :3] for x in p.inputs]
    out = kda.decode_kda(*qs, pool, idx, backend="cpu")
    for n, row in enumerate(idx):
        if row < 0:
            assert np.all(out[n] == 0)
            continue
        one = [x[n : n + 1] for x in qs]
        want = kda.recurrent_kda(*one, initial_state=before[row : row + 1], backend="reference")
        assert_within(out[n], want.output[0], tol=1e-12, name="decode output")
        assert_within(pool[row], want.final_state[0], tol=1e-12, name="decode pool")
    assert np.array_equal(pool[[1, 3]], before[[1, 3]])
    plan = kda.prepare_chunk_kda(*p.inputs, initial_state=p.initial_state, chunk_size=16, backend="cpu")
    o = plan.run()
    assert_within(o.output, ref.output, tol=1e-10, name="plan output")
    A, N = kda.chunk_kda_transition(*p.inputs, chunk_size=16, backend="cpu")
    assert_within(A @ p.initial_state + N, ref.final_state, tol=1e-10, name="A S0 + N")


def test_the_fused_passes_screen_the_gate_check(monkeypatch):
    """On the fused passes ``g <= 0`` is read off the chunks as they are loaded, with no host pass
    over ``g`` (``-inf`` included); a bad ``g`` still gets validation's error, in the forward and
    the backward; a call that runs no fused pass (a short ``T`` on the step recurrence,
    ``check_finite=False``) checks on the host before computing."""
    import kda._options.validation as validation

    calls = []
    check = validation.check_log_decay
    monkeypatch.setattr(validation, "check_log_decay", lambda xp, g: (calls.append(g.shape), check(xp, g))[1])
    p = make_problem(3, 1, 2, 200, 16, 8, "mild").astype(np.float32)
    q, k, v, g, beta = p.inputs
    g = g.copy()
    g[0, 1, 100, :5] = -np.inf  # a hard reset is a valid log decay: no alarm, no host pass
    out = kda.chunk_kda(q, k, v, g, beta, chunk_size=64, save_boundaries=True)
    kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, p.grad_output, chunk_size=64)
    assert calls == [], "a host check of g ran beside the fused passes"
    bad = g.copy()
    bad[0, 1, 20, 3] = 0.25
    bad[0, 0, 10, 0] = np.nan
    message = "got 1 positive and 1 NaN elements"
    with pytest.raises(kda.InvalidInputError, match=message):
        kda.chunk_kda(q, k, v, bad, beta, chunk_size=64)
    with pytest.raises(kda.InvalidInputError, match=message):
        kda.chunk_kda_backward(q, k, v, bad, beta, out.boundaries, p.grad_output, chunk_size=64)
    assert len(calls) == 2  # the message's counts, once a screen saw the bad element
    short = (q[:, :, :40], k[:, :, :40], v[:, :, :40])
    for call, shape in (
        (lambda x: kda.chunk_kda(*short, x[:, :, :40], beta[:, :, :40], chunk_size=64), g[:, :, :40].shape),
        (lambda x: kda.chunk_kda(q, k, v, x, beta, chunk_size=64, check_finite=False), g.shape),
    ):  # the step recurrence (T <= 64); no screen
        calls.clear()
        call(g)
        assert calls == [shape]
        with pytest.raises(kda.InvalidInputError, match=message):
            call(bad)


def test_numpy_dispatches_to_cpu_and_others_to_the_reference():
    from kda._backend import get_backend

    assert get_backend(np, None).NAME == "cpu"
    assert get_backend(np, "reference").NAME == "reference"
    strict = pytest.importorskip("array_api_strict")
    assert get_backend(strict, None).NAME == "reference"
    with pytest.raises(kda.InvalidInputError, match="backend 'cpu'"):
        get_backend(strict, "cpu")


def _fwd_bwd(p, backend="cpu"):
    out = kda.chunk_kda(
        *p.inputs, initial_state=p.initial_state, chunk_size=32, save_boundaries=True, backend=backend
    )
    grads = kda.chunk_kda_backward(
        *p.inputs,
        out.boundaries,
        p.grad_output,
        p.grad_final_state,
        initial_state=p.initial_state,
        chunk_size=32,
        backend=backend,
    )
    return [out.output, out.final_state, *grads[:6]]


def test_results_do_not_depend_on_the_thread_count_and_settings_are_restored(monkeypatch):
    import threadpoolctl

    cpu = _ops("cpu")
    p = make_problem(1, 2, 5, 200, 16, 8, "mild").astype(np.float32)
    base = _fwd_bwd(p)  # loads the kernels and their BLAS first
    blas_before = [(lib["filepath"], lib["num_threads"]) for lib in threadpoolctl.threadpool_info()]
    for n in (1, 2, 3, 7):
        monkeypatch.setattr(cpu, "threads", lambda n=n: n)
        again = _fwd_bwd(p)
        for a, b in zip(again, base, strict=True):
            assert np.array_equal(a, b), f"results differ with {n} threads"
    assert [(lib["filepath"], lib["num_threads"]) for lib in threadpoolctl.threadpool_info()] == blas_before


def test_concurrent_calls_are_safe_and_bitwise_equal_to_serial():
    problems = [make_problem(s, 1, 4, 150, 16, 8, "mild").astype(np.float32) for s in range(4)]
    serial = [_fwd_bwd(p) for p in problems]
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = _fwd_bwd(problems[i % 4])
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, got in results.items():
        for a, b in zip(got, serial[i % 4], strict=True):
            assert np.array_equal(a, b)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    root = str(ROOT)
    environ = {**os.environ, "PYTHONPATH": root, **env}
    command = [sys.executable, "-c", code]
    return subprocess.run(command, capture_output=True, text=True, env=environ, timeout=600)


def test_import_kda_does_not_import_numba():
    r = _python("import sys, kda; assert 'numba' not in sys.modules, 'numba imported'; print('ok')")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_read_only_install_compiles_without_a_cache():
    """Where neither numba nor kda's fallback (in the temporary directory) finds a writable cache
    directory, the kernels compile per process."""
    code = """
import numba.core.dispatcher as d
def refuse(self):
    raise RuntimeError("cannot cache function: no locator available")
d.Dispatcher.enable_caching = refuse
import tempfile
tempfile.tempdir = "/proc/kda-no-cache"  # not creatable, not even by root
import numpy as np, kda
from kda.cpu import _compile
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 3, 1, 2)) for _ in range(3))
g = -rng.uniform(0, 1, (1, 3, 1, 2)); beta = rng.uniform(0, 1, (1, 3, 1))
a = kda.recurrent_kda(q, k, v, g, beta, backend="cpu").output
b = kda.recurrent_kda(q, k, v, g, beta, backend="reference").output
assert not _compile.CACHING
assert np.allclose(a, b, rtol=1e-12, atol=1e-12)
print("ok")
"""
    r = _python(code)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@pytest.mark.slow
def test_the_other_kind_of_cores_block_sizes_compute_the_same_function(tmp_path):
    """The block sizes chosen for the other kind of core (``block_sizes(not WIDE)``: AVX-512 or
    not, ``kda/cpu/_compile.py``), compiled in a fresh process into a fresh cache: forward and
    backward against the float64 reference in every gate regime, with chunks that hold several
    sub-blocks and solve blocks and products wider than a GEMM block (``K = 80``, chunk 128)."""
    script = f"""
import sys
import numpy as np
sys.path.insert(0, {str(ROOT / "tests")!r})
from helpers import TOLERANCE, assert_within, make_problem
from kda.testing import LOG_REGIMES
from kda.cpu import _compile
other = _compile.block_sizes(not _compile.WIDE)
_compile.GEMM_BLOCK, _compile.SUB_BLOCK, _compile.SOLVE_BLOCK = other
import kda
for regime in LOG_REGIMES:
    for C in (48, 128):
        p = make_problem(5, 1, 2, 300, 80, 72, regime)
        ref = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, chunk_size=C, save_boundaries=True,
                            backend="reference")
        ref_g = kda.chunk_kda_backward(*p.inputs, ref.boundaries, p.grad_output, p.grad_final_state,
                                       initial_state=p.initial_state, chunk_size=C, backend="reference")
        p32 = p.astype(np.float32)
        out = kda.chunk_kda(*p32.inputs, initial_state=p32.initial_state, chunk_size=C, save_boundaries=True,
                            backend="cpu")
        grads = kda.chunk_kda_backward(*p32.inputs, out.boundaries, p32.grad_output, p32.grad_final_state,
                                       initial_state=p32.initial_state, chunk_size=C, backend="cpu")
        tol = TOLERANCE[np.dtype(np.float32)]  # the contract's; measured worst (seeds 5-8): 1.3e-6
        assert_within(out.output, ref.output, tol=tol, dtype="any", name=f"output {{regime}} {{C}}")
        assert_within(out.final_state, ref.final_state, tol=tol, dtype="any", name=f"final {{regime}} {{C}}")
        for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), grads[:6], ref_g[:6], strict=True):
            assert_within(a, b, tol=tol, dtype="any", name=f"d{{name}} {{regime}} {{C}}")
print("block sizes", other)
"""
    r = _python(script, NUMBA_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "block sizes" in r.stdout


@pytest.mark.parametrize("name", sorted(KERNEL_OUTPUTS))
def test_each_kernels_output_record_names_its_output_parameters_in_order(name):
    """kda.cpu._run passes a kernel's outputs positionally from a record (kda.cpu._outputs): its
    fields must be the kernel's parameters just before ``lo, hi``, in their order."""
    import inspect

    from kda.cpu import _kernels

    record = KERNEL_OUTPUTS[name]
    parameters = tuple(inspect.signature(getattr(_kernels, name).py_func).parameters)
    assert parameters[-2:] == ("lo", "hi")
    assert parameters[-2 - len(record._fields) : -2] == record._fields, (name, parameters)
