"""What the checks of ``python -m kda.vllm check`` share (:mod:`kda.vllm.check`,
:mod:`kda.vllm.check_glm`, :mod:`kda.vllm.check_kimi_linear`): the pass thresholds, the prompts, the
vLLM child process's environment and its result line. No vLLM import."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from typing import Any

TOKENS = 32
BF16_MIN_EQUAL = 28  # of 32
LOGPROB_TOL = 0.05
VOCAB = 128
PROMPT_LEN = 16
# vLLM-CPU settings: no cutlass GEMM all-reduce; a small KV cache (GiB); the plugin on
ENV = {"VLLM_KIMI_K3_GEMM_AR": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TRANSFORMERS_VERBOSITY": "error"}
RESULT = "KDA_VLLM_RESULT "


def prompt(seed: int = 0, length: int = PROMPT_LEN) -> list[int]:
    """``length`` random token ids in ``[3, VOCAB)`` (0-2 are the special tokens), from ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def child_env() -> dict[str, str]:
    """This process's environment with :data:`ENV`'s defaults, and the plugin on."""
    env = dict(os.environ)
    for k, v in ENV.items():
        env.setdefault(k, v)
    env.pop("KDA_VLLM", None)
    return env


def run_child(
    args: list[str], what: str, timeout: float = 900, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``python -m kda.vllm *args`` (``env`` added to :func:`child_env`) and return the JSON of
    its last :data:`RESULT` line; ``RuntimeError`` with the output's tail when it fails or prints
    none. The child runs in a session of its own, killed whole when it ends: a vLLM worker that a
    failed engine leaves behind (seen after a tensor-parallel worker's error) would otherwise keep
    a core busy."""
    cmd = [sys.executable, "-m", "kda.vllm", *args]
    env = {**child_env(), **(env or {})}
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as p:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        finally:
            _kill_session(p.pid)
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT)]
    if p.returncode != 0 or not lines:
        tail = "\n".join((stdout + stderr).splitlines()[-40:])
        raise RuntimeError(f"vLLM run ({what}) failed, exit {p.returncode}:\n{tail}")
    return json.loads(lines[-1][len(RESULT) :])


def _kill_session(pid: int) -> None:
    """Kill every process left in the session (process group) that ``pid`` leads."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left
        pass


def emit(result: dict[str, Any]) -> None:
    """The child's result line (read by :func:`run_child`)."""
    print(RESULT + json.dumps(result), flush=True)
