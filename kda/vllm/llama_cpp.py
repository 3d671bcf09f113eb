"""llama.cpp as an independent reference and a speed baseline: its build, a tokenizer its converter
accepts, GGUF conversion with its own ``convert_hf_to_gguf.py``, and its greedy tokens.

Shared by ``benchmarks/serve_vs_llama_cpp.py`` (vLLM-CPU + kda against llama.cpp on the same
weights) and the model families' checks of ``python -m kda.vllm check`` (llama.cpp's tokens where
transformers has no model). Nothing of llama.cpp is kept in the repository, and importing this
module imports nothing heavy.

* **Source**: the llama.cpp that the ``llama-cpp-python`` 0.3.36 sdist vendors
  (``vendor/llama.cpp``): the sdist is taken from ``$KDA_LLAMA_CPP_SDIST``, else from the cache
  directory, else downloaded with ``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36``,
  and unpacked under the cache directory, :func:`cache_dir` (``$KDA_BENCH_CACHE/llama.cpp-0.3.36``,
  by default ``~/.cache/kda-bench/llama.cpp-0.3.36``).
* **Build** (:func:`build`, once per cache directory; the commands are in :func:`build_commands` and
  written to ``build/kda-build-commands.txt``): cmake, Release, the native ISA (``GGML_NATIVE``),
  OpenMP, shared libraries, no network code; the tools ``llama-bench``, ``llama-batched-bench``,
  ``llama-simple`` and ``llama-completion``; then :data:`GREEDY_C`, a C program of this project's
  own against ``libllama`` (``kda-llama-greedy``): a list of prompts of token ids in, llama.cpp's
  greedy tokens out (its C API: one ``llama_decode`` of the prompt, then one token a step; the KV
  cache in float32 by default, so that an F32 GGUF computes in float32 throughout).
* **Tokenizer** (:func:`write_tokenizer`): a small byte-level BPE made with ``tokenizers`` (three
  special tokens, byte tokens, a few merges), saved beside a model. The converter recognises a
  BPE pre-tokenizer only by the hash of the tokens of a fixed text, known for published tokenizers
  only; the tokenizer's hash and the pre-tokenizer it uses (``gpt-2``: the GPT-2 split of
  ``tokenizers``' ``ByteLevel``) are written beside it (``kda-llama-pre.json``) and registered in
  the converter's module as it runs (:func:`convert` runs it through :data:`CONVERT_PY`, which
  wraps ``get_vocab_base_pre``); llama.cpp's files are not edited.
* **Conversion** (:func:`convert`): ``convert_hf_to_gguf.py`` with the ``gguf-py`` beside it,
  ``--outtype f32``, ``bf16`` or ``q8_0``; an architecture name the converter lacks can be mapped
  to one it has (``aliases``).

The tokenizer only has to satisfy the converter: the prompts are token ids, so no text is ever
tokenized. Kimi's own tokenizer is tiktoken's; its converter (``conversion/kimi_linear.py``) tries
the generic BPE path (``tokenizer.json``) first, which this tokenizer answers.

Example::

    from kda.vllm import llama_cpp
    write_tokenizer(model_dir)          # beside config.json and model.safetensors
    gguf = llama_cpp.convert(model_dir, "f32")
    runs = llama_cpp.greedy(gguf, [[5, 6, 7]], tokens=8)   # [Greedy(tokens=[...], margins=[...])]
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._errors import InvalidInputError
from ._llama_cpp_programs import CONVERT_PY, GREEDY_C

__all__ = [
    "GLM_SPECIALS", "OUTTYPES", "VERSION", "Build", "Greedy", "LlamaCppUnavailable", "build",
    "build_commands", "cache_dir", "convert", "greedy", "source_dir", "write_tokenizer",
]  # fmt: skip

#: the llama-cpp-python sdist whose vendored llama.cpp is built
VERSION = "0.3.36"
SDIST = f"llama-cpp-python=={VERSION}"
#: the converter's ``--outtype`` values accepted by :func:`convert`
OUTTYPES = ("f32", "bf16", "q8_0")
#: the tools built besides ``libllama``
TOOLS = ("llama-bench", "llama-batched-bench", "llama-simple", "llama-completion")
GREEDY = "kda-llama-greedy"
#: where the tokenizer's pre-tokenizer answer is written beside a model
PRE_FILE = "kda-llama-pre.json"
#: the pre-tokenizer llama.cpp applies to :func:`write_tokenizer`'s tokenizer
PRE_TOKENIZER = "gpt-2"
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the checks' pad, bos and eos ids
#: the special tokens GLM's vocabulary converter (``_set_vocab_glm``) looks up by name
GLM_SPECIALS = ("[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>")


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot be built, converted to or run here (no compiler or cmake, no sdist and no
    network, a failed build, a converter that refuses the model); the message says which and where
    the log is."""


# ----------------------------------------------------------------------------------------------
# source and build


def cache_dir() -> Path:
    """Where the sdist, its sources and the build live: ``$KDA_BENCH_CACHE/llama.cpp-<VERSION>``
    (``~/.cache/kda-bench`` when unset); never inside the repository."""
    root = Path(os.environ.get("KDA_BENCH_CACHE", Path.home() / ".cache" / "kda-bench"))
    return root / f"llama.cpp-{VERSION}"


def _log() -> Path:
    return cache_dir() / "build.log"


def _run(cmd: Sequence[str], what: str, cwd: Path | None = None) -> None:
    """Run ``cmd``, its output appended to the build log; :class:`LlamaCppUnavailable` on failure."""
    log = _log()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        try:
            r = subprocess.run(list(map(str, cmd)), cwd=cwd, stdout=f, stderr=subprocess.STDOUT, check=False)
        except OSError as e:
            raise LlamaCppUnavailable(f"{what}: {e}") from e
    if r.returncode != 0:
        raise LlamaCppUnavailable(f"{what} failed (exit {r.returncode}); see {log}")


def _sdist(root: Path) -> Path:
    """The sdist archive: ``$KDA_LLAMA_CPP_SDIST``, one in ``root``, or downloaded into ``root``."""
    given = os.environ.get("KDA_LLAMA_CPP_SDIST")
    if given:
        if not Path(given).is_file():
            raise LlamaCppUnavailable(f"KDA_LLAMA_CPP_SDIST={given}: no such file")
        return Path(given)
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    if (root / name).is_file():
        return root / name
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", root]
    _run(cmd, f"pip download {SDIST} (or set KDA_LLAMA_CPP_SDIST to the sdist)")
    if not (root / name).is_file():
        raise LlamaCppUnavailable(f"pip download {SDIST} left no {name} in {root}")
    return root / name


def source_dir() -> Path:
    """The vendored llama.cpp of the sdist, unpacked under :func:`cache_dir` once."""
    root = cache_dir()
    src = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    archive = _sdist(root)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise LlamaCppUnavailable(f"no vendor/llama.cpp/convert_hf_to_gguf.py in {archive}")
    return src


def _jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_commands(
    src: Path | None = None, out: Path | None = None, jobs: int | None = None
) -> list[list[str]]:
    """The commands :func:`build` runs: cmake's configure and build of llama.cpp (``src``, into
    ``out``), then the compilation of :data:`GREEDY_C` (written to ``out/kda-llama-greedy.c``)."""
    src = src or cache_dir() / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    out = out or cache_dir() / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [
        "cmake", "-S", str(src), "-B", str(out), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
        "-DGGML_OPENMP=ON", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_EXAMPLES=ON",
        "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
    ]  # fmt: skip
    compile_ = ["cmake", "--build", str(out), "-j", str(jobs or _jobs()), "--target", "llama", *TOOLS]
    lib = out / "bin"
    greedy_ = [
        "cc", "-O2", "-std=c11", str(out / f"{GREEDY}.c"), "-I", str(src / "include"), "-I",
        str(src / "ggml" / "include"), "-L", str(lib), "-lllama", "-lggml", "-lggml-base", "-lm",
        f"-Wl,-rpath,{lib}", "-o", str(lib / GREEDY),
    ]  # fmt: skip
    return [configure, compile_, greedy_]


@dataclass(frozen=True)
class Build:
    """A finished build: the sources, the build directory, its ``bin`` (tools and libraries), and
    the commands that made it (as :func:`build_commands` gives them)."""

    source: Path
    out: Path
    commands: tuple[str, ...]

    @property
    def bin(self) -> Path:
        return self.out / "bin"

    def tool(self, name: str) -> Path:
        """A built tool (:data:`TOOLS` or ``kda-llama-greedy``)."""
        if name not in (*TOOLS, GREEDY):
            raise InvalidInputError(f"tool: expected one of {[*TOOLS, GREEDY]}, got {name!r}")
        return self.bin / name


@functools.lru_cache(maxsize=1)
def build(jobs: int | None = None) -> Build:
    """Build llama.cpp and ``kda-llama-greedy`` once (kept under :func:`cache_dir`; a finished build
    is reused, a rebuilt one only when :data:`GREEDY_C` changed). ``jobs``: cmake's parallel jobs,
    every usable core by default. Raises :class:`LlamaCppUnavailable` where a tool is missing or a
    step fails (the log: ``cache_dir()/build.log``)."""
    missing = [tool for tool in ("cmake", "cc") if shutil.which(tool) is None]
    if missing:
        raise LlamaCppUnavailable(f"no {' or '.join(missing)} on PATH: install a C compiler and cmake")
    src = source_dir()
    out = cache_dir() / "build"
    configure, compile_, greedy_ = build_commands(src, out, jobs)
    lib = out / "bin"
    if not all((lib / t).exists() for t in TOOLS) or not any(lib.glob("libllama.*")):
        if not (out / "CMakeCache.txt").exists():
            _run(configure, "cmake configure of llama.cpp")
        _run(compile_, "cmake build of llama.cpp")
    source = out / f"{GREEDY}.c"
    if not (lib / GREEDY).exists() or not source.exists() or source.read_text() != GREEDY_C:
        source.write_text(GREEDY_C)
        _run(greedy_, f"compiling {GREEDY}")
    commands = tuple(" ".join(c) for c in (configure, compile_, greedy_))
    (out / "kda-build-commands.txt").write_text("\n".join(commands) + "\n")
    return Build(src, out, commands)


# ----------------------------------------------------------------------------------------------
# tokenizer


def _check_text(src: Path) -> str:
    """The fixed text whose tokens' hash the converter's ``get_vocab_base_pre`` looks up (read from
    its source, so that the hash matches this version's)."""
    tree = ast.parse((src / "conversion" / "base.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_vocab_base_pre":
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.Assign)
                    and getattr(stmt.targets[0], "id", None) == "chktxt"
                    and isinstance(stmt.value, ast.Constant)
                ):
                    return str(stmt.value.value)
    raise LlamaCppUnavailable(f"no chktxt in get_vocab_base_pre of {src / 'conversion' / 'base.py'}")


def _pre_hash(tokenizer: object, text: str) -> str:
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    return hashlib.sha256(str(ids).encode()).hexdigest()


def write_tokenizer(path: str | os.PathLike[str], vocab_size: int, specials: Sequence[str] = ()) -> str:
    """Write a byte-level BPE tokenizer of at most ``vocab_size`` ids to ``path`` (beside a model):
    ``tokenizer.json``, ``tokenizer_config.json`` and :data:`PRE_FILE` (the hash of its tokens of
    the converter's fixed text and :data:`PRE_TOKENIZER`). Ids 0-2 are ``<unk>``, ``<s>``, ``</s>``
    (the checks' pad, bos and eos ids), then ``specials`` (more special tokens a converter looks up
    by name, e.g. :data:`GLM_SPECIALS`); then byte tokens (printable ASCII first), as many as fit,
    and a few merges of them. Returns the hash. ``vocab_size`` must be at least 16 more than the
    special tokens."""
    names = (*SPECIALS, *specials)
    if not isinstance(vocab_size, int) or vocab_size < 16 + len(names):
        raise InvalidInputError(
            f"vocab_size: expected an int of at least {16 + len(names)}, got {vocab_size!r}"
        )
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in specials):
        raise InvalidInputError(
            f"specials: expected distinct non-empty strings beside {SPECIALS}, got {specials!r}"
        )
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_char = dict(zip(range(256), _gpt2_bytes()))  # GPT-2's mapping, as ByteLevel's
    order = list(range(0x20, 0x7F)) + [b for b in range(256) if not 0x20 <= b < 0x7F]
    room = min(vocab_size, 512) - len(names)
    n_merges = max(1, min(32, room - 256)) if room > 256 else max(1, room // 8)
    chars = [byte_char[b] for b in order[: room - n_merges]]
    vocab = {tok: i for i, tok in enumerate(names)}
    for c in chars:
        vocab[c] = len(vocab)
    # merges of the space character with letters, then of letter pairs: all within ``chars``
    letters = [byte_char[b] for b in b"etaoinshrdlucmfwypvbgkjqxz" if byte_char[b] in vocab]
    pairs = [(byte_char[0x20], c) for c in letters] + [(a, b) for a in letters for b in letters]
    merges = []
    for a, b in pairs[:n_merges]:
        if a in vocab and b in vocab and a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    model = models.BPE(vocab=vocab, merges=merges, unk_token=SPECIALS[0])
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=SPECIALS[0], bos_token=SPECIALS[1], eos_token=SPECIALS[2],
        pad_token=SPECIALS[0],
    )  # fmt: skip
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # not the model type's own class
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    digest = _pre_hash(PreTrainedTokenizerFast.from_pretrained(str(out)), _check_text(source_dir()))
    (out / PRE_FILE).write_text(json.dumps({digest: PRE_TOKENIZER}))
    return digest


def _gpt2_bytes() -> list[str]:
    """GPT-2's byte -> character table (byte ``b`` at index ``b``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


# ----------------------------------------------------------------------------------------------
# conversion


def convert(
    model_dir: str | os.PathLike[str], outtype: str = "f32", outfile: str | os.PathLike[str] | None = None,
    aliases: Mapping[str, str] | None = None, python: str | None = None, timeout: float = 3600,
    json_config: bool = False,
) -> Path:  # fmt: skip
    """Convert the checkpoint in ``model_dir`` (``config.json``, safetensors, a tokenizer with
    :data:`PRE_FILE`, see :func:`write_tokenizer`) to a GGUF with llama.cpp's
    ``convert_hf_to_gguf.py`` (``outtype``: one of :data:`OUTTYPES`); ``outfile`` defaults to
    ``model_dir/model-<outtype>.gguf``. ``aliases``: architecture names the converter lacks, each
    mapped to one it has (``{"Glm5NextForCausalLM": "Glm5NextForConditionalGeneration"}``).
    ``python``: the interpreter that runs it (this one by default; it needs torch, numpy, PyYAML
    and transformers). ``json_config``: the converter reads ``config.json`` as written instead of
    through transformers' ``AutoConfig`` (which, where transformers has a class for the
    ``model_type``, renames or drops fields: transformers 5.24's ``bailing_hybrid`` turns Ling-3's
    ``norm_topk_prob`` into ``moe_renormalize``, which the converter does not read). Returns the
    GGUF's path; :class:`LlamaCppUnavailable` with the converter's last lines when it refuses."""
    if outtype not in OUTTYPES:
        raise InvalidInputError(f"outtype: expected one of {list(OUTTYPES)}, got {outtype!r}")
    model = Path(model_dir)
    if not (model / "config.json").is_file():
        raise InvalidInputError(f"model_dir: expected a directory with config.json, got {str(model)!r}")
    src = source_dir()
    out = Path(outfile) if outfile is not None else model / f"model-{outtype}.gguf"
    pre = json.loads((model / PRE_FILE).read_text()) if (model / PRE_FILE).is_file() else {}
    spec = {"source": str(src), "pre": pre, "aliases": dict(aliases or {}), "text": _check_text(src),
            "json_config": json_config}  # fmt: skip
    cmd = [python or sys.executable, "-c", CONVERT_PY, json.dumps(spec), str(model), "--outfile", str(out),
           "--outtype", outtype]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if r.returncode != 0 or not out.is_file():
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-25:])
        raise LlamaCppUnavailable(
            f"convert_hf_to_gguf.py --outtype {outtype} of {model} failed (exit {r.returncode}):\n{tail}"
        )
    return out


# ----------------------------------------------------------------------------------------------
# greedy tokens


@dataclass(frozen=True)
class Greedy:
    """llama.cpp's greedy run of one prompt: the tokens, and at each step the logit of the chosen
    token minus the runner-up's (a small margin is a near tie)."""

    tokens: list[int]
    margins: list[float]


def greedy(
    gguf: str | os.PathLike[str], prompts: Sequence[Sequence[int]], tokens: int | Sequence[int],
    threads: int | None = None,
    kv_type: str = "f32", flash_attn: bool = False, context: int | None = None, timeout: float = 3600,
    perf: dict[str, float] | None = None,
) -> list[Greedy]:  # fmt: skip
    """llama.cpp's greedy tokens of each prompt (token ids) of ``gguf``, ``tokens`` a prompt (one
    count for all, or one a prompt), no
    stop at an end-of-sequence token: one ``llama_decode`` of the prompt, then one token a step,
    the KV cache cleared between prompts. ``kv_type``: the KV cache's type (``f32``, the float32
    reference; ``f16``, llama.cpp's default); ``flash_attn`` off by default; ``threads`` every usable
    core by default; ``context`` the longest prompt plus ``tokens`` by default. ``perf``, where given,
    receives llama.cpp's own counters over all prompts (``load_ms``, ``prompt_ms``, ``eval_ms``,
    ``prompt_tokens``, ``eval_tokens``: ``llama_perf_context``)."""
    counts = [tokens] * len(prompts) if isinstance(tokens, int) else list(tokens)
    if len(counts) != len(prompts) or any(not isinstance(n, int) or n < 1 for n in counts):
        raise InvalidInputError(
            f"tokens: expected an int of at least 1 or one a prompt ({len(prompts)}), got {tokens!r}"
        )
    if kv_type not in ("f32", "f16"):
        raise InvalidInputError(f"kv_type: expected 'f32' or 'f16', got {kv_type!r}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidInputError("prompts: expected a non-empty list of non-empty token id lists, got "
                                f"{[len(p) for p in prompts]} tokens")  # fmt: skip
    exe = build().tool(GREEDY)
    n_ctx = context or max(len(p) + n for p, n in zip(prompts, counts))
    args = [str(exe), str(gguf), str(threads or _jobs()), str(n_ctx), "1" if kv_type == "f32" else "0",
            "1" if flash_attn else "0"]  # fmt: skip
    stdin = "".join(f"{n} {' '.join(map(str, map(int, p)))}\n" for p, n in zip(prompts, counts))
    r = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    if r.returncode != 0:
        raise LlamaCppUnavailable(f"{GREEDY} {gguf} failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    runs, current = [], None
    for line in r.stdout.splitlines():
        head, _, rest = line.partition(" ")
        if head == "tokens":
            current = [int(x) for x in rest.split()]
        elif head == "margins" and current is not None:
            runs.append(Greedy(current, [float(x) for x in rest.split()]))
            current = None
        elif head == "perf" and perf is not None:
            keys = ("load_ms", "prompt_ms", "eval_ms", "prompt_tokens", "eval_tokens")
            perf.update(zip(keys, map(float, rest.split())))
    if len(runs) != len(prompts):
        raise LlamaCppUnavailable(
            f"{GREEDY} answered {len(runs)} of {len(prompts)} prompts: {r.stderr[-2000:]}"
        )
    return runs


def main(argv: list[str] | None = None) -> int:
    """``python -m kda.vllm.llama_cpp build``: build (once) and print the commands."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["build"]:
        b = build()
        print("\n".join(b.commands))
        print(f"built in {b.out}")
        return 0
    print("usage: python -m kda.vllm.llama_cpp build", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
