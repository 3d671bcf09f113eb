"""Measure the errors the error scales and tolerances are set from.

``python -m kda.testing.calibrate --kernels [NAME ...] [--examples N]``: float32, the worst ratio of
each correct kernel's error to ``max(yardstick, floor)`` (:mod:`kda.testing._scale`, before its
margin :data:`kda.testing.YARDSTICK_MARGIN`), per tensor, on ``N`` derandomised draws of the space
each kernel supports (:data:`KERNELS`): kda's chunked form on the reference and cpu backends,
``kda.torch.chunk_kda``, transformers' Kimi Linear fallbacks and fla's ``naive_recurrent_kda``
(those whose packages are missing are skipped, with the reason).

``python -m kda.testing.calibrate [--examples N] [--dtypes ...]`` draws ``N`` problems per dtype from
:func:`kda.testing.problems` (derandomised) and prints, per dtype, the worst error relative to
the tensor's max-abs (gate parameters and ``qk_l2norm``'s ``q, k`` against their error scales) of

- ``perfect``: the exact float64 results on the rounded inputs, rounded once more to the dtype
  (float32 for states): what an ideal kernel of that dtype returns;
- ``kda``: :func:`kda.chunk_kda` and :func:`kda.chunk_kda_backward` (NumPy; bfloat16 through
  ``kda.torch``'s path is the same float32 computation, so it is measured as float32 inputs
  rounded to bfloat16 and results rounded to bfloat16).

Each is measured against :func:`kda.testing.reference` of the same (rounded) inputs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from ._compare import TOLERANCES, compare
from ._draw import problems
from ._problems import Problem, round_to
from ._reference import GRADIENTS, reference


def _kda(p: Problem) -> dict[str, np.ndarray]:
    import kda

    dt = "float32" if p.dtype == "bfloat16" else p.dtype
    a = p.arrays
    kw = p.options()
    for n in ("A_log", "dt_bias"):
        if n in kw:
            kw[n] = kw[n].astype(p.dtype_of(n) if p.dtype != "bfloat16" else "float32")
    x = [a[n].astype(dt) for n in ("q", "k", "v", "g", "beta")]
    s0 = None if a["initial_state"] is None else a["initial_state"].astype(p.dtype_of("initial_state"))
    extra = {} if p.chunk_size is None else {"chunk_size": p.chunk_size}
    out = kda.chunk_kda(*x, initial_state=s0, scale=p.scale, save_boundaries=True, **extra, **kw)
    gr = kda.chunk_kda_backward(
        *x,
        out.boundaries,
        a["grad_output"].astype(dt),
        a["grad_final_state"].astype(p.dtype_of("grad_final_state")),
        initial_state=s0,
        scale=p.scale,
        **extra,
        **kw,
    )
    res = {"output": out.output, "final_state": out.final_state}
    res |= {"d" + n: d for n, d in zip(GRADIENTS, gr) if d is not None and a[n] is not None}
    if p.dtype == "bfloat16":
        res = {
            n: round_to(x, "bfloat16") if n in ("output", "dq", "dk", "dv", "dg", "dbeta") else x
            for n, x in res.items()
        }
    return res


def _measure_dtype(dtype: str, examples: int, w: dict[str, float]) -> None:
    from hypothesis import HealthCheck, given, settings

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(problems(dtypes=(dtype,)))
    def run(p: Problem) -> None:
        ref = reference(p, boundaries=False)
        exp = {"output": ref.output, "final_state": ref.final_state}
        exp |= {"d" + n: x for n, x in zip(GRADIENTS, ref.grads) if x is not None}
        got = _kda(p)
        for n, e in exp.items():
            scale = ref.grad_scales.get(n[1:])
            perfect = round_to(
                e, p.dtype_of(n[1:] if n.startswith("d") else "initial_state") if n != "output" else p.dtype
            )
            for kind, x in (("perfect", perfect), ("kda", got[n])):
                # tol=1: measure, do not judge (the ratio is the relative error)
                w[kind] = max(w[kind], compare(x, e, dtype="float64", name=n, scale=scale, tol=1.0))

    run()


def measure(examples: int, dtypes: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per dtype, the worst relative error of a perfect kernel and of kda (see the module notes)."""
    worst: dict[str, dict[str, float]] = {}
    for dtype in dtypes:
        _measure_dtype(dtype, examples, worst.setdefault(dtype, {"perfect": 0.0, "kda": 0.0}))
    return worst


# name -> (loader returning (fn, convention, backward) or raising ImportError, problems() arguments)
# (the spaces of tests/tools/test_third_party_kernels.py: each narrowed by what the kernel lacks)
_TRANSFORMERS = dict(
    groups=(1,), packed=(False,), gates=("log",), beta_activations=(None,), scale=("default",)
)


def _kimi(name: str) -> Any:
    import logging

    from transformers.models.kimi_linear import modeling_kimi_linear

    logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
    return getattr(modeling_kimi_linear, name)


def _fla_recurrent() -> Any:
    from ._fla import load_fla_naive

    module, reason = load_fla_naive()
    if module is None:
        raise ImportError(reason)
    return module.naive_recurrent_kda


def _kda_kernel(backend: str) -> tuple[Any, str, Any]:
    import functools

    import kda

    return (
        functools.partial(kda.chunk_kda, backend=backend),
        "kda",
        functools.partial(kda.chunk_kda_backward, backend=backend),
    )


def _kda_torch() -> tuple[Any, str, Any]:
    import kda.torch

    return kda.torch.chunk_kda, "fla", True


KERNELS: dict[str, tuple[Any, dict[str, Any]]] = {
    "kda reference": (lambda: _kda_kernel("reference"), {}),
    "kda cpu": (lambda: _kda_kernel("cpu"), {}),
    "kda.torch": (_kda_torch, {"layouts": ("time_major",)}),
    "transformers chunk": (
        lambda: (_kimi("chunk_kimi_delta_attention"), "fla", True),
        _TRANSFORMERS | {"regimes": ("zero", "weak", "mild")},
    ),
    "transformers recurrent": (
        lambda: (_kimi("recurrent_kimi_delta_attention"), "fla", True),
        _TRANSFORMERS,
    ),
    "fla naive_recurrent_kda": (
        lambda: (_fla_recurrent(), "fla", True),
        dict(
            packed=(False,), gates=("log",), beta_activations=(None,), qk_l2norm=(False,), chunk_sizes=(None,)
        ),
    ),
}


def measure_kernel(name: str, examples: int) -> tuple[dict[str, tuple[float, Problem]], float]:
    """``({tensor: (worst error / max(yardstick, floor), its problem)}, seconds)`` of one kernel of
    :data:`KERNELS` on ``examples`` float32 draws."""
    import time

    from hypothesis import HealthCheck, Phase, given, settings

    from ._check import _expected
    from ._conventions import runner_for
    from ._scale import YARDSTICK_MARGIN, error_scales, judge

    load, space = KERNELS[name]
    fn, convention, backward = load()
    runner = runner_for(fn, convention, backward, None, None)
    worst: dict[str, tuple[float, Problem]] = {}

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.generate,),
    )
    @given(problems(dtypes=("float32",), **space))
    def run(p: Problem) -> None:
        got = runner.run(p, p.arrays, True).results
        expected, ref = _expected(p, got, True)
        for n, (scale, _) in error_scales(p, expected, ref.grad_scales, True).items():
            r, _ = judge(got[n], expected[n], scale / YARDSTICK_MARGIN, name=n)
            if r >= worst.get(n, (-1.0,))[0]:
                worst[n] = (r, p)

    start = time.perf_counter()
    run()
    return worst, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kda.testing.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32", "float16", "bfloat16"])
    ap.add_argument("--kernels", nargs="*", default=None, help=f"any of {sorted(KERNELS)} (none: all)")
    ap.add_argument("--problems", action="store_true", help="with --kernels: print each worst problem")
    args = ap.parse_args(argv)
    if args.kernels is not None:
        for name in args.kernels or KERNELS:
            try:
                worst, seconds = measure_kernel(name, args.examples)
            except ImportError as err:
                print(f"{name}: skipped ({err})")
                continue
            print(f"{name}: {args.examples} examples, {seconds:.1f} s; worst error / max(yardstick, floor):")
            for n, (r, p) in sorted(worst.items()):
                print(f"  {n:<16} {r:7.3g}   K={p.K} V={p.V} T={p.T} {p.regime}")
                if args.problems:
                    print(f"    {p!r}")
        return 0
    for dtype, w in measure(args.examples, tuple(args.dtypes)).items():
        print(f"{dtype:9} perfect {w['perfect']:.2e}  kda {w['kda']:.2e}  tolerance {TOLERANCES[dtype]:.0e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
