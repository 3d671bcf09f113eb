"""What a backend module has unless it defines its own (:data:`DEFAULTS`), and :func:`complete`,
which every backend module ends with.

The defaults: no fused passes, one worker, the gate checked on the host, any chunk length, the
step recurrence for one-step calls, the generic chunk layout (:func:`to_chunks`,
:func:`from_chunks`) and the decode checks by whole-array reductions (:func:`decode_screen`,
:func:`decode_finite`). Backends import nothing from each other: what they share lives here and in
:mod:`.protocol`.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

from array_api_compat import array_namespace

from .._options.arguments import c_contiguous
from .protocol import Backend, ChunkLocal

__all__ = ["DEFAULTS", "INTERFACE", "complete", "decode_finite", "decode_screen", "from_chunks", "to_chunks"]


def to_chunks(x: Any, *, chunk_size: int, padded_size: int) -> Any:
    """``[B, H, T, D]`` -> ``[B, H, NT, Cp, D]``, zero-padded in time and within each chunk."""
    xp = array_namespace(x)
    B, H, T, D = x.shape
    C, Cp = chunk_size, padded_size
    NT = -(-T // C)
    if NT * C > T:
        x = xp.concat([x, xp.zeros((B, H, NT * C - T, D), dtype=x.dtype, device=x.device)], axis=2)
    x = xp.reshape(x, (B, H, NT, C, D))
    if Cp > C:
        x = xp.concat([x, xp.zeros((B, H, NT, Cp - C, D), dtype=x.dtype, device=x.device)], axis=3)
    return x


def from_chunks(x: Any, *, chunk_size: int, length: int) -> Any:
    """Inverse of :func:`to_chunks`: ``[B, H, NT, Cp, D]`` -> ``[B, H, T, D]`` with ``T = length``."""
    xp = array_namespace(x)
    B, H, NT, _, D = x.shape
    x = xp.reshape(x[..., :chunk_size, :], (B, H, NT * chunk_size, D))
    return x[:, :, :length, :]


# ---------------------------------------------------------------------- the base of every backend


def _one_worker(*, xp: Any, heads: int) -> int:
    """One head group at a time (no concurrency)."""
    return 1


def _no_worker_context() -> AbstractContextManager:
    """Nothing to set around head groups."""
    return contextlib.nullcontext()


def _host_gate_check(g: Any) -> None:
    """No device-side check: validation checks ``g`` on the host."""
    return None


def decode_screen(q: Any, k: Any, v: Any, g: Any, beta: Any, *, finite: bool) -> bool:
    """:meth:`Backend.decode_screen` with the arrays' namespace: one dtype (float32 or float64),
    C-contiguous, ``g <= 0`` everywhere and, with ``finite``, ``q, k, v, beta`` finite (the
    results of the cpu backend's compiled pass, by whole-array reductions)."""
    xp = array_namespace(q, k, v, g, beta)
    dt = q.dtype
    if dt not in (xp.float32, xp.float64) or any(x.dtype != dt for x in (k, v, g, beta)):
        return False
    if not all(c_contiguous(x) for x in (q, k, v, g, beta)):
        return False
    if not bool(xp.all(g <= 0)):  # a NaN fails
        return False
    return not finite or all(bool(xp.all(xp.isfinite(x))) for x in (q, k, v, beta))


def decode_finite(output: Any) -> bool:
    """:meth:`Backend.decode_finite` with the array's namespace."""
    xp = array_namespace(output)
    return bool(xp.all(xp.isfinite(output)))


# what a backend module has unless it defines its own (the optional part of :class:`Backend`)
DEFAULTS: dict[str, Any] = {
    "MAX_CHUNK": None,  # any chunk length
    "RECURRENT_MAX_T": 1,  # the step recurrence for one-step calls only
    "FUSED_SCREENS": frozenset(),  # no fused passes, nothing screened on the way
    "ChunkLocal": ChunkLocal,
    "to_chunks": to_chunks,
    "from_chunks": from_chunks,
    "chunk_forward_heads": None,  # no fused passes: the engine composes the primitives by slabs
    "chunk_backward_heads": None,
    "workers": _one_worker,
    "worker_context": _no_worker_context,
    "launch_gate_check": _host_gate_check,
    "decode_screen": decode_screen,  # the decode fast path's checks, by whole-array reductions
    "decode_finite": decode_finite,
}

# every name a backend module provides: the attributes and methods of :class:`Backend`, the record
INTERFACE: tuple[str, ...] = tuple(
    sorted({*Backend.__annotations__, *(n for n in vars(Backend) if not n.startswith("_")), "ChunkLocal"})
)


def complete(namespace: dict[str, Any], extras: tuple[str, ...] = ()) -> None:
    """Finish a backend module: :data:`DEFAULTS` for what ``namespace`` (its ``globals()``) does
    not define, and ``__all__`` as :data:`INTERFACE` plus ``extras`` (its own public names).

    Raises ``TypeError`` (a programming error, at import) when a name of the interface is missing.
    """
    for name, value in DEFAULTS.items():
        namespace.setdefault(name, value)
    missing = [name for name in (*INTERFACE, *extras) if name not in namespace]
    if missing:
        msg = f"backend {namespace.get('__name__')} lacks {missing} of the interface (kda._backend.Backend)"
        raise TypeError(msg)
    namespace["__all__"] = sorted({*INTERFACE, *extras})
