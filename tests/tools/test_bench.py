"""``python -m benchmarks.chunk`` on a tiny problem: it runs, prints the table, writes the JSON (and plot)."""

from __future__ import annotations

import ast
import importlib.util
import json

import pytest
from helpers import ROOT

from benchmarks import chunk as _bench
from kda.testing import load_fla_naive

TINY = [
    "--parts",
    "sweep",
    "--H",
    "2",
    "--K",
    "16",
    "--V",
    "16",
    "--T",
    "64",
    "128",
    "--repeats",
    "1",
    "--gemm-n",
    "128",
]
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _run(tmp_path, capsys, *extra: str) -> tuple[dict, str]:
    assert _bench.main([*TINY, "--out", str(tmp_path), "--no-progress", *extra]) == 0
    out = capsys.readouterr().out
    return json.loads((tmp_path / "bench.json").read_text()), out


def test_bench_tiny_no_plot(tmp_path, capsys):
    report, out = _run(tmp_path, capsys, "--no-plot", "--backends", "chunk", "recurrent")
    for key in ("config", "machine", "flop_count", "gemm", "gemm_rate_gflops", "fla", "results", "memory"):
        assert key in report
    for key in ("cpu_model", "logical_cores", "numpy", "python", "blas", "env"):
        assert key in report["machine"]
    assert report["gemm_rate_gflops"] > 0
    assert all(row["time_s"] > 0 and row["gflops"] > 0 for row in report["gemm"])

    got = {(r["method"], r["pass"], r["T"]) for r in report["results"]}
    want = {(m, p, t) for m in ("chunk", "recurrent") for p in ("fwd", "fwd+bwd") for t in (64, 128)}
    assert got == want
    for r in report["results"]:
        assert r["status"] == "ok"
        assert r["time_s"] > 0 and all(t > 0 for t in r["times_s"])
        assert r["gflops"] > 0 and r["pct_gemm"] > 0
        assert r["speedup_vs_recurrent"] > 0 and r["speedup_vs_chunk"] > 0
        assert r["speedup_vs_fla_naive_chunk"] is None

    assert [m["T"] for m in report["memory"]] == [64, 128]
    for m in report["memory"]:
        assert m["peak_bytes"] > 0 and m["essential_bytes"] > 0 and m["ratio"] > 0
        assert set(m["essential_breakdown"]) == {"inputs", "outputs", "boundaries", "gradients"}

    assert "x recurrent" in out and "GFLOP/s" in out and "peak memory" in out
    assert "chunk" in out and "recurrent" in out
    assert not (tmp_path / "bench.png").exists()
    assert report["files"]["png"] is None


def test_bench_caps_and_skips(tmp_path, capsys):
    report, out = _run(
        tmp_path, capsys, "--no-plot", "--no-memory", "--backends", "recurrent", "--recurrent-max-T", "64"
    )
    rows = {(r["pass"], r["T"]): r for r in report["results"]}
    assert rows["fwd", 64]["status"] == "ok"
    assert rows["fwd", 128]["status"] == "skipped" and rows["fwd", 128]["time_s"] is None
    assert "skipped (T > cap 64)" in out
    assert report["memory"] == []


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib not installed")
def test_bench_tiny_plot(tmp_path, capsys):
    report, out = _run(tmp_path, capsys, "--backends", "chunk", "--no-memory")
    png = tmp_path / "bench.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["files"]["png"] == str(png)
    assert str(png) in out


def test_bench_fla_reference(tmp_path, capsys):
    fla, reason = load_fla_naive()
    if fla is None:
        pytest.skip(reason)
    report, out = _run(tmp_path, capsys, "--no-plot", "--no-memory", "--T", "64", "--backends", "fla_naive")
    assert report["fla"]["available"]
    errs = report["fla"]["agreement"]["max_rel_error"]
    for name in ("naive_chunk_kda", "naive_recurrent_kda"):
        assert set(errs[name]) >= {"output", "final_state", "grad_q", "grad_g", "grad_beta"}
        assert max(errs[name].values()) < 1e-4  # fla computes in float32
    methods = {r["method"] for r in report["results"] if r["status"] == "ok"}
    assert methods == {"fla_naive_chunk", "fla_naive_recurrent"}
    assert "fla" in out


def test_bench_bad_arguments(tmp_path, capsys):
    assert _bench.main(["--H", "0", "--out", str(tmp_path)]) == 2
    assert "--H" in capsys.readouterr().err


INFERENCE = [
    "--short-shape",
    "1",
    "2",
    "8",
    "8",
    "--short-T",
    "1",
    "2",
    "4",
    "--decode-shape",
    "2",
    "2",
    "8",
    "8",
]
INFERENCE += [
    "--plan-shape",
    "1",
    "2",
    "8",
    "8",
    "--plan-T",
    "16",
    "40",
    "--repeats",
    "1",
    "--min-sample",
    "0",
]


def test_bench_inference_parts(tmp_path, capsys):
    """The short-sequence, decode and plan parts alone: numbers, crossover, summary lines."""
    argv = ["--parts", "short", "decode", "plan", *INFERENCE, "--out", str(tmp_path), "--no-progress"]
    assert _bench.main([*argv, "--no-plot"]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "bench.json").read_text())
    assert "results" not in report and set(report["inference"]) == {"short", "decode", "plan"}
    short = report["inference"]["short"]
    assert {(r["method"], r["pass"], r["T"]) for r in short["rows"]} == {
        (m, p, t)
        for m in ("chunk_kda", "chunked_forced", "recurrent_kda")
        for p in ("fwd", "fwd+bwd")
        for t in (1, 2, 4)
    }
    assert all(r["time_s"] > 0 for r in short["rows"])
    assert short["summary"]["T=1 chunk_kda / recurrent_kda fwd"] > 0
    decode = report["inference"]["decode"]
    assert (
        decode["copy_touched_states"]["bytes"] == 2 * 2 * 8 * 8 * 4 and decode["summary"]["decode / copy"] > 0
    )
    assert [(r["T"], r["pass"]) for r in report["inference"]["plan"]["rows"]] == [
        (16, "fwd"),
        (16, "bwd"),
        (40, "fwd"),
        (40, "bwd"),
    ]
    assert "crossover fwd" in out and "decode_kda" in out and "per-call overhead" in out


def test_crossover():
    from benchmarks.inference import crossover

    def rows(wins):
        out = []
        for T, win in wins:
            out += [{"method": "chunked_forced", "pass": "fwd", "T": T, "time_s": 1.0 if win else 3.0},
                    {"method": "recurrent_kda", "pass": "fwd", "T": T, "time_s": 2.0}]  # fmt: skip
        return out

    assert crossover(rows([(1, False), (2, False), (4, True), (8, True)]), "fwd") == 4
    assert crossover(rows([(1, False), (2, True), (4, False), (8, True)]), "fwd") == 8  # wins from 8 on only
    assert crossover(rows([(1, False), (2, False)]), "fwd") is None


# ------------------------------------------------------------------------------------------------
# benchmarks/ as a whole: one definition of what they share, no import cycle

BENCHMARKS = ROOT / "benchmarks"
# what benchmarks/_common.py defines once (inputs, GEMM reference, timer, machine description):
# no other benchmark module may define its own
SHARED = {"_inputs", "_gemm_rate", "_timed", "_machine", "_cpu_model"}


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(BENCHMARKS.glob("*.py"))}


def _imports(name: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The benchmarks modules ``name`` imports anywhere (top level or inside functions)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "benchmarks" and len(parts) > 1:
                    out.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1 or module == "benchmarks" or module.startswith("benchmarks."):
                base = (module if node.level else module.removeprefix("benchmarks")).lstrip(".")
                if base:
                    out.add(base.split(".")[0])
                else:  # from . import x / from benchmarks import x
                    out.update(a.name for a in node.names)
    return (out & modules) - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return [*path[path.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_benchmarks_share_one_definition_of_inputs_gemm_timer_and_machine():
    trees = _modules()
    assert "_common" in trees
    common = {n.name for n in trees["_common"].body if isinstance(n, ast.FunctionDef)}
    assert {"inputs", "draw", "gemm_rate", "rounds", "timed", "machine", "describe"} <= common
    for name, tree in trees.items():
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        own = defined & SHARED
        assert not own, f"benchmarks/{name}.py defines its own {sorted(own)}: use benchmarks._common"
        # gate regimes come from kda.testing: no private table of them
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "REGIMES" for t in node.targets):
                raise AssertionError(f"benchmarks/{name}.py defines REGIMES: use kda.testing.LOG_REGIMES")


def test_the_benchmarks_import_graph_is_acyclic():
    trees = _modules()
    graph = {name: _imports(name, tree, set(trees)) for name, tree in trees.items()}
    assert graph["llama_cpp"] and graph["gates"], "the import scan finds nothing: it is broken"
    assert _cycle(graph) is None, f"import cycle among benchmarks: {' -> '.join(_cycle(graph))}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_common_inputs_draw_kda_testings_gates():
    """The benchmarks' gates are kda.testing's draws (the tests' regimes), in both layouts."""
    import numpy as np

    import kda.testing as kt
    from benchmarks import _common

    for regime in kt.LOG_REGIMES:
        x = _common.inputs(1, 2, 5, 4, 3, np.float64, 7, regime=regime)
        rng = np.random.default_rng(7)
        for name in ("q", "k", "v"):
            _common.draw(name, x[name].shape, rng, np.float64)
        assert np.array_equal(x["g"], kt.gates(rng, (1, 2, 5, 4), regime), equal_nan=True)
        tm = _common.inputs(1, 2, 5, 4, 3, np.float64, 7, regime=regime, layout="time_major")
        assert np.array_equal(tm["g"], np.swapaxes(x["g"], 1, 2)) and tm["g"].flags.c_contiguous
    assert set(x) == set(_common.INPUT_NAMES)
    assert np.allclose(np.linalg.norm(x["k"], axis=-1), 1.0)
