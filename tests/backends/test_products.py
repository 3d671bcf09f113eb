"""benchmarks.products: the list of the fused passes' products per chunk and the rates report."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BACKENDS

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="numba or scipy not installed")


def test_the_chunk_products_follow_the_block_sizes():
    """Forward and backward products of one chunk at the compiled block sizes: every product's
    shape within the chunk's arrays, the pairs' and solves' products one per block."""
    from benchmarks.products import chunk_products
    from kda.cpu import _compile as cfg

    C, D = 64, 128
    groups = chunk_products(C, D)
    blocks = C // min(cfg.SOLVE_BLOCK, C)
    subs = C // min(cfg.SUB_BLOCK, C) - 1
    assert len(groups["fwd"]) == subs + 1 + (2 * blocks - 1) + 2
    assert len(groups["bwd"]) == 3 * subs + 1 + (2 * blocks - 1) + 2 + (2 * blocks - 1) + 5
    for p in (p for ps in groups.values() for p in ps):
        assert {p.m, p.n, p.k} <= {*range(1, 2 * C + 1), D}, p
    # the state products: [kg; qg] S forward, [kg; qg]^T [dR; dO]^T backward
    assert (2 * C, D, D, False, False) in groups["fwd"]
    assert (D, D, 2 * C, True, True) in groups["bwd"]


def test_the_rates_report_prints_every_product(capsys):
    from benchmarks.products import chunk_products, report
    from kda.cpu._products import PATH

    times = report(16, 8)
    out = capsys.readouterr().out
    assert "products: " in out and f"{PATH.name}: {PATH.library}" in out
    for p in {p for ps in chunk_products(16, 8).values() for p in ps}:
        assert f"{p.label} " in out
    assert times["bwd"] > times["fwd"] > 0


# ----------------------------------------------------------------------------------------------
# the product path (kda.cpu._products.choose): one BLAS per process, chosen once, overridable


def test_a_bad_setting_names_the_variable():
    from kda import KdaError
    from kda.cpu._products import ENV, choose

    with pytest.raises(KdaError, match=rf"{ENV}: expected one of auto, scipy, mkl; got 'blas'"):
        choose("blas")


def test_auto_keeps_scipys_blas_off_intel_processors():
    from kda.cpu._products import choose

    for cpu in ("AuthenticAMD", ""):
        path, addresses = choose("auto", cpu)
        assert path.name == "scipy" and "not Intel's" in path.reason
        assert set(addresses) == {"s", "d"} and all(addresses.values())
    assert choose("scipy", "GenuineIntel")[0].name == "scipy"


def test_mkl_missing_or_ilp64_falls_back_on_auto_and_is_refused_when_asked(monkeypatch):
    from kda import KdaError
    from kda.cpu import _products

    monkeypatch.setattr(_products, "_mkl_files", list)
    path, _ = _products.choose("auto", "GenuineIntel")
    assert path.name == "scipy" and "no libmkl_rt found" in path.reason
    with pytest.raises(KdaError, match=r"KDA_CPU_PRODUCTS=mkl: no libmkl_rt found \(pip install 'kda"):
        _products.choose("mkl")
    monkeypatch.undo()
    monkeypatch.setenv("MKL_INTERFACE_LAYER", "ILP64")
    path, _ = _products.choose("auto", "GenuineIntel")
    assert path.name == "scipy" and "MKL_INTERFACE_LAYER=ILP64" in path.reason


# Run in a fresh process with KDA_CPU_PRODUCTS set (the path is bound once per process): a
# training-sized problem forward and backward, on all cores and on one, from inputs at six
# 4-byte offsets within a 64-byte line; prints the path and how many distinct results it saw.
_RUN = """
import hashlib, logging, os, sys
import numpy as np
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
sys.path.insert(0, "tests")
import kda
from helpers import make_problem
from kda.cpu._products import PATH
p = make_problem(7, 1, 4, 520, 64, 64, "mild").astype(np.float32)

def shifted(x, words):
    raw = np.empty(x.size + 32, x.dtype)
    start = (-raw.ctypes.data // x.itemsize) % 16 + words
    out = raw[start : start + x.size].reshape(x.shape)
    out[...] = x
    return out

def digest(inputs):
    out = kda.chunk_kda(*inputs, initial_state=p.initial_state, save_boundaries=True)
    grads = kda.chunk_kda_backward(*inputs, out.boundaries, p.grad_output, p.grad_final_state,
                                   initial_state=p.initial_state)
    flat = np.concatenate([x.ravel() for x in (out.output, out.final_state, *grads[:6])])
    np.save(sys.argv[1], flat)
    return hashlib.sha256(flat.tobytes()).hexdigest()

seen = {digest(p.inputs)}
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
seen |= {digest([shifted(x, words) for x in p.inputs]) for words in range(0, 16, 3)}
print("path", PATH.name, "results", len(seen))
"""


def _run_path(name: str, tmp_path) -> tuple[str, np.ndarray]:
    import os
    import subprocess
    import sys

    from helpers import ROOT

    out = tmp_path / f"{name}.npy"
    env = {**os.environ, "KDA_CPU_PRODUCTS": name}
    cmd = [sys.executable, "-c", _RUN, str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout, np.load(out)


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="needs os.sched_setaffinity")
def test_mkl_path_agrees_with_scipys_and_is_bitwise_reproducible(tmp_path):
    """Where MKL is installed: asked for, it is the path (logged); one training problem gives the
    same bits on all cores and on one and at six input alignments, and agrees with SciPy's path within the
    float32 tolerance (not bitwise: another BLAS rounds differently)."""
    from kda.cpu._products import _mkl

    if isinstance(_mkl(), str):
        pytest.skip("MKL (the mkl wheel, kda[mkl]) not installed")
    mkl_out, mkl = _run_path("mkl", tmp_path)
    scipy_out, ref = _run_path("scipy", tmp_path)
    assert "kda.cpu matrix products: mkl, " in mkl_out and "(KDA_CPU_PRODUCTS=mkl)" in mkl_out
    assert "path mkl results 1" in mkl_out and "path scipy results 1" in scipy_out
    assert not np.array_equal(mkl, ref)  # another BLAS did run
    assert np.max(np.abs(mkl - ref)) <= 1e-5 * np.max(np.abs(ref))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scratch_arrays_start_on_64_bytes(dtype):
    """empty2 (every _mm operand is made by it): C-contiguous, the shape asked for, its data on a
    64-byte boundary, whatever the allocator gave (many sizes, so many raw offsets)."""
    import numba

    from kda.cpu._products import empty2

    @numba.njit
    def make(rows, cols, x):
        a = empty2(rows, cols, x.dtype)
        a[:, :] = 1.0
        return a

    for rows, cols in [(1, 1), (3, 5), (7, 13), (64, 128), (16, 9), (2, 1)]:
        a = make(rows, cols, np.zeros(1, dtype))
        assert a.shape == (rows, cols) and a.dtype == dtype and a.flags.c_contiguous
        assert a.ctypes.data % 64 == 0 and a.sum() == rows * cols
