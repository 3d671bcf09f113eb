"""The CPU backend: the primitives of :mod:`kda._backend` as Numba-compiled kernels.

It runs NumPy arrays (the default backend for them when Numba and SciPy are installed;
``backend="reference"`` keeps the array-API path). The chunked algorithm of
:mod:`kda._engine.chunked` calls its fused passes (``docs/speed.md``):

- ``chunk_forward_heads`` / ``chunk_backward_heads`` run one head per worker from its first chunk
  to its last (the backward: last to first), each chunk's state-free work and state step at once,
  so the chunk's data and the ``[K, V]`` state stay in the cache; inputs are read in place with
  any strides (time-major views too), only the results are written;
- the chunk primitives (``chunk_local``, ``chunk_state_pass``, ``chunk_state_grad_pass``,
  ``chunk_local_backward``) compute the same pieces over whole slabs of chunks, from the same
  per-chunk kernels (decay factors, the pairs ``A`` and ``L`` by sub-blocks, the unit-lower
  inverse by rows, ``[W, U0]`` by BLAS); the engine uses them for the state-gradient pass alone.

``RECURRENT_MAX_T``: the measured length up to which the step recurrence is faster here (the
core routes there).

Numba is imported on the first call of a primitive, not by ``import kda``. Kernels are compiled once
per dtype and cached on disk; where no cache directory is writable, per process.

Threads, the pool and BLAS pinning: :mod:`._pool`; the arrays laid out for the kernels: :mod:`._layout`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from .._backend import ChunkLocal, Gradients, LocalGradients, StateGradPass, StatePass, complete
from .._backend.expect import BACKWARD_FOLLOWS
from .._threads import PIN
from . import _fpenv, _pool
from ._decode import decode_finite, decode_forward, decode_screen  # noqa: F401  (complete writes __all__)
from ._layout import as_heads, compute_dtype, contiguous, in_place, scalar, to_chunks  # noqa: F401  (as above)
from ._outputs import (
    BackwardHeadsOut,
    ForwardHeadsOut,
    LocalBackwardOut,
    LocalForwardOut,
    RecurrentBackwardOut,
    RecurrentForwardOut,
    StateGradPassOut,
    StatePassOut,
)
from ._pool import threads

NAME = "cpu"
MAX_CHUNK = None  # any chunk length
# Elements of one [B, H, chunks, Cp, max(K, V)] array of a slab: 16 chunks of 16 heads at
# Cp=64, K=V=128 (8 MiB in float32), so a slab's parallel loops have work for every core and the
# per-call overhead is paid a few times per sequence, not per chunk.
SLAB_ELEMENTS = 1 << 21

# The step recurrence beats this backend's chunked form up to this many steps in one chunk
# (measured with `python -m benchmarks.llama_cpp --crossover`, B=1 H=16 K=V=128 float32 on 2 cores;
# docs/speed.md): forward+backward up to 64 steps; a forward alone up to about 256, but the route
# cannot depend on whether boundaries are kept (an output's bits must not), so the core takes the
# smaller of the two for every call.
RECURRENT_MAX_T = 64

# the inputs whose finiteness the fused passes read off the chunks as they pass (the forward's
# q, k, v; the backward's also grad_output and the boundaries), by the entry points' names; they
# screen the gate's g <= 0 too
FUSED_SCREENS = frozenset({"q", "k", "v", "boundaries", "grad_output"})

# ranges per thread in a kernel call (load balance against other processes on the cores)
SPLIT = 4
# calls whose arrays hold fewer elements than this run on the calling thread: handing tiny work
# (a decode step: a few heads of one step) to the pool costs more than the work (measured: about
# 110 us of lock hand-offs per call at B=1, H=4, K=V=64, T=1)
INLINE_ELEMENTS = 1 << 16


def _run(kernel: Any, items: int, *inputs: Any, outputs: tuple, blas: bool = True) -> None:
    """``kernel(*inputs, *outputs, lo, hi)`` (a kernel of :mod:`._kernels`) over ``items``
    independent items, in ranges ``[lo, hi)`` run by one thread per core; ``outputs``: the
    arrays it writes, a record of :mod:`._outputs` built by keyword whose fields are the kernel's
    output parameters in their order (``tests/backends/test_cpu.py`` checks them), so the kernel
    is called positionally.

    There are :data:`SPLIT` ranges per thread, taken in turn by whichever thread is free, so a
    core that other processes keep busy does not hold up the call. BLAS is pinned to one thread
    while the kernels run (``blas``): they call it from every thread. Every range runs with
    subnormals flushed to zero (:mod:`._fpenv`), on the pool's threads and the calling one alike.
    """
    # the kernel called positionally: a Numba dispatcher binds keyword arguments in Python, on
    # every range of every call
    inputs = (*inputs, *outputs)
    workers = min(items, threads())
    size = sum(int(getattr(a, "size", 0)) for a in inputs)
    if size < INLINE_ELEMENTS:
        workers = 1
    with PIN.hold() if blas else contextlib.nullcontext():
        if workers <= 1:
            _fpenv.run(kernel, *inputs, 0, items)
            return
        parts = min(items, workers * SPLIT)
        bounds = [items * i // parts for i in range(parts + 1)]
        _pool.run_ranges(_on_worker if blas else _fpenv.run, kernel, inputs, bounds, threads=workers)


def _on_worker(kernel: Any, *args: Any) -> None:
    """A range of a kernel on a pool thread, with that thread's MKL (where loaded) on one thread."""
    with PIN.this_thread():
        _fpenv.run(kernel, *args)


# ----------------------------------------------------------------------------------------------
# forward


def chunk_local(q: Any, k: Any, v: Any, g: Any, beta: Any, *, scale: float) -> ChunkLocal:
    """Every chunk's state-free work (see :class:`~kda._backend.ChunkLocal`).

    ``q, k, g: [..., Cp, K]``, ``v: [..., Cp, V]``, ``beta: [..., Cp]``; ``private`` is None
    (:func:`chunk_local_backward` recomputes the decay factors from ``g``).
    """
    from ._kernels import local_forward  # imports Numba on the first call

    dt = compute_dtype(q)
    *lead, Cp, K = q.shape
    V = v.shape[-1]
    N = int(np.prod(lead))
    qc, kc, gc = (contiguous(x, dt).reshape(N, Cp, K) for x in (q, k, g))
    vc, bc = contiguous(v, dt).reshape(N, Cp, V), contiguous(beta, dt).reshape(N, Cp)
    qg, kg, k_suffix, w = (np.empty((N, Cp, K), dt) for _ in range(4))
    A, L, Minv = (np.empty((N, Cp, Cp), dt) for _ in range(3))
    total, u0 = np.empty((N, K), dt), np.empty((N, Cp, V), dt)
    if N * Cp * K * V:
        outputs = LocalForwardOut(
            qg=qg, kg=kg, k_suffix=k_suffix, total=total, A=A, L=L, Minv=Minv, w=w, u0=u0
        )
        _run(local_forward, N, qc, kc, gc, vc, bc, scalar(scale, dt), outputs=outputs)
    else:
        for x in (qg, kg, k_suffix, w, A, L, Minv, total, u0):
            x[...] = 0
        for x in (A, L, Minv):
            x[...] = np.eye(Cp, dtype=dt) if x is Minv else 0

    def back(x: np.ndarray) -> np.ndarray:
        return x.reshape(*lead, *x.shape[1:])

    return ChunkLocal(
        qg=back(qg),
        kg=back(kg),
        k_suffix=back(k_suffix),
        total=back(total),
        A=back(A),
        L=back(L),
        Minv=back(Minv),
        w=back(w),
        u0=back(u0),
        private=None,
    )


def chunk_state_pass(
    w: Any, u0: Any, k_suffix: Any, total: Any, state: Any, qg: Any = None, A: Any = None
) -> StatePass:
    """The state recurrence over the chunks, the output fused in (see the interface).

    ``w, k_suffix, qg: [B, H, NT, Cp, K]``, ``u0: [B, H, NT, Cp, V]``, ``total: [B, H, NT, K]``,
    ``A: [B, H, NT, Cp, Cp]`` (lower triangle read), ``state: [B, H, K, V]``. Returns
    ``boundaries [NT, B, H, K, V]``, ``O [B, H, NT, Cp, V]`` (None without ``qg``) and the final state.
    """
    from ._kernels import state_pass  # imports Numba on the first call

    dt = compute_dtype(w)
    B, H, NT, Cp, K = w.shape
    V = u0.shape[-1]
    BH = B * H
    bounds = np.empty((NT, BH, K, V), dt)
    final = np.empty((BH, K, V), dt)
    with_output = qg is not None
    out = np.zeros((BH, NT, Cp, V), dt) if with_output else np.zeros((1, 1, 1, 1), dt)
    qgc = as_heads(qg, dt) if with_output else np.zeros((1, 1, 1, 1), dt)
    Ac = as_heads(A, dt) if with_output else np.zeros((1, 1, 1, 1), dt)
    args = [as_heads(x, dt) for x in (w, u0, k_suffix, total, state)]
    if BH * K * V:
        outputs = StatePassOut(boundaries=bounds, out=out, final=final)
        _run(state_pass, BH, *args, qgc, Ac, with_output, outputs=outputs)
    else:
        final[...] = args[4]
    return StatePass(
        boundaries=bounds.reshape(NT, B, H, K, V),
        output=out.reshape(B, H, NT, Cp, V) if with_output else None,
        final_state=final.reshape(B, H, K, V),
    )


def chunk_state_grad_pass(
    w: Any,
    u0: Any,
    k_suffix: Any,
    total: Any,
    qg: Any,
    A: Any,
    grad_output: Any,
    boundaries: Any,
    dfinal: Any,
) -> StateGradPass:
    """The state-gradient recurrence, last chunk first (see the interface).

    Returns ``dends [NT, B, H, K, V]``, ``U`` and ``dU`` (``[B, H, NT, Cp, V]``) and the gradient
    of the state before the first chunk ``[B, H, K, V]``.
    """
    from ._kernels import state_grad_pass  # imports Numba on the first call

    dt = compute_dtype(w)
    B, H, NT, Cp, K = w.shape
    V = u0.shape[-1]
    BH = B * H
    ends = np.empty((NT, BH, K, V), dt)
    u, du = np.empty((BH, NT, Cp, V), dt), np.empty((BH, NT, Cp, V), dt)
    dinit = np.empty((BH, K, V), dt)
    args = [as_heads(x, dt) for x in (w, u0, k_suffix, total, qg, A, grad_output)]
    bounds = contiguous(boundaries, dt).reshape(NT, BH, K, V)
    dS = as_heads(dfinal, dt)
    if BH * K * V:
        outputs = StateGradPassOut(ends=ends, u=u, du=du, dinit=dinit)
        _run(state_grad_pass, BH, *args, bounds, dS, outputs=outputs)
    else:
        dinit[...] = dS
        u[...] = 0
        du[...] = 0
    return StateGradPass(
        dends=ends.reshape(NT, B, H, K, V),
        u=u.reshape(B, H, NT, Cp, V),
        du=du.reshape(B, H, NT, Cp, V),
        dstart=dinit.reshape(B, H, K, V),
    )


# ----------------------------------------------------------------------------------------------
# backward


def chunk_local_backward(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    boundaries: Any,
    *,
    scale: float,
    local: ChunkLocal,
    dends: Any,
    u: Any,
    du: Any,
    grad_output: Any,
) -> LocalGradients:
    """Gradients of every chunk's state-free work (see the interface).

    ``q, k, g: [B, H, NT, Cp, K]``, ``v, u, du, grad_output: [B, H, NT, Cp, V]``,
    ``beta: [B, H, NT, Cp]``, ``boundaries, dends: [NT, B, H, K, V]``; ``local`` from
    :func:`chunk_local` (its ``kg, w, u0, L, Minv`` are read). Returns ``dq, dk [..., Cp, K]``,
    ``dv [..., Cp, V]``, ``dg [..., Cp, K]``, ``dbeta [..., Cp]``.
    """
    from ._kernels import local_backward  # imports Numba on the first call

    dt = compute_dtype(q)
    B, H, NT, Cp, K = q.shape
    V = v.shape[-1]
    N = B * H * NT
    qc, kc, gc, kg, w = (contiguous(x, dt).reshape(N, Cp, K) for x in (q, k, g, local.kg, local.w))
    vc, u0, uc, duc, dO = (contiguous(x, dt).reshape(N, Cp, V) for x in (v, local.u0, u, du, grad_output))
    L, Minv = (contiguous(x, dt).reshape(N, Cp, Cp) for x in (local.L, local.Minv))
    bc = contiguous(beta, dt).reshape(N, Cp)
    bounds, ends = (contiguous(x, dt).reshape(NT, B * H, K, V) for x in (boundaries, dends))
    dq, dk, dg = (np.zeros((N, Cp, K), dt) for _ in range(3))
    dv, dbeta = np.zeros((N, Cp, V), dt), np.zeros((N, Cp), dt)
    if N * Cp * K * V:
        inputs = (qc, kc, gc, vc, bc, scalar(scale, dt))
        forward = (kg, w, u0, L, Minv, bounds, ends, uc, duc, dO)  # the forward's work, states, U and dU, dO
        outputs = LocalBackwardOut(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta)
        _run(local_backward, N, *inputs, *forward, outputs=outputs)
    lead = (B, H, NT)
    return LocalGradients(
        dq=dq.reshape(*lead, Cp, K),
        dk=dk.reshape(*lead, Cp, K),
        dv=dv.reshape(*lead, Cp, V),
        dg=dg.reshape(*lead, Cp, K),
        dbeta=dbeta.reshape(*lead, Cp),
    )


# ----------------------------------------------------------------------------------------------
# the fused passes (what the engine calls; the chunk primitives above remain for the finer paths)


def chunk_forward_heads(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    state: Any,
    *,
    scale: float,
    chunk_size: int,
    output: Any,
    boundaries: Any,
    screen: Any = None,
) -> np.ndarray:
    """The chunked forward, one head per worker from its first chunk to its last.

    ``q, k, g: [B, H, T, K]``, ``v: [B, H, T, V]``, ``beta: [B, H, T]`` (read in place, any
    strides), ``state: [B, H, K, V]``. Writes ``output [B, H, T, V]`` and ``boundaries
    [NT, B, H, K, V]`` (the chunk-start states) where they are not None; returns the final state.
    ``screen``: a float64 ``[B * H, 2]`` array, or None; receives per head ``sum(x * 0)`` over
    ``q, k, v`` and over the output and final state (0 when finite, NaN when not); the first is
    also NaN where an element of ``g`` is not ``<= 0``.
    """
    from ._kernels import forward_heads  # imports Numba on the first call

    dt = compute_dtype(q)
    B, H, T, K = q.shape
    V = v.shape[-1]
    final = np.empty((B, H, K, V), dt)
    with_output, with_bounds = output is not None, boundaries is not None
    out = output if with_output else np.zeros((1, 1, 1, 1), dt)
    bounds = boundaries if with_bounds else np.zeros((1, 1, 1, 1, 1), dt)
    ins = [in_place(x, dt) for x in (q, k, v, g, beta)]
    start = contiguous(state, dt)
    screened = np.zeros((0, 2)) if screen is None else screen
    if with_bounds and not _AHEAD_ASKED and BACKWARD_FOLLOWS.get():
        _backward_ahead(ins, bounds, chunk_size, screened)
    if B * H * K * V and T:
        outputs = ForwardHeadsOut(out=out, boundaries=bounds, final=final, screen=screened)
        flags = (chunk_size, with_output, with_bounds)
        _run(forward_heads, B * H, *ins, scalar(scale, dt), start, *flags, outputs=outputs)
    else:
        final[...] = start
        screened[...] = 0.0
    return final


_AHEAD_ASKED: list[bool] = []  # whether a forward has asked for its backward ahead (once a process)


def _backward_ahead(ins: list[np.ndarray], bounds: np.ndarray, chunk_size: int, screen: np.ndarray) -> None:
    """A forward that keeps its boundaries for a backward (its caller said so:
    :data:`~kda._backend.expect.BACKWARD_FOLLOWS`), the first in this process: have the backward kernel
    compiled beside it, in a second process, for the types :func:`chunk_backward_heads` will
    most likely pass (the forward's inputs and boundaries, ``grad_output`` laid out as ``v``, new
    C-contiguous gradients; :mod:`._ahead`), its own helpers first. The signature's order is
    ``backward_heads``'."""
    from numba import typeof

    from . import _ahead
    from ._fused import backward_own_helpers
    from ._kernels import backward_heads

    _AHEAD_ASKED.append(True)
    if backward_heads.overloads or not _ahead.enabled():
        return
    q, k, v, g, beta = (typeof(x) for x in ins)
    like = [typeof(np.empty((0,) * x.ndim, x.dtype)) for x in ins]  # new C-contiguous arrays
    state, scale = like[0], typeof(np.empty(1, ins[0].dtype))
    # backward_heads' parameters: the inputs (grad_output laid out as v, dfinal as a new state), the
    # outputs (new gradients; dinit as a new state; the screen) and the range lo, hi
    inputs = (q, k, v, g, beta, scale, typeof(bounds), v, state, typeof(chunk_size))
    outputs = (*like[:4], like[4], state, typeof(screen))
    sig = (*inputs, *outputs, typeof(0), typeof(0))
    _ahead.compile_beside(backward_heads, sig, first=backward_own_helpers(q.dtype))


def chunk_backward_heads(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    boundaries: Any,
    grad_output: Any,
    dfinal: Any,
    *,
    scale: float,
    chunk_size: int,
    grads: Gradients,
    screen: Any = None,
) -> None:
    """The chunked backward, one head per worker from its last chunk to its first.

    Inputs as :func:`chunk_forward_heads`; ``boundaries [NT, B, H, K, V]`` from the forward,
    ``grad_output [B, H, T, V]``, ``dfinal [B, H, K, V]`` (the final state's gradient). Writes the
    six gradients into ``grads`` (a :class:`~kda._backend.Gradients` of writable arrays of the
    inputs' shapes).
    ``screen``: as for :func:`chunk_forward_heads`, over ``q, k, v, grad_output`` and the
    boundaries (and ``g <= 0``), and over the six gradients.
    """
    from ._kernels import backward_heads  # imports Numba on the first call

    dt = compute_dtype(q)
    B, H, T, K = q.shape
    V = v.shape[-1]
    ins = [in_place(x, dt) for x in (q, k, v, g, beta)]
    bounds, dO, dS = in_place(boundaries, dt), in_place(grad_output, dt), contiguous(dfinal, dt)
    screened = np.zeros((0, 2)) if screen is None else screen
    if B * H * K * V and T:
        dq, dk, dv, dg, dbeta, dinit = grads
        outputs = BackwardHeadsOut(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dinit=dinit, screen=screened)
        _run(backward_heads, B * H, *ins, scalar(scale, dt), bounds, dO, dS, chunk_size, outputs=outputs)
    else:
        screened[...] = 0.0
        grads.dinitial[...] = dS
        for x in (grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta):
            x[...] = 0


# ----------------------------------------------------------------------------------------------
# the step recurrence and decoding


def recurrent_forward(
    q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, *, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """The recurrence: ``[B, H, T, *]`` inputs from ``state [B, H, K, V]`` ->
    ``(output [B, H, T, V], final [B, H, K, V])``."""
    from ._kernels import recurrent_forward as kernel  # imports Numba on the first call

    dt = compute_dtype(q)
    B, H, T, K = q.shape
    V = v.shape[-1]
    out = np.zeros((B * H, T, V), dt)
    final = np.empty((B * H, K, V), dt)
    args = [as_heads(x, dt) for x in (q, k, v, g, beta)]
    S0 = as_heads(state, dt)
    if B * H * K * V:
        outputs = RecurrentForwardOut(out=out, final=final)
        _run(kernel, B * H, *args, scalar(scale, dt), S0, outputs=outputs, blas=False)
    else:
        final[...] = S0
    return out.reshape(B, H, T, V), final.reshape(B, H, K, V)


def recurrent_backward(
    q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, grad_output: Any, dfinal: Any, *, scale: float
) -> Gradients:
    """The gradients (:class:`~kda._backend.Gradients`) of the recurrence given the output's and the
    final state's (``dfinal``) (states kept every ``ceil(sqrt(T))`` steps, the ones between
    recomputed)."""
    from ._kernels import recurrent_backward as kernel  # imports Numba on the first call

    dt = compute_dtype(q)
    B, H, T, K = q.shape
    V = v.shape[-1]
    BH = B * H
    args = [as_heads(x, dt) for x in (q, k, v, g, beta)]
    S0, do, dS = as_heads(state, dt), as_heads(grad_output, dt), as_heads(dfinal, dt)
    dq, dk, dg = (np.zeros((BH, T, K), dt) for _ in range(3))
    dv, dbeta = np.zeros((BH, T, V), dt), np.zeros((BH, T), dt)
    dinit = np.empty((BH, K, V), dt)
    if BH * K * V:
        outputs = RecurrentBackwardOut(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dinit=dinit)
        _run(kernel, BH, *args, scalar(scale, dt), S0, do, dS, outputs=outputs, blas=False)
    else:
        dinit[...] = dS
    shape = (B, H, T)
    return Gradients(
        dq=dq.reshape(*shape, K),
        dk=dk.reshape(*shape, K),
        dv=dv.reshape(*shape, V),
        dg=dg.reshape(*shape, K),
        dbeta=dbeta.reshape(shape),
        dinitial=dinit.reshape(B, H, K, V),
    )


# ----------------------------------------------------------------------------------------------
# hooks: the defaults of kda._backend.complete (one head group: the kernels split heads and chunks
# over threads themselves; nothing to set around head groups, each kernel call pins what it needs;
# the gate checked on the host)


def kernel_cache() -> str | None:
    """Where kernels are cached: ``None`` (nowhere), ``"numba"`` or kda's fallback directory."""
    from ._cache import CACHE

    return CACHE


def compile_ahead_off() -> contextlib.AbstractContextManager[None]:
    """A block within which no kernel is compiled ahead in a second process (``kda warmup``)."""
    from . import _ahead

    return _ahead.off()


complete(globals(), extras=("compile_ahead_off", "kernel_cache"))
