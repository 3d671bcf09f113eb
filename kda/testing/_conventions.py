"""How a kernel under test is called: the ``"fla"`` and ``"kda"`` conventions.

Each convention's runner takes a :class:`~kda.testing.Problem` and its float64 arrays, calls the
kernel with the arrays in the problem's dtypes and layout, and returns a :class:`Run`: every result
as a head-first float64 NumPy array, and the inputs passed with a snapshot of their bytes (for the
check that the kernel leaves them unmodified).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import InvalidInputError, InvalidTypeError
from ._compare import to_numpy
from ._problems import Problem
from ._reference import GRADIENTS

__all__ = ["CONVENTIONS", "INPUTS", "Fla", "Kda", "Run", "Runner", "runner_for", "snapshot"]

CONVENTIONS = ("fla", "kda")
INPUTS = ("q", "k", "v", "g", "beta")


def _time_major(x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None else np.ascontiguousarray(np.swapaxes(x, 1, 2))


def _head_first(x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None else np.swapaxes(x, 1, 2)


class Run:
    """One call's results, head-first NumPy arrays; ``inputs`` are what was passed (for the
    unmodified check) as ``name -> (live array, NumPy copy taken before the call)``."""

    def __init__(self) -> None:
        self.results: dict[str, np.ndarray | None] = {}
        self.inputs: dict[str, tuple[Any, bytes]] = {}


class Fla:
    """flash-linear-attention's ``chunk_kda`` signature: time-major torch tensors, autograd."""

    name = "fla"

    def __init__(self, fn: Callable, backward: bool, device: Any) -> None:
        import torch

        self.torch, self.fn, self.backward = torch, fn, bool(backward)
        self.device = torch.device("cpu" if device is None else device)

    def dtype(self, name: str) -> Any:
        return getattr(self.torch, name)

    def run(self, p: Problem, arrays: dict[str, Any], backward: bool) -> Run:
        torch = self.torch
        run = Run()
        grad = backward and self.backward
        ts: dict[str, Any] = {}
        for n in (*INPUTS, "initial_state", "A_log", "dt_bias"):
            x = arrays[n]
            if x is None:
                continue
            if n in INPUTS:
                x = _time_major(x)
            if n == "dt_bias":
                x = x.reshape(-1)
            t = torch.tensor(x, dtype=self.dtype(p.dtype_of(n)), device=self.device)
            run.inputs[n] = (t, snapshot(t))
            ts[n] = t.requires_grad_(grad)
        kw: dict[str, Any] = {"output_final_state": True}
        if p.scale is not None:
            kw["scale"] = p.scale
        kw["initial_state"] = ts.get("initial_state")  # None too: some kernels take it positionally
        if p.chunk_size is not None:
            kw["chunk_size"] = p.chunk_size
        if p.cu_seqlens is not None:
            cu = torch.tensor(p.cu_seqlens, dtype=torch.int64, device=self.device)
            run.inputs["cu_seqlens"] = (cu, snapshot(cu))
            kw["cu_seqlens"] = cu
        if p.qk_l2norm:
            kw["use_qk_l2norm_in_kernel"] = True
        if p.gate != "log":
            kw["use_gate_in_kernel"] = True
            for n in ("A_log", "dt_bias"):
                if n in ts:
                    kw[n] = ts[n]
            if p.gate == "lower_bound":
                kw["lower_bound"] = p.lower_bound
        if p.beta_activation is not None:
            kw["use_beta_sigmoid_in_kernel"] = True
            if p.beta_activation == "sigmoid2":
                kw["allow_neg_eigval"] = True
        o, S = self.fn(*(ts[n] for n in INPUTS), **kw)
        run.results["output"] = _head_first(to_numpy(o).astype(np.float64))
        run.results["final_state"] = None if S is None else to_numpy(S).astype(np.float64)
        if grad:
            do = torch.tensor(_time_major(arrays["grad_output"]), dtype=o.dtype, device=o.device)
            outs, gos = [o], [do]
            if S is not None:
                outs.append(S)
                gos.append(torch.tensor(arrays["grad_final_state"], dtype=S.dtype, device=S.device))
            names = list(ts)
            gr = torch.autograd.grad(outs, [ts[n] for n in names], gos, allow_unused=True)
            for n, d in zip(names, gr):
                if d is None:
                    d = torch.zeros_like(ts[n])
                d = to_numpy(d).astype(np.float64)
                if n in INPUTS:
                    d = _head_first(d)
                if n == "dt_bias":
                    d = d.reshape(p.HV, p.K)
                run.results["d" + n] = d
        return run


class Kda:
    """kda's ``chunk_kda`` signature on an array-API namespace; backward a second callable."""

    name = "kda"

    def __init__(self, fn: Callable, backward: Any, device: Any, xp: Any) -> None:
        if xp is None:
            xp = np
        self.fn, self.bwd, self.device, self.xp = fn, backward if callable(backward) else None, device, xp

    def dtype(self, name: str) -> Any:
        d = getattr(self.xp, name, None)
        if d is None:
            raise InvalidInputError(
                f"problems: the namespace {self.xp.__name__} has no {name}; narrow dtypes"
            )
        return d

    def asarray(self, x: np.ndarray, dtype: str) -> Any:
        xp = self.xp
        if xp is np:
            return np.array(x, dtype=dtype)
        kw = {} if self.device is None else {"device": self.device}
        if dtype == "bfloat16":
            return xp.astype(xp.asarray(x.astype(np.float32), **kw), self.dtype(dtype))
        return xp.asarray(x.astype(dtype), **kw)

    def run(self, p: Problem, arrays: dict[str, Any], backward: bool) -> Run:
        run = Run()
        grad = backward and self.bwd is not None
        tm = p.layout == "time_major"
        xs: dict[str, Any] = {}
        for n in (*INPUTS, "initial_state", "A_log", "dt_bias", "grad_output", "grad_final_state"):
            x = arrays[n]
            if x is None or (not grad and n.startswith("grad_")):
                continue
            if tm and n in (*INPUTS, "grad_output"):
                x = _time_major(x)
            a = self.asarray(x, p.dtype_of(n))
            run.inputs[n] = (a, snapshot(a))
            xs[n] = a
        kw: dict[str, Any] = {}
        if p.scale is not None:
            kw["scale"] = p.scale
        if "initial_state" in xs:
            kw["initial_state"] = xs["initial_state"]
        if p.chunk_size is not None:
            kw["chunk_size"] = p.chunk_size
        if tm:
            kw["layout"] = "time_major"
        opts = p.options()
        for n in ("A_log", "dt_bias"):
            if n in opts:
                opts[n] = xs[n]
        if "cu_seqlens" in opts:
            cu = self.xp.asarray(opts["cu_seqlens"]) if self.xp is not np else opts["cu_seqlens"]
            run.inputs["cu_seqlens"] = (cu, snapshot(cu))
            opts["cu_seqlens"] = cu
        kw |= opts
        args = [xs[n] for n in INPUTS]
        out = self.fn(*args, **kw, **({"save_boundaries": True} if grad else {}))
        o, S = out[0], out[1]
        bounds = out[2] if len(out) > 2 else None
        conv = (lambda x: _head_first(x)) if tm else (lambda x: x)
        run.results["output"] = conv(to_numpy(o).astype(np.float64))
        run.results["final_state"] = to_numpy(S).astype(np.float64)
        if bounds is not None:
            run.results["boundaries"] = to_numpy(bounds).astype(np.float64)
        if grad:
            gr = self.bwd(*args, bounds, xs["grad_output"], xs["grad_final_state"], **kw)
            for n, d in zip(GRADIENTS, gr):
                if n in xs and d is not None:
                    d = to_numpy(d).astype(np.float64)
                    run.results["d" + n] = conv(d) if n in INPUTS else d
                elif n in xs:
                    run.results["d" + n] = np.zeros_like(arrays[n])
        return run


Runner = Fla | Kda  # a convention's caller


def runner_for(fn: Any, convention: Any, backward: Any, device: Any, xp: Any) -> Runner:
    """The caller of ``fn`` under ``convention`` (arguments checked: ``kda.KdaError`` if not)."""
    if not callable(fn):
        raise InvalidTypeError(f"fn must be callable; got {type(fn).__name__}")
    if convention == "fla":
        if not isinstance(backward, bool):
            raise InvalidTypeError(
                f"backward must be a bool for convention='fla'; got {type(backward).__name__}"
            )
        if xp is not None:
            raise InvalidInputError("xp is for convention='kda' only")
        return Fla(fn, backward, device)
    if convention == "kda":
        if not (backward is None or isinstance(backward, bool) or callable(backward)):
            raise InvalidTypeError(
                "backward must be a callable (chunk_kda_backward's signature), False or None"
            )
        if backward is True:
            raise InvalidInputError("backward=True needs a callable for convention='kda' (or False / None)")
        return Kda(fn, backward, device, xp)
    raise InvalidInputError(f"convention must be one of {CONVENTIONS}; got {convention!r}")


def snapshot(x: Any) -> bytes:
    """The raw bytes of an array of any namespace (torch bfloat16 included)."""
    if type(x).__module__.startswith("torch"):
        import torch

        return x.detach().cpu().reshape(-1).clone().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(to_numpy(x)).tobytes()
