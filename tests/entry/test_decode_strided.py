"""Pools whose rows sit a padded slot stride apart (vLLM-CPU's views: each slot's ``HV K V``
states C-contiguous, rows further apart than that) and row-strided int32 indices: read and
written in place by every backend's kernel (no copy of any row), in both layouts and all three
pool dtypes, through ``decode_kda``, its prepared form and ``kda.torch``'s pool call; against
the float64 recurrence, rows no request names and the padding between rows bitwise unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BACKENDS
from test_decode_pools import POOL_DTYPES, _bits, _check, _inputs, _pool, ml_dtypes

import kda

PAD = 13  # elements of padding after each slot


def _padded(dense: np.ndarray, pad: int = PAD) -> tuple[np.ndarray, np.ndarray]:
    """``(pool, buffer)``: ``dense [P, ...]``'s rows in a ``[P, row + pad]`` buffer whose padding
    holds the byte 0xA5, and ``pool`` the view of the rows (not C-contiguous)."""
    P, row = dense.shape[0], dense[0].size
    buf = np.empty((P, row + pad), dense.dtype)
    buf.view(np.uint8)[...] = 0xA5
    buf[:, :row] = dense.reshape(P, row)
    pool = buf[:, :row].reshape(dense.shape)
    assert not pool.flags.c_contiguous and np.shares_memory(pool, buf)
    return pool, buf


def _no_copies(monkeypatch, backend):
    """Make a copy of the pool fail the call: the cpu backend's copy route raises, and the cuda
    backend's copy counter is checked by :func:`_copies`."""
    if backend == "cpu":
        from kda.cpu import _decode

        def refuse(*args, **kwargs):
            raise AssertionError("the pool went through copies")

        monkeypatch.setattr(_decode, "_through_copies", refuse)


def _copies() -> int:
    try:
        from kda.cuda import _launch
    except ImportError:  # pragma: no cover - no numba-cuda
        return 0
    return int(_launch.COPIES["decode_forward"])


def _slots_int32(rows: list[list[int]]) -> np.ndarray:
    """``rows`` as a row-strided int32 view (every third column of a wider buffer)."""
    buf = np.full((len(rows), len(rows[0]), 3), 99, np.int32)
    view = buf[:, :, 0]
    view[...] = rows
    assert not view.flags.c_contiguous
    return view


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", POOL_DTYPES)
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("per_step", [False, True])
def test_padded_pool_in_place(backend, dtype, v_first, per_step, monkeypatch):
    """Speculative verification (own slots repeated, ``pad_slot_id=0``) and plain decoding on a
    padded pool: the recurrence from the rounded start rows, the padding and unnamed rows kept."""
    _no_copies(monkeypatch, backend)
    rng = np.random.default_rng(20 + per_step)
    N, HV, K, V, P = 4, 2, 8, 12, 9
    T = 3 if per_step else 1
    x = _inputs(rng, N, HV, T, K, V, "strong")
    pool, buf = _padded(_pool(rng, P, HV, K, V, dtype, v_first))
    padding, before = buf[:, pool[0].size :].copy(), pool.copy()
    if per_step:
        slots, accepted = _slots_int32([[1, 1, 1], [0, 0, 0], [4, 2, -1], [6, 6, 3]]), np.array([1, 1, 2, 3])
    else:
        slots, accepted = _slots_int32([[5], [0], [2], [7]])[:, 0], None
    copies = _copies()
    out = kda.decode_kda(*x, pool, slots, num_accepted_tokens=accepted, state_v_first=v_first, pad_slot_id=0,
                         backend=backend)  # fmt: skip
    assert np.all(out[1] == 0)
    _check(out, pool, before, x, slots, accepted, 0, dtype, v_first)
    assert np.array_equal(_bits(buf[:, pool[0].size :]), _bits(padding)), "the padding between rows changed"
    assert _copies() == copies, "the pool went through a copy"
    # the same call on the dense pool gives the same bits
    dense = np.ascontiguousarray(before)
    want = kda.decode_kda(*x, dense, np.ascontiguousarray(slots), num_accepted_tokens=accepted,
                          state_v_first=v_first, pad_slot_id=0, backend=backend)  # fmt: skip
    assert np.array_equal(out, want) and np.array_equal(_bits(pool), _bits(dense))


@pytest.mark.parametrize("dtype", POOL_DTYPES)
@pytest.mark.parametrize("v_first", [False, True])
def test_padded_pool_prepared(dtype, v_first, monkeypatch):
    """A prepared plan on a padded pool: each run bitwise the dense call's, no copies."""
    if "cpu" not in BACKENDS:
        pytest.skip("no cpu backend")
    _no_copies(monkeypatch, "cpu")
    rng = np.random.default_rng(22)
    N, HV, T, K, V, P = 3, 2, 2, 16, 16, 6
    x = _inputs(rng, N, HV, T, K, V)
    dense = _pool(rng, P, HV, K, V, dtype, v_first)
    pool, buf = _padded(dense.copy())
    padding = buf[:, pool[0].size :].copy()
    idx = np.array([[2, 2], [4, 0], [-1, -1]])
    plan = kda.prepare_decode_kda(*x, pool, idx, state_v_first=v_first)
    for _ in range(2):
        got = plan.run().copy()
        want = kda.decode_kda(*x, dense, idx, state_v_first=v_first)
        assert np.array_equal(got, want) and np.array_equal(_bits(pool), _bits(dense))
    assert np.array_equal(_bits(buf[:, pool[0].size :]), _bits(padding))


def test_pools_that_cannot_be_viewed_flat_are_copied():
    """A pool whose rows are not C-contiguous (a transposed view) is still served, bitwise as
    the dense pool (through copies of the named rows)."""
    rng = np.random.default_rng(23)
    x = _inputs(rng, 2, 2, 1, 8, 8)
    dense = _pool(rng, 5, 2, 8, 8, "float32", False, poison=False)
    backing = np.ascontiguousarray(np.swapaxes(dense, -1, -2))
    pool = np.swapaxes(backing, -1, -2)  # [P, HV, K, V] with strided rows
    want = dense.copy()
    out = kda.decode_kda(*x, pool, [3, 1])
    assert np.array_equal(out, kda.decode_kda(*x, want, [3, 1])) and np.array_equal(pool, want)


torch = pytest.importorskip("torch")
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("dtype", POOL_DTYPES)
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("inference", [True, False])
def test_torch_pool_call_on_a_padded_view(dtype, v_first, inference, monkeypatch):
    """vLLM-CPU's call: ``fused_recurrent_kda(..., initial_state=pool_view, ssm_state_indices=
    int32 row-strided, num_accepted_tokens, inplace_final_state=True, state_v_first, pad_slot_id=0)``
    on a view ``[P, HV, K, V]`` of a padded ``[P, row + pad]`` tensor: written in place (the view
    returned), bitwise NumPy's dense call, the padding kept, no copies (in and out of inference mode)."""
    from kda.torch import fused_recurrent_kda

    if "cpu" not in BACKENDS:
        pytest.skip("no cpu backend")
    _no_copies(monkeypatch, "cpu")
    rng = np.random.default_rng(24)
    N, HV, T, K, V, P = 3, 2, 2, 8, 12, 7
    x = _inputs(rng, N, HV, T, K, V)
    dense = _pool(rng, P, HV, K, V, dtype, v_first, poison=False)
    idx = [[1, 1], [0, 0], [5, 3]]
    accepted = np.array([1, 1, 2])
    want_pool = dense.copy()
    want = kda.decode_kda(
        *x, want_pool, idx, num_accepted_tokens=accepted, state_v_first=v_first, pad_slot_id=0
    )
    row = dense[0].size
    bits = dense.view(np.int16) if dtype == "bfloat16" else dense
    buf = torch.full((P, row + PAD), -7, dtype=torch.int16 if dtype == "bfloat16" else _TORCH[dtype])
    buf[:, :row] = torch.from_numpy(bits.reshape(P, row).copy())
    if dtype == "bfloat16":
        buf = buf.view(torch.bfloat16)
    padding = buf[:, row:].clone()
    t_pool = buf[:, :row].view(dense.shape)
    assert not t_pool.is_contiguous()
    ibuf = torch.zeros((N, T, 2), dtype=torch.int32)
    ibuf[:, :, 0] = torch.tensor(idx)
    tq, tk, tv, tg, tb = (torch.from_numpy(np.ascontiguousarray(np.swapaxes(a, 1, 2))) for a in x)
    ctx = torch.inference_mode() if inference else torch.no_grad()
    with ctx:
        o, final = fused_recurrent_kda(
            tq, tk, tv, tg, tb, initial_state=t_pool, inplace_final_state=True, state_v_first=v_first,
            ssm_state_indices=ibuf[:, :, 0], num_accepted_tokens=torch.from_numpy(accepted), pad_slot_id=0,
        )  # fmt: skip
    assert final is t_pool
    assert np.array_equal(o.numpy(), np.swapaxes(want, 1, 2))
    got = t_pool.view(torch.int16).numpy() if dtype == "bfloat16" else t_pool.numpy()
    assert np.array_equal(_bits(got), _bits(want_pool))
    assert torch.equal(buf[:, row:].view(torch.int16), padding.view(torch.int16))


def test_torch_bfloat16_pool_view_follows_the_tensor():
    """kda.torch keeps one ml_dtypes view per bfloat16 pool tensor: a tensor given new storage
    (``set_``) or a new shape is read anew, and the view goes with the tensor."""
    if "cpu" not in BACKENDS:
        pytest.skip("no cpu backend")
    if ml_dtypes is None:
        pytest.skip("needs ml_dtypes (a bfloat16 pool's NumPy view)")
    import kda.torch as kt
    from kda._torch import convert

    rng = np.random.default_rng(25)
    x = _inputs(rng, 2, 1, 1, 4, 6)
    tq, tk, tv, tg, tb = (torch.from_numpy(np.ascontiguousarray(np.swapaxes(a, 1, 2))) for a in x)
    t_pool = torch.zeros((4, 1, 4, 6), dtype=torch.bfloat16)
    for fill in (0.5, -0.25):
        dense = _pool(rng, 4, 1, 4, 6, "bfloat16", False, poison=False) * fill
        t_pool.set_(torch.from_numpy(dense.view(np.int16).copy()).view(torch.bfloat16))
        want = kda.decode_kda(*x, dense, [1, 3])
        with torch.inference_mode():
            kw = dict(initial_state=t_pool, inplace_final_state=True, ssm_state_indices=torch.tensor([1, 3]))
            o, final = kt.fused_recurrent_kda(tq, tk, tv, tg, tb, **kw)
        assert np.array_equal(o.numpy(), np.swapaxes(want, 1, 2))
        assert np.array_equal(_bits(t_pool.view(torch.int16).numpy()), _bits(dense))
    key = id(t_pool)
    assert key in convert.BF16_VIEWS and final is t_pool
    del t_pool, final, kw
    assert key not in convert.BF16_VIEWS
