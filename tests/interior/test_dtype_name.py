"""kda._dtypes.dtype_name: one name per dtype, whichever library spells it."""

from __future__ import annotations

import numpy as np
import pytest

from kda._dtypes import dtype_name


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (np.dtype(np.float32), "float32"),
        (np.float32, "float32"),
        (np.float64, "float64"),
        (np.dtype("float16"), "float16"),
        ("bfloat16", "bfloat16"),
    ],
)
def test_numpy_dtypes_and_names(dtype, name):
    assert dtype_name(dtype) == name


def test_bfloat16_from_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert dtype_name(ml_dtypes.bfloat16) == "bfloat16"
    assert dtype_name(np.dtype(ml_dtypes.bfloat16)) == "bfloat16"


def test_torch_dtypes():
    torch = pytest.importorskip("torch")
    for dtype, name in ((torch.float32, "float32"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
        assert dtype_name(dtype) == name
