"""Run flash-linear-attention's own KDA tests (``tests/ops/test_kda.py``) against ``kda.torch``.

fla's Triton kernels do not run on a CPU, so a small ``fla`` package is built in a temporary
directory: ``fla.ops.kda.chunk_kda`` / ``fused_recurrent_kda`` are kda.torch's, the references
(``naive.py``, the naive gates of ``gate.py``, ``assert_close`` of ``utils/testing.py``) are fla's
own files, and ``triton.next_power_of_2`` / ``cdiv`` are replaced by Python in the test file.
Everything else in the test file (inputs, references, tolerances) is unchanged, except with
``--nonpositive-g``: ``test_chunk_return_intermediate_states`` draws its log decays ``g`` from
``randn`` (positive values, which make the state grow; it checks shapes only) and kda refuses
positive log decays, so that option draws ``-|randn|`` instead.

    python benchmarks/run_fla_tests.py --fla /path/to/fla-source-root --tests /path/to/test_kda.py \\
        [--nonpositive-g] [-- pytest args, e.g. -k "varlen or intermediate"]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_TRITON = (
    "import types\ntriton = types.SimpleNamespace(next_power_of_2=lambda n: 1 << (int(n) - 1).bit_length(), "
    "cdiv=lambda a, b: -(-a // b))  # no Triton on a CPU\n"
)


def _grab(source: str, name: str) -> str:
    start = source.index(f"def {name}(")
    end = source.index("return g.to(output_dtype)", start) + len("return g.to(output_dtype)")
    return source[start:end]


def build(fla_root: Path, tests: Path, out: Path, nonpositive_g: bool) -> Path:
    """The shim package and a patched copy of the test file under ``out``; returns the copy."""
    kda_dir = out / "fla" / "ops" / "kda"
    (out / "fla" / "ops" / "utils").mkdir(parents=True)
    kda_dir.mkdir(parents=True)
    for init in ("fla/__init__.py", "fla/ops/__init__.py", "fla/ops/utils/__init__.py"):
        (out / init).write_text("")
    (out / "fla/ops/utils/cache.py").write_text(
        "class _Mode:\n    def uses_default_config(self):\n        return False\n\n\n"
        "FLA_CACHE_MODE = _Mode()\n"
    )
    (kda_dir / "__init__.py").write_text(
        "from kda.torch import chunk_kda, fused_recurrent_kda  # under test\n"
    )
    (kda_dir / "fused_recurrent.py").write_text(
        "def fused_recurrent_kda_fwd(*args, **kwargs):\n    raise NotImplementedError('vLLM decode kernel')\n"
    )
    (kda_dir / "naive.py").write_text((fla_root / "fla/ops/kda/naive.py").read_text())
    gate = (fla_root / "fla/ops/kda/gate.py").read_text()
    (kda_dir / "gate.py").write_text(
        "import torch\nimport torch.nn.functional as F\n\n\n"
        + _grab(gate, "naive_kda_gate") + "\n\n\n" + _grab(gate, "naive_kda_lowerbound_gate")
        + "\n\n\nfused_kda_gate = None  # fla's Triton gate: not under test\n"
    )  # fmt: skip
    testing = (fla_root / "fla/utils/testing.py").read_text()
    testing = testing.replace("from fla.utils.env import FLA_CI_ENV", "FLA_CI_ENV = False")
    (out / "fla/utils.py").write_text(
        testing + "\nIS_INTEL_ALCHEMIST = IS_NPU = IS_NVIDIA = False\ndevice = 'cpu'\n"
    )
    text = tests.read_text().replace("import triton\n", _TRITON, 1)
    if nonpositive_g:
        head, sep, tail = text.partition("def test_chunk_return_intermediate_states(")
        tail = tail.replace("g = torch.randn(", "g = -torch.abs(torch.randn(", 1)
        tail = tail.replace("g_varlen = torch.randn(", "g_varlen = -torch.abs(torch.randn(", 1)
        tail = tail.replace(
            "dtype=dtype, device=device)\n    beta", "dtype=dtype, device=device))\n    beta", 1
        )
        tail = tail.replace(
            "dtype=dtype, device=device)\n        beta_varlen",
            "dtype=dtype, device=device))\n        beta_varlen",
            1,
        )
        text = head + sep + tail
    copy = out / "test_kda.py"
    copy.write_text(text)
    return copy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--fla", type=Path, required=True, help="fla source root (holds fla/ops/kda/naive.py)"
    )
    parser.add_argument("--tests", type=Path, required=True, help="fla's tests/ops/test_kda.py")
    parser.add_argument("--nonpositive-g", action="store_true")
    args, pytest_args = parser.parse_known_args()
    pytest_args = [a for a in pytest_args if a != "--"]
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        copy = build(args.fla, args.tests, Path(tmp), args.nonpositive_g)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), tmp])}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(copy), *pytest_args]
        return subprocess.call(cmd, cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main())
