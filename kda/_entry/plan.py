"""Prepared plans: validate and allocate once, then run many times on refilled inputs.

``plan = prepare_chunk_kda(q, k, v, g, beta, ...)`` binds the arrays, checks them once and
allocates the outputs and the workspace. ``plan.run()`` computes from the *current contents* of
the bound arrays into ``plan.out`` and returns it; the caller refills the bound arrays in place
between runs (as the seed's ``SequenceKernelPlan``).

What ``run()`` costs beyond the computation:

- no validation of shapes, dtypes or options (done once at prepare time);
- the gate is re-checked with one reduction, ``max(g) <= 0`` (NaN fails it too), for
  ``gate="log"`` on host arrays: a refilled positive gate would silently overflow ``exp`` and a
  reduction reads ``g`` once without allocating (under 1% of a run at B=1, H=4, T=4096,
  K=V=64). On CuPy the check is skipped: it needs a host synchronisation, which would stall the
  stream and cannot be captured in a CUDA graph. Other values (NaN or infinite q, k, v, beta)
  are not re-checked on any backend.
- On NumPy (and other host namespaces), the plain forward and backward (``gate="log"``, no
  ``qk_l2norm``, no beta activation, ``HV == H``, no ``cu_seqlens``, float32 or float64 inputs)
  write straight into the plan's buffers: ``run()`` allocates only one slab's work, nothing that
  grows with ``T``. With element-wise options or float16/bfloat16 inputs, the options' maps and
  casts allocate arrays of the inputs' size on every run.
- On CuPy, the first ``run()`` computes eagerly (compiling kernels) and then captures the same
  work as a CUDA graph, which every later ``run()`` replays on the current stream: one launch
  from Python per run. The capture allocates from a memory pool private to the plan, so its
  temporaries keep their addresses for the replays. Under Numba's CUDA simulator (NumPy arrays,
  ``backend="cuda"``) there are no graphs and the plan runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import array_api_compat

from .._errors import InvalidInputError, InvalidTypeError
from .._options.gates import PARAMETER_NAMES, PARAMETERS
from .._options.maps import Options, head_first
from .._options.table import Array, Choices
from .._options.validation import STATE_DTYPE_RULE, Problem, c_contiguous, check_array, recheck_gate
from .call import Call, Inputs, KdaGradients, KdaOutput, open_call

__all__ = ["BackwardPlan", "ForwardPlan", "prepare_chunk_kda", "prepare_chunk_kda_backward"]


def _check_bindings(bindings: dict[str, Any]) -> None:
    """Every bound array must be C-contiguous (the seed's rule)."""
    for name, x in bindings.items():
        if x is not None and not c_contiguous(x):
            msg = (
                f"prepared KDA requires C-contiguous bindings: {name} (shape {tuple(x.shape)}) is not; "
                "bind a contiguous copy and refill that"
            )
            raise InvalidInputError(msg)


def _check_writable(name: str, x: Any) -> None:
    if not array_api_compat.is_writeable_array(x):
        msg = (
            f"prepared KDA writes its results in place: {name} must be a writable array; got a "
            f"read-only or immutable {type(x).__module__}.{type(x).__name__}"
        )
        raise InvalidInputError(msg)


@dataclass(frozen=True)
class _Buffers:
    """Makes or checks the out buffers of one plan."""

    p: Problem
    device: Any

    def get(self, name: str, given: Any, shape: tuple[int, ...], letters: str, dtype: Any, why: str) -> Any:
        """The caller's buffer ``out.<name>``, checked; or a new zeroed one."""
        if given is None:
            return self.p.xp.zeros(shape, dtype=dtype, device=self.device)
        check_array(f"out.{name}", given, self.p, shape, letters, dtype, why)
        _check_writable(f"out.{name}", given)
        return given

    def state(self, name: str, given: Any, shape: tuple[int, ...], letters: str) -> Any:
        return self.get(name, given, shape, letters, self.p.compute_dtype, STATE_DTYPE_RULE)


@dataclass
class _Runner:
    """What both plans share: the call (the core with its options), the bound arrays and the
    CUDA graph. Runs go through the same :class:`~kda._entry.call.Call` methods as the plain
    functions, so their results are bitwise those of the plain calls."""

    call: Call
    inputs: Inputs  # raw q, k, v, g, beta (and A_log, dt_bias for the backward)
    state: Any
    graph: Any = None
    graph_resources: tuple = field(default_factory=tuple)

    @property
    def xp(self) -> Any:
        return self.call.problem.xp

    def recheck_gate(self) -> None:
        """``max(g) <= 0`` on host arrays with a log gate (see the module notes)."""
        recheck_gate(self.call.options, self.xp, self.inputs.g)

    def run(self, compute) -> None:
        """``compute()`` eagerly, or by replaying its CUDA graph (captured after the first run)."""
        if self.graph is not None:
            self.graph.launch()
            return
        self.recheck_gate()
        compute()
        if array_api_compat.is_cupy_namespace(self.xp):
            self.graph, self.graph_resources = _capture(compute)


def _capture(compute) -> tuple[Any, tuple]:
    """Capture ``compute()`` as a CUDA graph on a private stream and memory pool.

    The pool serves only this capture: the temporaries it hands out are cached by it after the
    capture and never given to anyone else, so the graph's kernels find them at every replay.
    """
    import cupy

    pool = cupy.cuda.MemoryPool()
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.get_current_stream().synchronize()
    with cupy.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        try:
            compute()
        finally:
            graph = stream.end_capture()
    return graph, (pool, stream)


class ForwardPlan:
    """A prepared :func:`kda.chunk_kda`; see :func:`prepare_chunk_kda`.

    Attributes
    ----------
    out : KdaOutput
        The buffers that every :meth:`run` fills (``boundaries`` is None unless saved or given).
    """

    def __init__(self, runner: _Runner, out: KdaOutput) -> None:
        self._r = runner
        self.out = out

    def run(self) -> KdaOutput:
        """Compute from the bound arrays' current contents into :attr:`out`; return it."""
        self._r.run(self._compute)
        return self.out

    def _compute(self) -> None:
        r = self._r
        r.call.forward(r.inputs, r.state, self.out.boundaries is not None, out=self.out)


class BackwardPlan:
    """A prepared :func:`kda.chunk_kda_backward`; see :func:`prepare_chunk_kda_backward`.

    Attributes
    ----------
    out : KdaGradients
        The buffers that every :meth:`run` fills.
    """

    def __init__(self, runner: _Runner, out: KdaGradients, bound: tuple, workspace: Any) -> None:
        self._r = runner
        self._bound = bound  # boundaries, grad_output, grad_final_state (or zeros)
        self._workspace = workspace  # recomputed boundaries when none are bound
        self.out = out

    def run(self) -> KdaGradients:
        """Compute from the bound arrays' current contents into :attr:`out`; return it."""
        self._r.run(self._compute)
        return self.out

    def _compute(self) -> None:
        r, p = self._r, self._r.call.problem
        boundaries, do, dfinal = self._bound
        do = head_first(r.xp, r.xp.astype(do, p.compute_dtype, copy=False), p.layout)
        r.call.backward(r.inputs, r.state, boundaries, do, dfinal, out=self.out, workspace=self._workspace)


def _prepare(q, k, v, g, beta, scale, chunk_size, backend, initial_state, opts: Choices) -> tuple[Call, Any]:
    """Validation shared by both plans: ``(call, initial state)``; the call checks nothing at runs."""
    call = open_call(q, k, v, g, beta, scale, opts, backend=backend, chunk_size=chunk_size)
    if not array_api_compat.is_writeable_array(q):
        msg = f"prepared KDA needs arrays that can be written in place; {type(q).__module__} arrays cannot"
        raise InvalidInputError(msg)
    state = call.state_or_zeros("initial_state", initial_state)
    call.check_inputs_finite(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    # refuses pair matrices that cannot fit
    call.core.route(head_first(call.problem.xp, q, call.problem.layout))
    return replace(call, check=False), state


def prepare_chunk_kda(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    *,
    initial_state: Array | None = None,
    out: KdaOutput | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    save_boundaries: bool = False,
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
) -> ForwardPlan:
    """Prepare :func:`kda.chunk_kda` on bound arrays, to run many times.

    The arguments are those of :func:`kda.chunk_kda` (validated here, once, with the same
    errors), plus ``out``. Every bound array (``q, k, v, g, beta, initial_state`` and the
    buffers of ``out``) must be C-contiguous and stay in place: :meth:`ForwardPlan.run` reads
    their current contents. ``check_finite`` applies to the values at prepare time.

    Parameters
    ----------
    out : KdaOutput, optional
        Caller-owned buffers to adopt: ``output`` (shape and dtype of the output),
        ``final_state`` (``[B, HV, K, V]``, ``[N, HV, K, V]`` with ``cu_seqlens``) and
        ``boundaries`` (``[NT, B, HV, K, V]``, required with ``save_boundaries=True``, filled
        whenever given); states float32 (float64 for float64 inputs). None: the plan allocates.
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
    ForwardPlan
        ``plan.run()`` returns ``plan.out``, a :class:`~kda.KdaOutput` of the plan's buffers.

    Raises
    ------
    InvalidInputError
        As :func:`kda.chunk_kda`; also a binding that is not C-contiguous, an ``out`` buffer of
        the wrong shape or that cannot be written in place, an immutable namespace (JAX).
    InvalidTypeError
        As :func:`kda.chunk_kda`; also an ``out`` buffer of the wrong dtype.

    Notes
    -----
    ``run()`` does not repeat the validation. With ``gate="log"`` on host arrays it re-checks
    the refilled gate with one reduction, ``max(g) <= 0`` (a positive or NaN gate raises
    :class:`~kda.InvalidInputError`), because a positive log decay silently overflows ``exp``;
    the reduction reads ``g`` once and allocates nothing. On CuPy that check would need a host
    synchronisation in every run (and cannot be captured in a CUDA graph), so refilled values
    are not re-validated there; nor are NaN or infinite ``q, k, v, beta`` on any backend.
    On NumPy, plain problems (log gate, no ``qk_l2norm``, no beta activation, ``HV == H``, no
    ``cu_seqlens``, float32 or float64) run straight into the plan's buffers and allocate only
    one slab's work per run, nothing that grows with ``T``. On CuPy the first run also captures
    a CUDA graph that later runs replay.
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
    call, state = _prepare(q, k, v, g, beta, scale, chunk_size, backend, initial_state, choices)
    p = call.problem
    out = KdaOutput(None, None, None) if out is None else out
    if not isinstance(out, KdaOutput):
        msg = f"out must be a kda.KdaOutput of buffers or None; got {type(out).__name__}"
        raise InvalidTypeError(msg)
    if save_boundaries and out.output is not None and out.boundaries is None:
        msg = "out.boundaries must be a [NT, B, HV, K, V] buffer with save_boundaries=True; got None"
        raise InvalidInputError(msg)
    make = _Buffers(p, array_api_compat.device(q))
    rows = "B" if p.offsets is None else "N"
    output = make.get(
        "output", out.output, p.shape(p.HV, p.V), p.letters("HV", "V"), p.dtype, "the dtype of q"
    )
    final = make.state("final_state", out.final_state, (p.N, p.HV, p.K, p.V), f"{rows}, HV, K, V")
    boundaries = None
    if save_boundaries or out.boundaries is not None:
        boundaries = make.state("boundaries", out.boundaries, call.boundaries_shape(), "NT, B, HV, K, V")
    bound = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state}
    _check_bindings({**bound, "out.output": output, "out.final_state": final, "out.boundaries": boundaries})
    runner = _Runner(call=call, inputs=Inputs(q, k, v, g, beta), state=state)
    return ForwardPlan(runner, KdaOutput(output, final, boundaries))


def prepare_chunk_kda_backward(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    boundaries: Array,
    grad_output: Array,
    grad_final_state: Array | None = None,
    *,
    out: KdaGradients | None = None,
    scale: float | None = None,
    initial_state: Array | None = None,
    chunk_size: int = 64,
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
) -> BackwardPlan:
    """Prepare :func:`kda.chunk_kda_backward` on bound arrays, to run many times.

    The arguments are those of :func:`kda.chunk_kda_backward`, plus ``out``; as for
    :func:`prepare_chunk_kda`, every binding must be C-contiguous and is read at each run.
    ``boundaries=None`` recomputes the chunk-start states at every run, into a workspace
    allocated once here.

    Parameters
    ----------
    out : KdaGradients, optional
        Caller-owned gradient buffers, each with its input's shape and dtype (``initial_state``:
        ``[B, HV, K, V]`` in the states' dtype; ``A_log`` and ``dt_bias`` only where the gate
        uses them, else None). None: the plan allocates.
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
    BackwardPlan
        ``plan.run()`` returns ``plan.out``, a :class:`~kda.KdaGradients` of the plan's buffers.
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
    call, state = _prepare(q, k, v, g, beta, scale, chunk_size, backend, initial_state, choices)
    p, o = call.problem, call.options
    call.check_boundaries(boundaries)
    check_array(
        "grad_output", grad_output, p, p.shape(p.HV, p.V), p.letters("HV", "V"), p.dtype, "the dtype of q"
    )
    dfinal = call.state_or_zeros("grad_final_state", grad_final_state)
    finite = {"boundaries": boundaries, "grad_output": grad_output, "grad_final_state": grad_final_state}
    replace(call, check=choices.check_finite).check_inputs_finite(**finite)
    make = _Buffers(p, array_api_compat.device(q))
    like = Inputs.of(q, k, v, g, beta, choices, initial_state=state)
    grads = _gradient_buffers(p, o, make, out, like)
    bound = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state, **finite}
    _check_bindings({**bound, **{f"out.{n}": x for n, x in zip(KdaGradients._fields, grads)}})
    workspace = None
    if boundaries is None and call.plain(packed=False):  # recomputed boundaries, written in place
        workspace = make.state("boundaries workspace", None, call.boundaries_shape(), "NT, B, HV, K, V")
    runner = _Runner(call=call, inputs=Inputs.of(q, k, v, g, beta, choices), state=state)
    return BackwardPlan(runner, grads, (boundaries, grad_output, dfinal), workspace)


def _gradient_letters(p: Problem) -> dict[str, str]:
    return {
        "q": p.letters("H", "K"),
        "k": p.letters("H", "K"),
        "v": p.letters("HV", "V"),
        "g": p.letters("HV", "K"),
        "beta": p.letters("HV"),
        "initial_state": ("B" if p.offsets is None else "N") + ", HV, K, V",
        **{param.name: param.letters for param in PARAMETERS},
    }


def _gradient_buffers(p: Problem, o: Options, make: _Buffers, out: Any, like: tuple) -> KdaGradients:
    """The caller's gradient buffers, checked against the arrays they are gradients of; or new ones."""
    if out is not None and not isinstance(out, KdaGradients):
        msg = f"out must be a kda.KdaGradients of buffers or None; got {type(out).__name__}"
        raise InvalidTypeError(msg)
    given = KdaGradients(*(None,) * 8) if out is None else out
    letters = _gradient_letters(p)
    taken = {param.name for param in o.law.params}  # the gate law's parameters have gradients
    bufs = []
    for name, buf, x in zip(KdaGradients._fields, given, like, strict=True):
        if x is None or (name in PARAMETER_NAMES and name not in taken):
            bufs.append(None)
            continue
        if name == "initial_state":
            bufs.append(make.state(name, buf, tuple(x.shape), letters[name]))
        else:
            bufs.append(make.get(name, buf, tuple(x.shape), letters[name], x.dtype, f"the dtype of {name}"))
    return KdaGradients(*bufs)
