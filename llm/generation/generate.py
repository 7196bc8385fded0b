"""The decoding loop: prefill once, then cached forwards of one token, or of a draft to verify.

Every mode is one loop. Each step feeds the last emitted token, plus the draft tokens of a
proposer if there is one (reference decoding or a draft model), in ONE cached forward; the
longest draft prefix that the acceptance rule keeps is emitted with one token from the model's
own distribution, and the cache is cropped to what was accepted. Without a proposer a step is
plain decoding. The acceptance rule is that of speculative sampling (Leviathan et al. 2023,
Chen et al. 2023): with greedy decoding it keeps the draft while it equals the argmax, so the
output is token for token that of plain greedy decoding; with sampling, the output distribution
is exactly the model's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from llm.cache import Cache, DynamicCache
from llm.generation.candidates import DraftModel, DraftSchedule, PromptLookup
from llm.generation.sampling import Sampler


@dataclass
class GenerateOutput:
    """What ``generate(..., return_dict_in_generate=True)`` returns.

    Attributes:
        sequences: what ``generate`` returns otherwise: (batch, prompt + new) int64 with
            input_ids, (batch, new) with inputs_embeds.
        past_key_values: the cache after decoding (it holds all but the last new token).
        stats: ``prefill_tokens`` and ``new_tokens`` (real tokens: no padding, no pad tokens of
            finished rows), ``forward_passes`` (of the model, prefill included),
            ``proposed_tokens`` and ``accepted_tokens`` (draft tokens, any proposer),
            ``draft_forward_passes``, ``prefill_s`` and ``decode_s`` (seconds),
            ``prefill_tokens_per_s`` and ``decode_tokens_per_s`` (decode: tokens after the first).
    """

    sequences: torch.Tensor
    past_key_values: Cache | None = None
    stats: dict = field(default_factory=dict)


def _positive_int(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class _StopStrings:
    """Finds stop strings in each row's newly generated text (decoded with the tokenizer)."""

    def __init__(self, stop_strings: Sequence[str], tokenizer):
        if tokenizer is None:
            raise ValueError("stop_strings needs tokenizer= to decode the generated tokens")
        self.strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        if not self.strings or any(not isinstance(s, str) or not s for s in self.strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
        self.tokenizer = tokenizer
        # every token decodes to at least one character, so this many tokens cover any match
        self.window = max(len(s) for s in self.strings) + 1

    def hit(self, row_tokens: list[int]) -> bool:
        text = self.tokenizer.decode(row_tokens[-self.window - 8:])
        return any(s in text for s in self.strings)


class _Decoding:
    """State of one generate call; iterate to decode, one (batch, n) chunk of new tokens per step."""

    def __init__(self, model, input_ids, inputs_embeds, attention_mask, past_key_values, max_new_tokens, sampler,
                 eos_token_id, pad_token_id, stop, proposer, schedule="heuristic"):
        self.model, self.sampler, self.stop, self.proposer = model, sampler, stop, proposer
        self.schedule = DraftSchedule(proposer.num_tokens, schedule) if proposer is not None else None
        config = model.config
        prompt = input_ids if input_ids is not None else inputs_embeds
        self.batch, self.prompt_len = prompt.shape[:2]
        if self.prompt_len == 0:
            raise ValueError("the prompt is empty: generate needs at least one token")
        device = model.device
        self.max_new_tokens = max_new_tokens

        cache = Cache.from_legacy(past_key_values) if isinstance(past_key_values, (tuple, list)) else past_key_values
        self.cache = cache if cache is not None else DynamicCache()
        self.cached = self.cache.get_seq_length()
        if self.cached >= self.prompt_len:
            raise ValueError(
                f"past_key_values already holds {self.cached} positions but the prompt has {self.prompt_len}: "
                "pass the whole sequence so far (the cache must hold a strict prefix of it)"
            )
        needed = self.prompt_len + max_new_tokens - 1  # the last new token is never fed back
        if config.learned_pos_emb and needed > config.max_seq_len:
            raise ValueError(
                f"prompt of {self.prompt_len} tokens + max_new_tokens={max_new_tokens} needs {needed} positions, "
                f"more than max_seq_len={config.max_seq_len}; shorten the prompt or max_new_tokens"
            )
        limit = self.cache.get_max_length()
        if limit is not None and needed > limit:
            raise ValueError(
                f"prompt of {self.prompt_len} tokens + max_new_tokens={max_new_tokens} needs {needed} cache "
                f"positions, more than the StaticCache's max_cache_len={limit}"
            )
        self.cache.validate(config, self.batch, self.prompt_len - self.cached, model.dtype)

        if attention_mask is None:
            attention_mask = torch.ones(self.batch, self.prompt_len, dtype=torch.bool, device=device)
        elif tuple(attention_mask.shape) != (self.batch, self.prompt_len):
            raise ValueError(
                f"attention_mask must be (batch, T) = ({self.batch}, {self.prompt_len}), got {tuple(attention_mask.shape)}"
            )
        self.mask = attention_mask.to(device=device, dtype=torch.bool)
        self.padded = not bool(self.mask.all())
        if proposer is not None and (self.batch != 1 or self.padded):
            raise ValueError("speculative decoding runs one unpadded row at a time (generate splits batches)")

        self.eos = None
        if eos_token_id is not None:
            ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
            self.eos = torch.tensor(ids, dtype=torch.long, device=device)
        self.pad = pad_token_id if pad_token_id is not None else (int(self.eos[0]) if self.eos is not None else 0)

        self.prompt = prompt.to(device)
        # token history per row, for the repetition penalty and for reference decoding
        self.history = input_ids.to(device) if input_ids is not None else torch.zeros(self.batch, 0, dtype=torch.long, device=device)
        self.seen = None
        if sampler.repetition_penalty is not None:
            self.seen = torch.zeros(self.batch, config.vocab_size, dtype=torch.bool, device=device)
            self.seen.scatter_(1, self.history, self.mask[:, : self.history.shape[1]])
        self.finished = torch.zeros(self.batch, dtype=torch.bool, device=device)
        self.new_tokens: list[list[int]] = [[] for _ in range(self.batch)]
        # token counts are of real tokens: padding and the pad tokens of finished rows do not count
        self.stats = dict(prefill_tokens=int(self.mask[:, self.cached:].sum()), new_tokens=0, forward_passes=0,
                          proposed_tokens=0, accepted_tokens=0, draft_forward_passes=0)
        self.prefill_s = self.decode_s = 0.0

    def _forward(self, new: torch.Tensor, logits_to_keep: int = 1) -> torch.Tensor:
        key = "input_ids" if new.dim() == 2 else "inputs_embeds"
        out = self.model(**{key: new}, attention_mask=self.mask if self.padded else None,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
        self.stats["forward_passes"] += 1
        return out.logits

    def __iter__(self) -> Iterator[torch.Tensor]:
        start = time.perf_counter()
        logits = self._forward(self.prompt[:, self.cached:])[:, -1]
        token = self.sampler.pick(logits, self.seen)
        self.prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        chunk = self._emit(token[:, None])
        yield chunk
        while not bool(self.finished.all()) and len(self.new_tokens[0]) < self.max_new_tokens:
            chunk = self._step(chunk[:, -1])
            yield chunk
        self.decode_s = time.perf_counter() - start

    def _step(self, last: torch.Tensor) -> torch.Tensor:
        """Feed the last token (and a draft); return the (batch, n) tokens emitted."""
        draft, draft_probs = None, None
        k = self.schedule.next_draft_len() if self.schedule is not None else 0
        if k:
            # the draft and the token after it must fit what max_new_tokens leaves
            room = self.max_new_tokens - len(self.new_tokens[0]) - 1
            draft, draft_probs = self.proposer.propose(self.history[0], min(room, k))
            self.stats["proposed_tokens"] += draft.numel()
            if isinstance(self.proposer, DraftModel):
                self.stats["draft_forward_passes"] += draft.numel()
        if self.padded:
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        if draft is None or draft.numel() == 0:
            logits = self._forward(last[:, None])[:, -1]
            chunk = self._emit(self.sampler.pick(logits, self.seen)[:, None])
            if self.schedule is not None:
                self.schedule.step_done(0, 0)
            return chunk

        fed = torch.cat([last, draft])[None]
        cached = self.cache.get_seq_length()
        logits = self._forward(fed, logits_to_keep=fed.shape[1])[0]
        accepted, token = self._accept(draft, draft_probs, logits)
        self.stats["accepted_tokens"] += accepted
        chunk = self._emit(torch.cat([draft[:accepted], token.view(1)])[None])
        # The cache keeps the fed token and every emitted token but the last; emission may stop
        # inside the accepted draft (eos, a stop string), so crop to what was emitted.
        self.cache.crop(cached + chunk.shape[1])
        self.proposer.accepted(self.history[0])
        self.schedule.step_done(draft.numel(), accepted)
        return chunk

    def _accept(self, draft, draft_probs, logits):
        """Speculative acceptance: (number of draft tokens kept, the token that follows them).

        Draft token d is kept with probability min(1, p(d) / q(d)); the first rejected one is
        replaced by a draw from the residual max(p - q, 0), renormalised (q is one-hot for
        copied drafts). With greedy decoding p is one-hot: keep while d is the argmax.
        """
        seen = self.seen.clone() if self.seen is not None else None
        for i, d in enumerate(draft.tolist()):
            p = self.sampler.probs(logits[i:i + 1], seen)[0]
            q = draft_probs[i] if draft_probs is not None else None
            q_d = float(q[d]) if q is not None else 1.0
            u = 0.0 if self.sampler.greedy else self.sampler.uniform()
            if u * q_d >= float(p[d]):
                if self.sampler.greedy:
                    return i, p.argmax()
                if q is None:
                    residual = p.clone()
                    residual[d] = 0.0
                else:
                    residual = (p - q).clamp_min(0)
                if float(residual.sum()) <= 0:  # p <= q everywhere means p == q: a draw from p is exact
                    residual = p
                return i, self.sampler.draw((residual / residual.sum())[None])[0]
            if seen is not None:
                seen[0, d] = True
        return draft.numel(), self.sampler.pick(logits[-1:], seen)[0]

    def _emit(self, tokens: torch.Tensor) -> torch.Tensor:
        """Record (batch, n) new tokens: cut at max_new_tokens and where the last row stops (eos or a
        stop string); rows that stopped earlier get ``pad_token_id``."""
        tokens = tokens[:, : self.max_new_tokens - len(self.new_tokens[0])].clone()
        keep = 0
        for j in range(tokens.shape[1]):
            if bool(self.finished.all()):
                break
            keep = j + 1
            for row in range(self.batch):
                if bool(self.finished[row]):
                    tokens[row, j] = self.pad
                    self.new_tokens[row].append(self.pad)
                    continue
                t = int(tokens[row, j])
                self.new_tokens[row].append(t)
                self.stats["new_tokens"] += 1
                if (self.eos is not None and bool((self.eos == t).any())) or (
                    self.stop is not None and self.stop.hit(self.new_tokens[row])
                ):
                    self.finished[row] = True
        tokens = tokens[:, :keep]
        self.history = torch.cat([self.history, tokens], dim=1)
        if self.seen is not None:
            self.seen.scatter_(1, tokens, True)
        return tokens

    def result(self, input_ids, return_dict: bool):
        generated = torch.tensor(self.new_tokens, dtype=torch.long, device=self.prompt.device)
        sequences = torch.cat([input_ids.to(generated.device), generated], dim=1) if input_ids is not None else generated
        if not return_dict:
            return sequences
        decoded = self.stats["new_tokens"] - self.batch  # each row's first token comes from the prefill
        self.stats["prefill_s"], self.stats["decode_s"] = self.prefill_s, self.decode_s
        self.stats["prefill_tokens_per_s"] = self.stats["prefill_tokens"] / max(self.prefill_s, 1e-9)
        self.stats["decode_tokens_per_s"] = decoded / self.decode_s if decoded > 0 and self.decode_s > 0 else float("nan")
        return GenerateOutput(sequences=sequences, past_key_values=self.cache, stats=self.stats)


def _decodings(model, input_ids=None, *, inputs_embeds=None, attention_mask=None, past_key_values=None,
               max_new_tokens=20, do_sample=False, temperature=1.0, top_k=None, top_p=None, min_p=None,
               repetition_penalty=None, eos_token_id=None, pad_token_id=None, stop_strings=None, tokenizer=None,
               seed=None, prompt_lookup_num_tokens=None, max_matching_ngram_size=None, reference_ids=None,
               assistant_model=None, num_assistant_tokens=None, num_assistant_tokens_schedule="heuristic"):
    """Validate the arguments; return the per-row (speculative) or whole-batch decodings to run."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    _positive_int("max_new_tokens", max_new_tokens, allow_none=False)
    _positive_int("prompt_lookup_num_tokens", prompt_lookup_num_tokens)
    _positive_int("max_matching_ngram_size", max_matching_ngram_size)
    _positive_int("num_assistant_tokens", num_assistant_tokens)
    if num_assistant_tokens_schedule not in ("heuristic", "constant"):
        raise ValueError(
            f"num_assistant_tokens_schedule must be 'heuristic' or 'constant', got {num_assistant_tokens_schedule!r}"
        )
    if prompt_lookup_num_tokens is not None and assistant_model is not None:
        raise ValueError("choose one proposer: prompt_lookup_num_tokens (reference decoding) or assistant_model")
    if assistant_model is not None and assistant_model.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"assistant_model has vocab_size {assistant_model.config.vocab_size}, the model "
            f"{model.config.vocab_size}: the draft must share the tokenizer"
        )
    speculative = prompt_lookup_num_tokens is not None or assistant_model is not None
    if speculative and input_ids is None:
        raise ValueError("speculative decoding works on token ids: pass input_ids, not inputs_embeds")
    if assistant_model is not None and assistant_model.config.learned_pos_emb:
        needed = input_ids.shape[1] + max_new_tokens - 1
        if needed > assistant_model.config.max_seq_len:
            raise ValueError(
                f"assistant_model has learned positions up to max_seq_len={assistant_model.config.max_seq_len}, "
                f"but the prompt of {input_ids.shape[1]} tokens + max_new_tokens={max_new_tokens} needs {needed}"
            )
    generator = torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None
    sampler = Sampler(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                      repetition_penalty=repetition_penalty, generator=generator)
    stop = _StopStrings(stop_strings, tokenizer) if stop_strings is not None else None

    common = dict(max_new_tokens=max_new_tokens, sampler=sampler, eos_token_id=eos_token_id,
                  pad_token_id=pad_token_id, stop=stop, schedule=num_assistant_tokens_schedule)

    def proposer():
        if assistant_model is not None:
            return DraftModel(assistant_model, num_assistant_tokens or 5, sampler)
        if speculative:
            references = [] if reference_ids is None else (
                [reference_ids] if torch.is_tensor(reference_ids) and reference_ids.dim() == 1 else list(reference_ids))
            return PromptLookup(prompt_lookup_num_tokens, max_matching_ngram_size or 2,
                                [torch.as_tensor(r, device=model.device) for r in references])
        return None

    mask = attention_mask
    if not speculative or (input_ids.shape[0] == 1 and (mask is None or bool(mask.bool().all()))):
        return [_Decoding(model, input_ids, inputs_embeds, attention_mask, past_key_values, proposer=proposer(), **common)]
    if past_key_values is not None:
        raise ValueError("speculative decoding of a batch decodes row by row: it cannot share one past_key_values")
    rows = []
    for r in range(input_ids.shape[0]):
        real = mask[r].bool() if mask is not None else slice(None)
        rows.append(_Decoding(model, input_ids[r:r + 1, real], None, None, None, proposer=proposer(), **common))
    return rows


def generate(model, input_ids: torch.Tensor | None = None, *, streamer=None,
             return_dict_in_generate: bool = False, **kwargs) -> torch.Tensor | GenerateOutput:
    """Greedy or sampled decoding with a KV cache, plain or speculative (transformers' conventions).

    The prompt is prefilled in one forward. Each later forward feeds the last new token, plus
    a draft when speculative decoding is on. If ``past_key_values`` already holds the first L
    positions of the prompt (a prompt cache, or an earlier ``generate`` call's cache), only
    prompt positions L..T-1 are run, for ``input_ids`` and ``inputs_embeds`` alike.

    Args:
        model: a :class:`~llm.model.MosaicGPT`.
        input_ids: (batch, T) int64 prompt, left padded for prompts of different lengths; or
        inputs_embeds: (batch, T, d_model) prompt embeddings (exactly one of the two).
        attention_mask: (batch, T) 1 for real tokens, 0 for padding; default all ones.
        past_key_values: a cache holding a prefix (L < T positions) of the prompt, written in
            place; default a new :class:`~llm.cache.DynamicCache`.
        max_new_tokens: the most tokens to add per row (>= 1).
        do_sample: sample instead of greedy; ``temperature=0`` is greedy as well.
        temperature (>= 0), top_k (>= 0; 0/None: off), top_p (in (0, 1]), min_p (in [0, 1]),
        repetition_penalty (> 0; counts every token of the sequence, cached prompt included).
        eos_token_id: one id or several; a row stops at its first and is then filled with
            ``pad_token_id`` (default: the first eos id, else 0); decoding ends when all stop.
        stop_strings: a string or strings that stop a row once its new text contains one;
            needs ``tokenizer``.
        streamer: an object with ``put(token_ids)`` and ``end()`` (transformers' protocol,
            e.g. ``transformers.TextStreamer``): it gets the prompt ids first, then each step's
            new tokens ((n,) for batch 1, else (batch, n)).
        seed: seeds a generator of this call's own, so a run is reproducible.
        prompt_lookup_num_tokens, max_matching_ngram_size, reference_ids: reference decoding
            (LLMA / prompt lookup): drafts of up to K tokens copied from the prompt, the
            generated text, or ``reference_ids`` (1-D token tensors of documents).
        assistant_model, num_assistant_tokens: draft-model speculative decoding with a smaller
            MosaicGPT of the same vocabulary, proposing K tokens per step.
        num_assistant_tokens_schedule: ``"heuristic"`` (default): the draft length adapts and
            steps draft only while drafting pays in measured tokens per second, so that drafts
            that keep failing (free text with reference decoding) cost little; ``"constant"``: a
            draft of K at every step (see :class:`~llm.generation.candidates.DraftSchedule`).
            Either way the tokens are the same.
        return_dict_in_generate: return a :class:`GenerateOutput` with statistics.

    Returns:
        With input_ids: (batch, T + new) int64, prompt followed by the new tokens; with
        inputs_embeds: (batch, new) int64, only the new tokens. Speculative decoding of a batch
        runs row by row and gives the same tokens as decoding the batch.

    Raises:
        ValueError: a bad argument (naming it and its allowed range); a cache that does not fit
            the model or already holds the whole prompt; a prompt plus max_new_tokens beyond
            max_seq_len (learned positions) or the StaticCache.
    """
    decodings = _decodings(model, input_ids, **kwargs)
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
        return decodings[0].result(input_ids, return_dict_in_generate)
    return _merge_rows(decodings, input_ids, kwargs.get("attention_mask"), return_dict_in_generate)


def _merge_rows(decodings, input_ids, attention_mask, return_dict):
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


def stream(model, input_ids: torch.Tensor | None = None, **kwargs) -> Iterator[torch.Tensor]:
    """Yield new tokens as they are decoded: (batch, n) int64 per step (n > 1 when drafts are accepted).

    Takes ``generate``'s arguments (not ``streamer`` or ``return_dict_in_generate``). Finished
    rows yield ``pad_token_id``.

    Raises:
        ValueError: as ``generate``; and for speculative decoding of more than one prompt, which
            decodes row by row and so has no (batch, n) steps to yield.
    """
    decodings = _decodings(model, input_ids, **kwargs)
    if len(decodings) > 1:
        raise ValueError("streaming speculative decoding needs a batch of one prompt")
    yield from decodings[0]
