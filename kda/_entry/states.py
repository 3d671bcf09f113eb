"""The chunked calls' states: V-major layouts (``state_v_first``) and gradients through the
chunk-start states (fla's ``return_intermediate_states``).

``state_v_first``. :func:`kda.chunk_kda` and :func:`kda.chunk_kda_backward` take and return
their states (``initial_state``, ``final_state``, ``boundaries``, ``grad_final_state`` and the
``initial_state`` gradient) V-major, ``[.., HV, V, K]``, with ``state_v_first=True``
(:func:`k_major_state`, :func:`v_major_output`). The chunk kernels work on K-major states, so
the entry layer transposes them: a copy of the ``[N, HV, K, V]`` states (and ``[NT, B, HV, K,
V]`` boundaries) in each direction, small next to the chunk work; results are bitwise those of
the K-major call, transposed.

Gradients through the chunk-start states.
The adapters return the chunk-start states ``h`` that :func:`kda.chunk_kda` saves as its
boundaries. When the loss depends on ``h``, its gradient enters the state-gradient recurrence at
every chunk boundary, which :func:`kda.chunk_kda_backward` has no argument for. This module gets
the exact gradients from the public functions instead: every chunk becomes a packed sequence of
its own (``cu_seqlens`` at the chunk boundaries, so the chunks are exactly those of the original
call), whose start state is its boundary. Per chunk ``m`` (:func:`kda.chunk_kda_transition`,
:func:`kda.chunk_kda_transition_backward`)::

    dS_start[m] = A[m]^T dS_end[m] + D[m]

and a reverse scan over each sequence's chunks (:func:`kda._entry.scan.retreat`),
``dS_end[m - 1] = dS_start[m] + dh[m]`` from ``dS_end[last] = grad_final_state``, gives every
chunk its true end-state gradient; one packed :func:`kda.chunk_kda_backward` then gives every
input's gradient. Cost: about two backwards and
one forward more than the ordinary backward; it runs only when ``h`` has a nonzero gradient.
"""

from __future__ import annotations

import itertools
from typing import Any

import array_api_compat

from .._errors import InvalidInputError
from .._options.validation import STATE_DTYPE_RULE, Problem, check_array
from .call import KdaGradients, KdaOutput
from .scan import retreat
from .transition import chunk_kda_transition, chunk_kda_transition_backward

__all__ = ["backward_with_state_gradients", "k_major_state", "transposed", "v_major_output"]


def transposed(xp: Any, a: Any) -> Any:
    """``a [..., X, Y]`` as ``[..., Y, X]``: C-contiguous for NumPy and CuPy arrays (a copy)."""
    t = xp.matrix_transpose(a)
    if array_api_compat.is_numpy_array(t) or array_api_compat.is_cupy_array(t):
        import numpy as np

        return np.ascontiguousarray(t) if array_api_compat.is_numpy_array(t) else xp.asarray(t, copy=True)
    return t


def k_major_state(name: str, state: Any, p: Problem, boundaries: tuple[int, ...] | None = None) -> Any:
    """The V-major ``state`` (``[N, HV, V, K]``; with ``boundaries``, the K-major boundaries'
    shape: ``[NT, B, HV, V, K]``) checked and transposed to K-major; None stays None."""
    if state is None:
        return None
    if boundaries is not None:
        shape, letters = (*boundaries[:3], p.V, p.K), "NT, B, HV, V, K"
    else:
        shape, letters = (p.N, p.HV, p.V, p.K), ("B" if p.offsets is None else "N") + ", HV, V, K"
    got = tuple(int(n) for n in getattr(state, "shape", ()))
    if array_api_compat.is_array_api_obj(state) and got != shape:
        msg = f"{name} must have shape [{letters}] = {shape} (V-major: state_v_first=True); got {got}"
        if got == (*shape[:-2], p.K, p.V):
            msg += " (the K-major layout: pass state_v_first=False for states of that layout)"
        raise InvalidInputError(msg)
    check_array(name, state, p, shape, letters, p.compute_dtype, STATE_DTYPE_RULE)
    return transposed(p.xp, state)


def v_major_output(xp: Any, out: Any) -> Any:
    """A :class:`KdaOutput` (its final state and boundaries) or :class:`KdaGradients` (its
    ``initial_state``) with the states transposed to V-major."""
    if isinstance(out, KdaOutput):
        boundaries = None if out.boundaries is None else transposed(xp, out.boundaries)
        return KdaOutput(out.output, transposed(xp, out.final_state), boundaries)
    return out._replace(initial_state=transposed(xp, out.initial_state))


def backward_with_state_gradients(
    x: tuple[Any, ...],
    boundaries: Any,
    do: Any,
    dfinal: Any,
    dboundaries: Any,
    initial_state: Any,
    offsets: tuple[int, ...] | None,
    opts: dict[str, Any],
) -> KdaGradients:
    """Gradients of a time-major chunked call whose chunk-start states also reach the loss.

    Parameters
    ----------
    x : tuple of array
        ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``, ``beta [B, T, HV]``.
    boundaries, dboundaries : array, shape ``[NT, B, HV, K, V]``
        The chunk-start states (``boundaries`` of :func:`kda.chunk_kda`) and their gradient;
        with ``offsets``, ``NT = sum(ceil(len_i / C))`` in packed chunk order (``B == 1``).
    do : array, shape ``[B, T, HV, V]``
        The output's gradient.
    dfinal : array, shape ``[N, HV, K, V]``, or None (zeros)
        The final state's gradient.
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
    from .api import chunk_kda_backward  # (api imports this module)

    xp = array_api_compat.array_namespace(boundaries)
    B, T = x[0].shape[:2]
    C = int(opts["chunk_size"])
    if offsets is None:  # every row a sequence of its own: one packed row, chunks in row order
        seqs = [(b * T, (b + 1) * T) for b in range(B)]
        flat = tuple(xp.reshape(t, (1, B * T, *t.shape[2:])) for t in x)
        do = xp.reshape(do, (1, B * T, *do.shape[2:]))
        shape = (-1, *boundaries.shape[2:])
        boundaries = xp.reshape(xp.permute_dims(boundaries, (1, 0, 2, 3, 4)), shape)
        dboundaries = xp.reshape(xp.permute_dims(dboundaries, (1, 0, 2, 3, 4)), shape)
    else:
        seqs = list(itertools.pairwise(offsets))
        flat = x
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
        A = chunk_kda_transition(*flat, cu_seqlens=tuple(cuts), **opts).A
        D = chunk_kda_transition_backward(*flat, do, cu_seqlens=tuple(cuts), **opts)
    dends = [None] * M  # every chunk's end-state gradient
    for n, (a, b) in enumerate(seqs):
        dend = xp.zeros(shape, dtype=boundaries.dtype) if dfinal is None else dfinal[n]
        m0, m1 = first[n], first[n] + len(range(a, b, C))
        for m in range(m1 - 1, m0 - 1, -1):
            dends[m] = dend
            dend = retreat(A[m], D[m], dend) + dboundaries[m]
    if M:
        grads = chunk_kda_backward(
            *flat, boundaries[:, None, ...], do, xp.stack(dends), initial_state=boundaries,
            cu_seqlens=tuple(cuts), **opts,
        )  # fmt: skip
        per_chunk = grads.initial_state + dboundaries
    dinitial = []
    for n, (a, b) in enumerate(seqs):
        if b > a:
            dinitial.append(per_chunk[first[n]])
        else:
            dinitial.append(xp.zeros(shape, dtype=boundaries.dtype) if dfinal is None else dfinal[n])
    if not M:
        return KdaGradients(*(xp.zeros_like(t) for t in x), xp.stack(dinitial), None, None)
    back = tuple(xp.reshape(gr, t.shape) for gr, t in zip(grads[:5], x))
    return KdaGradients(*back, xp.stack(dinitial), grads.A_log, grads.dt_bias)
