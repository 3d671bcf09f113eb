"""``python -m benchmarks.decode``: one decode step (T = 1), kda against llama.cpp's ggml, side by side.

Per ``H`` (default 4, 16, 32; ``B = 1``, ``K = V = 128``, float32) it prints, from one run:

- ``ggml``: ``ggml_gated_delta_net`` in KDA mode on ggml's CPU backend, 2 threads
  (:mod:`benchmarks.llama_cpp` builds ``benchmarks/ggml_kda.c``), and ggml at ``B = 64`` for the
  pool-of-256 row. ggml's timer covers ``ggml_graph_compute`` of a one-node graph alone, run as
  llama.cpp runs a model: the threadpool (ggml's default parameters: polling workers) and the
  compute plan with its work buffer are made once before the repeats, so no thread is created or
  joined inside the timer; the inputs are already in ggml tensors and nothing is copied in or out.
  kda's columns, by contrast, time the whole Python call (validation, dispatch, output allocation);
- ``decode_kda``: :func:`kda.decode_kda` on a pool of 8 rows, one request (row 3);
- ``plan``: the prepared form, :func:`kda.prepare_decode_kda` ``.run()``;
- ``decode_kda split``: ``decode_kda`` with the step split over both cores whatever its size
  (``kda.cpu._decode.SPLIT_WORK = 0``; by default a step this small runs on the calling thread):
  whether the split threshold should be lower;
- ``torch``: ``kda.torch.fused_recurrent_kda(q, k, v, g, beta, initial_state=s0,
  output_final_state=True)`` in ``torch.inference_mode()`` (time-major ``[1, 1, H, K]`` tensors);
- ``torch pool``: vLLM's call, ``fused_recurrent_kda(q, k, v, g, beta, initial_state=pool,
  ssm_state_indices=rows, inplace_final_state=True)`` with int32 ``rows`` (row 3 of a pool of 8);
- ``64/256``: ``decode_kda`` and the plan with 64 requests from a pool of 256 rows (split over
  both cores: ``kda.cpu._decode.SPLIT_WORK``), and ``decode_kda`` held to one thread;
- ``ggml 1 thread``: the same ggml step on one thread (less sensitive to other load);
- the targets (``decode_kda <= 1.5 ggml + 25 us``, ``torch <= 1.5 ggml + 60 us``),
  whether each is met, the agreement of kda's step with ggml's (max abs difference of outputs and
  states), the same-run GEMM rate and ``os.getloadavg()`` before and after.

Times are the median (and the minimum) of ``--repeats`` calls after 50 warm-up calls. Run on a quiet
machine, without the OpenBLAS settings of the test environment::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m benchmarks.decode

Where ggml cannot be built here (no compiler, cmake or network) its columns say why and the kda
columns are still printed.

``--pools`` times instead one step (``K = V = 128``; one request of a pool of 8, and 64 requests
of a pool of 256) from each pool layout and dtype serving engines keep: float32, float16 and
bfloat16 (``ml_dtypes``), K-major ``[P, H, K, V]`` and V-major ``[P, H, V, K]``
(``state_v_first=True``), through :func:`kda.decode_kda` and ``kda.torch``'s pool call (vLLM's),
with the ratios the targets name (V-major within 1.2x of K-major, 16-bit within 1.2x of
float32) and a verdict on each. The variants are timed in alternating rounds (each round calls
every variant once, in a rotated order), so that the ratios compare calls made at the same
time::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m benchmarks.decode --pools

Both forms print ``uptime`` (the load average) and the CPU model with the figures.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

import kda

from . import _common

K = V = 128
POOL, ROW = 8, 3
MANY, MANY_POOL = 64, 256


WARM_UP = 50  # calls before the timed ones: a serving loop's steady state, not its first calls


def _times(fn: Any, repeats: int) -> tuple[float, float]:
    """(median, min) seconds of ``fn()`` over ``repeats`` calls, after :data:`WARM_UP` calls."""
    t = _common.rounds({"fn": fn}, repeats, warm_up=WARM_UP)["fn"]
    return t.median_s, t.min_s


def _aligned(a: np.ndarray) -> np.ndarray:
    """``a`` as float32 in a 64-byte-aligned buffer: NumPy aligns large arrays to 16 bytes only,
    and a state whose rows start 16 bytes into a cache line steps 10-20% slower (measured at
    H = 32), which made the figures differ from run to run with where the allocator put them."""
    buf = np.empty(a.size + 16, np.float32)
    start = (-buf.ctypes.data % 64) // 4
    out = buf[start : start + a.size].reshape(a.shape)
    out[...] = a
    return out


def _one_step(B: int, H: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One step of :func:`benchmarks._common.inputs` (float32, ``K = V = 128``)."""
    return _common.inputs(B, H, 1, K, V, np.float32, seed)


def _ggml(x: dict[str, np.ndarray], state: np.ndarray, repeats: int, threads: int) -> tuple[Any, str]:
    """ggml's result dict, or None and the reason it cannot run."""
    try:
        from .llama_cpp import GgmlUnavailable, ggml_forward
    except ImportError as err:  # pragma: no cover
        return None, f"benchmarks.llama_cpp missing: {err}"
    try:
        return ggml_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], state, threads, repeats), ""
    except (GgmlUnavailable, OSError) as err:
        return None, str(err)


def _one_row(H: int, repeats: int) -> dict[str, Any]:
    """ggml, decode_kda, the plan and kda.torch on one request (row ROW of a pool of POOL)."""
    x = _one_step(1, H)
    rng = np.random.default_rng(1)
    s0 = _aligned(0.1 * rng.standard_normal((1, H, K, V)))
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    # agreement: one step of kda from s0 against ggml's
    check_pool = np.zeros((POOL, H, K, V), np.float32)
    check_pool[ROW] = s0[0]
    rows = np.array([ROW], np.int64)
    kda_out = kda.decode_kda(q, k, v, g, beta, check_pool, rows)
    row = {"H": H}
    ggml, why = _ggml(x, s0, repeats, 2)
    one, _ = _ggml(x, s0, repeats, 1)
    row["ggml1"] = None if one is None else (one["time_s"], min(one["times_s"]))
    if ggml is not None:
        row["ggml"] = (ggml["time_s"], min(ggml["times_s"]))
        row["agreement"] = max(
            float(np.abs(kda_out - ggml["output"]).max()),
            float(np.abs(check_pool[ROW] - ggml["final_state"][0]).max()),
        )
    else:
        row["ggml_missing"] = why
    pool = _aligned(np.zeros((POOL, H, K, V)))
    pool[ROW] = s0[0]
    row["decode_kda"] = _times(lambda: kda.decode_kda(q, k, v, g, beta, pool, rows), repeats)
    plan = kda.prepare_decode_kda(q, k, v, g, beta, pool, rows)
    row["plan"] = _times(plan.run, repeats)
    row["split"] = _split(lambda: kda.decode_kda(q, k, v, g, beta, pool, rows), repeats)
    row["torch"], row["torch_pool"] = _torch(x, s0, repeats)
    return row


def _split(fn: Any, repeats: int) -> Any:
    """``fn`` timed with every decode step split over both cores (``SPLIT_WORK = 0``), or None
    on one core: whether the split threshold should be lower."""
    import kda.cpu._decode as cpu_decode

    if cpu_decode._cores() < 2:
        return None
    split, cpu_decode.SPLIT_WORK = cpu_decode.SPLIT_WORK, 0
    try:
        return _times(fn, repeats)
    finally:
        cpu_decode.SPLIT_WORK = split


def _torch(x: dict[str, np.ndarray], s0: np.ndarray, repeats: int) -> tuple[Any, Any]:
    """kda.torch's plain recurrent call and its pool call (vLLM's), (median, min) each."""
    try:
        import torch

        from kda.torch import fused_recurrent_kda
    except ImportError:
        return None, None
    q, k, v, g, beta = (
        torch.from_numpy(np.ascontiguousarray(np.swapaxes(x[n], 1, 2))) for n in "q k v g beta".split()
    )
    state = torch.from_numpy(s0)
    pool = torch.zeros((POOL, *s0.shape[1:]))
    pool[ROW] = state[0]
    rows = torch.tensor([ROW], dtype=torch.int32)
    with torch.inference_mode():
        plain = _times(
            lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True),
            repeats,
        )
        vllm = _times(
            lambda: fused_recurrent_kda(
                q, k, v, g, beta, initial_state=pool, ssm_state_indices=rows, inplace_final_state=True
            ),
            repeats,
        )
    return plain, vllm


def _many(H: int, repeats: int) -> dict[str, Any]:
    """MANY requests, distinct rows of a pool of MANY_POOL: decode_kda, the plan, ggml at B = MANY."""
    x = _one_step(MANY, H, seed=2)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    rng = np.random.default_rng(3)
    pool = _aligned(0.1 * rng.standard_normal((MANY_POOL, H, K, V)))
    rows = rng.choice(MANY_POOL, MANY, replace=False).astype(np.int64)
    row: dict[str, Any] = {
        "decode_kda": _times(lambda: kda.decode_kda(q, k, v, g, beta, pool, rows), repeats)
    }
    row["plan"] = _times(kda.prepare_decode_kda(q, k, v, g, beta, pool, rows).run, repeats)
    import kda.cpu._decode as cpu_decode

    split, cpu_decode.SPLIT_WORK = cpu_decode.SPLIT_WORK, 1 << 62  # the same call on one thread
    try:
        row["one_thread"] = _times(lambda: kda.decode_kda(q, k, v, g, beta, pool, rows), repeats)
    finally:
        cpu_decode.SPLIT_WORK = split
    ggml, _ = _ggml(x, np.ascontiguousarray(pool[rows]), repeats, 2)
    row["ggml"] = None if ggml is None else (ggml["time_s"], min(ggml["times_s"]))
    return row


def _us(t: Any) -> str:
    """Median (min) in microseconds, or '-'."""
    return "-" if t is None else f"{t[0] * 1e6:.1f} ({t[1] * 1e6:.1f})"


def _target(measured: Any, target: float | None) -> str:
    if measured is None or target is None:
        return "-"
    return f"{target * 1e6:.1f} {'met' if measured[0] <= target else 'NOT MET'}"


COLUMNS = (
    "H", "ggml", "ggml 1 thread", "decode_kda", "plan", "decode_kda split", "torch", "torch pool",
    "kda target (1.5 ggml + 25)",
    "torch target (1.5 ggml + 60)",
    "|kda - ggml|", "64/256 decode_kda", "64/256 plan", "64/256 decode_kda 1 thread", "ggml B=64",
)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# --pools: the pool layouts and dtypes engines keep


POOL_KINDS = (("float32", False), ("float32", True), ("float16", False), ("float16", True),
              ("bfloat16", False), ("bfloat16", True))  # fmt: skip


def _pool_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _pool_of(a: np.ndarray, dtype: str, v_first: bool) -> np.ndarray:
    """``a`` ([P, H, K, V] float32) as a pool of ``dtype`` in its layout, 64-byte aligned."""
    a = np.ascontiguousarray(np.swapaxes(a, -1, -2)) if v_first else a
    dt = np.dtype(_pool_dtype(dtype))
    buf = np.empty(a.size * dt.itemsize + 64, np.uint8)
    start = -buf.ctypes.data % 64
    out = buf[start : start + a.size * dt.itemsize].view(dt).reshape(a.shape)
    out[...] = a.astype(dt)
    return out


def _torch_pool(pool: np.ndarray) -> Any:
    import torch

    if pool.dtype.name == "bfloat16":
        return torch.from_numpy(pool.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(pool)


def _pools(H: int, N: int, P: int, repeats: int) -> dict[str, Any]:
    """One step of ``N`` requests (distinct rows of a pool of ``P``) for every pool kind:
    ``decode_kda`` and ``kda.torch.fused_recurrent_kda``'s pool call, (median, min) each, timed
    in alternating rounds (:func:`_rounds`)."""
    x = _one_step(N, H, seed=5)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    rng = np.random.default_rng(6)
    base = (0.1 * rng.standard_normal((P, H, K, V))).astype(np.float32)
    rows = rng.choice(P, N, replace=False).astype(np.int64)
    try:
        import torch

        from kda.torch import fused_recurrent_kda
    except ImportError:
        torch = None
    if torch is not None:
        tx = [torch.from_numpy(np.ascontiguousarray(np.swapaxes(x[n], 1, 2))) for n in "q k v g beta".split()]
        trows = torch.from_numpy(rows.astype(np.int32))
    fns: dict[str, Any] = {}
    for dtype, v_first in POOL_KINDS:
        pool = _pool_of(base, dtype, v_first)
        key = f"{dtype} {'V' if v_first else 'K'}"

        def plain(pool=pool, v_first=v_first) -> Any:
            return kda.decode_kda(q, k, v, g, beta, pool, rows, state_v_first=v_first)

        fns[key] = plain
        if torch is not None:
            tpool = _torch_pool(pool)

            def pool_call(tpool=tpool, v_first=v_first) -> Any:
                return fused_recurrent_kda(*tx, initial_state=tpool, ssm_state_indices=trows,
                                           inplace_final_state=True, state_v_first=v_first)  # fmt: skip

            fns["torch " + key] = pool_call
    if torch is None:
        return _rounds(fns, repeats)
    with torch.inference_mode():  # vLLM's mode (the NumPy calls do not care)
        return _rounds(fns, repeats)


def _rounds(fns: dict[str, Any], repeats: int) -> dict[str, tuple[float, float]]:
    """(median, min) seconds of each of ``fns`` over ``repeats`` rounds, after :data:`WARM_UP`
    calls of each (:func:`benchmarks._common.rounds`: the order rotates from round to round)."""
    return {name: (t.median_s, t.min_s) for name, t in _common.rounds(fns, repeats, warm_up=WARM_UP).items()}


def _ratio(a: Any, b: Any) -> str:
    if a is None or b is None:
        return "-"
    r = a[0] / b[0]
    return f"{r:.2f}{'' if r <= 1.2 else ' (>1.2)'}"


def pools_main(args: Any) -> int:
    """``--pools``: each pool layout and dtype against the float32 K-major pool, NumPy and torch."""
    print(_common.describe())
    print(f"one step, K=V={K}, float32 inputs; median (min) us of {args.repeats} calls (1 request) and "
          f"{args.many_repeats} ({MANY} requests of a pool of {MANY_POOL}); targets: V-major <= 1.2 K-major, "
          "16-bit <= 1.2 float32 (same layout)")  # fmt: skip
    kinds = [f"{d} {'V' if f else 'K'}" for d, f in POOL_KINDS]
    ratios = ("V/K f32", "V/K f16", "V/K bf16", "f16/f32 K", "bf16/f32 K", "f16/f32 V", "bf16/f32 V")
    print(" | ".join(["H", "requests", "api", *kinds, *ratios]))
    worst: dict[str, tuple[float, str]] = {}  # target -> (worst ratio, where)
    for H in args.heads:
        for N, P, repeats in ((1, POOL, args.repeats), (MANY, MANY_POOL, args.many_repeats)):
            r = _pools(H, N, P, repeats)
            for api, pre in (("decode_kda", ""), ("torch", "torch ")):
                if pre + kinds[0] not in r:
                    continue
                t = [r.get(pre + kind) for kind in kinds]
                ratios = [_ratio(t[1], t[0]), _ratio(t[3], t[2]), _ratio(t[5], t[4]), _ratio(t[2], t[0]),
                          _ratio(t[4], t[0]), _ratio(t[3], t[1]), _ratio(t[5], t[1])]  # fmt: skip
                print(" | ".join([str(H), str(N), api, *map(_us, t), *ratios]), flush=True)
                for target, pairs in (("V-major/K-major", ((1, 0), (3, 2), (5, 4))),
                                      ("16-bit/float32", ((2, 0), (4, 0), (3, 1), (5, 1)))):  # fmt: skip
                    for a, b in pairs:
                        if t[a] is not None and t[b] is not None:
                            ratio = t[a][0] / t[b][0]
                            if ratio > worst.get(target, (0.0, ""))[0]:
                                worst[target] = (ratio, f"H={H}, {N} requests, {api}, {kinds[a]}")
    for target, (ratio, where) in worst.items():
        print(f"target {target} <= 1.2: {'met' if ratio <= 1.2 else 'MISSED'} (worst {ratio:.2f}: {where})")
    print(f"load average after: {_common.load_average()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--many-repeats", type=int, default=60)
    parser.add_argument(
        "--pools", action="store_true",
        help="time one step from float32 / float16 / bfloat16 pools, K-major and V-major (state_v_first), "
        "through decode_kda and kda.torch's pool call, against the float32 K-major pool",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.pools:
        return pools_main(args)
    print(_common.describe())
    print(
        f"same-run GEMM reference (benchmarks._common.gemm_rate, {_common.GEMM_N}^3 float32): "
        f"{_common.gemm_rate():.1f} GFLOP/s"
    )
    print(f"one token, B=1, K=V={K}, float32; median (min) us of {args.repeats} calls; ggml 2 threads")
    print(" | ".join(COLUMNS))
    for H in args.heads:
        r, m = _one_row(H, args.repeats), _many(H, args.many_repeats)
        ggml = r.get("ggml")
        cells = [
            str(H), _us(ggml), _us(r["ggml1"]), _us(r["decode_kda"]), _us(r["plan"]), _us(r["split"]),
            _us(r["torch"]),
            _us(r["torch_pool"]),
            _target(r["decode_kda"], None if ggml is None else 1.5 * ggml[0] + 25e-6),
            _target(r["torch"], None if ggml is None else 1.5 * ggml[0] + 60e-6),
            f"{r['agreement']:.1e}" if "agreement" in r else "-",
            _us(m["decode_kda"]), _us(m["plan"]), _us(m["one_thread"]), _us(m["ggml"]),
        ]  # fmt: skip
        print(" | ".join(cells))
        if "ggml_missing" in r:
            print(f"    ggml not run: {r['ggml_missing']}")
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
