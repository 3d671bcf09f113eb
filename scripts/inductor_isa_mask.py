"""Inductor's FX graph cache reused across vector ISAs (PyTorch alone; docs/vllm.md, completion
``inductor_isa``): an embedding mask as vLLM's vocabulary-parallel embedding computes it, compiled
with ``torch.compile`` and compared with the eager result. On an AVX-512 host, in one fresh cache::

    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    python scripts/inductor_isa_mask.py                           # True
    ATEN_CPU_CAPABILITY=avx2 python scripts/inductor_isa_mask.py  # False: the AVX-512 graph reused

In a fresh cache the AVX2 run alone prints True.
"""

import torch


def mask(x, lo: int, hi: int):
    m = (x >= lo) & (x < hi)
    return m * (x - lo), ~m


x = torch.arange(100)
print(torch.equal(torch.compile(mask, dynamic=True)(x, 64, 128)[0], mask(x, 64, 128)[0]))
