"""Prepared plans: ``kda.prepare_chunk_kda`` and ``kda.prepare_chunk_kda_backward``."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
from helpers import HAS_GPU, make_problem

import kda

GRADS = ("q", "k", "v", "g", "beta", "initial_state")


def _plain(p, dtype=np.float32):
    """Contiguous inputs of ``dtype`` (states float32, or float64 for float64)."""
    p = p.astype(dtype)
    return [np.ascontiguousarray(x) for x in p.inputs], p


def _same(got, want, name):
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("T", [1, 5, 64, 150])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_and_backward_plans_equal_the_calls(T, dtype):
    """A run gives bitwise what the plain call gives, and a refilled run follows the new values."""
    p0, p1 = make_problem(0, 2, 3, T, 16, 8), make_problem(1, 2, 3, T, 16, 8)
    inputs, p = _plain(p0, dtype)
    state = p.initial_state
    plan = kda.prepare_chunk_kda(*inputs, initial_state=state, chunk_size=32, save_boundaries=True)
    do, ds = p.grad_output, p.grad_final_state
    bplan = kda.prepare_chunk_kda_backward(
        *inputs, plan.out.boundaries, do, ds, initial_state=state, chunk_size=32
    )
    for source in (p0, p1):
        src = source.astype(dtype)
        for x, new in zip(
            (*inputs, state, do, ds), (*src.inputs, src.initial_state, src.grad_output, src.grad_final_state)
        ):
            x[...] = new  # refill in place
        want = kda.chunk_kda(*inputs, initial_state=state, chunk_size=32, save_boundaries=True)
        got = plan.run()
        assert got is plan.out
        for name, a, b in zip(("output", "final_state", "boundaries"), got, want):
            _same(a, b, name)
        wgrads = kda.chunk_kda_backward(*inputs, want.boundaries, do, ds, initial_state=state, chunk_size=32)
        ggrads = bplan.run()
        for name in GRADS:
            _same(getattr(ggrads, name), getattr(wgrads, name), name)


def test_backward_plan_without_boundaries_and_time_major():
    """boundaries=None recomputes into the plan's workspace; time-major buffers are written in place."""
    p = make_problem(2, 1, 2, 70, 8, 8).astype(np.float32)
    tm = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in p.inputs]
    do = np.ascontiguousarray(np.swapaxes(p.grad_output, 1, 2))
    common = dict(initial_state=p.initial_state, chunk_size=16, layout="time_major")
    want = kda.chunk_kda_backward(*tm, None, do, p.grad_final_state, **common)
    got = kda.prepare_chunk_kda_backward(*tm, None, do, p.grad_final_state, **common).run()
    for name in GRADS:
        _same(getattr(got, name), getattr(want, name), name)
    fwant = kda.chunk_kda(*tm, **common)
    fgot = kda.prepare_chunk_kda(*tm, **common).run()
    _same(fgot.output, fwant.output, "output")
    assert fgot.boundaries is None


def test_options_run_through_the_general_path():
    """Element-wise options (GVA, l2norm, softplus gate, sigmoid beta) match the plain call."""
    rng = np.random.default_rng(3)
    B, H, HV, T, K, V = 1, 1, 2, 40, 8, 4
    q, k = (rng.standard_normal((B, H, T, K)) for _ in range(2))
    v, g = rng.standard_normal((B, HV, T, V)), rng.standard_normal((B, HV, T, K))
    beta = rng.standard_normal((B, HV, T))
    opts = dict(qk_l2norm=True, gate="softplus", A_log=rng.uniform(-1, 1, HV), beta_activation="sigmoid")
    opts |= dict(dt_bias=rng.standard_normal((HV, K)), chunk_size=16)
    want = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True, **opts)
    got = kda.prepare_chunk_kda(q, k, v, g, beta, save_boundaries=True, **opts).run()
    for name, a, b in zip(("output", "final_state", "boundaries"), got, want):
        _same(a, b, name)
    do = rng.standard_normal(want.output.shape)
    gwant = kda.chunk_kda_backward(q, k, v, g, beta, want.boundaries, do, **opts)
    ggot = kda.prepare_chunk_kda_backward(q, k, v, g, beta, want.boundaries, do, **opts).run()
    for name in (*GRADS, "A_log", "dt_bias"):
        _same(getattr(ggot, name), getattr(gwant, name), name)


def test_packed_sequences():
    """cu_seqlens: states per sequence, boundaries per sequence's chunks, bitwise the plain calls."""
    inputs, p = _plain(make_problem(11, 1, 2, 50, 8, 4))
    common = dict(cu_seqlens=np.array([0, 7, 30, 50]), chunk_size=16)
    s0 = np.random.default_rng(0).standard_normal((3, 2, 8, 4)).astype(np.float32)
    want = kda.chunk_kda(*inputs, initial_state=s0, save_boundaries=True, **common)
    got = kda.prepare_chunk_kda(*inputs, initial_state=s0, save_boundaries=True, **common).run()
    for name, a, b in zip(("output", "final_state", "boundaries"), got, want):
        _same(a, b, name)
    for saved in (want.boundaries, None):
        gwant = kda.chunk_kda_backward(*inputs, saved, p.grad_output, initial_state=s0, **common)
        ggot = kda.prepare_chunk_kda_backward(*inputs, saved, p.grad_output, initial_state=s0, **common).run()
        for name in GRADS:
            _same(getattr(ggot, name), getattr(gwant, name), name)


def test_caller_buffers_are_adopted():
    inputs = _plain(make_problem(4, 1, 2, 33, 8, 4))[0]
    out = kda.KdaOutput(
        np.empty((1, 2, 33, 4), np.float32),
        np.empty((1, 2, 8, 4), np.float32),
        np.empty((3, 1, 2, 8, 4), np.float32),
    )
    plan = kda.prepare_chunk_kda(*inputs, out=out, chunk_size=16, save_boundaries=True)
    got = plan.run()
    assert all(a is b for a, b in zip(got, out))
    want = kda.chunk_kda(*inputs, chunk_size=16, save_boundaries=True)
    for name, a, b in zip(("output", "final_state", "boundaries"), got, want):
        _same(a, b, name)
    grads = kda.KdaGradients(*(np.empty_like(x) for x in inputs), np.empty((1, 2, 8, 4), np.float32))
    bplan = kda.prepare_chunk_kda_backward(
        *inputs, out.boundaries, np.ones_like(want.output), out=grads, chunk_size=16
    )
    assert all(a is b for a, b in zip(bplan.run()[:6], grads[:6]))


def _bad_out():
    f32, KO = np.float32, kda.KdaOutput
    bad, wrong = kda.InvalidInputError, kda.InvalidTypeError
    strided = np.empty((1, 2, 4, 33), f32).transpose(0, 1, 3, 2)
    return [
        (KO(np.empty((1, 2, 33, 5), f32), None, None), bad, r"out\.output must have shape"),
        (KO(np.empty((1, 2, 33, 4), np.float64), None, None), wrong, r"out\.output must have dtype float32"),
        (
            KO(None, np.empty((1, 2, 8, 4), np.float64), None),
            wrong,
            r"out\.final_state must have dtype float32",
        ),
        (KO(None, None, np.empty((2, 1, 2, 8, 4), f32)), bad, r"out\.boundaries must have shape"),
        (KO(strided, None, None), bad, r"C-contiguous bindings: out\.output"),
    ]


def test_errors_name_the_binding():
    inputs = _plain(make_problem(5, 1, 2, 33, 8, 4))[0]
    for out, error, match in _bad_out():
        with pytest.raises(error, match=match):
            kda.prepare_chunk_kda(*inputs, out=out, chunk_size=16)
    strided = np.ascontiguousarray(np.swapaxes(inputs[0], 2, 3)).swapaxes(2, 3)
    with pytest.raises(kda.InvalidInputError, match=r"C-contiguous bindings: q"):
        kda.prepare_chunk_kda(strided, *inputs[1:])
    ro = np.empty((1, 2, 33, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(kda.InvalidInputError, match=r"out\.output must be a writable array"):
        kda.prepare_chunk_kda(*inputs, out=kda.KdaOutput(ro, None, None))
    grads = kda.KdaGradients(np.empty((1, 2, 33, 7), np.float32), *(None,) * 7)
    with pytest.raises(kda.InvalidInputError, match=r"out\.q must have shape"):
        kda.prepare_chunk_kda_backward(*inputs, None, np.ones((1, 2, 33, 4), np.float32), out=grads)
    with pytest.raises(kda.InvalidInputError, match=r"g must hold log decays"):
        kda.prepare_chunk_kda(*inputs[:3], -inputs[3] + 1, inputs[4])


def test_refilled_positive_gate_is_refused_at_run():
    inputs, _ = _plain(make_problem(6, 1, 1, 20, 4, 4))
    plan = kda.prepare_chunk_kda(*inputs)
    inputs[3][0, 0, 5, 1] = 0.5
    with pytest.raises(kda.InvalidInputError, match="refilled g"):
        plan.run()
    inputs[3][0, 0, 5, 1] = np.nan
    with pytest.raises(kda.InvalidInputError, match="refilled g"):
        plan.run()


def _run_peak(run) -> int:
    run()  # warm: thread pools, BLAS buffers
    gc.collect()
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_run_allocates_nothing_that_grows_with_T(monkeypatch):
    """Peak traced memory of run() at T and 4T is about equal, forward and backward.

    Slabs of 2**14 elements (one chunk of B=1, H=4, K=V=64) make the slab work small next to
    what grows with T (output 0.5 -> 2 MiB, boundaries 0.5 -> 2 MiB): the plain call's peak grows
    by more than half (checked, so that the measurement can see growth).
    """
    import kda.cpu
    import kda.reference

    for backend in (kda.reference, kda.cpu):  # NumPy's default is cpu
        monkeypatch.setattr(backend, "SLAB_ELEMENTS", 1 << 14)
    # one head group (one thread on the cpu backend): concurrent groups overlap their slab work by
    # chance, and the peak with it (under load the cpu backend's ranges pile up differently)
    monkeypatch.setattr(kda.reference, "workers", lambda xp, heads: 1)
    monkeypatch.setattr(kda.cpu, "threads", lambda: 1)
    threadpoolctl = pytest.importorskip("threadpoolctl")
    peaks = {}
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):  # as kda's own head groups do
        peaks.update(_peaks(T) for T in (512, 2048))
    for name, small, large in zip(("forward", "backward", "backward (recomputed)"), peaks[512], peaks[2048]):
        assert large < 1.1 * small, f"{name} run() peak grew from {small} to {large} bytes"
    assert peaks[2048][3] > 1.5 * peaks[512][3], "the plain call's peak should grow with T"


def _peaks(T: int) -> tuple[int, list[int]]:
    """Peaks of forward, backward and backward-recomputing plans' run() and of the plain call."""
    inputs, p = _plain(make_problem(7, 1, 4, T, 64, 64))
    plan = kda.prepare_chunk_kda(*inputs, save_boundaries=True)
    saved = kda.prepare_chunk_kda_backward(*inputs, plan.run().boundaries, p.grad_output)
    recomputed = kda.prepare_chunk_kda_backward(*inputs, None, p.grad_output)
    plain = lambda: kda.chunk_kda(*inputs, save_boundaries=True)  # noqa: E731
    return T, [_run_peak(f) for f in (plan.run, saved.run, recomputed.run, plain)]


# ---------------------------------------------------------------- the CUDA backend


def test_simulator_plan_runs_without_graphs():
    pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")
    if HAS_GPU:
        pytest.skip("a GPU is present: the CuPy graph test covers the CUDA backend")
    inputs = _plain(make_problem(8, 1, 2, 9, 4, 4))[0]
    want = kda.chunk_kda(*inputs, chunk_size=4, save_boundaries=True)
    plan = kda.prepare_chunk_kda(*inputs, chunk_size=4, save_boundaries=True, backend="cuda")
    for _ in range(2):
        got = plan.run()
        assert plan._r.graph is None
        np.testing.assert_allclose(got.output, want.output, rtol=0, atol=1e-5 * np.abs(want.output).max())
        np.testing.assert_allclose(
            got.final_state, want.final_state, rtol=0, atol=1e-5 * np.abs(want.final_state).max()
        )


def test_cupy_plan_replays_a_cuda_graph():
    """On a GPU: the second run replays the captured graph and follows refilled inputs."""
    if not HAS_GPU:
        pytest.skip("needs a GPU (CUDA graphs cannot run under the simulator)")
    cp = pytest.importorskip("cupy")
    p0, p1 = make_problem(9, 1, 4, 200, 32, 32), make_problem(10, 1, 4, 200, 32, 32)
    inputs = [cp.asarray(x.astype(np.float32)) for x in p0.inputs]
    plan = kda.prepare_chunk_kda(*inputs, save_boundaries=True)
    first = [x.copy() for x in plan.run()]
    assert plan._r.graph is not None
    want0 = kda.chunk_kda(*inputs, save_boundaries=True)
    for a, b in zip(first, want0):
        cp.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(cp.abs(b).max()))
    for x, new in zip(inputs, p1.inputs):
        x[...] = cp.asarray(new.astype(np.float32))
    got = plan.run()
    want1 = kda.chunk_kda(*inputs, save_boundaries=True)
    for a, b in zip(got, want1):
        cp.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(cp.abs(b).max()))
