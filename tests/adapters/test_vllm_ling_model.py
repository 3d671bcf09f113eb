"""kda.vllm.ling_model: the tiny Ling-3's layer grouping, config fields and checkpoint names (no vLLM)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")
lm = pytest.importorskip("kda.vllm.ling_model")


@pytest.mark.parametrize(("layers", "group"), [(5, 4), (20, 5), (4, 8), (9, 3)])
def test_grouping(layers, group):
    """vLLM's rule (``_is_kda_layer``) and llama.cpp's (``is_full_attention``), written out here."""
    kda = [lm.is_kda_layer(i, layers, group) for i in range(layers)]
    full = [i >= layers or (i + 1) % group == 0 or i >= layers // group * group for i in range(layers)]
    assert kda == [not f for f in full]
    if layers == 5 and group == 4:
        assert kda == [True, True, True, False, False]


def test_checkpoint(tmp_path):
    from safetensors.torch import load_file

    cfg = lm.build_model(str(tmp_path), seed=1)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk == cfg and cfg["model_type"] == "bailing_hybrid"
    # what llama.cpp's converter (conversion/bailingmoe3.py) requires
    assert cfg["no_kda_lora"] and cfg["kda_safe_gate"] and cfg["kda_lower_bound"] == -5.0
    assert cfg["gated_attention_proj_granularity_type"] == "head_wise"
    assert os.path.exists(tmp_path / "configuration_bailing_moe_v3.py")
    t = load_file(str(tmp_path / "model.safetensors"))
    H, K, D = lm.HEADS, lm.HEAD_DIM, lm.HIDDEN
    for i in range(lm.LAYERS):
        a = f"model.layers.{i}.attention."
        if lm.is_kda_layer(i):
            assert t[a + "f_proj.weight"].shape == (H * K, D) and t[a + "b_proj.weight"].shape == (H, D)
            assert t[a + "q_conv1d.weight"].shape == (H * K, 1, 4) and t[a + "A_log"].shape == (H,)
            assert a + "kv_b_proj.weight" not in t
        else:
            assert t[a + "g_proj.weight"].shape == (H, D)  # head-wise output gate
            assert t[a + "kv_b_proj.weight"].shape == (H * (lm.NOPE + lm.V_DIM), lm.KV_LORA)
            assert t[a + "q_b_proj.weight"].shape == (H * (lm.NOPE + lm.ROPE), lm.Q_LORA)
            assert a + "f_proj.weight" not in t
        mlp = f"model.layers.{i}.mlp."
        if i < cfg["first_k_dense_replace"]:
            assert mlp + "gate_proj.weight" in t and mlp + "gate.weight" not in t
        else:
            assert t[mlp + "gate.expert_bias"].shape == (lm.EXPERTS,)
            assert {f"{mlp}experts.{e}.down_proj.weight" for e in range(lm.EXPERTS)} <= set(t)
    again = str(tmp_path / "again")
    lm.build_model(again, seed=1)
    assert all((load_file(os.path.join(again, "model.safetensors"))[k] == v).all() for k, v in t.items())


def test_family_spec():
    """``check --model ling``'s spec: every phase's prompts exist, engine names unique, the spec
    module within the family interface's 150 lines."""
    fam = pytest.importorskip("kda.vllm.families.ling").FAMILY
    prompts = fam.prompts(0)
    names = [e.name for e in fam.engines]
    assert len(set(names)) == len(names) and fam.name == "ling"
    for engine in fam.engines:
        assert engine.args.get("trust_remote_code") is True, engine.name
        for phase in engine.phases:
            assert phase.prompts in prompts, (engine.name, phase.name)
    assert [len(p) for p in prompts["concurrent"]] == [50, 120, 200, 275, 348]
    path = fam.reference.__code__.co_filename
    with open(path) as f:
        assert len(f.read().splitlines()) < 150


def test_mix_scales_the_output_projections_only(tmp_path):
    """``mix`` (the speculative row's ``ling-repeat``): the same draws, every layer's output
    projection (KDA ``o_proj``, MLA ``dense``, each ``down_proj``) times ``mix``, nothing else."""
    from safetensors.torch import load_file

    lm.build_model(str(tmp_path / "a"), seed=3)
    lm.build_model(str(tmp_path / "b"), seed=3, mix=0.3)
    a = load_file(str(tmp_path / "a" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(a) == set(b)
    scaled = [k for k in a if k.endswith(("o_proj.weight", "attention.dense.weight", "down_proj.weight"))]
    assert len(scaled) == 3 + 2 + 1 + (lm.LAYERS - 1) * (lm.EXPERTS + 1)
    for k in a:
        want = a[k] * 0.3 if k in scaled else a[k]
        assert (b[k] - want).abs().max() <= 1e-6 * a[k].abs().max(), k


def test_family_spec_speculation_on_the_repeating_model():
    """The ``spec`` engine runs by default, on ``ling-repeat`` only (on ``ling`` no draft is right),
    against the default engine, which runs on both models; so does ``bf16``."""
    fam = pytest.importorskip("kda.vllm.families.ling").FAMILY
    spec, models = fam.engine("spec"), {m.name: m for m in fam.models}
    assert spec.default and spec.against == "default" and spec.speculative
    assert "spec" not in models["ling"].engines and "spec" in models["ling-repeat"].engines
    assert "default" in models["ling"].engines and "default" in models["ling-repeat"].engines
    # bfloat16: by default on ling-repeat; on ling (a near tie in its MoE group routing) on request
    assert fam.engine("bf16").default and not fam.engine("bf16-tie").default
    assert "bf16" in models["ling-repeat"].engines and "bf16-tie" in models["ling"].engines
