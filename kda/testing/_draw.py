"""The hypothesis strategy of :class:`~kda.testing.Problem` (:func:`problems`): its arguments
checked and normalised into a space, and the draw of one problem from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .._dtypes import dtype_name
from .._errors import InvalidInputError, InvalidTypeError
from .._options.table import BETA_ACTIVATIONS, GATES, LAYOUTS
from ._problems import DTYPES, REGIMES, Problem

__all__ = ["problems"]


def _range(name: str, value: Any, low: int = 1) -> tuple[int, int]:
    """An int or an inclusive ``(min, max)`` pair."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if (
        not isinstance(value, tuple | list)
        or len(value) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in value)
        or not low <= value[0] <= value[1]
    ):
        raise InvalidInputError(f"{name} must be an int >= {low} or a (min, max) pair of them; got {value!r}")
    return int(value[0]), int(value[1])


def _choices(name: str, value: Any, allowed: Sequence[Any]) -> tuple[Any, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        value = (value,)
    value = tuple(value)
    bad = [x for x in value if x not in allowed]
    if not value or bad:
        raise InvalidInputError(f"{name} must be a non-empty choice from {tuple(allowed)}; got {value!r}")
    return value


def _checked_dtype(d: Any) -> str:
    """The name of the dtype ``d``, one of :data:`DTYPES` (``kda.KdaError`` if not)."""
    name = dtype_name(d)
    if name not in DTYPES:
        raise InvalidTypeError(f"dtypes must name float64, float32, float16 or bfloat16; got {d!r}")
    return name


def problems(
    *,
    dtypes: Sequence[Any] = DTYPES,
    K: int | tuple[int, int] = (1, 16),
    V: int | tuple[int, int] = (1, 12),
    T: int | tuple[int, int] = (1, 80),
    T_multiple_of: int = 1,
    heads: int | tuple[int, int] = (1, 2),
    groups: Sequence[int] = (1, 2, 3),
    batch: int | tuple[int, int] = (1, 2),
    packed: Sequence[bool] = (False, True),
    max_sequences: int = 5,
    layouts: Sequence[str] = LAYOUTS,
    initial_state: Sequence[bool] = (False, True),
    gates: Sequence[str] = GATES,
    lower_bound: tuple[float, float] = (-10.0, -0.1),
    regimes: Sequence[str] = REGIMES,
    qk_l2norm: Sequence[bool] = (False, True),
    beta_activations: Sequence[str | None] = BETA_ACTIVATIONS,
    scale: Sequence[str] = ("default", "drawn"),
    chunk_sizes: Sequence[int | None] = (None, 1, 3, 8, 16, 64),
) -> Any:
    """A hypothesis strategy of :class:`Problem`; every argument narrows what is drawn.

    The defaults cover everything kda supports. A kernel that lacks a feature is tested by
    narrowing: ``problems(groups=(1,), packed=(False,))`` for one without grouped value heads
    or packed sequences.

    Parameters
    ----------
    dtypes : sequence of {"float64", "float32", "float16", "bfloat16"} (or NumPy / torch dtypes)
    K, V, T : int or (min, max)
        Key size, value size, steps (total steps of the packed row with ``packed``).
    T_multiple_of : int
        Every ``T`` (and every packed sequence's length) is a multiple of this.
    heads : int or (min, max)
        q/k heads ``H``.
    groups : sequence of int
        Value heads per q/k head ``G`` (``HV = G * H``); ``(1,)`` for no GVA.
    batch : int or (min, max)
        ``B`` (1 with packed sequences).
    packed : sequence of bool
        Whether ``cu_seqlens`` packs several sequences (empty and length-1 ones included).
    max_sequences : int
        Most packed sequences.
    layouts : sequence of {"head_first", "time_major"}
    initial_state : sequence of bool
    gates : sequence of {"log", "softplus", "lower_bound"}
    lower_bound : (min, max) floats < 0
        Range of ``lower_bound`` for the lower-bound gate.
    regimes : sequence of :data:`REGIMES`
    qk_l2norm : sequence of bool
    beta_activations : sequence of {None, "sigmoid", "sigmoid2"}
    scale : sequence of {"default", "drawn"}
        ``"default"``: not passed; ``"drawn"``: a scale in ``[0.05, 2]``.
    chunk_sizes : sequence of int or None
        None: not passed.

    Returns
    -------
    hypothesis.strategies.SearchStrategy[Problem]
    """
    space = _space(
        dtypes,
        K,
        V,
        T,
        T_multiple_of,
        heads,
        groups,
        batch,
        packed,
        max_sequences,
        layouts,
        initial_state,
        gates,
        lower_bound,
        regimes,
        qk_l2norm,
        beta_activations,
        scale,
        chunk_sizes,
    )
    return _strategy(space)


class _Space(NamedTuple):
    """The checked choices of :func:`problems` that a draw samples from."""

    dt: tuple[str, ...]
    Kr: tuple[int, int]
    Vr: tuple[int, int]
    Hr: tuple[int, int]
    Br: tuple[int, int]
    m: int
    t_lo: int
    t_hi: int
    Gs: tuple
    packs: tuple
    lays: tuple
    states: tuple
    gts: tuple
    regs: tuple
    norms: tuple
    betas: tuple
    scales: tuple
    chunks: tuple
    lower_bound: tuple[float, float]
    max_sequences: int


def _space(
    dtypes: Any,
    K: Any,
    V: Any,
    T: Any,
    T_multiple_of: Any,
    heads: Any,
    groups: Any,
    batch: Any,
    packed: Any,
    max_sequences: Any,
    layouts: Any,
    initial_state: Any,
    gates: Any,
    lower_bound: Any,
    regimes: Any,
    qk_l2norm: Any,
    beta_activations: Any,
    scale: Any,
    chunk_sizes: Any,
) -> _Space:
    """:func:`problems`' arguments checked (``kda.KdaError`` naming the bad one) and normalised."""
    dt = tuple(
        _checked_dtype(d)
        for d in (dtypes if isinstance(dtypes, Sequence) and not isinstance(dtypes, str) else (dtypes,))
    )
    if not dt:
        raise InvalidInputError("dtypes must not be empty")
    Kr, Vr, Hr, Br = _range("K", K), _range("V", V), _range("heads", heads), _range("batch", batch)
    Tr = _range("T", T)
    if not isinstance(T_multiple_of, int) or T_multiple_of < 1:
        raise InvalidInputError(f"T_multiple_of must be a positive int; got {T_multiple_of!r}")
    m = T_multiple_of
    t_lo, t_hi = -(-Tr[0] // m), Tr[1] // m
    if t_lo > t_hi:
        raise InvalidInputError(f"T={T!r} holds no multiple of T_multiple_of={m}")
    Gs = _choices("groups", groups, range(1, 65))
    packs = _choices("packed", packed, (False, True))
    lays = _choices("layouts", layouts, LAYOUTS)
    states = _choices("initial_state", initial_state, (False, True))
    gts = _choices("gates", gates, GATES)
    regs = _choices("regimes", regimes, REGIMES)
    norms = _choices("qk_l2norm", qk_l2norm, (False, True))
    betas = _choices("beta_activations", beta_activations, BETA_ACTIVATIONS)
    scales = _choices("scale", scale, ("default", "drawn"))
    chunks = tuple(chunk_sizes) if isinstance(chunk_sizes, Sequence) else (chunk_sizes,)
    if not chunks or any(c is not None and (not isinstance(c, int) or c < 1) for c in chunks):
        raise InvalidInputError(f"chunk_sizes must hold None or positive ints; got {chunk_sizes!r}")
    if not (
        isinstance(lower_bound, tuple | list)
        and len(lower_bound) == 2
        and lower_bound[0] <= lower_bound[1] < 0
    ):
        raise InvalidInputError(f"lower_bound must be a (min, max) pair of floats < 0; got {lower_bound!r}")
    if not isinstance(max_sequences, int) or max_sequences < 1:
        raise InvalidInputError(f"max_sequences must be a positive int; got {max_sequences!r}")
    return _Space(
        dt,
        Kr,
        Vr,
        Hr,
        Br,
        m,
        t_lo,
        t_hi,
        Gs,
        packs,
        lays,
        states,
        gts,
        regs,
        norms,
        betas,
        scales,
        chunks,
        tuple(lower_bound),
        max_sequences,
    )


def _strategy(space: _Space) -> Any:
    """The hypothesis strategy of :class:`Problem` drawing from ``space``."""
    from hypothesis import strategies as st

    (
        dt,
        Kr,
        Vr,
        Hr,
        Br,
        m,
        t_lo,
        t_hi,
        Gs,
        packs,
        lays,
        states,
        gts,
        regs,
        norms,
        betas,
        scales,
        chunks,
        lower_bound,
        max_sequences,
    ) = space

    @st.composite
    def draw_problem(draw: Any) -> Problem:
        is_packed = draw(st.sampled_from(packs))
        T_ = m * draw(st.integers(t_lo, t_hi))
        cu = None
        if is_packed:
            cuts = draw(st.lists(st.integers(0, T_ // m), min_size=0, max_size=max_sequences - 1))
            cu = (0, *sorted(m * c for c in cuts), T_)
        gate = draw(st.sampled_from(gts))
        has_A = gate == "softplus" or (gate == "lower_bound" and draw(st.booleans()))
        return Problem(
            seed=draw(st.integers(0, 2**32 - 1)),
            dtype=draw(st.sampled_from(dt)),
            B=1 if is_packed else draw(st.integers(*Br)),
            H=draw(st.integers(*Hr)),
            G=draw(st.sampled_from(Gs)),
            T=T_,
            K=draw(st.integers(*Kr)),
            V=draw(st.integers(*Vr)),
            cu_seqlens=cu,
            layout=draw(st.sampled_from(lays)),
            initial_state=draw(st.sampled_from(states)),
            gate=gate,
            lower_bound=(
                round(draw(st.floats(*lower_bound)), 6) or lower_bound[1] if gate == "lower_bound" else None
            ),
            A_log=has_A,
            dt_bias=gate != "log" and draw(st.booleans()),
            regime=draw(st.sampled_from(regs)),
            qk_l2norm=draw(st.sampled_from(norms)),
            beta_activation=draw(st.sampled_from(betas)),
            scale=round(draw(st.floats(0.05, 2.0)), 6) if draw(st.sampled_from(scales)) == "drawn" else None,
            chunk_size=draw(st.sampled_from(chunks)),
            causal_step=draw(st.integers(1, max(T_ - 1, 1))),
        )

    return draw_problem()
