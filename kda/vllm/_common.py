"""What ``python -m kda.vllm check`` shares between its driver (:mod:`kda.vllm.check`), the vLLM
process it starts (:mod:`kda.vllm.check_worker`) and the model families it checks
(:mod:`kda.vllm.families`): the records of a family's spec, the pass thresholds, the prompts, the
child process's environment and its result line. No vLLM import."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

TOKENS = 32
BF16_MIN_EQUAL = 28  # of 32: bfloat16 passes with 7 of every 8 tokens equal
LOGPROB_TOL = 0.05  # float32: the largest log-probability difference over the compared tokens
# float32: two tokens whose log probabilities (the reference's) differ by less than this are a tie
# between the implementations, not a mismatch: vLLM's and transformers' float32 log probabilities
# of the same token differ by up to 6.9e-5 on the check's models, so a greedy choice closer than
# twice that may go either way. The request's later tokens are then not compared.
TIE_LOGPROB = 1.5e-4
VOCAB = 128
PROMPT_LEN = 16
# vLLM-CPU settings: no cutlass GEMM all-reduce; a small KV cache (GiB); the plugin on
ENV = {"VLLM_KIMI_K3_GEMM_AR": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TRANSFORMERS_VERBOSITY": "error"}
RESULT = "KDA_VLLM_RESULT "
#: the line a vLLM process prints before it stops on a non-finite parameter or buffer after loading
NONFINITE = "KDA_VLLM_NONFINITE "
#: ``LLM`` arguments of every engine, under an engine's own
BASE_ARGS: dict[str, Any] = {"enforce_eager": True, "max_model_len": 1024, "seed": 0}


class Phase(NamedTuple):
    """Requests an engine runs: the row's run name, the key of its prompts (the family's
    ``prompts(seed)``), greedy tokens a request (None: ``--tokens``), and how they are submitted
    (``together``: one ``generate``; ``joining``: one at a time while the others decode; ``twice``:
    the same ``generate`` again, the second pass must reuse cached tokens; ``forced``: then one
    teacher-forced prefill of each prompt and its tokens, recorded as ``forced``)."""

    name: str
    prompts: str
    tokens: int | None = None
    mode: str = "together"


@dataclass(frozen=True)
class Engine:
    """One vLLM engine of a family: its phases, ``LLM`` arguments over :data:`BASE_ARGS`, the dtypes
    it runs in, its process's environment, the tag its rows' runs carry (``"one tp2"``), the layers
    whose state pools are filled with NaN as vLLM allocates them (class names), whether ``check``
    runs it without ``--engines``, and the engine whose run of the same phase its tokens must equal
    (``against``: run first)."""

    name: str
    phases: tuple[Phase, ...]
    args: dict[str, Any] = field(default_factory=dict)
    dtypes: tuple[str, ...] = ("float32",)
    env: dict[str, str] = field(default_factory=dict)
    tag: str = ""
    poison: tuple[str, ...] = ()
    default: bool = True
    against: str | None = None

    @property
    def speculative(self) -> bool:
        """Speculative decoding on: the child reports vLLM's acceptance counts."""
        return "speculative_config" in self.args

    def run_name(self, phase: Phase) -> str:
        """The run column of ``phase``'s row."""
        return f"{phase.name} {self.tag}" if self.tag else phase.name


@dataclass(frozen=True)
class Model:
    """A model of a family: its name (``--models``), its builder (``(directory, seed)``: writes the
    checkpoint, returns what the family's reference needs), the engines that run it (None: all)."""

    name: str
    build: Callable[[str, int], Any]
    engines: tuple[str, ...] | None = None


class Expected(NamedTuple):
    """A reference's greedy run of one request: its tokens, and per step the log probabilities it
    knows (of its own token at least; of every token where a tie is to be told)."""

    tokens: list[int]
    logprobs: list[dict[int, float]]


@dataclass(frozen=True)
class Family:
    """A model family of ``python -m kda.vllm check --model NAME`` (``docs/vllm.md``).

    ``reference(handle, prompts, tokens, dtype, record)``: an :class:`Expected` per prompt
    (``record``: the vLLM child's record of the phase, for references the engine computes itself);
    ``unavailable()``: why the family cannot run here (exit 2), or None; ``child_hook``:
    ``"module:function"`` called in the engine's process before the engine starts, returning a
    callable that gives (and resets) the facts of each phase; ``verify(facts)``: failures;
    ``engine_reference``: the reference reads the engine's record (computed for every run, not once
    per prompts, dtype and token count); ``fixes``: every CPU fix of :mod:`kda.vllm.cpu_fixes` must be
    in place in every rank (those ``KDA_VLLM_SKIP`` names aside): the released Kimi Linear's
    engines, which import every module a fix patches."""

    name: str
    models: tuple[Model, ...]
    engines: tuple[Engine, ...]
    prompts: Callable[[int], dict[str, list[list[int]]]]
    reference: Callable[[Any, list[list[int]], int, str, dict[str, Any]], list[Expected]]
    unavailable: Callable[[], str | None] = lambda: None
    child_hook: str | None = None
    verify: Callable[[dict[str, Any]], list[str]] | None = None
    engine_reference: bool = False
    fixes: bool = False
    doc: str = ""

    def engine(self, name: str) -> Engine:
        """The engine named ``name`` (``KeyError`` if none)."""
        for e in self.engines:
            if e.name == name:
                return e
        raise KeyError(name)


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


class ChildFailed(RuntimeError):
    """A vLLM child process that failed: its message ends with the output's tail; ``output`` holds
    all of it."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


def run_child(
    args: list[str], what: str, timeout: float = 900, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``python -m kda.vllm *args`` (``env`` added to :func:`child_env`) and return the JSON of
    its last :data:`RESULT` line; :class:`ChildFailed` with the output's tail when it fails or prints
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
        except subprocess.TimeoutExpired:
            _kill_session(p.pid)
            stdout, stderr = p.communicate()
            raise ChildFailed(f"vLLM run ({what}) ran past {timeout:.0f} s", stdout + stderr) from None
        finally:
            _kill_session(p.pid)
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT)]
    if p.returncode != 0 or not lines:
        tail = "\n".join((stdout + stderr).splitlines()[-40:])
        raise ChildFailed(f"vLLM run ({what}) failed, exit {p.returncode}:\n{tail}", stdout + stderr)
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
