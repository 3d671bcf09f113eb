"""``python -m kda.vllm check [--model NAME]``: the one check of vLLM-CPU + kda, for every model family
(:mod:`kda.vllm.families`: a family gives its model builders, engine configurations and reference).
For each model of the family and each engine, one child process (``python -m kda.vllm _engine``,
:mod:`kda.vllm.check_worker`) runs the engine's phases, armed: uninitialized memory filled with NaN
and every parameter and buffer scanned after loading, on every rank; each phase is a row, its
greedy tokens compared with the family's reference.

The pass rule, one for every family (:meth:`Row.ok`):

* float32: every token equal to the reference's, up to a tie (the reference's log probabilities of
  both tokens within ``TIE_LOGPROB``: the request's later tokens are not compared), and the
  largest log-probability difference over the compared tokens within ``LOGPROB_TOL``;
* bfloat16: at least ``BF16_MIN_EQUAL`` of every 32 tokens equal (rounded up); log probabilities
  reported, not held: vLLM's and the reference's bfloat16 kernels round at different places;
* and no failure: the engine's error (a non-finite weight after loading, named), a completion of
  kda.vllm not in place, a repeated phase with no cached tokens, a speculative engine with no draft
  accepted or a token unequal to its non-speculative engine's, the family's own ``verify``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ._common import (
    BF16_MIN_EQUAL,
    LOGPROB_TOL,
    NONFINITE,
    TIE_LOGPROB,
    TOKENS,
    ChildFailed,
    Engine,
    Expected,
    Family,
    Phase,
    run_child,
)
from .families import REGISTRY, family

__all__ = ["Row", "check", "compare", "engines_to_run", "needed", "table", "verdict"]


def needed(dtype: str, total: int) -> int:
    """Tokens of ``total`` that must equal the reference's: all in float32, 7 of 8 in bfloat16."""
    if dtype == "float32":
        return total
    return total - (total * (TOKENS - BF16_MIN_EQUAL)) // TOKENS


@dataclass
class Row:
    """One (model, dtype, run) of the check: tokens equal of those compared, ties, the largest
    log-probability difference, the second pass's cached tokens, speculation's counts, the run's
    seconds, failures (each fails the row) and notes (printed below the table)."""

    model: str
    dtype: str
    run: str
    equal: int = 0
    total: int = 0
    ties: int = 0
    dlogprob: float | None = None
    cached: list[int] = field(default_factory=list)
    speculation: tuple[int, int] | None = None
    nonspec_equal: int | None = None
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        close = self.dtype != "float32" or self.dlogprob is None or self.dlogprob <= LOGPROB_TOL
        return self.total > 0 and self.equal >= needed(self.dtype, self.total) and close and not self.failures


def compare(row: Row, record: dict[str, Any], expected: list[Expected]) -> Row:
    """Fill ``row`` from the child's record of a phase and the reference's runs of its requests."""
    worst = 0.0
    for k, run in enumerate(record["passes"]):
        for i, (v, h) in enumerate(zip(run, expected)):
            compared = len(h.tokens)
            t = next((t for t, (a, b) in enumerate(zip(v["tokens"], h.tokens)) if a != b), None)
            if t is not None:
                a, b = v["tokens"][t], h.tokens[t]
                lp = h.logprobs[t]
                # a reference may know no log probability at a step (llama.cpp's: margins only)
                margin = abs(lp[b] - lp[a]) if a in lp and b in lp else math.inf
                tie = row.dtype == "float32" and margin < TIE_LOGPROB
                known = lp.get(b, math.nan), lp.get(a, math.nan)
                gap = f", the reference's logprobs {known[0]:.6f} against {known[1]:.6f}"
                if tie:  # the later tokens follow different contexts: not compared
                    row.ties, compared = row.ties + 1, t
                what = "a tie" if tie else "first differs"
                row.notes.append(
                    f"{row.model} {row.dtype} {row.run}: request {i} (pass {k + 1}) {what} at "
                    f"token {t}: vLLM {a}, reference {b}{gap}"
                )
            same = t if t is not None else compared
            for s in range(min(same, len(v["logprobs"]))):
                ref = h.logprobs[s].get(v["tokens"][s])
                if ref is not None:
                    worst = max(worst, abs(v["logprobs"][s] - ref))
            row.equal += sum(a == b for a, b in zip(v["tokens"][:compared], h.tokens[:compared]))
            row.total += compared
    row.dlogprob = worst
    row.seconds = record["seconds"]
    if len(record["passes"]) > 1:  # a repeated phase: every second-pass request served partly cached
        row.cached = [r["cached"] for r in record["passes"][-1]]
        if min(row.cached) <= 0:
            row.failures.append("no cached tokens on the second pass")
    if record.get("preemptions"):
        row.notes.append(f"{row.model} {row.dtype} {row.run}: {record['preemptions']} preemptions")
    return row


def _against(
    row: Row, got: dict[str, Any], plain: dict[str, Any] | None, phase: str, plain_phase: str
) -> None:
    """A speculative engine's row: its acceptance counts, and its tokens against the
    non-speculative engine's run of the same phase."""
    counts = got["speculation"]
    row.speculation = (counts["accepted"], counts["drafted"])
    row.nonspec_equal = 0
    if counts["accepted"] <= 0:
        row.failures.append("no draft token accepted")
    if plain is None or plain_phase not in plain:
        row.failures.append("no non-speculative run to compare with")
        return
    for i, (s, p) in enumerate(zip(got[phase]["passes"][0], plain[plain_phase]["passes"][0])):
        row.nonspec_equal += sum(a == b for a, b in zip(s["tokens"], p["tokens"]))
        if s["tokens"] != p["tokens"]:
            row.failures.append(f"request {i} differs from the non-speculative run")


def engines_to_run(fam: Family, names: tuple[str, ...] | None, dtypes: tuple[str, ...]) -> list[Engine]:
    """The engines ``check`` runs, in order: ``names`` (by default those marked ``default``), each
    one's ``against`` engine first when not among them, those running in none of ``dtypes`` left
    out; ``ValueError`` for a name the family does not have."""
    known = [e.name for e in fam.engines]
    picked = names or tuple(e.name for e in fam.engines if e.default)
    unknown = [n for n in picked if n not in known]
    if unknown:
        raise ValueError(f"unknown {unknown}; known: {known}")
    extra = [fam.engine(n).against for n in picked if fam.engine(n).against not in (None, *picked)]
    order = [fam.engine(n) for n in dict.fromkeys([*extra, *picked]) if n is not None]
    return [e for e in order if set(e.dtypes) & set(dtypes)]


def _failed(err: ChildFailed) -> str:
    """What a failed engine says: the non-finite weight a rank found, else the error's tail."""
    for line in err.output.splitlines():
        if line.startswith(NONFINITE):
            got = json.loads(line[len(NONFINITE) :])
            return f"non-finite after loading (rank {got['rank']}): {got['what']}"
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    return " / ".join(lines[:1] + lines[-3:])


def _run_engine(fam: Family, name: str, path: str, dtype: str, eng: Engine, spec: list[dict]) -> dict | str:
    """The child's record of ``eng``'s phases (``spec``, handed over in a file), or why it failed."""
    with tempfile.NamedTemporaryFile("w", prefix="kda-vllm-phases-", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        try:
            got = run_child(
                ["_engine", fam.name, path, dtype, eng.name, f.name],
                f"{fam.name} {name} {dtype} {eng.name}",
                env=eng.env,
            )
        except ChildFailed as err:
            return _failed(err)
    from .cpu_fixes import skipped

    missing = [k for k, v in got["completions"].items() if fam.fixes and not v and k not in skipped()]
    return f"completions {missing} not in place" if missing else got


def check(
    model: str = "kimi",
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    tokens: int = TOKENS,
    seed: int = 0,
    keep: str | None = None,
    models: tuple[str, ...] | None = None,
    engines: tuple[str, ...] | None = None,
) -> tuple[bool, list[Row]]:
    """Run family ``model``'s check: build each of ``models`` (default: all), run ``engines`` (default:
    those marked ``default``) in each of ``dtypes`` they run in, compare with the reference;
    ``(passed, rows)``. ``ValueError`` for a model or engine the family does not have."""
    fam = family(model)
    known = [m.name for m in fam.models]
    if models and [m for m in models if m not in known]:
        raise ValueError(f"--models: {[m for m in models if m not in known]} unknown; known: {known}")
    run = engines_to_run(fam, engines, dtypes)
    prompts = fam.prompts(seed)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix=f"kda-vllm-{fam.name}-") as tmp:
        for m in (m for m in fam.models if not models or m.name in models):
            mine = [e for e in run if m.engines is None or e.name in m.engines]
            if not mine:
                continue
            path = os.path.join(keep or tmp, m.name)
            os.makedirs(path, exist_ok=True)
            handle = m.build(path, seed)
            refs: dict[tuple[str, str, int], list[Expected]] = {}
            for dtype in dtypes:
                records: dict[str, Any] = {}
                for eng in (e for e in mine if dtype in e.dtypes):
                    phases = [(ph, ph.tokens or tokens) for ph in eng.phases]
                    spec = [
                        {
                            "name": eng.run_name(ph),
                            "prompts": prompts[ph.prompts],
                            "tokens": n,
                            "mode": ph.mode,
                        }
                        for ph, n in phases
                    ]
                    got = _run_engine(fam, m.name, path, dtype, eng, spec)
                    if isinstance(got, str):
                        rows += [Row(m.name, dtype, eng.run_name(ph), failures=[got]) for ph in eng.phases]
                        continue
                    records[eng.name] = got
                    for ph, n in phases:
                        rows.append(_row(fam, m.name, dtype, eng, ph, n, got, records, handle, prompts, refs))
    return bool(rows) and all(r.ok for r in rows), rows


def _row(
    fam: Family,
    model: str,
    dtype: str,
    eng: Engine,
    ph: Phase,
    n: int,
    got: dict[str, Any],
    records: dict[str, Any],
    handle: Any,
    prompts: dict[str, Any],
    refs: dict,
) -> Row:
    name = eng.run_name(ph)
    record = got[name]
    key = (dtype, ph.prompts, n)
    if fam.engine_reference or key not in refs:  # a transformers reference: once per prompts
        refs[key] = fam.reference(handle, prompts[ph.prompts], n, dtype, record)
    row = compare(Row(model, dtype, name), record, refs[key])
    if fam.verify is not None:
        row.failures += fam.verify(record["facts"])
    if eng.speculative:
        plain = fam.engine(eng.against).run_name(ph) if eng.against else ""
        _against(row, got, records.get(eng.against or ""), name, plain)
    return row


def table(rows: list[Row]) -> str:
    """The check's table, a line per row."""
    lines = [
        "| model | dtype | run | tokens equal | ties | logprob diff (max) | cached tokens (2nd pass) "
        "| speculation: = non-spec, accepted/drafted | vLLM s | pass |",
        "|" + " --- |" * 10,
    ]
    for r in rows:
        d = "" if r.dlogprob is None else f"{r.dlogprob:.2e}"
        s = ""
        if r.speculation is not None:
            (a, n), rate = r.speculation, r.speculation[0] / max(r.speculation[1], 1)
            s = f"{r.nonspec_equal}/{r.total}, {a}/{n} ({rate:.0%})"
        lines.append(
            f"| {r.model} | {r.dtype} | {r.run} | {r.equal}/{r.total} | {r.ties} | {d} | "
            f"{', '.join(map(str, r.cached))} | {s} | {r.seconds:.1f} | {'yes' if r.ok else 'NO'} |"
        )
    return "\n".join(lines)


def verdict(rows: list[Row]) -> str:
    """The lines below the table: each row's failures and notes, then PASS or FAIL with the rule."""
    lines = [f"{r.model} {r.dtype} {r.run}: FAILED: {f}" for r in rows for f in r.failures]
    lines += [n for r in rows for n in r.notes]
    ok = bool(rows) and all(r.ok for r in rows)
    lines.append(
        f"{'PASS' if ok else 'FAIL'}: float32 tokens all equal to the reference's (up to a tie), "
        f"log probabilities within {LOGPROB_TOL}; bfloat16 >= {BF16_MIN_EQUAL} of every {TOKENS} "
        "tokens equal; no engine error, non-finite weight or failed requirement"
    )
    return "\n".join(lines)


MODELS = tuple(REGISTRY)
