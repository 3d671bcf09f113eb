"""Ling-3's KDA ops on kda, with vLLM's signatures (``vllm.third_party.flash_linear_attention.ops.kda``
of vLLM 0.32, fla's functions as vLLM vendors them).

Ling-3's KDA layer (``BailingMoeV3KimiDeltaAttention``, ``vllm/model_executor/models/bailing_moe_v3.py``,
the model ``BailingMoeV3ForCausalLM``) binds four Triton functions of that module at import:

- ``fused_kda_gate(g, A, head_k_dim, g_bias, ...)``: the log decay from the raw gate projection, in
  float32: ``lower_bound * sigmoid(exp(A) * (g + g_bias))`` where ``lower_bound`` is given (the
  layer passes ``kda_lower_bound`` when ``kda_safe_gate``), else ``-exp(A) * softplus(g + g_bias)``
  (softplus with fla's ``beta`` and ``threshold``);
- ``chunk_kda(q, k, v, g, beta, ...)``: the prefill from that log decay and ``beta`` already
  sigmoided, from ``initial_state [N, H, V, K]`` (gathered by the layer from the pool), returning
  the final states (the layer writes them back); ``safe_gate`` and ``lower_bound`` arrive in
  ``**kwargs`` and change nothing (``g`` is the log decay already);
- ``fused_recurrent_kda(q, k, v, g, beta, ...)``: decode, one token a request, from the pool
  ``initial_state [slots, H, V, K]`` with ``ssm_state_indices [N]``, in place;
- ``fused_recurrent_kda_fwd(...)``: speculative verify, ``ssm_state_indices [N, W]`` a slot per
  step and ``num_accepted_tokens``: request ``n`` starts from slot ``[n, num_accepted_tokens[n] - 1]``
  and writes the state after step ``t`` to slot ``[n, t]``.

:func:`install` (called by :func:`kda.vllm.register` on vLLM's CPU platform) puts them in that
module and in the layer's, through :mod:`kda.vllm._patch` (each only where vLLM's function has the
parameters written against), and completes what vLLM-CPU gets wrong for Ling-3's MLA layers: its
rotary embedding (:func:`rotary_2d`).

The pool is vLLM's: V-major ``[slots, H, V, K]`` (float32, or bfloat16), each slot dense, the slot
stride possibly padded (Mamba pages), read and written in place; slot 0 (and -1) is padding: zero
output, nothing read or written. These functions need torch only (not vLLM):
``tests/adapters/test_vllm_ling_ops.py`` checks them against a float64 step recurrence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import torch as _kt
from .._errors import InvalidTypeError, refuse
from .._options.arguments import check_lower_bound
from .._options.gates import sigmoid, softplus
from . import _patch, glm
from .ops import _shape, _start_past_the_step

__all__ = [
    "LAYER_MODULE", "NAMES", "OPS_MODULE", "ROTARY_MODULE", "chunk_kda", "fused_kda_gate",
    "fused_recurrent_kda", "fused_recurrent_kda_fwd", "install", "rotary_2d",
]  # fmt: skip

#: the module whose functions are replaced, and the model module that binds them at import
OPS_MODULE = "vllm.third_party.flash_linear_attention.ops.kda"
LAYER_MODULE = "vllm.model_executor.models.bailing_moe_v3"
#: the functions of :data:`OPS_MODULE` Ling-3's layer calls, each replaced by this module's
NAMES = ("chunk_kda", "fused_kda_gate", "fused_recurrent_kda", "fused_recurrent_kda_fwd")
#: the rotary embedding's module (its ``RotaryEmbedding.forward_cpu``: :func:`rotary_2d`)
ROTARY_MODULE = "vllm.model_executor.layers.rotary_embedding.base"
_ROTARY_SIGNATURE = "(self, positions, query, key=None)"


def fused_kda_gate(
    g: torch.Tensor,
    A: torch.Tensor,
    head_k_dim: int,
    g_bias: torch.Tensor | None = None,
    beta: float = 1.0,
    threshold: float = 20.0,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """The KDA log decay from the raw gate, in float32 (vLLM's ``fused_kda_gate``).

    Parameters
    ----------
    g : torch.Tensor
        ``[..., H * head_k_dim]``, the gate projection (any float dtype; row-strided views allowed).
    A : torch.Tensor
        ``A_log``: ``H`` elements, any shape (``[H]`` or ``[1, 1, H, 1]``).
    head_k_dim : int
        ``K``, the key head size.
    g_bias : torch.Tensor or None
        ``dt_bias``: ``H * K`` elements, added to ``g``.
    beta, threshold : float
        softplus's: ``softplus(x) = log(1 + exp(beta x)) / beta``, ``x`` itself where ``beta x >
        threshold`` (fla's and vLLM's kernel's); unused with ``lower_bound``.
    lower_bound : float or None
        Given: the bounded gate ``lower_bound * sigmoid(exp(A) * (g + g_bias))`` (a finite float
        < 0); None: ``-exp(A) * softplus(g + g_bias)``.

    Returns
    -------
    torch.Tensor
        ``[..., H, K]`` float32, every element ``<= 0``.
    """
    if not isinstance(g, torch.Tensor) or not isinstance(A, torch.Tensor):
        got = f"{type(g).__name__} and {type(A).__name__}"
        raise InvalidTypeError(f"fused_kda_gate: g and A must be torch.Tensors; got {got}")
    if isinstance(head_k_dim, bool) or not isinstance(head_k_dim, int) or head_k_dim < 1:
        raise InvalidTypeError(f"fused_kda_gate: head_k_dim must be an int >= 1; got {head_k_dim!r}")
    H, K = A.numel(), head_k_dim
    if g.ndim < 1 or g.shape[-1] != H * K:
        refuse(
            f"fused_kda_gate: g must be [..., H * head_k_dim] = [..., {H * K}] (H = {H}: A's elements); "
            f"got {_shape(g)}"
        )
    if g_bias is not None and (not isinstance(g_bias, torch.Tensor) or g_bias.numel() != H * K):
        want, got = H * K, _shape(g_bias)
        refuse(f"fused_kda_gate: g_bias must have H * head_k_dim = {want} elements or be None; got {got}")
    if lower_bound is not None:
        lower_bound = check_lower_bound(lower_bound, " or None")
    lead = tuple(g.shape[:-1])
    x = g.reshape(-1, H, K).float()
    if g_bias is not None:
        x = x + g_bias.reshape(H, K).float()
    a = torch.exp(A.reshape(H).float())[:, None]
    if lower_bound is not None:
        y = lower_bound * sigmoid(torch, a * x)
    else:
        scaled = x * beta
        y = -a * torch.where(scaled > threshold, x, softplus(torch, scaled) / beta)
    return y.reshape(*lead, H, K)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ling-3's chunked prefill (vLLM's ``chunk_kda``), on :func:`kda.torch.chunk_kda`.

    ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H, K]`` the log decay
    (:func:`fused_kda_gate`'s), ``beta [B, T, H]`` the step sizes (already sigmoided); ``B == 1``
    with ``cu_seqlens [N + 1]``. ``initial_state [N, H, V, K]`` is V-major (vLLM's pool rows,
    float32 or bfloat16) or None (zeros); ``scale`` defaults to ``K ** -0.5``. Returns ``(o [B, T,
    H, V] in v's dtype, final_state [N, H, V, K] float32, or None without output_final_state)``.
    vLLM's ``**kwargs`` (the layer's ``safe_gate`` and ``lower_bound``) are accepted and unused,
    as vLLM's kernel ignores them: ``g`` is already the log decay.
    """
    o, final = _kt.chunk_kda(
        q, k, v, g, beta,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, state_v_first=True,
    )  # fmt: skip
    return o.to(v.dtype), final


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor = None,  # vLLM's signature, kept
    scale: float = None,  # noqa: RUF013 (vLLM's signature, kept)
    initial_state: torch.Tensor = None,
    inplace_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ling-3's decode (vLLM's ``fused_recurrent_kda``): one token a request from the pool.

    ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H, K]`` the log decay, ``beta [B, T,
    H]`` the step sizes (already sigmoided); ``B == 1`` with ``cu_seqlens [N + 1]`` (packed
    requests), else ``N = B``. Request ``n`` continues slot ``ssm_state_indices[n]`` of the pool
    ``initial_state [slots, H, V, K]`` and writes its state back there, in place (``<= 0``:
    padding, zero output). ``scale`` defaults to ``K ** -0.5``. Returns ``(out [B, T, H, V] in k's
    dtype, initial_state)``. vLLM's ``**kwargs`` (``safe_gate``, ``lower_bound``) are accepted and
    unused, as vLLM's kernel ignores them.
    """
    return _recurrent(q, k, v, g, beta, scale, initial_state, inplace_final_state, cu_seqlens,
                      ssm_state_indices, None, use_qk_l2norm_in_kernel)  # fmt: skip


def fused_recurrent_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor,
    inplace_final_state: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ling-3's speculative verify (vLLM's ``fused_recurrent_kda_fwd``), and decode without
    ``num_accepted_tokens``.

    As :func:`fused_recurrent_kda`, with ``ssm_state_indices [>= N, W]`` a slot per step (the first
    ``N`` rows read) and ``num_accepted_tokens [>= N]``: request ``n`` starts from slot ``[n,
    num_accepted_tokens[n] - 1]`` and the state after its step ``t`` goes to slot ``[n, t]``, in
    place. A start past the request's steps (a step shorter than the accepted count, no draft
    found) is first copied to slot ``[n, 0]``, which step 0 overwrites. ``scale`` is required
    here (vLLM's layer passes ``K ** -0.5``). Returns ``(out [B, T, H, V] in k's dtype,
    initial_state)``.
    """
    return _recurrent(q, k, v, g, beta, scale, initial_state, inplace_final_state, cu_seqlens,
                      ssm_state_indices, num_accepted_tokens, use_qk_l2norm_in_kernel)  # fmt: skip


def _recurrent(
    q: Any, k: Any, v: Any, g: Any, beta: Any, scale: Any, initial_state: Any, inplace_final_state: bool,
    cu_seqlens: Any, ssm_state_indices: Any, num_accepted_tokens: Any, use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if not inplace_final_state:
        refuse(
            "inplace_final_state must be True: Ling-3's layer updates the state pool in place; kda does "
            "not return the per-token states of inplace_final_state=False"
        )
    if initial_state is None or ssm_state_indices is None:
        refuse("initial_state (the state pool) and ssm_state_indices must be given (both are read)")
    accepted = num_accepted_tokens
    if accepted is not None:
        if not isinstance(ssm_state_indices, torch.Tensor) or ssm_state_indices.ndim != 2:
            got = _shape(ssm_state_indices)
            refuse(f"num_accepted_tokens needs ssm_state_indices [N, W] (a slot per step); got {got}")
        if not isinstance(q, torch.Tensor) or q.ndim != 4:
            refuse(f"q must have shape [B, T, H, K]; got {_shape(q)}")
        if cu_seqlens is not None:
            offsets = cu_seqlens.tolist()
        else:
            offsets = [n * q.shape[1] for n in range(q.shape[0] + 1)]
        N = len(offsets) - 1
        if ssm_state_indices.shape[0] < N or accepted.ndim != 1 or accepted.shape[0] < N:
            refuse(
                f"ssm_state_indices and num_accepted_tokens must have at least N = {N} rows (one per "
                f"request); got {_shape(ssm_state_indices)} and {_shape(accepted)}"
            )
        accepted = _start_past_the_step(initial_state, ssm_state_indices[:N], accepted[:N], offsets)
    return glm.fused_recurrent_kda(
        q, k, v, g, beta,
        scale=scale, initial_state=initial_state, inplace_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        ssm_state_indices=ssm_state_indices, num_accepted_tokens=accepted,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# installing them in vLLM


def install() -> None:
    """Ling-3's ops in :data:`OPS_MODULE` and in :data:`LAYER_MODULE` (which binds them at import),
    and :func:`rotary_2d` in :data:`ROTARY_MODULE`, each as its module is imported (now if it is),
    through :mod:`kda.vllm._patch`: a vLLM function whose parameters are not vLLM 0.32's raises
    :class:`kda.vllm.VllmVersionError` naming it, with nothing changed. Idempotent."""
    _patch.when_imported(OPS_MODULE, _install_ops)
    _patch.when_imported(LAYER_MODULE, _install_ops)
    _patch.when_imported(ROTARY_MODULE, _install_rotary)


def _install_ops(module: Any) -> None:
    for name in NAMES:
        if module.__name__ == OPS_MODULE or hasattr(module, name):
            new = globals()[name]
            _patch.replace(module, name, new, signature=new)


def _install_rotary(module: Any) -> None:
    _patch.wrap(module.RotaryEmbedding, "forward_cpu", rotary_2d, signature=_ROTARY_SIGNATURE)


def rotary_2d(forward_cpu: Callable[..., Any]) -> Callable[..., Any]:
    """``RotaryEmbedding.forward_cpu`` given ``query [T, H * D]`` and ``key [T, HK * D]``, dense.

    vLLM-CPU's kernel (``ops.rotary_embedding``, in place) reads a 3-D ``query [T, H, D]`` (and any
    key that is not dense) with the wrong token stride: every token after the first is rotated with
    the wrong position (vLLM's own ``forward_native`` gives the right result; the CUDA kernel takes
    either shape). vLLM's generic MLA layer (``vllm/model_executor/layers/mla.py``, Ling-3's) calls
    it with ``q[..., qk_nope_head_dim:]`` (``[T, H, rope]``, strided) and ``k_pe [T, 1, rope]`` (a
    column slice of the latent projection): a prefill's logits then depend on the prompt's length.
    Here the kernel gets dense 2-D tensors (views where the inputs are dense, copies written back
    otherwise); ``query`` and ``key`` are rotated in place and returned, as vLLM's."""

    def rotated(self: Any, positions: Any, query: Any, key: Any = None) -> tuple[Any, Any]:
        tokens = positions.numel()
        flat_q = query.contiguous().view(tokens, -1)
        flat_k = None if key is None else key.contiguous().view(tokens, -1)
        forward_cpu(self, positions, flat_q, flat_k)
        for given, flat in ((query, flat_q), (key, flat_k)):
            if given is not None and flat.data_ptr() != given.data_ptr():
                given.copy_(flat.view(given.shape))
        return query, key

    rotated.__name__ = rotated.__qualname__ = "forward_cpu"
    return rotated
