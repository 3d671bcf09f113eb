"""benchmarks.products: the list of the fused passes' products per chunk and the rates report."""

from __future__ import annotations

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

    times = report(16, 8)
    out = capsys.readouterr().out
    assert "products: " in out and "through numba_xxgemm" in out
    for p in {p for ps in chunk_products(16, 8).values() for p in ps}:
        assert f"{p.label} " in out
    assert times["bwd"] > times["fwd"] > 0
