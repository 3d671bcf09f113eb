"""kda.testing: the strategy's coverage, check_kernel on kda's own kernels and on fla's naive chunk,
and eight deliberately broken kernels (tests/tools/broken_kernels.py) each caught with default settings."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest
from broken_kernels import BROKEN
from helpers import BACKENDS, fla_naive
from hypothesis import HealthCheck, given, settings

import kda
import kda.testing as kt


def test_import_kda_imports_neither_hypothesis_nor_torch():
    code = "import sys, kda; assert 'hypothesis' not in sys.modules and 'torch' not in sys.modules"
    code += "; import kda.testing; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ | {"PYTHONPATH": os.getcwd()})


def test_derandomised_draws_cover_every_regime_size_class_and_option():
    seen: set[str] = set()

    @settings(max_examples=300, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(kt.problems())
    def draw(p: kt.Problem) -> None:
        seen.update(p.features)

    draw()
    want = {f"regime={r}" for r in kt.REGIMES} | {f"size={c}" for c in kt.SIZE_CLASSES}
    want |= {f"dtype={d}" for d in kt.DTYPES} | {"gate=log", "gate=softplus", "gate=lower_bound"}
    want |= {"gva", "qk_l2norm", "initial_state", "scale", "packed", "packed: empty sequence"}
    want |= {"packed: length-1 sequence", "layout=time_major", "beta=sigmoid", "beta=sigmoid2"}
    assert want <= seen, sorted(want - seen)


@settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(kt.problems(T_multiple_of=4, T=(4, 40), K=(2, 6), regimes=("mild", "reset"), dtypes=("float64",)))
def test_problems_narrow(p):
    assert p.dtype == "float64" and p.T % 4 == 0 and 2 <= p.K <= 6 and p.regime in ("mild", "reset")
    assert all(n % 4 == 0 for n in p.lengths)
    assert p.arrays["g"].shape == (p.B, p.HV, p.T, p.K)


def test_reference_boundaries_match_the_chunked_form():
    p = kt.Problem(seed=3, dtype="float64", B=1, H=2, G=2, T=37, K=4, V=3, cu_seqlens=(0, 0, 1, 20, 37),
                   gate="softplus", A_log=True, dt_bias=True, regime="mixed", chunk_size=8)  # fmt: skip
    ref = kt.reference(p)
    x = [p.arrays[n] for n in ("q", "k", "v", "g", "beta")]
    out = kda.chunk_kda(*x, initial_state=p.arrays["initial_state"],
                        chunk_size=8, save_boundaries=True, **p.options())  # fmt: skip
    kt.assert_close(out.boundaries, ref.boundaries, dtype="float64", name="boundaries")
    kt.assert_close(out.output, ref.output, dtype="float64", name="output")
    assert ref.grads.A_log.shape == (4,) and ref.grad_scales["dt_bias"].shape == (4, 4)


def test_assert_close_names_tensor_index_and_ratio():
    e = np.ones((2, 3))
    a = e.copy()
    a[1, 2] += 1e-3
    with pytest.raises(AssertionError, match=r"dq: error 1\.000e-03 at \(1, 2\) is 33\.3 x the tolerance"):
        kt.assert_close(a, e, dtype="float32", name="dq")
    assert kt.assert_close(a, e, dtype="float16", name="dq") == pytest.approx(0.25)
    a[0, 0] = np.nan
    with pytest.raises(AssertionError, match="non-finite"):
        kt.assert_close(a, e, dtype="float16")


def test_bad_arguments_raise_kda_errors():
    with pytest.raises(kda.InvalidInputError, match="T_multiple_of"):
        kt.problems(T=(1, 3), T_multiple_of=4)
    with pytest.raises(kda.InvalidInputError, match="regimes"):
        kt.problems(regimes=("nope",))
    with pytest.raises(kda.InvalidTypeError, match="dtypes"):
        kt.problems(dtypes=("int8",))
    with pytest.raises(kda.InvalidInputError, match="convention"):
        kt.check_kernel(kda.chunk_kda, convention="jax")
    with pytest.raises(kda.InvalidTypeError, match="fn"):
        kt.check_kernel(None, convention="kda")
    with pytest.raises(kda.InvalidTypeError, match="dtype"):
        kt.assert_close(np.ones(2), np.ones(2), dtype="int8")
    with pytest.raises(kda.InvalidInputError, match=r"Problem\.lower_bound"):
        kt.Problem(gate="lower_bound")


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_kernel_passes_kda_chunk_kda_on_each_backend(backend):
    if backend == "cuda":  # Numba's simulator: a few small examples
        space = kt.problems(dtypes=("float32", "float64"), T=(1, 10), K=(1, 4), V=(1, 4), heads=1,
                            groups=(1, 2),
                            chunk_sizes=(None, 4))  # fmt: skip
        n = 3
    else:
        space, n = None, 100
    fn = functools.partial(kda.chunk_kda, backend=backend)
    bwd = functools.partial(kda.chunk_kda_backward, backend=backend)
    summary = kt.check_kernel(fn, backward=bwd, convention="kda", problems=space, max_examples=n)
    assert summary.examples == n and max(summary.worst.values()) <= 1
    assert "boundaries" in summary.worst


def test_check_kernel_passes_kda_torch():
    pytest.importorskip("torch")
    import kda.torch

    summary = kt.check_kernel(kda.torch.chunk_kda, convention="fla")
    assert summary.examples == 100 and "dA_log" in summary.worst and "ddt_bias" in summary.worst


@pytest.fixture(scope="module")
def fla():
    return fla_naive()


# What fla's naive chunk supports: no packed sequences, no gate or activations in the kernel,
# float32 compute (so float32 inputs), T a multiple of the chunk size.
FLA_NAIVE = dict(T_multiple_of=16, T=(16, 48), chunk_sizes=(16,), packed=(False,), gates=("log",),
                 qk_l2norm=(False,), beta_activations=(None,), dtypes=("float32",))  # fmt: skip


def test_fla_naive_chunk_passes_its_narrowed_space(fla):
    space = kt.problems(**FLA_NAIVE, regimes=("zero", "weak", "mild"))
    summary = kt.check_kernel(fla.naive_chunk_kda, convention="fla", problems=space, max_examples=15)
    assert summary.examples == 15


@pytest.mark.parametrize(
    ("space", "backward", "check", "match"),
    [
        ({}, True, "call", "AssertionError"),  # assert T % BT == 0 (and the default chunk is 64)
        (FLA_NAIVE | {"regimes": ("reset",)}, True, "finite", "non-finite"),  # -inf - -inf in its cumsum
        (FLA_NAIVE | {"regimes": ("raw",)}, True, "finite", "non-finite"),  # gates to -1e3: NaN gradients
        (FLA_NAIVE | {"regimes": ("hard",)}, True, "finite", "non-finite"),  # -1e4: NaN gradients
        (FLA_NAIVE | {"regimes": ("hard",)}, False, "accuracy", "is wrong"),  # cumsum loses digits
    ],
)
def test_fla_naive_chunk_findings(fla, space, backward, check, match):
    problems = kt.problems(**space) if space else None
    with pytest.raises(kt.KernelCheckFailed, match=match) as info:
        kt.check_kernel(
            fla.naive_chunk_kda, convention="fla", problems=problems, max_examples=10, backward=backward
        )
    assert info.value.check == check


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_kernel_is_caught(name):
    pytest.importorskip("torch")
    fn, check = BROKEN[name]
    with pytest.raises(kt.KernelCheckFailed) as info:
        kt.check_kernel(fn, convention="fla")
    err = info.value
    assert err.check == check, str(err)
    if check == "accuracy":  # wrong, not merely imprecise: default settings catch it
        assert " is wrong: " in str(err), str(err)
    assert err.examples <= 100
    assert "kt.check_problem(fn, problem, convention='fla'" in str(err)
    # the reproducer runs and fails the same way
    with pytest.raises(kt.KernelCheckFailed) as again:
        exec(err.reproducer, {})
    assert again.value.check == check or name == "nondeterministic last bit"


SMALL_BUGS = ("exp(g) as 1 + g for decays above -0.005", "chunk boundary off by one", "dbeta scaled by 1.005",
              "stale state across packed sequences")  # fmt: skip


@pytest.mark.parametrize("name", SMALL_BUGS)
def test_bug_under_one_percent_is_wrong_on_float32_alone(name):
    """float32's error scale follows the problem: bugs of 0.07 % to 0.8 % are wrong, not imprecise."""
    pytest.importorskip("torch")
    fn, check = BROKEN[name]
    space = kt.problems(dtypes=("float32",), layouts=("time_major",))
    with pytest.raises(kt.KernelCheckFailed, match=" is wrong: ") as info:
        kt.check_kernel(fn, convention="fla", problems=space)
    assert info.value.check == check and info.value.examples <= 100


def test_command_line_prints_summary_and_reproducer(tmp_path):
    pytest.importorskip("torch")  # the broken kernel is kda.torch.chunk_kda with a bug (fla convention)
    here = os.path.dirname(os.path.abspath(__file__))  # broken_kernels.py
    env = os.environ | {"PYTHONPATH": os.pathsep.join([os.getcwd(), here])}
    cmd = [sys.executable, "-m", "kda.testing"]
    ok = subprocess.run([*cmd, "kda:chunk_kda", "--backward", "kda:chunk_kda_backward",
                         "--convention", "kda", "--examples", "5", "--dtypes", "float32"],
                        capture_output=True, text=True, env=env)  # fmt: skip
    assert ok.returncode == 0 and "5 examples passed" in ok.stdout, ok.stderr
    bad = subprocess.run([*cmd, "broken_kernels:modifies_input", "--convention", "fla", "--examples", "5"],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert bad.returncode == 1 and "reproducer:" in bad.stdout, bad.stderr


def test_command_line_has_every_problems_argument():
    import inspect

    from kda.testing.__main__ import _SPACE, _space, main

    assert {n for n, *_ in _SPACE} == set(inspect.signature(kt.problems).parameters)
    import argparse

    a = argparse.Namespace(**{n: None for n, *_ in _SPACE}, no_packed=True)
    a.scale, a.chunk_sizes, a.lower_bound, a.qk_l2norm = ["default"], ["none", "16"], (-5.0, -1.0), ["false"]
    assert _space(a) == {"scale": ("default",), "chunk_sizes": (None, 16), "lower_bound": (-5.0, -1.0),
                         "qk_l2norm": (False,), "packed": (False,)}  # fmt: skip
    assert main(["kda:chunk_kda", "--convention", "kda", "--examples", "2", "--dtypes", "float32",
                 "--scale", "default", "--packed", "false", "--max-sequences", "2", "--T", "1,4",
                 "--lower-bound=-2,-1", "--layouts", "time_major"]) == 0  # fmt: skip


def _no_scale(q, k, v, g, beta, scale=None, **kw):
    """kda.chunk_kda without a scale keyword (raises NotImplementedError for one)."""
    if scale is not None:
        raise NotImplementedError("scale")
    return kda.chunk_kda(q, k, v, g, beta, **kw)


def test_not_implemented_rejects_the_draw_and_most_rejected_names_the_narrowing():
    space = kt.problems(dtypes=("float32",), T=(1, 6), K=(1, 3), V=(1, 3))
    summary = kt.check_kernel(_no_scale, convention="kda", backward=None, problems=space, max_examples=20)
    assert summary.examples == 20 and summary.rejected > 0
    assert "features" and summary.rejected_features["scale"] == summary.rejected
    assert "scale" not in summary.features
    assert f"{summary.rejected} draws rejected with NotImplementedError" in str(summary)
    # every draw rejected: a failure that says what to narrow
    with pytest.raises(kt.KernelCheckFailed, match=r"rejected every draw .* scale=\('default',\)") as info:
        kt.check_kernel(_no_scale, convention="kda", backward=None, max_examples=5,
                        problems=kt.problems(dtypes=("float32",), T=(1, 4), scale=("drawn",)))  # fmt: skip
    assert info.value.check == "call"
    # most rejected: the summary says which options to narrow
    s = kt.Summary(examples=2, rejected=30, rejected_features={"scale": 30, "gva": 9}, features={"gva": 1})
    assert "most draws were rejected: narrow problems(...) by scale=('default',)" in str(s)


def _output_off(problem, times):
    """kda.chunk_kda with its output moved by ``times`` the problem's output error scale."""
    ref = kt.reference(problem, backward=False, boundaries=False)
    scale, _ = kt.error_scales(problem, {"output": ref.output}, {}, False)["output"]

    def fn(q, k, v, g, beta, **kw):
        out = kda.chunk_kda(q, k, v, g, beta, **kw)
        return out.output + np.float32(times * scale), out.final_state

    return fn


def test_imprecise_is_reported_and_fails_only_under_strict():
    from hypothesis import strategies as st

    p = kt.Problem(seed=5, T=12, K=6, V=5, regime="mild", layout="head_first")
    space = st.just(p)
    fn = _output_off(p, 2.0)  # twice the scale: imprecise
    summary = kt.check_kernel(fn, convention="kda", backward=None, problems=space, max_examples=1)
    assert set(summary.imprecise) == {"output"}, str(summary)
    im = summary.imprecise["output"]
    assert 1.5 < im.worst <= kt.IMPRECISE_BAND["float32"] and im.examples == 1 and im.problem == p
    assert "IMPRECISE in 1 examples" in str(summary) and "x its error scale" in str(summary)
    with pytest.raises(kt.KernelCheckFailed, match="output is imprecise") as info:
        kt.check_kernel(fn, convention="kda", backward=None, problems=space, max_examples=1, strict=True)
    assert "strict=True" in info.value.reproducer
    with pytest.raises(kt.KernelCheckFailed, match="output is wrong"):  # beyond the band: wrong
        kt.check_kernel(_output_off(p, 8.0), convention="kda", backward=None, problems=space, max_examples=1)


def test_exact_zero_gradient_is_judged_against_the_floor():
    # T = 1 without an initial state: dg is exactly 0; a kernel's 6e-8 there is rounding, not a bug
    p = kt.Problem(seed=1, T=1, K=3, V=2, initial_state=False)
    ref = kt.reference(p, boundaries=False)
    assert not ref.grads.g.any()
    exp = {"dg": ref.grads.g, "output": ref.output}
    (scale, basis), _ = kt.error_scales(p, exp, ref.grad_scales, True)["dg"], None
    assert 6e-8 < scale < 1e-4 and "floor" in basis


def test_calibrate_measures_kernels_and_dtypes():
    from kda.testing import calibrate

    worst, _ = calibrate.measure_kernel("kda reference", 5)
    assert {"output", "final_state", "dq", "dg"} <= set(worst)
    assert all(0 <= r < kt.YARDSTICK_MARGIN for r, _ in worst.values())
    w = calibrate.measure(3, ("float32",))["float32"]
    assert 0 < w["perfect"] <= w["kda"] < kt.TOLERANCES["float32"]
