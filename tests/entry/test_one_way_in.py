"""One way in: every entry point's options come from the one table, and every entry point reaches
the chunked algorithm through the core (so plans are bitwise the plain calls, widening included)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from helpers import make_model_problem

import kda
from kda._options.table import OPTIONS

ENTRY_POINTS = {
    "chunk_kda": kda.chunk_kda,
    "chunk_kda_backward": kda.chunk_kda_backward,
    "recurrent_kda": kda.recurrent_kda,
    "recurrent_kda_backward": kda.recurrent_kda_backward,
    "prepare_chunk_kda": kda.prepare_chunk_kda,
    "prepare_chunk_kda_backward": kda.prepare_chunk_kda_backward,
    "chunk_kda_transition": kda.chunk_kda_transition,
    "chunk_kda_transition_backward": kda.chunk_kda_transition_backward,
    "decode_kda": kda.decode_kda,
    "prepare_decode_kda": kda.prepare_decode_kda,
}


def _entry_points() -> dict:
    points = dict(ENTRY_POINTS)
    try:
        import kda.dask

        points["dask.chunk_kda"] = kda.dask.chunk_kda
        points["dask.chunk_kda_backward"] = kda.dask.chunk_kda_backward
    except ImportError:
        pass
    return points


@pytest.mark.parametrize("name", sorted(_entry_points()))
def test_signature_and_docs_follow_the_option_table(name):
    """Every option of the table ends the signature, keyword-only, with
    the table's default and its documentation; no **kwargs; an unknown keyword is a TypeError."""
    fn = _entry_points()[name]
    params = inspect.signature(fn).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    options = list(OPTIONS)
    tail = list(params.values())[-len(options) :]
    assert [p.name for p in tail] == [o.name for o in options]
    for p, o in zip(tail, options, strict=True):
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == o.default, p
        assert f"{o.name} : " in fn.__doc__ and o.doc.split()[0] in fn.__doc__, (name, o.name)
    assert "{options}" not in fn.__doc__
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_an_option'"):
        required = [q for q in params.values() if q.default is inspect.Parameter.empty]
        fn(*(None for _ in required), not_an_option=1)


def test_fla_signatures_are_one():
    """kda.torch and kda.jax take fla's parameters in fla's order, from one declaration."""
    from kda._entry.fla import CHUNK_PARAMS, RECURRENT_PARAMS

    adapters = []
    for module in ("kda.torch", "kda.jax"):
        try:
            adapters.append(__import__(module, fromlist=["chunk_kda"]))
        except ImportError:
            continue
    if not adapters:
        pytest.skip("neither torch nor jax is installed")
    for mod in adapters:
        for fn, declared in ((mod.chunk_kda, CHUNK_PARAMS), (mod.fused_recurrent_kda, RECURRENT_PARAMS)):
            params = list(inspect.signature(fn).parameters.values())
            assert [p.name for p in params[:5]] == ["q", "k", "v", "g", "beta"]
            assert [(p.name, p.default) for p in params[5:-1]] == list(declared)
            assert params[-1].kind is inspect.Parameter.VAR_KEYWORD


# ---------------------------------------------------------------------------- plans are the core

OPTION_SETS = {
    "plain": {},
    "time_major+gva": {"layout": "time_major", "G": 2},
    "softplus+l2norm+sigmoid": {"gate": "softplus", "qk_l2norm": True, "beta_activation": "sigmoid"},
    "packed": {"cu_seqlens": (0, 100, 100, 250, 300)},
}


def _problem(options: dict, dtype, T=300, K=2, V=8):
    return make_model_problem(11, 1, 2, T, K, V, **options).astype(dtype)


def _bitwise(a, b, name):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert np.array_equal(a, b, equal_nan=True), f"{name}: max diff {np.nanmax(np.abs(a - b))}"


@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("options", sorted(OPTION_SETS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_plans_are_bitwise_the_plain_call(options, dtype, with_out):
    """Forward and backward plans, with and without caller buffers, give the plain calls' bits,
    including K=2 with chunk 128, where the core widens float32 to float64 (the reported case)."""
    p = _problem(OPTION_SETS[options], dtype)
    kw = {**p.kwargs, "chunk_size": 128}
    out = kda.chunk_kda(*p.inputs, save_boundaries=True, **kw)
    do = np.random.default_rng(2).standard_normal(out.output.shape).astype(dtype)
    grads = kda.chunk_kda_backward(*p.inputs, out.boundaries, do, **kw)
    fwd_out = bwd_out = None
    if with_out:
        fwd_out = kda.KdaOutput(*(np.full(x.shape, np.nan, x.dtype) for x in out))
        bwd_out = kda.KdaGradients(*(None if x is None else np.full(x.shape, np.nan, x.dtype) for x in grads))
    plan = kda.prepare_chunk_kda(*p.inputs, save_boundaries=True, out=fwd_out, **kw)
    for _ in range(2):
        got = plan.run()
        for name, a, b in zip(out._fields, got, out, strict=True):
            _bitwise(a, b, f"forward {name}")
    bplan = kda.prepare_chunk_kda_backward(*p.inputs, out.boundaries, do, out=bwd_out, **kw)
    for name, a, b in zip(grads._fields, bplan.run(), grads, strict=True):
        if b is not None:
            _bitwise(a, b, f"backward {name}")
    recomputing = kda.prepare_chunk_kda_backward(*p.inputs, None, do, **kw).run()
    plain = kda.chunk_kda_backward(*p.inputs, None, do, **kw)
    for name, a, b in zip(grads._fields, recomputing, plain, strict=True):
        if b is not None:
            _bitwise(a, b, f"backward (recomputed boundaries) {name}")


def test_reported_plan_case_is_accurate():
    """B=1, H=2, T=300, K=2, V=8, chunk 128, float32, zero decay (keys this small with a chunk this
    large compute in float64): a plan computes as the plain call does, bitwise, and both are within
    2e-7 of the float64 recurrence."""
    p = make_model_problem(0, 1, 2, 300, 2, 8, regime="zero").astype(np.float32)
    want = kda.recurrent_kda(*(x.astype(np.float64) for x in p.inputs)).output
    got = kda.prepare_chunk_kda(*p.inputs, chunk_size=128).run().output
    plain = kda.chunk_kda(*p.inputs, chunk_size=128).output
    _bitwise(got, plain, "output")
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 2e-7


def test_transitions_go_through_the_core(monkeypatch):
    """Transition maps are computed by the core (its route, widening and backend choice): a core
    whose routing is counted sees every map's call."""
    from kda._engine import core

    calls = []
    route = core.ChunkCore.route
    monkeypatch.setattr(core.ChunkCore, "route", lambda self, q: calls.append(q.shape) or route(self, q))
    p = make_model_problem(4, 1, 2, 40, 2, 3).astype(np.float32)
    kda.chunk_kda_transition(*p.inputs, chunk_size=32)
    kda.chunk_kda_transition_backward(*p.inputs, np.ones((1, 2, 40, 3), np.float32), chunk_size=32)
    assert len(calls) == 2


# ---------------------------------------------------------------------------- short call paths
# kda's frames on the stack when a call reaches its first backend primitive (frames whose module
# is kda or kda.*, the public function's own first: kda._entry.api.chunk_kda). The
# engine's share is the frames in the chunked algorithm's modules, from the function the core
# calls down to the primitive call; the entry layers' share (adapter, entry, core) is everything above it.

#: the chunked algorithm's modules (its entry points, the forward, the backward, what they share)
ENGINE = (
    "kda._engine.chunked",
    "kda._engine.chunked_forward",
    "kda._engine.chunked_backward",
    "kda._engine.chunks",
)
PATHS = {  # name: (the entry layers' budget, the total budget)
    "kda.chunk_kda": (3, 7),
    "kda.torch.chunk_kda backward": (4, 8),
}


def _primitive_names() -> set[str]:
    from kda._backend import Backend

    hooks = {"workers", "worker_context", "launch_gate_check"}
    return {n for n in vars(Backend) if not n.startswith("_")} - hooks


def _stack_at_first_primitive(fn) -> tuple[str, list[str]]:
    """``(primitive, kda's frames outermost first)`` when ``fn()`` first calls a backend primitive."""
    import sys

    primitives, found = _primitive_names(), []

    def profile(frame, event, arg):
        if found or event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[:2] in (["kda", "reference"], ["kda", "cpu"], ["kda", "cuda"]):
            if frame.f_code.co_name in primitives:
                names, f = [], frame.f_back
                while f is not None:
                    m = f.f_globals.get("__name__", "")
                    if m == "kda" or m.startswith("kda."):
                        names.append(f"{m}.{f.f_code.co_name}")
                    f = f.f_back
                found.append((f"{module}.{frame.f_code.co_name}", names[::-1]))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    assert found, "no backend primitive was called"
    return found[0]


def _probe_inputs():
    import kda.cpu

    rng = np.random.default_rng(0)
    # longer than the cpu backend's step-recurrence crossover: the chunked algorithm runs
    B, H, T, K, V = 1, 2, 4 * max(64, kda.cpu.RECURRENT_MAX_T), 32, 32
    q, k, v = (rng.standard_normal((B, H, T, d)).astype(np.float32) for d in (K, K, V))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = np.log(rng.uniform(0.9, 1, (B, H, T, K))).astype(np.float32)
    beta = rng.uniform(0, 1, (B, H, T)).astype(np.float32)
    return q, k, v, g, beta


def _call_path(name: str) -> list[str]:
    q, k, v, g, beta = _probe_inputs()
    if name == "kda.chunk_kda":
        _, frames = _stack_at_first_primitive(lambda: kda.chunk_kda(q, k, v, g, beta))
        assert frames[0] == "kda._entry.api.chunk_kda", frames
        return frames
    torch = pytest.importorskip("torch")
    import kda.torch as kt

    x = [torch.tensor(np.swapaxes(a, 1, 2).copy(), requires_grad=True) for a in (q, k, v, g, beta)]
    o, _ = kt.chunk_kda(*x)
    _, frames = _stack_at_first_primitive(lambda: o.sum().backward())
    assert frames[0] == "kda._torch.ops._backward", frames
    return frames


def _shares(frames: list[str]) -> tuple[list[str], list[str]]:
    """``(the entry layers' frames, the engine's frames)``."""
    engine = [f for f in frames if f.startswith(tuple(m + "." for m in ENGINE))]
    assert frames[len(frames) - len(engine) :] == engine, f"engine frames are not the innermost: {frames}"
    return frames[: len(frames) - len(engine)], engine


@pytest.mark.parametrize("name", sorted(PATHS))
def test_entry_layers_call_path_budget(name):
    """Above the engine, kda.chunk_kda (NumPy) reaches the chunked algorithm in at most 3 of kda's
    frames (api.chunk_kda, Call.forward, ChunkCore.forward) and the backward of kda.torch.chunk_kda
    in at most 4 (the autograd formula, the backward op, Call.backward, ChunkCore.backward): the
    backward reuses the forward's validated call instead of re-entering the public API."""
    mine, engine = _shares(_call_path(name))
    assert engine, "the path did not go through the chunked algorithm"
    assert mine[-1] == "kda._engine.core.forward" or mine[-1] == "kda._engine.core.backward", mine
    assert len(mine) <= PATHS[name][0], mine


@pytest.mark.parametrize("name", sorted(PATHS))
def test_total_call_path_budget(name):
    """The whole path: at most 7 of kda's frames for kda.chunk_kda, 8 for the torch backward; the
    engine's share (the chunked algorithm's modules, from the function the core calls) at most 4."""
    frames = _call_path(name)
    assert len(frames) <= PATHS[name][1], frames
    assert 1 <= len(_shares(frames)[1]) <= 4, frames
