"""Context-parallel scenarios, shared by tests/adapters/test_context_parallel.py and its spawned ranks.

A scenario is a packed ``B == 1`` batch (sequence lengths), a world size, an option set and a
dtype. :func:`problem` draws the global inputs (the same on every rank from the seed);
:func:`single_process` is the single-process ``kda.torch.chunk_kda`` with autograd; :func:`check_rank`
compares one rank's context-parallel result with it: the output and every input gradient on the
rank's slice, the complete final states, and the replicated inputs' gradients (``initial_state``,
``A_log``, ``dt_bias``) summed over ranks. The loss on rank ``r`` is
``<do_r, o_r> + <dF_r, final_state>``, so the single-process loss is
``<do, o> + <sum_r dF_r, final_state>``.
"""

from __future__ import annotations

import itertools
import os
import traceback
from typing import Any

import numpy as np
import torch

H, K, V = 2, 8, 4
CHUNK = 16

# option sets: fla keywords (A_log / dt_bias drawn by problem() when the gate needs them)
OPTION_SETS: dict[str, dict[str, Any]] = {
    "plain": {},
    "gva_softplus_l2": {"use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True, "HV": 4},
    "lower_bound_sigmoid": {
        "use_gate_in_kernel": True,
        "safe_gate": True,
        "lower_bound": -5.0,
        "use_beta_sigmoid_in_kernel": True,
    },
    "neg_eigval_v_first": {
        "use_beta_sigmoid_in_kernel": True,
        "allow_neg_eigval": True,
        "state_v_first": True,
        "HV": 4,
    },
}

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def problem(lengths: tuple[int, ...], option: str, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """Global inputs of one scenario (every tensor float ``dtype``; ``cu_seqlens`` int64)."""
    opts = dict(OPTION_SETS[option])
    HV = opts.pop("HV", H)
    T, N = sum(lengths), len(lengths)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    x = {
        "q": randn(1, T, H, K),
        "k": torch.nn.functional.normalize(randn(1, T, H, K), dim=-1),
        "v": randn(1, T, HV, V),
        "beta": torch.rand(1, T, HV, generator=gen, dtype=torch.float64).to(dtype),
        "initial_state": randn(N, HV, K, V),
    }
    if opts.get("use_gate_in_kernel"):
        x["g"] = randn(1, T, HV, K)
        x["A_log"] = randn(1, 1, HV, 1, scale=0.5) - 2.0  # fla's test shape; weak decay crosses ranks
        x["dt_bias"] = randn(HV * K, scale=0.5)
    else:
        x["g"] = -0.05 * torch.rand(1, T, HV, K, generator=gen, dtype=torch.float64).to(dtype)
    if opts.get("use_beta_sigmoid_in_kernel"):
        x["beta"] = randn(1, T, HV)
    if opts.get("state_v_first"):
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    x["do"] = randn(1, T, HV, V)
    x["cu_seqlens"] = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    return {"x": x, "opts": opts, "T": T, "N": N}


DIFF = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _leaves(x: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {n: x[n].detach().clone().requires_grad_() for n in DIFF if n in x}


def dfinal(scenario: dict[str, Any], rank: int) -> torch.Tensor:
    """``dF_r``: rank ``r``'s gradient of the (replicated) final states."""
    s0 = scenario["x"]["initial_state"]
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(s0.shape, generator=gen, dtype=torch.float64).to(s0.dtype)


def single_process(scenario: dict[str, Any], world_size: int) -> dict[str, torch.Tensor]:
    """Single-process output, final states and gradients."""
    import kda.torch as kt

    x, opts = scenario["x"], scenario["opts"]
    leaves = _leaves(x)
    extra = {n: leaves[n] for n in ("A_log", "dt_bias") if n in leaves}
    o, final = kt.chunk_kda(
        *(leaves[n] for n in ("q", "k", "v", "g", "beta")),
        initial_state=leaves["initial_state"],
        output_final_state=True,
        cu_seqlens=x["cu_seqlens"],
        chunk_size=CHUNK,
        **extra,
        **opts,
    )
    dF = sum(dfinal(scenario, r) for r in range(world_size))
    ((o * x["do"]).sum() + (final * dF).sum()).backward()
    return {"o": o.detach(), "final": final.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def run_rank(
    scenario: dict[str, Any], rank: int, world_size: int, group: Any = None
) -> dict[str, torch.Tensor]:
    """This rank's context-parallel output, final states and gradients (replicated inputs'
    gradients summed over ranks with an all-reduce)."""
    import torch.distributed as dist

    import kda.torch as kt

    x, opts, T = scenario["x"], scenario["opts"], scenario["T"]
    P = T // world_size
    sl = slice(rank * P, (rank + 1) * P)
    local = {n: (x[n][:, sl] if n in ("q", "k", "v", "g", "beta") else x[n]) for n in DIFF if n in x}
    leaves = _leaves(local)
    extra = {n: leaves[n] for n in ("A_log", "dt_bias") if n in leaves}
    ctx = kt.build_cp_context(x["cu_seqlens"], group=group)
    o, final = kt.chunk_kda(
        *(leaves[n] for n in ("q", "k", "v", "g", "beta")),
        initial_state=leaves["initial_state"],
        output_final_state=True,
        cp_context=ctx,
        chunk_size=CHUNK,
        **extra,
        **opts,
    )
    ((o * x["do"][:, sl]).sum() + (final * dfinal(scenario, rank)).sum()).backward()
    out = {"o": o.detach(), "final": final.detach()}
    for n, t in leaves.items():
        gr = t.grad.clone()
        if n in ("initial_state", "A_log", "dt_bias"):
            dist.all_reduce(gr, group=group)
        out[f"d{n}"] = gr
    return out


def rank_errors(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rank: int, world_size: int, tol: float
):
    """``max|got - want| <= tol * max|want|`` for every field (slices of the sequence fields)."""
    T = want["o"].shape[1]
    P = T // world_size
    errors = {}
    for name, w in want.items():
        if name in ("o", "dq", "dk", "dv", "dg", "dbeta"):
            w = w[:, rank * P : (rank + 1) * P]
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{name}: {g.shape} {g.dtype} != {w.shape} {w.dtype}"
        )
        err = float((g.double() - w.double()).abs().max()) / max(float(w.double().abs().max()), 1e-30)
        errors[name] = err
        assert err <= tol, f"rank {rank}: {name} relative error {err:.2e} > {tol:.0e}"
    return errors


# scenarios per world size: fla's (a sequence cut mid-rank, boundaries aligned with ranks, many
# mixed lengths, one sequence across all ranks) scaled down, plus empty sequences and a sequence
# crossing two boundaries; T = 96 tokens, chunk 16 (several chunks per rank)
SCENARIOS = {
    2: {
        "cut": (30, 40, 26),
        "aligned": (48, 48),
        "many": (10, 15, 20, 25, 12, 10, 4),
        "single": (96,),
    },
    4: {
        "complex": (70, 26),  # the first sequence spans ranks 0-2: two boundaries
        "single": (96,),
        "empty_and_short": (5, 0, 19, 1, 60, 11, 0),
        "aligned": (24, 48, 24),
    },
}


def cases(world_size: int, options=None, dtypes=(torch.float32, torch.float64)):
    """Every (name, lengths, option, dtype) of a world size."""
    for (name, lengths), option, dtype in itertools.product(
        SCENARIOS[world_size].items(), options or OPTION_SETS, dtypes
    ):
        yield name, lengths, option, dtype


def worker(rank: int, world_size: int, port: int, options: Any, result_dir: str) -> None:
    """One spawned rank: every case of its world size, one process group."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        lines = []
        for name, lengths, option, dtype in cases(world_size, options):
            scenario = problem(lengths, option, dtype)
            want = single_process(scenario, world_size)
            got = run_rank(scenario, rank, world_size)
            errors = rank_errors(got, want, rank, world_size, TOLERANCE[dtype])
            lines.append(f"{name} {option} {dtype} {max(errors.values()):.2e}")
        with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(lines))
        dist.barrier()  # no rank tears gloo's connections down while a peer still uses them
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# In-process simulation of the ranks (no process group): kda/_entry/cp.py's steps, with the
# collectives replaced by stacking every rank's map. Fast; used for the injected-bug tests.


def simulate(scenario: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """Every rank's output, final-state share and gradients (NumPy float64), from cp.py's steps."""
    from kda._entry import cp
    from kda._options.spec import CallSpec

    x, opts, T = scenario["x"], scenario["opts"], scenario["T"]
    assert not opts, "simulate() runs kda's options directly: plain scenarios only"
    P = T // world_size
    arr = {n: x[n].double().numpy() for n in ("q", "k", "v", "g", "beta", "initial_state", "do")}
    core = CallSpec(scale=K**-0.5, chunk_size=CHUNK, layout="time_major")
    offsets = x["cu_seqlens"].tolist()
    parts = [cp.partition(offsets, world_size, r) for r in range(world_size)]
    xs = [
        tuple(arr[n][:, r * P : (r + 1) * P] for n in ("q", "k", "v", "g", "beta")) for r in range(world_size)
    ]
    dos = [arr["do"][:, r * P : (r + 1) * P] for r in range(world_size)]
    HV = arr["v"].shape[2]
    maps = np.stack([cp.forward_map(p, xr, core, np.float64) for p, xr in zip(parts, xs)])
    dF = sum(dfinal(scenario, r) for r in range(world_size)).double().numpy()
    s0 = arr["initial_state"]
    fwd = []
    for p, xr in zip(parts, xs):
        starts = cp.start_states(p, maps, s0, (HV, K, V), np.float64, np)
        fwd.append((starts, cp.forward_local(p, xr, starts, core)))
    bmaps = np.stack(
        [
            cp.backward_map(p, xr, d, core, np.float64, own_map=maps[p.rank])
            for p, xr, d in zip(parts, xs, dos)
        ]
    )
    results = []
    for p, xr, d, (starts, out) in zip(parts, xs, dos, fwd):
        dends = cp.end_gradients(p, bmaps, dF, (HV, K, V), np.float64, np)
        grads = cp.backward_local(p, xr, starts, out.boundaries, d, dends, core, dF)
        share = cp.final_state_share(p, out.final_state, s0, np)
        results.append({"o": out.output, "final_share": share, "grads": grads})
    return results


def simulated_errors(scenario: dict[str, Any], world_size: int) -> float:
    """Worst relative error of :func:`simulate` against the single-process float64 reference."""
    want = single_process(scenario, world_size)
    res = simulate(scenario, world_size)
    got = {
        "o": np.concatenate([r["o"] for r in res], axis=1),
        "final": sum(r["final_share"] for r in res),
        **{
            f"d{n}": np.concatenate([r["grads"][i] for r in res], axis=1)
            for i, n in enumerate(("q", "k", "v", "g", "beta"))
        },
        "dinitial_state": sum(r["grads"].initial_state for r in res),
    }
    worst = 0.0
    for name, g in got.items():
        w = want[name].double().numpy()
        worst = max(worst, float(np.abs(g - w).max()) / max(float(np.abs(w).max()), 1e-30))
    return worst
