"""Kimi Linear models in Hugging Face transformers on kda's KDA kernels (``pip install kda[transformers]``).

>>> from transformers import AutoModelForCausalLM                        # doctest: +SKIP
>>> from kda.transformers import apply_kda_to_kimi_linear               # doctest: +SKIP
>>> apply_kda_to_kimi_linear()   # every Kimi Linear model, already built or not     # doctest: +SKIP

transformers' ``KimiLinearDeltaAttention.forward`` looks up two functions of its modeling module,
``chunk_kimi_delta_attention`` (prefill and training) and ``recurrent_kimi_delta_attention`` (one
decode step from the cache), each time it runs. This module has functions of the same names and
signatures that call :func:`kda.torch.chunk_kda` and :func:`kda.torch.fused_recurrent_kda`, and
installs them:

- :func:`apply_kda_to_kimi_linear` with no model replaces the two module globals, so every Kimi
  Linear model runs on kda (the convention of kernel libraries such as Liger Kernel's
  ``apply_liger_kernel_to_llama()``); with a model, only that model's KDA layers do (each layer
  gets a copy of its class's ``forward`` that reads kda's functions instead);
- :func:`revert_kda_in_kimi_linear` undoes either; :func:`kda_in_kimi_linear` is a context manager
  that applies on entry and reverts on exit.

Supported transformers versions: :data:`SUPPORTED_TRANSFORMERS` (5.17.0, the first release with
Kimi Linear, up to 5.24.x, the newest when this was written); others are refused with
:class:`TransformersVersionError` (a :class:`kda.KdaError`) before anything is changed.

transformers passes the model's keyword arguments on to both functions: the framework keywords in
:data:`FRAMEWORK_KEYWORDS` are accepted and have no effect (as in transformers' own PyTorch
fallback); any other unknown keyword raises ``TypeError`` naming it.

Packed sequences (``cu_seq_lens_q``/``cu_seq_lens_k`` from a padding-free data collator) are wrong
in Kimi Linear with either kernel, transformers' fallback or kda: the model does not pass them on
to the KDA call as ``cu_seqlens``, and its short convolution mixes the sequences as well. That is
the model's to fix, not kda's; a ``cu_seqlens`` that does reach these functions is honoured, as
flash-linear-attention would.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

from . import torch as _kt
from ._errors import InvalidInputError, KdaError
from ._version import within

__all__ = [
    "FRAMEWORK_KEYWORDS",
    "SUPPORTED_TRANSFORMERS",
    "TransformersVersionError",
    "apply_kda_to_kimi_linear",
    "chunk_kimi_delta_attention",
    "is_kda_applied",
    "kda_in_kimi_linear",
    "recurrent_kimi_delta_attention",
    "revert_kda_in_kimi_linear",
]

#: transformers versions this module was written and tested against: ``(first, end)``, first included,
#: end excluded. 5.17.0 is the first release with Kimi Linear; the two functions' signatures and the
#: keywords the model passes them are the same from 5.17.0 to 5.24.0.
SUPPORTED_TRANSFORMERS: tuple[str, str] = ("5.17.0", "5.25")

#: Keyword arguments that transformers forwards from ``model(...)`` to the KDA functions
#: (``TransformersKwargs`` and ``FlashAttentionKwargs``), accepted and ignored here as transformers'
#: own fallback ignores them; keyword -> why it has no effect on KDA.
FRAMEWORK_KEYWORDS: dict[str, str] = {
    "output_attentions": "KDA has no attention weights to return",
    "output_hidden_states": "read by the model, not by the attention kernel",
    "output_router_logits": "read by the mixture-of-experts layers",
    "num_items_in_batch": "Trainer's loss normaliser for gradient accumulation; read by the loss",
    "cu_seq_lens_q": "packed-sequence offsets for flash attention; Kimi Linear does not pass them on as "
    "cu_seqlens (packed sequences are mixed with either kernel)",
    "cu_seq_lens_k": "as cu_seq_lens_q",
    "max_length_q": "flash attention's longest packed sequence",
    "max_length_k": "as max_length_q",
    "position_ids": "KDA has no positional encoding",
    "is_causal": "KDA is causal by construction",
    "seq_idx": "sequence index per token, read by the short convolution's kernel (causal-conv1d)",
}

_CHUNK = "chunk_kimi_delta_attention"
_RECURRENT = "recurrent_kimi_delta_attention"
_MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"
_LAYER = "KimiLinearDeltaAttention"
_MARK = "_kda_forward"  # attribute set on a layer whose instance forward reads kda's functions
_LOCK = threading.Lock()
_SAVED: dict[str, Any] = {}  # transformers' own module globals while kda's are installed


class TransformersVersionError(KdaError, ImportError):
    """transformers is missing, or is a version without Kimi Linear or not yet checked against kda."""


def _framework_keywords(function: str, kwargs: dict[str, Any]) -> None:
    for name in kwargs:
        if name not in FRAMEWORK_KEYWORDS:
            known = ", ".join(FRAMEWORK_KEYWORDS)
            msg = (
                f"{function}() got an unexpected keyword argument {name!r} (kda.transformers accepts "
                f"transformers' framework keywords: {known}; and cu_seqlens)"
            )
            raise TypeError(msg)


def chunk_kimi_delta_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``chunk_kimi_delta_attention`` on :func:`kda.torch.chunk_kda`.

    Parameters
    ----------
    query, key : torch.Tensor
        ``[B, T, H, K]``.
    value : torch.Tensor
        ``[B, T, H, V]``.
    g : torch.Tensor
        Log decay ``[B, T, H, K]`` (the model's forget gate, already ``-exp(A_log) * softplus(.)``).
    beta : torch.Tensor
        ``[B, T, H]``, after the sigmoid.
    chunk_size : int
        Chunk length; changes rounding only.
    initial_state : torch.Tensor or None
        ``[B, H, K, V]``; zeros when None.
    output_final_state : bool
        Return the final state (float32 ``[B, H, K, V]``), else None.
    use_qk_l2norm_in_kernel : bool
        L2-normalise ``query`` and ``key`` over ``K`` (``x / sqrt(sum(x**2) + 1e-6)``).
    **kwargs
        :data:`FRAMEWORK_KEYWORDS` (no effect) and ``cu_seqlens`` (packed sequences, honoured as
        flash-linear-attention does); anything else raises ``TypeError``.

    Returns
    -------
    tuple
        ``(o [B, T, H, V] in query's dtype, final state or None)``.
    """
    cu_seqlens = kwargs.pop("cu_seqlens", None)
    _framework_keywords(_CHUNK, kwargs)
    return _kt.chunk_kda(
        query, key, value, g, beta,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
    )  # fmt: skip


def recurrent_kimi_delta_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``recurrent_kimi_delta_attention`` on :func:`kda.torch.fused_recurrent_kda`.

    The parameters are those of :func:`chunk_kimi_delta_attention` without ``chunk_size``, in
    transformers' order (``initial_state`` and ``output_final_state`` are positional after
    ``beta``, where fla's ``fused_recurrent_kda`` has ``A_log, dt_bias``). The model calls it for
    one decode step (``T == 1``) from the cached state.

    Returns
    -------
    tuple
        ``(o [B, T, H, V] in query's dtype, final state [B, H, K, V] float32 or None)``.
    """
    cu_seqlens = kwargs.pop("cu_seqlens", None)
    _framework_keywords(_RECURRENT, kwargs)
    return _kt.fused_recurrent_kda(
        query, key, value, g, beta,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
    )  # fmt: skip


_KDA = {_CHUNK: chunk_kimi_delta_attention, _RECURRENT: recurrent_kimi_delta_attention}


# ----------------------------------------------------------------------------------------------
# Installing


def _modeling() -> types.ModuleType:
    """transformers' Kimi Linear modeling module, after checking the transformers version."""
    try:
        import transformers
    except ImportError as e:
        msg = "kda.transformers needs transformers: pip install 'kda[transformers]'"
        raise TransformersVersionError(msg) from e
    first, end = SUPPORTED_TRANSFORMERS
    version = transformers.__version__
    if not within(version, SUPPORTED_TRANSFORMERS):
        msg = (
            f"kda.transformers supports transformers >= {first}, < {end} (Kimi Linear's KDA call as "
            f"checked against kda); transformers {version} is installed: "
            f"pip install 'transformers>={first},<{end}'"
        )
        raise TransformersVersionError(msg)
    mkl = importlib.import_module(_MODULE)
    for name in (_CHUNK, _RECURRENT, _LAYER):
        if not hasattr(mkl, name):
            msg = f"transformers {version}: {_MODULE} has no {name}; kda.transformers cannot install"
            raise TransformersVersionError(msg)
    return mkl


def _shadow(mkl: types.ModuleType) -> types.ModuleType:
    """A module ``kda.transformers._kimi_linear``: a copy of transformers' Kimi Linear modeling
    module's namespace with kda's two functions, registered in ``sys.modules`` (so that
    ``torch.compile`` resolves and guards the globals of functions that read it)."""
    name = f"{__name__}._kimi_linear"
    shadow = sys.modules.get(name)
    if shadow is None or shadow.__dict__.get("_kda_source") is not mkl:
        shadow = types.ModuleType(name)
        vars(shadow).update({k: v for k, v in vars(mkl).items() if k not in ("__name__", "__spec__")})
        vars(shadow).update(_KDA, _kda_source=mkl)
        sys.modules[name] = shadow
    return shadow


def _rebind(fn: Any, namespace: dict[str, Any], shadow: dict[str, Any], depth: int = 0) -> Any:
    """``fn`` with every function in its decorator chain whose globals are ``namespace`` copied to
    read ``shadow`` instead; ``fn`` itself when none does."""
    if not isinstance(fn, types.FunctionType) or depth > 8:
        return fn
    if fn.__globals__ is namespace:
        closure = fn.__closure__
    elif fn.__closure__:
        closure = []
        for cell in fn.__closure__:
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                closure.append(cell)
                continue
            new_content = _rebind(content, namespace, shadow, depth + 1)
            closure.append(cell if new_content is content else types.CellType(new_content))
        if all(a is b for a, b in zip(closure, fn.__closure__)):
            return fn
        closure = tuple(closure)
    else:
        return fn
    globals_ = shadow if fn.__globals__ is namespace else fn.__globals__
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    functools.update_wrapper(new, fn, updated=())
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


def _layers(mkl: types.ModuleType, model: Any) -> list[Any]:
    layer_class = getattr(mkl, _LAYER)
    layers = [m for m in model.modules() if isinstance(m, layer_class)]
    if not layers:
        msg = f"{type(model).__name__} has no {_LAYER} layers: not a Kimi Linear model"
        raise InvalidInputError(msg)
    return layers


def apply_kda_to_kimi_linear(model: Any = None) -> None:
    """Run Kimi Linear's KDA layers on kda.

    Parameters
    ----------
    model : torch.nn.Module or None
        None: replace ``chunk_kimi_delta_attention`` and ``recurrent_kimi_delta_attention`` in
        transformers' Kimi Linear modeling module, so that every Kimi Linear model, built before or
        after, runs on kda. A model: only its ``KimiLinearDeltaAttention`` layers do (each gets an
        instance ``forward``, a copy of its class's reading kda's functions); other models keep
        transformers' functions. Applying twice is the same as once.

    Raises
    ------
    TransformersVersionError
        transformers is missing or not a :data:`SUPPORTED_TRANSFORMERS` version; nothing is changed.
    kda.InvalidInputError
        ``model`` has no Kimi Linear KDA layers.
    """
    mkl = _modeling()
    with _LOCK:
        if model is None:
            if not _SAVED:
                _SAVED.update({name: getattr(mkl, name) for name in _KDA})
                for name, fn in _KDA.items():
                    setattr(mkl, name, fn)
            return
        layers = _layers(mkl, model)
        forward = _rebind(getattr(mkl, _LAYER).forward, vars(mkl), vars(_shadow(mkl)))
        if forward is getattr(mkl, _LAYER).forward:
            msg = f"{_LAYER}.forward does not read {_MODULE}'s globals: cannot install per model"
            raise TransformersVersionError(msg)
        for layer in layers:
            if getattr(layer, _MARK, None) is None:
                bound = types.MethodType(forward, layer)
                layer.forward = bound
                object.__setattr__(layer, _MARK, bound)


def revert_kda_in_kimi_linear(model: Any = None) -> None:
    """Undo :func:`apply_kda_to_kimi_linear` (the same ``model`` argument).

    Parameters
    ----------
    model : torch.nn.Module or None
        None: restore transformers' own module functions. A model: remove the instance
        ``forward`` from its KDA layers (a model that is not patched is left as it is). Each undoes
        only the matching apply: models patched one by one stay patched after ``revert()``.
    """
    mkl = _modeling()
    with _LOCK:
        if model is None:
            for name, fn in _SAVED.items():
                setattr(mkl, name, fn)
            _SAVED.clear()
            return
        for layer in _layers(mkl, model):
            if getattr(layer, _MARK, None) is not None:
                if layer.__dict__.get("forward") is layer.__dict__[_MARK]:
                    del layer.forward
                object.__delattr__(layer, _MARK)


def is_kda_applied(model: Any = None) -> bool:
    """Whether :func:`apply_kda_to_kimi_linear` is in effect: for every model (None), or for
    every KDA layer of ``model`` (including through the module-wide install)."""
    mkl = _modeling()
    if all(getattr(mkl, name) is fn for name, fn in _KDA.items()):
        return True
    if model is None:
        return False
    return all(getattr(layer, _MARK, None) is not None for layer in _layers(mkl, model))


@contextlib.contextmanager
def kda_in_kimi_linear(model: Any = None) -> Iterator[None]:
    """Apply kda (:func:`apply_kda_to_kimi_linear`) inside a ``with`` block and revert it on exit.

    Parameters
    ----------
    model : torch.nn.Module or None
        As in :func:`apply_kda_to_kimi_linear`. On exit, an install that was already in place on
        entry is kept.
    """
    mkl = _modeling()
    if model is None:
        already = bool(_SAVED)
    else:
        already = all(getattr(layer, _MARK, None) is not None for layer in _layers(mkl, model))
    apply_kda_to_kimi_linear(model)
    try:
        yield
    finally:
        if not already:
            revert_kda_in_kimi_linear(model)
