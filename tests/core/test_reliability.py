"""Trust under real use: concurrent callers, backends that cannot run, non-finite input, divergence."""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
from helpers import HAS_GPU, ROOT, make_problem

import kda
from kda._options import checks as _checks


def _python(code: str, env_drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter at the repository root (without ``env_drop`` variables)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


# ---------------------------------------------------------------- threads and the BLAS pin


def _blas_threads() -> list[tuple[str, int]]:
    """The thread counts of the BLAS libraries whose count is process-wide: all but MKL, whose
    count is each thread's own (``test_mkl_is_pinned_on_each_thread_that_runs_kda``)."""
    from threadpoolctl import threadpool_info

    infos = [i for i in threadpool_info() if i["user_api"] == "blas" and i["internal_api"] != "mkl"]
    return sorted((i["filepath"], i["num_threads"]) for i in infos)


@pytest.fixture
def blas_at_two():
    """BLAS at 2 threads for the test (then as before), with no thread left in control of OpenBLAS.

    (threadpoolctl >= 3.8 lets only the thread that last changed OpenBLAS's pool change it again,
    silently; a test that pinned from this thread would stop the calls under test from pinning.)
    """
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from kda.reference._scheduling import _no_controlling_thread

    try:  # SciPy's BLAS (the cpu backend's np.dot) loaded first, so the libraries do not change
        import scipy.linalg.cython_blas  # noqa: F401
    except ImportError:
        pass
    with _no_controlling_thread():
        limiter = threadpoolctl.ThreadpoolController().limit(limits=2, user_api="blas")
    yield _blas_threads()
    with _no_controlling_thread():
        limiter.restore_original_limits()


def test_blas_pin_restores_only_after_the_last_holder(blas_at_two):
    """Holders in two threads (A in, B in, A out, B out): BLAS at 1 until B leaves, then as found."""
    from kda.reference._scheduling import BlasPin

    pin = BlasPin()
    a, b = pin.hold(), pin.hold()
    a.__enter__()
    thread = threading.Thread(target=b.__enter__)
    thread.start()
    thread.join()
    assert all(n == 1 for _, n in _blas_threads())
    a.__exit__(None, None, None)
    assert all(n == 1 for _, n in _blas_threads()), "the first holder to leave restored the setting"
    assert pin.holders == 1
    thread = threading.Thread(target=b.__exit__, args=(None, None, None))
    thread.start()
    thread.join()
    assert _blas_threads() == blas_at_two
    assert pin.holders == 0


def _call(p, chunk_size: int = 16) -> list[np.ndarray]:
    out = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, chunk_size=chunk_size, save_boundaries=True)
    grads = kda.chunk_kda_backward(
        *p.inputs,
        None,
        p.grad_output,
        p.grad_final_state,
        initial_state=p.initial_state,
        chunk_size=chunk_size,
    )
    return [np.asarray(x) for x in (*out, *grads)]


def test_overlapping_calls_pin_blas_and_restore_it_after_the_last_one(monkeypatch, blas_at_two):
    """Call A enters, call B enters (each in its own thread), A leaves, B leaves.

    Inside, BLAS runs one thread; after, it is as found. (A per-call pin fails this: B records
    the 1 that A set, and restores it last.)
    """
    import kda.reference

    monkeypatch.setattr(kda.reference, "workers", lambda xp, heads: min(heads, 2))
    chunks = {"A": 5, "B": 6}
    inside = {n: threading.Event() for n in chunks}
    release = {n: threading.Event() for n in chunks}
    state_pass = kda.reference.chunk_state_pass

    def held(w, *args):  # each call waits inside the pin until it is released
        name = next(n for n, c in chunks.items() if c == w.shape[2])
        inside[name].set()
        assert release[name].wait(60)
        return state_pass(w, *args)

    monkeypatch.setattr(kda.reference, "chunk_state_pass", held)
    threads = {}
    try:
        for seed, (name, n) in enumerate(chunks.items()):
            p = make_problem(seed, 1, 2, 16 * n, 4, 3).astype(np.float32)
            kwargs = {"chunk_size": 16, "backend": "reference"}  # the reference: its pin
            threads[name] = threading.Thread(target=kda.chunk_kda, args=p.inputs, kwargs=kwargs)
            threads[name].start()
            assert inside[name].wait(60)
        inside_both = _blas_threads()
    finally:
        for name in chunks:  # A leaves first, B last
            release[name].set()
            if name in threads:
                threads[name].join()
    assert all(n == 1 for _, n in inside_both), "BLAS is not single-threaded inside the calls"
    assert _blas_threads() == blas_at_two


def _mkl_library():
    """MKL's runtime loaded into this process (as the cpu backend's MKL product path loads it),
    the pin rescanned; a skip where MKL is not installed."""
    import ctypes

    pytest.importorskip("numba")
    from kda._threads import PIN
    from kda.cpu._products import _mkl

    found = _mkl()
    if isinstance(found, str):
        pytest.skip(f"MKL: {found}")
    lib = ctypes.CDLL(found[0].library)
    lib.MKL_Get_Max_Threads.restype = ctypes.c_int
    PIN.rescan()
    return lib


def test_mkl_is_pinned_on_each_thread_that_runs_kda(monkeypatch):
    """MKL's thread count is each thread's own. Holders A (this thread) and B (another) overlap
    (A in, B in, A out, B out): each runs MKL on one thread inside, and each thread has its
    own setting back after; the cpu backend's pool threads run MKL on one thread in every range
    and are left as they were. (A process-wide pin, set by A's thread and restored by B's,
    leaves A's thread at 1 and B's unpinned: the first checks fail.)"""
    import kda.cpu
    from kda._threads import BlasPin

    lib = _mkl_library()
    pin = BlasPin()
    default = lib.MKL_Get_Max_Threads()
    seen: dict[str, int] = {}
    b_inside, a_out = threading.Event(), threading.Event()

    def holder_b():
        with pin.hold():
            seen["B in"] = lib.MKL_Get_Max_Threads()
            b_inside.set()
            assert a_out.wait(60)
            seen["B in, A out"] = lib.MKL_Get_Max_Threads()
        seen["B out"] = lib.MKL_Get_Max_Threads()

    with pin.hold():
        seen["A in"] = lib.MKL_Get_Max_Threads()
        thread = threading.Thread(target=holder_b)
        thread.start()
        assert b_inside.wait(60)
    seen["A out"] = lib.MKL_Get_Max_Threads()
    a_out.set()
    thread.join()
    assert seen == {"A in": 1, "B in": 1, "A out": default, "B in, A out": 1, "B out": default}

    ranges: list[int] = []

    def probe(*args):  # a kernel: its last two arguments are its range lo, hi
        ranges.append(lib.MKL_Get_Max_Threads())

    monkeypatch.setattr(kda.cpu, "threads", lambda: 2)
    big = np.zeros(kda.cpu.INLINE_ELEMENTS)
    kda.cpu._run(probe, 8, big, outputs=())
    pool = kda.cpu._pool.pool(2)
    after = [pool.submit(lib.MKL_Get_Max_Threads).result() for _ in range(8)]
    assert ranges == [1] * 8
    assert set(after) == {default}


def test_concurrent_calls_are_bitwise_serial_and_leave_blas_as_found(monkeypatch, blas_at_two):
    """4 threads x 4 calls at once: each result bitwise equal to its serial call; BLAS threads unchanged."""
    import kda.reference

    # groups on any machine
    monkeypatch.setattr(kda.reference, "workers", lambda xp, heads: min(heads, 2))
    # sizes differ, so that the threads' calls enter and leave at staggered times
    problems = [make_problem(50 + i, 1, 3, 40 + 30 * i, 12, 9, "mild").astype(np.float32) for i in range(4)]
    serial = [_call(p) for p in problems]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(problems))

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = [_call(problems[i]) for _ in range(4)]
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert _blas_threads() == blas_at_two
    for i, want in enumerate(serial):
        for got in results[i]:
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- backends that cannot run here

_CUDA_CALL = """
import numpy as np, kda
x = np.zeros((1, 1, 4, 2), np.float32)
try:
    kda.chunk_kda(x, x, x, x, np.zeros((1, 1, 4), np.float32), backend="cuda")
except kda.KdaError as err:
    print("KdaError:", err)
"""


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the driver path does not fail")
def test_cuda_without_a_driver_is_a_kda_error():
    """No simulator and no driver: Numba's CudaSupportError becomes a KdaError naming the driver."""
    pytest.importorskip("numba.cuda")
    run = _python(_CUDA_CALL, env_drop=("NUMBA_ENABLE_CUDASIM",))
    assert run.returncode == 0, run.stderr
    assert "KdaError: backend 'cuda' cannot run here: no usable CUDA GPU" in run.stdout
    assert "driver" in run.stdout and "backend='reference'" in run.stdout


def test_cuda_without_numba_is_a_kda_error():
    run = _python("import sys; sys.modules['numba'] = None\n" + _CUDA_CALL)
    assert run.returncode == 0, run.stderr
    assert "numba-cuda is not installed" in run.stdout and "pip install kda[cuda]" in run.stdout


def test_cuda_without_nvvm_names_it(monkeypatch):
    """A driver but no libNVVM (the kernels' compiler): the reason names NVVM and how to install it."""
    nvvm = pytest.importorskip("numba.cuda.cudadrv.nvvm")
    from kda._backend import cuda_probe

    def missing():  # as numba's NvvmSupportError, or whatever loading the library raises
        raise OSError("libNVVM cannot be found")

    monkeypatch.setattr(nvvm, "NVVM", missing)
    reason = cuda_probe._nvvm_problem()
    assert reason is not None and "libNVVM cannot be loaded (libNVVM cannot be found)" in reason
    assert "pip install" in reason


def test_import_kda_imports_neither_numba_nor_cupy():
    code = (
        "import sys, numpy as np, kda\n"
        "assert 'numba' not in sys.modules\n"
        "x = np.zeros((1, 2, 5, 3), np.float32)\n"
        "kda.chunk_kda(x, x, x, x, np.zeros((1, 2, 5), np.float32), backend='reference')\n"
        "print(sorted(m for m in ('numba', 'cupy', 'torch', 'jax', 'dask') if m in sys.modules))\n"
    )
    run = _python(code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_python_m_kda_fails_on_a_broken_primitive(monkeypatch, capsys):
    """The self-check exits non-zero when the chunked result is wrong (here: a state pass off by 1e-3)."""
    import kda.__main__ as cli
    import kda.reference

    good = kda.reference.chunk_state_pass

    def broken(*args):
        passed = good(*args)
        return passed._replace(final_state=passed.final_state * (1 + 1e-3))

    argv = ["--H", "1", "--T", "96", "--K", "8", "--V", "8", "--chunk-size", "32"]
    assert cli.main(argv) == 0
    monkeypatch.setattr(kda.reference, "chunk_state_pass", broken)
    assert cli.main(argv) == 1
    assert "FAIL" in capsys.readouterr().out


# ---------------------------------------------------------------- check_finite and warn_if_diverged


def test_check_finite_names_the_first_bad_element():
    x = np.zeros((2, 3, 4), np.float32)
    x[1, 2, 3] = np.nan
    x[1, 0, 1] = -np.inf
    with pytest.raises(
        kda.InvalidInputError,
        match=r"v must be finite; got 2 non-finite elements, "
        r"the first -inf at index \(1, 0, 1\)",
    ):
        _checks.check_finite(np, "v", x)
    y = np.zeros(5)
    y[3] = -np.inf
    _checks.check_finite(np, "g", y, allow_neg_inf=True)
    y[4] = np.inf
    with pytest.raises(
        kda.InvalidInputError, match=r"g must be finite or -inf .* the first inf at index \(4,\)"
    ):
        _checks.check_finite(np, "g", y, allow_neg_inf=True)


def test_check_finite_passes_finite_values_whose_sum_overflows():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _checks.check_finite(np, "v", np.full(8, 3e38, np.float32))
        _checks.check_finite(np, "v", np.full(8, 6e4, np.float16))


@pytest.mark.parametrize("library", ["array_api_strict", "torch"])
def test_check_finite_other_namespaces(library):
    mod = pytest.importorskip(library)
    from array_api_compat import array_namespace

    x = np.ones((3, 4), np.float32)
    x[2, 1] = np.nan
    arr = mod.asarray(x) if library == "array_api_strict" else mod.from_numpy(x)
    with pytest.raises(
        kda.InvalidInputError,
        match=r"q must be finite; got 1 non-finite element, "
        r"the first nan at index \(2, 1\)",
    ):
        _checks.check_finite(array_namespace(arr), "q", arr)


def test_warn_if_diverged_warns_once():
    ok, bad = np.ones(3), np.array([1.0, np.inf, np.nan])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not _checks.warn_if_diverged(np, ok, None)
        assert _checks.warn_if_diverged(np, bad, ok, bad)
    assert len(caught) == 1 and caught[0].category is kda.KdaWarning
    assert issubclass(kda.KdaWarning, RuntimeWarning)
    assert "beta * |k|^2 <= 2" in str(caught[0].message) and "qk_l2norm=True" in str(caught[0].message)


# ---------------------------------------------------------------- the public functions, check_finite=True


def _small():
    return make_problem(3, 1, 2, 20, 4, 3, "mild").astype(np.float32)


def _arguments(p, function: str) -> dict:
    """Every array argument of ``function`` on problem ``p`` (keywords where the function takes them)."""
    args = {"q": p.q, "k": p.k, "v": p.v, "g": p.g, "beta": p.beta}
    if function == "chunk_kda_backward":
        out = kda.chunk_kda(*p.inputs, initial_state=p.initial_state, chunk_size=8, save_boundaries=True)
        args["boundaries"] = out.boundaries
    if function.endswith("backward"):
        args |= {"grad_output": p.grad_output, "grad_final_state": p.grad_final_state}
    return args


def _run(function: str, args: dict, p, **options):
    kwargs = {"initial_state": p.initial_state, **options}
    if function.startswith("chunk"):
        kwargs["chunk_size"] = 8
    return getattr(kda, function)(*args.values(), **kwargs)


FUNCTIONS = ["chunk_kda", "recurrent_kda", "chunk_kda_backward", "recurrent_kda_backward"]
CASES = [
    (f, name, value)
    for f in FUNCTIONS
    for name in ("q", "k", "v", "beta", "initial_state", "boundaries", "grad_output", "grad_final_state")
    for value in (np.nan, np.inf, -np.inf)
    if (name != "boundaries" or f == "chunk_kda_backward")
    and (not name.startswith("grad") or f.endswith("backward"))
]


@pytest.mark.parametrize(("function", "name", "value"), CASES)
def test_non_finite_input_is_refused(function, name, value):
    """check_finite=True (the default): the message names the argument and the first bad index."""
    p = _small()
    args = _arguments(p, function)
    if name == "initial_state":
        p.initial_state = p.initial_state.copy()
        target = p.initial_state
    else:
        target = args[name] = args[name].copy()
    index = tuple(n - 1 for n in target.shape)  # the last element
    target[index] = value
    expected = f"{name} must be finite; got 1 non-finite element, the first {value} at index {index}"
    with pytest.raises(kda.InvalidInputError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        _run(function, args, p)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_log_gate_reset_is_legal_but_not_in_other_gates(function):
    p = _small()
    args = _arguments(p, function)
    args["g"] = args["g"].copy()
    args["g"][0, 1, 5, 2] = -np.inf
    _run(function, args, p)  # a hard reset
    with pytest.raises(kda.InvalidInputError, match=r"g must be finite; .* at index \(0, 1, 5, 2\)"):
        _run(function, args, p, gate="softplus", A_log=np.zeros(2, np.float32))


@pytest.mark.parametrize("function", FUNCTIONS)
def test_check_finite_false_skips_the_checks(function):
    p = _small()
    args = _arguments(p, function)
    args["v"] = args["v"].copy()
    args["v"][0, 0, 3, 1] = np.nan
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _run(function, args, p, check_finite=False)
    assert caught == []
    assert np.isnan(np.asarray(result[0])).any()


def _diverging():
    """Unnormalised keys (|k|^2 = 9 * K) with beta = 1.9: beta |k|^2 >> 2, float32 overflows."""
    p = make_problem(4, 1, 2, 96, 4, 3, "zero").astype(np.float32)
    p.k = (p.k * 3).astype(np.float32)
    p.beta = np.full_like(p.beta, 1.9)
    return p


@pytest.mark.parametrize("function", FUNCTIONS)
def test_divergence_warns_once_naming_the_cause(function):
    """Finite inputs, non-finite results: one KdaWarning at the caller's line, no NumPy warning."""
    p = _diverging()
    args = _arguments(p, function.replace("chunk_kda_backward", "recurrent_kda_backward"))
    if function == "chunk_kda_backward":  # saved boundaries would be non-finite input: recompute them
        args = {**dict(list(args.items())[:5]), "boundaries": None, **dict(list(args.items())[5:])}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(function, args, p)
    assert [w.category for w in caught] == [kda.KdaWarning], [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "beta * |k|^2 <= 2" in message and "qk_l2norm=True" in message
    assert caught[0].filename == __file__


def test_qk_l2norm_cures_the_divergence():
    p = _diverging()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = kda.chunk_kda(*p.inputs, qk_l2norm=True, chunk_size=8)
    assert np.isfinite(out.output).all()
