"""check_kernel: run a candidate KDA kernel on drawn problems and check it against the reference."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import InvalidInputError, InvalidTypeError
from ._compare import Mismatch, to_numpy
from ._problems import Problem, problems
from ._reference import GRADIENTS, reference
from ._scale import IMPRECISE_BAND, error_scales, judge, verdict

__all__ = ["CONVENTIONS", "Imprecise", "KernelCheckFailed", "Summary", "check_kernel", "check_problem"]

CONVENTIONS = ("fla", "kda")
CHECKS = ("call", "inputs unmodified", "finite", "causal", "accuracy", "deterministic")
_INPUTS = ("q", "k", "v", "g", "beta")


class KernelCheckFailed(AssertionError):
    """A check failed. Attributes: ``check`` (one of ``call``, ``inputs unmodified``, ``finite``,
    ``accuracy``, ``deterministic``, ``causal``), ``problem`` (the shrunk problem), ``examples``
    (examples run up to the first failure), ``seconds``, ``reproducer`` (Python source)."""

    def __init__(self, message: str, *, check: str, problem: Problem | None = None) -> None:
        super().__init__(message)
        self.check = check
        self.problem = problem
        self.examples = 0
        self.seconds = 0.0
        self.reproducer = ""


@dataclass
class Imprecise:
    """A tensor judged imprecise: in how many ``examples``, the ``worst`` ratio of error to its scale,
    that example's ``detail`` (the element, both values, the scale) and ``problem``."""

    examples: int
    worst: float
    detail: str
    problem: Problem


# problems() narrowing for each feature tag a rejected draw had
_NARROW = {
    "scale": "scale=('default',)",
    "packed": "packed=(False,)",
    "gva": "groups=(1,)",
    "qk_l2norm": "qk_l2norm=(False,)",
    "initial_state": "initial_state=(False,)",
}
_NARROW_PREFIX = {
    "gate": "gates",
    "beta": "beta_activations",
    "regime": "regimes",
    "dtype": "dtypes",
    "layout": "layouts",
    "chunk": "chunk_sizes",
    "size": "T",
}


@dataclass
class Summary:
    """What :func:`check_kernel` ran.

    Attributes
    ----------
    examples : int
        Examples checked (rejected draws not counted).
    worst : dict
        The worst ratio of error to error scale per tensor (``<= 1``: accurate).
    imprecise : dict
        Per tensor judged imprecise in some example: :class:`Imprecise`.
    rejected : int
        Draws the kernel rejected by raising ``NotImplementedError``.
    rejected_features, features : dict
        Feature tags (:attr:`Problem.features`) of the rejected draws and of the examples checked.
    checks : tuple of str
    seconds : float
    """

    examples: int = 0
    worst: dict[str, float] = field(default_factory=dict)
    imprecise: dict[str, Imprecise] = field(default_factory=dict)
    rejected: int = 0
    rejected_features: dict[str, int] = field(default_factory=dict)
    checks: tuple[str, ...] = ()
    features: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)

    def narrowing(self) -> list[str]:
        """The ``problems(...)`` arguments that would avoid most rejected draws: features that were
        in at least a quarter of the rejected draws and were rejected at least 9 times in 10."""
        out = []
        for tag, n in sorted(self.rejected_features.items(), key=lambda x: -x[1]):
            rate = n / (n + self.features.get(tag, 0))
            if rate < 0.9 or n < self.rejected / 4:
                continue
            if tag in _NARROW:
                hint = _NARROW[tag]
            elif tag.split("=")[0] in _NARROW_PREFIX:
                key, _, value = tag.partition("=")
                hint = f"{_NARROW_PREFIX[key]} without {value}"
            else:
                continue
            out.append(f"{hint} ({n} of {n + self.features.get(tag, 0)} draws with {tag!r} rejected)")
        return out

    def __str__(self) -> str:
        rej = ""
        if self.rejected:
            top = sorted(self.reasons.items(), key=lambda x: -x[1])[:3]
            why = "; ".join(f"{r!r} x {c}" for r, c in top)
            rej = f" ({self.rejected} draws rejected with NotImplementedError: {why})"
        lines = [f"{self.examples} examples passed in {self.seconds:.1f} s{rej}"]
        lines[0] += f"; checks: {', '.join(self.checks)}"
        if self.rejected > self.examples:
            hints = self.narrowing()
            lines.append(
                "most draws were rejected: narrow problems(...) by "
                + ("; ".join(hints) if hints else "the options the kernel lacks")
            )
        lines.append("worst error / error scale per tensor (<= 1: accurate):")
        for n, r in sorted(self.worst.items()):
            line = f"  {n:<16} {r:.3g}"
            if n in self.imprecise:
                im = self.imprecise[n]
                line += f"  IMPRECISE in {im.examples} examples; worst: {im.detail}\n    in {im.problem!r}"
            lines.append(line)
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Conventions: how a kernel is called. Each returns head-first float64 NumPy results.


def _time_major(x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None else np.ascontiguousarray(np.swapaxes(x, 1, 2))


def _head_first(x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None else np.swapaxes(x, 1, 2)


class _Run:
    """One call's results, head-first NumPy arrays; ``inputs`` are what was passed (for the
    unmodified check) as ``name -> (live array, NumPy copy taken before the call)``."""

    def __init__(self) -> None:
        self.results: dict[str, np.ndarray | None] = {}
        self.inputs: dict[str, tuple[Any, bytes]] = {}


class _Fla:
    """flash-linear-attention's ``chunk_kda`` signature: time-major torch tensors, autograd."""

    name = "fla"

    def __init__(self, fn: Callable, backward: bool, device: Any) -> None:
        import torch

        self.torch, self.fn, self.backward = torch, fn, bool(backward)
        self.device = torch.device("cpu" if device is None else device)

    def dtype(self, name: str) -> Any:
        return getattr(self.torch, name)

    def run(self, p: Problem, arrays: dict[str, Any], backward: bool) -> _Run:
        torch = self.torch
        run = _Run()
        grad = backward and self.backward
        ts: dict[str, Any] = {}
        for n in (*_INPUTS, "initial_state", "A_log", "dt_bias"):
            x = arrays[n]
            if x is None:
                continue
            if n in _INPUTS:
                x = _time_major(x)
            if n == "dt_bias":
                x = x.reshape(-1)
            t = torch.tensor(x, dtype=self.dtype(p.dtype_of(n)), device=self.device)
            run.inputs[n] = (t, _snapshot(t))
            ts[n] = t.requires_grad_(grad)
        kw: dict[str, Any] = {"output_final_state": True}
        if p.scale is not None:
            kw["scale"] = p.scale
        kw["initial_state"] = ts.get("initial_state")  # None too: some kernels take it positionally
        if p.chunk_size is not None:
            kw["chunk_size"] = p.chunk_size
        if p.cu_seqlens is not None:
            cu = torch.tensor(p.cu_seqlens, dtype=torch.int64, device=self.device)
            run.inputs["cu_seqlens"] = (cu, _snapshot(cu))
            kw["cu_seqlens"] = cu
        if p.qk_l2norm:
            kw["use_qk_l2norm_in_kernel"] = True
        if p.gate != "log":
            kw["use_gate_in_kernel"] = True
            for n in ("A_log", "dt_bias"):
                if n in ts:
                    kw[n] = ts[n]
            if p.gate == "lower_bound":
                kw["lower_bound"] = p.lower_bound
        if p.beta_activation is not None:
            kw["use_beta_sigmoid_in_kernel"] = True
            if p.beta_activation == "sigmoid2":
                kw["allow_neg_eigval"] = True
        o, S = self.fn(*(ts[n] for n in _INPUTS), **kw)
        run.results["output"] = _head_first(to_numpy(o).astype(np.float64))
        run.results["final_state"] = None if S is None else to_numpy(S).astype(np.float64)
        if grad:
            do = torch.tensor(_time_major(arrays["grad_output"]), dtype=o.dtype, device=o.device)
            outs, gos = [o], [do]
            if S is not None:
                outs.append(S)
                gos.append(torch.tensor(arrays["grad_final_state"], dtype=S.dtype, device=S.device))
            names = list(ts)
            gr = torch.autograd.grad(outs, [ts[n] for n in names], gos, allow_unused=True)
            for n, d in zip(names, gr):
                if d is None:
                    d = torch.zeros_like(ts[n])
                d = to_numpy(d).astype(np.float64)
                if n in _INPUTS:
                    d = _head_first(d)
                if n == "dt_bias":
                    d = d.reshape(p.HV, p.K)
                run.results["d" + n] = d
        return run


class _Kda:
    """kda's ``chunk_kda`` signature on an array-API namespace; backward a second callable."""

    name = "kda"

    def __init__(self, fn: Callable, backward: Any, device: Any, xp: Any) -> None:
        if xp is None:
            xp = np
        self.fn, self.bwd, self.device, self.xp = fn, backward if callable(backward) else None, device, xp

    def dtype(self, name: str) -> Any:
        d = getattr(self.xp, name, None)
        if d is None:
            raise InvalidInputError(
                f"problems: the namespace {self.xp.__name__} has no {name}; narrow dtypes"
            )
        return d

    def asarray(self, x: np.ndarray, dtype: str) -> Any:
        xp = self.xp
        if xp is np:
            return np.array(x, dtype=dtype)
        kw = {} if self.device is None else {"device": self.device}
        if dtype == "bfloat16":
            return xp.astype(xp.asarray(x.astype(np.float32), **kw), self.dtype(dtype))
        return xp.asarray(x.astype(dtype), **kw)

    def run(self, p: Problem, arrays: dict[str, Any], backward: bool) -> _Run:
        run = _Run()
        grad = backward and self.bwd is not None
        tm = p.layout == "time_major"
        xs: dict[str, Any] = {}
        for n in (*_INPUTS, "initial_state", "A_log", "dt_bias", "grad_output", "grad_final_state"):
            x = arrays[n]
            if x is None or (not grad and n.startswith("grad_")):
                continue
            if tm and n in (*_INPUTS, "grad_output"):
                x = _time_major(x)
            a = self.asarray(x, p.dtype_of(n))
            run.inputs[n] = (a, _snapshot(a))
            xs[n] = a
        kw: dict[str, Any] = {}
        if p.scale is not None:
            kw["scale"] = p.scale
        if "initial_state" in xs:
            kw["initial_state"] = xs["initial_state"]
        if p.chunk_size is not None:
            kw["chunk_size"] = p.chunk_size
        if tm:
            kw["layout"] = "time_major"
        opts = p.options()
        for n in ("A_log", "dt_bias"):
            if n in opts:
                opts[n] = xs[n]
        if "cu_seqlens" in opts:
            cu = self.xp.asarray(opts["cu_seqlens"]) if self.xp is not np else opts["cu_seqlens"]
            run.inputs["cu_seqlens"] = (cu, _snapshot(cu))
            opts["cu_seqlens"] = cu
        kw |= opts
        args = [xs[n] for n in _INPUTS]
        out = self.fn(*args, **kw, **({"save_boundaries": True} if grad else {}))
        o, S = out[0], out[1]
        bounds = out[2] if len(out) > 2 else None
        conv = (lambda x: _head_first(x)) if tm else (lambda x: x)
        run.results["output"] = conv(to_numpy(o).astype(np.float64))
        run.results["final_state"] = to_numpy(S).astype(np.float64)
        if bounds is not None:
            run.results["boundaries"] = to_numpy(bounds).astype(np.float64)
        if grad:
            gr = self.bwd(*args, bounds, xs["grad_output"], xs["grad_final_state"], **kw)
            for n, d in zip(GRADIENTS, gr):
                if n in xs and d is not None:
                    d = to_numpy(d).astype(np.float64)
                    run.results["d" + n] = conv(d) if n in _INPUTS else d
                elif n in xs:
                    run.results["d" + n] = np.zeros_like(arrays[n])
        return run


def _runner(fn: Any, convention: Any, backward: Any, device: Any, xp: Any) -> _Fla | _Kda:
    if not callable(fn):
        raise InvalidTypeError(f"fn must be callable; got {type(fn).__name__}")
    if convention == "fla":
        if not isinstance(backward, bool):
            raise InvalidTypeError(
                f"backward must be a bool for convention='fla'; got {type(backward).__name__}"
            )
        if xp is not None:
            raise InvalidInputError("xp is for convention='kda' only")
        return _Fla(fn, backward, device)
    if convention == "kda":
        if not (backward is None or isinstance(backward, bool) or callable(backward)):
            raise InvalidTypeError(
                "backward must be a callable (chunk_kda_backward's signature), False or None"
            )
        if backward is True:
            raise InvalidInputError("backward=True needs a callable for convention='kda' (or False / None)")
        return _Kda(fn, backward, device, xp)
    raise InvalidInputError(f"convention must be one of {CONVENTIONS}; got {convention!r}")


# ----------------------------------------------------------------------------------------------
# The checks of one problem


def _fail(check: str, message: str, problem: Problem) -> KernelCheckFailed:
    return KernelCheckFailed(f"check '{check}' failed: {message}", check=check, problem=problem)


def _same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _snapshot(x: Any) -> bytes:
    """The raw bytes of an array of any namespace (torch bfloat16 included)."""
    if type(x).__module__.startswith("torch"):
        import torch

        return x.detach().cpu().reshape(-1).clone().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(to_numpy(x)).tobytes()


def _perturbed(p: Problem, arrays: dict[str, Any]) -> dict[str, Any]:
    """The arrays with every input changed at steps ``>= p.causal_step`` (same validity)."""
    t = p.causal_step
    out = dict(arrays)
    q, k, v, g, beta = (np.array(arrays[n], copy=True) for n in _INPUTS)
    q[:, :, t:] = q[:, :, t:] * -0.5 + 0.25
    k[:, :, t:] = -k[:, :, t:]
    v[:, :, t:] = v[:, :, t:] + 1.0
    g[:, :, t:] = g[:, :, t:] * 0.5 - 0.125 if p.gate == "log" else g[:, :, t:] + 1.0
    beta[:, :, t:] = beta[:, :, t:] * 0.5 + 0.25
    for n, x in zip(_INPUTS, (q, k, v, g, beta)):
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
    runner = _runner(fn, convention, backward, device, xp)
    try:
        return _check(runner, problem, backward, deterministic, strict, summary)
    except Rejected as err:
        raise _fail("call", f"the kernel rejected the problem: {err}", problem) from None


def _call(runner: _Fla | _Kda, p: Problem, arrays: dict[str, Any], grad: bool, first: bool) -> _Run:
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


def _check_causal(runner: _Fla | _Kda, p: Problem, got: dict[str, Any]) -> None:
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
    runner: _Fla | _Kda, p: Problem, backward: Any, deterministic: bool, strict: bool, summary: Summary | None
) -> dict[str, float]:
    arrays = p.arrays
    grad = bool(backward)
    run = _call(runner, p, arrays, grad, True)
    for n, (live, before) in run.inputs.items():
        if _snapshot(live) != before:
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
        _record(summary, p, ratios, details)
    return ratios


def _record(summary: Summary, p: Problem, ratios: dict[str, float], details: dict[str, str]) -> None:
    summary.examples += 1
    for n, r in ratios.items():
        summary.worst[n] = max(summary.worst.get(n, 0.0), r)
        if verdict(r, p.dtype) == "imprecise":
            im = summary.imprecise.get(n)
            if im is None:
                summary.imprecise[n] = Imprecise(1, r, details[n], p)
            else:
                im.examples += 1
                if r > im.worst:
                    im.worst, im.detail, im.problem = r, details[n], p
    for f in p.features:
        summary.features[f] = summary.features.get(f, 0) + 1


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

    runner = _runner(fn, convention, backward, device, xp)
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
            fn, err.problem, convention=convention, backward=backward, deterministic=deterministic,
            strict=strict,
        )  # fmt: skip
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
