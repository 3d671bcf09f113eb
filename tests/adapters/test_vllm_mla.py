"""kda.vllm.mla: vLLM-CPU's missing pieces for Kimi Linear's MLA layers (the three fused NoPE
epilogues, the context-latent gather, the kernel-block zeroing, the context chunk written into
``out``) against plain torch loops written out here in vLLM's conventions: a paged latent cache
``[blocks, block_size, kv_lora_rank + rope]`` (also a strided view), ``slot_mapping`` of ``block *
block_size + offset`` with -1 as padding, rows no token names left bitwise unchanged. Needs torch
only (vLLM is not imported)."""

from __future__ import annotations

import pytest

import kda

torch = pytest.importorskip("torch")
mla = pytest.importorskip("kda.vllm.mla")

L, R, P, V, H = 512, 64, 128, 128, 2  # the released conventions: kv_lora_rank, rope, nope, v; heads


def _cache(blocks=6, bs=16, dtype=torch.float32, strided=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # a view of every other kernel block of a larger store (vLLM's kernel-block views)
        store = torch.randn(2 * blocks, bs, L + R, generator=gen).to(dtype)
        return store[::2]
    return torch.randn(blocks, bs, L + R, generator=gen).to(dtype)


def _inputs(T, dtype=torch.float32, seed=1, pe3=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, P + R, generator=gen).to(dtype)
    kv = torch.randn(T, H, P + V, generator=gen).to(dtype)
    k_nope = kv[..., :P]  # strided: a half of kv_b_proj's output, as vLLM passes it
    k_pe = torch.randn(T, *((1,) if pe3 else ()), R, generator=gen).to(dtype)
    latent = torch.randn(T, L, generator=gen).to(dtype)
    return q, k_nope, k_pe, latent


def _ref_insert(cache, slots, latent, k_pe):
    """The loop: each token with a slot >= 0 writes ``[latent | k_pe]`` at ``(slot // B, slot % B)``."""
    out = cache.clone()
    B = cache.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[s // B, s % B, :L] = latent[t].to(cache.dtype)
            out[s // B, s % B, L:] = k_pe.reshape(len(slots), R)[t].to(cache.dtype)
    return out


def _ref_key(k_nope, k_pe):
    T = k_nope.shape[0]
    k = torch.zeros(T, H, P + R, dtype=k_nope.dtype)
    for t in range(T):
        for h in range(H):
            k[t, h, :P] = k_nope[t, h]
            k[t, h, P:] = k_pe.reshape(T, R)[t]
    return k


SLOTS = [5, 17, -1, 40, 3, 90]  # across blocks, a padding slot, out of order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("pe3", [False, True])
def test_prefill_epilogue(dtype, strided, pe3):
    """``fused_mla_key_concat_kv_cache_insert``: the full key, and the cache rows of the named slots
    (and nothing else) written; ``q`` untouched (NoPE)."""
    q, k_nope, k_pe, latent = _inputs(len(SLOTS), dtype, pe3=pe3)
    cache = _cache(dtype=dtype, strided=strided)
    slots = torch.tensor(SLOTS, dtype=torch.int64)
    q0, expect = q.clone(), _ref_insert(cache, slots, latent, k_pe)
    k = mla.fused_mla_key_concat_kv_cache_insert(q, k_nope, k_pe, latent, cache, slots)
    assert k.is_contiguous() and k.dtype == dtype
    assert torch.equal(k, _ref_key(k_nope, k_pe))
    assert torch.equal(cache, expect)
    assert torch.equal(q, q0)


def test_kv_concat():
    """``fused_mla_kv_concat``: ``[k_nope | k_pe]`` per head, contiguous, from strided inputs."""
    _, k_nope, k_pe, _ = _inputs(7)
    pe = torch.randn(7, 2 * R)[:, ::2]  # a strided k_pe (a view of the gather workspace)
    for p in (k_pe, pe, pe[:, None, :]):
        k = mla.fused_mla_kv_concat(k_nope, p)
        assert k.is_contiguous() and torch.equal(k, _ref_key(k_nope, p.reshape(7, R)))
    assert mla.fused_mla_kv_concat(k_nope[:0], k_pe[:0]).shape == (0, H, P + R)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_epilogue(dtype):
    """``fused_mla_decode_q_concat_kv_cache_insert``: the latent query ``[ql_nope | q_pe]`` and the
    decode tokens' cache rows."""
    gen = torch.Generator().manual_seed(3)
    B = len(SLOTS)
    ql_nope = torch.randn(H, B, L, generator=gen).to(dtype).transpose(0, 1)  # strided, as vLLM's bmm output
    q_pe = torch.randn(B, H, R, generator=gen).to(dtype)
    _, _, k_pe, latent = _inputs(B, dtype, seed=4)
    cache = _cache(dtype=dtype, strided=True)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    expect = _ref_insert(cache, slots, latent, k_pe)
    q = mla.fused_mla_decode_q_concat_kv_cache_insert(ql_nope, q_pe, latent, k_pe, cache, slots)
    ref = torch.zeros(B, H, L + R, dtype=dtype)
    for b in range(B):
        for h in range(H):
            ref[b, h] = torch.cat([ql_nope[b, h], q_pe[b, h]])
    assert torch.equal(q, ref) and torch.equal(cache, expect)


def test_refusals():
    """RoPE (positions / cos_sin_cache) and fp8 caches are refused, naming what was given, before
    anything is written."""
    q, k_nope, k_pe, latent = _inputs(2)
    cache = _cache()
    before = cache.clone()
    slots = torch.tensor([1, 2])
    with pytest.raises(kda.KdaError, match="NoPE"):
        mla.fused_mla_key_concat_kv_cache_insert(q, k_nope, k_pe, latent, cache, slots, positions=slots)
    with pytest.raises(kda.KdaError, match="NoPE"):
        mla.fused_mla_decode_q_concat_kv_cache_insert(
            latent[:, None].expand(2, H, L), q[..., :R], latent, k_pe, cache, slots, cos_sin_cache=cache[0]
        )
    with pytest.raises(kda.KdaError, match="ds_mla"):
        mla.fused_mla_decode_q_concat_kv_cache_insert(
            latent[:, None].expand(2, H, L), q[..., :R], latent, k_pe, cache, slots, ds_mla=True
        )
    with pytest.raises(kda.KdaError, match="fp8"):
        mla.fused_mla_key_concat_kv_cache_insert(
            q, k_nope, k_pe, latent, torch.zeros(4, 16, L + R, dtype=torch.uint8), slots
        )
    with pytest.raises(kda.KdaError, match="fp8"):
        mla.refuse_fp8("fused_mla_kv_concat_quant_fp8")(k_nope, k_pe, k_nope)
    with pytest.raises(kda.KdaError, match="kv_cache_dtype='fp8'"):
        mla.gather_and_maybe_dequant_cache(cache, latent, slots[None], slots, slots, 2, "fp8", None)
    with pytest.raises(kda.KdaError, match="slot_mapping names slot 96"):
        mla.fused_mla_key_concat_kv_cache_insert(q, k_nope, k_pe, latent, cache, torch.tensor([1, 96]))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("starts", [None, [16, 0, 32]])
def test_gather_context(starts):
    """``gather_and_maybe_dequant_cache``: three requests' context latents, by their block tables,
    from chunk starts (block-aligned, as vLLM schedules them); rows past ``num_tokens`` untouched."""
    cache = _cache(blocks=8, strided=True)
    block_table = torch.tensor([[3, 0, 6, 1], [7, 2, 0, 0], [5, 4, 1, 2]], dtype=torch.int32)
    lens = [20, 9, 17]
    cu = torch.tensor([0, 20, 29, 46], dtype=torch.int32)
    token_to_seq = torch.tensor([r for r, n in enumerate(lens) for _ in range(n)], dtype=torch.int32)
    dst = torch.randn(50, L + R)
    expect = dst.clone()
    st = [0, 0, 0] if starts is None else starts
    for r, n in enumerate(lens):
        for i in range(n):
            p = st[r] + i
            expect[int(cu[r]) + i] = cache[int(block_table[r, p // 16]), p % 16]
    seq_starts = None if starts is None else torch.tensor(starts, dtype=torch.int32)
    mla.gather_and_maybe_dequant_cache(
        cache, dst, block_table, cu, token_to_seq, 46, "auto", None, seq_starts
    )
    assert torch.equal(dst, expect)


@pytest.mark.parametrize("ratio", [1, 8])
def test_zero_kv_blocks(ratio):
    """Logical blocks 1 and 4 of a cache bound as ``ratio`` kernel blocks per logical block: exactly
    their kernel blocks are zeroed (with the logical id as a kernel index, vLLM-CPU zeroed kernel
    blocks 1 and 4 instead: part of logical block 0, a KDA state page in a hybrid)."""
    num_blocks = 6
    kv = torch.randn(num_blocks * ratio, 16, 8)
    expect = kv.clone()
    for b in (1, 4):
        for j in range(ratio):
            expect[b * ratio + j] = 0
    mla.zero_kv_blocks(kv, [1, 4], num_blocks)
    assert torch.equal(kv, expect)
    with pytest.raises(kda.KdaError, match="not a multiple"):
        mla.zero_kv_blocks(torch.zeros(7, 2), [0], num_blocks)


def test_context_chunk_into_out():
    """The wrapped backend writes into ``out`` and returns it (with the lse); without ``out`` it
    returns the backend's own result."""
    calls = []

    def run(self, chunk, q, k, v, out=None):
        assert out is None, "CPU MLA context prefill does not support in-place output"
        calls.append(chunk)
        return q * 2, torch.ones(3)

    wrapped = mla.context_chunk_into_out(run)
    q = torch.randn(4, H, 8)
    out = torch.zeros(4, H, 8)
    res, lse = wrapped(None, "c0", q, q, q, out=out)
    assert res is out and torch.equal(out, q * 2) and torch.equal(lse, torch.ones(3))
    res, _ = wrapped(None, "c1", q, q, q)
    assert torch.equal(res, q * 2) and calls == ["c0", "c1"]


def test_skip_names(monkeypatch):
    """``KDA_VLLM_SKIP`` (the reproductions in docs/vllm.md leave one completion out): the names it
    lists, and an unknown name refused with the known ones."""
    comp = pytest.importorskip("kda.vllm.cpu_fixes")
    monkeypatch.delenv("KDA_VLLM_SKIP", raising=False)
    assert comp.skipped() == frozenset()
    monkeypatch.setenv("KDA_VLLM_SKIP", "zero_blocks, prefix_caching")
    assert comp.skipped() == {"zero_blocks", "prefix_caching"}
    monkeypatch.setenv("KDA_VLLM_SKIP", "zero_block")
    with pytest.raises(kda.KdaError, match=r"zero_block.*kv_b_proj"):
        comp.skipped()
