"""``python -m benchmarks.sequence_dask``: kda.dask against the single-process functions.

Three measurements, written to ``--out/<name>.json`` and printed:

* ``work``: the total CPU time of the Dask graph (every task run in this process by Dask's
  synchronous scheduler, :func:`time.process_time`) over that of the single-process
  :func:`kda.chunk_kda` (+ :func:`kda.chunk_kda_backward`), for head sharding and for time sharding
  into ``--shards`` blocks. Target: time sharding <= 3x.
* ``wall``: wall time on a ``dask.distributed.LocalCluster`` of ``--workers`` single-threaded worker
  processes, each pinned to one core (so kda runs one head group per worker), inputs generated on
  the workers and results kept there, against the single-process run in this process (which uses
  every core through kda's head groups).
* ``accuracy`` (``--parts accuracy``): max-abs error over max-abs of the float64 recurrence, worst over
  the output, the final state and every gradient, as the number of time shards grows.

Default problem: B=1, H=16, T=16384, K=V=128, float32, chunk 64. Needs ``pip install 'kda[dask]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import kda

from . import _common

__all__ = ["main"]

NAMES = ("q", "k", "v", "g", "beta")
PARTS = ("work", "wall", "accuracy")


def _parser() -> argparse.ArgumentParser:
    prog = "python -m benchmarks.sequence_dask"
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    for name, default in (("B", 1), ("H", 16), ("T", 16384), ("K", 128), ("V", 128)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--shards", type=int, default=2, help="time and head blocks (default 2)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per entry, the best reported")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=["work", "wall"],
        help="what to measure (default: work wall)",
    )
    p.add_argument("--accuracy-T", type=int, default=4096)
    p.add_argument("--accuracy-shards", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="dask")
    return p


def _block(shape: tuple[int, ...], dtype: str, seed: int, kind: str) -> np.ndarray:
    """One input array (or block of one), drawn by :func:`benchmarks._common.draw` from its own seed."""
    return _common.draw(kind, shape, np.random.default_rng(seed), dtype)


def _shapes(a: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    seq = (a.B, a.H, a.T)
    return {
        "q": (*seq, a.K),
        "k": (*seq, a.K),
        "v": (*seq, a.V),
        "g": (*seq, a.K),
        "beta": seq,
        "do": (*seq, a.V),
    }


def _numpy_inputs(a: argparse.Namespace) -> dict[str, np.ndarray]:
    return {n: _block(s, a.dtype, i, n) for i, (n, s) in enumerate(_shapes(a).items())}


def _dask_inputs(a: argparse.Namespace, cut: str) -> dict[str, Any]:
    """Arrays like :func:`_numpy_inputs`, cut by heads or by time, each block drawn by its own task.

    Every block is created where the scheduler puts it, so the blocks spread over the workers.
    """
    import dask.array as da

    out = {}
    for i, (name, shape) in enumerate(_shapes(a).items()):
        chunks = [1, a.H // a.shards if cut == "heads" else a.H, a.T // a.shards if cut == "time" else a.T]
        template = da.zeros(shape, chunks=tuple(chunks) + shape[3:], dtype=a.dtype)
        out[name] = template.map_blocks(_drawn_block, a.dtype, i, name, dtype=a.dtype)
    return out


def _drawn_block(block: np.ndarray, dtype: str, seed: int, kind: str, block_info: Any = None) -> np.ndarray:
    """A block of one input, seeded by the input and the block's position."""
    location = block_info[0]["chunk-location"] if block_info else ()
    return _block(block.shape, dtype, hash((seed, *location)) % 2**32, kind)


def _single(x: dict[str, np.ndarray], C: int, backward: bool) -> Any:
    ins = [x[n] for n in NAMES]
    out = kda.chunk_kda(*ins, chunk_size=C, save_boundaries=backward)
    if not backward:
        return out
    return kda.chunk_kda_backward(*ins, out.boundaries, x["do"], chunk_size=C)


def _graph(x: dict[str, Any], C: int, backward: bool) -> list[Any]:
    """The Dask collections of one pass (forward: output and final state; +backward: gradients)."""
    import kda.dask as kd

    ins = [x[n] for n in NAMES]
    out = kd.chunk_kda(*ins, chunk_size=C, save_boundaries=backward)
    if not backward:
        return [out.output, out.final_state]
    grads = kd.chunk_kda_backward(*ins, out.boundaries, x["do"], chunk_size=C)
    return [out.output, out.final_state, *grads[:6]]


def _best(run: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Wall and CPU seconds of the fastest of ``repeats`` runs."""
    best = None
    for _ in range(repeats):
        _, wall_s, cpu_s = _common.timed(run)
        now = {"wall_s": wall_s, "cpu_s": cpu_s}
        best = now if best is None or now["wall_s"] < best["wall_s"] else best
    return best


def _work(a: argparse.Namespace, x: dict[str, np.ndarray]) -> dict[str, Any]:
    """CPU time of the Dask graph run in this process against the single-process call."""
    import dask
    import dask.array as da

    result: dict[str, Any] = {}
    small = {n: da.from_array(y[:, :, :64], chunks=(1, 1, 32, *y.shape[3:])) for n, y in x.items()}
    with dask.config.set(scheduler="synchronous"):
        dask.compute(*_graph(small, 16, True))  # warm-up
    for backward in (False, True):
        key = "fwd+bwd" if backward else "fwd"
        single = _best(lambda b=backward: _single(x, a.chunk_size, b), a.repeats)
        row = {"single": single}
        for cut in ("heads", "time"):
            axis = 1 if cut == "heads" else 2
            chunks = {n: [1, a.H, a.T, *x[n].shape[3:]] for n in x}
            for n in chunks:
                chunks[n][axis] //= a.shards
            dx = {n: da.from_array(x[n], chunks=tuple(chunks[n])) for n in x}
            graph = _graph(dx, a.chunk_size, backward)
            with dask.config.set(scheduler="synchronous"):
                run = _best(lambda g=graph: dask.compute(*g), a.repeats)
            run["cpu_ratio"] = run["cpu_s"] / single["cpu_s"]
            row[cut] = run
        result[key] = row
        print(
            f"work {key:8s} single {single['cpu_s']:7.2f} s CPU ({single['wall_s']:.2f} s wall); "
            f"{a.shards} head blocks {row['heads']['cpu_ratio']:.2f}x, "
            f"{a.shards} time shards {row['time']['cpu_ratio']:.2f}x"
        )
    return result


def _pin(dask_worker: Any) -> int:
    """Pin a worker process to one core (by its position), so that kda runs one head group in it."""
    cores = sorted(os.sched_getaffinity(0))
    names = sorted(w for w in dask_worker.scheduler.workers) if hasattr(dask_worker, "scheduler") else []
    index = names.index(dask_worker.address) if dask_worker.address in names else 0
    core = cores[index % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def _wall(a: argparse.Namespace, x: dict[str, np.ndarray]) -> dict[str, Any]:
    """Wall time on single-threaded worker processes, each on its own core."""
    from dask.graph_manipulation import clone
    from distributed import Client, LocalCluster, wait

    result: dict[str, Any] = {}
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def run(inputs: dict[str, Any], backward: bool) -> None:
        """One pass with fresh task keys, so that no result of an earlier run is reused."""
        graph = clone(*_graph(inputs, a.chunk_size, backward), omit=list(inputs.values()))
        wait(client.persist(list(graph)))

    with (
        LocalCluster(
            n_workers=a.workers, threads_per_worker=1, processes=True, dashboard_address=":0", env=env
        ) as cluster,
        Client(cluster) as client,
    ):
        addresses = sorted(client.scheduler_info()["workers"])
        cores = sorted(os.sched_getaffinity(0))
        for i, address in enumerate(addresses):
            core = cores[i % len(cores)]
            client.run(os.sched_setaffinity, 0, {core}, workers=[address])
        for backward in (False, True):
            key = "fwd+bwd" if backward else "fwd"
            single = _best(lambda b=backward: _single(x, a.chunk_size, b), a.repeats)
            row = {"single": single}
            for cut in ("heads", "time"):
                lazy = _dask_inputs(a, cut)
                inputs = dict(zip(lazy, client.persist(list(lazy.values()))))
                wait(list(inputs.values()))
                client.rebalance()  # sibling blocks may start on one worker: spread them
                placement = {w: len(keys) for w, keys in client.has_what().items()}
                run(inputs, backward)  # warm-up: imports on the workers

                timed = _best(lambda i=inputs, b=backward: run(i, b), a.repeats)
                timed["speedup"] = single["wall_s"] / timed["wall_s"]
                timed["input_blocks_per_worker"] = sorted(placement.values())
                row[cut] = timed
                del inputs
            result[key] = row
            print(
                f"wall {key:8s} single {single['wall_s']:7.2f} s; {a.workers} workers: "
                f"heads {row['heads']['wall_s']:.2f} s ({row['heads']['speedup']:.2f}x), "
                f"time {row['time']['wall_s']:.2f} s ({row['time']['speedup']:.2f}x)"
            )
    return result


def _accuracy(a: argparse.Namespace) -> dict[str, Any]:
    """Worst error against the float64 recurrence as the number of time shards grows."""
    import dask
    import dask.array as da

    import kda.dask as kd

    B, H, T, K, V, C = 1, 2, a.accuracy_T, 64, 64, a.chunk_size
    rng = np.random.default_rng(5)
    k = rng.standard_normal((B, H, T, K))
    x64 = {
        "q": rng.standard_normal((B, H, T, K)),
        "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
        "v": rng.standard_normal((B, H, T, V)),
        "g": -0.02 * rng.uniform(0, 1, (B, H, T, K)),  # weak decays: the state crosses every shard
        "beta": rng.uniform(0, 1, (B, H, T)),
    }
    s0, do, ds = (rng.standard_normal(s) for s in ((B, H, K, V), (B, H, T, V), (B, H, K, V)))
    ins64 = [x64[n] for n in NAMES]
    ref = kda.recurrent_kda(*ins64, initial_state=s0)
    ref_grads = kda.recurrent_kda_backward(*ins64, do, ds, initial_state=s0)
    refs = [ref.output, ref.final_state, *ref_grads[:6]]
    rows = []
    for dtype in ("float32", "float64"):
        sdt = np.float64 if dtype == "float64" else np.float32
        for shards in a.accuracy_shards:
            chunks = (1, H, T // shards)
            dx = [da.from_array(x64[n].astype(dtype), chunks=chunks + x64[n].shape[3:]) for n in NAMES]
            ddo = da.from_array(do.astype(dtype), chunks=(*chunks, V))
            out = kd.chunk_kda(*dx, initial_state=s0.astype(sdt), chunk_size=C, save_boundaries=True)
            grads = kd.chunk_kda_backward(
                *dx, out.boundaries, ddo, ds.astype(sdt), initial_state=s0.astype(sdt), chunk_size=C
            )
            with dask.config.set(scheduler="synchronous"):
                got = dask.compute(out.output, out.final_state, *grads[:6])
            errs = [float(np.max(np.abs(g - r)) / np.max(np.abs(r))) for g, r in zip(got, refs)]
            rows.append({"dtype": dtype, "shards": shards, "worst": max(errs), "output": errs[0]})
            print(f"accuracy {dtype} {shards:3d} shards: worst {max(errs):.2e} (output {errs[0]:.2e})")
    return {
        "problem": {"B": B, "H": H, "T": T, "K": K, "V": V, "chunk_size": C, "g": "-0.02 U(0, 1)"},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    print(
        f"kda.dask bench: B={a.B} H={a.H} T={a.T} K={a.K} V={a.V} {a.dtype}, chunk {a.chunk_size}, "
        f"{a.shards} blocks, {a.workers} workers, {os.cpu_count()} cores"
    )
    x = _numpy_inputs(a) if {"work", "wall"} & set(a.parts) else {}
    report: dict[str, Any] = {
        "command": "python -m benchmarks.sequence_dask " + " ".join(argv or []),
        "machine": _common.machine(),
        "problem": {
            k: getattr(a, k) for k in ("B", "H", "T", "K", "V", "dtype", "chunk_size", "shards", "workers")
        },
    }
    measures = {"work": lambda: _work(a, x), "wall": lambda: _wall(a, x), "accuracy": lambda: _accuracy(a)}
    for part in a.parts:
        report[part] = measures[part]()
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"{a.name}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
