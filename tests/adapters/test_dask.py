"""kda.dask on a multi-process dask.distributed cluster against the single-process functions."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from helpers import TOLERANCE, assert_within, make_problem

import kda
from kda.testing import LOG_REGIMES

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
import dask  # noqa: E402

import kda.dask as kd  # noqa: E402

GRADS = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.fixture(scope="module")
def client():
    """Two single-threaded worker processes; every compute in this module runs on them."""
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        distributed.Client(cluster, set_as_default=True) as c,
    ):
        yield c


def _weak(p):
    p.g, p.beta = 0.02 * p.g, 0.25 * p.beta
    return p


def _problem(regime: str, dtype, T: int, *, B: int = 1, H: int = 1, seed: int = 0):
    p = make_problem(seed, B, H, T, 6, 5, "mild" if regime == "weak" else regime)
    return (_weak(p) if regime == "weak" else p).astype(dtype)


def _dask(x: np.ndarray, times: tuple[int, ...], heads=1, batch=1):
    """Head-first ``[B, H, T, ...]`` cut into the given time blocks."""
    return da.from_array(x, chunks=(batch, heads, times, *x.shape[3:]))


def _single(p, C: int, **options):
    kw = {"initial_state": p.initial_state, "chunk_size": C, **options}
    out = kda.chunk_kda(*p.inputs, save_boundaries=True, **kw)
    grads = kda.chunk_kda_backward(*p.inputs, out.boundaries, p.grad_output, p.grad_final_state, **kw)
    return out, grads


def _distributed(p, C: int, times, **cut):
    """Forward, backward with the forward's boundaries, and backward without them: one compute."""
    ins = [_dask(x, times, **cut) for x in p.inputs]
    do = _dask(p.grad_output, times, **cut)
    out = kd.chunk_kda(*ins, initial_state=p.initial_state, chunk_size=C, save_boundaries=True)
    kw = {"initial_state": p.initial_state, "chunk_size": C}
    saved = kd.chunk_kda_backward(*ins, out.boundaries, do, p.grad_final_state, **kw)
    recomputed = kd.chunk_kda_backward(*ins, None, do, p.grad_final_state, **kw)
    return dask.compute(out[:3], saved[:6], recomputed[:6])


def _check(p, C, times, **cut):
    out, grads = _single(p, C)
    got_out, *got_grads = _distributed(p, C, times, **cut)
    tol = TOLERANCE[np.dtype(p.q.dtype)]
    for name, got, want in zip(("output", "final_state", "boundaries"), got_out, out):
        assert_within(got, want, tol=tol, name=name)
    for got in got_grads:
        for name, g, want in zip(GRADS, got, grads):
            assert_within(g, want, tol=tol, name=name)


# uneven shards, each a whole number of 8-step chunks, and a shorter last one
FOUR = (8, 24, 16, 13)
SIXTEEN = (8, 16, 8, 8, 24, 8, 8, 16, 8, 8, 8, 16, 8, 8, 8, 5)


@pytest.mark.parametrize("regime", LOG_REGIMES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_regime(client, regime, dtype):
    _check(_problem(regime, dtype, sum(FOUR)), 8, FOUR)


@pytest.mark.parametrize(("regime", "dtype"), [("weak", np.float32), ("reset", np.float64)])
def test_sixteen_uneven_shards(client, regime, dtype):
    _check(_problem(regime, dtype, sum(SIXTEEN), seed=4), 8, SIXTEEN)


@pytest.mark.parametrize(
    "times",
    [
        (70,),  # one shard
        (32, 38),  # two
        (20, 30, 7, 13),  # boundaries off the chunk grid: moved to 16, 48, 64 (7 merges away)
        (3, 3, 3, 61),  # blocks shorter than half a chunk
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_time_blocks(client, times, dtype):
    _check(_problem("weak", dtype, sum(times), seed=1), 16, times)


def test_batch_and_head_blocks(client):
    """Batch and heads cut as well as time: independent problems, each with its own scan."""
    p = _problem("weak", np.float64, 40, B=3, H=4, seed=2)
    _check(p, 8, (16, 24), heads=(1, 3), batch=(2, 1))


def test_model_options_gva_time_major(client):
    """time_major, grouped value heads, softplus gates, sigmoid beta, q/k l2norm; their gradients."""
    rng = np.random.default_rng(3)
    B, T, H, HV, K, V, C = 2, 45, 2, 4, 6, 5, 8
    q, k = rng.standard_normal((2, B, T, H, K))
    v, do = rng.standard_normal((2, B, T, HV, V))
    g = rng.standard_normal((B, T, HV, K)) - 4.0
    beta = rng.standard_normal((B, T, HV))
    options = {
        "layout": "time_major",
        "qk_l2norm": True,
        "gate": "softplus",
        "A_log": rng.uniform(-2.0, 0.0, HV),
        "dt_bias": 0.1 * rng.standard_normal((HV, K)),
        "beta_activation": "sigmoid",
    }
    s0, ds = rng.standard_normal((2, B, HV, K, V))
    out = kda.chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=C, **options)
    grads = kda.chunk_kda_backward(q, k, v, g, beta, None, do, ds, initial_state=s0, chunk_size=C, **options)

    def cut(x, heads):
        return da.from_array(x, chunks=(1, (16, 16, 13), heads, *x.shape[3:]))

    ins = [cut(q, 1), cut(k, 1), cut(v, (1, 3)), cut(g, 2), cut(beta, 2)]
    got_out = kd.chunk_kda(*ins, initial_state=s0, chunk_size=C, **options)
    got = kd.chunk_kda_backward(*ins, None, cut(do, 2), ds, initial_state=s0, chunk_size=C, **options)
    got_out, got = dask.compute(got_out, got)
    assert_within(got_out.output, out.output, tol=1e-10, name="output")
    assert_within(got_out.final_state, out.final_state, tol=1e-10, name="final_state")
    for name in (*GRADS, "A_log", "dt_bias"):
        assert_within(getattr(got, name), getattr(grads, name), tol=1e-10, name=name)


def test_outputs_come_back_in_the_inputs_chunks():
    p = _problem("mild", np.float64, 50, H=2)
    ins = [_dask(x, (20, 30)) for x in p.inputs]
    out = kd.chunk_kda(*ins, chunk_size=16, save_boundaries=True)
    assert out.output.chunks == ins[2].chunks
    assert out.boundaries.chunks[0] == (1, 3)  # the shards start at steps 0 and 16
    grads = kd.chunk_kda_backward(*ins, None, _dask(p.grad_output, (20, 30)), chunk_size=16)
    for name, x in zip(GRADS, ins):
        assert getattr(grads, name).chunks == x.chunks
    assert grads.initial_state.shape == (1, 2, 6, 5)


def test_graph_grows_with_blocks_not_chunks():
    """The number of tasks depends on the blocks only, not on how many chunks they hold."""

    def tasks(T: int, C: int) -> tuple[int, int]:
        p = _problem("mild", np.float32, T)
        times = (T // 4, T // 4, T // 2)
        ins = [_dask(x, times) for x in p.inputs]
        out = kd.chunk_kda(*ins, chunk_size=C, save_boundaries=True)
        grads = kd.chunk_kda_backward(*ins, out.boundaries, _dask(p.grad_output, times), chunk_size=C)
        return len(dict(out.output.__dask_graph__())), len(dict(grads.k.__dask_graph__()))

    assert tasks(64, 16) == tasks(4096, 16) == tasks(4096, 4)


def test_bad_input_is_refused():
    p = _problem("mild", np.float64, 20)
    ins = [_dask(x, (10, 10)) for x in p.inputs]
    with pytest.raises(kda.InvalidInputError, match="save_boundaries must be False with cu_seqlens"):
        kd.chunk_kda(*ins, cu_seqlens=np.array([0, 20]), save_boundaries=True)
    with pytest.raises(kda.InvalidInputError, match="cu_seqlens must start at 0 and end at T=20"):
        kd.chunk_kda(*ins, cu_seqlens=np.array([0, 19]))
    with pytest.raises(kda.InvalidInputError, match="boundaries must be None with cu_seqlens"):
        kd.chunk_kda_backward(*ins, np.zeros((2, 1, 1, 6, 5)), ins[2], cu_seqlens=np.array([0, 20]))
    with pytest.raises(kda.InvalidTypeError, match="q must be a dask"):
        kd.chunk_kda(p.q, *ins[1:])
    with pytest.raises(kda.InvalidInputError, match="v must have shape"):
        kd.chunk_kda(ins[0], ins[1], ins[2][:, :, :5], *ins[3:])
    with pytest.raises(TypeError, match="boundaries"):
        kd.chunk_kda(*ins, boundaries=None)
    with pytest.raises(kda.InvalidInputError, match="initial_state"):
        kd.chunk_kda(*ins, initial_state=np.zeros((1, 2, 6, 4)))


def test_bad_values_raise_on_compute(client):
    """Values are checked where the blocks are: a positive gate raises kda's error from a worker."""
    p = _problem("mild", np.float64, 20)
    p.g[0, 0, 15, 2] = 0.5
    ins = [_dask(x, (10, 10)) for x in p.inputs]
    with pytest.raises(kda.InvalidInputError, match="g must hold log decays"):
        kd.chunk_kda(*ins).output.compute()


def test_import_kda_does_not_import_dask():
    code = "import sys, kda; assert 'dask' not in sys.modules, 'dask imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_dask_names_the_extra():
    code = (
        "import sys; sys.modules['dask'] = None\n"
        "try:\n    import kda.dask\nexcept ImportError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert "pip install 'kda[dask]'" in result.stdout


def test_bench_dask_runs(tmp_path):
    """``python -m benchmarks.sequence_dask`` on a tiny problem: the work ratios and the accuracy rows."""
    import json

    from benchmarks import sequence_dask as _bench_dask

    argv = [
        "--T",
        "64",
        "--H",
        "2",
        "--K",
        "8",
        "--V",
        "8",
        "--chunk-size",
        "16",
        "--parts",
        "work",
        "accuracy",
    ]
    argv += ["--accuracy-T", "64", "--accuracy-shards", "1", "4", "--out", str(tmp_path)]
    assert _bench_dask.main(argv) == 0
    report = json.loads((tmp_path / "dask.json").read_text())
    assert report["work"]["fwd+bwd"]["time"]["cpu_ratio"] > 0
    assert [row["shards"] for row in report["accuracy"]["rows"]] == [1, 4, 1, 4]
    assert all(
        row["worst"] < (1e-5 if row["dtype"] == "float32" else 1e-10) for row in report["accuracy"]["rows"]
    )


# packed sequences across time blocks: a sequence cut mid-block, boundaries aligned with blocks,
# many mixed lengths with empty ones, one sequence across every block (one crossing two)
PACKED = [
    ((0, 30, 70, 100, 120), (32, 32, 32, 24)),
    ((0, 40, 80, 120), (40, 40, 40)),
    ((0, 5, 5, 50, 51, 120, 120), (16, 64, 40)),
    ((0, 120), (24, 32, 40, 24)),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_packed_sequences_across_time_blocks(client, dtype):
    """cu_seqlens with time blocks (and head blocks, GVA, the softplus gate, beta sigmoid): output,
    final states and every gradient equal the single-process call."""
    rng = np.random.default_rng(3)
    T, H, HV, K, V = 120, 2, 4, 6, 5
    for offsets, times in PACKED:
        N = len(offsets) - 1
        x = [
            rng.standard_normal(s)
            for s in ((1, T, H, K), (1, T, H, K), (1, T, HV, V), (1, T, HV, K), (1, T, HV))
        ]
        x[1] /= np.linalg.norm(x[1], axis=-1, keepdims=True)
        x = [a.astype(dtype) for a in x]
        s0, dfin = (rng.standard_normal((N, HV, K, V)).astype(dtype) for _ in range(2))
        do = rng.standard_normal((1, T, HV, V)).astype(dtype)
        opts = dict(
            layout="time_major",
            chunk_size=8,
            gate="softplus",
            beta_activation="sigmoid",
            cu_seqlens=offsets,
            A_log=(0.3 * rng.standard_normal(HV) - 2).astype(dtype),
            dt_bias=rng.standard_normal((HV, K)).astype(dtype),
        )
        ref = kda.chunk_kda(*x, initial_state=s0, save_boundaries=True, **opts)
        grads = kda.chunk_kda_backward(*x, ref.boundaries, do, dfin, initial_state=s0, **opts)

        def cut(a, times=times):
            return da.from_array(a, chunks=(1, times, 2, *a.shape[3:]))

        out = kd.chunk_kda(*map(cut, x), initial_state=s0, **opts)
        got = kd.chunk_kda_backward(*map(cut, x), None, cut(do), dfin, initial_state=s0, **opts)
        got_out, got_grads = dask.compute(out[:2], got)
        tol = TOLERANCE[np.dtype(dtype)]
        for name, a, b in zip(("output", "final_state"), got_out, ref):
            assert_within(a, b, tol=tol, name=f"{offsets} {name}")
        for name, a, b in zip(kda.KdaGradients._fields, got_grads, grads):
            assert_within(a, b, tol=tol, name=f"{offsets} d{name}")


def _reordered(real, record):
    """``real`` returning its record with the fields in reverse order (same names)."""
    import collections

    Reversed = collections.namedtuple("Reversed", record._fields[::-1])

    def wrapped(*args, **kwargs):
        r = real(*args, **kwargs)
        return Reversed(**r._asdict())

    return wrapped


@pytest.mark.parametrize("packed", [False, True])
def test_graph_reads_task_records_by_name(monkeypatch, packed):
    """The graph reads every block task's result by field name: the same bits when each task
    returns its record with the fields in reverse order (an integer slot would read another
    field, or fail on the shorter record)."""
    from kda._dask import tasks
    from kda._entry.call import KdaGradients, KdaOutput
    from kda._entry.transition import KdaTransition

    p = _problem("mild", np.float64, 53, H=2, seed=3)
    A_log = np.linspace(-1.0, 0.5, 2)
    kw = {"chunk_size": 8, "gate": "softplus", "A_log": A_log}
    if packed:  # two sequences, the first crossing a time block
        kw["cu_seqlens"] = np.array([0, 20, 53])
    states = None if packed else p.initial_state

    def run():
        ins = [_dask(x, (16, 16, 21), heads=1) for x in (p.q, p.k, p.v, p.g, p.beta)]
        do = _dask(p.grad_output, (16, 16, 21), heads=1)
        out = kd.chunk_kda(*ins, initial_state=states, **kw)
        grads = kd.chunk_kda_backward(*ins, None, do, None, initial_state=states, **kw)
        return dask.compute(out[:2], grads, scheduler="sync")

    want = run()
    for name, record in (
        ("forward_block", KdaOutput),
        ("backward_block", KdaGradients),
        ("transition_block", KdaTransition),
        ("packed_forward_block", KdaOutput),
        ("packed_backward_block", KdaGradients),
        ("packed_transition", KdaTransition),
        ("packed_state_gradient", tasks.Retreat),
    ):
        monkeypatch.setattr(tasks, name, _reordered(getattr(tasks, name), record))
    got = run()
    (out, grads), (got_out, got_grads) = want, got
    for name, a, b in [
        *zip(("output", "final_state"), out, got_out),
        *zip(KdaGradients._fields, grads, got_grads),
    ]:
        assert (a is None and b is None) or np.array_equal(a, b), name
