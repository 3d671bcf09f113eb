"""``python -m kda.testing MODULE:FUNCTION --convention fla [--examples N] [space options]``.

Runs :func:`kda.testing.check_kernel` on the function and prints the summary (exit 0) or the
failed check with its reproducer (exit 1). ``MODULE`` may also be a path to a ``.py`` file.
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
    sp = ap.add_argument_group("space (each narrows the default)")
    sp.add_argument("--dtypes", nargs="+")
    sp.add_argument("--K", type=_pair, help="min,max")
    sp.add_argument("--V", type=_pair, help="min,max")
    sp.add_argument("--T", type=_pair, help="min,max")
    sp.add_argument("--T-multiple-of", type=int, dest="T_multiple_of")
    sp.add_argument("--heads", type=_pair)
    sp.add_argument("--groups", type=int, nargs="+")
    sp.add_argument("--batch", type=_pair)
    sp.add_argument("--no-packed", action="store_true")
    sp.add_argument("--no-initial-state", action="store_true")
    sp.add_argument("--gates", nargs="+")
    sp.add_argument("--regimes", nargs="+")
    sp.add_argument("--no-qk-l2norm", action="store_true")
    sp.add_argument("--beta-activations", nargs="+", help="none, sigmoid, sigmoid2")
    sp.add_argument("--chunk-sizes", nargs="+", help="ints, or none (not passed)")
    a = ap.parse_args(argv)
    space: dict[str, Any] = {}
    for name in ("dtypes", "K", "V", "T", "T_multiple_of", "heads", "batch", "gates", "regimes"):
        if getattr(a, name) is not None:
            space[name] = tuple(getattr(a, name)) if isinstance(getattr(a, name), list) else getattr(a, name)
    if a.groups:
        space["groups"] = tuple(a.groups)
    if a.no_packed:
        space["packed"] = (False,)
    if a.no_initial_state:
        space["initial_state"] = (False,)
    if a.no_qk_l2norm:
        space["qk_l2norm"] = (False,)
    if a.beta_activations:
        space["beta_activations"] = tuple(None if b == "none" else b for b in a.beta_activations)
    if a.chunk_sizes:
        space["chunk_sizes"] = tuple(None if c == "none" else int(c) for c in a.chunk_sizes)
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
            fn, convention=a.convention, problems=problems(**space), backward=backward,
            max_examples=a.examples, seed=a.seed, device=a.device, deterministic=not a.nondeterministic,
        )  # fmt: skip
    except KernelCheckFailed as err:
        print(err)
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
