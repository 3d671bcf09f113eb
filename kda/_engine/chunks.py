"""What the chunked forward and backward share: the step arrays as one record, their chunks and
state-free work, slabs of chunks, and groups of heads run concurrently.

The algorithm itself is described in :mod:`kda._engine.chunked`.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = [
    "Chunks",
    "Steps",
    "head_groups",
    "padded_chunk_size",
    "prepare",
    "run_groups",
    "slabs",
    "step_range",
    "writable",
]


def padded_chunk_size(chunk_size: int) -> int:
    """The next power of two ``>= chunk_size``: chunks are halved recursively."""
    return 1 << (chunk_size - 1).bit_length()


class Steps(NamedTuple):
    """The step arrays of a call, ``[B, H, T, ...]`` (``beta [B, H, T]``), in the primitives' order:
    ``*steps`` passes them on positionally."""

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any

    def heads(self, index: tuple) -> Steps:
        """The step arrays of the heads ``index`` selects (a group along ``B`` or ``H``)."""
        return Steps(*(x[index] for x in self))

    def span(self, t: slice) -> Steps:
        """The steps ``t`` of every head."""
        return Steps(*(x[:, :, t, ...] for x in self))


class Chunks(NamedTuple):
    """The step arrays of a slab as chunks, and their state-free work (shared by forward and backward)."""

    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any  # [B, H, NT, Cp]
    local: Any  # ChunkLocal: qg, kg, k_suffix, total, A, L, Minv, w, u0


def prepare(ops: Any, steps: Steps, *, scale: float, chunk_size: int) -> Chunks:
    """The chunks of ``steps`` (zero-padded to the padded chunk size) and their state-free work."""
    C, Cp = chunk_size, padded_chunk_size(chunk_size)
    qc, kc, vc, gc = (ops.to_chunks(x, chunk_size=C, padded_size=Cp) for x in steps[:4])
    bc = ops.to_chunks(steps.beta[..., None], chunk_size=C, padded_size=Cp)[..., 0]
    local = ops.chunk_local(qc, kc, vc, gc, bc, scale=scale)
    return Chunks(q=qc, k=kc, v=vc, g=gc, beta=bc, local=local)


def slabs(shape: tuple[int, ...], chunk_size: int, width: int, slab_elements: int) -> list[tuple[int, int]]:
    """Ranges ``[n0, n1)`` of chunks processed together.

    The state-free work of one slab holds arrays of about ``slab_elements`` elements, so memory
    stays bounded as ``T`` grows, and the number of primitive calls grows with ``T / slab``, not
    with the number of chunks.
    """
    B, H, T = shape[:3]
    NT = -(-T // chunk_size)
    per_chunk = max(1, B * H * padded_chunk_size(chunk_size) * width)
    step = max(1, slab_elements // per_chunk)
    return [(n, min(n + step, NT)) for n in range(0, NT, step)]


def step_range(n0: int, n1: int, chunk_size: int, T: int) -> slice:
    """The steps of the chunks ``[n0, n1)`` (the last chunk may be short)."""
    return slice(n0 * chunk_size, min(n1 * chunk_size, T))


def head_groups(ops: Any, xp: Any, shape: tuple[int, ...]) -> tuple[int, list[slice]]:
    """Split the independent heads ``B * H`` into groups that run concurrently.

    Returns the axis (0 for B, 1 for H) and one slice per group; the backend decides how many
    workers it wants (one on a GPU).
    """
    B, H = shape[:2]
    workers = ops.workers(xp=xp, heads=B * H)
    axis, n = (1, H) if H >= workers or H >= B else (0, B)
    workers = min(workers, n)
    if workers <= 1:
        return 1, [slice(None)]
    edges = [n * i // workers for i in range(workers + 1)]
    return axis, [slice(a, b) for a, b in itertools.pairwise(edges)]


def run_groups(ops: Any, groups: list[slice], task: Callable[[slice], Any]) -> list[Any]:
    """``task(group)`` for every group, concurrently when there is more than one."""
    if len(groups) == 1:
        return [task(group) for group in groups]
    from concurrent.futures import ThreadPoolExecutor

    # each group runs in a copy of the caller's context, so context-local settings (NumPy's
    # errstate, for one) hold in the workers as they do in the caller
    contexts = [contextvars.copy_context() for _ in groups]
    with ops.worker_context(), ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(lambda ctx, group: ctx.run(task, group), contexts, groups))


def writable(x: Any) -> bool:
    """Whether ``x`` can be written in place (a JAX array cannot)."""
    import array_api_compat

    return bool(array_api_compat.is_writeable_array(x))
