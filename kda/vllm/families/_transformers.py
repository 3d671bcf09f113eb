"""References for the families a transformers model defines: its greedy run on kda, with every
token's log probability at each step (ties are told from them)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

from .._common import Expected


def _on_kda(model: Any, dtype: str, apply: Callable[[Any], Any]) -> Any:
    import torch

    m = copy.deepcopy(model).to(getattr(torch, dtype))
    apply(m)
    return m


def _steps(logits: list[Any]) -> list[dict[int, float]]:
    import torch

    return [dict(enumerate(torch.log_softmax(x.float(), dim=-1).tolist())) for x in logits]


def generate_reference(
    model: Any, prompts: list[list[int]], tokens: int, dtype: str, apply: Callable[[Any], Any]
) -> list[Expected]:
    """transformers' ``generate`` (greedy) of each prompt, in ``dtype``, after ``apply(model)`` (kda
    in place of the model's KDA layers) on a copy (``model`` is not modified)."""
    import torch

    m, out = _on_kda(model, dtype, apply), []
    with torch.inference_mode():
        for ids in prompts:
            g = m.generate(
                torch.tensor([ids]),
                max_new_tokens=tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            seq = g.sequences[0, len(ids) :].tolist()
            out.append(Expected(seq, _steps([x[0] for x in g.logits])))
    return out


def linear_only_cache(model: Any) -> tuple[Any, list[int]]:
    """A transformers ``DynamicCache`` for a model without attention layers, told the sequence
    length by the caller (``[seen]``): transformers' own asks an attention layer for it and raises
    when there is none (``get_seq_length can only be called on Attention layers``), in ``generate``
    and in a cached forward alike."""
    from transformers import DynamicCache

    cache, seen = DynamicCache(config=model.config), [0]

    def mask_sizes(query: Any, layer_idx: int = 0) -> tuple[int, int]:
        return seen[0] + (query if isinstance(query, int) else int(query.shape[0])), 0

    cache.get_seq_length = lambda layer_idx=0: seen[0]
    cache.get_query_offset = lambda layer_idx=0: seen[0]
    cache.get_mask_sizes = mask_sizes
    return cache, seen


def stepwise_reference(
    model: Any, prompts: list[list[int]], tokens: int, dtype: str, apply: Callable[[Any], Any]
) -> list[Expected]:
    """As :func:`generate_reference` for a model without attention layers: the prompt in one
    forward, then a token a forward through :func:`linear_only_cache`."""
    import torch

    m, out = _on_kda(model, dtype, apply), []
    # the cache's keyword: `cache` from transformers 5.24 (`past_key_values` deprecated)
    name = "cache" if "cache" in inspect.signature(type(m).forward).parameters else "past_key_values"
    with torch.inference_mode():
        for ids in prompts:
            cache, seen = linear_only_cache(m)
            x, seq, logits = torch.tensor([ids]), [], []
            for _ in range(tokens):
                pos = torch.arange(seen[0], seen[0] + x.shape[1])[None]
                last = m(x, use_cache=True, position_ids=pos, **{name: cache}).logits[0, -1]
                seen[0] += x.shape[1]
                logits.append(last)
                x = last.argmax(-1).reshape(1, 1)
                seq.append(int(x))
            out.append(Expected(seq, _steps(logits)))
    return out
