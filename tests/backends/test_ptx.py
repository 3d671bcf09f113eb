"""Every ``kda.cuda`` kernel compiles to PTX for compute capability 9.0 (the H200), in both dtypes.

Runs in a subprocess without Numba's CUDA simulator (which the rest of the suite switches on).
Checks that float32 kernels contain no float64 instruction (with 32- and 64-bit offsets), and,
where NVIDIA's ``ptxas`` is on the PATH (a CUDA toolkit's, as new as the one whose NVVM Numba
uses: an older one refuses the PTX version), assembles each float32 kernel for ``sm_90`` and
checks that none spills registers to local memory and that the fused kernels stay within their
register budgets. The register counts are printed (``pytest -s``) and recorded in docs/gpu.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT

# numba itself ships a ``numba.cuda`` (its old built-in target) that cannot compile these kernels to
# PTX without numba-cuda's NVVM bindings: the numba-cuda package is what the test needs
pytest.importorskip("numba_cuda", reason="numba-cuda is not installed (pip install kda[cuda])")

PTX_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
from numba import cuda
import kda.cuda
from kda.cuda._device import DTYPES, FAMILIES
ptxas = sys.argv[1] if len(sys.argv) > 1 else ""
report = {}
# both dtypes with 32-bit offsets; the 64-bit variants in float32 (where a float64 would hide)
variants = [(dtype, "uint32") for dtype in DTYPES] + [("float32", "uint64")]
with tempfile.TemporaryDirectory() as tmp:
    for dtype, index in variants:
      for family in FAMILIES:
        funcs = family.build(dtype, index)
        for name in family.signatures:
            ptx, _ = cuda.compile_ptx(funcs[name], family.signature(name, dtype, index), cc=(9, 0))
            info = {"bytes": len(ptx), "f64": len(re.findall(r"\.f64\b", ptx)), "entry": ".entry" in ptx}
            if ptxas and dtype == "float32":  # the dtype that matters for speed; ptxas is slow
                path = os.path.join(tmp, f"{name}_{dtype}_{index}.ptx")
                with open(path, "w") as fh:
                    fh.write(ptx)
                done = subprocess.run([ptxas, "-arch=sm_90", "-v", path, "-o", os.devnull],
                                      capture_output=True, text=True)
                log = done.stderr
                info["ptxas_rc"] = done.returncode
                regs = re.findall(r"Used (\d+) registers", log)
                spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
                info["registers"] = int(regs[0]) if regs else None
                info["spill_bytes"] = sum(int(a) + int(b) for a, b in spills)
            report[f"{name}/{dtype}/{index}"] = info
print(json.dumps(report))
"""


# registers per thread that the float32 kernels with 32-bit offsets may use (ptxas -arch=sm_90):
# the counts of docs/gpu.md (CUDA 13.0) plus about 15% for other ptxas versions. Multi-dimensional
# array arguments with Numba's signed 64-bit indexing took 114-230 in the fused kernels.
REGISTER_BUDGET = {
    "chunk_local": 90,
    "chunk_state_pass": 92,
    "chunk_state_pass_staged": 90,
    "chunk_state_grad_pass_staged": 147,
    "chunk_state_grad_pass": 96,
    "chunk_local_backward": 192,
    "gate_flags": 40,
}


def test_ptx_compiles_for_cc90():
    """Every kernel, both dtypes: PTX for cc 9.0; no float64 in float32 kernels; no spills (float32)."""
    import kda.cuda  # noqa: F401  (registers every family)
    from kda.cuda._device import FAMILIES

    env = {name: value for name, value in os.environ.items() if name != "NUMBA_ENABLE_CUDASIM"}
    root = str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    ptxas = shutil.which("ptxas") or ""
    done = subprocess.run(
        [sys.executable, "-c", PTX_SCRIPT, ptxas],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 3 * sum(len(f.signatures) for f in FAMILIES)
    print("\nkernel/dtype: registers, spill bytes (ptxas -arch=sm_90)" if ptxas else "\n(no ptxas)")
    for key, info in sorted(report.items()):
        assert info["entry"], key
        if "/float32/" in key:
            assert info["f64"] == 0, f"{key} uses float64 arithmetic ({info['f64']} .f64 operands)"
        if "ptxas_rc" in info:
            assert info["ptxas_rc"] == 0, f"ptxas rejected {key}"
            assert info["spill_bytes"] == 0, f"{key} spills {info['spill_bytes']} bytes"
            print(f"  {key}: {info['registers']} registers, {info['spill_bytes']} spill bytes")
            name, dtype, index = key.split("/")
            if dtype == "float32" and index == "uint32" and name in REGISTER_BUDGET:
                budget = REGISTER_BUDGET[name]
                assert info["registers"] <= budget, (
                    f"{key} uses {info['registers']} registers (budget {budget})"
                )
