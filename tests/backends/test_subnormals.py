"""Subnormal floats: the cpu backend's kernels run with x86's FTZ/DAZ bits set (and every caller's
floating-point environment as it was afterwards); the reference flushes tiny decay factors.

The bits are checked two ways: by reading MXCSR (kda's own reader), and by arithmetic on this
thread, which needs no reader: with FTZ ``float32(1e-30) * float32(1e-10)`` is 0, with DAZ
``float32(1e-40) * 1`` is 0, and both are subnormal otherwise.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import BACKENDS, TOLERANCE, assert_within, make_problem

import kda

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="numba or scipy not installed")

fpenv = pytest.importorskip("kda.cpu._fpenv")
x86 = pytest.mark.skipif(not fpenv.X86, reason="FTZ/DAZ are x86 bits")


def _flushes() -> tuple[bool, bool]:
    """``(FTZ, DAZ)`` in effect on this thread, seen by arithmetic."""
    with np.errstate(all="ignore"):
        ftz = float(np.float32(1e-30) * np.float32(1e-10)) == 0.0
        daz = float(np.float32(1e-40) * np.float32(1.0)) == 0.0
    return ftz, daz


def _control() -> int:
    return fpenv.read() & ~fpenv.STATUS


def _problem(T: int):
    """A steep-gate float32 problem, ``H=2, K=V=16``: inline at small ``T``, pooled at large."""
    return make_problem(T, 1, 2, T, 16, 16, "steep").astype(np.float32)


def _calls(p):
    """Every public entry point on the cpu backend, each as a thunk."""
    q, k, v, g, beta, s0 = p.q, p.k, p.v, p.g, p.beta, p.initial_state
    kw = {"initial_state": s0, "backend": "cpu"}

    def forward_backward():
        out = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True, **kw)
        kda.chunk_kda_backward(q, k, v, g, beta, out.boundaries, np.ones_like(out.output), **kw)

    def recurrent():
        out = kda.recurrent_kda(q, k, v, g, beta, **kw)
        kda.recurrent_kda_backward(q, k, v, g, beta, np.ones_like(out.output), **kw)

    def decode():
        pool = np.ascontiguousarray(np.concatenate([s0, s0]))
        rows = np.arange(q.shape[0], dtype=np.int64)
        kda.decode_kda(
            q[:, :, :1], k[:, :, :1], v[:, :, :1], g[:, :, :1], beta[:, :, :1], pool, rows, backend="cpu"
        )

    def plan():
        kda.prepare_chunk_kda(q, k, v, g, beta, **kw).run()

    def transition():
        kda.chunk_kda_transition(q, k, v, g, beta, backend="cpu")

    return {
        "chunk": forward_backward,
        "recurrent": recurrent,
        "decode": decode,
        "plan": plan,
        "transition": transition,
    }


@x86
def test_the_two_readers_agree_and_run_sets_both_bits():
    """The MXCSR reader and the arithmetic see the same bits, and ``run`` sets them for its call
    alone (a reader that returned a constant, or a run that set nothing, fails here)."""
    assert _flushes() == (False, False)
    assert fpenv.flushing_bits(fpenv.read()) == 0
    inside = fpenv.run(lambda: (_flushes(), fpenv.read()))
    assert inside[0] == (True, True)
    assert fpenv.flushing_bits(inside[1]) == fpenv.FLUSH
    assert _flushes() == (False, False)
    assert fpenv.flushing_bits(fpenv.read()) == 0


@x86
@pytest.mark.parametrize("T", [3, 700])  # on the calling thread, and on the pool's threads
def test_no_entry_point_changes_the_callers_or_the_pools_environment(T):
    """MXCSR's control bits on the calling thread, and on kda's pool threads, are what they were
    before every entry point, whether the caller had FTZ/DAZ off or on."""
    import kda.cpu as cpu

    p = _problem(T)
    for name, call in _calls(p).items():
        before = _control()
        call()
        assert _control() == before, name
        assert _flushes() == (False, False), name
        # a caller that runs with the bits set keeps them
        m = fpenv._compiled()
        old = m.enter()
        try:
            call()
            assert _flushes() == (True, True), name
        finally:
            m.leave(old)
        assert _control() == before, name
    pool = cpu._pool.pool(cpu.threads())
    seen = [pool.submit(_flushes).result() for _ in range(8)]
    assert seen == [(False, False)] * 8


@x86
@pytest.mark.parametrize("T", [3, 700])
def test_the_kernels_run_with_subnormals_flushed(T):
    """An output that is subnormal in exact arithmetic comes back as 0 from the cpu kernels (on
    the calling thread for short calls, on the pool for long ones), and as the subnormal from a
    NumPy step on this thread: the kernels really run with FTZ/DAZ."""
    B, H, K, V = 1, 4, 8, 8
    q = np.zeros((B, H, T, K), np.float32)
    q[..., 0] = 1.0
    k = np.zeros((B, H, T, K), np.float32)  # nothing written: the output reads the decayed state
    v = np.zeros((B, H, T, V), np.float32)
    g = np.zeros((B, H, T, K), np.float32)
    g[:, :, 0, :] = -23.0  # exp(-23) ~ 1e-10
    beta = np.zeros((B, H, T), np.float32)
    s0 = np.full((B, H, K, V), 1e-30, np.float32)
    expected = np.float32(1e-30) * np.exp(np.float32(-23.0))  # subnormal here, on this thread
    assert 0 < expected < np.finfo(np.float32).tiny
    out = kda.recurrent_kda(q, k, v, g, beta, initial_state=s0, scale=1.0, backend="cpu")
    assert np.all(out.output == 0) and np.all(out.final_state == 0)
    chunked = kda.chunk_kda(q, k, v, g, beta, initial_state=s0, scale=1.0, backend="cpu")
    assert np.all(chunked.output == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_reference_flushes_tiny_decay_factors_and_keeps_the_rest(dtype):
    """exp(g) below FLUSH_BELOW is an exact 0 in the reference; above it, exactly exp(g)."""
    from kda.reference._blocks import FLUSH_BELOW, decay

    bits = np.finfo(dtype).bits
    tiny = FLUSH_BELOW[bits]
    edge = np.log(tiny)
    g = np.array([edge - 0.01, edge + 0.01, -7.0, 0.0, -np.inf], dtype=dtype)
    got = decay(np, g)
    assert got[0] == 0 and got[-1] == 0
    assert np.array_equal(got[1:4], np.exp(g[1:4]))
    assert np.isnan(decay(np, np.array([np.nan], dtype)))[0]


@pytest.mark.parametrize("backend", [b for b in ("reference", "cpu") if b in BACKENDS])
@pytest.mark.parametrize("regime", ["steep", "kimi"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strong_gates_at_a_realistic_size_against_the_recurrence(backend, regime, dtype):
    """T=600 (ten chunks), K=V=64, the steep and Kimi-formula regimes: output, final state and
    every gradient within the fixed tolerances of the float64 recurrence."""
    p = make_problem(11, 1, 2, 600, 64, 64, regime).astype(dtype)
    p64 = p.astype(np.float64)
    want = kda.recurrent_kda(*p64.inputs, initial_state=p64.initial_state, backend="reference")
    dwant = kda.recurrent_kda_backward(
        *p64.inputs,
        p64.grad_output,
        p64.grad_final_state,
        initial_state=p64.initial_state,
        backend="reference",
    )
    out = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, save_boundaries=True, backend=backend)
    grads = kda.chunk_kda_backward(
        *p.inputs,
        out.boundaries,
        p.grad_output,
        p.grad_final_state,
        initial_state=p.initial_state,
        backend=backend,
    )
    tol = TOLERANCE[np.dtype(dtype)]
    assert_within(out.output, want.output, tol=tol, dtype=dtype, name="output")
    assert_within(out.final_state, want.final_state, tol=tol, dtype="any", name="final_state")
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        assert_within(getattr(grads, name), getattr(dwant, name), tol=tol, dtype="any", name=f"d{name}")


@x86
def test_calls_from_two_threads_each_leave_their_own_thread_as_found():
    """Two threads calling at once, one with FTZ/DAZ set by itself: each ends as it began."""
    p = _problem(700)
    calls = _calls(p)
    seen: dict[str, tuple[bool, bool]] = {}

    def worker(name: str, flush: bool) -> None:
        m = fpenv._compiled()
        old = m.enter() if flush else None
        try:
            for call in calls.values():
                call()
            seen[name] = _flushes()
        finally:
            if old is not None:
                m.leave(old)

    threads = [threading.Thread(target=worker, args=(n, f)) for n, f in (("off", False), ("on", True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"off": (False, False), "on": (True, True)}
