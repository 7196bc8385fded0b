"""``generate`` and ``stream``: transformers-style entry points to the decoding loop.

Both run without recording autograd (as transformers' ``generate``, under ``torch.no_grad``),
take their options as a :class:`~llm.generation.config.GenerationConfig` (the model's
``generation_config`` by default) plus keyword overrides, and refuse token ids outside the
vocabulary before anything runs. The loop itself is :class:`~llm.generation.decoding.Decoding`.
"""

from __future__ import annotations

from typing import Iterator

import torch

from llm.generation.candidates import DraftModel, PromptLookup
from llm.generation.config import GenerationConfig
from llm.generation.decoding import Decoding, GenerateOutput, StopStrings, check_token_ids
from llm.generation.sampling import Sampler

__all__ = ["GenerateOutput", "generate", "start_decoding", "stream"]


def _options(model, generation_config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
    """The call's options: ``generation_config`` (else the model's ``generation_config``, else the
    defaults) updated with the keyword overrides, as transformers' ``generate(**kwargs)``."""
    base = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    if base is None:
        base = GenerationConfig()
    if not isinstance(base, GenerationConfig):
        raise TypeError(f"generation_config must be an llm.GenerationConfig, got {type(base).__name__}")
    return base.update(**overrides) if overrides else base


def _decodings(model, input_ids, inputs_embeds, attention_mask, past_key_values, options: GenerationConfig,
               tokenizer, reference_ids, assistant_model, compile: bool = False) -> list[Decoding]:
    """Check the inputs against the model; return the per-row (speculative) or whole-batch decodings."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    vocab_size = model.config.vocab_size
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, T), got shape {tuple(input_ids.shape)}")
        check_token_ids(input_ids, vocab_size)
    lookup, assistant = options.prompt_lookup_num_tokens, assistant_model
    if lookup is not None and assistant is not None:
        raise ValueError("choose one proposer: prompt_lookup_num_tokens (reference decoding) or assistant_model")
    if assistant is not None and assistant.config.vocab_size != vocab_size:
        raise ValueError(
            f"assistant_model has vocab_size {assistant.config.vocab_size}, the model "
            f"{vocab_size}: the draft must share the tokenizer"
        )
    speculative = lookup is not None or assistant is not None
    if speculative and input_ids is None:
        raise ValueError("speculative decoding works on token ids: pass input_ids, not inputs_embeds")
    if assistant is not None and assistant.config.learned_pos_emb:
        needed = input_ids.shape[1] + options.max_new_tokens - 1
        if needed > assistant.config.max_seq_len:
            raise ValueError(
                f"assistant_model has learned positions up to max_seq_len={assistant.config.max_seq_len}, "
                f"but the prompt of {input_ids.shape[1]} tokens + max_new_tokens={options.max_new_tokens} "
                f"needs {needed}"
            )
    references = [] if reference_ids is None else (
        [reference_ids] if torch.is_tensor(reference_ids) and reference_ids.dim() == 1 else list(reference_ids))
    references = [torch.as_tensor(r, device=model.device) for r in references]
    for i, reference in enumerate(references):
        check_token_ids(reference, vocab_size, f"reference_ids[{i}]")  # drafts are copied from them
    generator = torch.Generator(device=model.device).manual_seed(options.seed) if options.seed is not None else None
    sampler = Sampler(options, generator)
    stop = StopStrings(options.stop_strings, tokenizer) if options.stop_strings is not None else None

    def proposer():
        if assistant is not None:
            return DraftModel(assistant, options.num_assistant_tokens or 5, sampler)
        if speculative:
            return PromptLookup(lookup, options.max_matching_ngram_size or 2, references)
        return None

    common = dict(options=options, sampler=sampler, stop=stop, compile=compile)
    mask = attention_mask
    if not speculative or (input_ids.shape[0] == 1 and (mask is None or bool(mask.bool().all()))):
        return [Decoding(model, input_ids, inputs_embeds, attention_mask, past_key_values, proposer=proposer(),
                         **common)]
    if past_key_values is not None:
        raise ValueError("speculative decoding of a batch decodes row by row: it cannot share one past_key_values")
    if mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must be (batch, T) = {tuple(input_ids.shape)}, got {tuple(mask.shape)}")
    rows = []
    for r in range(input_ids.shape[0]):
        # padding anywhere in the row is dropped: a row decodes as it would alone
        real = mask[r].bool() if mask is not None else slice(None)
        rows.append(Decoding(model, input_ids[r:r + 1, real], None, None, None, proposer=proposer(), **common))
    return rows


@torch.no_grad()
def generate(model, input_ids: torch.Tensor | None = None, *, generation_config: GenerationConfig | None = None,
             inputs_embeds: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             past_key_values=None, tokenizer=None, streamer=None, reference_ids=None, assistant_model=None,
             compile: bool = False, **overrides) -> torch.Tensor | GenerateOutput:
    """Greedy or sampled decoding with a KV cache, plain or speculative (transformers' conventions).

    The prompt is prefilled in one forward. Each later forward feeds the last new token, plus
    a draft when speculative decoding is on. On our CPU kernels, one unpadded row decodes in
    chunks of up to 16 such steps in one call (:meth:`llm.model.buffer.FusedSteps.tokens`), the
    same tokens and cache; a chunk draws its random numbers when it is decoded, so without
    ``seed`` code that draws from torch's global generator between two tokens (a streamer's
    ``put``) changes other draws than it would one step at a time. If ``past_key_values``
    already holds the first L positions of the prompt (a prompt cache, or an earlier
    ``generate`` call's cache), only prompt positions L..T-1 are run, for ``input_ids`` and
    ``inputs_embeds`` alike. Runs under ``torch.no_grad()``: nothing is recorded for autograd.

    Args:
        model: a :class:`~llm.model.MosaicGPT`.
        input_ids: (batch, T) int64 prompt, ids in [0, vocab_size); or
        inputs_embeds: (batch, T, d_model) prompt embeddings (exactly one of the two).
        generation_config: the options (:class:`~llm.generation.GenerationConfig`); default
            ``model.generation_config`` (the defaults a bundle or registered model came with).
        **overrides: options that replace the config's for this call, by their
            ``GenerationConfig`` names: max_new_tokens, do_sample, temperature, top_k, top_p,
            min_p, repetition_penalty (counts every token of the sequence, cached prompt
            included), eos_token_id, pad_token_id, stop_strings, seed, prompt_lookup_num_tokens,
            max_matching_ngram_size, num_assistant_tokens, num_assistant_tokens_schedule,
            return_dict_in_generate.
        attention_mask: (batch, T) 1 for real tokens, 0 for padding; default all ones. Padding
            may stand anywhere: left (the usual), right (what tokenizers do by default: each row
            continues from its last real token) or in between; each row decodes as if alone.
        past_key_values: a cache holding a prefix (L < T positions) of the prompt, written in
            place; default a new :class:`~llm.cache.DynamicCache`.
        tokenizer: decodes the new tokens for ``stop_strings``.
        streamer: an object with ``put(token_ids)`` and ``end()`` (transformers' protocol,
            e.g. ``transformers.TextStreamer``): it gets the prompt ids first, then each step's
            or chunk's new tokens ((n,) for batch 1, else (batch, n)).
        reference_ids: documents (1-D token tensors) that reference decoding
            (``prompt_lookup_num_tokens``) copies drafts from, besides the prompt and output.
        assistant_model: a smaller MosaicGPT of the same vocabulary that proposes
            ``num_assistant_tokens`` draft tokens per step.
        compile: run the model's forwards as gpt-fast does: over a static cache with fixed shapes,
            through ``torch.compile`` (:mod:`llm.generation.compiled`): the first call of a shape
            compiles (or loads from inductor's disk cache), later calls of any position and
            prompt length reuse it. The prompt is prefilled in chunks; a given
            ``past_key_values`` is copied into the static buffer, not written in place (the
            returned ``GenerateOutput.past_key_values`` is the static cache). Without a working
            C++ compiler this warns once and runs the same path uncompiled. The draft model of
            ``assistant_model`` runs uncompiled.

    Returns:
        With input_ids: (batch, T + new) int64, the prompt as given followed by the new tokens
        (rows that stopped early are filled with the pad id); with inputs_embeds: (batch, new)
        int64, only the new tokens. A :class:`GenerateOutput` with ``return_dict_in_generate``.
        Speculative decoding of a batch runs row by row and gives the same tokens.

    Raises:
        ValueError: a bad option (by :class:`GenerationConfig`: naming it, its value and the
            allowed range); a token id outside the vocabulary (naming it); a mask row without
            a real token; a cache that does not fit the model or already holds the whole prompt
            (or a row's last real token); a prompt plus max_new_tokens beyond max_seq_len
            (learned positions) or the StaticCache.
        TypeError: an override that is not an option.

    Warns:
        ContextLengthWarning: a prompt plus max_new_tokens beyond max_seq_len (rotary or ALiBi
            positions, which run on but were never trained there).
    """
    options = _options(model, generation_config, overrides)
    decodings = _decodings(model, input_ids, inputs_embeds, attention_mask, past_key_values, options, tokenizer,
                           reference_ids, assistant_model, compile)
    if streamer is not None:
        if len(decodings) > 1:
            raise ValueError("streaming speculative decoding needs a batch of one prompt")
        streamer.put((input_ids if input_ids is not None else torch.zeros(decodings[0].batch, 0, dtype=torch.long)).cpu())
    for decoding in decodings:
        for chunk in decoding:
            if streamer is not None:
                streamer.put((chunk[0] if chunk.shape[0] == 1 else chunk).cpu())
    if streamer is not None:
        streamer.end()
    if len(decodings) == 1:
        return decodings[0].result(input_ids, options.return_dict_in_generate)
    return _merge_rows(decodings, input_ids, options.return_dict_in_generate)


def _merge_rows(decodings, input_ids, return_dict):
    """Reassemble rows decoded one by one: the padded prompts, then each row's new tokens padded right."""
    width = max(len(d.new_tokens[0]) for d in decodings)
    rows = [d.new_tokens[0] + [d.pad] * (width - len(d.new_tokens[0])) for d in decodings]
    generated = torch.tensor(rows, dtype=torch.long, device=input_ids.device)
    sequences = torch.cat([input_ids, generated], dim=1)
    if not return_dict:
        return sequences
    stats = {k: sum(d.stats[k] for d in decodings) for k in decodings[0].stats}
    prefill_s = stats["prefill_s"] = sum(d.prefill_s for d in decodings)
    decode_s = stats["decode_s"] = sum(d.decode_s for d in decodings)
    stats["prefill_tokens_per_s"] = stats["prefill_tokens"] / max(prefill_s, 1e-9)
    stats["decode_tokens_per_s"] = (stats["new_tokens"] - len(decodings)) / decode_s if decode_s > 0 else float("nan")
    return GenerateOutput(sequences=sequences, past_key_values=None, stats=stats)


@torch.no_grad()
def stream(model, input_ids: torch.Tensor | None = None, *, generation_config: GenerationConfig | None = None,
           inputs_embeds: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
           past_key_values=None, tokenizer=None, reference_ids=None, assistant_model=None,
           compile: bool = False, **overrides) -> Iterator[torch.Tensor]:
    """Yield new tokens as they are decoded: (batch, n) int64 per step (n > 1 when drafts are accepted).

    Takes ``generate``'s arguments but ``streamer`` (``return_dict_in_generate`` has no effect).
    Finished rows yield the pad id. Runs under ``torch.no_grad()``, step by step.

    Raises:
        ValueError, TypeError: as ``generate``, at the first step; and for speculative decoding
            of more than one prompt, which decodes row by row and so has no (batch, n) steps.
    """
    options = _options(model, generation_config, overrides)
    decodings = _decodings(model, input_ids, inputs_embeds, attention_mask, past_key_values, options, tokenizer,
                           reference_ids, assistant_model, compile)
    if len(decodings) > 1:
        raise ValueError("streaming speculative decoding needs a batch of one prompt")
    yield from decodings[0]


def start_decoding(model, input_ids: torch.Tensor, options: GenerationConfig, *, past_key_values=None, tokenizer=None,
                   compile: bool = False) -> Decoding:
    """The decoding loop of one prompt as ``generate`` runs it, to step through by hand (the
    serving engine's rows that decode speculatively): iterate it for (1, n) int64 chunks of new
    tokens; ``new_tokens[0]`` and ``finished[0]`` say what came out and whether eos or a stop
    string ended it.

    Args:
        input_ids: (1, T) int64, no padding; options: the validated options (reference decoding
            with ``prompt_lookup_num_tokens``, or plain); past_key_values, tokenizer, compile: as
            ``generate``'s.

    Raises:
        ValueError: as ``generate``.
    """
    return _decodings(model, input_ids, None, None, past_key_values, options, tokenizer, None, None, compile)[0]
