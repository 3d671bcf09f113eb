"""One contiguity predicate in kda: ``kda._options.arguments.c_contiguous``.

Every test of an array's contiguity in kda goes through it (and through ``slot_stride``, which
asks it about a pool's rows): no other module, ``kda/vllm`` included, reads an array's contiguity
flag, asks a tensor ``is_contiguous()`` or compares strides itself (read from the source). The
predicate and the pools' slot stride are checked here on every kind of array a call can bring.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import ROOT

from kda._options.arguments import c_contiguous, slot_stride

PREDICATE = ROOT / "kda" / "_options" / "arguments.py"
# an inline contiguity test: NumPy's / CuPy's flag, torch's method, a stride compared in a loop
INLINE = re.compile(r"\.flags\.[cf]_contiguous|\.is_contiguous\(|\.strides\[1:\]|\.stride\(\)\[")


def test_no_inline_contiguity_test():
    found = []
    for path in sorted((ROOT / "kda").rglob("*.py")):
        if path == PREDICATE:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if INLINE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "contiguity tested outside c_contiguous:\n" + "\n".join(found)


def test_c_contiguous_numpy():
    a = np.zeros((3, 4, 5))
    assert c_contiguous(a) and c_contiguous(a, a[1], a[:1], a[:, :1][:1])
    assert not c_contiguous(a.transpose(0, 2, 1))
    assert not c_contiguous(a, a[:, ::2])  # one of several
    assert c_contiguous()


def test_c_contiguous_torch():
    torch = pytest.importorskip("torch")
    t = torch.zeros(3, 4, 5)
    assert c_contiguous(t) and not c_contiguous(t.transpose(1, 2))
    assert not c_contiguous(np.zeros(3), t.transpose(1, 2))


def test_c_contiguous_jax():
    jnp = pytest.importorskip("jax.numpy")
    assert c_contiguous(jnp.zeros((3, 4)))  # no strides to ask about


def test_slot_stride():
    pool = np.zeros((4, 2, 3, 5), np.float32)
    assert slot_stride(pool) == 30
    padded = np.zeros((4, 40), np.float32)[:, :30].reshape(4, 2, 3, 5)  # rows 40 elements apart
    assert not c_contiguous(padded) and slot_stride(padded) == 40
    assert slot_stride(pool.transpose(0, 1, 3, 2)) is None  # rows not C-contiguous
    assert slot_stride(pool[::-1]) is None  # a negative slot stride
    overlapping = np.lib.stride_tricks.as_strided(pool, (4, 2, 3, 5), (40, 60, 20, 4))
    assert slot_stride(overlapping) is None  # rows 10 elements apart, 30 long
