"""Decoding from a state pool: ``decode_kda``, speculative verification, and the adapters'
recurrent forward (:func:`decode_states`), on the general route.

A serving engine keeps the recurrent states of its requests in one pool ``[P, HV, K, V]`` and
runs a batch of requests, each a few steps long (one for decoding, a few for speculative
verification), against the rows it names. Rows are written in place; rows that no request names
are neither read nor written. ``docs/decode.md`` is the guide.

Slots. ``state_indices [N]``: request ``n`` starts from row ``state_indices[n]`` and its final
state goes back there (``-1``: a padding request). ``state_indices [N, W]`` (speculative
verification, as flash-linear-attention and vLLM): request ``n`` starts from slot
``[n, num_accepted_tokens[n] - 1]`` and its state after step ``t`` goes to slot ``[n, t]``
(``-1``: not kept). The backends receive the same two int64 arrays in both cases,
``start [N]`` and ``dest [N, W]`` (:meth:`kda._backend.Backend.decode_forward`); the pool and
the slots are checked by :mod:`kda._options.arguments`.

Cost. Validation looks at the small arrays only (the inputs' shapes and dtypes, the indices, and
the inputs' values for the gate and finiteness checks); the pool's shape, dtype and writability
are read from its header, its contents never. On NumPy a plain call takes the direct route
(:mod:`kda._entry.decode_numpy`), bitwise the general route's, which handles everything else
and words every error. The prepared form is :mod:`kda._entry.decode_plan`.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from .._options.arguments import check_array
from .._options.checks import warn_if_diverged
from .._options.maps import head_first
from .._options.packing import PADDING, Slots, check_pad_slot_id, check_pool, check_slots
from .._options.table import Array, Choices
from .._options.validation import check_state
from .call import Call, Inputs, KdaOutput, open_call
from .decode_numpy import numpy_route as _numpy_route
from .layout import check_state_v_first

__all__ = ["Slots", "decode_kda", "decode_states"]


# ----------------------------------------------------------------------------------------------
# the call


def _run(
    call: Call,
    inputs: Inputs,
    pool: Any,
    slots: Slots,
    *,
    out: Any = None,
    final_pool: Any = None,
    v_first: bool = False,
) -> Any:
    """The general route: options mapped, the backend's kernel, the output in the caller's layout."""
    p, xp = call.problem, call.problem.xp
    c = call.core_inputs(inputs)
    ops = call.core.ops
    o = ops.decode_forward(
        c.q,
        c.k,
        c.v,
        c.g,
        c.beta,
        pool,
        slots.start,
        slots.dest,
        scale=p.scale,
        offsets=p.offsets,
        final_pool=final_pool,
        v_first=v_first,
    )
    o = head_first(xp, xp.astype(o, p.dtype, copy=False), p.layout)
    if call.check:
        warn_if_diverged(xp, o)
    if out is not None:
        out[...] = o
        return out
    return o


def _decode_kda(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    state_pool: Array,
    state_indices: Array,
    *,
    num_accepted_tokens: Array | None,
    state_v_first: bool,
    pad_slot_id: int,
    scale: float | None,
    backend: str | None,
    opts: Choices,
) -> Any:
    """:func:`decode_kda` with the options gathered (``opts``): what the public function and the
    fla-style adapters' pool calls (:func:`kda._entry.host.decode`) run."""
    if opts.cu_seqlens is None and (state_v_first is False or state_v_first is True):
        out = _numpy_route(
            q,
            k,
            v,
            g,
            beta,
            state_pool,
            state_indices,
            scale=scale,
            backend=backend,
            opts=opts,
            num_accepted_tokens=num_accepted_tokens,
            v_first=state_v_first,
            pad=pad_slot_id,
        )
        if out is not None:
            return out
    call = open_call(q, k, v, g, beta, scale, opts, backend=backend)
    p = call.problem
    v_first = check_state_v_first(state_v_first)
    P = check_pool(state_pool, p, v_first)
    pad = check_pad_slot_id(pad_slot_id, P)
    slots = check_slots(state_indices, num_accepted_tokens, p.N, p.T, p.offsets, P, pad)
    call.check_inputs_finite(q=q, k=k, v=v, g=g, beta=beta)
    return _run(call, Inputs(q, k, v, g, beta), state_pool, slots, v_first=v_first)


def decode_kda(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    state_pool: Array,
    state_indices: Array,
    *,
    num_accepted_tokens: Array | None = None,
    state_v_first: bool = False,
    pad_slot_id: int = PADDING,
    scale: float | None = None,
    backend: str | None = None,
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Array | None = None,
    check_finite: bool = True,
) -> Any:
    """A few KDA steps of a batch of requests, each continuing a state held in a pool row.

    With 1-D ``state_indices``, request ``n`` starts from ``state_pool[state_indices[n]]``, runs
    its steps of the recurrence (as :func:`kda.recurrent_kda` would with that row as
    ``initial_state``) and writes its final state back into that row, in place. With 2-D
    ``state_indices [N, T]`` (speculative verification, the convention of flash-linear-attention
    and vLLM), request ``n`` starts from slot ``[n, num_accepted_tokens[n] - 1]`` and writes its
    state after step ``t`` into slot ``[n, t]``.

    Parameters
    ----------
    q, k : array, shape ``[N, H, T, K]`` (``[N, T, H, K]`` with ``layout="time_major"``)
        Queries and keys of the ``N`` requests (``[1, H, T_total, K]`` with ``cu_seqlens``:
        request ``n`` is steps ``cu_seqlens[n]:cu_seqlens[n + 1]``).
    v : array, shape ``[N, HV, T, V]``
        Values (``HV`` a multiple of ``H``: grouped value heads).
    g : array, shape ``[N, HV, T, K]``
        Gates: log decays ``<= 0`` with ``gate="log"``, raw gates otherwise.
    beta : array, shape ``[N, HV, T]``
        Delta-rule step sizes (raw, with ``beta_activation``).
    state_pool : array, shape ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``state_v_first``)
        The pool of states, writable; updated in place. float32, float16 or bfloat16
        (``ml_dtypes.bfloat16`` for NumPy) for float32 and 16-bit inputs, float64 for float64
        inputs: a row is read as it is, the steps compute in float32 (float64) and every state
        stored is rounded to the pool's dtype (to nearest even). Rows that no request names
        are neither read nor written (bitwise unchanged).
    state_indices : integer array or list, shape ``[N]`` or ``[N, T]``
        ``[N]``: the row of each request (``-1`` or ``pad_slot_id``: a padding request, whose
        output is zeros and which reads and writes no state). ``[N, T]``: a row per step
        (``-1`` / ``pad_slot_id``: that step's state is not kept; a request whose start slot is
        padding is a padding request and must be padding throughout); columns past a request's
        length are ignored. A request may name its own row at several steps (they are written
        in step order: the row ends with the state after the last of them); no row is named by
        two requests.
    num_accepted_tokens : integer array or list, shape ``[N]``, optional
        With 2-D ``state_indices`` only: request ``n`` starts from slot
        ``[n, num_accepted_tokens[n] - 1]``, each in ``1..T`` (``T``: the request's steps).
        Default: all 1 (start from slot ``[n, 0]``).
    state_v_first : bool
        The pool is V-major, ``[P, HV, V, K]`` (vLLM's Kimi Linear layers): read and written in
        that layout in place, as fast as a K-major pool.
    pad_slot_id : int
        The index that marks padding besides ``-1``: ``-1`` (default) or a pool row reserved
        for padding (vLLM's KDA layers pass 0); that row is neither read nor written.
    scale : float, optional
        Query scale; default ``K ** -0.5``.
    backend : {None, "reference", "cpu", "cuda"}
        ``None`` picks from the arrays' namespace; CuPy arrays run one CUDA kernel.
    layout : {"head_first", "time_major"}, default "head_first"
        ``"time_major"`` takes and returns ``[B, T, heads, ...]`` arrays. States are always
        ``[B, HV, K, V]``, boundaries ``[NT, B, HV, K, V]``.
    qk_l2norm : bool, default False
        Replace q and k by ``x / sqrt(sum(x**2, over K) + 1e-6)`` per step and head.
    gate : {"log", "softplus", "lower_bound"}, default "log"
        The gate law (:mod:`kda._options.gates`), the log decay from ``g``: ``"log"``: ``g`` itself;
        ``"softplus"``: ``-exp(A_log[h]) * softplus(g + dt_bias[h])``; ``"lower_bound"``:
        ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))`` (factor 1 when ``A_log`` is
        None).
    A_log : Array | None, default None
        shape ``[HV]``. Required for ``"softplus"``, optional for ``"lower_bound"``, refused
        for ``"log"``.
    dt_bias : Array | None, default None
        shape ``[HV, K]``. Gate bias (zeros when None); refused for ``"log"``.
    lower_bound : float | None, default None
        A float < 0, required for ``"lower_bound"`` only.
    beta_activation : {None, "sigmoid", "sigmoid2"}, default None
        Use ``beta``, ``sigmoid(beta)`` or ``2 * sigmoid(beta)`` (negative eigenvalues allowed).
    cu_seqlens : Array | None, default None
        1-D integer array of ``N + 1`` offsets. With ``B == 1``: the row holds ``N``
        independent sequences, sequence ``i`` at steps ``cu_seqlens[i]:cu_seqlens[i + 1]``;
        states are ``[N, HV, K, V]``, boundaries ``[NT, 1, HV, K, V]`` with
        ``NT = sum(ceil(len_i / C))``, in sequence order.
    check_finite : bool, default True
        Refuse NaN or infinite inputs (``-inf`` stays legal in a log gate) with
        :class:`~kda.InvalidInputError`, and warn with :class:`~kda.KdaWarning` when finite
        inputs give non-finite results (the delta rule diverged). False skips both.
        (``check_finite`` scans the inputs, not the pool: that would read every row.)

    Returns
    -------
    output : array, shape ``[N, HV, T, V]`` (``[N, T, HV, V]`` time-major), dtype of the inputs.

    Raises
    ------
    InvalidInputError
        Wrong shapes, an index outside ``[-1, P)``, a row named twice in a call, a
        ``num_accepted_tokens`` outside ``1..T``, a pool that cannot be written in place (a
        read-only NumPy array, an immutable namespace such as JAX). Nothing is written then.
    InvalidTypeError
        Wrong dtypes (the pool must be the compute dtype) or array types.
    """
    choices = Choices(
        layout=layout,
        qk_l2norm=qk_l2norm,
        gate=gate,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        beta_activation=beta_activation,
        cu_seqlens=cu_seqlens,
        check_finite=check_finite,
    )
    return _decode_kda(
        q,
        k,
        v,
        g,
        beta,
        state_pool,
        state_indices,
        num_accepted_tokens=num_accepted_tokens,
        state_v_first=state_v_first,
        pad_slot_id=pad_slot_id,
        scale=scale,
        backend=backend,
        opts=choices,
    )


_ROWS: dict[int, Slots] = {}  # N -> request n on row n (arange(N), int64, read-only): decode_states


def _rows(N: int) -> Slots:
    """The slots of :func:`decode_states`: request ``n`` reads row ``n`` and writes row ``n``."""
    slots = _ROWS.get(N)
    if slots is None:
        import numpy as np

        rows = np.arange(N, dtype=np.int64)
        rows.flags.writeable = False
        slots = _ROWS[N] = Slots(rows, rows.reshape(N, 1))
    return slots


def _decode_states(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    initial_state: Array | None,
    *,
    state_v_first: bool,
    scale: float | None,
    backend: str | None,
    opts: Choices,
) -> KdaOutput:
    """:func:`kda.recurrent_kda`'s forward through the decode kernel: ``(output, final_state, None)``.

    Request ``n`` (batch row, or packed sequence with ``cu_seqlens``) starts from
    ``initial_state[n]`` (zeros when None) and its final state is written into a new
    ``final_state [N, HV, K, V]`` (``[N, HV, V, K]``, read and written V-major, with
    ``state_v_first``); ``initial_state`` is only read. As for :func:`decode_kda`,
    ``check_finite`` scans the step inputs, not the states. The adapters' recurrent forward
    (``fused_recurrent_kda``) runs here.
    """
    v_first = state_v_first is True
    if initial_state is not None and opts.cu_seqlens is None:
        import numpy as np

        plain = (
            type(initial_state) is np.ndarray and initial_state.ndim == 4 and initial_state.dtype == q.dtype
        )
        if plain and getattr(q, "ndim", 0) == 4 and initial_state.shape[0] == q.shape[0]:
            final = np.empty(initial_state.shape, initial_state.dtype)
            rows = _rows(initial_state.shape[0])
            out = _numpy_route(
                q,
                k,
                v,
                g,
                beta,
                initial_state,
                rows.start,
                scale=scale,
                backend=backend,
                opts=opts,
                final_pool=final,
                slots=rows,
                v_first=v_first,
            )
            if out is not None:
                return KdaOutput(out, final, None)
    call = open_call(q, k, v, g, beta, scale, opts, backend=backend)
    p, xp = call.problem, call.problem.xp
    v_first = check_state_v_first(state_v_first)
    call.check_inputs_finite(q=q, k=k, v=v, g=g, beta=beta)
    shape = (p.N, p.HV, p.V, p.K) if v_first else (p.N, p.HV, p.K, p.V)
    final = xp.zeros(shape, dtype=p.compute_dtype, device=array_api_compat.device(q))
    slots = _rows(p.N)
    if initial_state is None:
        return KdaOutput(_run(call, Inputs(q, k, v, g, beta), final, slots, v_first=v_first), final, None)
    if v_first:
        rows = "B" if p.offsets is None else "N"
        check_array(
            "initial_state",
            initial_state,
            p,
            shape,
            f"{rows}, HV, V, K",
            p.compute_dtype,
            "states are float64 for float64 inputs, float32 otherwise",
        )
    else:
        check_state("initial_state", initial_state, p)
    o = _run(call, Inputs(q, k, v, g, beta), initial_state, slots, final_pool=final, v_first=v_first)
    return KdaOutput(o, final, None)


def decode_states(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    initial_state: Array | None = None,
    *,
    state_v_first: bool = False,
    scale: float | None = None,
    backend: str | None = None,
    layout: str = "head_first",
    qk_l2norm: bool = False,
    gate: str = "log",
    A_log: Array | None = None,
    dt_bias: Array | None = None,
    lower_bound: float | None = None,
    beta_activation: str | None = None,
    cu_seqlens: Array | None = None,
    check_finite: bool = True,
) -> KdaOutput:
    """:func:`_decode_states` with the options as keywords (those of :func:`decode_kda`)."""
    choices = Choices(
        layout=layout,
        qk_l2norm=qk_l2norm,
        gate=gate,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        beta_activation=beta_activation,
        cu_seqlens=cu_seqlens,
        check_finite=check_finite,
    )
    return _decode_states(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        state_v_first=state_v_first,
        scale=scale,
        backend=backend,
        opts=choices,
    )
