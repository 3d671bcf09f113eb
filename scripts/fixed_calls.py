# ruff: noqa: B023  (each lambda is called at once by record(), inside its loop iteration)
"""A fixed set of kda calls through every entry point; prints one sha256 per call.

Run from a tree's root with PYTHONPATH set to it and diff two trees' outputs (a refactor must leave
every line equal)::

    PYTHONPATH=$PWD python scripts/fixed_calls.py [numpy torch jax dask]

Optional parts (torch, jax, dask) are skipped with a line saying so where not importable.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings

import numpy as np

os.environ.setdefault("KDA_FIXED_CALLS", "1")
import kda

RESULTS: list[tuple[str, str]] = []


def digest(obj) -> str:
    h = hashlib.sha256()

    def feed(x):
        if x is None:
            h.update(b"None")
        elif isinstance(x, (tuple, list)):
            h.update(b"(")
            for y in x:
                feed(y)
            h.update(b")")
        elif isinstance(x, dict):
            for key in sorted(x):
                h.update(str(key).encode())
                feed(x[key])
        elif hasattr(x, "_asdict"):
            feed(x._asdict())
        elif hasattr(x, "__dataclass_fields__"):
            feed({f: getattr(x, f) for f in x.__dataclass_fields__})
        elif isinstance(x, (int, float, str, bool)):
            h.update(repr(x).encode())
        else:
            if hasattr(x, "detach"):  # torch
                x = x.detach().float().numpy() if str(x.dtype) == "torch.bfloat16" else x.detach().numpy()
            a = np.asarray(x)
            h.update(str(a.dtype).encode() + str(a.shape).encode())
            h.update(np.ascontiguousarray(a).tobytes())

    feed(obj)
    return h.hexdigest()[:24]


def record(name: str, fn) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fn()
        RESULTS.append((name, digest(result)))
    except Exception as e:  # an error is a result too
        RESULTS.append((name, f"ERROR {type(e).__name__}: {str(e)[:160]}"))


def inputs(seed, B, H, HV, T, K, V, dtype, regime="mild", gate="log"):
    from kda.testing._problems import gates

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, T, K))
    k = rng.standard_normal((B, H, T, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, HV, T, V))
    g = gates(rng, (B, HV, T, K), regime, gate=gate)
    beta = rng.uniform(0, 1, (B, HV, T))
    h0 = rng.standard_normal((B, HV, K, V)) * 0.1
    do = rng.standard_normal((B, HV, T, V))
    cast = lambda x: x.astype(dtype)  # noqa: E731
    return [cast(x) for x in (q, k, v, g, beta)], cast(h0) if dtype != np.float64 else h0, cast(do)


def gate_params(seed, HV, K, dtype):
    rng = np.random.default_rng(seed + 99)
    return {
        "A_log": rng.uniform(-1, 1, HV).astype(np.float32),
        "dt_bias": rng.uniform(-1, 1, (HV, K)).astype(np.float32),
    }


def numpy_calls():
    shapes = [(1, 2, 2, 100, 16, 16), (2, 2, 4, 64, 32, 16), (1, 1, 1, 1, 8, 8), (1, 2, 2, 200, 32, 32)]
    for backend in ("cpu", "reference"):
        for dt in (np.float32, np.float64):
            for si, (B, H, HV, T, K, V) in enumerate(shapes):
                for regime in ("mild", "kimi", "reset", "strong"):
                    (q, k, v, g, beta), h0, do = inputs(si, B, H, HV, T, K, V, dt, regime)
                    tag = f"{backend}/{dt.__name__}/{B}x{H}x{HV}x{T}x{K}x{V}/{regime}"
                    kw = dict(backend=backend)
                    record(
                        f"chunk {tag}",
                        lambda: kda.chunk_kda(
                            q, k, v, g, beta, initial_state=h0, save_boundaries=True, chunk_size=32, **kw
                        ),
                    )
                    out = kda.chunk_kda(
                        q, k, v, g, beta, initial_state=h0, save_boundaries=True, chunk_size=32, **kw
                    )
                    record(
                        f"chunk_bwd {tag}",
                        lambda: kda.chunk_kda_backward(
                            q,
                            k,
                            v,
                            g,
                            beta,
                            out.boundaries,
                            do,
                            h0 * 0.5,
                            initial_state=h0,
                            chunk_size=32,
                            **kw,
                        ),
                    )
                    record(
                        f"chunk_bwd_noboundaries {tag}",
                        lambda: kda.chunk_kda_backward(
                            q, k, v, g, beta, None, do, initial_state=h0, chunk_size=32, **kw
                        ),
                    )
                    record(
                        f"recurrent {tag}",
                        lambda: kda.recurrent_kda(q, k, v, g, beta, initial_state=h0, **kw),
                    )
                    record(
                        f"recurrent_bwd {tag}",
                        lambda: kda.recurrent_kda_backward(q, k, v, g, beta, do, initial_state=h0, **kw),
                    )
                    record(
                        f"transition {tag}",
                        lambda: kda.chunk_kda_transition(q, k, v, g, beta, chunk_size=32, **kw),
                    )
                    record(
                        f"transition_bwd {tag}",
                        lambda: kda.chunk_kda_transition_backward(q, k, v, g, beta, do, chunk_size=32, **kw),
                    )
                    if regime != "mild":
                        continue
                    # options
                    gp = gate_params(si, HV, K, dt)
                    (q2, k2, v2, graw, b2), _, _ = inputs(si, B, H, HV, T, K, V, dt, "raw", gate="softplus")
                    for opts in (
                        dict(gate="softplus", **gp),
                        dict(gate="lower_bound", lower_bound=-5.0, **gp),
                        dict(qk_l2norm=True, beta_activation="sigmoid"),
                        dict(layout="time_major"),
                    ):
                        name = ",".join(f"{a}" for a in opts if a not in ("A_log", "dt_bias"))
                        if opts.get("layout") == "time_major":
                            args = [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v, g)]
                            args.append(np.ascontiguousarray(np.swapaxes(beta, 1, 2)))
                            dot = np.ascontiguousarray(np.swapaxes(do, 1, 2))
                        elif "gate" in opts:
                            args, dot = [q2, k2, v2, graw, b2], do
                        else:
                            args, dot = [q, k, v, g, beta], do
                        record(
                            f"chunk[{name}] {tag}",
                            lambda: kda.chunk_kda(
                                *args, initial_state=h0, save_boundaries=True, chunk_size=32, **kw, **opts
                            ),
                        )
                        record(
                            f"chunk_bwd[{name}] {tag}",
                            lambda: kda.chunk_kda_backward(
                                *args,
                                kda.chunk_kda(
                                    *args, initial_state=h0, save_boundaries=True, chunk_size=32, **kw, **opts
                                ).boundaries,
                                dot,
                                initial_state=h0,
                                chunk_size=32,
                                **kw,
                                **opts,
                            ),
                        )
                        record(
                            f"recurrent[{name}] {tag}",
                            lambda: kda.recurrent_kda(*args, initial_state=h0, **kw, **opts),
                        )
                        record(
                            f"recurrent_bwd[{name}] {tag}",
                            lambda: kda.recurrent_kda_backward(*args, dot, initial_state=h0, **kw, **opts),
                        )
                        record(
                            f"transition[{name}] {tag}",
                            lambda: kda.chunk_kda_transition(*args, chunk_size=32, **kw, **opts),
                        )
                    # packed sequences
                    if B == 1 and T >= 64:
                        cu = np.array([0, 10, 40, T], dtype=np.int64)
                        record(
                            f"chunk[cu] {tag}",
                            lambda: kda.chunk_kda(
                                q, k, v, g, beta, cu_seqlens=cu, save_boundaries=True, chunk_size=16, **kw
                            ),
                        )
                        oc = kda.chunk_kda(
                            q, k, v, g, beta, cu_seqlens=cu, save_boundaries=True, chunk_size=16, **kw
                        )
                        record(
                            f"chunk_bwd[cu] {tag}",
                            lambda: kda.chunk_kda_backward(
                                q, k, v, g, beta, oc.boundaries, do, cu_seqlens=cu, chunk_size=16, **kw
                            ),
                        )
                        record(
                            f"recurrent[cu] {tag}",
                            lambda: kda.recurrent_kda(q, k, v, g, beta, cu_seqlens=cu, **kw),
                        )
                        record(
                            f"transition[cu] {tag}",
                            lambda: kda.chunk_kda_transition(
                                q, k, v, g, beta, cu_seqlens=cu, chunk_size=16, **kw
                            ),
                        )

                    # plans
                    def plan():
                        p = kda.prepare_chunk_kda(
                            q, k, v, g, beta, initial_state=h0, save_boundaries=True, chunk_size=32, **kw
                        )
                        a = p.run()
                        a = digest(a)
                        b = p.run()
                        pb = kda.prepare_chunk_kda_backward(
                            q, k, v, g, beta, b.boundaries, do, initial_state=h0, chunk_size=32, **kw
                        )
                        return a, b, pb.run()

                    record(f"plans {tag}", plan)

                    # decode
                    def decode(two_d=False, v_first=False, plan=False):
                        N, Td = 3, 2
                        rng = np.random.default_rng(si + 7)
                        pool = (rng.standard_normal((6, HV, K, V)) * 0.1).astype(
                            dt if dt == np.float64 else np.float32
                        )
                        if v_first:
                            pool = np.ascontiguousarray(np.swapaxes(pool, -1, -2))
                        qd = rng.standard_normal((N, H, Td, K)).astype(dt)
                        kd = rng.standard_normal((N, H, Td, K)).astype(dt)
                        kd /= np.linalg.norm(kd, axis=-1, keepdims=True)
                        vd = rng.standard_normal((N, HV, Td, V)).astype(dt)
                        gd = np.log(rng.uniform(0.5, 1.0, (N, HV, Td, K))).astype(dt)
                        bd = rng.uniform(0, 1, (N, HV, Td)).astype(dt)
                        if two_d:
                            idx = np.array([[0, 1], [2, 3], [4, -1]], dtype=np.int32)
                            acc = np.array([1, 2, 1], dtype=np.int32)
                        else:
                            idx, acc = np.array([4, 0, 2], dtype=np.int32), None
                        if plan:
                            p = kda.prepare_decode_kda(
                                qd,
                                kd,
                                vd,
                                gd,
                                bd,
                                pool,
                                idx,
                                num_accepted_tokens=acc,
                                state_v_first=v_first,
                                **kw,
                            )
                            o1 = p.run().copy()
                            o2 = p.run()
                            return o1, o2, pool
                        o = kda.decode_kda(
                            qd,
                            kd,
                            vd,
                            gd,
                            bd,
                            pool,
                            idx,
                            num_accepted_tokens=acc,
                            state_v_first=v_first,
                            **kw,
                        )
                        return o, pool

                    record(f"decode {tag}", decode)
                    record(f"decode2d {tag}", lambda: decode(two_d=True))
                    record(f"decode_vfirst {tag}", lambda: decode(v_first=True))
                    record(f"decode_plan {tag}", lambda: decode(plan=True))


def torch_calls():
    try:
        import torch

        import kda.torch as kt
    except Exception as e:  # pragma: no cover
        RESULTS.append(("torch", f"skipped {e}"))
        return
    torch.manual_seed(0)
    for si, (B, T, H, HV, K, V) in enumerate([(1, 70, 2, 2, 16, 16), (2, 33, 2, 4, 16, 32)]):
        for dt in (torch.float32, torch.float64):
            rng = np.random.default_rng(si)
            q = torch.tensor(rng.standard_normal((B, T, H, K)), dtype=dt)
            k = torch.nn.functional.normalize(
                torch.tensor(rng.standard_normal((B, T, H, K)), dtype=dt), dim=-1
            )
            v = torch.tensor(rng.standard_normal((B, T, HV, V)), dtype=dt)
            g = torch.tensor(np.log(rng.uniform(0.8, 1, (B, T, HV, K))), dtype=dt)
            beta = torch.tensor(rng.uniform(0, 1, (B, T, HV)), dtype=dt)
            h0 = torch.tensor(rng.standard_normal((B, HV, K, V)) * 0.1, dtype=dt)
            tag = f"{dt}/{B}x{T}x{H}x{HV}x{K}x{V}"

            def run(fn, **kw):
                xs = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
                o, s = fn(*xs[:5], initial_state=xs[5], output_final_state=True, **kw)
                (o.square().sum() + s.sum()).backward()
                return o, s, [x.grad for x in xs]

            record(f"torch.chunk {tag}", lambda: run(kt.chunk_kda, chunk_size=32))
            record(f"torch.recurrent {tag}", lambda: run(kt.fused_recurrent_kda))
            record(
                f"torch.chunk[l2,sig] {tag}",
                lambda: run(kt.chunk_kda, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True),
            )
            A_log = torch.tensor(rng.uniform(-1, 1, HV), dtype=torch.float32)
            dt_bias = torch.tensor(rng.uniform(-1, 1, HV * K), dtype=torch.float32)
            graw = torch.tensor(rng.standard_normal((B, T, HV, K)), dtype=dt)

            def run_gate(fn, **kw):
                xs = [t.clone().requires_grad_(True) for t in (q, k, v, graw, beta, A_log, dt_bias)]
                o, s = fn(
                    *xs[:5],
                    use_gate_in_kernel=True,
                    A_log=xs[5],
                    dt_bias=xs[6],
                    output_final_state=True,
                    **kw,
                )
                o.square().sum().backward()
                return o, s, [x.grad for x in xs]

            record(f"torch.chunk[softplus] {tag}", lambda: run_gate(kt.chunk_kda))
            record(f"torch.chunk[lower_bound] {tag}", lambda: run_gate(kt.chunk_kda, lower_bound=-5.0))
            record(f"torch.recurrent[softplus] {tag}", lambda: run_gate(kt.fused_recurrent_kda))

            def infer():
                with torch.inference_mode():
                    o, s = kt.fused_recurrent_kda(
                        q[:, :1],
                        k[:, :1],
                        v[:, :1],
                        g[:, :1],
                        beta[:, :1],
                        initial_state=h0,
                        output_final_state=True,
                    )
                    return o, s

            record(f"torch.decode1 {tag}", infer)

            def pool_decode():
                pool = (h0.repeat(3, 1, 1, 1).clone()).to(torch.float32 if dt == torch.float32 else dt)
                idx = torch.tensor(list(range(B)), dtype=torch.int32)
                with torch.inference_mode():
                    o, _ = kt.fused_recurrent_kda(
                        q[:, :1],
                        k[:, :1],
                        v[:, :1],
                        g[:, :1],
                        beta[:, :1],
                        initial_state=pool,
                        ssm_state_indices=idx,
                        inplace_final_state=True,
                    )
                return o, pool

            record(f"torch.pool_decode {tag}", pool_decode)
            if B == 1:
                cu = torch.tensor([0, 20, T], dtype=torch.int64)
                record(
                    f"torch.chunk[cu] {tag}",
                    lambda: (
                        run(kt.chunk_kda, cu_seqlens=cu)
                        if False
                        else (
                            lambda xs: (lambda o: (o[0], o[1]))(
                                kt.chunk_kda(*xs, cu_seqlens=cu, output_final_state=True)
                            )
                        )([t.clone() for t in (q, k, v, g, beta)])
                    ),
                )


def jax_calls():
    try:
        import jax

        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp

        import kda.jax as kj
    except Exception as e:  # pragma: no cover
        RESULTS.append(("jax", f"skipped {e}"))
        return
    B, T, H, HV, K, V = 1, 50, 2, 2, 16, 16
    rng = np.random.default_rng(3)
    for dt in (np.float32, np.float64):
        q = jnp.asarray(rng.standard_normal((B, T, H, K)).astype(dt))
        kk = rng.standard_normal((B, T, H, K))
        k = jnp.asarray((kk / np.linalg.norm(kk, axis=-1, keepdims=True)).astype(dt))
        v = jnp.asarray(rng.standard_normal((B, T, HV, V)).astype(dt))
        g = jnp.asarray(np.log(rng.uniform(0.8, 1, (B, T, HV, K))).astype(dt))
        beta = jnp.asarray(rng.uniform(0, 1, (B, T, HV)).astype(dt))
        for name, fn in (("chunk", kj.chunk_kda), ("recurrent", kj.fused_recurrent_kda)):

            def loss(q, k, v, g, beta, fn=fn):
                o, _ = fn(q, k, v, g, beta, output_final_state=True)
                return (o * o).sum()

            record(f"jax.{name} {dt.__name__}", lambda fn=fn: fn(q, k, v, g, beta, output_final_state=True))
            record(
                f"jax.{name}.grad {dt.__name__}",
                lambda loss=loss: jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta),
            )


def dask_calls():
    try:
        import dask
        import dask.array as da

        import kda.dask as kd
    except Exception as e:  # pragma: no cover
        RESULTS.append(("dask", f"skipped {e}"))
        return
    (q, k, v, g, beta), h0, do = inputs(5, 2, 2, 2, 96, 16, 16, np.float32)
    chunks = (1, 1, 32, -1)
    with dask.config.set(scheduler="synchronous"):
        dq, dk, dv, dg = (da.from_array(x, chunks=chunks) for x in (q, k, v, g))
        db = da.from_array(beta, chunks=(1, 1, 32))
        dh0 = da.from_array(h0, chunks=(1, 1, -1, -1))
        ddo = da.from_array(do, chunks=chunks)

        def fwd():
            out = kd.chunk_kda(dq, dk, dv, dg, db, initial_state=dh0, chunk_size=16, save_boundaries=True)
            return dask.compute(out.output, out.final_state, out.boundaries)

        record("dask.chunk", fwd)

        def bwd():
            out = kd.chunk_kda(dq, dk, dv, dg, db, initial_state=dh0, chunk_size=16, save_boundaries=True)
            grads = kd.chunk_kda_backward(
                dq, dk, dv, dg, db, out.boundaries, ddo, initial_state=dh0, chunk_size=16
            )
            return dask.compute(*[x for x in grads if x is not None])

        record("dask.chunk_bwd", bwd)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["numpy", "torch", "jax", "dask"]
    for part in parts:
        globals()[f"{part}_calls"]()
    for name, h in RESULTS:
        print(f"{h}  {name}")
    print(f"# {len(RESULTS)} calls", file=sys.stderr)
