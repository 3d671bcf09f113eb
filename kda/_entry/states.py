"""Gradients through the chunk-start states (fla's ``return_intermediate_states``).

The adapters return the chunk-start states (the ``boundaries`` that :func:`kda.chunk_kda` saves).
When the loss depends on them, their gradient enters the state-gradient recurrence at every chunk
boundary, which :func:`kda.chunk_kda_backward` has no argument for. This module gets the exact
gradients from the forward's validated call instead: every chunk becomes a packed sequence of
its own (``cu_seqlens`` at the chunk boundaries, so the chunks are exactly those of the original
call, :meth:`~kda._entry.call.Call.packed`), whose start state is its boundary. Per chunk ``m``
(:func:`~kda._entry.transition.transition_map`, :func:`~kda._entry.transition.transition_gradient`)::

    dS_start[m] = A[m]^T dS_end[m] + D[m]

and a reverse scan over each sequence's chunks (:func:`kda._entry.scan.retreat`),
``dS_end[m - 1] = dS_start[m] + dboundaries[m]`` from ``dS_end[last] = dfinal``, gives every
chunk its true end-state gradient; one packed backward then gives every input's gradient. Cost:
about two backwards and one forward more than the ordinary backward; it runs only when the
boundaries have a nonzero gradient. Nothing is validated or scanned again: the inputs were, by
the forward; the cotangents are, once, by the caller (:func:`kda._entry.host.backward`).
"""

from __future__ import annotations

import itertools
from typing import Any

from .call import Call, Inputs, KdaGradients
from .scan import retreat
from .transition import transition_gradient, transition_map

__all__ = ["backward_with_state_gradients"]


def backward_with_state_gradients(
    call: Call, x: Inputs, boundaries: Any, do: Any, dfinal: Any, dboundaries: Any
) -> KdaGradients:
    """Gradients of a time-major chunked call whose chunk-start states also reach the loss.

    Parameters
    ----------
    call : Call
        The forward's validated call (time-major; host ``cu_seqlens`` in ``call.problem.offsets``).
    x : Inputs
        ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``, ``beta [B, T, HV]``,
        ``initial_state [N, HV, K, V]`` or None (zeros), ``A_log``, ``dt_bias``.
    boundaries, dboundaries : array, shape ``[NT, B, HV, K, V]``
        The chunk-start states (``boundaries`` of :func:`kda.chunk_kda`) and their gradient;
        with ``offsets``, ``NT = sum(ceil(len_i / C))`` in packed chunk order (``B == 1``).
    do : array, shape ``[B, T, HV, V]``
        The output's gradient.
    dfinal : array, shape ``[N, HV, K, V]``, or None (zeros)
        The final state's gradient.

    Returns
    -------
    KdaGradients
        Shaped like the inputs; ``initial_state`` ``[N, HV, K, V]`` (also when it was None).
    """
    xp, offsets = call.problem.xp, call.problem.offsets
    B, T = x.q.shape[:2]
    C = call.core.chunk_size
    steps = x.steps
    if offsets is None:  # every row a sequence of its own: one packed row, chunks in row order
        seqs = [(b * T, (b + 1) * T) for b in range(B)]
        flat = Inputs(
            *(xp.reshape(t, (1, B * T, *t.shape[2:])) for t in steps), A_log=x.A_log, dt_bias=x.dt_bias
        )
        do = xp.reshape(do, (1, B * T, *do.shape[2:]))
        shape = (-1, *boundaries.shape[2:])
        boundaries = xp.reshape(xp.permute_dims(boundaries, (1, 0, 2, 3, 4)), shape)
        dboundaries = xp.reshape(xp.permute_dims(dboundaries, (1, 0, 2, 3, 4)), shape)
    else:
        seqs = list(itertools.pairwise(offsets))
        flat = x._replace(initial_state=None)
        boundaries, dboundaries = boundaries[:, 0, ...], dboundaries[:, 0, ...]
    cuts, first = [0], []
    for a, b in seqs:
        first.append(len(cuts) - 1)
        cuts.extend(range(a + C, b, C))
        if b > a:
            cuts.append(b)
    M = len(cuts) - 1
    boundaries, dboundaries = boundaries[:M, ...], dboundaries[:M, ...]  # [M, HV, K, V], packed order
    shape = boundaries.shape[1:]
    if M:
        chunks = call.packed(tuple(cuts))  # every chunk a sequence
        do = chunks.grad_output(do, check=False)
        A = transition_map(chunks, flat).A
        D = transition_gradient(chunks, flat, do)
    dends = [None] * M  # every chunk's end-state gradient
    for n, (a, b) in enumerate(seqs):
        dend = xp.zeros(shape, dtype=boundaries.dtype) if dfinal is None else dfinal[n]
        m0, m1 = first[n], first[n] + len(range(a, b, C))
        for m in range(m1 - 1, m0 - 1, -1):
            dends[m] = dend
            dend = retreat(A[m], D[m], dend) + dboundaries[m]
    if M:
        grads = chunks.backward(flat, boundaries, boundaries[:, None, ...], do, xp.stack(dends))
        per_chunk = grads.initial_state + dboundaries
    dinitial = []
    for n, (a, b) in enumerate(seqs):
        if b > a:
            dinitial.append(per_chunk[first[n]])
        else:
            dinitial.append(xp.zeros(shape, dtype=boundaries.dtype) if dfinal is None else dfinal[n])
    if not M:
        return KdaGradients(*(xp.zeros_like(t) for t in steps), xp.stack(dinitial), None, None)
    back = (xp.reshape(gr, t.shape) for gr, t in zip((grads.q, grads.k, grads.v, grads.g, grads.beta), steps))
    return KdaGradients(*back, xp.stack(dinitial), grads.A_log, grads.dt_bias)
