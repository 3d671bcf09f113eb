"""The Numba-CUDA backend (``kda.cuda``) against the float64 reference.

Without a GPU the kernels run under Numba's CUDA simulator on NumPy arrays (tiny shapes: the
simulator costs ~0.2 ms per thread); with one (``/dev/nvidiactl``) they run on CuPy arrays.
tests/conftest.py switches the simulator on (before numba is first imported) where helpers.HAS_GPU
is False.
Every kernel runs here with the block shape it has on a GPU (the shapes of the data shrink, the
blocks do not). tests/backends/test_ptx.py compiles every kernel for compute capability 9.0.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from helpers import HAS_GPU

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (pip install kda[cuda])")

from hypothesis import given, settings
from hypothesis import strategies as st

import kda
import kda.reference as ref
import kda.testing as kt

kc = pytest.importorskip("kda.cuda")
from kda.cuda._launch import COPIES, LAUNCHES  # noqa: E402

if HAS_GPU:
    cupy = pytest.importorskip("cupy", reason="a GPU is present but CuPy is not installed")
    xp_dev = cupy
else:
    xp_dev = np

pytestmark = [
    pytest.mark.cuda,
    # on a real GPU, Numba warns about every grid under 128 blocks: the tests' grids are tiny
    pytest.mark.filterwarnings("ignore:Grid size .* will likely result in GPU under-utilization"),
]

TOL = {np.float32: 1e-5, np.float64: 1e-10}
# worst relative error seen per (check, regime, dtype), printed at the end of the module
WORST: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _fast_simulator_barriers():
    """The simulator's syncthreads is ~4x cheaper with a short thread switch interval."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(old)
    if WORST:
        print("\nkda.cuda worst relative errors:")
        for key in sorted(WORST):
            print(f"  {key}: {WORST[key]:.2e}")


def to_dev(x):
    return xp_dev.asarray(x)


def to_np(x):
    if HAS_GPU and isinstance(x, cupy.ndarray):
        return cupy.asnumpy(x)
    return np.asarray(x)


def rel_err(got, want) -> float:
    got = to_np(got).astype(np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    assert np.all(np.isfinite(got))
    scale = np.max(np.abs(want)) if want.size else 0.0
    err = np.max(np.abs(got - want)) if want.size else 0.0
    return float(err / scale) if scale > 0 else float(err)


def check(name, got, want, dtype, regime="-"):
    err = rel_err(got, want)
    key = (name, regime, np.dtype(dtype).name)
    WORST[key] = max(WORST.get(key, 0.0), err)
    assert err <= TOL[dtype], f"{name} ({regime}, {np.dtype(dtype).name}): relative error {err:.2e}"


def problem(rng, B, H, T, K, V, regime):
    """float64 inputs of one KDA problem (keys L2-normalised per step, as in KDA models)."""
    q = rng.standard_normal((B, H, T, K))
    k = rng.standard_normal((B, H, T, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, H, T, V))
    g = kt.gates(rng, (B, H, T, K), regime)
    beta = rng.uniform(0.0, 1.0, (B, H, T))
    state = rng.standard_normal((B, H, K, V))
    do = rng.standard_normal((B, H, T, V))
    dstate = rng.standard_normal((B, H, K, V))
    return q, k, v, g, beta, state, do, dstate


def run_chunked(arrays, dtype, chunk_size):
    """Forward and backward of ``chunk_kda`` with ``backend="cuda"`` in ``dtype``."""
    q, k, v, g, beta, state, do, dstate = (to_dev(x.astype(dtype)) for x in arrays)
    out = kda.chunk_kda(
        q, k, v, g, beta, initial_state=state, chunk_size=chunk_size, save_boundaries=True, backend="cuda"
    )
    grads = kda.chunk_kda_backward(
        q,
        k,
        v,
        g,
        beta,
        out.boundaries,
        do,
        dstate,
        initial_state=state,
        chunk_size=chunk_size,
        backend="cuda",
    )
    return out, grads


def oracle(arrays):
    """The float64 reference recurrence and its backward."""
    q, k, v, g, beta, state, do, dstate = arrays
    out = kda.recurrent_kda(q, k, v, g, beta, initial_state=state, backend="reference")
    grads = kda.recurrent_kda_backward(q, k, v, g, beta, do, dstate, initial_state=state, backend="reference")
    return out, grads


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dstate")


def check_all(prefix, got_out, got_grads, want_out, want_grads, dtype, regime):
    """:func:`check` the output, the final state and every gradient."""
    check(f"{prefix} output", got_out.output, want_out.output, dtype, regime)
    check(f"{prefix} final_state", got_out.final_state, want_out.final_state, dtype, regime)
    for name, got, want in zip(GRAD_NAMES, got_grads, want_grads):
        check(f"{prefix} {name}", got, want, dtype, regime)


# ---------------------------------------------------------------- the public functions


def test_exports():
    """The cuda backend provides every name of the interface (kda._backend.Backend)."""
    from kda._backend import Backend

    assert kc.NAME == "cuda"
    for name in (*Backend.__annotations__, *(n for n in vars(Backend) if not n.startswith("_"))):
        assert hasattr(kc, name), name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("regime", kt.LOG_REGIMES)
def test_regimes(regime, dtype):
    """Chunked and recurrent forward and backward in every gate regime (T spans 3 chunks)."""
    rng = np.random.default_rng(kt.LOG_REGIMES.index(regime))
    arrays = problem(rng, 1, 2, 19, 8, 8, regime)
    want_out, want_grads = oracle(arrays)
    out, grads = run_chunked(arrays, dtype, 7)
    check_all("chunk", out, grads, want_out, want_grads, dtype, regime)
    q, k, v, g, beta, state, do, dstate = (to_dev(x.astype(dtype)) for x in arrays)
    rout = kda.recurrent_kda(q, k, v, g, beta, initial_state=state, backend="cuda")
    rgrads = kda.recurrent_kda_backward(q, k, v, g, beta, do, dstate, initial_state=state, backend="cuda")
    check_all("recurrent", rout, rgrads, want_out, want_grads, dtype, regime)


shapes = st.tuples(
    st.integers(1, 2),  # B
    st.integers(1, 2),  # H
    st.integers(1, 20),  # T
    st.integers(1, 8),  # K
    st.integers(1, 8),  # V
)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    shape=shapes,
    chunk_size=st.integers(1, 8),
    regime=st.sampled_from(kt.LOG_REGIMES),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_chunked_property(shape, chunk_size, regime, dtype, seed):
    """Any sizes, at most three chunks (the simulator pays for every block's threads)."""
    arrays = problem(np.random.default_rng(seed), *shape, regime)
    want_out, want_grads = oracle(arrays)
    chunk_size = max(chunk_size, -(-shape[2] // 3))
    out, grads = run_chunked(arrays, dtype, chunk_size)
    check_all("chunk", out, grads, want_out, want_grads, dtype, regime)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    shape=shapes,
    regime=st.sampled_from(kt.LOG_REGIMES),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_recurrent_property(shape, regime, dtype, seed):
    arrays = problem(np.random.default_rng(seed), *shape, regime)
    want_out, want_grads = oracle(arrays)
    q, k, v, g, beta, state, do, dstate = (to_dev(x.astype(dtype)) for x in arrays)
    out = kda.recurrent_kda(q, k, v, g, beta, initial_state=state, backend="cuda")
    grads = kda.recurrent_kda_backward(q, k, v, g, beta, do, dstate, initial_state=state, backend="cuda")
    check_all("recurrent", out, grads, want_out, want_grads, dtype, regime)


@pytest.mark.parametrize(("chunk_size", "regime"), [(16, "strong"), (33, "reset")])
def test_long_chunks(chunk_size, regime):
    """Padded chunks of 16 and 64 steps: four and six halving levels."""
    arrays = problem(np.random.default_rng(chunk_size), 1, 1, 40, 3, 2, regime)
    want_out, want_grads = oracle(arrays)
    for dtype in (np.float32, np.float64):
        out, grads = run_chunked(arrays, dtype, chunk_size)
        check_all("chunk", out, grads, want_out, want_grads, dtype, regime)


def test_empty_sequence():
    arrays = problem(np.random.default_rng(0), 1, 2, 0, 3, 4, "mild")
    want_out, want_grads = oracle(arrays)
    for dtype in (np.float32, np.float64):
        out, grads = run_chunked(arrays, dtype, 4)
        check_all("chunk", out, grads, want_out, want_grads, dtype, "T=0")


def test_launches_do_not_grow_with_length(monkeypatch):
    """A fixed number of kernels per call (2 and 5 chunks), and no glue: no array product, no copy.

    The cuda backend asks for one slab at any size (``kda.cuda.SLAB_ELEMENTS``), so these are
    the counts of a whole call: forward 2 (the state-free work, the state pass with the output);
    backward 3 (the state-free work again, the state-gradient pass, the state-free gradients),
    5 without saved boundaries (the forward's two first, for the states alone).
    """
    import array_api_compat.numpy as compat_np

    def no_products(*args, **kwargs):
        raise AssertionError("the cuda path forms an array product outside its kernels")

    monkeypatch.setattr(compat_np, "matmul", no_products)
    monkeypatch.setattr(np, "matmul", no_products)
    counts = []
    COPIES.clear()
    for T in (4, 9):
        arrays = problem(np.random.default_rng(T), 1, 1, T, 2, 2, "mild")
        q, k, v, g, beta, state, do, dstate = (to_dev(x.astype(np.float32)) for x in arrays)
        calls = {}
        LAUNCHES.clear()
        out = kda.chunk_kda(
            q, k, v, g, beta, initial_state=state, chunk_size=2, save_boundaries=True, backend="cuda"
        )
        calls["forward"] = dict(LAUNCHES)
        for name, b in (("backward", out.boundaries), ("backward without boundaries", None)):
            LAUNCHES.clear()
            kda.chunk_kda_backward(
                q, k, v, g, beta, b, do, dstate, initial_state=state, chunk_size=2, backend="cuda"
            )
            calls[name] = dict(LAUNCHES)
        LAUNCHES.clear()
        kda.recurrent_kda(q, k, v, g, beta, initial_state=state, backend="cuda")
        kda.recurrent_kda_backward(q, k, v, g, beta, do, dstate, initial_state=state, backend="cuda")
        calls["recurrent"] = dict(LAUNCHES)
        counts.append(calls)
    assert counts[0] == counts[1]
    assert counts[0]["forward"] == {"chunk_local": 1, "chunk_state_pass_staged": 1}
    backward = {"chunk_local": 1, "chunk_state_grad_pass_staged": 1, "chunk_local_backward": 1}
    assert counts[0]["backward"] == backward
    totals = {name: sum(c.values()) for name, c in counts[0].items()}
    assert totals == {"forward": 2, "backward": 3, "backward without boundaries": 5, "recurrent": 2}
    assert not COPIES, f"operands copied to make them contiguous: {dict(COPIES)}"


@pytest.fixture
def compiled_calls(monkeypatch):
    """The ``(kernel, index type)`` of every kernel the launcher asks for, in order."""
    from kda.cuda._device import Kernel

    calls = []
    real = Kernel.compiled

    def spy(self, dtype, index="uint32"):
        calls.append((self.name, index))
        return real(self, dtype, index)

    monkeypatch.setattr(Kernel, "compiled", spy)
    return calls


def test_offsets_in_64_bits_when_sizes_need_them(compiled_calls, monkeypatch):
    """32-bit offsets wherever every array of a launch allows; the 64-bit kernels give the same bits.

    ``INDEX32_LIMIT`` is lowered so that this small problem takes the 64-bit variants of every
    kernel of a chunked and a recurrent forward and backward (and the gate check).
    """
    from kda.cuda import _device

    used = compiled_calls
    arrays = problem(np.random.default_rng(5), 1, 2, 9, 4, 3, "reset")

    def run_all():
        used.clear()
        out, grads = run_chunked(arrays, np.float32, 4)
        q, k, v, g, beta, state, do, dstate = (to_dev(x.astype(np.float32)) for x in arrays)
        rout = kda.recurrent_kda(q, k, v, g, beta, initial_state=state, backend="cuda")
        rgrads = kda.recurrent_kda_backward(q, k, v, g, beta, do, dstate, initial_state=state, backend="cuda")
        flags = kc.gate_flags(g)
        exact = [out.output, out.final_state, *grads[:6], rout.output, rout.final_state, flags]
        # the recurrent backward accumulates dq, dk, dg, dbeta with atomics: any order
        atomic = list(rgrads[:6])
        return [to_np(x) for x in exact], [to_np(x) for x in atomic], set(used)

    narrow, narrow_atomic, narrow_used = run_all()
    monkeypatch.setattr(_device, "INDEX32_LIMIT", 16)
    wide, wide_atomic, wide_used = run_all()
    assert {i for _, i in narrow_used} == {"uint32"}, narrow_used
    assert {i for _, i in wide_used} == {"uint64"}, wide_used
    names = {n for n, _ in narrow_used}
    assert (
        names
        == {n for n, _ in wide_used}
        == {
            "chunk_local",
            "chunk_state_pass_staged",
            "chunk_state_grad_pass_staged",
            "chunk_local_backward",
            "recurrent_forward",
            "recurrent_backward",
            "gate_flags",
        }
    )
    for i, (a, b) in enumerate(zip(narrow, wide, strict=True)):
        assert np.array_equal(a, b), (i, np.max(np.abs(a - b)))
    for a, b in zip(narrow_atomic, wide_atomic, strict=True):
        check("64-bit offsets, recurrent backward", a, b, np.float32)


def test_index_type_by_size():
    """The largest array or dimension of a launch decides: under 2**32 elements, 32-bit offsets."""
    from kda.cuda._launch import index_type

    class Sized:
        def __init__(self, size):
            self.size = size

    assert index_type([Sized(2**32 - 1), Sized(3)], (7, 9)) == "uint32"
    assert index_type([Sized(2**32), Sized(3)], (7,)) == "uint64"
    assert index_type([Sized(5)], (2**32,)) == "uint64"
    assert index_type([], ()) == "uint32"


# ---------------------------------------------------------------- each primitive


def chunked_inputs(rng, regime, B=2, H=1, NT=3, Cp=8, K=5):
    q = rng.standard_normal((B, H, NT, Cp, K))
    k = rng.standard_normal((B, H, NT, Cp, K)) / np.sqrt(K)
    g = kt.gates(rng, (B, H, NT, Cp, K), regime)
    return q, k, g


def both(dtype, *arrays):
    """The arrays in ``dtype``, for the reference (NumPy) and for the cuda backend."""
    host = [np.asarray(x, dtype=dtype) for x in arrays]
    return host, [to_dev(x) for x in host]


def check_primitive(name, got_ref, got_cuda, want, dtype, regime="-"):
    """Both backends against the same float64 oracle (the reference primitive in float64)."""
    check(f"reference {name}", got_ref, want, dtype, regime)
    check(f"cuda {name}", got_cuda, want, dtype, regime)


def test_chunk_local_with_64_bit_offsets(compiled_calls, monkeypatch):
    """The per-chunk kernels in their 64-bit variants."""
    from kda.cuda import _device

    monkeypatch.setattr(_device, "INDEX32_LIMIT", 16)
    from test_primitives import test_chunk_local_and_its_backward_by_dtype

    test_chunk_local_and_its_backward_by_dtype(kc, "reset", 8, np.float32)
    assert set(compiled_calls) == {(name, "uint64") for name in ("chunk_local", "chunk_local_backward")}


@pytest.mark.parametrize(("Cp", "K", "V"), [(32, 40, 20), (4, 33, 17)])
def test_chunk_local_backward_tiles(Cp, K, V):
    """chunk_local_backward's staged tiles: several, and partial, tiles of rows (16), channels (32)
    and terms (16) in its products over V and K, and rows of lanes over j, d and x for dbeta."""
    rng = np.random.default_rng(K + V)
    B, H, NT = 1, 1, (1 if Cp > 8 else 2)  # one block of 32 steps: the simulator is slow
    q = rng.standard_normal((B, H, NT, Cp, K))
    k = rng.standard_normal((B, H, NT, Cp, K)) / np.sqrt(K)
    g = kt.gates(rng, (B, H, NT, Cp, K), "kimi")
    v = rng.standard_normal((B, H, NT, Cp, V))
    beta = rng.uniform(0, 1, (B, H, NT, Cp))
    S, dS = (rng.standard_normal((NT, B, H, K, V)) for _ in range(2))
    u, du, do = (rng.standard_normal((B, H, NT, Cp, V)) for _ in range(3))
    scale = K**-0.5
    want = ref.chunk_local(q, k, v, g, beta, scale=scale)
    want_grads = ref.chunk_local_backward(
        q, k, v, g, beta, S, scale=scale, local=want, dends=dS, u=u, du=du, grad_output=do
    )
    _, dev = both(np.float64, q, k, v, g, beta, S, dS, u, du, do)
    steps, boundaries, passed = dev[:5], dev[5], dict(zip(("dends", "u", "du", "grad_output"), dev[6:]))
    got = kc.chunk_local(*steps, scale=scale)
    got_grads = kc.chunk_local_backward(*steps, boundaries, scale=scale, local=got, **passed)
    for name, a, w in zip(("dq", "dk", "dv", "dg", "dbeta"), got_grads, want_grads, strict=True):
        check(f"cuda chunk_local_backward.{name} (tiles)", a, w, np.float64, "kimi")


def test_chunks_longer_than_a_block_run_on_the_reference(monkeypatch):
    """Padded chunks over MAX_CHUNK steps: no cuda kernel runs, the reference backend does, and
    the results match the recurrence; the kernels refuse such chunks themselves."""
    from kda._backend import resolve

    assert resolve(kc, kc.MAX_CHUNK) is kc
    assert resolve(kc, 2 * kc.MAX_CHUNK) is ref
    arrays = problem(np.random.default_rng(11), 1, 1, 150, 3, 2, "mild")
    want_out, want_grads = oracle(arrays)
    kc._launch.LAUNCHES.clear()
    out, grads = run_chunked(arrays, np.float64, kc.MAX_CHUNK + 1)
    check_all("chunk", out, grads, want_out, want_grads, np.float64, "mild")
    assert not any(name.startswith("chunk_") for name in kc._launch.LAUNCHES)
    q = np.zeros((1, 1, 1, 2 * kc.MAX_CHUNK, 3))
    with pytest.raises(ValueError, match="at most 64 steps"):
        kc.chunk_local(q, q, q[..., :2], q, q[..., 0], scale=1.0)


def test_gate_flags():
    """Invalid log decays are counted on the device; only raise_for_gates reads the counts."""
    g = np.zeros((2, 3, 50, 7))
    g[0, 1, 3, 2] = 1e-3
    g[1, 2, 49, 6] = np.inf
    g[1, 0, 0, 0] = np.nan
    g[0, 0, 5, :] = -np.inf  # valid: hard resets
    for dtype in ("float16", "float32", "float64"):
        flags = kc.gate_flags(to_dev(g.astype(dtype)))
        assert [int(x) for x in flags] == [2, 1]
        with pytest.raises(kda.InvalidInputError, match="got 2 positive and 1 NaN elements"):
            kc.raise_for_gates(flags)
    ok = kc.gate_flags(to_dev(np.array([[0.0, -0.0], [-1e4, -np.inf]], np.float32)))
    assert [int(x) for x in ok] == [0, 0]
    kc.raise_for_gates(ok)


STATE_CASES = [
    # (Cp, K, V, shared limit): the production block (16 columns x 16 row threads) with rows and
    # columns left idle; 128 steps (two row groups per thread) and K > 16 (two rows of S per
    # thread); a small shared-memory limit that narrows the tiles to 4 columns (64 row threads)
    # in the state pass and 2 (128 row threads) in the gradient pass, so that V = 5 spans two
    # and three tiles, the last partly idle
    (8, 7, 5, None),
    (128, 20, 3, None),
    (8, 7, 5, 4 * 23 * 4),
]
STATE_PARAMS = [
    pytest.param(*case, dtype, id=f"{case[0]}-{case[1]}-{case[2]}-{case[3]}-{np.dtype(dtype).name}")
    for case in STATE_CASES
    for dtype in ((np.float32,) if case[0] > 8 else (np.float32, np.float64))  # 128 steps: slow
]


@pytest.mark.parametrize("variant", ["staged", "broadcast"])
@pytest.mark.parametrize(("Cp", "K", "V", "limit", "dtype"), STATE_PARAMS)
def test_state_passes(Cp, K, V, limit, dtype, variant, monkeypatch):
    """Both state passes, with the fused output and local gradient terms, in the real block shape.

    ``variant``: the forward pass's two cuts (a small shared-memory limit runs the broadcast one).
    """
    monkeypatch.setattr(kc.state_pass, "STATE_PASS", variant)
    if limit is not None:
        monkeypatch.setattr(kc.state_pass, "SHARED_LIMIT", limit * np.dtype(dtype).itemsize // 4)
        size = np.dtype(dtype).itemsize
        assert kc.state_pass._state_block("", K, Cp, size, K + 2 * Cp)[0] == (4, 64)
        assert kc.state_pass._state_block("", K, Cp, size, 2 * K + 2 * Cp)[0] == (2, 128)
    rng = np.random.default_rng(2)
    B, H, NT = (2, 1, 3) if Cp <= 8 else (1, 1, 2)
    w, kt, qg = (rng.standard_normal((B, H, NT, Cp, K)) * 0.3 for _ in range(3))
    u0, do = (rng.standard_normal((B, H, NT, Cp, V)) for _ in range(2))
    A = rng.standard_normal((B, H, NT, Cp, Cp)) * 0.3  # full: only the lower triangle may be read
    total = rng.uniform(0, 1, (B, H, NT, K))
    state, dstate = (rng.standard_normal((B, H, K, V)) for _ in range(2))
    want = ref.chunk_state_pass(w, u0, kt, total, state, qg, A)
    host, dev = both(dtype, w, u0, kt, total, state, qg, A)
    LAUNCHES.clear()
    got_r, got_c = ref.chunk_state_pass(*host), kc.chunk_state_pass(*dev)
    ran = "chunk_state_pass_staged" if variant == "staged" and limit is None else "chunk_state_pass"
    assert dict(LAUNCHES) == {ran: 1}
    for name, r, c, x in zip(("boundaries", "output", "final"), got_r, got_c, want):
        check_primitive(f"chunk_state_pass.{name}", r, c, x, dtype)
    alone = kc.chunk_state_pass(*dev[:5])
    assert alone[1] is None
    check("cuda chunk_state_pass.boundaries alone", alone[0], want[0], dtype)
    args = (w, u0, kt, total, qg, A, do, want[0], dstate)
    want = ref.chunk_state_grad_pass(*args)
    host, dev = both(dtype, *args)
    LAUNCHES.clear()
    got_r, got_c = ref.chunk_state_grad_pass(*host), kc.chunk_state_grad_pass(*dev)
    ran = "chunk_state_grad_pass_staged" if variant == "staged" and limit is None else "chunk_state_grad_pass"
    assert dict(LAUNCHES) == {ran: 1}
    for name, r, c, x in zip(("dends", "u", "du", "dinitial"), got_r, got_c, want):
        check_primitive(f"chunk_state_grad_pass.{name}", r, c, x, dtype)


@pytest.mark.parametrize(
    ("Cp", "K", "V", "dtype"),
    [
        (8, 7, 5, np.float64),  # one partial slice of channels, one partial tile of columns
        (16, 18, 21, np.float32),  # two slices (the second partial), two tiles (the second partial)
        (64, 33, 16, np.float32),  # the default chunk's block: 128 threads, rows on whole warps
        (1, 3, 2, np.float32),
    ],
)
def test_staged_state_pass(Cp, K, V, dtype, monkeypatch):
    """The re-cut state passes (rows on the lanes, staged tiles) against the reference."""
    monkeypatch.setattr(kc.state_pass, "STATE_PASS", "staged")
    rng = np.random.default_rng(Cp + K)
    B, H, NT = 1, 2, 3
    w, kt, qg = (rng.standard_normal((B, H, NT, Cp, K)) * 0.3 for _ in range(3))
    u0 = rng.standard_normal((B, H, NT, Cp, V))
    A = rng.standard_normal((B, H, NT, Cp, Cp)) * 0.3  # full: only the lower triangle may be read
    total = rng.uniform(0, 1, (B, H, NT, K))
    state = rng.standard_normal((B, H, K, V))
    want = ref.chunk_state_pass(w, u0, kt, total, state, qg, A)
    _, dev = both(dtype, w, u0, kt, total, state, qg, A)
    LAUNCHES.clear()
    got = kc.chunk_state_pass(*dev)
    alone = kc.chunk_state_pass(*dev[:5])
    assert dict(LAUNCHES) == {"chunk_state_pass_staged": 2}
    for name, c, x in zip(("boundaries", "output", "final"), got, want):
        check(f"cuda chunk_state_pass_staged.{name}", c, x, dtype)
    assert alone[1] is None
    check("cuda chunk_state_pass_staged.boundaries alone", alone[0], want[0], dtype)
    check("cuda chunk_state_pass_staged.final alone", alone[2], want[2], dtype)
    do, dstate = rng.standard_normal((B, H, NT, Cp, V)), rng.standard_normal((B, H, K, V))
    args = (w, u0, kt, total, qg, A, do, want[0], dstate)
    want = ref.chunk_state_grad_pass(*args)
    LAUNCHES.clear()
    got = kc.chunk_state_grad_pass(*both(dtype, *args)[1])
    assert dict(LAUNCHES) == {"chunk_state_grad_pass_staged": 1}
    for name, c, x in zip(("dends", "u", "du", "dinitial"), got, want):
        check(f"cuda chunk_state_grad_pass_staged.{name}", c, x, dtype)


def test_staged_state_pass_falls_back_and_runs_end_to_end(monkeypatch):
    """Where its tiles do not fit, the broadcast pass runs; a whole call with it matches the oracle."""
    monkeypatch.setattr(kc.state_pass, "STATE_PASS", "staged")
    kernel = kc.state_pass._state_kernel
    assert kernel(1, 1, 64, 128, 128, 4)[0].name == "chunk_state_pass_staged"
    assert kernel(1, 1, 1024, 128, 128, 4)[0].name == "chunk_state_pass"  # 2048 threads
    arrays = problem(np.random.default_rng(9), 1, 2, 19, 8, 20, "reset")
    LAUNCHES.clear()
    out, grads = run_chunked(arrays, np.float32, 7)
    assert LAUNCHES["chunk_state_pass_staged"] == 1 and "chunk_state_pass" not in LAUNCHES
    assert LAUNCHES["chunk_state_grad_pass_staged"] == 1 and "chunk_state_grad_pass" not in LAUNCHES
    check_all("chunk (staged state pass)", out, grads, *oracle(arrays), np.float32, "reset")
    monkeypatch.setattr(kc.state_pass, "SHARED_LIMIT", 4 * (8 * 16 + 2 * 8 * 17 + 2 * 16 * 9) - 1)
    LAUNCHES.clear()
    shapes = [(1, 1, 1, 8, 8)] * 3 + [(1, 1, 1, 8), (1, 1, 8, 8)]  # w, u0, kt, total, state
    kc.chunk_state_pass(*(to_dev(np.ones(s, np.float32)) for s in shapes))
    assert "chunk_state_pass_staged" not in LAUNCHES and LAUNCHES["chunk_state_pass"] == 1


def test_wrapper_errors():
    rng = np.random.default_rng(5)
    q, k, g = (to_dev(x.astype(np.float32)) for x in chunked_inputs(rng, "mild", Cp=4))
    v, beta = q[..., :2], q[..., 0]
    with pytest.raises(TypeError, match="float32 or float64"):
        half = to_dev(np.zeros((1, 1, 1, 4, 2), np.float16))
        kc.chunk_local(half, half, half, half, half[..., 0], scale=1.0)
    with pytest.raises(TypeError, match="share one dtype"):
        kc.chunk_local(q, k, v, g.astype(np.float64), beta, scale=1.0)
    with pytest.raises(ValueError, match="shape"):
        kc.chunk_local(q, k[..., :1], v, g, beta, scale=1.0)
    with pytest.raises(ValueError, match="power of two"):
        kc.chunk_local(q[..., :3, :], k[..., :3, :], v[..., :3, :], g[..., :3, :], beta[..., :3], scale=1.0)


# ---------------------------------------------------------------- CuPy arrays on a GPU


def _cupy_or_skip():
    cp = pytest.importorskip("cupy")
    try:
        cp.zeros(1)
    except Exception as err:  # no GPU, no driver: CuPy cannot make an array here
        pytest.skip(f"CuPy cannot create an array here: {type(err).__name__}")
    return cp


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_cupy_arrays_choose_cuda(dtype):
    cp = _cupy_or_skip()
    arrays = problem(np.random.default_rng(6), 2, 2, 37, 16, 8, "strong")
    want_out, want_grads = oracle([x.astype(dtype).astype(np.float64) for x in arrays])
    q, k, v, g, beta, _, do, _ = (cp.asarray(x.astype(dtype)) for x in arrays)
    sdtype = "float64" if dtype == "float64" else "float32"
    state, dstate = (cp.asarray(arrays[i].astype(dtype).astype(sdtype)) for i in (5, 7))
    out = kda.chunk_kda(q, k, v, g, beta, initial_state=state, chunk_size=16, save_boundaries=True)
    grads = kda.chunk_kda_backward(
        q, k, v, g, beta, out.boundaries, do, dstate, initial_state=state, chunk_size=16
    )
    assert isinstance(out.output, cp.ndarray) and out.output.dtype == cp.dtype(dtype)
    tol = {"float32": 1e-5, "float64": 1e-10, "float16": 2e-3}[dtype]
    for name, got, want in [
        ("output", out.output, want_out.output),
        ("final", out.final_state, want_out.final_state),
    ]:
        assert rel_err(cp.asnumpy(got), want) <= tol, name
    for name, got, want in zip(GRAD_NAMES, grads, want_grads):
        assert rel_err(cp.asnumpy(got), want) <= (tol if dtype != "float16" else 5e-3), name
