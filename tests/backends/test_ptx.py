"""Every ``kda.cuda`` kernel compiles to PTX for compute capability 9.0 (the H200), in every dtype it takes.

Runs in a subprocess without Numba's CUDA simulator (which the rest of the suite switches on).
Compiles every kernel of every family for each dtype the family accepts (``Family.dtypes``:
float32 and float64, and float16 for the gate check) with 32-bit offsets and in float32 with
64-bit offsets, and the decode kernel in its dtypes and 16-bit pools; checks that float32 and float16 kernels
contain no float64 instruction, and that no kernel flushes subnormals to zero (no ``.ftz``
outside libdevice's ``expf``: docs/gpu.md, "Subnormal floats"). Where NVIDIA's ``ptxas`` is
found (on the PATH, under ``CUDA_HOME`` or ``/usr/local/cuda``, or in an ``nvidia-cuda-nvcc``
wheel; as new as the CUDA whose NVVM Numba uses: an older one refuses the PTX version) it
assembles every variant for ``sm_90`` and checks that none spills registers or keeps a stack
frame (a local array left in memory), and that the fused kernels stay within their register
budgets. The register counts are printed (``pytest -s``) and recorded in docs/gpu.md.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
from helpers import ROOT

# numba itself ships a ``numba.cuda`` (its old built-in target) that cannot compile these kernels to
# PTX without numba-cuda's NVVM bindings: the numba-cuda package is what the test needs
pytest.importorskip("numba_cuda", reason="numba-cuda is not installed (pip install kda[cuda])")

PTX_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
from numba import cuda
import kda.cuda
from kda.cuda._device import FAMILIES
ptxas = sys.argv[1] if len(sys.argv) > 1 else ""
report = {}
# (family name, kernel, dtype, index, python function, signature)
jobs = []
for family in FAMILIES:
    variants = [(dtype, "uint32") for dtype in family.dtypes] + [("float32", "uint64")]
    for dtype, index in variants:
        for kn in family.kernels:
            jobs.append((kn.name, dtype, index, kn.function(dtype, index), kn.signature(dtype, index)))
try:  # the decode kernel compiles itself (kda/cuda/_decode.py), outside the families
    from kda.cuda._decode import DTYPES as DECODE_DTYPES, build_decode_kernel, decode_signature
except ImportError:
    pass
else:
    for dtype, index in [(d, "uint32") for d in DECODE_DTYPES] + [("float32", "uint64")]:
        jobs.append(("decode_forward", dtype, index, build_decode_kernel(dtype, index),
                     decode_signature(dtype, index)))
    # its 16-bit pools (float16, and bfloat16 as int16 bits) computed in float32, both layouts
    from kda.cuda import _decode
    for pool in getattr(_decode, "HALF_POOLS", {}).values():
        for v_first in (False, True):
            jobs.append((f"decode_forward[{pool} pool{', v_first' if v_first else ''}]", "float32",
                         "uint32", build_decode_kernel("float32", "uint32", pool=pool, v_first=v_first),
                         decode_signature("float32", "uint32", pool=pool)))
with tempfile.TemporaryDirectory() as tmp:
    for name, dtype, index, func, sig in jobs:
        key = f"{name}/{dtype}/{index}"
        try:
            ptx, _ = cuda.compile_ptx(func, sig, cc=(9, 0))
        except Exception as err:
            report[key] = {"error": f"{type(err).__name__}: {err}"[:2000]}
            continue
        info = {"bytes": len(ptx), "f64": len(re.findall(r"\.f64\b", ptx)), "entry": ".entry" in ptx}
        # flush-to-zero anywhere but libdevice's expf (ex2.approx.ftz of its reduced argument,
        # never subnormal; the scaling after it is a plain mul, so subnormal results survive)
        info["ftz"] = len(re.findall(r"\.ftz\b", ptx)) - len(re.findall(r"\bex2\.approx\.ftz\.f32\b", ptx))
        if ptxas:
            path = os.path.join(tmp, f"{name}_{dtype}_{index}.ptx")
            with open(path, "w") as fh:
                fh.write(ptx)
            done = subprocess.run([ptxas, "-arch=sm_90", "-v", path, "-o", os.devnull],
                                  capture_output=True, text=True)
            log = done.stderr
            info["ptxas_rc"] = done.returncode
            info["ptxas_log"] = log[-1500:]
            regs = re.findall(r"Used (\d+) registers", log)
            spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            stack = re.findall(r"(\d+) bytes stack frame", log)
            info["registers"] = int(regs[0]) if regs else None
            info["spill_bytes"] = sum(int(a) + int(b) for a, b in spills)
            info["stack_bytes"] = sum(int(a) for a in stack)
        report[key] = info
print(json.dumps(report))
"""


# registers per thread that the float32 kernels with 32-bit offsets may use (ptxas -arch=sm_90):
# the counts of docs/gpu.md (CUDA 13.0) plus about 15% for other ptxas versions. Multi-dimensional
# array arguments with Numba's signed 64-bit indexing took 114-230 in the fused kernels.
REGISTER_BUDGET = {
    "chunk_local": 100,
    "chunk_state_pass": 92,
    "chunk_state_pass_staged": 90,
    "chunk_state_grad_pass_staged": 147,
    "chunk_state_grad_pass": 96,
    "chunk_local_backward": 192,
    "gate_flags": 40,
}


def find_ptxas() -> str:
    """NVIDIA's ptxas: on the PATH, under CUDA_HOME or /usr/local/cuda, or in an nvidia-cuda-nvcc
    wheel (``nvidia/cuda_nvcc/bin`` for CUDA 12, ``nvidia/cu13/bin`` for 13); "" if none."""
    found = shutil.which("ptxas")
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    site = sysconfig.get_paths()["purelib"]
    candidates = [os.path.join(h, "bin", "ptxas") for h in homes if h]
    candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "bin", "ptxas")), reverse=True)
    return next((c for c in candidates if os.access(c, os.X_OK)), "")


def test_ptx_compiles_for_cc90():
    """Every kernel, every dtype it takes: PTX for cc 9.0; no float64 in float32 or float16
    kernels; assembled by ptxas where found: no spills, no stack frame, registers in budget."""
    import kda.cuda  # noqa: F401  (registers every family)
    from kda.cuda._device import FAMILIES

    env = {name: value for name, value in os.environ.items() if name != "NUMBA_ENABLE_CUDASIM"}
    root = str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    ptxas = find_ptxas()
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
    failed = {key: info["error"] for key, info in report.items() if "error" in info}
    assert not failed, f"kernels that do not compile to PTX: {failed}"
    expected = sum(len(f.kernels) * (len(f.dtypes) + 1) for f in FAMILIES)
    assert len([k for k in report if not k.startswith("decode_forward")]) == expected
    gate_dtypes = {k.split("/")[1] for k in report if k.startswith("gate_flags/")}
    assert gate_dtypes == {"float16", "float32", "float64"}
    print(f"\nkernel/dtype/offsets: registers, spill and stack bytes (ptxas -arch=sm_90: {ptxas})" if ptxas
          else "\n(no ptxas found: PTX compiled, not assembled)")  # fmt: skip
    for key, info in sorted(report.items()):
        assert info["entry"], key
        if "/float64/" not in key:
            assert info["f64"] == 0, f"{key} uses float64 arithmetic ({info['f64']} .f64 operands)"
        assert info["ftz"] == 0, f"{key} flushes subnormals to zero ({info['ftz']} .ftz outside expf)"
        if "ptxas_rc" in info:
            assert info["ptxas_rc"] == 0, f"ptxas rejected {key}: {info['ptxas_log']}"
            assert info["spill_bytes"] == 0, f"{key} spills {info['spill_bytes']} bytes"
            assert info["stack_bytes"] == 0, f"{key} keeps a {info['stack_bytes']}-byte stack frame"
            print(f"  {key}: {info['registers']} registers, {info['spill_bytes']} spill bytes")
            name, dtype, index = key.split("/")
            if dtype == "float32" and index == "uint32" and name in REGISTER_BUDGET:
                budget = REGISTER_BUDGET[name]
                assert info["registers"] <= budget, (
                    f"{key} uses {info['registers']} registers (budget {budget})"
                )
