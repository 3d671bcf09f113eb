"""``python -m kda.testing MODULE:FUNCTION --convention fla [--examples N] [--strict] [space options]``.

Runs :func:`kda.testing.check_kernel` on the function and prints the summary (exit 0) or the
failed check with its reproducer (exit 1). ``MODULE`` may also be a path to a ``.py`` file. Every
argument of :func:`kda.testing.problems` is an option (``--T-multiple-of 16``, ``--scale default``,
``--packed false``, ``--lower-bound=-5,-1``, ...).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def _load(spec: str) -> Any:
    if ":" not in spec:
        raise SystemExit(f"kernel must be MODULE:FUNCTION; got {spec!r}")
    mod_name, _, attr = spec.rpartition(":")
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        s = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(s)
        s.loader.exec_module(module)
    else:
        module = importlib.import_module(mod_name)
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part)
    return fn


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def _floats(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    return float(lo), float(hi or lo)


def _bools(values: list[str]) -> tuple[bool, ...]:
    table = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    try:
        return tuple(table[v.lower()] for v in values)
    except KeyError as err:
        raise SystemExit(f"expected true or false; got {err.args[0]!r}") from None


# problems()'s arguments: (flag, type, nargs, help). Every one is on the command line.
_SPACE = (
    ("dtypes", str, "+", "float64 float32 float16 bfloat16"),
    ("K", _pair, None, "min,max (or one int)"),
    ("V", _pair, None, "min,max"),
    ("T", _pair, None, "min,max"),
    ("T_multiple_of", int, None, "every T (and packed length) a multiple of this"),
    ("heads", _pair, None, "min,max"),
    ("groups", int, "+", "value heads per q/k head"),
    ("batch", _pair, None, "min,max"),
    ("packed", str, "+", "true false"),
    ("max_sequences", int, None, "most packed sequences"),
    ("layouts", str, "+", "head_first time_major"),
    ("initial_state", str, "+", "true false"),
    ("gates", str, "+", "log softplus lower_bound"),
    ("lower_bound", _floats, None, "min,max (floats < 0)"),
    ("regimes", str, "+", "zero weak mild steep kimi strong hard reset raw mixed"),
    ("qk_l2norm", str, "+", "true false"),
    ("beta_activations", str, "+", "none sigmoid sigmoid2"),
    ("scale", str, "+", "default drawn"),
    ("chunk_sizes", str, "+", "ints, or none (not passed)"),
)
_BOOLS = ("packed", "initial_state", "qk_l2norm")


def _space(a: argparse.Namespace) -> dict[str, Any]:
    space: dict[str, Any] = {}
    for name, *_ in _SPACE:
        x = getattr(a, name)
        if x is None:
            continue
        if name in _BOOLS:
            x = _bools(x)
        elif name == "beta_activations":
            x = tuple(None if b == "none" else b for b in x)
        elif name == "chunk_sizes":
            x = tuple(None if c == "none" else int(c) for c in x)
        elif isinstance(x, list):
            x = tuple(x)
        space[name] = x
    for name in _BOOLS:  # the older spellings
        if getattr(a, "no_" + name, False):
            space[name] = (False,)
    return space


def main(argv: list[str] | None = None) -> int:
    from . import check_kernel, problems
    from ._check import KernelCheckFailed

    ap = argparse.ArgumentParser(
        prog="python -m kda.testing", description="Check a KDA kernel against kda's exact recurrence."
    )
    ap.add_argument("kernel", help="MODULE:FUNCTION (or path/to/file.py:FUNCTION)")
    ap.add_argument("--convention", required=True, choices=("fla", "kda"))
    ap.add_argument("--backward", default=None, help="kda convention: MODULE:FUNCTION of the backward")
    ap.add_argument("--no-backward", action="store_true", help="fla convention: forward only")
    ap.add_argument("--examples", type=int, default=100)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--nondeterministic", action="store_true", help="skip the repeated-call check")
    ap.add_argument("--strict", action="store_true", help="fail on an imprecise tensor too")
    sp = ap.add_argument_group("space: kda.testing.problems()'s arguments (each narrows the default)")
    for name, kind, nargs, text in _SPACE:
        flag = "--" + name.replace("_", "-") if name not in ("K", "V", "T") else "--" + name
        sp.add_argument(flag, dest=name, type=kind, nargs=nargs, help=text)
    for name in _BOOLS:
        sp.add_argument(
            "--no-" + name.replace("_", "-"),
            dest="no_" + name,
            action="store_true",
            help=f"the same as --{name.replace('_', '-')} false",
        )
    a = ap.parse_args(argv)
    space = _space(a)
    if a.convention == "fla":
        space.setdefault("layouts", ("time_major",))
    elif "dtypes" not in space:
        space["dtypes"] = ("float64", "float32", "float16")
    fn = _load(a.kernel)
    backward: Any = not a.no_backward
    if a.convention == "kda":
        backward = _load(a.backward) if a.backward else None
    try:
        summary = check_kernel(
            fn,
            convention=a.convention,
            problems=problems(**space),
            backward=backward,
            max_examples=a.examples,
            seed=a.seed,
            device=a.device,
            deterministic=not a.nondeterministic,
            strict=a.strict,
        )
    except KernelCheckFailed as err:
        print(err)
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
