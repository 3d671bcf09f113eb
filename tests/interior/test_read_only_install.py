"""Every NumPy entry point from a read-only install, run by a user who can write no cache.

The package is copied as an installer would lay it out (no ``__pycache__``, so no compiled
kernel to load) into a temporary site directory, which is then made read-only; a child Python
with only that directory on its path runs every NumPy entry point on the cpu backend (the
chunked forward and backward, the transitions, the recurrence and its backward, decode,
prepared decode, decode into float16 and bfloat16 pools, and ``kda.torch.fused_recurrent_kda``
decoding CPU tensors from a pool where PyTorch is installed), with ``HOME`` unwritable and no
``NUMBA_CACHE_DIR``: Numba finds no cache directory; kda's fallback, a private directory of the
user's in the temporary directory (``TMPDIR``: a fresh sticky directory here), takes the compiled
kernels. The child first checks that it indeed cannot write the package's ``__pycache__`` or a
cache under ``HOME``, then prints a hash of every result; they must equal the hashes of the same
calls in this (cached) process, bitwise. It runs twice: the first process compiles every kernel
(Numba's ``numba:compile`` events of kda functions counted), the second compiles none (its first
call is warm: loaded from the fallback cache) and gives the same bits.

Who runs the child: a non-root user (``kda-readonly``, added with ``useradd`` if absent) where
every directory above the interpreter is open to other users; where it is not (an interpreter
under a private ``/root``, as in some containers), root with every capability dropped (no
``CAP_DAC_OVERRIDE``: the file modes bind it as they bind any user) and an unwritable ``HOME``.
It needs root to set either up (and ``setpriv``): skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from helpers import BACKENDS

import kda

if "cpu" not in BACKENDS:
    pytest.skip("the cpu backend needs numba and scipy", allow_module_level=True)
if not hasattr(os, "geteuid") or os.geteuid() != 0:
    pytest.skip("needs root, to run the child as a user who can write no cache", allow_module_level=True)
if shutil.which("setpriv") is None:
    pytest.skip("needs setpriv (util-linux), to run the child as another user", allow_module_level=True)

USER = "kda-readonly"

# The calls (run here and in the child): ``results()`` returns every output by name.
CALLS = """
import numpy as np
import kda


def results():
    rng = np.random.default_rng(0)
    out = {}
    B, H, T, K, V = 1, 2, 80, 16, 32  # T > the cpu backend's RECURRENT_MAX_T: the chunked route
    q, k = (rng.standard_normal((B, H, T, K)).astype(np.float32) for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, H, T, V)).astype(np.float32)
    g = -rng.uniform(0, 1, (B, H, T, K)).astype(np.float32)
    g[0, 1, 40, :] = -np.inf  # a hard reset
    beta = rng.uniform(0, 1, (B, H, T)).astype(np.float32)
    s0 = rng.standard_normal((B, H, K, V)).astype(np.float32)
    do = rng.standard_normal((B, H, T, V)).astype(np.float32)
    ds = rng.standard_normal((B, H, K, V)).astype(np.float32)
    x = (q, k, v, g, beta)

    o = kda.chunk_kda(*x, initial_state=s0, chunk_size=32, save_boundaries=True)
    out["chunk_kda"] = (o.output, o.final_state, o.boundaries)
    out["chunk_kda_backward"] = tuple(
        kda.chunk_kda_backward(*x, o.boundaries, do, ds, initial_state=s0, chunk_size=32)
    )
    t = kda.chunk_kda_transition(*x, chunk_size=32)
    out["chunk_kda_transition"] = tuple(t)
    out["chunk_kda_transition_backward"] = tuple(
        kda.chunk_kda_transition_backward(*x, do, chunk_size=32)
    )
    r = kda.recurrent_kda(*x, initial_state=s0)
    out["recurrent_kda"] = (r.output, r.final_state)
    out["recurrent_kda_backward"] = tuple(kda.recurrent_kda_backward(*x, do, ds, initial_state=s0))

    N, P = 3, 5
    step = [y[:, :, :1] for y in x]
    step = [np.ascontiguousarray(np.repeat(y, N, axis=0)) for y in step]
    idx = np.array([3, 0, 4], np.int64)
    pools = {"float32": np.float32, "float16": np.float16}
    try:
        import ml_dtypes
    except ImportError:
        pass
    else:
        pools["bfloat16"] = ml_dtypes.bfloat16
    for name, dt in pools.items():
        pool = rng.standard_normal((P, H, K, V)).astype(dt)
        o1 = kda.decode_kda(*step, pool, idx)
        out[f"decode_kda {name}"] = (o1, pool.view(np.uint8))
        plan = kda.prepare_decode_kda(*step, pool, idx)
        out[f"prepare_decode_kda {name}"] = (np.array(plan.run()), np.array(plan.run()), pool.view(np.uint8))
    try:
        import torch
    except ImportError:
        return out
    import kda.torch as kt

    pool = torch.from_numpy(rng.standard_normal((P, H, K, V)).astype(np.float32))
    tq, tk, tv, tg, tb = (torch.from_numpy(np.ascontiguousarray(np.swapaxes(y, 1, 2))) for y in step)
    with torch.inference_mode():
        o, final = kt.fused_recurrent_kda(tq, tk, tv, tg, tb, initial_state=pool,
                                          ssm_state_indices=torch.from_numpy(idx), inplace_final_state=True)
    out["kda.torch.fused_recurrent_kda pool"] = (o.numpy(), final.numpy())
    return out


def digests():
    import hashlib

    lines = []
    for name, arrays in results().items():
        h = hashlib.sha256()
        for a in arrays:
            if a is None:  # a gradient not asked for (A_log, dt_bias)
                h.update(b"None")
                continue
            a = np.ascontiguousarray(a)
            h.update(str((a.dtype.str, a.shape)).encode() + a.tobytes())
        lines.append(f"{name}: {h.hexdigest()}")
    return lines
"""

# The child: checks it can write no cache, then prints the digests.
CHILD = """
import os, sys
site, home = sys.argv[1], os.environ["HOME"]
for where in (os.path.join(site, "kda", "cpu", "__pycache__"), os.path.join(home, ".cache", "numba")):
    try:
        os.makedirs(where)
    except OSError:
        continue
    raise SystemExit(f"not a read-only setup: {{where}} could be created")
assert "NUMBA_CACHE_DIR" not in os.environ and "XDG_CACHE_HOME" not in os.environ
from numba.core import event
compiled = []
class Count(event.Listener):
    def on_start(self, ev):
        pass
    def on_end(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__module__)
event.register("numba:compile", Count())
import kda
assert kda.__file__.startswith(site), kda.__file__
{calls}
for line in digests():
    print(line)
from kda.cpu import _compile
print("cache", _compile.CACHE)
print("compiled", sum(m.startswith("kda.") for m in compiled))
"""


def _open_to_others(path: str) -> bool:
    """Whether every directory above ``path`` lets other users through (``o+x``)."""
    p = Path(path).resolve()
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in p.parents)


def _runner(tmp: Path) -> tuple[list[str], str]:
    """The command prefix that runs the child, and its ``HOME``."""
    interpreter = [sys.executable, os.path.realpath(sys.executable), sys.base_prefix, sys.prefix]
    if all(_open_to_others(p) for p in interpreter):
        if subprocess.run(["id", USER], capture_output=True).returncode != 0:
            if shutil.which("useradd") is None:
                pytest.skip("needs useradd, to add a user who runs the child")
            add = ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell",
                   "/usr/sbin/nologin", USER]  # fmt: skip
            subprocess.run(add, check=True, capture_output=True)
        return ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups"], "/nonexistent"
    # the interpreter is private to root here: root without capabilities, HOME read-only
    home = tmp / "home"
    home.mkdir()
    home.chmod(0o555)
    return ["setpriv", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all"], str(home)


def _read_only_copy(tmp: Path) -> Path:
    """The package in ``tmp/site``, laid out as an install (no ``__pycache__``), every file and
    directory without write permission."""
    site = tmp / "site"
    shutil.copytree(Path(kda.__file__).parent, site / "kda", ignore=shutil.ignore_patterns("__pycache__"))
    for root, _dirs, files in os.walk(site):
        for name in files:
            os.chmod(os.path.join(root, name), 0o444)
        os.chmod(root, 0o555)
    return site


@pytest.mark.slow  # every kernel compiled in the first child: minutes of compiling on 2 cores
def test_every_numpy_entry_point_runs_from_a_read_only_install_and_starts_warm_the_second_time():
    # not pytest's tmp_path: its base directory is private to root, and the child may be another user
    with tempfile.TemporaryDirectory(prefix="kda-read-only-") as name:
        tmp = Path(name)
        tmp.chmod(0o755)
        site = _read_only_copy(tmp)
        prefix, home = _runner(tmp)
        temp = tmp / "tmp"  # the child's temporary directory, as /tmp: anyone may add, none remove
        temp.mkdir()
        temp.chmod(0o1777)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "PYTHONPATH": str(site),
               "TMPDIR": str(temp)}  # fmt: skip
        code = textwrap.dedent(CHILD).format(calls=CALLS)
        runs = []
        try:
            for _ in range(2):
                runs.append(subprocess.run([*prefix, sys.executable, "-s", "-c", code, str(site)], cwd=tmp,
                                           env=env, capture_output=True, text=True, timeout=900))  # fmt: skip
                assert runs[-1].returncode == 0, runs[-1].stderr[-6000:]
        finally:
            for root, _dirs, _files in os.walk(site):
                os.chmod(root, 0o755)  # so that the copy can be removed
    namespace: dict = {}
    exec(compile(CALLS, "<calls>", "exec"), namespace)
    want = namespace["digests"]()
    first, second = (r.stdout.splitlines() for r in runs)
    # Numba found no cache: kda's fallback in the child's temporary directory took the kernels
    assert first[-2].startswith(f"cache {temp}{os.sep}kda-numba-"), first[-2]
    assert int(first[-1].split()[1]) > 0, first[-1]  # the first process compiled them
    assert first[:-2] == want  # every entry point, bitwise what the cached kernels give here
    assert second[-2] == first[-2]
    assert second[-1] == "compiled 0", second[-1]  # the second process started warm
    assert second[:-2] == want
