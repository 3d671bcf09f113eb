"""The one table of what each backend runs and when it is chosen (:data:`CAPABILITIES`), and
what is generated from it: the README's backend table (:func:`backend_table`), the ``backend``
entry of the entry points' docstrings (:func:`backend_doc`) and which backends are installed here
(:func:`installed_backends`, which the tests run on). Adding a backend is its folder plus its row
here (and, to be chosen by default, a line in :func:`kda._backend.dispatch.get_backend`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

__all__ = ["BACKENDS", "CAPABILITIES", "Capability", "backend_doc", "backend_table", "cpu_available",
           "installed_backends"]  # fmt: skip


class Capability(NamedTuple):
    """One backend: what it runs and when it is chosen (a row of :data:`CAPABILITIES`)."""

    name: str
    module: str
    arrays: str  # what it computes, and how (the README's "arrays" column)
    chosen: str  # when the dispatch picks it (the README's "chosen" column)
    requires: tuple[str, ...]  # top-level packages it needs installed (beyond kda's own)
    summary: str  # one phrase for the ``backend`` docstrings


CAPABILITIES: tuple[Capability, ...] = (
    Capability(
        "cpu", "kda.cpu", "NumPy; Numba kernels, BLAS products, one worker per core",
        "by default for NumPy arrays", ("numba", "scipy"),
        "NumPy arrays, Numba kernels (the default for them where numba and scipy are installed)",
    ),
    Capability(
        "reference", "kda.reference",
        "any array-API namespace (NumPy, array-api-strict, PyTorch CPU tensors, ...)",
        'for every other namespace, or `backend="reference"`', (),
        "any array-API namespace (the default for every other one)",
    ),
    Capability(
        "cuda", "kda.cuda", "CuPy; Numba-CUDA kernels on CuPy's stream",
        'for CuPy arrays (`pip install -e ".[cuda]"`, or `".[cuda13]"` for a CUDA 13 driver: `docs/gpu.md`)',
        ("numba", "numba_cuda"), "CuPy arrays, Numba-CUDA kernels (the default for them)",
    ),
)  # fmt: skip

# name -> module implementing the primitive interface
BACKENDS = {c.name: c.module for c in CAPABILITIES}
_CAPABILITY = {c.name: c for c in CAPABILITIES}


def backend_table() -> str:
    """The README's table of backends (markdown), from :data:`CAPABILITIES`."""
    rows = ["| backend | arrays | chosen |", "| --- | --- | --- |"]
    rows += [
        f"| `{c.name}` (`{c.module.replace('.', '/')}`) | {c.arrays} | {c.chosen} |" for c in CAPABILITIES
    ]
    return "\n".join(rows)


def backend_doc(indent: str = "    ") -> str:
    """The numpydoc entry of an entry point's ``backend`` parameter, from :data:`CAPABILITIES`;
    ``indent``: the indentation of the parameter's line (the description goes 4 spaces deeper)."""
    import textwrap

    names = ", ".join(f'"{c.name}"' for c in CAPABILITIES)
    text = "``None`` picks from the arrays' namespace; " + "; ".join(
        f'"{c.name}": {c.summary}' for c in CAPABILITIES
    )
    body = textwrap.fill(
        text + ".", width=96, initial_indent=indent + "    ", subsequent_indent=indent + "    "
    )
    return f"backend : {{None, {names}}}\n{body}"


def installed_backends() -> tuple[str, ...]:
    """The backends whose packages are installed here, in :data:`CAPABILITIES` order (found, not
    imported: so asking imports no numba)."""
    import importlib.util

    return tuple(
        c.name for c in CAPABILITIES if all(importlib.util.find_spec(r) is not None for r in c.requires)
    )


@functools.lru_cache(maxsize=1)
def cpu_available() -> bool:
    """Whether the Numba CPU backend can run here: numba and scipy are installed (not imported)."""
    return "cpu" in installed_backends()
