"""check_kernel: run a candidate KDA kernel on drawn problems and check it against the reference.

The checks of one problem (:func:`check_problem`) and the run over drawn problems
(:func:`check_kernel`); how a kernel is called is in :mod:`._conventions`, what a run reports in
:mod:`._summary`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import InvalidInputError, InvalidTypeError
from ._compare import Mismatch
from ._conventions import CONVENTIONS, INPUTS, Run, Runner, runner_for, snapshot
from ._draw import problems
from ._problems import Problem
from ._reference import GRADIENTS, reference
from ._scale import IMPRECISE_BAND, error_scales, judge, verdict
from ._summary import Imprecise, KernelCheckFailed, Summary, record

__all__ = ["CONVENTIONS", "Imprecise", "KernelCheckFailed", "Summary", "check_kernel", "check_problem"]

CHECKS = ("call", "inputs unmodified", "finite", "causal", "accuracy", "deterministic")


# ----------------------------------------------------------------------------------------------
# The checks of one problem


def _fail(check: str, message: str, problem: Problem) -> KernelCheckFailed:
    return KernelCheckFailed(f"check '{check}' failed: {message}", check=check, problem=problem)


def _same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _perturbed(p: Problem, arrays: dict[str, Any]) -> dict[str, Any]:
    """The arrays with every input changed at steps ``>= p.causal_step`` (same validity)."""
    t = p.causal_step
    out = dict(arrays)
    q, k, v, g, beta = (np.array(arrays[n], copy=True) for n in INPUTS)
    q[:, :, t:] = q[:, :, t:] * -0.5 + 0.25
    k[:, :, t:] = -k[:, :, t:]
    v[:, :, t:] = v[:, :, t:] + 1.0
    g[:, :, t:] = g[:, :, t:] * 0.5 - 0.125 if p.gate == "log" else g[:, :, t:] + 1.0
    beta[:, :, t:] = beta[:, :, t:] * 0.5 + 0.25
    for n, x in zip(INPUTS, (q, k, v, g, beta)):
        out[n] = x
    return out


class Rejected(Exception):
    """The kernel raised ``NotImplementedError`` for a drawn option: the draw is rejected."""


def check_problem(
    fn: Callable,
    problem: Problem,
    *,
    convention: str,
    backward: Any = True,
    device: Any = None,
    xp: Any = None,
    deterministic: bool = True,
    strict: bool = False,
    summary: Summary | None = None,
) -> dict[str, float]:
    """Run every check of :func:`check_kernel` on one problem (what its reproducer calls).

    Returns the worst ratio of error to error scale per tensor; raises
    :class:`KernelCheckFailed` (an ``AssertionError``) naming the failed check (a kernel's
    ``NotImplementedError`` too, as the check ``call``).
    """
    if not isinstance(problem, Problem):
        raise InvalidTypeError(f"problem must be a kda.testing.Problem; got {type(problem).__name__}")
    runner = runner_for(fn, convention, backward, device, xp)
    try:
        return _check(runner, problem, backward, deterministic, strict, summary)
    except Rejected as err:
        raise _fail("call", f"the kernel rejected the problem: {err}", problem) from None


def _call(runner: Runner, p: Problem, arrays: dict[str, Any], grad: bool, first: bool) -> Run:
    try:
        return runner.run(p, arrays, grad)
    except NotImplementedError as err:
        if first:
            raise Rejected(f"NotImplementedError: {err}") from err
        raise _fail("call", f"the kernel raised NotImplementedError on a repeated call: {err}", p) from err
    except Exception as err:
        import traceback

        frame = traceback.extract_tb(err.__traceback__)[-1]
        where = f" ({frame.filename}:{frame.lineno}: {frame.line})"
        raise _fail("call", f"the kernel raised {type(err).__name__}: {err}{where}", p) from err


def _expected(p: Problem, got: dict[str, Any], grad: bool) -> tuple[dict[str, np.ndarray], Any]:
    ref = reference(p, backward=grad and any(k.startswith("d") for k in got), boundaries="boundaries" in got)
    expected: dict[str, Any] = {"output": ref.output, "final_state": ref.final_state}
    if "boundaries" in got:
        expected["boundaries"] = ref.boundaries
    if ref.grads is not None:
        for n, x in zip(GRADIENTS, ref.grads):
            if x is not None and "d" + n in got:
                expected["d" + n] = x
    return expected, ref


def _check_causal(runner: Runner, p: Problem, got: dict[str, Any]) -> None:
    t = p.causal_step
    other = _call(runner, p, _perturbed(p, p.arrays), False, False).results["output"]
    a, b = got["output"][:, :, :t], other[:, :, :t]
    if not _same_bits(a, b):
        bad = np.argwhere(~((a == b) | (np.isnan(a) & np.isnan(b))))
        where = tuple(int(i) for i in bad[0]) if bad.size else "?"
        raise _fail(
            "causal",
            f"changing the inputs at steps >= {t} changed output[b, h, t, v] at {where} (head-first), "
            f"before step {t}",
            p,
        )


def _check(
    runner: Runner, p: Problem, backward: Any, deterministic: bool, strict: bool, summary: Summary | None
) -> dict[str, float]:
    arrays = p.arrays
    grad = bool(backward)
    run = _call(runner, p, arrays, grad, True)
    for n, (live, before) in run.inputs.items():
        if snapshot(live) != before:
            raise _fail("inputs unmodified", f"the kernel modified its input {n!r}", p)
    got = run.results
    expected, ref = _expected(p, got, grad)
    for n in expected:
        if got.get(n) is None:
            raise _fail("call", f"the kernel returned no {n}", p)
    for n, e in expected.items():  # finiteness (and shapes) first: a NaN is reported as such
        try:
            judge(got[n], e, 1.0, name=n)
        except Mismatch as m:
            raise _fail(m.check, str(m), p) from None
    if p.T > 1:
        _check_causal(runner, p, got)
    scales = error_scales(p, expected, ref.grad_scales, grad)
    ratios: dict[str, float] = {}
    details: dict[str, str] = {}
    band = IMPRECISE_BAND[p.dtype]
    for n, e in expected.items():
        scale, basis = scales[n]
        r, where = judge(got[n], e, scale, name=n)
        ratios[n] = r
        details[n] = f"{where} is {r:.3g} x its error scale {scale:.3e} ({basis})"
        v = verdict(r, p.dtype)
        if v == "wrong" or (v == "imprecise" and strict):
            limit = f"wrong beyond {band:g} x" if v == "wrong" else "imprecise, and strict=True"
            raise _fail("accuracy", f"{n} is {v}: {details[n]}; {limit}", p)
    if deterministic:
        again = _call(runner, p, arrays, grad, False).results
        for n, x in got.items():
            if x is not None and not _same_bits(x, again.get(n)):
                diff = np.argwhere(~((x == again[n]) | (np.isnan(x) & np.isnan(again[n]))))
                where = tuple(int(i) for i in diff[0]) if diff.size else "(shape or NaN pattern)"
                raise _fail("deterministic", f"a repeated call changed {n} at {where}", p)
    if summary is not None:
        record(summary, p, ratios, details)
    return ratios


# ----------------------------------------------------------------------------------------------
# check_kernel


def _name_of(fn: Any) -> tuple[str, str]:
    """``(import line, expression)`` that rebuild ``fn`` where possible."""
    import functools

    if isinstance(fn, functools.partial):
        line, expr = _name_of(fn.func)
        args = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"import functools\n{line}", f"functools.partial({expr}, {', '.join(args)})"
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if mod and qual and "<" not in qual and mod != "__main__":
        top = qual.split(".")[0]
        return f"from {mod} import {top}", qual
    return "", f"...  # the kernel under test: {fn!r}"


def reproducer(
    fn: Any, problem: Problem, *, convention: str, backward: Any, deterministic: bool, strict: bool = False
) -> str:
    """Python source that reruns the checks of ``problem`` on ``fn``."""
    line, expr = _name_of(fn)
    lines = ["import kda.testing as kt", "from kda.testing import Problem"]
    if line:
        lines.append(line)
    lines.append(f"fn = {expr}")
    bw = repr(backward)
    if callable(backward):
        bline, bexpr = _name_of(backward)
        if bline:
            lines.append(bline)
        lines.append(f"backward = {bexpr}")
        bw = "backward"
    lines.append(f"problem = {problem!r}")
    extra = ("" if deterministic else ", deterministic=False") + (", strict=True" if strict else "")
    lines.append(f"kt.check_problem(fn, problem, convention={convention!r}, backward={bw}{extra})")
    return "\n".join(lines)


def default_problems(convention: str, xp: Any = None) -> Any:
    """The default space of a convention: everything kda supports that the convention can pass
    (NumPy has no bfloat16)."""
    if convention == "kda":
        ns = np if xp is None else xp
        dts = tuple(d for d in ("float64", "float32", "float16", "bfloat16") if hasattr(ns, d))
        return problems(dtypes=dts)
    return problems(layouts=("time_major",))


def check_kernel(
    fn: Callable,
    *,
    convention: str,
    problems: Any = None,
    backward: Any = True,
    max_examples: int = 100,
    seed: int | None = None,
    device: Any = None,
    xp: Any = None,
    deterministic: bool = True,
    strict: bool = False,
) -> Summary:
    """Check a KDA kernel against kda's exact recurrence on drawn problems.

    Per example, in this order: the call succeeds (a ``NotImplementedError`` rejects the draw:
    counted in the summary, not a failure); inputs left unmodified (bitwise); every output and
    gradient finite wherever the reference is; causality (changing the inputs at steps ``>= t``
    changes no output before ``t``, bitwise); every output and gradient within its error scale
    of the float64 reference (``kda/testing/_scale.py``, ``docs/testing.md``): a ratio of error to
    scale up to 1 is accurate, up to :data:`kda.testing.IMPRECISE_BAND` imprecise (reported in the
    summary; a failure only with ``strict``), beyond it wrong; the same bits on a repeated call
    (``deterministic``).

    Parameters
    ----------
    fn : callable
        ``convention="fla"``: flash-linear-attention's ``chunk_kda(q, k, v, g, beta, **kw)`` on
        time-major torch tensors (``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``,
        ``beta [B, T, HV]``, states ``[N, HV, K, V]``) returning ``(o, final_state)``; called with
        ``output_final_state=True``, ``initial_state`` (None when the problem has none) and only
        the other keywords the problem uses (``scale``, ``chunk_size``, ``cu_seqlens``,
        ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel`` with ``A_log``, ``dt_bias``
        (``HV * K`` elements), ``lower_bound``, ``use_beta_sigmoid_in_kernel``,
        ``allow_neg_eigval``); gradients through ``torch.autograd``.
        ``convention="kda"``: :func:`kda.chunk_kda`'s signature on the arrays of ``xp``,
        returning ``(output, final_state[, boundaries])``; boundaries, when returned, are
        checked against the reference's chunk-start states.
        Either may raise ``NotImplementedError`` for an option it lacks: that draw is rejected.
    convention : {"fla", "kda"}
    problems : hypothesis strategy of :class:`Problem`, optional
        Default: :func:`kda.testing.problems` (time-major only for ``"fla"``; no bfloat16 on
        NumPy).
    backward : bool or callable
        ``"fla"``: whether to check gradients. ``"kda"``: a callable with
        :func:`kda.chunk_kda_backward`'s signature (then ``fn`` gets ``save_boundaries=True``),
        or False / None for a forward-only kernel.
    max_examples : int
        Examples to check (before shrinking a failure; rejected draws do not count).
    seed : int, optional
        Hypothesis seed; None: derandomised (the same examples on every run).
    device : optional
        ``"fla"``: the torch device of the tensors; ``"kda"``: passed to ``xp.asarray(..., device=)``.
    xp : array namespace, optional
        ``"kda"`` only: the namespace of the inputs (NumPy by default).
    deterministic : bool
        Check that a repeated call returns the same bits.
    strict : bool
        Fail on an imprecise tensor too (default: reported in the summary).

    Returns
    -------
    Summary
        Examples run, rejected draws, the worst error / error scale per tensor, the imprecise
        tensors with their worst example, the features covered.

    Raises
    ------
    KernelCheckFailed
        (an ``AssertionError``) naming the failed check, with the shrunk problem and a runnable
        reproducer in its message; also when every draw was rejected.
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.errors import FlakyFailure, FlakyReplay, Unsatisfiable

    runner = runner_for(fn, convention, backward, device, xp)
    strategy = _checked_arguments(
        max_examples, seed, strict, default_problems(convention, xp) if problems is None else problems
    )
    summary = Summary(checks=tuple(c for c in CHECKS if deterministic or c != "deterministic"))
    state: dict[str, Any] = {"count": 0, "first": None, "last": None, "start": time.perf_counter()}
    body = _example_body(runner, backward, deterministic, strict, summary, state)
    config = settings(
        max_examples=max_examples,
        derandomize=seed is None,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )
    test = config(given(strategy)(body))
    if seed is not None:
        test = hseed(seed)(test)
    try:
        test()
    except Unsatisfiable:
        hints = summary.narrowing()
        msg = (
            f"check 'call' failed: the kernel rejected every draw ({summary.rejected}) with "
            f"NotImplementedError; narrow problems(...) by "
            + ("; ".join(hints) if hints else "the options the kernel lacks")
        )
        raise KernelCheckFailed(msg, check="call") from None
    except (KernelCheckFailed, FlakyFailure, FlakyReplay) as caught:
        err = state["last"] if state["last"] is not None else caught
        if not isinstance(err, KernelCheckFailed):
            raise
        repro = reproducer(
            fn,
            err.problem,
            convention=convention,
            backward=backward,
            deterministic=deterministic,
            strict=strict,
        )
        raise _reported(err, caught, state, repro) from None
    summary.seconds = time.perf_counter() - state["start"]
    return summary


def _checked_arguments(max_examples: Any, seed: Any, strict: Any, strategy: Any) -> Any:
    """``strategy`` once :func:`check_kernel`'s arguments are checked (``kda.KdaError`` if not)."""
    if not isinstance(max_examples, int) or isinstance(max_examples, bool) or max_examples < 1:
        raise InvalidInputError(f"max_examples must be a positive int; got {max_examples!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise InvalidTypeError(f"seed must be an int or None; got {type(seed).__name__}")
    if not isinstance(strict, bool):
        raise InvalidTypeError(f"strict must be a bool; got {type(strict).__name__}")
    if not hasattr(strategy, "example"):
        raise InvalidTypeError(f"problems must be a hypothesis strategy; got {type(strategy).__name__}")
    return strategy


def _example_body(
    runner: Any, backward: Any, deterministic: bool, strict: bool, summary: Summary, state: dict
) -> Callable[[Problem], None]:
    """The body hypothesis runs per drawn problem: the checks, the rejected draws counted in
    ``summary`` and the first failure's example count and time recorded in ``state``."""
    from hypothesis import reject

    def body(problem: Problem) -> None:
        if not isinstance(problem, Problem):
            raise InvalidTypeError(f"problems must draw kda.testing.Problem; drew {type(problem).__name__}")
        if state["first"] is None:
            state["count"] += 1
        try:
            _check(runner, problem, backward, deterministic, strict, summary)
        except Rejected as why:
            if state["first"] is None:
                summary.rejected += 1
                summary.reasons[str(why)] = summary.reasons.get(str(why), 0) + 1
                for f in problem.features:
                    summary.rejected_features[f] = summary.rejected_features.get(f, 0) + 1
            reject()
        except KernelCheckFailed as err:
            if state["first"] is None:
                state["first"] = (state["count"], time.perf_counter() - state["start"])
            state["last"] = err
            raise

    return body


def _reported(err: KernelCheckFailed, caught: BaseException, state: dict, repro: str) -> KernelCheckFailed:
    """The failure :func:`check_kernel` raises: ``err``'s message with the example count, the time,
    the shrunk problem and the reproducer ``repro``."""
    count, seconds = state["first"] or (state["count"], time.perf_counter() - state["start"])
    flaky = "" if isinstance(caught, KernelCheckFailed) else " (flaky: it did not fail again on replay)"
    msg = (
        f"{err.args[0]}{flaky}\nfirst failure after {count} examples ({seconds:.1f} s); shrunk problem:\n"
        f"{err.problem!r}\nreproducer:\n{repro}"
    )
    out = KernelCheckFailed(msg, check=err.check, problem=err.problem)
    out.examples, out.seconds, out.reproducer = count, seconds, repro
    return out
