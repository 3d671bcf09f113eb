"""The prepared decode call: :func:`prepare_decode_kda` validates once, :meth:`DecodePlan.run` runs
again on the refilled bound arrays (the general route's kernel, or the kernel on the bound arrays
directly for a plain problem)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import array_api_compat

from .._errors import InvalidInputError
from .._options.arguments import c_contiguous, check_array
from .._options.maps import head_first
from .._options.packing import PADDING, SMALL, Slots, _check_rows, check_pad_slot_id, check_pool, check_slots
from .._options.table import Array, Choices
from .._options.validation import recheck_gate
from .call import Call, Inputs, open_call
from .decode import _run
from .layout import check_state_v_first

__all__ = ["DecodePlan", "prepare_decode_kda"]


@dataclass
class DecodePlan:
    """A validated decode call, to run many times on refilled inputs (:func:`prepare_decode_kda`).

    Attributes
    ----------
    out : the output buffer ``[N, HV, T, V]`` (time-major: ``[N, T, HV, V]``) every run writes.
    """

    call: Call
    inputs: Inputs  # q .. beta
    pool: Any
    state_indices: Any
    num_accepted_tokens: Any
    out: Any
    P: int
    direct: bool  # the kernel reads the bound arrays as they are (no option maps, no casts)
    v_first: bool = False  # the pool is [P, HV, V, K]
    pad: int = PADDING  # pad_slot_id

    def __post_init__(self) -> None:
        p, xp = self.call.problem, self.call.problem.xp
        # what runs read: head-first views of the bound buffers (valid while they are refilled)
        self._views = tuple(head_first(xp, x, p.layout) for x in self.inputs.steps)
        self._buffer = head_first(xp, self.out, p.layout)
        idx = self.state_indices
        one_d = (
            _is_int64_vector(idx, p.N)
            and self.num_accepted_tokens is None
            and p.offsets is None
            and self.pad == PADDING
        )
        self._rows = Slots(idx, idx.reshape(p.N, 1)) if one_d else None

    def run(self) -> Any:
        """Run from the current contents of the bound arrays; returns :attr:`out`.

        Re-checks what a caller refills between runs: the slots (``state_indices``,
        ``num_accepted_tokens``: range, repeats, counts; O(N T), the pool is not read) and, for
        a log gate on host arrays, ``max(g) <= 0``. Shapes, dtypes and options are not re-checked.
        """
        p = self.call.problem
        if self._rows is not None and p.N <= SMALL:
            _check_rows(
                "state_indices", self._rows.start.tolist(), self.P, "two requests cannot share a state"
            )
            slots = self._rows
        else:
            slots = check_slots(
                self.state_indices, self.num_accepted_tokens, p.N, p.T, p.offsets, self.P, self.pad
            )
        self._recheck_gate()
        if not self.direct:
            return _run(self.call, self.inputs, self.pool, slots, out=self.out, v_first=self.v_first)
        buffer = self._buffer
        ops = self.call.core.ops
        o = ops.decode_forward(
            *self._views,
            self.pool,
            slots.start,
            slots.dest,
            scale=p.scale,
            offsets=p.offsets,
            out=buffer,
            v_first=self.v_first,
        )
        if o is not buffer:
            buffer[...] = o
        return self.out

    def _recheck_gate(self) -> None:
        recheck_gate(self.call.options, self.call.problem.xp, self.inputs.g)


def _is_int64_vector(x: Any, N: int) -> bool:
    import numpy as np

    return type(x) is np.ndarray and x.dtype == np.int64 and x.shape == (N,) and c_contiguous(x)


def prepare_decode_kda(
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
    out: Array | None = None,
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
) -> DecodePlan:
    """Validate a :func:`decode_kda` call once and bind its arrays: ``plan.run()`` runs it again.

    The arguments are those of :func:`decode_kda`, plus ``out``: a writable output buffer
    ``[N, HV, T, V]`` (``[N, T, HV, V]`` time-major) of the inputs' dtype, or None to allocate
    one. Every run reads the *current contents* of the bound arrays, ``state_indices`` and
    ``num_accepted_tokens`` included (refill them in place; their shapes are fixed), and writes
    :attr:`DecodePlan.out`. On NumPy, a plain problem (float32 / float64, ``gate="log"``, no
    ``qk_l2norm`` or beta activation, ``HV == H``) allocates nothing in ``run()``: the kernel
    reads the bound arrays and writes ``out`` and the pool directly.

    Parameters
    ----------
    q, k, v, g, beta, state_pool, state_indices, num_accepted_tokens, state_v_first, pad_slot_id, scale
        As for :func:`decode_kda` (and ``backend``); the inputs must be C-contiguous.
    out : array, optional
        The output buffer.
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

    Returns
    -------
    DecodePlan
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
    call = open_call(q, k, v, g, beta, scale, choices, backend=backend)
    p = call.problem
    v_first = check_state_v_first(state_v_first)
    P = check_pool(state_pool, p, v_first)
    pad = check_pad_slot_id(pad_slot_id, P)
    check_slots(state_indices, num_accepted_tokens, p.N, p.T, p.offsets, P, pad)
    call.check_inputs_finite(q=q, k=k, v=v, g=g, beta=beta)
    for name, x in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta)):
        if not c_contiguous(x):
            msg = f"prepared decode requires C-contiguous bindings: {name} (shape {tuple(x.shape)}) is not"
            raise InvalidInputError(msg)
    shape = p.shape(p.HV, p.V)
    if out is None:
        out = p.xp.zeros(shape, dtype=p.dtype, device=array_api_compat.device(q))
    else:
        check_array("out", out, p, shape, p.letters("HV", "V"), p.dtype, "the dtype of q")
        if not array_api_compat.is_writeable_array(out) or not c_contiguous(out):
            msg = "out must be a writable C-contiguous array (runs write the output into it)"
            raise InvalidInputError(msg)
    direct = call.plain()
    return DecodePlan(
        call=call,
        inputs=Inputs(q, k, v, g, beta),
        pool=state_pool,
        state_indices=state_indices,
        num_accepted_tokens=num_accepted_tokens,
        out=out,
        P=P,
        direct=direct,
        v_first=v_first,
        pad=pad,
    )
