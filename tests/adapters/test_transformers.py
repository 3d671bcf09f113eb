"""kda.transformers: a tiny Kimi Linear model (built from a config, no download) on kda against the
same model on transformers' own PyTorch fallback: training through ``Trainer`` with gradient
accumulation, greedy generation through the cache, left padding, ``torch.compile``; undoing the
install and installing on one model only.

Where transformers (or accelerate, which its ``Trainer`` needs) is missing the tests skip, unless
``KDA_REQUIRE_TRANSFORMERS=1`` (set by CI), where they fail.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
from helpers import ROOT, assert_within

import kda

torch = pytest.importorskip("torch")

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the fallback's "install fla" notice


def _require(module: str):
    try:
        return __import__(module)
    except ImportError as e:
        if os.environ.get("KDA_REQUIRE_TRANSFORMERS") == "1":
            pytest.fail(f"KDA_REQUIRE_TRANSFORMERS=1 but {module} is not installed: {e}")
        pytest.skip(f"{module} is not installed (pip install 'kda[transformers]')", allow_module_level=True)


transformers = _require("transformers")
kt = pytest.importorskip("kda.transformers")
mkl = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

TOL = 1e-5  # float32, relative to the largest reference element
VOCAB = 128


def tiny_config(**overrides):
    """KDA, full attention (MLA), KDA; dense then mixture-of-experts MLPs; 2 KDA heads of 32."""
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        linear_num_heads=2,
        linear_head_dim=32,
        linear_conv_kernel_dim=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    return transformers.KimiLinearConfig(**cfg)


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.KimiLinearForCausalLM(tiny_config()).float()


def ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _reverted():
    """Every test starts and ends with transformers' own functions installed."""
    kt.revert_kda_in_kimi_linear()
    yield
    kt.revert_kda_in_kimi_linear()


@pytest.fixture
def counted(monkeypatch):
    """Calls that reach kda.torch, by function name."""
    import kda.torch as kdt

    calls = {"chunk_kda": 0, "fused_recurrent_kda": 0}
    for name in calls:
        original = getattr(kdt, name)

        def spy(*a, _name=name, _f=original, **k):
            calls[_name] += 1
            return _f(*a, **k)

        monkeypatch.setattr(kdt, name, spy)
    return calls


def _kda_inputs(B=2, T=50, H=2, K=32, seed=0, state=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, K, generator=g) for _ in range(3))
    gate = -torch.rand(B, T, H, K, generator=g) * 0.5
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, K, K, generator=g) if state else None
    return q, k, v, gate, beta, s0


# ----------------------------------------------------------------------------------------------
# The functions


def test_import_kda_imports_neither_torch_nor_transformers():
    code = "import sys, kda; assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"])
def test_signatures_are_transformers(name):
    ours, theirs = inspect.signature(getattr(kt, name)), inspect.signature(getattr(mkl, name))
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
        (p.name, p.kind, p.default) for p in theirs.parameters.values()
    ]


def test_framework_keywords_cover_transformers_kwargs():
    from transformers.utils.generic import TransformersKwargs

    assert set(TransformersKwargs.__annotations__) <= set(kt.FRAMEWORK_KEYWORDS)


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_functions_match_fallback(method):
    """Output and final state against transformers' own functions, from a nonzero state, with the
    framework keywords that the model passes on (they change nothing)."""
    T = 50 if method == "chunk" else 1
    q, k, v, g, beta, s0 = _kda_inputs(T=T)
    fallback = getattr(mkl, f"{method}_kimi_delta_attention")
    ours = getattr(kt, f"{method}_kimi_delta_attention")
    opts = dict(g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    framework = dict(output_attentions=False, num_items_in_batch=torch.tensor(7), cu_seq_lens_q=None)
    o_ref, s_ref = fallback(q, k, v, **opts)
    o, s = ours(q, k, v, **opts, **framework)
    assert_within(o, o_ref, tol=TOL, name="o")
    assert_within(s, s_ref, tol=TOL, name="final state")
    assert ours(q, k, v, **{**opts, "output_final_state": False})[1] is None


def test_unknown_keyword_raises_type_error_naming_it():
    q, k, v, g, beta, _ = _kda_inputs(T=4)
    with pytest.raises(TypeError, match="'frobnicate'"):
        kt.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, frobnicate=1)
    with pytest.raises(TypeError, match="'chunk_size'"):
        kt.recurrent_kimi_delta_attention(
            q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], None, True, chunk_size=64
        )


# ----------------------------------------------------------------------------------------------
# Installing


def test_version_outside_the_supported_range_is_refused(monkeypatch):
    for version in ("5.16.1", "5.25.0", "4.57.6"):
        monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
        with pytest.raises(kt.TransformersVersionError, match=version) as info:
            kt.apply_kda_to_kimi_linear()
        assert isinstance(info.value, kda.KdaError)
        assert mkl.chunk_kimi_delta_attention is not kt.chunk_kimi_delta_attention


def test_not_a_kimi_linear_model_is_refused():
    with pytest.raises(kda.InvalidInputError, match="not a Kimi Linear model"):
        kt.apply_kda_to_kimi_linear(torch.nn.Linear(2, 2))


def test_apply_and_revert_every_model(counted):
    original = (mkl.chunk_kimi_delta_attention, mkl.recurrent_kimi_delta_attention)
    model, x = tiny_model(), ids(1, 12)
    with torch.no_grad():
        reference = model(input_ids=x).logits
        kt.apply_kda_to_kimi_linear()
        kt.apply_kda_to_kimi_linear()  # twice is once
        assert kt.is_kda_applied() and kt.is_kda_applied(model)
        assert_within(model(input_ids=x).logits, reference, tol=TOL)
        assert counted["chunk_kda"] == 2  # two KDA layers
        kt.revert_kda_in_kimi_linear()
        assert (mkl.chunk_kimi_delta_attention, mkl.recurrent_kimi_delta_attention) == original
        assert not kt.is_kda_applied()
        assert torch.equal(model(input_ids=x).logits, reference)  # the fallback again, bit for bit
        assert counted["chunk_kda"] == 2
        with kt.kda_in_kimi_linear():
            model(input_ids=x)
        assert counted["chunk_kda"] == 4
        assert mkl.chunk_kimi_delta_attention is original[0]


def test_one_model_only(counted):
    patched, other, x = tiny_model(), tiny_model(), ids(2, 20)
    kt.apply_kda_to_kimi_linear(patched)
    assert kt.is_kda_applied(patched) and not kt.is_kda_applied(other) and not kt.is_kda_applied()
    with torch.no_grad():
        expected = other(input_ids=x).logits
        assert counted["chunk_kda"] == 0
        assert_within(patched(input_ids=x).logits, expected, tol=TOL)
        assert counted["chunk_kda"] == 2
        kt.revert_kda_in_kimi_linear(patched)
        assert torch.equal(patched(input_ids=x).logits, expected)
        assert counted["chunk_kda"] == 2
        with kt.kda_in_kimi_linear(patched):
            patched(input_ids=x)
            other(input_ids=x)
        assert counted["chunk_kda"] == 4
        assert not kt.is_kda_applied(patched)


# ----------------------------------------------------------------------------------------------
# The model on kda against the model on transformers' fallback


def _train(tmp_path, name: str, steps: int = 3):
    """A few Trainer steps, two micro-batches accumulated per step; the losses and the model. Plain
    SGD: Adam's normalised step would magnify float32 rounding in near-zero gradients."""
    data = [{"input_ids": x, "labels": x} for x in ids(8, 40, seed=3)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=0.1,
        optim="sgd",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = tiny_model()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == steps
    return losses, model


def test_trainer_matches_fallback(tmp_path, counted):
    losses_ref, ref = _train(tmp_path, "fallback")
    assert counted["chunk_kda"] == 0
    with kt.kda_in_kimi_linear():
        losses, model = _train(tmp_path, "kda")
    assert counted["chunk_kda"] > 0
    assert_within(torch.tensor(losses), torch.tensor(losses_ref), tol=TOL, name="losses")
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert_within(p.detach(), p_ref.detach(), tol=TOL, name=name)


def test_gradients_match_fallback():
    """Every parameter's gradient after one forward and backward, from a nonzero cached state
    continuation too (prefill of 30 tokens, then 10 more through the chunk path)."""
    x = ids(2, 40)
    grads = []
    for install in (False, True):
        model = tiny_model()
        with kt.kda_in_kimi_linear(model) if install else _nothing():
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, g_ref in grads[0].items():
        assert_within(grads[1][name], g_ref, tol=TOL, name=name)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_generate_with_cache_matches_fallback(counted):
    """Greedy generation through the cache: prefill on the chunk function, then one recurrent
    step per token, from left-padded prompts; the same tokens and scores as the fallback."""
    model = tiny_model().eval()
    prompt = ids(2, 12)
    mask = torch.ones_like(prompt)
    mask[0, :5] = 0  # left padding
    prompt[0, :5] = 0
    opts = dict(
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        ref = model.generate(prompt, **opts)
        with kt.kda_in_kimi_linear(model):
            out = model.generate(prompt, **opts)
    assert counted["chunk_kda"] == 2 and counted["fused_recurrent_kda"] == 2 * 9
    assert torch.equal(out.sequences, ref.sequences)
    assert_within(torch.stack(out.scores), torch.stack(ref.scores), tol=TOL, name="scores")


def test_cached_continuation_matches_fallback():
    """A multi-token continuation from the cache takes the chunk function with the cached state."""
    model, x = tiny_model().eval(), ids(2, 30)
    results = []
    with torch.no_grad():
        for install in (False, True):
            with kt.kda_in_kimi_linear(model) if install else _nothing():
                first = model(input_ids=x[:, :20], use_cache=True)
                results.append(model(input_ids=x[:, 20:], cache=first.cache, use_cache=True).logits)
    assert_within(results[1], results[0], tol=TOL)


def test_torch_compile_matches_fallback(counted):
    """``torch.compile(fullgraph=True)`` (aot_eager) of the model on kda, forward and backward,
    against the eager model on the fallback."""
    x = ids(2, 24)
    ref = tiny_model()
    ref(input_ids=x, labels=x, use_cache=False).loss.backward()
    model = tiny_model()
    kt.apply_kda_to_kimi_linear(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(input_ids=x, labels=x, use_cache=False)
    out.loss.backward()
    assert counted["chunk_kda"] == 2  # traced through kda's custom op, not the fallback
    assert_within(out.loss.detach(), ref(input_ids=x, labels=x, use_cache=False).loss.detach(), tol=TOL)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        if p_ref.grad is not None:
            assert_within(p.grad, p_ref.grad, tol=TOL, name=name)


def test_readme_example_runs(counted):
    """The guide's no-download block (docs/adapters.md), as written."""
    readme = (ROOT / "docs" / "adapters.md").read_text()
    section = readme[readme.index("## Hugging Face transformers") :]
    block = section.split("```python\n")[2].split("```")[0]
    exec(compile(block, "docs/adapters.md", "exec"), {})
    assert counted["chunk_kda"] >= 2 and counted["fused_recurrent_kda"] == 7


@pytest.mark.parametrize("continuation", [1, 10])
def test_cache_written_by_the_fallback_continues_on_kda(continuation):
    """The cached state is exchanged in transformers' layout ([B, H, K, V], float32): a prompt
    prefilled on the fallback continues on kda (one recurrent step, or a chunk from the state)."""
    model, x = tiny_model().eval(), ids(2, 20 + continuation)
    results = []
    with torch.no_grad():
        for install in (False, True):
            first = model(input_ids=x[:, :20], use_cache=True)
            with kt.kda_in_kimi_linear(model) if install else _nothing():
                results.append(model(input_ids=x[:, 20:], cache=first.cache, use_cache=True).logits)
    assert_within(results[1], results[0], tol=TOL)
