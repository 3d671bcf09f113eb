"""kda.testing on third-party kernels, float32, on the CPU: transformers' Kimi Linear fallbacks
(``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention``) and flash-linear-attention's
``naive_recurrent_kda``. Each is correct in float32 and must pass every size the kit draws with every
finite gate regime it supports, narrowed only by what it lacks; the chunked fallback's ``-inf``
resets are a real defect the kit must report (on the finite check, first). The 150-example runs are
``slow``; the default step runs a few examples of each."""

from __future__ import annotations

import pytest
from helpers import fla_naive

import kda.testing as kt

# What transformers' fallbacks lack: grouped value heads, packed sequences (they raise ValueError),
# a scale keyword, gates and beta activations in the kernel (keywords they drop silently)
TRANSFORMERS = dict(dtypes=("float32",), groups=(1,), packed=(False,), gates=("log",),
                    beta_activations=(None,), scale=("default",))  # fmt: skip
# The chunked fallback forms decays as exp of differences of cumulative sums: -inf resets give NaN,
# and strong decays lose digits; the zero, weak and mild regimes are its supported ones
CHUNK_REGIMES = ("zero", "weak", "mild")
# What fla's naive_recurrent_kda lacks: packed sequences, chunk_size, gates, activations, qk_l2norm
FLA_RECURRENT = dict(dtypes=("float32",), packed=(False,), gates=("log",), beta_activations=(None,),
                     qk_l2norm=(False,), chunk_sizes=(None,))  # fmt: skip


@pytest.fixture(scope="module")
def kimi():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import logging

    from transformers.models.kimi_linear import modeling_kimi_linear

    # the fallbacks warn once that flash-linear-attention is not installed
    logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
    return modeling_kimi_linear


def _kernels(kimi, fla=None):
    return {
        "transformers chunk": (
            kimi.chunk_kimi_delta_attention,
            kt.problems(**TRANSFORMERS, regimes=CHUNK_REGIMES),
        ),
        "transformers recurrent": (kimi.recurrent_kimi_delta_attention, kt.problems(**TRANSFORMERS)),
    }


def _check(fn, space, n):
    summary = kt.check_kernel(fn, convention="fla", problems=space, max_examples=n)
    assert summary.examples == n and not summary.rejected
    assert not summary.imprecise, str(summary)
    assert max(summary.worst.values()) <= 1, str(summary)
    return summary


@pytest.mark.parametrize("name", ["transformers chunk", "transformers recurrent"])
def test_transformers_fallback_passes(kimi, name):
    fn, space = _kernels(kimi)[name]
    _check(fn, space, 12)


def test_fla_naive_recurrent_passes():
    fla = fla_naive()
    _check(fla.naive_recurrent_kda, kt.problems(**FLA_RECURRENT), 12)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["transformers chunk", "transformers recurrent"])
def test_transformers_fallback_passes_150_examples(kimi, name):
    fn, space = _kernels(kimi)[name]
    summary = _check(fn, space, 150)
    assert {"size=one step", "size=ragged chunks", "regime=mild", "qk_l2norm"} <= set(summary.features)


@pytest.mark.slow
def test_fla_naive_recurrent_passes_150_examples():
    fla = fla_naive()
    summary = _check(fla.naive_recurrent_kda, kt.problems(**FLA_RECURRENT), 150)
    assert {"size=one step", "gva", "scale", "regime=hard", "regime=reset"} <= set(summary.features)


def test_transformers_chunk_fails_reset_gates_on_the_finite_check(kimi):
    space = kt.problems(**TRANSFORMERS, regimes=("reset",))
    with pytest.raises(
        kt.KernelCheckFailed, match="non-finite elements where the reference is finite"
    ) as info:
        kt.check_kernel(kimi.chunk_kimi_delta_attention, convention="fla", problems=space, max_examples=20)
    assert info.value.check == "finite"
