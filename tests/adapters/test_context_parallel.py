"""Context parallelism (``kda.torch.build_cp_context``, ``chunk_kda(..., cp_context=ctx)``).

The ranks are real processes (``torch.multiprocessing`` spawn, ``gloo`` on CPU tensors, a free
port picked at run time), one process group per world size running every scenario of
``cp_worker.SCENARIOS`` with every option set and dtype (spawning costs seconds, so the cases
are batched), torn down in ``finally``; a hung rank fails the test after ``TIMEOUT`` seconds.
Each rank's output, every gradient and the final states equal the single-process call within
1e-5 (float32) and 1e-10 (float64), relative to the largest reference element.

The partition and the injected bugs run in-process (``cp_worker.simulate``: the ranks' steps
with the collectives replaced by stacking the maps).
"""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # before cp_worker, which imports torch

from cp_worker import OPTION_SETS, problem, simulated_errors, worker  # noqa: E402

import kda  # noqa: E402
from kda._entry import cp  # noqa: E402

TIMEOUT = 240  # seconds for one spawned group (measured: about 20 s for 4 ranks on 2 cores)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world_size: int, tmp_path, options=None) -> list[str]:
    """Run :func:`cp_worker.worker` on ``world_size`` ranks; fail on any rank's error or a hang."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        worker, args=(world_size, _free_port(), options, str(tmp_path)), nprocs=world_size,
        join=False, start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + TIMEOUT
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"context-parallel ranks did not finish within {TIMEOUT} s")
    except mp.ProcessRaisedException as err:
        pytest.fail(f"a rank failed:\n{err}")
    except mp.ProcessExitedException as err:
        # gloo occasionally aborts a rank at teardown ("terminate called without an active
        # exception", seen about once in 15 runs of 4 ranks here) after every rank has checked
        # its results; only a rank that did not finish its checks fails the test
        done = all((tmp_path / f"rank{r}.txt").exists() for r in range(world_size))
        if not done or list(tmp_path.glob("*.err")):
            pytest.fail(f"a rank died:\n{err}")
        # (reported on stderr, not as a warning: filterwarnings = error would fail the test)
        print(f"a rank died after its checks passed: {err}", file=sys.stderr)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [(tmp_path / f"rank{r}.txt").read_text() for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_match_single_process(world_size, tmp_path):
    """fla's scenarios (scaled down) x every option set x float32/float64, with initial_state
    and the final states: output, final states and every gradient."""
    lines = _spawn(world_size, tmp_path)
    assert all(len(text.splitlines()) == len(lines[0].splitlines()) > 0 for text in lines)


# ----------------------------------------------------------------------------------------------
# The partition (fla's get_cp_cu_seqlens cases)


def test_partition_matches_fla_example():
    p = cp.partition([0, 5, 12], 3, 1)  # fla's test_cp_context example
    assert p.local_offsets == (0, 1, 4)
    assert (p.pre_num_conv_tokens, p.pre_num_ranks, p.post_num_ranks) == (4, 1, 1)
    p = cp.partition([0, 70, 96], 4, 2)
    assert p.local_seqs == (0, 1) and p.local_offsets == (0, 22, 24)
    assert (p.pre_num_ranks, p.post_num_ranks) == (2, 1)
    assert not cp.partition([0, 48, 96], 2, 0).crossing


@pytest.mark.parametrize(
    ("offsets", "world_size"), [([0, 10], 3), ([0, 4, 14], 4), ([0, 2], 3), ([0, 5, 3], 1)]
)
def test_partition_refusals(offsets, world_size):
    with pytest.raises(kda.InvalidInputError, match="cu_seqlens"):
        cp.partition(offsets, world_size, 0)


def test_build_cp_context_needs_a_process_group():
    import kda.torch as kt

    with pytest.raises(kda.InvalidInputError, match="process group"):
        kt.build_cp_context(torch.tensor([0, 8]), group=None)
    x = problem((8,), "plain", torch.float32)["x"]
    with pytest.raises(kda.InvalidTypeError, match="cp_context"):
        kt.chunk_kda(*(x[n] for n in ("q", "k", "v", "g", "beta")), cp_context=object())


# ----------------------------------------------------------------------------------------------
# Injected bugs: each must be caught by the comparison the spawned ranks run


def _wrong_order_start_states(p, maps, initial_state, shape, dtype, xp):
    """Bug: the earlier ranks' maps folded last-first."""
    K = shape[1]
    starts = []
    for i, n in enumerate(p.local_seqs):
        s = initial_state[n]
        if i == 0:
            for j in reversed(range(p.first_rank[n], p.rank)):
                s = xp.matmul(maps[j][..., :K], s) + maps[j][..., K:]
        starts.append(s)
    return xp.stack(starts)


def _drop_last_rank_gradient(original):
    """Bug: the end-state gradient ignores the last rank of the sequence."""

    def end_gradients(p, maps, grad_final_state, shape, dtype, xp):
        maps = maps.copy()
        maps[p.world_size - 1][..., shape[1] :] = 0  # the last rank's D dropped
        return original(p, maps, grad_final_state, shape, dtype, xp)

    return end_gradients


def _one_boundary_only(original):
    """Bug: a sequence's start state folds only the previous rank's map (wrong when it crosses
    two boundaries)."""

    def start_states(p, maps, initial_state, shape, dtype, xp):
        first = list(p.first_rank)
        n = p.local_seqs[0]
        first[n] = max(first[n], p.rank - 1)
        return original(replace(p, first_rank=tuple(first)), maps, initial_state, shape, dtype, xp)

    return start_states


@pytest.mark.parametrize(
    ("bug", "lengths", "world_size"),
    [
        ("wrong_order", (70, 26), 4),
        ("last_rank_gradient_dropped", (30, 40, 26), 2),
        ("one_boundary_only", (70, 26), 4),
    ],
)
def test_injected_bugs_are_caught(bug, lengths, world_size, monkeypatch):
    scenario = problem(lengths, "plain", torch.float64)
    assert simulated_errors(scenario, world_size) <= 1e-10  # the unmodified steps pass
    if bug == "wrong_order":
        monkeypatch.setattr(cp, "start_states", _wrong_order_start_states)
    elif bug == "last_rank_gradient_dropped":
        monkeypatch.setattr(cp, "end_gradients", _drop_last_rank_gradient(cp.end_gradients))
    else:
        monkeypatch.setattr(cp, "start_states", _one_boundary_only(cp.start_states))
    assert simulated_errors(scenario, world_size) > 1e-3


def test_option_sets_cover_the_issue():
    """GVA, both in-kernel gates, both beta activations, q/k L2 norm and state_v_first."""
    keys = set().union(*OPTION_SETS.values())
    assert {
        "HV",
        "use_gate_in_kernel",
        "lower_bound",
        "use_beta_sigmoid_in_kernel",
        "allow_neg_eigval",
    } <= keys
    assert {"use_qk_l2norm_in_kernel", "state_v_first"} <= keys
    assert np.isfinite(simulated_errors(problem((96,), "plain", torch.float64), 4))


def test_diverged_carried_state_is_named():
    """A non-finite state carried from earlier ranks is reported as such, not as a bad
    initial_state the user never passed."""
    scenario = problem((96,), "plain", torch.float64)
    x = scenario["x"]
    p = cp.partition([0, 96], 2, 1)
    xr = tuple(x[n][:, 48:].numpy() for n in ("q", "k", "v", "g", "beta"))
    starts = np.full((1, 2, 8, 4), np.nan)
    with pytest.raises(kda.InvalidInputError, match="rank 1: the state carried"):
        cp.forward_local(p, xr, starts, {"layout": "time_major", "chunk_size": 16})
