"""Context parallelism over torch.distributed: 2 ranks (gloo, CPU) against 1 process.

One packed sequence ``B = 1, H = 16, T = 16384, K = V = 128``, float32, chunk 64, fla's
keywords (``kda.torch.chunk_kda``), forward and forward + backward (``o.backward(do)``):

* ``1 process``: the whole sequence in this process (kda runs its head groups on both cores),
  and the same in a spawned process pinned to one core (one thread: the work of one rank's core);
* ``2 ranks``: two spawned processes, each pinned to one core (one thread each), each holding
  half the sequence (``build_cp_context``), with ``initial_state`` and ``output_final_state``.

The bytes every rank sends and receives are counted by wrapping ``torch.distributed.all_gather``
and ``all_reduce``. Wall time: minimum over rounds (each rank's time is the slowest rank's).

    python benchmarks/context_parallel.py [--T 16384] [--rounds 3]

writes ``benchmarks/results/context_parallel.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a file: the repository root, for benchmarks._common
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common

H, K, V = 16, 128, 128


def _tensors(T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`benchmarks._common.inputs` (``B = 1``, float32) as time-major torch tensors."""
    x = _common.inputs(1, H, T, K, V, np.float32, seed, layout="time_major")
    return {("initial_state" if n == "state" else n): torch.from_numpy(a) for n, a in x.items()}


def _run(x: dict[str, torch.Tensor], sl: slice, backward: bool, **kw) -> None:
    import kda.torch as kt

    leaves = {n: x[n][:, sl].clone().requires_grad_(backward) for n in ("q", "k", "v", "g", "beta")}
    s0 = x["initial_state"].clone().requires_grad_(backward)
    o, _ = kt.chunk_kda(*leaves.values(), initial_state=s0, output_final_state=True, **kw)
    if backward:
        o.backward(x["do"][:, sl])


def _time(fn, rounds: int, sync=None) -> float:
    best = float("inf")
    for _ in range(rounds):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _rank(rank: int, world_size: int, port: int, T: int, rounds: int, out: str) -> None:
    import torch.distributed as dist

    import kda.torch as kt

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    counts = {"sent": 0, "received": 0, "calls": 0}
    gather, reduce = dist.all_gather, dist.all_reduce

    def all_gather(tensors, tensor, group=None, **kw):
        counts["sent"] += tensor.numel() * tensor.element_size()
        counts["received"] += (
            sum(t.numel() * t.element_size() for t in tensors) - tensor.numel() * tensor.element_size()
        )
        counts["calls"] += 1
        return gather(tensors, tensor, group=group, **kw)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, **kw):
        if tensor.numel() > 1:  # the timing barrier's scalar is not counted
            nbytes = tensor.numel() * tensor.element_size()  # ring all-reduce: about 2 (W-1)/W of it each way
            counts["sent"] += nbytes
            counts["received"] += nbytes
            counts["calls"] += 1
        return reduce(tensor, op=op, group=group, **kw)

    try:
        x = _tensors(T)
        P = T // world_size
        sl = slice(rank * P, (rank + 1) * P)
        ctx = kt.build_cp_context(torch.tensor([0, T]), group=None)
        dist.all_gather, dist.all_reduce = all_gather, all_reduce
        _run(x, sl, True, cp_context=ctx)  # warm-up
        counts.update(sent=0, received=0, calls=0)
        _run(x, sl, True, cp_context=ctx)
        per_call = dict(counts)
        sync = dist.barrier
        fwd = _time(lambda: _run(x, sl, False, cp_context=ctx), rounds, sync)
        both = _time(lambda: _run(x, sl, True, cp_context=ctx), rounds, sync)
        if rank == 0:
            Path(out).write_text(
                json.dumps({"forward_s": fwd, "forward_backward_s": both, "bytes": per_call})
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _pinned(rank: int, T: int, rounds: int, out: str) -> None:
    """The single-process call on one core (one thread), for the per-core comparison."""
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    x = _tensors(T)
    sl = slice(0, T)
    _run(x, sl, True)
    fwd = _time(lambda: _run(x, sl, False), rounds)
    both = _time(lambda: _run(x, sl, True), rounds)
    Path(out).write_text(json.dumps({"forward_s": fwd, "forward_backward_s": both}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "context_parallel.json"))
    args = parser.parse_args()

    load_before = _common.load_average()
    x = _tensors(args.T)
    sl = slice(0, args.T)
    _run(x, sl, True)  # warm-up
    single = {
        "forward_s": _time(lambda: _run(x, sl, False), args.rounds),
        "forward_backward_s": _time(lambda: _run(x, sl, True), args.rounds),
    }
    print("1 process:", single, flush=True)

    import torch.multiprocessing as mp

    # one BLAS/OpenMP thread per rank: a rank pinned to one core with BLAS's default thread count
    # (one per core) spends its time in the threads' spin-waits (measured: 20x slower)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(args.output).with_suffix(".rank0.tmp")
    mp.start_processes(_rank, args=(2, port, args.T, args.rounds, str(tmp)), nprocs=2, start_method="spawn")
    two = json.loads(tmp.read_text())
    tmp.unlink()
    print("2 ranks:", two, flush=True)
    mp.start_processes(_pinned, args=(args.T, args.rounds, str(tmp)), nprocs=1, start_method="spawn")
    one_core = json.loads(tmp.read_text())
    tmp.unlink()
    print("1 process, 1 core:", one_core, flush=True)
    maps = H * K * (K + V) * 4
    result = {
        "problem": {"B": 1, "H": H, "T": args.T, "K": K, "V": V, "dtype": "float32", "chunk_size": 64},
        "machine": _common.machine(),
        "placement": "1 process uses every core, each rank pinned to one",
        "rounds": args.rounds,
        "load_average_before_after": [load_before, _common.load_average()],
        "one_process": single,
        "one_process_one_core": one_core,
        "two_ranks_gloo": two,
        "speedup_forward": single["forward_s"] / two["forward_s"],
        "speedup_forward_backward": single["forward_backward_s"] / two["forward_backward_s"],
        "speedup_vs_one_core_forward": one_core["forward_s"] / two["forward_s"],
        "speedup_vs_one_core_forward_backward": one_core["forward_backward_s"] / two["forward_backward_s"],
        "bytes_per_rank_expected": {
            "forward_all_gather_send": maps,
            "backward_all_gather_send": maps,
            "final_state_all_reduce": H * K * V * 4,
            "final_state_grad_all_reduce": H * K * V * 4,
        },
        "command": "python benchmarks/context_parallel.py",
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
