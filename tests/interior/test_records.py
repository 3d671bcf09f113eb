"""The records at kda's inner boundaries, tied to what is generated from them.

The host arrays (``kda._entry.call.Inputs``) and the options that are not arrays
(``kda._entry.fla.OpOptions``) are the one statement of an adapter call's arguments: the torch ops'
schemas and the JAX residuals are generated from them, so a reordered or added field cannot make
an op read ``A_log`` where ``initial_state`` was passed. The option table states, per option, the
values that leave a call plain: the one "plain call" predicate is generated from it.
"""

from __future__ import annotations

import numpy as np
import pytest

import kda
from kda._entry.call import Inputs, KdaGradients
from kda._entry.fla import OpOptions
from kda._options import maps
from kda._options.table import ANY, OPTIONS, Choices, is_plain

# an option value that is not plain, per option (each as the table's checks accept it, where they can)
NOT_PLAIN = {
    "qk_l2norm": True,
    "gate": "softplus",
    "A_log": np.zeros(2, np.float32),
    "dt_bias": np.zeros((2, 4), np.float32),
    "lower_bound": -1.0,
    "beta_activation": "sigmoid",
    "cu_seqlens": np.array([0, 1]),
    "layout": "sideways",
}


def test_inputs_are_the_gradients_fields():
    """A call's arrays and their gradients are one list of names, in one order."""
    assert Inputs._fields == KdaGradients._fields
    assert Inputs._fields[:5] == ("q", "k", "v", "g", "beta")
    assert set(Inputs._field_defaults) == {"initial_state", "A_log", "dt_bias"}  # may be None


def _schema_names(op) -> list[str]:
    return [a.name for a in op.default._schema.arguments]


def _schema_optional(op) -> dict[str, bool]:
    return {
        a.name: str(a.type).endswith("?") or "Optional" in str(a.type) for a in op.default._schema.arguments
    }


def test_torch_op_schemas_are_the_records():
    """Every op's arguments are the records' fields, in their order: the host arrays (those with a
    default optional), the offsets, the op's own, then OpOptions' fields with their types."""
    torch = pytest.importorskip("torch")
    from kda._torch import ops as kt

    ops = torch.ops.kda
    options = list(OpOptions._fields)
    inputs = [*Inputs._fields, "cu_seqlens"]
    assert _schema_names(ops.forward) == [*inputs, *options]
    assert _schema_names(ops.backward) == [
        *inputs, "boundaries", "grad_output", "grad_final_state", "grad_boundaries", *options,
    ]  # fmt: skip
    assert _schema_names(ops.recurrent_inference) == [*inputs, "state_v_first", *options]
    steps = [n for n in Inputs._fields if n not in Inputs._field_defaults]
    assert _schema_names(ops.decode)[: len(steps)] == steps
    assert _schema_names(ops.decode)[-len(options) :] == options
    for op in (ops.forward, ops.backward, ops.recurrent_inference):
        optional = _schema_optional(op)
        assert [n for n in Inputs._fields if optional[n]] == list(Inputs._field_defaults)
        assert optional["lower_bound"] and not optional["scale"] and not optional["beta_activation"]
    # the implementations read their arguments through records made from the same schemas
    assert kt.ForwardArgs._fields == tuple(_schema_names(ops.forward))
    assert kt.BackwardArgs._fields == tuple(_schema_names(ops.backward))
    assert kt.DecodeArgs._fields == tuple(_schema_names(ops.decode))
    assert kt.RecurrentInferenceArgs._fields == tuple(_schema_names(ops.recurrent_inference))


def test_torch_op_reads_the_arrays_by_name(monkeypatch):
    """An injected swap of two optional arrays in the record the op builds is seen by the host layer
    (the test above would then fail): the op passes the arrays by the record's names."""
    pytest.importorskip("torch")
    import torch

    import kda._entry.host as host
    import kda.torch as kt

    seen = {}
    real = host.forward

    def spy(options, x, offsets, v_first=False):
        seen.update(x._asdict())
        seen["options"] = options
        return real(options, x, offsets, v_first)

    monkeypatch.setattr(host, "forward", spy)
    rng = np.random.default_rng(0)
    B, T, H, K, V = 1, 5, 2, 4, 4
    q, k = (torch.tensor(rng.standard_normal((B, T, H, K)), dtype=torch.float32) for _ in range(2))
    v = torch.tensor(rng.standard_normal((B, T, H, V)), dtype=torch.float32)
    g = torch.tensor(rng.standard_normal((B, T, H, K)), dtype=torch.float32)
    beta = torch.rand(B, T, H)
    A_log, dt_bias = torch.zeros(H), torch.ones(H * K)
    s0 = torch.full((B, H, K, V), 0.5)
    kt.chunk_kda(q, k, v, g, beta, initial_state=s0, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True)
    assert seen["A_log"].shape == (H,) and np.all(seen["A_log"] == 0)
    assert seen["dt_bias"].shape == (H, K) and np.all(seen["dt_bias"] == 1)
    assert seen["initial_state"].shape == (B, H, K, V) and np.all(seen["initial_state"] == 0.5)
    assert isinstance(seen["options"], OpOptions) and seen["options"].gate == "softplus"


def test_jax_residuals_are_the_records():
    """The custom_vjp's residuals: the host arrays as Inputs, the offsets, the boundaries."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import kda.jax as kj

    assert kj.Residuals._fields == ("inputs", "cu_seqlens", "boundaries")
    rng = np.random.default_rng(1)
    B, T, H, K, V = 1, 6, 2, 4, 3
    x = Inputs(
        *(jnp.asarray(rng.standard_normal((B, T, H, d)), dtype=jnp.float32) for d in (K, K, V)),
        jnp.asarray(-np.abs(rng.standard_normal((B, T, H, K))), dtype=jnp.float32),
        jnp.asarray(rng.uniform(size=(B, T, H)), dtype=jnp.float32),
        initial_state=jnp.ones((B, H, K, V), dtype=jnp.float32),
    )
    static = OpOptions(
        method="chunk", scale=0.5, chunk_size=4, qk_l2norm=False, gate="log", lower_bound=None,
        beta_activation="",
    )  # fmt: skip
    (o, final, boundaries), res = kj._kda_fwd(static, x, None)
    assert isinstance(res, kj.Residuals) and isinstance(res.inputs, Inputs)
    assert res.inputs.initial_state is x.initial_state and res.inputs.A_log is None
    assert res.boundaries is boundaries and res.cu_seqlens is None
    grads, dcu = kj._kda_bwd(
        static, res, (jnp.ones_like(o), jnp.zeros_like(final), jnp.zeros_like(boundaries))
    )
    assert isinstance(grads, Inputs) and dcu is None
    assert grads.A_log is None and grads.initial_state.shape == (B, H, K, V)


def test_every_option_states_its_plain_values():
    """Each row of the table says which values leave a call plain, and the predicate asks them all."""
    assert is_plain(Choices())
    # the options that can make a call not plain, pinned: a new option's row states its plain values
    # and is added here with a value that is not plain
    assert {o.name for o in OPTIONS if o.plain is not ANY} == set(NOT_PLAIN)
    for o in OPTIONS:
        assert o.plain is ANY or isinstance(o.plain, tuple), o.name
        assert o.plain is ANY or o.name in NOT_PLAIN, f"add a non-plain value of {o.name} to NOT_PLAIN"
        if o.plain is not ANY:
            assert o.default in o.plain, o.name  # the defaults make a plain call
            assert not is_plain(Choices(**{o.name: NOT_PLAIN[o.name]})), o.name


def test_validated_options_hold_every_map():
    """The validated record's plain test (kda._options.maps.Options.is_identity) is the table's over
    the options it holds; every other option that can make a call not plain is the problem's."""
    held = {f for f in maps.Options.__dataclass_fields__}
    for o in OPTIONS:
        if o.plain is not ANY and o.name not in held:
            assert o.name in ("cu_seqlens", "layout"), f"{o.name}: a map the validated record does not hold"
    assert maps.Options().is_identity
    assert not maps.Options(qk_l2norm=True).is_identity
    assert not maps.Options(gate="softplus").is_identity
    assert not maps.Options(beta_activation="sigmoid2").is_identity


@pytest.mark.parametrize("name", [o.name for o in OPTIONS if o.plain is not ANY and o.name != "layout"])
def test_decode_fast_path_sees_every_option(name, monkeypatch):
    """The NumPy decode route takes no call with an option at a value that is not plain: it asks the
    table's predicate (a new option's row cannot be skipped). The general route then runs it."""
    import kda._entry.decode as entry

    taken = []
    real = entry._numpy_route

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(entry, "_numpy_route", spy)
    rng = np.random.default_rng(2)
    N, H, T, K, V = 2, 2, 1, 4, 3
    q, k = (rng.standard_normal((N, H, T, K)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((N, H, T, V)).astype(np.float32)
    g = -np.abs(rng.standard_normal((N, H, T, K))).astype(np.float32)
    beta = rng.uniform(size=(N, H, T)).astype(np.float32)
    pool = np.zeros((3, H, K, V), np.float32)
    kw = {name: NOT_PLAIN[name]}
    if name in ("gate", "A_log", "dt_bias", "lower_bound"):
        kw["gate"] = "lower_bound"
        kw.setdefault("lower_bound", -1.0)
    if name == "cu_seqlens":
        q, k, v, g, beta = (x[:1] for x in (q, k, v, g, beta))
        kw["cu_seqlens"] = np.array([0, 1])
        idx = np.array([0])
    else:
        idx = np.array([0, 2])
    kda.decode_kda(q, k, v, g, beta, pool, idx, **kw)
    assert taken in ([], [False]), taken  # the general route ran it
    assert np.any(pool != 0)


def test_prepared_decode_refuses_non_contiguous_torch_inputs():
    """docs/decode.md: the prepared form binds C-contiguous inputs; a transposed torch view is refused
    as a NumPy one is (one contiguity check for every array library)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    N, H, T, K, V = 2, 2, 3, 4, 3
    q = torch.tensor(rng.standard_normal((N, H, K, T)), dtype=torch.float32).transpose(-1, -2)
    k = torch.tensor(rng.standard_normal((N, H, T, K)), dtype=torch.float32)
    v = torch.tensor(rng.standard_normal((N, H, T, V)), dtype=torch.float32)
    g = -torch.rand(N, H, T, K)
    beta = torch.rand(N, H, T)
    pool = torch.zeros(3, H, K, V)
    idx = torch.tensor([0, 2])
    assert not q.is_contiguous()
    with pytest.raises(kda.InvalidInputError, match="C-contiguous bindings: q"):
        kda.prepare_decode_kda(q, k, v, g, beta, pool, idx)
    plan = kda.prepare_decode_kda(q.contiguous(), k, v, g, beta, pool, idx)
    assert plan.run().shape == (N, H, T, V)
