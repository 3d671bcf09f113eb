"""kda.vllm._moe_padding: Kimi's routed experts, padded per rank under tensor parallelism, have
their padding zeroed before the checkpoint is loaded. On a fake ``KimiMoE`` built as vLLM 0.32
builds it (the weights on the ``MoERunner``'s ``routed_experts``, made with uninitialized memory,
here NaN), then against vLLM's own class where vLLM is installed.
"""

from __future__ import annotations

import sys
import types

import pytest

import kda

torch = pytest.importorskip("torch")
patch = pytest.importorskip("kda.vllm._patch")
padding = pytest.importorskip("kda.vllm._moe_padding")


@pytest.fixture(autouse=True)
def _isolated():
    with patch.patches():
        yield


def _fake_model(monkeypatch, width: int, unpadded: int, experts: int = 4, hidden: int = 8):
    """A module with a ``KimiMoE`` whose ``__init__`` does what vLLM 0.32's does to the weights:
    ``torch.empty``-like (NaN) routed-expert weights of the padded width on a runner, vLLM's own
    zeroing looking for them on the runner itself (where they are not), then the unpadded width."""

    class Config:
        intermediate_size_per_partition = width
        intermediate_size_per_partition_unpadded = width

    class Runner:
        def __init__(self) -> None:
            self.moe_config = Config()
            self.routed_experts = types.SimpleNamespace(
                w13_weight=torch.nn.Parameter(torch.full((experts, 2 * width, hidden), float("nan"))),
                w2_weight=torch.nn.Parameter(torch.full((experts, hidden, width), float("nan"))),
            )

    class KimiMoE:
        def __init__(
            self, config, vllm_config, quant_config=None, prefix="", layer_idx=0,
            use_sequence_parallel=False, run_gemm_rs_ar=False,
        ):  # fmt: skip
            self.experts = Runner()
            for name in ("w13_weight", "w2_weight"):  # vLLM's lookup: None on a runner
                weight = getattr(self.experts, name, None)
                if weight is not None:
                    weight.data.zero_()
            self.experts.moe_config.intermediate_size_per_partition_unpadded = unpadded

    module = types.ModuleType(padding.MODEL)
    module.KimiMoE = KimiMoE
    monkeypatch.setitem(sys.modules, padding.MODEL, module)
    return module


def test_padded_experts_zeroed(monkeypatch):
    module = _fake_model(monkeypatch, width=256, unpadded=32)
    assert torch.isnan(module.KimiMoE(None, None).experts.routed_experts.w13_weight).all()  # the fault
    padding.install(module)
    moe = module.KimiMoE(None, None)
    for weight in (moe.experts.routed_experts.w13_weight, moe.experts.routed_experts.w2_weight):
        assert torch.count_nonzero(weight) == 0
    assert padding.zero_expert_padding(moe) == ["w13_weight", "w2_weight"]


def test_unpadded_experts_untouched(monkeypatch):
    """TP 1 (or a share of at least the minimum): no padding, the weights are left to the loader."""
    module = _fake_model(monkeypatch, width=64, unpadded=64)
    padding.install(module)
    moe = module.KimiMoE(None, None)
    assert torch.isnan(moe.experts.routed_experts.w13_weight).all()


def test_install_idempotent_and_undone(monkeypatch):
    module = _fake_model(monkeypatch, width=256, unpadded=32)
    original = module.KimiMoE.__init__
    padding.install(module)
    wrapped = module.KimiMoE.__init__
    padding.install(module)
    assert module.KimiMoE.__init__ is wrapped
    patch.undo_all()
    assert module.KimiMoE.__init__ is original


def test_other_signature_refused(monkeypatch):
    module = types.ModuleType(padding.MODEL)

    class KimiMoE:
        def __init__(self, config, vllm_config, prefix=""):
            pass

    module.KimiMoE = KimiMoE
    with pytest.raises(kda.KdaError, match=r"KimiMoE\.__init__"):
        padding.install(module)
    assert "__init__" in vars(KimiMoE) and not patch.is_patched(KimiMoE, "__init__")


def test_vllm_kimi_moe():
    """vLLM's own ``KimiMoE``: the signature written against, and the fault still there (its
    zeroing looks on the ``MoERunner``, which does not hold the weights): when vLLM fixes it, this
    test says the completion can go."""
    pytest.importorskip("vllm")
    import importlib
    import inspect
    import warnings

    try:
        with warnings.catch_warnings():  # vLLM's and torch's own deprecations at import
            warnings.simplefilter("ignore")
            model = importlib.import_module(padding.MODEL)
            runner = importlib.import_module("vllm.model_executor.layers.fused_moe.runner.moe_runner")
    except ImportError as err:
        pytest.skip(f"vLLM's Kimi model does not import here: {err}")
    source = inspect.getsource(model.KimiMoE.__init__)
    assert 'getattr(self.experts, "w13_weight", None)' in source
    assert not hasattr(runner.MoERunner, "w13_weight")
    padding.install(model)
    assert patch.is_patched(model.KimiMoE, "__init__")
