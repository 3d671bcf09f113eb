"""Gradients through the chunk-start states (fla's ``return_intermediate_states``).

The adapters return the chunk-start states ``h`` that :func:`kda.chunk_kda` saves as its
boundaries. When the loss depends on ``h``, its gradient enters the state-gradient recurrence at
every chunk boundary, which :func:`kda.chunk_kda_backward` has no argument for. This module gets
the exact gradients from the public functions instead: every chunk becomes a packed sequence of
its own (``cu_seqlens`` at the chunk boundaries, so the chunks are exactly those of the original
call), whose start state is its boundary. Per chunk ``m`` (:func:`kda.chunk_kda_transition`,
:func:`kda.chunk_kda_transition_backward`)::

    dS_start[m] = A[m]^T dS_end[m] + D[m]

and a reverse scan over each sequence's chunks, ``dS_end[m - 1] = dS_start[m] + dh[m]`` from
``dS_end[last] = grad_final_state``, gives every chunk its true end-state gradient; one packed
:func:`kda.chunk_kda_backward` then gives every input's gradient. Cost: about two backwards and
one forward more than the ordinary backward; it runs only when ``h`` has a nonzero gradient.
"""

from __future__ import annotations

import itertools
from typing import Any

import array_api_compat

from .api import KdaGradients, chunk_kda_backward
from .transition import chunk_kda_transition, chunk_kda_transition_backward

__all__ = ["backward_with_state_gradients"]


def backward_with_state_gradients(
    x: tuple[Any, ...],
    boundaries: Any,
    grad_output: Any,
    grad_final_state: Any,
    grad_boundaries: Any,
    initial_state: Any,
    offsets: tuple[int, ...] | None,
    opts: dict[str, Any],
) -> KdaGradients:
    """Gradients of a time-major chunked call whose chunk-start states also reach the loss.

    Parameters
    ----------
    x : tuple of array
        ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``, ``beta [B, T, HV]``.
    boundaries, grad_boundaries : array, shape ``[NT, B, HV, K, V]``
        The chunk-start states (``boundaries`` of :func:`kda.chunk_kda`) and their gradient;
        with ``offsets``, ``NT = sum(ceil(len_i / C))`` in packed chunk order (``B == 1``).
    grad_output : array, shape ``[B, T, HV, V]``
    grad_final_state : array, shape ``[N, HV, K, V]``, or None (zeros)
    initial_state : array, shape ``[N, HV, K, V]``, or None (zeros)
    offsets : tuple of int or None
        Host ``cu_seqlens``.
    opts : dict
        Keywords of :func:`kda.chunk_kda` (``layout="time_major"``, ``chunk_size``, options,
        ``A_log``, ``dt_bias``) without ``cu_seqlens``.

    Returns
    -------
    KdaGradients
        Shaped like the inputs; ``initial_state`` ``[N, HV, K, V]`` (also when it was None).
    """
    xp = array_api_compat.array_namespace(boundaries)
    B, T = x[0].shape[:2]
    C = int(opts["chunk_size"])
    if offsets is None:
        seqs = [(b * T, (b + 1) * T) for b in range(B)]
        flat = tuple(xp.reshape(t, (1, B * T, *t.shape[2:])) for t in x)
        do = xp.reshape(grad_output, (1, B * T, *grad_output.shape[2:]))
        starts = xp.reshape(xp.permute_dims(boundaries, (1, 0, 2, 3, 4)), (-1, *boundaries.shape[2:]))
        dh = xp.reshape(xp.permute_dims(grad_boundaries, (1, 0, 2, 3, 4)), (-1, *boundaries.shape[2:]))
    else:
        seqs = list(itertools.pairwise(offsets))
        flat, do = x, grad_output
        starts, dh = boundaries[:, 0, ...], grad_boundaries[:, 0, ...]
    cuts, first = [0], []
    for a, b in seqs:
        first.append(len(cuts) - 1)
        cuts.extend(range(a + C, b, C))
        if b > a:
            cuts.append(b)
    M = len(cuts) - 1
    starts, dh = starts[:M, ...], dh[:M, ...]
    shape = starts.shape[1:]
    if M:
        A = chunk_kda_transition(*flat, cu_seqlens=tuple(cuts), **opts).A
        D = chunk_kda_transition_backward(*flat, do, cu_seqlens=tuple(cuts), **opts)
    ends = [None] * M
    for n, (a, b) in enumerate(seqs):
        e = xp.zeros(shape, dtype=starts.dtype) if grad_final_state is None else grad_final_state[n]
        m0, m1 = first[n], first[n] + len(range(a, b, C))
        for m in range(m1 - 1, m0 - 1, -1):
            ends[m] = e
            e = xp.matmul(xp.matrix_transpose(A[m]), e) + D[m] + dh[m]
    if M:
        grads = chunk_kda_backward(
            *flat, starts[:, None, ...], do, xp.stack(ends), initial_state=starts, cu_seqlens=tuple(cuts),
            **opts,
        )  # fmt: skip
        per_chunk = grads.initial_state + dh
    dinit = []
    for n, (a, b) in enumerate(seqs):
        if b > a:
            dinit.append(per_chunk[first[n]])
        else:
            dinit.append(
                xp.zeros(shape, dtype=starts.dtype) if grad_final_state is None else grad_final_state[n]
            )
    if not M:
        return KdaGradients(*(xp.zeros_like(t) for t in x), xp.stack(dinit), None, None)
    back = tuple(xp.reshape(gr, t.shape) for gr, t in zip(grads[:5], x))
    return KdaGradients(*back, xp.stack(dinit), grads.A_log, grads.dt_bias)
