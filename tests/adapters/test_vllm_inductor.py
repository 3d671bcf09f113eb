"""kda.vllm's ``inductor_isa`` completion (:func:`kda.vllm.cpu_fixes.key_inductor_isa`): inductor's
FX graph cache key names the vector ISA its C++ was written for, so that a graph cached under
AVX-512 is not reused under AVX2 (``ATEN_CPU_CAPABILITY=avx2``), where its 16-lane loops, compiled
with 8-lane vectors, leave half of each output unwritten (vLLM-CPU's tensor-parallel embedding
mask: token ids out of range).

Needs torch only: vLLM is not imported (``tests/adapters/test_vllm_e2e.py`` runs the tensor-parallel
engine).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers import ROOT

torch = pytest.importorskip("torch")
cpu_fixes = pytest.importorskip("kda.vllm.cpu_fixes")
patch = pytest.importorskip("kda.vllm._patch")

X86 = platform.machine() in ("x86_64", "AMD64")

# a child process: torch.compile (inductor, dynamic shapes) of an embedding-style input mask, as
# vLLM's get_masked_input_and_mask, against eager; argv[1] == "1": kda's completion first
CHILD = """
import sys
import torch
if sys.argv[1] == "1":
    import torch._inductor.config as config
    from kda.vllm.cpu_fixes import key_inductor_isa
    key_inductor_isa(config)
def mask(x, lo: int, hi: int):
    m = (x >= lo) & (x < hi)
    return m * (x - lo), ~m
f = torch.compile(mask, dynamic=True, backend="inductor")
ok = True
for n in (16, 37, 100):
    x = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
    for lo, hi in ((0, 64), (64, 128)):
        got, ref = f(x, lo, hi), mask(x, lo, hi)
        ok = ok and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
print(torch.backends.cpu.get_cpu_capability(), "equal" if ok else "differ")
"""


def _config(simdlen: int | None) -> SimpleNamespace:
    return SimpleNamespace(cpp=SimpleNamespace(simdlen=simdlen))


@pytest.mark.skipif(not X86, reason="the completion sets the width on x86 only")
def test_width_from_aten_capability() -> None:
    """Unset ``simdlen`` becomes the width of ATen's capability (AVX-512 512, AVX2 256, none 0)."""
    cap = torch.backends.cpu.get_cpu_capability()
    want = {"AVX512": 512, "AVX2": 256, "DEFAULT": 0}[cap]
    config = _config(None)
    with patch.patches():
        cpu_fixes.key_inductor_isa(config)
        assert config.cpp.simdlen == want and patch.is_patched(config.cpp, "simdlen")
    assert config.cpp.simdlen is None, "undone with the other patches"


def test_user_width_kept() -> None:
    """A ``simdlen`` the user set is kept."""
    config = _config(128)
    with patch.patches() as made:
        cpu_fixes.key_inductor_isa(config)
    assert config.cpp.simdlen == 128 and made == []


def _run(cache: str, fix: bool, capability: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env.update(TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    p = subprocess.run(
        [sys.executable, "-c", CHILD, "1" if fix else "0"],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split()[-2:]


@pytest.mark.skipif(
    not X86 or torch.backends.cpu.get_cpu_capability() != "AVX512" or shutil.which("g++") is None,
    reason="needs an AVX-512 host (AVX2 forced through ATEN_CPU_CAPABILITY) and g++ for inductor",
)
def test_cache_not_shared_across_isas(tmp_path) -> None:
    """One inductor cache, the mask compiled under AVX-512 and then under ``ATEN_CPU_CAPABILITY=avx2``:
    with the completion in both processes the AVX2 run compiles its own graph and equals eager.
    Without it (first two runs, kept as the control: the fault the completion stands in for, while
    torch has it) the AVX2 run reuses the AVX-512 graph and differs."""
    control = str(tmp_path / "control")
    assert _run(control, fix=False, capability=None) == ["AVX512", "equal"]
    control_avx2 = _run(control, fix=False, capability="avx2")
    keyed = str(tmp_path / "keyed")
    assert _run(keyed, fix=True, capability=None) == ["AVX512", "equal"]
    assert _run(keyed, fix=True, capability="avx2") == ["AVX2", "equal"], control_avx2
    if control_avx2 != ["AVX2", "differ"]:
        pytest.xfail(f"torch's inductor cache no longer mixes ISAs here (control: {control_avx2})")
