"""A tiny Kimi Linear model in Hugging Face transformers: kda (kda.transformers) against
transformers' own PyTorch fallback for the KDA layers, end to end.

The model: hidden 256, three layers (KDA, full attention, KDA), mixture of experts,
4 KDA heads of 64, vocabulary 1000, float32, randomly initialised from a config (no download).
For each ``T`` and each implementation, interleaved round by round so that load on a shared
machine hits both alike:

* ``train_step``: ``model(input_ids, labels=input_ids, use_cache=False)``, ``loss.backward()`` and
  an SGD step, ``B=1``;
* ``generate``: greedy ``model.generate`` of ``--new-tokens`` tokens through the cache from a
  prompt of ``T`` tokens (one chunk call to prefill, then one recurrent call per token and layer);
* ``prefill``: the forward of the prompt alone under ``torch.no_grad()``.

    python benchmarks/transformers_kimi.py [--T 512 2048] [--rounds 3] [--new-tokens 32]

On a shared machine, run it with ``OMP_NUM_THREADS=1``: under load, torch's and NumPy's thread
pools spinning against each other on few cores cost more than the work (measured: a 4-token
generate at T=64 took 1.8 s with the default threads at load 15 on 2 cores, 0.05 s with one).

Reports the minimum over rounds (after one warm-up round) of the wall time, and writes
``benchmarks/results/transformers_kimi.json``. Needs ``pip install 'kda[transformers]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import transformers

import kda.transformers as kt

if __package__ in (None, ""):  # run as a file: the repository root, for benchmarks._common
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common


def tiny_model(seed: int = 0) -> transformers.KimiLinearForCausalLM:
    config = transformers.KimiLinearConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        linear_num_heads=4,
        linear_head_dim=64,
        linear_conv_kernel_dim=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.KimiLinearForCausalLM(config).float()


def _wall(fn) -> tuple[float, object]:
    """``(wall seconds, fn())`` (:func:`benchmarks._common.timed`)."""
    out, wall_s, _ = _common.timed(fn)
    return wall_s, out


def _round(model, opt, ids: torch.Tensor, new_tokens: int) -> dict[str, tuple[float, object]]:
    def train_step():
        model.train()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def generate():
        model.eval()
        with torch.no_grad():
            return model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )

    def prefill():
        model.eval()
        with torch.no_grad():
            return model(input_ids=ids, use_cache=True).logits

    return {"prefill": _wall(prefill), "generate": _wall(generate), "train_step": _wall(train_step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "transformers_kimi.json"
    )
    args = parser.parse_args()

    results = []
    for T in args.T:
        ids = torch.randint(3, 1000, (1, T), generator=torch.Generator().manual_seed(T))
        models = {"fallback": tiny_model(), "kda": tiny_model()}
        kt.apply_kda_to_kimi_linear(models["kda"])
        opts = {
            name: torch.optim.SGD(m.parameters(), lr=0.0) for name, m in models.items()
        }  # lr 0: same model
        times: dict[str, dict[str, list[float]]] = {name: {} for name in models}
        outputs: dict[str, dict[str, object]] = {}
        for r in range(args.rounds + 1):
            for name, model in models.items():
                got = _round(model, opts[name], ids, args.new_tokens)
                outputs[name] = {part: out for part, (_, out) in got.items()}
                if r:  # round 0 warms up
                    for part, (seconds, _) in got.items():
                        times[name].setdefault(part, []).append(seconds)
        same_tokens = torch.equal(outputs["kda"]["generate"], outputs["fallback"]["generate"])
        ref = outputs["fallback"]["prefill"]
        logits_rel = float((outputs["kda"]["prefill"] - ref).abs().max() / ref.abs().max())
        row = {"T": T, "generated_tokens_identical": same_tokens, "prefill_logits_max_rel_diff": logits_rel}
        for part in ("train_step", "generate", "prefill"):
            best = {name: min(times[name][part]) for name in models}
            row[part] = {
                "fallback_s": best["fallback"],
                "kda_s": best["kda"],
                "speedup": best["fallback"] / best["kda"],
                "rounds_s": {name: times[name][part] for name in models},
            }
            print(
                f"T={T:5d} {part:10s} fallback {best['fallback']:8.3f} s  kda {best['kda']:8.3f} s  "
                f"{best['fallback'] / best['kda']:5.2f}x"
            )
        print(
            f"T={T:5d} generated tokens identical: {same_tokens}; "
            f"prefill logits max rel diff {logits_rel:.1e}"
        )
        results.append(row)

    record = {
        "command": "python benchmarks/transformers_kimi.py "
        + " ".join(
            [
                f"--T {' '.join(map(str, args.T))}",
                f"--rounds {args.rounds}",
                f"--new-tokens {args.new_tokens}",
            ]
        ),
        "model": "KimiLinearForCausalLM hidden 256, layers KDA/MLA/KDA, MoE 4 experts top-2 + 1 shared, "
        "4 KDA heads of 64, vocab 1000, float32, B=1",
        "timing": "minimum wall time over rounds after one warm-up round; implementations interleaved",
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "machine": _common.machine(),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_end": _common.load_average(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
