"""Loading third-party reference kernels for comparison (flash-linear-attention's naive KDA)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

__all__ = ["load_fla_naive"]


def load_fla_naive(fresh: bool = False) -> tuple[Any, str]:
    """``fla.ops.kda.naive`` or the reason it is unavailable (the one loader of fla's reference,
    used by the benchmarks and the tests).

    ``import fla.ops`` needs triton; the naive reference needs only torch and einops, so when the
    package import fails the file itself is loaded. ``fresh``: always a new module loaded from
    the file (for callers that patch it).
    """
    try:
        import einops  # noqa: F401
        import torch  # noqa: F401
    except ImportError as err:
        return None, f"fla reference not run: {err} (pip install torch einops fla-core)"
    if not fresh:
        try:
            return importlib.import_module("fla.ops.kda.naive"), ""
        except ImportError:
            pass
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None, "fla reference not run: fla-core is not installed (pip install --no-deps fla-core)"
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    if not path.is_file():
        return None, f"fla reference not run: {path} not found in the installed fla"
    mod_spec = importlib.util.spec_from_file_location("_kda_bench_fla_naive", path)
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except Exception as err:
        return None, f"fla reference not run: loading {path} failed: {err!r}"
    return module, ""
