"""kda.vllm._patch: the one way kda.vllm changes vLLM's modules and classes (replace, wrap, undo,
import hooks), on fake modules and classes built here (no vLLM), then on vLLM where it is
installed: every patch :func:`kda.vllm.register` makes is undone to vLLM's original, and a renamed or
changed vLLM function is refused by name.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings

import pytest

import kda

patch = pytest.importorskip("kda.vllm._patch")


@pytest.fixture(autouse=True)
def _isolated():
    """Every test leaves the patches and hooks as it found them."""
    with patch.patches():
        yield


def _module(monkeypatch, name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(source, vars(module))
    monkeypatch.setitem(sys.modules, name, module)
    return module


FAKE = """
def f(x, y=None):
    return ("vllm", x, y)

class Backend:
    def run(self, q, out=None):
        return ("vllm run", q)

    @classmethod
    def supports(cls, block_size):
        return block_size == 16

    @staticmethod
    def helper(a, *, b=1):
        return ("vllm helper", a, b)

class CpuBackend(Backend):
    pass
"""


@pytest.fixture
def fake(monkeypatch):
    return _module(monkeypatch, "kda_fake_vllm.ops", FAKE)


def mine(x, y=None):
    return ("kda", x, y)


# ----------------------------------------------------------------------------------------------
# the signature check


def test_replace_checks_and_installs(fake):
    original = fake.f
    record = patch.replace(fake, "f", mine, signature="(x, y=None)")
    assert fake.f is mine and fake.f(1) == ("kda", 1, None)
    assert record.original is original and record.where == "kda_fake_vllm.ops.f"
    assert patch.is_patched(fake, "f") and patch.is_replacement(fake.f) and not patch.is_replacement(original)
    assert patch.applied() == [record]


@pytest.mark.parametrize(
    ("source", "expected", "found"),
    [
        ("def f(x, y=None, z=None): pass", "f(x, y)", "f(x, y=None, z=None)"),  # a parameter added
        ("def f(x, z=None): pass", "f(x, y)", "f(x, z=None)"),  # renamed
        ("def f(x, *, y=None): pass", "f(x, y)", "f(x, *, y=None)"),  # keyword-only now
        ("def f(x, /, y=None): pass", "f(x, y)", "f(x, /, y=None)"),  # positional-only now
        ("f = 3", "f(x, y)", "int 3 (not a function)"),
        ("def g(x, y=None): pass", "f(x, y)", "no such attribute"),  # the function renamed
    ],
)
def test_changed_function_refused_by_name(monkeypatch, source, expected, found):
    """A vLLM whose function was renamed or whose parameters changed: VllmVersionError naming the
    module, the attribute, the signature written against and the one found; nothing changed."""
    module = _module(monkeypatch, "kda_fake_vllm.changed", source)
    before = dict(vars(module))
    with pytest.raises(patch.VllmVersionError) as err:
        patch.replace(module, "f", mine, signature="(x, y=None)")
    message = str(err.value)
    assert "kda_fake_vllm.changed.f" in message and expected in message and found in message
    assert isinstance(err.value, kda.KdaError) and "KDA_VLLM=0" in message
    assert vars(module) == before and patch.applied() == []


def test_signature_forms(fake):
    """Defaults and annotations do not count; a callable's own signature is accepted; a value is
    patched with ``signature=None`` (a function is not); a malformed signature is refused."""
    patch.replace(fake, "f", mine, signature="(x: int, y: str | None = 'a') -> tuple")
    patch.replace(fake, "f", mine, signature=mine)
    value = types.SimpleNamespace(simdlen=None)
    patch.replace(value, "simdlen", 256, signature=None)
    patch.replace(value, "simdlen", 512, signature=None)
    assert value.simdlen == 512 and patch.is_patched(value, "simdlen")
    patch.undo(value, "simdlen")
    assert value.simdlen is None, "the first original kept (a value carries no mark)"
    with pytest.raises(patch.VllmVersionError, match=r"written against a value \(not a function\)"):
        patch.replace(fake, "f", mine, signature=None)
    with pytest.raises(kda.KdaError, match="def line's parameter list"):
        patch.replace(fake, "f", mine, signature="x, y")
    with pytest.raises(patch.VllmVersionError, match=r"written against f\(x\), found f\(x, y=None\)"):
        patch.replace(fake, "f", mine, signature=lambda x: x)


# ----------------------------------------------------------------------------------------------
# classes: methods, classmethods, staticmethods, inherited


def test_methods_of_every_kind(fake):
    Backend = fake.Backend
    patch.wrap(
        Backend,
        "run",
        lambda run: lambda self, q, out=None: ("kda", run(self, q)),
        signature="(self, q, out=None)",
    )
    patch.replace(
        Backend, "supports", lambda cls, block_size: block_size % 16 == 0, signature="(cls, block_size)"
    )
    patch.wrap(Backend, "helper", lambda h: lambda a, *, b=1: ("kda", h(a, b=b)), signature="(a, *, b)")
    assert isinstance(vars(Backend)["supports"], classmethod) and isinstance(
        vars(Backend)["helper"], staticmethod
    )
    assert Backend().run(1) == ("kda", ("vllm run", 1))
    assert Backend.supports(32) and fake.CpuBackend.supports(48)
    assert Backend.helper(2, b=3) == ("kda", ("vllm helper", 2, 3))
    assert all(patch.is_replacement(vars(Backend)[n]) for n in ("run", "supports", "helper"))
    with pytest.raises(
        patch.VllmVersionError,
        match=r"kda_fake_vllm\.ops\.Backend\.supports: written against supports\(cls\)",
    ):
        patch.replace(Backend, "supports", lambda cls: True, signature="(cls)")
    patch.undo_all()
    assert not Backend.supports(32) and Backend().run(1) == ("vllm run", 1)
    assert Backend.helper(2) == ("vllm helper", 2, 1)


def test_inherited_method_patched_on_the_subclass_and_undone(fake):
    """A method the class inherits is set on the class itself; undoing deletes it (the base's
    shows again), the base untouched throughout."""
    Cpu, base_run = fake.CpuBackend, vars(fake.Backend)["run"]
    patch.wrap(Cpu, "run", lambda run: lambda self, q, out=None: "kda", signature="(self, q, out=None)")
    assert Cpu().run(1) == "kda" and fake.Backend().run(1) == ("vllm run", 1)
    patch.undo(Cpu, "run")
    assert "run" not in vars(Cpu) and vars(fake.Backend)["run"] is base_run


# ----------------------------------------------------------------------------------------------
# idempotence, undo


def test_patching_twice_keeps_the_first_original_and_wraps_once(fake):
    original = fake.f
    seen = []

    def make(f):
        seen.append(f)
        return lambda x, y=None: ("kda", f(x, y))

    patch.wrap(fake, "f", make, signature="(x, y=None)")
    patch.wrap(fake, "f", make, signature="(x, y=None)")
    assert seen == [original, original], "each wrap is built on vLLM's original, not the previous wrapper"
    assert fake.f(1) == ("kda", ("vllm", 1, None))
    record = patch.replace(fake, "f", mine, signature="(x, y=None)")
    assert record.original is original and len(patch.applied()) == 1
    patch.undo_all()
    assert fake.f is original and patch.applied() == [] and not patch.is_patched(fake, "f")


def test_undo_all_restores_names_bound_after_the_patch(fake, monkeypatch):
    """A vLLM module that bound a replacement by name (``from ops import f`` after the patch) gets
    vLLM's original back; patching that module records vLLM's original, not the replacement."""
    original = fake.f
    patch.replace(fake, "f", mine, signature="(x, y=None)")
    user = _module(monkeypatch, "kda_fake_vllm.user", "from kda_fake_vllm.ops import f\n")
    other = _module(monkeypatch, "kda_fake_vllm.other", "from kda_fake_vllm.ops import f\n")
    assert user.f is mine and other.f is mine
    record = patch.replace(user, "f", mine, signature="(x, y=None)")
    assert record.original is original
    patch.undo_all()
    assert fake.f is original and user.f is original and other.f is original
    assert mine.__module__ == __name__ and globals()["mine"] is mine, (
        "modules outside vLLM's package untouched"
    )


def test_patches_block_restores_the_state_on_entry(fake):
    original = fake.f
    before = patch.replace(
        fake.Backend, "supports", lambda cls, block_size: True, signature="(cls, block_size)"
    )
    with patch.patches() as made:
        patch.replace(fake, "f", mine, signature="(x, y=None)")
        patch.undo(fake.Backend, "supports")
        assert [p.name for p in made] == ["f"]
    assert fake.f is original and vars(fake.Backend)["supports"] is before.new
    assert patch.applied() == [before]


def test_all_or_nothing_reverts_a_failed_install(fake):
    original = fake.f
    with pytest.raises(patch.VllmVersionError), patch.all_or_nothing():
        patch.replace(fake, "f", mine, signature="(x, y=None)")
        patch.replace(fake.Backend, "gone", mine, signature="(x)")
    assert fake.f is original and patch.applied() == []
    with patch.all_or_nothing():
        patch.replace(fake, "f", mine, signature="(x, y=None)")
    assert fake.f is mine


# ----------------------------------------------------------------------------------------------
# import hooks


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``kda_fake_pkg`` on disk (``ops`` with ``f``, ``layer`` importing ``f`` by name),
    not imported; ``sys.meta_path`` restored after the test."""
    pkg = tmp_path / "kda_fake_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ops.py").write_text("def f():\n    return 'vllm'\n")
    (pkg / "layer.py").write_text("from kda_fake_pkg.ops import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in ("kda_fake_pkg", "kda_fake_pkg.ops", "kda_fake_pkg.layer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return pkg


def test_several_hooks_per_module(package):
    """Two hooks for one module both run, in order, before an importer binds the names; the same
    hook registered twice runs once; a hook registered once the module is imported runs at once."""
    seen = []

    def first(module):
        seen.append("first")
        patch.replace(module, "f", lambda: "kda", signature="()")

    def second(module):
        seen.append("second")

    patch.when_imported("kda_fake_pkg.ops", first)
    patch.when_imported("kda_fake_pkg.ops", second)
    patch.when_imported("kda_fake_pkg.ops", first)
    assert "kda_fake_pkg.ops" not in sys.modules and seen == []
    layer = importlib.import_module("kda_fake_pkg.layer")
    assert seen == ["first", "second"] and layer.f() == "kda"
    patch.when_imported("kda_fake_pkg.ops", second)  # registered: not again
    patch.when_imported("kda_fake_pkg.ops", lambda m: seen.append("late"))
    assert seen == ["first", "second", "late"]


def test_undo_all_drops_the_hooks(package):
    seen = []
    patch.when_imported("kda_fake_pkg.ops", seen.append)
    patch.undo_all()
    assert not any(type(f).__name__ == "_ImportHooks" for f in sys.meta_path)
    importlib.import_module("kda_fake_pkg.ops")
    assert seen == []


def test_a_failing_hook_fails_the_import_and_is_not_kept(package, monkeypatch):
    """A hook whose patch is refused fails the import with the error naming the attribute; run at
    once (the module imported), it is not kept: registering it again runs it again."""
    calls = []

    def renamed(module):
        calls.append(module.__name__)
        patch.replace(module, "g", lambda: "kda", signature="()")

    patch.when_imported("kda_fake_pkg.ops", renamed)
    with pytest.raises(
        patch.VllmVersionError, match=r"kda_fake_pkg\.ops\.g: written against g\(\), found no such"
    ):
        importlib.import_module("kda_fake_pkg.ops")
    extra = _module(monkeypatch, "kda_fake_pkg_extra", "")
    for _ in range(2):
        with pytest.raises(patch.VllmVersionError, match=r"kda_fake_pkg_extra\.g"):
            patch.when_imported("kda_fake_pkg_extra", renamed)
    assert calls == ["kda_fake_pkg.ops", "kda_fake_pkg_extra", "kda_fake_pkg_extra"]
    assert extra.__dict__.keys() >= {"__name__"} and "g" not in vars(extra)


# ----------------------------------------------------------------------------------------------
# kda.vllm's own patches, without vLLM: the override scan, the convolution dispatch, the fix table

kv = pytest.importorskip("kda.vllm")

# vLLM 0.32's _rebind_kernels (vllm/triton_utils/dispatcher.py), as it reads sys.modules
VLLM_REBIND = """
import sys

def _rebind_kernels(overrides):
    originals = {original: wrapper for original, wrapper in overrides}

    def lookup(value):
        for original in originals:
            if value is original:
                return originals[original]
        return None

    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            wrapper = lookup(value)
            if wrapper is not None:
                setattr(module, attr, wrapper)
                continue
            if hasattr(value, "__dict__"):
                wrapper = lookup(vars(value).get("kernel"))
            if wrapper is None:
                continue
            value.kernel = wrapper
            if not isinstance(value, type):
                value.__dict__.pop("_kernel_arg_names", None)
"""


def test_override_scan_skips_odd_namespaces(monkeypatch):
    """vLLM's scan, wrapped, rebinds module attributes (a module holding an odd value too) and a
    warmup owner's ``kernel`` (a class's too), and passes over a value whose ``__dict__`` is not a
    mapping (llvmlite's ``ffi.lib``), where vLLM's own fails."""

    class LibWrapper:  # llvmlite's _lib_wrapper: any attribute, __dict__ included, is a function wrapper
        def __getattribute__(self, name):
            return lambda *a: None

    dispatcher = _module(monkeypatch, "kda_fake_vllm.dispatcher", VLLM_REBIND)
    original, wrapper = object(), object()

    class Owner:
        kernel = original

    inst = types.SimpleNamespace(kernel=original, _kernel_arg_names=("x",))
    mod = _module(monkeypatch, "kda_fake_vllm.holder", "")
    mod.lib, mod.k, mod.Owner, mod.inst = LibWrapper(), original, Owner, inst
    with warnings.catch_warnings(), pytest.raises(AttributeError):  # hasattr on deprecated attributes warns
        warnings.simplefilter("ignore")
        dispatcher._rebind_kernels([(original, wrapper)])
    patch.wrap(dispatcher, "_rebind_kernels", kv._scan_without_odd_namespaces, signature="(overrides)")
    dispatcher._rebind_kernels([(original, wrapper)])
    assert mod.k is wrapper and Owner.kernel is wrapper and inst.kernel is wrapper
    assert not hasattr(inst, "_kernel_arg_names") and isinstance(mod.lib, LibWrapper)
    changed = _module(monkeypatch, "kda_fake_vllm.changed", "def _rebind_kernels(overrides):\n    pass\n")
    with pytest.raises(patch.VllmVersionError, match="does not read it"):
        patch.wrap(changed, "_rebind_kernels", kv._scan_without_odd_namespaces, signature="(overrides)")


CPU_CONV = "(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, query_start_loc=None, pad_slot_id=None, **kwargs)"  # noqa: E501
GENERIC_CONV = "(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, num_accepted_tokens=None, query_start_loc=None, max_query_len=-1, null_block_id=0, out=None)"  # noqa: E501


@pytest.mark.parametrize("signature", [CPU_CONV, GENERIC_CONV], ids=["cpu", "generic"])
def test_conv_dispatch_by_bound_arguments(monkeypatch, signature):
    """``causal_conv1d_update`` goes to kda's speculative update when the call's arguments, bound
    to vLLM's signature, carry ``num_accepted_tokens``, whatever their count; else to vLLM's."""
    pytest.importorskip("torch")
    fixes = pytest.importorskip("kda.vllm.speculative_fixes")
    spec = pytest.importorskip("kda.vllm.speculative")
    calls = []
    fake = _module(
        monkeypatch, "kda_fake_vllm.conv", f"def causal_conv1d_update{signature}:\n    return 'vllm'\n"
    )
    monkeypatch.setattr(spec, "causal_conv1d_update_spec", lambda **kw: calls.append(kw) or "kda")
    patch.wrap(fake, "causal_conv1d_update", fixes._conv_dispatch, signature=signature)
    conv = fake.causal_conv1d_update
    x, state, w, b, qsl, acc = "x", "state", "w", "b", "qsl", "acc"
    assert conv(x, state, w, b, "silu", "idx") == "vllm"
    assert conv(x, state, w, b, "silu", "idx", None, None) == "vllm"  # 8 positional: not speculative
    assert (
        conv(x, state, w, b, activation="silu", conv_state_indices="idx", num_accepted_tokens=None) == "vllm"
    )
    assert conv(x, state, w, b, activation="silu", num_accepted_tokens=acc, query_start_loc=qsl) == "kda"
    assert calls[-1]["num_accepted_tokens"] == acc and calls[-1]["query_start_loc"] == qsl
    assert calls[-1]["x"] == x and calls[-1]["bias"] == b
    if "num_accepted_tokens=None, query" in signature:  # a parameter of its own: by position too
        assert conv(x, state, w, b, "silu", "idx", acc, qsl) == "kda"
        assert calls[-1]["num_accepted_tokens"] == acc and calls[-1]["query_start_loc"] == qsl
    else:
        assert conv(x, state, w, b, "silu", "idx", qsl, 7, num_accepted_tokens=acc) == "kda"
        assert calls[-1]["query_start_loc"] == qsl and calls[-1]["null_block_id"] == 7


def test_fix_table(monkeypatch):
    """Each fix names its vLLM module and an installer; a fix given as ``"module:function"`` is
    imported when its module is; what it patched is recorded, and :func:`installed` says so until
    it is undone."""
    fixes = pytest.importorskip("kda.vllm.cpu_fixes")
    assert fixes.NAMES == tuple(f.name for f in fixes.FIXES) and len(set(fixes.NAMES)) == len(fixes.NAMES)
    for fix in fixes.FIXES:
        assert fix.module.split(".")[0] in ("vllm", "torch")
        assert callable(fix.fix) or (fix.fix.startswith("kda.") and ":" in fix.fix), fix
    fake = _module(monkeypatch, "kda_fake_vllm.ops", FAKE)
    _module(
        monkeypatch,
        "kda_fake_fixes",
        "from kda.vllm import _patch\n"
        "def fill(m):\n"
        "    _patch.replace(m, 'f', lambda x, y=None: 'kda', signature='(x, y=None)')\n",
    )
    lazy = fixes.Fix("demo", "kda_fake_vllm.ops", "kda_fake_fixes:fill")
    monkeypatch.setattr(fixes, "FIXES", (*fixes.FIXES, lazy))
    monkeypatch.setattr(fixes, "NAMES", (*fixes.NAMES, "demo"))
    monkeypatch.setenv("KDA_VLLM_SKIP", ",".join(n for n in fixes.NAMES if n != "demo"))
    monkeypatch.setattr(fixes, "_installed", {})
    fixes.install()
    assert fake.f(1) == "kda" and fixes.installed()["demo"]
    fixes.install()  # again: the same hook, not run twice
    assert len(patch.applied()) == 1
    patch.undo_all()
    assert fake.f(1) == ("vllm", 1, None) and not fixes.installed()["demo"]


# ----------------------------------------------------------------------------------------------
# with vLLM: kda.vllm.register() and undo_all() on vLLM's own modules


@pytest.fixture
def vllm_cpu():
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("kda.vllm installs on vLLM's CPU platform only")
    fixes = importlib.import_module("kda.vllm.cpu_fixes")
    for fix in fixes.FIXES:  # the modules the fixes patch, imported before (as a server does)
        importlib.import_module(fix.module)
    patch.undo_all()  # in case importing them loaded vLLM's plugins
    return fixes


def _namespaces() -> dict[int, tuple[object, dict]]:
    """Every vLLM module's namespace and that of each class defined in it, copied."""
    out = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "vllm" or not isinstance(getattr(module, "__dict__", None), dict):
            continue
        out[id(module)] = (module, dict(vars(module)))
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                out[id(value)] = (value, dict(vars(value)))
    return out


@pytest.mark.filterwarnings("ignore")  # importing vLLM warns (torch's deprecations)
def test_register_then_undo_all_gives_vllm_back(vllm_cpu, monkeypatch):
    """After ``kda.vllm.register()``, every patched attribute is vLLM's original again once
    ``undo_all`` ran, and no vLLM module or class keeps anything of kda."""
    monkeypatch.delenv("KDA_VLLM", raising=False)
    monkeypatch.delenv("KDA_VLLM_SKIP", raising=False)
    before = _namespaces()
    simdlen = sys.modules["torch._inductor.config"].cpp.simdlen
    kv.register()
    assert kv.is_registered()
    made = patch.applied()
    where = {p.where for p in made}
    for name in ("fused_recurrent_kda_packed_decode", "chunk_kda_with_fused_gate", "fused_recurrent_kda"):
        assert f"vllm.models.kimi_k3.nvidia.ops.third_party.kda.{name}" in where
    assert "vllm.triton_utils.dispatcher._rebind_kernels" in where
    assert "vllm.platforms.cpu.CpuPlatform.check_and_update_config" in where
    assert all(vllm_cpu.installed().values()), vllm_cpu.installed()
    for p in made:
        if id(p.owner) in before:
            assert before[id(p.owner)][1].get(p.name) is p.original, p.where
    patch.undo_all()
    assert not kv.is_registered() and patch.applied() == []
    for p in made:
        if id(p.owner) in before:
            stored = vars(p.owner).get(p.name)
            assert stored is before[id(p.owner)][1].get(p.name), f"{p.where} is not vLLM's original"
    after = _namespaces()
    for key, (owner, namespace) in before.items():
        now = after[key][1]
        changed = [k for k in namespace if namespace[k] is not now.get(k)]
        changed += [k for k in now.keys() - namespace.keys() if not isinstance(now[k], types.ModuleType)]
        assert not changed, (owner, changed)
    assert sys.modules["torch._inductor.config"].cpp.simdlen == simdlen
    assert not any(vllm_cpu.installed().values())


@pytest.mark.filterwarnings("ignore")
def test_register_refuses_a_renamed_vllm_function(vllm_cpu, monkeypatch):
    """A vLLM whose Kimi Linear op is renamed, or whose platform hook takes other parameters: the
    error names it, and register() leaves nothing changed."""
    monkeypatch.delenv("KDA_VLLM", raising=False)
    ops = importlib.import_module("vllm.models.kimi_k3.nvidia.ops.third_party.kda")
    monkeypatch.setattr(ops, "fused_recurrent_kda_v2", ops.fused_recurrent_kda, raising=False)
    monkeypatch.delattr(ops, "fused_recurrent_kda")
    with pytest.raises(kv.VllmVersionError) as err:
        kv.register()
    assert "vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent_kda" in str(err.value)
    assert "no such attribute" in str(err.value)
    assert patch.applied() == [] and not kv.is_registered()
    monkeypatch.undo()
    monkeypatch.delenv("KDA_VLLM", raising=False)
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(
        CpuPlatform, "check_and_update_config", classmethod(lambda cls, config, extra=None: None)
    )
    expected = (
        r"CpuPlatform\.check_and_update_config: written against check_and_update_config\(cls, vllm_config\)"
    )
    with pytest.raises(kv.VllmVersionError, match=expected + r", found check_and_update_config\(cls, config"):
        kv.register()
    assert patch.applied() == [] and not kv.is_registered()
