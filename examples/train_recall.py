"""Train a tiny KDA model on synthetic multi-query associative recall, on the CPU, with kda.torch.

Each sequence lists ``--pairs`` key-value pairs, then asks for ``--queries`` of the keys again;
after each asked key the model must name its value::

    k3 v7 k0 v2 k5 v1 ... | k0 -> v2   k5 -> v1 ...

Chance is one over the number of values. The model is what a KDA layer of Kimi Linear computes,
shrunk: q/k/v projections through a causal short convolution with SiLU, the raw gate from a low-rank
projection turned into a log decay inside the kernel (``use_gate_in_kernel`` with ``A_log`` and
``dt_bias``), beta as a sigmoid in the kernel, q/k L2-normalised in the kernel, then an RMS-normalised
output and a projection back; each layer is followed by an MLP, both residual.

    python examples/train_recall.py                 # 400 steps: 170 s on a 2-core CPU, 99.7% accuracy
    python examples/train_recall.py --quick         # the reduced setting of tests/test_example.py

It prints the final accuracy on fresh sequences and writes the loss curve (``--plot``, default
``examples/train_recall.png``). Needs ``pip install kda[torch,bench]`` (torch, tqdm, matplotlib).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kda.torch import chunk_kda

HERE = Path(__file__).resolve().parent


class ShortConv(nn.Module):
    """Causal depthwise convolution over time (kernel 4) with SiLU, as KDA layers use."""

    def __init__(self, channels: int, kernel: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C]
        T = x.shape[1]
        return F.silu(self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2))


class KdaLayer(nn.Module):
    """One Kimi Delta Attention layer on ``[B, T, D]`` activations."""

    def __init__(self, D: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.H, self.K = heads, head_dim
        width = heads * head_dim
        self.q, self.k, self.v = (nn.Linear(D, width, bias=False) for _ in range(3))
        self.q_conv, self.k_conv, self.v_conv = (ShortConv(width) for _ in range(3))
        self.gate = nn.Sequential(nn.Linear(D, head_dim, bias=False), nn.Linear(head_dim, width, bias=False))
        self.beta = nn.Linear(D, heads, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16)))
        # as Mamba and fla initialise it: softplus(dt_bias) log-uniform in [1e-3, 0.1]
        dt = torch.exp(torch.empty(width).uniform_(math.log(1e-3), math.log(0.1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.norm = nn.RMSNorm(head_dim)
        self.out = nn.Linear(width, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        shape = (B, T, self.H, self.K)
        q = self.q_conv(self.q(x)).view(shape)
        k = self.k_conv(self.k(x)).view(shape)
        v = self.v_conv(self.v(x)).view(shape)
        o, _ = chunk_kda(
            q, k, v, self.gate(x).view(shape), self.beta(x),
            A_log=self.A_log, dt_bias=self.dt_bias, use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, chunk_size=16,
        )  # fmt: skip
        return self.out(self.norm(o).reshape(B, T, -1))


class RecallModel(nn.Module):
    def __init__(self, vocab: int, classes: int, D: int, layers: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
            self.blocks.append(
                nn.ModuleList([nn.RMSNorm(D), KdaLayer(D, heads, head_dim), nn.RMSNorm(D), mlp])
            )
        self.head = nn.Sequential(nn.RMSNorm(D), nn.Linear(D, classes))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for norm1, attn, norm2, mlp in self.blocks:
            x = x + attn(norm1(x))
            x = x + mlp(norm2(x))
        return self.head(x)


def make_batch(batch: int, keys: int, values: int, pairs: int, queries: int, gen: torch.Generator):
    """Tokens ``[batch, 2 pairs + queries]`` (keys ``0..keys-1``, values ``keys..``), the query
    positions' target values ``[batch, queries]`` (class indices ``0..values-1``)."""
    key_ids = torch.argsort(torch.rand(batch, keys, generator=gen), dim=1)[:, :pairs]
    val_ids = torch.randint(0, values, (batch, pairs), generator=gen)
    context = torch.stack([key_ids, keys + val_ids], dim=2).reshape(batch, 2 * pairs)
    asked = torch.argsort(torch.rand(batch, pairs, generator=gen), dim=1)[:, :queries]
    tokens = torch.cat([context, torch.gather(key_ids, 1, asked)], dim=1)
    return tokens, torch.gather(val_ids, 1, asked)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--keys", type=int, default=32)
    p.add_argument("--values", type=int, default=32)
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="PyTorch threads (small ops: 1 is fastest)")
    p.add_argument("--quick", action="store_true", help="the reduced setting run by the test suite")
    p.add_argument(
        "--plot", type=Path, default=HERE / "train_recall.png", help="loss-curve PNG ('' for none)"
    )
    p.add_argument("--no-progress", action="store_true")
    return p


QUICK = {
    "steps": 150,
    "keys": 16,
    "values": 16,
    "pairs": 6,
    "queries": 4,
    "layers": 1,
    "dim": 32,
    "head_dim": 16,
}


def train(args: argparse.Namespace) -> dict[str, float]:
    """Train, evaluate on 1024 fresh sequences; return accuracy, chance, final loss, seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads)


def _train(args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = RecallModel(
        args.keys + args.values, args.values, args.dim, args.layers, args.heads, args.head_dim
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    sizes = (args.keys, args.values, args.pairs, args.queries)
    losses, start = [], time.perf_counter()
    steps = range(args.steps)
    if not args.no_progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="train", unit="step", file=sys.stderr)
    for _ in steps:
        tokens, target = make_batch(args.batch, *sizes, gen)
        logits = model(tokens)[:, -args.queries :]
        loss = F.cross_entropy(logits.reshape(-1, args.values), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{loss.item():.3f}")
    seconds = time.perf_counter() - start
    with torch.no_grad():
        tokens, target = make_batch(1024, *sizes, torch.Generator().manual_seed(args.seed + 1))
        accuracy = (model(tokens)[:, -args.queries :].argmax(-1) == target).float().mean().item()
    if args.plot:
        _plot(losses, args, accuracy)
    return {"accuracy": accuracy, "chance": 1 / args.values, "final_loss": losses[-1], "seconds": seconds}


def _plot(losses: list[float], args: argparse.Namespace, accuracy: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, lw=0.8, label="training loss (per batch)")
    ax.axhline(torch.log(torch.tensor(float(args.values))).item(), color="gray", ls="--", label="chance")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(f"KDA associative recall ({args.pairs} pairs): accuracy {accuracy:.1%}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = _parser().parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    result = train(args)
    print(
        f"accuracy {result['accuracy']:.1%} (chance {result['chance']:.1%}), final loss "
        f"{result['final_loss']:.3f}, {args.steps} steps in {result['seconds']:.0f} s"
    )
    return result


if __name__ == "__main__":
    main()
