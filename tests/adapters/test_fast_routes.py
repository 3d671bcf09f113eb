"""The adapters' per-call shortcuts: fla keyword translation memoised, CPU tensors viewed without
the general conversions, the pool call with int32 indices on the direct route. Each must give
the bits of the long way round and still refuse bad input with the named KdaError."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from helpers import decline_direct_decode_route, spy_direct_decode_route

torch = pytest.importorskip("torch")

import kda  # noqa: E402
import kda.torch as kt  # noqa: E402
from kda._entry import fla  # noqa: E402
from kda._torch import convert  # noqa: E402

RECURRENT = "fused_recurrent_kda"


def _kw(**given):
    """fla's keywords as the generated fused_recurrent_kda collects them (named ones, then extras)."""
    kw = dict(fla.RECURRENT_PARAMS)
    kw.update(given)
    return kw


def _translate(shape=(1, 1, 2, 4), **given):
    return fla.translate(RECURRENT, shape, shape, _kw(**given), has_A_log=False, has_dt_bias=False,
                         has_cu_seqlens=False)  # fmt: skip


def _step(seed=0, H=3, K=16, V=16, dtype=torch.float32):
    """One time-major decode step ``q, k, v, g, beta`` and a state, as inference tensors take them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, H, K, generator=gen, dtype=dtype)
    k = torch.randn(1, 1, H, K, generator=gen, dtype=dtype)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(1, 1, H, V, generator=gen, dtype=dtype)
    g = -torch.rand(1, 1, H, K, generator=gen, dtype=dtype)
    beta = torch.rand(1, 1, H, generator=gen, dtype=dtype)
    s0 = 0.5 * torch.randn(1, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, beta, s0


# ---------------------------------------------------------------- translate's memo


def test_translate_memo_returns_the_first_translation():
    fla._MEMO.clear()
    first = _translate(scale=0.5, output_final_state=True)
    assert _translate(scale=0.5, output_final_state=True) is first
    assert _translate(scale=0.25, output_final_state=True).static.scale == 0.25
    assert _translate(scale=0.5).output_final_state is False


def test_translate_memo_keeps_types_and_signs_apart():
    """``scale=1`` and ``scale=True`` are equal keys to a dict; the memo must not serve the second
    (a bool scale is refused); -0.0 and 0.0 are different scales; an explicit ``chunk_size=None``
    is refused after a call that left it out."""
    fla._MEMO.clear()
    assert _translate(scale=1).static.scale == 1.0
    with pytest.raises(kda.InvalidTypeError, match="scale must be a real number"):
        _translate(scale=True)
    assert not np.signbit(_translate(scale=0.0).static.scale)
    assert np.signbit(_translate(scale=-0.0).static.scale)
    assert _translate().static.chunk_size == 64
    with pytest.raises(kda.InvalidTypeError, match="chunk_size must be a positive int"):
        _translate(chunk_size=None)
    assert _translate(use_qk_l2norm_in_kernel=1).static.qk_l2norm is True
    assert _translate(use_qk_l2norm_in_kernel=True) is not _translate(use_qk_l2norm_in_kernel=1)


def test_translate_refusals_and_warnings_every_time():
    fla._MEMO.clear()
    for _ in range(2):
        with pytest.raises(
            kda.InvalidInputError, match=r"lower_bound=-1\.0 given without use_gate_in_kernel"
        ):
            _translate(lower_bound=-1.0)
        with pytest.raises(kda.InvalidInputError, match="q and v must be time-major"):
            _translate(shape=(1, 2, 4))
    for _ in range(2):
        with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
            assert _translate(transpose_state_layout=True).state_v_first is True


def test_translate_memo_is_bounded():
    fla._MEMO.clear()
    for n in range(fla.MEMO_SIZE + 5):
        _translate(scale=1.0 + n)
    assert len(fla._MEMO) <= fla.MEMO_SIZE


def test_numpy_scalar_options_are_translated_every_time():
    """A NumPy scalar is not a plain key: no memo entry, the same result."""
    fla._MEMO.clear()
    assert _translate(scale=np.float32(0.5)).static.scale == 0.5
    assert not fla._MEMO


# ---------------------------------------------------------------- kda.torch's recurrent inference call


def _general(monkeypatch):
    """The long way round: the general tensor conversion and the general decode route."""
    decline_direct_decode_route(monkeypatch)
    monkeypatch.setattr(convert, "VIEWED", ())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("v_first", [False, True])
def test_recurrent_inference_is_bitwise_the_general_route(dtype, v_first, monkeypatch):
    q, k, v, g, beta, s0 = _step(dtype=dtype)
    before = [t.clone() for t in (q, k, v, g, beta, s0)]
    served = spy_direct_decode_route(monkeypatch)
    with torch.inference_mode():
        fast = kt.fused_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                      state_v_first=v_first)  # fmt: skip
        assert served == [True]  # a [V, K] state (a transposed view) too: through a copy of its rows
        _general(monkeypatch)
        slow = kt.fused_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                      state_v_first=v_first)  # fmt: skip
    for a, b in zip(fast, slow):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v, g, beta, s0)))
    assert fast[1].untyped_storage().data_ptr() != s0.untyped_storage().data_ptr()


def test_views_gradients_and_strides_take_the_same_path():
    """A tensor that requires a gradient (under no_grad), a non-contiguous one and a float64 state
    for float32 steps: the same bits as plain contiguous inference tensors."""
    q, k, v, g, beta, s0 = _step(seed=3)
    with torch.inference_mode():
        want = kt.fused_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    leaf = q.clone().requires_grad_()
    strided = torch.empty(1, 1, 3, 32)[..., ::2]
    strided[...] = k
    assert not strided.is_contiguous()
    with torch.no_grad():
        got = kt.fused_recurrent_kda(
            leaf, strided, v, g, beta, initial_state=s0.double(), output_final_state=True
        )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_negative_view_is_resolved():
    """A tensor with the negative bit set (a lazy negation) cannot be viewed as is: the general
    conversion resolves it."""
    x = torch.arange(4.0)
    neg = torch._neg_view(x)
    assert neg.is_neg() and np.array_equal(convert.array(neg), -x.numpy())


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [("q", float("nan"), "^q must"), ("g", 0.5, "^g must hold log decays"), ("beta", float("inf"), "^beta")],
)  # fmt: skip
def test_recurrent_inference_refusals_name_the_argument(name, value, match):
    x = dict(zip(("q", "k", "v", "g", "beta", "initial_state"), _step(seed=1)))
    x[name].view(-1)[-1] = value
    before = x["initial_state"].clone()
    with torch.inference_mode(), pytest.raises(kda.InvalidInputError, match=match):
        kt.fused_recurrent_kda(**x, output_final_state=True)
    assert torch.equal(x["initial_state"], before)


def test_recurrent_inference_refuses_a_wrong_state_shape():
    q, k, v, g, beta, s0 = _step()
    with torch.inference_mode(), pytest.raises(kda.InvalidInputError, match="initial_state must have shape"):
        kt.fused_recurrent_kda(q, k, v, g, beta, initial_state=s0[:, :2], output_final_state=True)


# ---------------------------------------------------------------- the pool call (vLLM's)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("per_step", [False, True])
def test_pool_call_is_bitwise_the_general_route(index_dtype, per_step, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    N, T, H, K, V, P = 3, 2, 2, 8, 8, 10
    q, k, v = (torch.randn(N, T, H, D, generator=gen) for D in (K, K, V))
    k = k / k.norm(dim=-1, keepdim=True)
    g, beta = -torch.rand(N, T, H, K, generator=gen), torch.rand(N, T, H, generator=gen)
    pool = 0.5 * torch.randn(P, H, K, V, generator=gen)
    if per_step:
        kw = {"ssm_state_indices": torch.tensor([[4, 0], [7, -1], [-1, -1]], dtype=index_dtype),
              "num_accepted_tokens": torch.tensor([2, 1, 1], dtype=index_dtype)}  # fmt: skip
    else:
        kw = {"ssm_state_indices": torch.tensor([4, 9, -1], dtype=index_dtype)}
    a, b = pool.clone(), pool.clone()
    served = spy_direct_decode_route(monkeypatch)
    with torch.inference_mode():
        fast, _ = kt.fused_recurrent_kda(q, k, v, g, beta, initial_state=a, inplace_final_state=True, **kw)
        assert served == [True]
        _general(monkeypatch)
        slow, _ = kt.fused_recurrent_kda(q, k, v, g, beta, initial_state=b, inplace_final_state=True, **kw)
    assert torch.equal(fast, slow) and torch.equal(a, b) and not torch.equal(a, pool)


def test_pool_call_refusals_write_nothing():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 1, 2, 4, generator=gen) for _ in range(3))
    g, beta = -torch.rand(2, 1, 2, 4, generator=gen), torch.rand(2, 1, 2, generator=gen)
    pool = torch.randn(5, 2, 4, 4, generator=gen)
    before = pool.clone()
    for idx, match in (([1, 1], "at most once"), ([0, 5], r"row in \[0, 5\)"), ([-3, 0], r"\[-3\]")):
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("error")
            with pytest.raises(kda.InvalidInputError, match=f"state_indices.*{match}"):
                kt.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, inplace_final_state=True,
                                       ssm_state_indices=torch.tensor(idx, dtype=torch.int32))  # fmt: skip
        assert torch.equal(pool, before)
