"""The backend interface: the primitives the chunked algorithm is written against, the hooks, and
the records they return.

Every method takes its step arrays in the order ``q, k, v, g, beta``, then the other arrays
positionally; everything that is not an array (``scale``, ``chunk_size``, buffers, flags) is
keyword-only. ``tests/interior/test_protocol.py`` checks every backend's functions against these
parameters.

Shapes: ``B`` batch rows, ``H`` heads (value heads: the core's q and k are already expanded),
``T`` steps, ``K`` key and ``V`` value channels; ``NT`` chunks of ``C`` steps padded with zero
rows to ``Cp`` (a power of two). A chunked array is ``[B, H, NT, Cp, D]``; ``...`` stands for the
leading ``[B, H, NT]``. Padding rows carry ``q = k = v = 0``, ``beta = 0`` and ``g = 0``: they
add nothing and decay nothing. Every primitive takes and returns arrays of one floating dtype
(the compute dtype) in the namespace of its inputs.

Numerical contract (``docs/design.md``): every decay factor is a product of ``exp(g)`` over
exactly the steps it spans, so every factor lies in ``[0, 1]`` and ``g = -inf`` gives an exact 0.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

__all__ = [
    "Backend",
    "ChunkLocal",
    "GateFlags",
    "Gradients",
    "KdaOutput",
    "LocalGradients",
    "StateGradPass",
    "StatePass",
]


@dataclass(frozen=True)
class ChunkLocal:
    """The state-free work of every chunk that the forward needs (from ``chunk_local``).

    Attributes
    ----------
    qg : ``[..., Cp, K]``, ``scale * q * prefix`` (``prefix[i]``: the decay from the chunk start
        through step ``i``).
    kg : ``[..., Cp, K]``, ``k * prefix``.
    k_suffix : ``[..., Cp, K]``, ``k * suffix`` (``suffix[j]``: the decay after step ``j`` to the
        end).
    total : ``[..., K]``, the decay over the whole chunk.
    A : ``[..., Cp, Cp]`` lower triangular, ``A[i, j] = scale sum_d q[i,d] k[j,d] decay(j..i]``.
    L : ``[..., Cp, Cp]`` strictly lower triangular, the same with ``k`` for ``q``.
    Minv : ``[..., Cp, Cp]`` unit lower triangular, ``M^-1`` with ``M = I + diag(beta) L`` (the
        matrix ``docs/design.md`` calls ``T``).
    w : ``[..., Cp, K]``, ``Minv diag(beta) kg``; u0 : ``[..., Cp, V]``, ``Minv diag(beta) v``.
    private : whatever the backend keeps for its own ``chunk_local_backward``; the algorithm
        never reads it.
    """

    qg: Any
    kg: Any
    k_suffix: Any
    total: Any
    A: Any
    L: Any
    Minv: Any
    w: Any
    u0: Any
    private: Any = None


class StatePass(NamedTuple):
    """What ``chunk_state_pass`` returns: ``boundaries [NT, B, H, K, V]`` (the chunk-start
    states), ``output [B, H, NT, Cp, V]`` (None when no output was asked for) and ``final_state
    [B, H, K, V]``."""

    boundaries: Any
    output: Any
    final_state: Any


class StateGradPass(NamedTuple):
    """What ``chunk_state_grad_pass`` returns: ``dends [NT, B, H, K, V]`` (the gradient of each
    chunk's end state), ``u`` and ``du [B, H, NT, Cp, V]`` (``U`` and its gradient) and
    ``dstart [B, H, K, V]`` (the gradient of the state before the first chunk)."""

    dends: Any
    u: Any
    du: Any
    dstart: Any


class LocalGradients(NamedTuple):
    """What ``chunk_local_backward`` returns: the gradients of the chunked step arrays, ``dq, dk,
    dg [..., Cp, K]``, ``dv [..., Cp, V]``, ``dbeta [..., Cp]``."""

    dq: Any
    dk: Any
    dv: Any
    dg: Any
    dbeta: Any


class KdaOutput(NamedTuple):
    """Result of a KDA forward.

    Attributes
    ----------
    output : ``[B, HV, T, V]`` (``[B, T, HV, V]`` time-major), dtype of the inputs.
    final_state : ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``), float32 (float64
        for float64 inputs).
    boundaries : ``[NT, B, HV, K, V]``, the state at the start of each chunk (same dtype as
        ``final_state``), or ``None`` when not asked for.

    The public record (``kda.KdaOutput``), and the one the core and the engine return a forward's
    results in (head-first, in the compute dtype); buffers for a forward are passed as one too.
    """

    output: Any
    final_state: Any
    boundaries: Any


class Gradients(NamedTuple):
    """A backward's results, in the one order of the step arrays: the gradients of ``q, k, v, g,
    beta`` (each shaped like its input) and of the initial state.

    Not the public :class:`kda.KdaGradients`, whose fields differ in number and meaning: these
    are the core's, with respect to the core's inputs (the arrays after the options' maps:
    normalised ``q, k``, the gate law's log decay, the activated ``beta``; head-first, ``q, k``
    expanded to the value heads, in the compute dtype), six of them; ``KdaGradients`` holds the
    gradients with respect to the raw inputs after the chain rules, named as the inputs, with
    the gate law's parameters (``A_log``, ``dt_bias``) besides.
    """

    dq: Any
    dk: Any
    dv: Any
    dg: Any
    dbeta: Any
    dinitial: Any


class GateFlags(Protocol):
    """A device-side check of ``g <= 0`` in flight; reading it synchronises."""

    def raise_if_bad(self) -> None:
        """Raise :class:`kda.InvalidInputError` if the check found a positive or NaN decay."""


class Backend(Protocol):
    """What a backend module provides: primitives, then hooks."""

    NAME: str
    SLAB_ELEMENTS: int  # elements of one [B, H, NT, Cp, max(K, V)] array of a slab of chunks
    MAX_CHUNK: int | None  # the longest padded chunk Cp it computes (None: any)
    # the step recurrence is faster than the chunked form up to this many steps in one chunk
    # (measured per backend): the core routes every call of that length there
    RECURRENT_MAX_T: int
    # the inputs whose finiteness the fused passes read off the chunks as they pass (their
    # ``screen``), by the names the entry points give them: the call's checks scan only the
    # others. Empty without fused passes.
    FUSED_SCREENS: frozenset[str]

    # --- layout
    def to_chunks(self, x: Any, *, chunk_size: int, padded_size: int) -> Any:
        """``[B, H, T, D]`` -> ``[B, H, NT, Cp, D]``, zero-padded in time and within each chunk."""

    def from_chunks(self, x: Any, *, chunk_size: int, length: int) -> Any:
        """``[B, H, NT, Cp, D]`` -> ``[B, H, T, D]`` with ``T = length``."""

    # --- forward
    def chunk_local(self, q: Any, k: Any, v: Any, g: Any, beta: Any, *, scale: float) -> ChunkLocal:
        """Every chunk's state-free work. ``q, k, g: [..., Cp, K]``, ``v: [..., Cp, V]``,
        ``beta: [..., Cp]``."""

    def chunk_state_pass(
        self, w: Any, u0: Any, k_suffix: Any, total: Any, state: Any, qg: Any = None, A: Any = None
    ) -> StatePass:
        """The state recurrence over the chunks of a slab, the output fused in.

        Per chunk from ``S``: ``U = u0 - w S``, ``O = qg S + A U``, ``S <- total * S + k_suffix^T U``.
        ``state: [B, H, K, V]``. Returns the chunk-start states, ``O`` (None without ``qg`` and
        ``A``) and the final state (:class:`StatePass`).
        """

    # --- backward
    def chunk_state_grad_pass(
        self,
        w: Any,
        u0: Any,
        k_suffix: Any,
        total: Any,
        qg: Any,
        A: Any,
        grad_output: Any,
        boundaries: Any,
        dfinal: Any,
    ) -> StateGradPass:
        """The state-gradient recurrence, last chunk first: ``dU = A^T dO + k_suffix dS`` and
        ``dS <- total * dS + qg^T dO - w^T dU``. Returns each chunk's end-state gradient, ``U`` and
        ``dU`` and the gradient of the state before the first chunk (:class:`StateGradPass`)."""

    def chunk_local_backward(
        self,
        q: Any,
        k: Any,
        v: Any,
        g: Any,
        beta: Any,
        boundaries: Any,
        *,
        scale: float,
        local: ChunkLocal,
        dends: Any,
        u: Any,
        du: Any,
        grad_output: Any,
    ) -> LocalGradients:
        """Gradients of every chunk's state-free work (:class:`LocalGradients`). ``boundaries``:
        the chunk-start states; ``local``: :meth:`chunk_local`'s record of the same inputs;
        ``dends, u, du``: what :meth:`chunk_state_grad_pass` returns;
        ``grad_output [..., Cp, V]``."""

    # --- fused passes (optional: None where the backend leaves the composition to the engine)
    # ``screen``, where given, is a float64 ``[B * H, 2]`` array that receives per head ``sum(x * 0)``
    # over the pass's inputs (column 0) and over its results (column 1): 0 where all are finite,
    # NaN where one is not, read off the chunks as they pass (the call's finiteness checks without
    # passes of their own); column 0 is NaN too where an element of ``g`` is not ``<= 0`` (the gate
    # check, likewise). None: no screen (the caller checks the arrays itself). Which inputs are
    # screened: ``FUSED_SCREENS``.
    def chunk_forward_heads(
        self,
        q: Any,
        k: Any,
        v: Any,
        g: Any,
        beta: Any,
        state: Any,
        *,
        scale: float,
        chunk_size: int,
        output: Any,
        boundaries: Any,
        screen: Any = None,
    ) -> Any:
        """The whole chunked forward of ``[B, H, T, *]`` inputs (any strides) from ``state
        [B, H, K, V]``, the chunk primitives above fused per head and chunk; writes ``output
        [B, H, T, V]`` and ``boundaries [NT, B, H, K, V]`` where they are not None and returns the
        final state. ``screen``: the inputs are ``q, k, v`` (and ``g``), the results the output and
        the final state. A backend may set it to None: the engine then runs the chunk primitives
        slab by slab (``kda/_engine/chunked.py``)."""

    def chunk_backward_heads(
        self,
        q: Any,
        k: Any,
        v: Any,
        g: Any,
        beta: Any,
        boundaries: Any,
        grad_output: Any,
        dfinal: Any,
        *,
        scale: float,
        chunk_size: int,
        grads: Gradients,
        screen: Any = None,
    ) -> None:
        """The whole chunked backward, last chunk first, from the forward's ``boundaries`` and the
        final state's gradient ``dfinal [B, H, K, V]``; writes the six gradients into the buffers
        ``grads`` (a :class:`Gradients` of writable arrays of the inputs' shapes). ``screen``: the
        inputs are ``q, k, v, grad_output`` and the boundaries (and ``g``), the results the six
        gradients. None: composed by the engine, as for :meth:`chunk_forward_heads`."""

    # --- the step recurrence (the oracle, T == 1, decoding)
    def recurrent_forward(
        self, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any, *, scale: float
    ) -> tuple[Any, Any]:
        """``[B, H, T, *]`` inputs from ``state [B, H, K, V]``: ``(output [B, H, T, V], final)``."""

    def recurrent_backward(
        self,
        q: Any,
        k: Any,
        v: Any,
        g: Any,
        beta: Any,
        state: Any,
        grad_output: Any,
        dfinal: Any,
        *,
        scale: float,
    ) -> Gradients:
        """The gradients of the recurrence from ``state`` (:class:`Gradients`), given the output's
        gradient and the final state's, ``dfinal [B, H, K, V]``."""

    def decode_forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        g: Any,
        beta: Any,
        pool: Any,
        start: Any,
        dest: Any,
        *,
        scale: float,
        offsets: Any = None,
        final_pool: Any = None,
        out: Any = None,
        v_first: bool = False,
    ) -> Any:
        """Steps of ``N`` requests from rows of ``pool [P, H, K, V]``; returns ``output [B, H, T, V]``.

        Request ``n`` is batch row ``n`` of ``[B, H, T, *]`` inputs, or steps
        ``offsets[n]:offsets[n + 1]`` of row 0 (``offsets``: ``[N + 1]`` host ints, ``B == 1``).
        It starts from ``pool[start[n]]`` (``start[n] < 0``: padding, zero outputs, nothing read
        or written) and writes its state after step ``t`` into row ``dest[n, t]`` of
        ``final_pool`` (default ``pool``, in place); ``dest [N, 1]`` names only the final
        state's row; ``-1`` writes nothing. ``start`` and ``dest`` are int64 NumPy arrays whose
        non-negative rows are in range and distinct across requests (the caller checks). Rows not
        named are neither read nor written. ``out``: a C-contiguous ``[B, H, T, V]`` buffer of
        the compute dtype that receives the output (and is returned), or None. ``v_first``: the
        pools are V-major, ``[P, H, V, K]``, read and written in that layout in place. The pools
        hold the compute dtype, or float16 / bfloat16 with float32 compute: a row is read as it
        is, the steps run in the compute dtype and each stored state is rounded to the pool's
        dtype (to nearest even); ``final_pool`` has ``pool``'s dtype and layout. A request may
        name one row at several steps (written in step order).
        """

    def decode_screen(self, q: Any, k: Any, v: Any, g: Any, beta: Any, *, finite: bool) -> bool:
        """The checks of a decode step's values at once: True where ``q, k, v, g, beta`` are arrays
        of one dtype, float32 or float64, laid out C-contiguously (where the namespace has such a
        notion), every ``g <= 0`` (``-inf`` allowed; NaN fails) and, with ``finite``, every element of
        ``q, k, v, beta`` finite. False otherwise, including for arrays it does not serve: the
        caller's own checks then decide (and word the error). The default
        (:func:`kda._backend.decode_screen`) computes it with the arrays' namespace; a backend may
        compute it in one pass of its own."""

    def decode_finite(self, output: Any) -> bool:
        """Whether every element of a decode step's ``output`` is finite (its divergence check).
        The default (:func:`kda._backend.decode_finite`) asks the arrays' namespace."""

    # --- hooks
    def workers(self, *, xp: Any, heads: int) -> int:
        """How many head groups the algorithm runs at once (1: no concurrency)."""

    def worker_context(self) -> AbstractContextManager:
        """Entered around concurrent head groups (e.g. to pin BLAS threads)."""

    def launch_gate_check(self, g: Any) -> GateFlags | None:
        """Start a device-side ``g <= 0`` check and return its flags; None: check on the host."""
