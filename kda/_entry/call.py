"""What every entry point does around the core: validate, map the options, run, apply chain rules.

A :class:`Call` is one validated problem bound to a core. The public functions, the plans, the
transition maps and (through them) Dask blocks and the adapters all run through its methods, so
they compute the same thing the same way:

    raw inputs --(layout, dtype, options' maps)--> core inputs --(core)--> results
               <--(chain rules, layout, dtype)--
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import array_api_compat

from .._backend import get_backend
from .._engine.core import (
    ChunkCore,
    Core,
    Gradients,
    KdaOutput,
    RecurrentCore,
    run_packed_backward,
    run_packed_forward,
)
from .._options.arguments import check_choice
from .._options.checks import check_finite as _check_finite
from .._options.checks import floating_point_quiet, warn_if_diverged
from .._options.gates import PARAMETER_NAMES, parameters_of
from .._options.maps import (
    CoreInputs,
    Options,
    beta_backward,
    gate_backward,
    head_first,
    prepare_core_inputs,
    qk_backward,
)
from .._options.spec import METHODS, CallSpec
from .._options.table import Choices
from .._options.validation import (
    STATE_DTYPE_RULE,
    Problem,
    ScreenedGate,
    check_array,
    check_chunk_size,
    check_options_call,
    check_state,
    namespace_of,
    raise_for_gates,
)
from .records import Inputs, KdaGradients

__all__ = ["Call", "Inputs", "KdaGradients", "KdaOutput", "bind_call", "build_call", "open_call"]


def open_call(
    q,
    k,
    v,
    g,
    beta,
    scale: Any,
    choices: Choices,
    *,
    backend: str | None,
    chunk_size: Any = None,
    defer_gate: bool = False,
    scan: bool = True,
) -> Call:
    """A public function's call: its arguments and options (the table's ``choices``) as a
    :class:`~kda._options.spec.CallSpec` and arrays, through :func:`build_call` (validated).
    ``chunk_size=None``: the step recurrence."""
    spec = CallSpec.from_choices(
        choices,
        method="recurrent" if chunk_size is None else "chunk",
        scale=scale,
        chunk_size=64 if chunk_size is None else chunk_size,
        backend=backend,
    )
    x = Inputs.of(q, k, v, g, beta, choices)
    return build_call(
        spec, x, cu_seqlens=choices.cu_seqlens, defer_gate=defer_gate, scan=scan, choices=choices
    )


def build_call(
    spec: CallSpec,
    x: Inputs,
    *,
    cu_seqlens: Any = None,
    defer_gate: bool = False,
    scan: bool = True,
    choices: Choices | None = None,
) -> Call:
    """The validating door: check the arrays ``x`` (``q .. beta`` and the gate law's parameters,
    in ``spec.layout``), ``cu_seqlens`` and the ``spec`` and bind them to a core.

    ``defer_gate``: let a GPU backend check ``g <= 0`` on the device, read after the call's work
    is queued (:meth:`Call.forward` and :meth:`Call.backward` read it), and a backend with fused
    passes screen ``g`` as they load it (checked on the host first where the call runs none).
    ``scan=False``: sizes, dtypes and options only, no look at the values: for a part of a call
    whose arrays were checked (a Dask block's later tasks, after its check task).
    ``choices``: the table's :class:`~kda._options.table.Choices` that ``spec``, ``x``'s gate
    parameters and ``cu_seqlens`` were made from, where the caller has it (:func:`open_call`):
    not made again from them.
    """
    check_choice("method", spec.method, METHODS)
    xp = namespace_of(["q", "k", "v", "g", "beta"], list(x.steps))
    backend = get_backend(xp, spec.backend)
    gate_check = backend.launch_gate_check if defer_gate else None
    if defer_gate and backend.chunk_forward_heads is not None:
        gate_check = partial(ScreenedGate, xp)  # the fused passes screen g (Call._gate_before)
    if choices is None:
        choices = spec.choices(parameters_of(x), cu_seqlens)
    p, options = check_options_call(*x.steps, spec.scale, choices, gate_check, scan)
    chunk_size = check_chunk_size(spec.chunk_size) if spec.method == "chunk" else None
    return _call(p, options, backend, chunk_size, check=bool(spec.check_finite))


def bind_call(spec: CallSpec, x: Inputs, offsets: tuple[int, ...] | None) -> Call:
    """The non-validating door: the call that :func:`build_call` validated, rebuilt without a
    check from the same ``spec`` and arrays (``x`` in ``spec.layout`` and the compute dtype,
    the gate parameters as validated) and host ``offsets``: the problem's sizes, the options and
    the core. ``spec.scale`` must be the resolved scale (a float)."""
    q, v = x.q, x.v
    xp = array_api_compat.array_namespace(q)
    B, H, HV = q.shape[0], q.shape[1], v.shape[1]
    T = q.shape[2]
    if spec.layout != "head_first":
        H, HV, T = q.shape[2], v.shape[2], q.shape[1]
    problem = Problem(
        xp=xp,
        B=B,
        H=H,
        HV=HV,
        T=T,
        K=q.shape[3],
        V=v.shape[3],
        dtype=q.dtype,
        compute_dtype=q.dtype,
        scale=spec.scale,
        layout=spec.layout,
        offsets=offsets,
    )
    options = Options(
        qk_l2norm=spec.qk_l2norm,
        gate=spec.gate,
        lower_bound=spec.lower_bound,
        beta_activation=spec.beta_activation or None,
        **parameters_of(x),
    )
    backend = get_backend(xp, spec.backend)
    chunk_size = spec.chunk_size if spec.method == "chunk" else None
    return _call(problem, options, backend, chunk_size, check=bool(spec.check_finite))


def _call(p: Problem, options: Options, backend: Any, chunk_size: int | None, *, check: bool) -> Call:
    """The one constructor of a :class:`Call`: the problem, its options, the core (the chunked
    form, or the step recurrence for ``chunk_size=None``) and whether to check finiteness."""
    if chunk_size is None:
        core: Core = RecurrentCore(ops=backend, scale=p.scale)
    else:
        core = ChunkCore(ops=backend, scale=p.scale, chunk_size=chunk_size)
    return Call(problem=p, options=options, core=core, check=check)


@dataclass(frozen=True)
class Call:
    """One validated call: its ``problem`` (sizes, dtypes, namespace, layout, scale, offsets), its
    validated ``options``, its core and whether to check finiteness."""

    problem: Problem
    options: Options
    core: Core
    check: bool

    # --- calls derived from this one (validated already: composition checks nothing again)

    def packed(self, offsets: tuple[int, ...]) -> Call:
        """This call on one row of packed sequences at host ``offsets`` (``cu_seqlens``): ``B = 1``,
        ``T = offsets[-1]``; the arrays are this call's, reshaped by the caller to one row."""
        return replace(self, problem=replace(self.problem, B=1, T=offsets[-1], offsets=tuple(offsets)))

    def segment(self, a: int, b: int) -> Call:
        """This call on steps ``a:b`` of its (unpacked) sequences; the arrays sliced by the caller
        (:meth:`steps`)."""
        return replace(self, problem=replace(self.problem, T=b - a, offsets=None))

    def widened(self, V: int) -> Call:
        """This call with values ``V`` wide (a transition's ``[0, v]``: ``K + V``)."""
        return replace(self, problem=replace(self.problem, V=V))

    def steps(self, x: Inputs, a: int, b: int) -> Inputs:
        """Steps ``a:b`` of ``x``'s arrays with a time axis (in this call's layout); the rest as they are."""
        t = (
            (slice(None), slice(None), slice(a, b))
            if self.problem.layout == "head_first"
            else (slice(None), slice(a, b))
        )
        return x._replace(**{n: getattr(x, n)[t] for n in ("q", "k", "v", "g", "beta")})

    def plain(self, *, packed: bool = True) -> bool:
        """The one structural "plain call" test: the core's inputs are the raw inputs as given
        (no element-wise map of an option, ``HV == H``, the inputs' dtype the compute dtype), so
        results and buffers can be written straight into the caller's arrays. ``packed=False``:
        also no packed sequences."""
        p = self.problem
        return (
            self.options.is_identity
            and p.H == p.HV
            and p.dtype == p.compute_dtype
            and (packed or p.offsets is None)
        )

    # --- checks of the other arguments

    def check_inputs_finite(self, **arrays: Any) -> None:
        """Refuse NaN / infinite values in ``arrays`` and in the gate's ``A_log``, ``dt_bias``
        (``-inf`` allowed in a log gate), when asked to check."""
        self.check_finite(**arrays, **self.options.gate_params())

    def check_finite(self, **arrays: Any) -> None:
        """Refuse NaN / infinite values in ``arrays`` (None skipped), when asked to check.

        A log gate ``g`` is skipped: validation refused NaN and ``+inf`` in it already (every
        element ``<= 0``), and ``-inf`` is a legal reset.
        """
        if not self.check:
            return
        log_input = self.options.law.log_input
        for name, x in arrays.items():
            if not (name == "g" and log_input):
                _check_finite(self.problem.xp, name, x)

    def _check_before(self, arrays: dict | None, screen: Any) -> None:
        """Refuse NaN / inf in ``arrays`` now, but for those a fused pass screens (``screen``)."""
        if arrays is not None:
            unscreened = {
                n: x for n, x in arrays.items() if screen is None or n not in self.core.ops.FUSED_SCREENS
            }
            self.check_inputs_finite(**unscreened)

    def _gate_before(self, screen: Any) -> None:
        """Check ``g <= 0`` on the host now where validation left it to a fused pass that this
        call will not run with a screen (:class:`~kda._options.validation.ScreenedGate`)."""
        if screen is None and isinstance(self.problem.gate_flags, ScreenedGate):
            self.problem.gate_flags.raise_if_bad()

    def _screen_sums(self, screen: Any) -> tuple[float, float] | None:
        """A fused pass's ``screen`` summed over heads (None: not screened); a clean input column
        settles a gate check left to the pass (:meth:`_gate_before`)."""
        if screen is None:
            return None
        seen_in, seen_out = (float(x) for x in self.problem.xp.sum(screen, axis=0))
        if math.isfinite(seen_in) and isinstance(self.problem.gate_flags, ScreenedGate):
            self.problem.gate_flags.settle()
        return seen_in, seen_out

    def _results_finite(self, arrays: dict | None, sums: tuple[float, float] | None) -> bool:
        """Read a fused pass's screen sums: raise for a non-finite screened input (the message
        from the array itself); return whether the results were finite (False: not screened)."""
        if sums is None:
            return False
        seen_in, seen_out = sums
        if not math.isfinite(seen_in):
            screened = self.core.ops.FUSED_SCREENS
            self.check_finite(**{n: x for n, x in arrays.items() if n in screened})  # raises, naming it
        return math.isfinite(seen_out)

    def _screen(self, q: Any) -> Any:
        """A zeroed float64 ``[B * HV, 2]`` screen for the core's fused pass (head-first ``q``), or
        None where the call does not check or the core does not screen (packed sequences too)."""
        if not self.check or self.problem.offsets is not None or not self.core.screens(q):
            return None
        return self.problem.xp.zeros((q.shape[0] * q.shape[1], 2), dtype=self.problem.xp.float64)

    def state_or_zeros(self, name: str, state: Any) -> Any:
        """A checked ``[N, HV, K, V]`` state, or zeros for None."""
        state = check_state(name, state, self.problem)
        return self.zero_state() if state is None else state

    def zero_state(self) -> Any:
        """Zeros ``[N, HV, K, V]`` in the compute dtype."""
        p = self.problem
        return p.xp.zeros((p.N, p.HV, p.K, p.V), dtype=p.compute_dtype)

    def grad_output(self, grad_output: Any, check: bool = True) -> Any:
        """The output gradient (checked unless ``check=False``), head-first in the compute dtype."""
        p = self.problem
        if check:
            shape, letters = p.shape(p.HV, p.V), p.letters("HV", "V")
            check_array("grad_output", grad_output, p, shape, letters, p.dtype, "the dtype of q")
        return head_first(p.xp, p.xp.astype(grad_output, p.compute_dtype, copy=False), p.layout)

    def boundaries_shape(self) -> tuple[int, ...]:
        p = self.problem
        return (p.num_chunks(self.core.chunk_size), p.B, p.HV, p.K, p.V)

    def check_boundaries(self, boundaries: Any) -> None:
        if boundaries is not None:
            why = STATE_DTYPE_RULE
            check_array(
                "boundaries",
                boundaries,
                self.problem,
                self.boundaries_shape(),
                "NT, B, HV, K, V",
                self.problem.compute_dtype,
                why,
            )

    # --- the computation

    def core_inputs(self, x: Inputs) -> CoreInputs:
        """The core's inputs from ``x.q .. x.beta``: head-first, in the compute dtype, with every
        option applied."""
        p, xp = self.problem, self.problem.xp
        arrays = [head_first(xp, xp.astype(a, p.compute_dtype, copy=False), p.layout) for a in x.steps]
        with floating_point_quiet(xp):
            return prepare_core_inputs(xp, *arrays, self.options, p.HV)

    def forward(
        self,
        inputs: Inputs,
        state: Any,
        keep: bool,
        *,
        out: KdaOutput | None = None,
        check_inputs: dict | None = None,
    ) -> KdaOutput:
        """The forward of the raw ``inputs`` (``q .. beta`` read) from ``state``.

        ``out``: a :class:`KdaOutput` of buffers (the output's dtype and layout; states in the
        compute dtype; ``boundaries`` may be None) that receive the results and are returned.
        ``check_inputs``: the raw arrays to refuse NaN / inf in, by name
        (:meth:`check_inputs_finite`). Where the core screens
        (:meth:`~kda._engine.core.ChunkCore.screens`), those the backend names in ``FUSED_SCREENS``
        and the results are read off its fused pass instead of passes of their own, and looked at
        again, for the message, only when it saw a non-finite value.
        """
        p, xp = self.problem, self.problem.xp
        core_in = self.core_inputs(inputs)
        screen = self._screen(core_in.q) if check_inputs is not None and out is None else None
        self._check_before(check_inputs, screen)
        self._gate_before(screen)
        direct = out is not None and p.dtype == p.compute_dtype
        bufs = None
        if direct:
            bufs = KdaOutput(
                output=head_first(xp, out.output, p.layout),
                final_state=out.final_state,
                boundaries=out.boundaries,
            )
        with floating_point_quiet(xp):
            if p.offsets is None:
                output, final, boundaries = self.core.forward(
                    core_in.q,
                    core_in.k,
                    core_in.v,
                    core_in.g,
                    core_in.beta,
                    state,
                    keep=keep,
                    out=bufs,
                    screen=screen,
                )
            else:
                output, final, boundaries = run_packed_forward(
                    self.core, xp, core_in, state, p.offsets, keep=keep, out=bufs
                )
        sums = self._screen_sums(screen)
        raise_for_gates(p)  # a deferred check, read once the work is queued
        if self.check and not self._results_finite(check_inputs, sums):
            warn_if_diverged(xp, output, final)
        output = xp.astype(head_first(xp, output, p.layout), p.dtype, copy=False)
        result = KdaOutput(output, final, boundaries)
        if out is None:
            return result if keep else result._replace(boundaries=None)
        if not direct:
            _copy_into(out, result)
        return out

    def backward(
        self,
        inputs: Inputs,
        state: Any,
        boundaries: Any,
        do: Any,
        dfinal: Any,
        *,
        out: KdaGradients | None = None,
        workspace: Any = None,
        check_inputs: dict | None = None,
    ) -> KdaGradients:
        """Gradients of the raw ``inputs`` (``q .. beta``, ``A_log`` and ``dt_bias`` read;
        ``initial_state`` is ``state``).

        ``do``: head-first output gradient in the compute dtype; ``dfinal``: the final state's
        gradient ``[N, HV, K, V]``. ``out``: a
        :class:`KdaGradients` of buffers (each its input's dtype and shape) that receive the
        gradients and are returned; ``workspace`` holds recomputed boundaries on the way.
        ``check_inputs``: as for :meth:`forward`.
        """
        p, xp, options = self.problem, self.problem.xp, self.options
        core_in = self.core_inputs(inputs)
        screen = self._screen(core_in.q) if check_inputs is not None and out is None else None
        self._check_before(check_inputs, screen)
        self._gate_before(screen)
        direct = out is not None and self.plain()
        bufs = None
        if direct:
            dq, dk, dv, dg, dbeta = (
                head_first(xp, x, p.layout) for x in (out.q, out.k, out.v, out.g, out.beta)
            )
            bufs = Gradients(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dinitial=out.initial_state)
        with floating_point_quiet(xp):
            if p.offsets is None:
                grads = self.core.backward(
                    core_in.q,
                    core_in.k,
                    core_in.v,
                    core_in.g,
                    core_in.beta,
                    state,
                    boundaries,
                    do,
                    dfinal,
                    out=bufs,
                    workspace=workspace,
                    screen=screen,
                )
            else:
                grads = run_packed_backward(
                    self.core, xp, core_in, state, boundaries, do, dfinal, p.offsets, out=bufs
                )
            dq, dk, dv, dlog, dbeta, dinitial = grads
            dg, dparams = gate_backward(xp, dlog, core_in, options)
            dq, dk = qk_backward(xp, dq, dk, core_in, options, p.H)
            dbeta = beta_backward(xp, dbeta, core_in, options)
        sums = self._screen_sums(screen)
        raise_for_gates(p)
        finite = self._results_finite(check_inputs, sums)  # of the core's gradients
        if self.check and not (options.is_identity and finite):
            warn_if_diverged(xp, dq, dk, dv, dg, dbeta, dinitial)
        grads = [xp.astype(head_first(xp, x, p.layout), p.dtype, copy=False) for x in (dq, dk, dv, dg, dbeta)]
        params = {
            name: None
            if dparams.get(name) is None
            else xp.astype(dparams[name], getattr(inputs, name).dtype, copy=False)
            for name in PARAMETER_NAMES
        }
        result = KdaGradients(*grads, dinitial, **params)
        if out is None:
            return result
        if not direct:
            _copy_into(out, result)
        return out

    def end_state(self, core_in: CoreInputs, start: Any) -> Any:
        """The state after the core inputs ``core_in`` from ``start`` (no outputs formed)."""
        with floating_point_quiet(self.problem.xp):
            return self.core.end_state(core_in.q, core_in.k, core_in.v, core_in.g, core_in.beta, start)

    def state_gradient(self, core_in: CoreInputs, do: Any) -> Any:
        """The start-state gradient when the end-state gradient is zero."""
        with floating_point_quiet(self.problem.xp):
            return self.core.state_gradient(core_in.q, core_in.k, core_in.v, core_in.g, core_in.beta, do)


def _copy_into(out: tuple, result: tuple) -> None:
    for buf, x in zip(out, result, strict=True):
        if buf is not None and x is not None:
            buf[...] = x
