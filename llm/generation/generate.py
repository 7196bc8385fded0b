"""The decoding loop: prefill once, then one cached forward per new token."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from llm.cache import Cache, DynamicCache
from llm.generation.sampling import next_tokens, validate_sampling


@dataclass
class GenerateOutput:
    """What ``generate(..., return_dict_in_generate=True)`` returns.

    Attributes:
        sequences: what ``generate`` returns otherwise: (batch, prompt + new) int64 with
            input_ids, (batch, new) with inputs_embeds.
        past_key_values: the cache after decoding (holds all but the last new token).
        stats: counters and speeds: ``prefill_tokens``, ``new_tokens``, ``forward_passes``,
            ``proposed_tokens``, ``accepted_tokens``, ``prefill_tokens_per_s``, ``decode_tokens_per_s``.
    """

    sequences: torch.Tensor
    past_key_values: Cache | None = None
    stats: dict = field(default_factory=dict)


def _eos_tensor(eos_token_id: int | Sequence[int] | None, device) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


def generate(
    model,
    input_ids: torch.Tensor | None = None,
    *,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values: Cache | None = None,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    seed: int | None = None,
    return_dict_in_generate: bool = False,
) -> torch.Tensor | GenerateOutput:
    """Greedy or sampled decoding with a KV cache (transformers' ``generate`` conventions).

    The prompt is prefilled in one forward, then each new token takes one cached forward of a
    single position. If ``past_key_values`` already holds the first L positions of the prompt
    (a prompt cache, or the cache of an earlier ``generate`` call), only prompt positions L..T-1
    are run, for ``input_ids`` and for ``inputs_embeds`` alike.

    Args:
        model: a :class:`~llm.model.MosaicGPT`.
        input_ids: (batch, T) int64 prompt, left padded for prompts of different lengths; or
        inputs_embeds: (batch, T, d_model) prompt embeddings (exactly one of the two).
        attention_mask: (batch, T) 1 for real tokens, 0 for (left) padding; default all ones.
        past_key_values: a cache holding a prefix (L < T positions) of the prompt, written in
            place; default a new :class:`~llm.cache.DynamicCache`.
        max_new_tokens: the most tokens to add per row.
        do_sample: sample instead of greedy; temperature 0 is greedy as well.
        temperature, top_k, top_p, min_p: sampling filters (see :mod:`llm.generation.sampling`).
        eos_token_id: one id or several; a row stops at its first, and is filled with
            ``pad_token_id`` (default: the first eos id) afterwards. Decoding ends when all stop.
        seed: seeds the sampler's own generator, so a run is reproducible.
        return_dict_in_generate: return a :class:`GenerateOutput` with statistics.

    Returns:
        With input_ids: (batch, T + new) int64, prompt followed by the new tokens; with
        inputs_embeds: (batch, new) int64, only the new tokens.

    Raises:
        ValueError: a bad argument (naming it and its allowed range); a cache that does not fit
            the model or already holds the whole prompt; a prompt plus max_new_tokens that does
            not fit max_seq_len (learned positions) or the StaticCache.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    validate_sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=None)
    prompt = input_ids if input_ids is not None else inputs_embeds
    batch, prompt_len = prompt.shape[:2]
    device = model.device
    if prompt_len == 0:
        raise ValueError("the prompt is empty: generate needs at least one token")

    cache = Cache.from_legacy(past_key_values) if isinstance(past_key_values, (tuple, list)) else past_key_values
    cache = cache if cache is not None else DynamicCache()
    cached = cache.get_seq_length()
    if cached >= prompt_len:
        raise ValueError(
            f"past_key_values already holds {cached} positions but the prompt has {prompt_len}: pass the "
            "whole sequence so far (the cache must hold a strict prefix of it)"
        )
    needed = prompt_len + max_new_tokens - 1  # the last new token is never fed back
    config = model.config
    if config.learned_pos_emb and needed > config.max_seq_len:
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} needs {needed} positions, "
            f"more than max_seq_len={config.max_seq_len}; shorten the prompt or max_new_tokens"
        )
    if cache.get_max_length() is not None and needed > cache.get_max_length():
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} needs {needed} cache positions, "
            f"more than the StaticCache's max_cache_len={cache.get_max_length()}"
        )
    cache.validate(config, batch, prompt_len - cached, model.dtype)

    if attention_mask is None:
        attention_mask = torch.ones(batch, prompt_len, dtype=torch.bool, device=device)
    elif tuple(attention_mask.shape) != (batch, prompt_len):
        raise ValueError(f"attention_mask must be (batch, T) = ({batch}, {prompt_len}), got {tuple(attention_mask.shape)}")
    attention_mask = attention_mask.to(device=device, dtype=torch.bool)
    padded = not bool(attention_mask.all())
    eos = _eos_tensor(eos_token_id, device)
    if pad_token_id is None:
        pad_token_id = int(eos[0]) if eos is not None else 0
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    def forward(new, mask):
        key = "input_ids" if new.dim() == 2 else "inputs_embeds"
        out = model(**{key: new}, attention_mask=mask if padded else None, past_key_values=cache, use_cache=True)
        return out.logits[:, -1]

    t0 = time.perf_counter()
    logits = forward(prompt[:, cached:].to(device), attention_mask)
    t1 = time.perf_counter()
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    new_tokens = []
    forward_passes = 1
    for step in range(max_new_tokens):
        token = next_tokens(logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, generator=generator)
        token = token.masked_fill(finished, pad_token_id)
        new_tokens.append(token)
        if eos is not None:
            finished |= torch.isin(token, eos)
            if bool(finished.all()):
                break
        if step == max_new_tokens - 1:
            break
        if padded:
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        logits = forward(token[:, None], attention_mask)
        forward_passes += 1
    t2 = time.perf_counter()

    generated = torch.stack(new_tokens, dim=1)
    sequences = torch.cat([input_ids.to(device), generated], dim=1) if input_ids is not None else generated
    if not return_dict_in_generate:
        return sequences
    n_new = generated.shape[1]
    stats = {
        "prefill_tokens": batch * (prompt_len - cached),
        "new_tokens": batch * n_new,
        "forward_passes": forward_passes,
        "proposed_tokens": 0,
        "accepted_tokens": 0,
        "prefill_tokens_per_s": batch * (prompt_len - cached) / max(t1 - t0, 1e-9),
        "decode_tokens_per_s": batch * (n_new - 1) / (t2 - t1) if n_new > 1 else float("nan"),
    }
    return GenerateOutput(sequences=sequences, past_key_values=cache, stats=stats)
