"""flash-linear-attention 0.6 keywords, translated to kda's options (shared by kda.torch and kda.jax).

Nothing here imports an array library: the adapters pass shapes and flags, and get back the
keyword arguments of :func:`kda.chunk_kda` (except the arrays ``A_log``, ``dt_bias`` and
``cu_seqlens``, which each adapter converts itself).

Every keyword of fla's ``chunk_kda`` and ``fused_recurrent_kda`` is in one of three classes:

- honoured: ``scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
  use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log, dt_bias,
  cu_seqlens, chunk_size, state_v_first`` (and its deprecated spelling ``transpose_state_layout``);
- honoured by ``chunk_kda`` only: ``return_intermediate_states`` (the chunk-start states ``h``)
  and ``cp_context`` (context parallelism over ``torch.distributed``, :mod:`kda.torch` only);
- accepted with no effect on the result (they only choose among fla's GPU kernels or describe
  its memory use): ``safe_gate, disable_recompute, cu_seqlens_cpu, use_graph, max_num_seqs``.
  ``fused_recurrent_kda`` also accepts these and ``chunk_size`` (no effect on a recurrence), and
  ``return_intermediate_states=False`` / ``cp_context=None``, so that one keyword dict serves both
  ops as in fla's layers;
- refused with :class:`~kda.InvalidInputError`: every combination that fla itself refuses or
  silently ignores (``A_log`` or ``dt_bias`` without ``use_gate_in_kernel``, for example;
  ``return_intermediate_states=True`` or a ``cp_context`` given to ``fused_recurrent_kda``).

Any other keyword raises ``TypeError`` (fla ignores unknown keywords silently).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._errors import refuse
from .._options.arguments import check_lower_bound
from .._options.checks import warn_at_caller
from .._options.gates import PARAMETERS
from .._options.spec import CallSpec
from .._options.validation import check_chunk_size, check_scale

__all__ = [
    "KEYWORD_TABLE",
    "FlaCall",
    "OpOptions",
    "boundary_bound",
    "check_gate_sizes",
    "translate",
]

# keyword -> (class, what kda does with it); the README's table restates it
KEYWORD_TABLE: dict[str, tuple[str, str]] = {
    "scale": ("honoured", "query scale, default K ** -0.5"),
    "initial_state": ("honoured", "[N, HV, K, V] (or [N, HV, V, K] with state_v_first); differentiable"),
    "output_final_state": ("honoured", "final_state returned, else None"),
    "use_qk_l2norm_in_kernel": ("honoured", "qk_l2norm=True: x / sqrt(sum(x**2) + 1e-6)"),
    "use_gate_in_kernel": (
        "honoured",
        'gate="softplus" (needs A_log), or gate="lower_bound" when lower_bound is set',
    ),
    "use_beta_sigmoid_in_kernel": ("honoured", 'beta_activation="sigmoid"'),
    "allow_neg_eigval": ("honoured", 'beta_activation="sigmoid2" (only with the beta sigmoid, as fla)'),
    "lower_bound": (
        "honoured",
        "with use_gate_in_kernel: the lower-bound gate, must be < 0; without it refused unless "
        "safe_gate=True (then no effect: fla's bounded-gate kernel)",
    ),
    "A_log": (
        "honoured",
        "HV elements (any shape, e.g. fla's [1, 1, HV, 1]), with use_gate_in_kernel; differentiable, "
        "gradient in the shape given",
    ),
    "dt_bias": (
        "honoured",
        "HV * K elements (any shape), read as [HV, K], with use_gate_in_kernel; differentiable, "
        "gradient in the shape given",
    ),
    "cu_seqlens": ("honoured", "packed sequences, B == 1; states [N, HV, K, V]"),
    "gate": (
        "honoured (kda)",
        "with use_gate_in_kernel: the gate law by name (kda.chunk_kda's gate option, any law registered "
        "in kda._options.gates) instead of fla's choice from lower_bound; A_log, dt_bias, lower_bound "
        "as that law takes them",
    ),
    "chunk_size": ("honoured", "any positive int (fla: 32 or 64); changes rounding only"),
    "state_v_first": ("honoured", "states read and returned as [N, HV, V, K]"),
    "transpose_state_layout": ("honoured", "deprecated spelling of state_v_first (DeprecationWarning)"),
    "safe_gate": ("no effect", "fla kernel choice for bounded gates; fla's argument checks are kept"),
    "disable_recompute": ("no effect", "fla memory/speed choice; kda saves the chunk-start states"),
    "cu_seqlens_cpu": ("no effect", "a host copy of cu_seqlens for fla's scheduling"),
    "use_graph": ("no effect", "CUDA-graph capture of fla's kernels"),
    "max_num_seqs": ("no effect", "bound for use_graph"),
    "return_intermediate_states": (
        "honoured",
        "chunk_kda returns (o, final_state, h), h [B, NT, HV, K, V] the chunk-start states in k's "
        "dtype (packed chunk order with cu_seqlens); differentiable; fused_recurrent_kda: False only",
    ),
    "cp_context": (
        "honoured (kda.torch)",
        "context parallelism over torch.distributed (kda.torch.build_cp_context); with "
        "initial_state and output_final_state too; fused_recurrent_kda and kda.jax: None only",
    ),
    "ssm_state_indices": (
        "honoured (fused_recurrent_kda)",
        "decoding from a state pool (vLLM's call): initial_state is the pool [P, HV, K, V], updated in "
        "place (inplace_final_state=True); [N] one row per request, [N, T] a slot per step "
        "(kda.decode_kda); inference only",
    ),
    "num_accepted_tokens": (
        "honoured (fused_recurrent_kda)",
        "[N], with 2-D ssm_state_indices: request n starts from slot [n, num_accepted_tokens[n] - 1]",
    ),
    "inplace_final_state": (
        "honoured (fused_recurrent_kda)",
        "write the final states into initial_state (rows ssm_state_indices, or row n for request n); "
        "the final state returned is initial_state itself; inference only. The pool may be float32, "
        "float16 or bfloat16 (float64 for float64 inputs; computed in float32, rounded on store), "
        "and V-major [P, HV, V, K] with state_v_first (read and written in place)",
    ),
    "pad_slot_id": (
        "honoured (fused_recurrent_kda)",
        "with ssm_state_indices: the index marking padding besides -1 (default -1; vLLM's KDA layers "
        "pass 0): zero output, that row neither read nor written (kda.decode_kda)",
    ),
}
# fused_recurrent_kda's pool keywords (vLLM's): refused by chunk_kda
DECODE_KEYWORDS = ("ssm_state_indices", "num_accepted_tokens", "inplace_final_state", "pad_slot_id")

# fla 0.6's named parameters after ``q, k, v, g, beta``, in its order, with their defaults: the
# adapters' functions (kda.torch's and kda.jax's chunk_kda, fused_recurrent_kda) write them out,
# and tests/entry/test_signatures.py holds their signatures to these. Keywords fla reads from
# ``**kwargs`` are the rest of KEYWORD_TABLE.
CHUNK_PARAMS: tuple[tuple[str, Any], ...] = (
    ("scale", None),
    ("initial_state", None),
    ("output_final_state", False),
    ("use_qk_l2norm_in_kernel", False),
    ("use_gate_in_kernel", False),
    ("use_beta_sigmoid_in_kernel", False),
    ("allow_neg_eigval", False),
    ("safe_gate", False),
    ("lower_bound", None),
    ("disable_recompute", False),
    ("return_intermediate_states", False),
    ("state_v_first", False),
    ("cu_seqlens", None),
    ("cu_seqlens_cpu", None),
    ("cp_context", None),
    ("use_graph", False),
    ("max_num_seqs", None),
)
RECURRENT_PARAMS: tuple[tuple[str, Any], ...] = (
    ("A_log", None),
    ("dt_bias", None),
    ("scale", None),
    ("initial_state", None),
    ("output_final_state", False),
    ("use_qk_l2norm_in_kernel", False),
    ("use_gate_in_kernel", False),
    ("use_beta_sigmoid_in_kernel", False),
    ("allow_neg_eigval", False),
    ("lower_bound", None),
    ("state_v_first", False),
    ("cu_seqlens", None),
)
CHUNK_KEYWORDS = frozenset(KEYWORD_TABLE) - frozenset(DECODE_KEYWORDS)
# chunk_kda's keywords that do not change a recurrence (kernel choices, chunking), and the two
# whose defaults are accepted: one keyword dict serves both ops
RECURRENT_NO_EFFECT = (
    "safe_gate",
    "disable_recompute",
    "cu_seqlens_cpu",
    "use_graph",
    "max_num_seqs",
    "chunk_size",
    "return_intermediate_states",
    "cp_context",
)
RECURRENT_KEYWORDS = frozenset(
    {
        *(n for n, _ in RECURRENT_PARAMS),
        "transpose_state_layout",
        "gate",
        *RECURRENT_NO_EFFECT,
        *DECODE_KEYWORDS,
    }
)


class OpOptions(NamedTuple):
    """The options of an fla-style call that are not arrays, checked: the torch ops' non-tensor
    arguments, in this order (:mod:`kda._torch.ops` generates their schemas from these fields and
    their annotations; the schemas are public and pinned by ``tests/adapters/test_op_schemas.py``)
    and :mod:`kda.jax`'s ``custom_vjp`` static argument.

    The call's :class:`~kda._options.spec.CallSpec` is made from it, one way (:meth:`spec`): an
    adapter call is time-major, on the default backend, screened for non-finite values, with its
    scale resolved; ``beta_activation`` is ``""`` for none (an op argument of type ``str``)."""

    method: str  # "chunk" or "recurrent"
    scale: float
    chunk_size: int
    qk_l2norm: bool
    gate: str
    lower_bound: float | None
    beta_activation: str  # "" for none (an op argument cannot be None)

    @classmethod
    def of(cls, options: tuple[Any, ...]) -> OpOptions:
        """``options`` (an :class:`OpOptions`, or the plain tuple an op received) as an :class:`OpOptions`."""
        return options if type(options) is cls else cls._make(options)

    def spec(self) -> CallSpec:
        """The call's :class:`~kda._options.spec.CallSpec`."""
        return _spec(self)


@functools.lru_cache(maxsize=256)
def _spec(options: OpOptions) -> CallSpec:
    return CallSpec(
        method=options.method,
        scale=options.scale,
        chunk_size=options.chunk_size,
        layout="time_major",
        qk_l2norm=options.qk_l2norm,
        gate=options.gate,
        lower_bound=options.lower_bound,
        beta_activation=options.beta_activation or None,
    )


@dataclass(frozen=True)
class FlaCall:
    """One fla-style call, translated.

    ``static`` holds the options that are not arrays (a :class:`OpOptions`; :func:`choices` reads
    them); ``dt_bias_shape`` is
    ``(HV, K)``; ``state_v_first``, ``output_final_state`` and ``intermediate_states``
    (``return_intermediate_states``) are applied by the adapter.
    """

    static: OpOptions
    output_final_state: bool
    state_v_first: bool
    dt_bias_shape: tuple[int, int]
    intermediate_states: bool = False


def boundary_bound(T: Any, chunk_size: int, num_seqs: int | None) -> Any:
    """Chunk-start states an adapter keeps: ``ceil(T / C)``, or with ``num_seqs`` packed sequences
    a bound that does not depend on the offsets' values (shapes must not):
    ``sum(ceil(len_i / C)) <= (T + N (C - 1)) // C``."""
    if num_seqs is None:
        return -(-T // chunk_size)
    return (T + num_seqs * (chunk_size - 1)) // chunk_size


def check_keywords(function: str, kwargs: dict[str, Any], allowed: frozenset[str]) -> None:
    """``TypeError`` for a keyword that fla's ``function`` does not define."""
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        msg = (
            f"{function}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"fla 0.6's {function} takes {', '.join(sorted(allowed))}"
        )
        raise TypeError(msg)


def state_layout(kw: dict[str, Any]) -> bool:
    """``state_v_first``, honouring fla's deprecated ``transpose_state_layout`` spelling."""
    v_first = bool(kw.get("state_v_first", False))
    if "transpose_state_layout" in kw:
        if v_first:
            refuse("pass state_v_first or the deprecated transpose_state_layout, not both")
        warn_at_caller(
            "`transpose_state_layout` is deprecated and renamed to `state_v_first` (as in fla 0.6).",
            DeprecationWarning,
        )
        v_first = bool(kw["transpose_state_layout"])
    return v_first


def _check_unsupported(function: str, kw: dict[str, Any]) -> None:
    if function == "chunk_kda":
        return
    if kw.get("return_intermediate_states", False):
        refuse(
            "return_intermediate_states=True is refused by fused_recurrent_kda (a recurrence has no "
            "chunks; fla ignores it silently); use chunk_kda(..., return_intermediate_states=True)"
        )
    if kw.get("cp_context") is not None:
        refuse(
            "cp_context is refused by fused_recurrent_kda (fla ignores it silently); use "
            "chunk_kda(..., cp_context=ctx)"
        )


def _gate(kw: dict[str, Any], has_A_log: bool, has_dt_bias: bool) -> dict[str, Any]:
    """``gate``, ``lower_bound`` options from fla's gate keywords (fla's refusals kept)."""
    lower_bound = kw.get("lower_bound")
    if lower_bound is not None:
        lower_bound = check_lower_bound(lower_bound, " or None")
    safe_gate = bool(kw.get("safe_gate", False))
    law = kw.get("gate")
    if law is not None:  # kda's own keyword: a gate law by name (validated with the call's options)
        if not kw.get("use_gate_in_kernel", False):
            refuse(f"gate={law!r} needs use_gate_in_kernel=True (the gate law is applied in the kernel)")
        return {"gate": law} if lower_bound is None else {"gate": law, "lower_bound": float(lower_bound)}
    if not kw.get("use_gate_in_kernel", False):
        given = [n for n, has in (("A_log", has_A_log), ("dt_bias", has_dt_bias)) if has]
        if given:
            refuse(
                f"{' and '.join(given)} given without use_gate_in_kernel=True: the gate is applied "
                "only in the kernel, and fla would ignore them silently; pass use_gate_in_kernel=True "
                "or drop them"
            )
        if lower_bound is not None and not safe_gate:
            refuse(
                f"lower_bound={lower_bound} given without use_gate_in_kernel=True (or safe_gate=True): "
                "fla would ignore it; g is taken as the final log decay"
            )
        return {"gate": "log"}
    if lower_bound is None:
        if safe_gate:
            refuse("lower_bound must be set when safe_gate=True and use_gate_in_kernel=True (as in fla)")
        if not has_A_log:
            refuse("A_log must be given when use_gate_in_kernel=True and lower_bound is not set (as in fla)")
        return {"gate": "softplus"}
    if safe_gate and not -5 <= lower_bound < 0:
        refuse(f"lower_bound must be in fla's safe range [-5, 0) with safe_gate=True; got {lower_bound}")
    return {"gate": "lower_bound", "lower_bound": float(lower_bound)}


def _beta(kw: dict[str, Any]) -> str:
    sigmoid = bool(kw.get("use_beta_sigmoid_in_kernel", False))
    if kw.get("allow_neg_eigval", False):
        if not sigmoid:
            refuse("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as in fla)")
        return "sigmoid2"
    return "sigmoid" if sigmoid else ""  # "": none (OpOptions.beta_activation)


def _check_shapes(q: tuple[int, ...], v: tuple[int, ...], cu_seqlens: bool) -> tuple[int, int]:
    """``(HV, K)`` from time-major ``q [B, T, H, K]`` and ``v [B, T, HV, V]``."""
    if len(q) != 4 or len(v) != 4:
        refuse(f"q and v must be time-major [B, T, H, K] and [B, T, HV, V]; got {q} and {v}")
    if cu_seqlens and q[0] != 1:
        refuse(f"the batch size must be 1 with cu_seqlens (flatten the sequences); got q of shape {q}")
    return v[2], q[3]


# the keywords translate reads by value (the arrays are read by presence only), and the plain
# types a memo key may hold: a key of these compares by value and type, never by an array's ==
TRANSLATED = (
    "scale",
    "chunk_size",
    "output_final_state",
    "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel",
    "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval",
    "safe_gate",
    "lower_bound",
    "state_v_first",
    "return_intermediate_states",
    "gate",
)


class _Absent:
    """A keyword not passed (a memo key tells it from one passed as None)."""


_ABSENT = _Absent()
_ABSENTS = (_ABSENT,) * len(TRANSLATED)
_PLAIN_TYPES = frozenset({type(None), bool, int, float, str, _Absent})
_MEMO: dict[tuple[Any, ...], FlaCall] = {}  # translate's results of calls seen before
MEMO_SIZE = 256  # entries kept (cleared when full: a serving loop repeats a few shapes)


def _memo_key(
    function: str, q_shape: tuple[int, ...], v_shape: tuple[int, ...], kw: dict[str, Any], flags: tuple
) -> tuple[Any, ...] | None:
    """The memo key of a call: everything :func:`translate` reads, or None where a value is not
    a plain scalar (an array, a NumPy scalar) or the call warns (``transpose_state_layout``).
    Each value enters with its type (``1`` and ``True`` are equal keys otherwise)."""
    if "transpose_state_layout" in kw or kw.get("cp_context") is not None:
        return None
    values = tuple(map(kw.get, TRANSLATED, _ABSENTS))
    kinds = tuple(map(type, values))
    if not _PLAIN_TYPES.issuperset(kinds):
        return None
    if float in kinds:  # -0.0 == 0.0, but they are different scales: floats by their bits
        values = tuple(x.hex() if type(x) is float else x for x in values)
    return (function, q_shape, v_shape, flags, values, kinds)


def translate(
    function: str,
    q_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    kw: dict[str, Any],
    *,
    has_A_log: bool,
    has_dt_bias: bool,
    has_cu_seqlens: bool,
) -> FlaCall:
    """Translate fla keywords ``kw`` (already restricted to the known ones) into kda options.

    A call whose keywords are plain scalars is translated once: later calls with the same shapes,
    presence flags and keyword values (and types: ``scale=1`` and ``scale=True`` differ) get the
    same :class:`FlaCall` from a memo. Refusals are never memoised, so they are raised every time.
    """
    q_shape, v_shape = tuple(q_shape), tuple(v_shape)
    key = _memo_key(function, q_shape, v_shape, kw, (has_A_log, has_dt_bias, has_cu_seqlens))
    if key is not None:
        call = _MEMO.get(key)
        if call is not None:
            return call
    call = _translate(function, q_shape, v_shape, kw, has_A_log, has_dt_bias, has_cu_seqlens)
    if key is not None:
        if len(_MEMO) >= MEMO_SIZE:
            _MEMO.clear()
        _MEMO[key] = call
    return call


def _translate(
    function: str,
    q_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    kw: dict[str, Any],
    has_A_log: bool,
    has_dt_bias: bool,
    has_cu_seqlens: bool,
) -> FlaCall:
    _check_unsupported(function, kw)
    HV, K = _check_shapes(q_shape, v_shape, has_cu_seqlens)
    gate = _gate(kw, has_A_log, has_dt_bias)
    static = OpOptions(
        method="chunk" if function == "chunk_kda" else "recurrent",
        scale=check_scale(kw.get("scale"), K),
        chunk_size=check_chunk_size(kw.get("chunk_size", 64)),
        qk_l2norm=bool(kw.get("use_qk_l2norm_in_kernel", False)),
        gate=gate["gate"],
        lower_bound=gate.get("lower_bound"),
        beta_activation=_beta(kw),
    )
    return FlaCall(
        static=static,
        output_final_state=bool(kw.get("output_final_state", False)),
        state_v_first=state_layout(kw),
        dt_bias_shape=(HV, K),
        intermediate_states=bool(kw.get("return_intermediate_states", False)),
    )


def check_gate_sizes(A_log: Any, dt_bias: Any, call: FlaCall) -> None:
    """fla reads the gate parameters by element count: ``A_log`` ``HV`` and ``dt_bias`` ``HV * K``
    elements of any shape (fla's tests pass ``A_log`` as ``[1, 1, HV, 1]``; each parameter's
    count is that of its shape in :data:`~kda._options.gates.PARAMETERS`).
    :class:`~kda.InvalidInputError` naming the argument otherwise. Each: anything with a
    ``shape``, or None."""
    HV, K = call.dt_bias_shape
    sizes = {"HV": HV, "K": K}
    for param, x in zip(PARAMETERS, (A_log, dt_bias), strict=True):
        if x is None:
            continue
        want = math.prod(param.shape(HV, K))
        n = math.prod(x.shape)
        if n != want:
            what = " * ".join(param.dims)
            if len(param.dims) > 1:
                what += " = " + " * ".join(str(sizes[d]) for d in param.dims)
            got = tuple(x.shape)
            refuse(f"{param.name} must have {what} = {want} elements (any shape, as fla); got shape {got}")
