"""The model families of ``python -m kda.vllm check --model NAME``: each a module of this package
defining ``FAMILY`` (a :class:`kda.vllm._common.Family`: model builders, engine configurations,
reference), registered here by one line. No vLLM import."""

from __future__ import annotations

import importlib

from .._common import Family

#: ``--model`` name -> module of this package (the first is the default)
REGISTRY = {
    "kimi": "kda_only",
    "kimi-linear": "kimi_linear",
    "glm": "glm",
    "ling": "ling",
}


def family(name: str) -> Family:
    """The family registered as ``name`` (``KeyError`` if none)."""
    return importlib.import_module(f"{__name__}.{REGISTRY[name]}").FAMILY
