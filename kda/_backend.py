"""The backend interface (the primitives the chunked algorithm is written against, and the hooks)
and the dispatch from the inputs' array namespace to a backend.

A backend is a package beside this module (``kda/reference``, ``kda/cpu``, ``kda/cuda``) that
provides every name of :class:`Backend`: it defines its primitives and ends with
:func:`complete`, which fills in the defaults it does not override (:data:`DEFAULTS`: no fused
passes, one worker, the gate checked on the host, any chunk length, the step recurrence for
one-step calls, the generic chunk layout, the decode checks by whole-array reductions) and its
``__all__``. :data:`CAPABILITIES` is the one table of what each backend runs and when it is
chosen: it generates the README's backend table
(:func:`backend_table`), the ``backend`` entry of the entry points' docstrings
(:func:`backend_doc`) and which backends the tests run here (:func:`installed_backends`). The
chunked algorithm (:mod:`kda._engine.chunked`), the
cores (:mod:`kda._engine.core`) and the entry points call backends only through these names.
Backends import nothing from each other: what they share (the :class:`ChunkLocal` record, the
generic :func:`to_chunks` / :func:`from_chunks` and :func:`decode_screen` / :func:`decode_finite`)
lives here. No signature has more than ten positional parameters (the rest are keyword-only);
``tests/interior/test_protocol.py`` checks every backend's functions against :class:`Backend`'s
parameters. Adding a backend is its folder plus
its row in :data:`CAPABILITIES` (and, to be chosen by default, a line in :func:`get_backend`).

Shapes: ``B`` batch rows, ``H`` heads (value heads: the core's q and k are already expanded),
``T`` steps, ``K`` key and ``V`` value channels; ``NT`` chunks of ``C`` steps padded with zero
rows to ``Cp`` (a power of two). A chunked array is ``[B, H, NT, Cp, D]``; ``...`` stands for the
leading ``[B, H, NT]``. Padding rows carry ``q = k = v = 0``, ``beta = 0`` and ``g = 0``: they
add nothing and decay nothing. Every primitive takes and returns arrays of one floating dtype
(the compute dtype) in the namespace of its inputs.

Numerical contract (``docs/design.md``): every decay factor is a product of ``exp(g)`` over
exactly the steps it spans, so every factor lies in ``[0, 1]`` and ``g = -inf`` gives an exact 0.

Nothing here imports an array library the caller has not already imported: the CUDA
backend (Numba-CUDA kernels) is imported only for CuPy arrays or when asked for by name.
Every reason a backend cannot run here (a missing extra, no driver, no GPU, no NVVM) is raised
as :class:`~kda.InvalidInputError` naming what is missing and what to do, before any kernel is
compiled or launched: no exception of numba or CuPy escapes for such a cause.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple, Protocol

import array_api_compat
from array_api_compat import array_namespace

from ._errors import InvalidInputError

__all__ = [
    "BACKENDS",
    "CAPABILITIES",
    "DEFAULTS",
    "INTERFACE",
    "Backend",
    "Capability",
    "ChunkLocal",
    "GateFlags",
    "backend_doc",
    "backend_table",
    "complete",
    "cpu_available",
    "cuda_problem",
    "decode_finite",
    "decode_screen",
    "from_chunks",
    "get_backend",
    "installed_backends",
    "resolve",
    "to_chunks",
]


@dataclass
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

    # --- layout
    def to_chunks(self, x: Any, chunk_size: int, padded_size: int) -> Any:
        """``[B, H, T, D]`` -> ``[B, H, NT, Cp, D]``, zero-padded in time and within each chunk."""

    def from_chunks(self, x: Any, chunk_size: int, length: int) -> Any:
        """``[B, H, NT, Cp, D]`` -> ``[B, H, T, D]`` with ``T = length``."""

    # --- forward
    def chunk_local(self, q: Any, k: Any, g: Any, v: Any, beta: Any, scale: float) -> ChunkLocal:
        """Every chunk's state-free work. ``q, k, g: [..., Cp, K]``, ``v: [..., Cp, V]``,
        ``beta: [..., Cp]``."""

    def chunk_state_pass(
        self, w: Any, u0: Any, k_suffix: Any, total: Any, state: Any, qg: Any = None, A: Any = None
    ) -> tuple[Any, Any, Any]:
        """The state recurrence over the chunks of a slab, the output fused in.

        Per chunk from ``S``: ``U = u0 - w S``, ``O = qg S + A U``, ``S <- total * S + k_suffix^T U``.
        ``state: [B, H, K, V]``. Returns ``boundaries [NT, B, H, K, V]`` (the chunk-start
        states), ``O [B, H, NT, Cp, V]`` (None without ``qg`` and ``A``) and the final state.
        """

    # --- backward
    def chunk_state_grad_pass(
        self, w: Any, u0: Any, k_suffix: Any, total: Any, qg: Any, A: Any, grad_output: Any, boundaries: Any,
        dfinal: Any,
    ) -> tuple[Any, Any, Any, Any]:  # fmt: skip
        """The state-gradient recurrence, last chunk first: ``dU = A^T dO + k_suffix dS`` and
        ``dS <- total * dS + qg^T dO - w^T dU``. Returns ``dends [NT, B, H, K, V]`` (the gradient
        of each chunk's end state), ``U`` and ``dU`` (``[B, H, NT, Cp, V]``) and the gradient of
        the state before the first chunk."""  # fmt: skip

    def chunk_local_backward(
        self, q: Any, k: Any, g: Any, v: Any, beta: Any, scale: float, loc: ChunkLocal, boundaries: Any, *,
        dends: Any, u: Any, du: Any, grad_output: Any,
    ) -> tuple[Any, Any, Any, Any, Any]:  # fmt: skip
        """Gradients of every chunk's state-free work: ``dq, dk, dg [..., Cp, K]``,
        ``dv [..., Cp, V]``, ``dbeta [..., Cp]``. ``loc``: :meth:`chunk_local`'s record of the same
        inputs; ``boundaries``: the chunk-start states; ``dends, u, du``: what
        :meth:`chunk_state_grad_pass` returns; ``grad_output [..., Cp, V]``."""  # fmt: skip

    # --- fused passes (optional: None where the backend leaves the composition to the engine)
    # ``screen``, where given, is a float64 ``[B * H, 2]`` array that receives per head ``sum(x * 0)``
    # over the pass's inputs (column 0) and over its results (column 1): 0 where all are finite,
    # NaN where one is not, read off the chunks as they pass (the call's finiteness checks without
    # passes of their own); column 0 is NaN too where an element of ``g`` is not ``<= 0`` (the gate
    # check, likewise). None: no screen (the caller checks the arrays itself).
    def chunk_forward_heads(
        self, q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, state: Any, chunk_size: int, *,
        output: Any, boundaries: Any, screen: Any = None,
    ) -> Any:  # fmt: skip
        """The whole chunked forward of ``[B, H, T, *]`` inputs (any strides) from ``state
        [B, H, K, V]``, the chunk primitives above fused per head and chunk; writes ``output
        [B, H, T, V]`` and ``boundaries [NT, B, H, K, V]`` where they are not None and returns the
        final state. ``screen``: the inputs are ``q, k, v`` (and ``g``), the results the output and
        the final state. A backend may set it to None: the engine then runs the chunk primitives
        slab by slab (``kda/_engine/chunked.py``)."""  # fmt: skip

    def chunk_backward_heads(
        self, q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, boundaries: Any, grad_output: Any,
        dfinal: Any, chunk_size: int, *, grads: Any, screen: Any = None,
    ) -> None:  # fmt: skip
        """The whole chunked backward, last chunk first, from the forward's ``boundaries`` and the
        final state's gradient ``dfinal [B, H, K, V]``; writes ``dq, dk, dv, dg, dbeta, dinitial``
        into the six buffers ``grads`` (writable arrays of the inputs' shapes). ``screen``: the
        inputs are ``q, k, v, grad_output`` and the boundaries (and ``g``), the results the six
        gradients. None: composed by the engine, as for :meth:`chunk_forward_heads`."""  # fmt: skip

    # --- the step recurrence (the oracle, T == 1, decoding)
    def recurrent_forward(
        self, q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, state: Any
    ) -> tuple[Any, Any]:
        """``[B, H, T, *]`` inputs from ``state [B, H, K, V]``: ``(output [B, H, T, V], final)``."""

    def recurrent_backward(
        self, q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, state: Any, grad_output: Any,
        dfinal: Any,
    ) -> tuple[Any, Any, Any, Any, Any, Any]:  # fmt: skip
        """Gradients ``(dq, dk, dv, dg, dbeta, dinitial)`` of the recurrence from ``state``, given the
        output's gradient and the final state's, ``dfinal [B, H, K, V]``."""  # fmt: skip

    def decode_forward(
        self, q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float, pool: Any, start: Any, dest: Any, *,
        offsets: Any = None, final_pool: Any = None, out: Any = None, v_first: bool = False,
    ) -> Any:  # fmt: skip
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

    def decode_screen(self, q: Any, k: Any, v: Any, g: Any, beta: Any, finite: bool) -> bool:
        """The checks of a decode step's values at once: True where ``q, k, v, g, beta`` are arrays
        of one dtype, float32 or float64, laid out C-contiguously (where the namespace has such a
        notion), every ``g <= 0`` (``-inf`` allowed; NaN fails) and, with ``finite``, every element of
        ``q, k, v, beta`` finite. False otherwise, including for arrays it does not serve: the
        caller's own checks then decide (and word the error). The default
        (:func:`decode_screen`) computes it with the arrays' namespace; a backend may compute it
        in one pass of its own."""

    def decode_finite(self, output: Any) -> bool:
        """Whether every element of a decode step's ``output`` is finite (its divergence check).
        The default (:func:`decode_finite`) asks the arrays' namespace."""

    # --- hooks
    def workers(self, xp: Any, heads: int) -> int:
        """How many head groups the algorithm runs at once (1: no concurrency)."""

    def worker_context(self) -> AbstractContextManager:
        """Entered around concurrent head groups (e.g. to pin BLAS threads)."""

    def launch_gate_check(self, g: Any) -> GateFlags | None:
        """Start a device-side ``g <= 0`` check and return its flags; None: check on the host."""


def to_chunks(x: Any, chunk_size: int, padded_size: int) -> Any:
    """``[B, H, T, D]`` -> ``[B, H, NT, Cp, D]``, zero-padded in time and within each chunk."""
    xp = array_namespace(x)
    B, H, T, D = x.shape
    C, Cp = chunk_size, padded_size
    NT = -(-T // C)
    if NT * C > T:
        x = xp.concat([x, xp.zeros((B, H, NT * C - T, D), dtype=x.dtype, device=x.device)], axis=2)
    x = xp.reshape(x, (B, H, NT, C, D))
    if Cp > C:
        x = xp.concat([x, xp.zeros((B, H, NT, Cp - C, D), dtype=x.dtype, device=x.device)], axis=3)
    return x


def from_chunks(x: Any, chunk_size: int, length: int) -> Any:
    """Inverse of :func:`to_chunks`: ``[B, H, NT, Cp, D]`` -> ``[B, H, T, D]`` with ``T = length``."""
    xp = array_namespace(x)
    B, H, NT, _, D = x.shape
    x = xp.reshape(x[..., :chunk_size, :], (B, H, NT * chunk_size, D))
    return x[:, :, :length, :]


# ---------------------------------------------------------------------- the base of every backend


def _one_worker(xp: Any, heads: int) -> int:
    """One head group at a time (no concurrency)."""
    return 1


def _no_worker_context() -> AbstractContextManager:
    """Nothing to set around head groups."""
    return contextlib.nullcontext()


def _host_gate_check(g: Any) -> None:
    """No device-side check: validation checks ``g`` on the host."""
    return None


def _c_contiguous(x: Any) -> bool:
    """Whether ``x`` is laid out C-contiguously: NumPy's and CuPy's ``flags``, PyTorch's
    ``is_contiguous()``; True for a namespace with no such notion."""
    flags = getattr(x, "flags", None)
    if flags is not None:
        return bool(flags.c_contiguous)
    is_contiguous = getattr(x, "is_contiguous", None)
    return bool(is_contiguous()) if callable(is_contiguous) else True


def decode_screen(q: Any, k: Any, v: Any, g: Any, beta: Any, finite: bool) -> bool:
    """:meth:`Backend.decode_screen` with the arrays' namespace: one dtype (float32 or float64),
    C-contiguous, ``g <= 0`` everywhere and, with ``finite``, ``q, k, v, beta`` finite (the
    results of the cpu backend's compiled pass, by whole-array reductions)."""
    xp = array_namespace(q, k, v, g, beta)
    dt = q.dtype
    if dt not in (xp.float32, xp.float64) or any(x.dtype != dt for x in (k, v, g, beta)):
        return False
    if not all(_c_contiguous(x) for x in (q, k, v, g, beta)):
        return False
    if not bool(xp.all(g <= 0)):  # a NaN fails
        return False
    return not finite or all(bool(xp.all(xp.isfinite(x))) for x in (q, k, v, beta))


def decode_finite(output: Any) -> bool:
    """:meth:`Backend.decode_finite` with the array's namespace."""
    xp = array_namespace(output)
    return bool(xp.all(xp.isfinite(output)))


# what a backend module has unless it defines its own (the optional part of :class:`Backend`)
DEFAULTS: dict[str, Any] = {
    "MAX_CHUNK": None,  # any chunk length
    "RECURRENT_MAX_T": 1,  # the step recurrence for one-step calls only
    "ChunkLocal": ChunkLocal,
    "to_chunks": to_chunks,
    "from_chunks": from_chunks,
    "chunk_forward_heads": None,  # no fused passes: the engine composes the primitives by slabs
    "chunk_backward_heads": None,
    "workers": _one_worker,
    "worker_context": _no_worker_context,
    "launch_gate_check": _host_gate_check,
    "decode_screen": decode_screen,  # the decode fast path's checks, by whole-array reductions
    "decode_finite": decode_finite,
}

# every name a backend module provides: the attributes and methods of :class:`Backend`, the record
INTERFACE: tuple[str, ...] = tuple(
    sorted({*Backend.__annotations__, *(n for n in vars(Backend) if not n.startswith("_")), "ChunkLocal"})
)


def complete(namespace: dict[str, Any], extras: tuple[str, ...] = ()) -> None:
    """Finish a backend module: :data:`DEFAULTS` for what ``namespace`` (its ``globals()``) does
    not define, and ``__all__`` as :data:`INTERFACE` plus ``extras`` (its own public names).

    Raises ``TypeError`` (a programming error, at import) when a name of the interface is missing.
    """
    for name, value in DEFAULTS.items():
        namespace.setdefault(name, value)
    missing = [name for name in (*INTERFACE, *extras) if name not in namespace]
    if missing:
        msg = f"backend {namespace.get('__name__')} lacks {missing} of the interface (kda._backend.Backend)"
        raise TypeError(msg)
    namespace["__all__"] = sorted({*INTERFACE, *extras})


# ---------------------------------------------------------------------- the capability table


class Capability(NamedTuple):
    """One backend: what it runs and when it is chosen (a row of :data:`CAPABILITIES`)."""

    name: str
    module: str
    arrays: str  # what it computes, and how (the README's "arrays" column)
    chosen: str  # when the dispatch picks it (the README's "chosen" column)
    requires: tuple[str, ...]  # top-level packages it needs installed (beyond kda's own)
    summary: str  # one phrase for the ``backend`` docstrings


CAPABILITIES: tuple[Capability, ...] = (
    Capability(
        "cpu", "kda.cpu", "NumPy; Numba kernels, BLAS products, one worker per core",
        "by default for NumPy arrays", ("numba", "scipy"),
        "NumPy arrays, Numba kernels (the default for them where numba and scipy are installed)",
    ),
    Capability(
        "reference", "kda.reference",
        "any array-API namespace (NumPy, array-api-strict, PyTorch CPU tensors, ...)",
        'for every other namespace, or `backend="reference"`', (),
        "any array-API namespace (the default for every other one)",
    ),
    Capability(
        "cuda", "kda.cuda", "CuPy; Numba-CUDA kernels on CuPy's stream",
        'for CuPy arrays (`pip install -e ".[cuda]"`, or `".[cuda13]"` for a CUDA 13 driver: `docs/gpu.md`)',
        ("numba", "numba_cuda"), "CuPy arrays, Numba-CUDA kernels (the default for them)",
    ),
)  # fmt: skip

# name -> module implementing the primitive interface
BACKENDS = {c.name: c.module for c in CAPABILITIES}
_CAPABILITY = {c.name: c for c in CAPABILITIES}


def backend_table() -> str:
    """The README's table of backends (markdown), from :data:`CAPABILITIES`."""
    rows = ["| backend | arrays | chosen |", "| --- | --- | --- |"]
    rows += [
        f"| `{c.name}` (`{c.module.replace('.', '/')}`) | {c.arrays} | {c.chosen} |" for c in CAPABILITIES
    ]
    return "\n".join(rows)


def backend_doc(indent: str = "    ") -> str:
    """The numpydoc entry of an entry point's ``backend`` parameter, from :data:`CAPABILITIES`;
    ``indent``: the indentation of the parameter's line (the description goes 4 spaces deeper)."""
    import textwrap

    names = ", ".join(f'"{c.name}"' for c in CAPABILITIES)
    text = "``None`` picks from the arrays' namespace; " + "; ".join(
        f'"{c.name}": {c.summary}' for c in CAPABILITIES
    )
    body = textwrap.fill(
        text + ".", width=96, initial_indent=indent + "    ", subsequent_indent=indent + "    "
    )
    return f"backend : {{None, {names}}}\n{body}"


def installed_backends() -> tuple[str, ...]:
    """The backends whose packages are installed here, in :data:`CAPABILITIES` order (found, not
    imported: so asking imports no numba)."""
    import importlib.util

    return tuple(
        c.name for c in CAPABILITIES if all(importlib.util.find_spec(r) is not None for r in c.requires)
    )


_CUDA_FIX = (
    "Use backend='reference' (NumPy or any array-API arrays on the CPU), or run on a machine with an "
    "NVIDIA GPU and driver; NUMBA_ENABLE_CUDASIM=1 runs the kernels on Numba's CPU simulator (slow)."
)


@functools.lru_cache(maxsize=1)
def cuda_problem() -> str | None:
    """Why the CUDA backend cannot run in this process, or None when it can (checked once).

    Covers numba-cuda not installed, no driver library, a driver that fails to start, no GPU,
    and no libNVVM (the compiler of the kernels). Under Numba's simulator only the import counts.
    """
    try:
        from numba import cuda
    except ImportError as err:
        return f"numba-cuda is not installed ({err}); install it with `pip install kda[cuda]`"
    if cuda.is_available():
        return None if _simulated() else _nvvm_problem()
    reason = cuda.cuda_error()
    detail = " ".join(str(reason).split()).rstrip(".") if reason is not None else "no CUDA GPU was found"
    return f"no usable CUDA GPU: {detail}"


def _simulated() -> bool:
    from numba import config

    return bool(getattr(config, "ENABLE_CUDASIM", False))


def _nvvm_problem() -> str | None:
    try:
        from numba.cuda.cudadrv.nvvm import NVVM

        NVVM()
    except Exception as err:  # numba's NvvmSupportError and whatever loading the library raises
        detail = " ".join(str(err).split()).rstrip(".")
        return (
            f"the CUDA compiler library libNVVM cannot be loaded ({detail}); install the CUDA toolkit's "
            "NVVM, e.g. `pip install nvidia-cuda-nvcc-cu12`"
        )
    return None


def get_backend(xp: Any, backend: str | None) -> ModuleType:
    """The primitive module for ``backend``; ``None`` chooses from the namespace ``xp``.

    CuPy arrays run on ``"cuda"``; NumPy arrays on the Numba ``"cpu"`` backend where Numba and
    SciPy (the BLAS of Numba's ``np.dot``) are installed; every other namespace (and NumPy
    without them) on the array-API ``"reference"``. Raises :class:`~kda.InvalidInputError` when
    the chosen backend cannot run here.
    """
    if backend is None:
        if array_api_compat.is_cupy_namespace(xp):
            backend = "cuda"
        elif array_api_compat.is_numpy_namespace(xp) and cpu_available():
            backend = "cpu"
        else:
            backend = "reference"
    if backend not in BACKENDS:
        msg = f"backend must be None or one of {sorted(BACKENDS)}; got {backend!r}"
        raise InvalidInputError(msg)
    if backend == "cuda":
        problem = cuda_problem()
        if problem is not None:
            msg = f"backend 'cuda' cannot run here: {problem}. {_CUDA_FIX}"
            raise InvalidInputError(msg)
    if backend == "cpu":
        if not cpu_available():
            msg = (
                "backend 'cpu' cannot run here: it needs numba and scipy (`pip install numba scipy`); "
                "backend='reference' runs NumPy arrays without them"
            )
            raise InvalidInputError(msg)
        if not array_api_compat.is_numpy_namespace(xp):
            msg = f"backend 'cpu' computes NumPy arrays; got arrays of {getattr(xp, '__name__', xp)}"
            raise InvalidInputError(msg)
    try:
        return importlib.import_module(BACKENDS[backend])
    except ImportError as err:
        msg = f"backend {backend!r} is not available here: {err}. Install it with `pip install kda[cuda]`."
        raise InvalidInputError(msg) from err


@functools.lru_cache(maxsize=1)
def cpu_available() -> bool:
    """Whether the Numba CPU backend can run here: numba and scipy are installed (not imported)."""
    return "cpu" in installed_backends()


def resolve(ops: ModuleType, padded_chunk: int) -> ModuleType:
    """The backend that runs chunks of ``padded_chunk`` steps: ``ops``, or the reference backend
    (on the same arrays) when they are longer than ``ops.MAX_CHUNK``."""
    limit = ops.MAX_CHUNK
    if limit is None or padded_chunk <= limit:
        return ops
    return importlib.import_module(BACKENDS["reference"])
