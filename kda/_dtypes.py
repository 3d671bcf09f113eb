"""Dtype names across array libraries: the one spelling the option checks, the pools and
:mod:`kda.testing` compare dtypes by."""

from __future__ import annotations

from typing import Any

__all__ = ["dtype_name"]


def dtype_name(dtype: Any) -> str:
    """The name of ``dtype``: ``"float32"``, ``"bfloat16"``, ...

    Parameters
    ----------
    dtype : a NumPy dtype or scalar type (``np.dtype("float16")``, ``np.float32``), an
        ``ml_dtypes`` type, a torch or JAX dtype, or a name (returned as it is).

    Returns
    -------
    str
        The dtype's ``name``, else its type's ``__name__``, else the last dotted part of its
        string (``torch.bfloat16`` -> ``"bfloat16"``). Nothing is checked: callers compare the
        name with the dtypes they accept.
    """
    if isinstance(dtype, str):
        return dtype
    name = getattr(dtype, "name", None)
    if not isinstance(name, str):
        name = getattr(dtype, "__name__", None)
    return name if isinstance(name, str) else str(dtype).rpartition(".")[2]
