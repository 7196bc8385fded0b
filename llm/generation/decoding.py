"""The decoding loop: prefill once, then cached forwards of one token, or of a draft to verify.

Every mode is one loop. Each step feeds the last emitted token, plus the draft tokens of a
proposer if there is one (reference decoding or a draft model), in ONE cached forward; the
longest draft prefix that the acceptance rule keeps is emitted with one token from the model's
own distribution, and the cache is cropped to what was accepted. Without a proposer a step is
plain decoding. The acceptance rule is that of speculative sampling (Leviathan et al. 2023,
Chen et al. 2023): with greedy decoding it keeps the draft while it equals the argmax, so the
output is token for token that of plain greedy decoding; with sampling, the output distribution
is exactly the model's. The entry points (``generate``, ``stream``) are in
:mod:`llm.generation.generate`.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import torch

from llm.cache import Cache, DynamicCache
from llm.generation.candidates import DraftModel, DraftSchedule
from llm.generation.compiled import PREFILL_CHUNK, StaticDecoder, verify_chunk
from llm.generation.config import GenerationConfig
from llm.generation.sampling import Sampler


#: The most positions ``generate`` allocates a cache for up front (SmolLM2: 46 KB a position).
_EXPECT_LIMIT = 8192
# Most tokens of one whole-steps call (Decoding._whole_steps): a chunk streams out at once, 16
# tokens are about 0.1 s of SmolLM2 on 2 cores; the first chunks are shorter (4, then doubling).
_CHUNK_FIRST, _CHUNK_MOST = 4, 16


def check_finite_logits(logits: torch.Tensor) -> None:
    """Refuse logits (batch, vocab) with a NaN in a row: a model whose weights are NaN (a run
    that diverged) or corrupt, which would otherwise decode nothing and look like an empty answer.
    Checked once per call, at the prompt's logits (one host sync).

    Raises:
        ValueError: saying the model's output is NaN and why that happens.
    """
    if torch.isnan(logits).any():
        raise ValueError("the model's logits are NaN: its weights hold NaN or are corrupt (a training run that "
                         "diverged, e.g. with too high a learning rate, or a damaged weights file)")


class ContextLengthWarning(UserWarning):
    """Decoding runs past the model's ``max_seq_len`` (rotary or ALiBi positions extrapolate,
    learned positions cannot and raise instead)."""


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


def check_token_ids(ids: torch.Tensor, vocab_size: int, name: str = "input_ids") -> None:
    """Refuse what the embedding would index wrongly or crash on: ``ids`` (any shape) must hold
    integers in [0, vocab_size).

    Raises:
        ValueError: for a float or bool dtype, or naming the first id outside the vocabulary, its
            index and the vocabulary size.
    """
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.numel() == 0:
        return
    lowest, highest = torch.aminmax(ids)  # one op in a decoding step, the mask only on error
    if int(lowest) < 0 or int(highest) >= vocab_size:
        bad = (ids < 0) | (ids >= vocab_size)
        where = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name} holds token id {int(ids[where])} (at index {list(where)}), outside the "
                         f"vocabulary of {vocab_size} tokens (ids 0 to {vocab_size - 1})")


class StopStrings:
    """Finds stop strings in each row's newly generated text (decoded with the tokenizer)."""

    def __init__(self, strings: tuple[str, ...], tokenizer):
        if tokenizer is None:
            raise ValueError("stop_strings needs tokenizer= to decode the generated tokens")
        self.strings = strings
        self.tokenizer = tokenizer
        # every token decodes to at least one character, so this many tokens cover any match
        self.window = max(len(s) for s in self.strings) + 1

    def hit(self, row_tokens: list[int]) -> bool:
        text = self.tokenizer.decode(row_tokens[-self.window - 8:])
        return any(s in text for s in self.strings)


class Decoding:
    """State of one generate call; iterate to decode, one (batch, n) chunk of new tokens per step.

    Args:
        model: the MosaicGPT; input_ids / inputs_embeds, attention_mask, past_key_values: as
            ``generate``'s (input_ids already checked against the vocabulary).
        options: the validated options; sampler: made from them.
        stop: a :class:`StopStrings` or None; proposer: a draft proposer
            (:mod:`llm.generation.candidates`) or None for plain decoding.
        compile: run the model's forwards through the compiled static-cache steps of
            :mod:`llm.generation.compiled` (a given past_key_values is copied, not written).

    Raises:
        ValueError: for a prompt, mask, cache or pad id that does not fit (see ``generate``).
    """

    def __init__(self, model, input_ids, inputs_embeds, attention_mask, past_key_values, options: GenerationConfig,
                 sampler: Sampler, stop: StopStrings | None, proposer, compile: bool = False):
        self.model, self.sampler, self.stop, self.proposer = model, sampler, stop, proposer
        self.schedule = (DraftSchedule(proposer.num_tokens, options.num_assistant_tokens_schedule)
                         if proposer is not None else None)
        config = model.config
        max_new_tokens = options.max_new_tokens
        prompt = input_ids if input_ids is not None else inputs_embeds
        self.batch, self.prompt_len = prompt.shape[:2]
        if self.prompt_len == 0:
            raise ValueError("the prompt is empty: generate needs at least one token")
        device = model.device
        self.max_new_tokens = max_new_tokens

        cache = Cache.from_legacy(past_key_values) if isinstance(past_key_values, (tuple, list)) else past_key_values
        needed = self._open_cache(cache)
        if isinstance(self.cache, DynamicCache):
            # room for the whole call now (a draft's verify chunk may run past the last token), so
            # no decode step pays for a grow; past _EXPECT_LIMIT positions storage doubles as needed
            self.cache.expect(min(needed + (2 * proposer.num_tokens if proposer is not None else 0), _EXPECT_LIMIT))

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
        self._find_last_real_tokens()
        self.static = self.steps = None
        if compile:
            draft = proposer.num_tokens if proposer is not None else 0
            prefill_end = self.cached + -(-(self.prompt_len - self.cached) // PREFILL_CHUNK) * PREFILL_CHUNK
            writes = max(prefill_end, needed + (verify_chunk(draft) if draft else 0))
            self.static = StaticDecoder(model, self.mask, writes, cache, compile=True, draft_tokens=draft)
            self.cache = self.static.cache
        else:  # one-token steps, thin on the fused kernel (MosaicGPT.decoding_steps)
            self.steps = model.decoding_steps(self.cache)

        self._eos_and_pad(options)

        self.prompt = prompt.to(device)
        # token history per row, for the repetition penalty and for speculative proposers
        self.history = input_ids.to(device) if input_ids is not None else torch.zeros(self.batch, 0, dtype=torch.long, device=device)
        self.seen = None
        if sampler.repetition_penalty is not None:
            self.seen = torch.zeros(self.batch, config.vocab_size, dtype=torch.bool, device=device)
            self.seen.scatter_(1, self.history, self.mask[:, : self.history.shape[1]])
        self.finished = [False] * self.batch
        self.new_tokens: list[list[int]] = [[] for _ in range(self.batch)]
        # token counts are of real tokens: padding and the pad tokens of finished rows do not count
        self.stats = dict(prefill_tokens=int(self.mask[:, self.cached:].sum()), new_tokens=0, forward_passes=0,
                          proposed_tokens=0, accepted_tokens=0, draft_forward_passes=0)
        self.prefill_s = self.decode_s = 0.0
        self._chunk = _CHUNK_FIRST

    def _open_cache(self, cache: Cache | None) -> int:
        """Take ``cache`` (a new DynamicCache for None), checked to hold a strict prefix of the
        prompt and to have room for the new tokens; returns the positions the call writes."""
        config = self.model.config
        self.cache = cache if cache is not None else DynamicCache()
        self.cached = self.cache.get_seq_length()
        if self.cached >= self.prompt_len:
            raise ValueError(
                f"past_key_values already holds {self.cached} positions but the prompt has {self.prompt_len}: "
                "pass the whole sequence so far (the cache must hold a strict prefix of it)"
            )
        needed = self.prompt_len + self.max_new_tokens - 1  # the last new token is never fed back
        if config.learned_pos_emb and needed > config.max_seq_len:
            raise ValueError(
                f"prompt of {self.prompt_len} tokens + max_new_tokens={self.max_new_tokens} needs {needed} "
                f"positions, more than max_seq_len={config.max_seq_len}; shorten the prompt or max_new_tokens"
            )
        if needed > config.max_seq_len:
            warnings.warn(
                f"prompt of {self.prompt_len} tokens + max_new_tokens={self.max_new_tokens} reaches position "
                f"{needed}, past the model's context of max_seq_len={config.max_seq_len}: text beyond it is "
                "unreliable (positions it was never trained on)", ContextLengthWarning, stacklevel=2)
        limit = self.cache.get_max_length()
        if limit is not None and needed > limit:
            raise ValueError(
                f"prompt of {self.prompt_len} tokens + max_new_tokens={self.max_new_tokens} needs {needed} cache "
                f"positions, more than the StaticCache's max_cache_len={limit}"
            )
        self.cache.validate(config, self.batch, self.prompt_len - self.cached, self.model.dtype)
        return needed

    def _eos_and_pad(self, options: GenerationConfig) -> None:
        """The eos ids (a tuple, maybe empty) and the id finished rows feed the model: ``pad_token_id``,
        by default the first eos id."""
        eos = options.eos_token_id
        self.eos = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(i) for i in eos)
        pad = options.pad_token_id
        self.pad = pad if pad is not None else (self.eos[0] if self.eos else 0)
        vocab_size = self.model.config.vocab_size
        if self.pad >= vocab_size:  # finished rows feed it to the model
            which = "pad_token_id" if pad is not None else "pad_token_id (by default the first eos_token_id)"
            raise ValueError(f"{which} is {self.pad}, outside the vocabulary of {vocab_size} tokens")

    def _find_last_real_tokens(self) -> None:
        """Where each row's next token comes from: the logits at its last real position.

        That is the prompt's end when it is padded on the left; for a row padded on the right
        (what tokenizers do by default) it is earlier, and the pads then stand between the prompt
        and the new tokens, where the model ignores them as it ignores padding anywhere.
        """
        positions = torch.arange(self.prompt_len, device=self.mask.device)
        self.last = torch.where(self.mask, positions, -1).amax(dim=1)  # (batch,) int64
        for row, last in enumerate(self.last.tolist()):
            if last < 0:
                raise ValueError(f"row {row} of attention_mask has no real token (all 0): nothing to continue")
            if last < self.cached:
                raise ValueError(
                    f"row {row}'s last real token (position {last}) is inside past_key_values, which holds "
                    f"{self.cached} positions: its next token needs that position's logits; give a cache "
                    f"that ends before every row's last real token"
                )
        # enough trailing positions of logits to reach every row's last real token
        self.logits_to_keep = self.prompt_len - int(self.last.min())

    def _forward(self, new: torch.Tensor, logits_to_keep: int = 1) -> torch.Tensor:
        self.stats["forward_passes"] += 1
        if self.static is not None:  # all positions fed: (batch, n, vocab)
            return self.static.forward(new)
        if new.dim() == 2 and new.shape[1] == 1 and logits_to_keep == 1:  # one token: the thin step
            return self.steps(new, self.mask if self.padded else None)[:, None]
        key = "input_ids" if new.dim() == 2 else "inputs_embeds"
        out = self.model(**{key: new}, attention_mask=self.mask if self.padded else None,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
        return out.logits

    def __iter__(self) -> Iterator[torch.Tensor]:
        start = time.perf_counter()
        logits = self._prefill()
        check_finite_logits(logits)
        token = self.sampler.pick(logits, self.seen)
        self.prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        chunk = self._emit(token[:, None])
        yield chunk
        while not all(self.finished) and len(self.new_tokens[0]) < self.max_new_tokens:
            chunk = self._step(chunk[:, -1])
            yield chunk
        self.decode_s = time.perf_counter() - start

    def _prefill(self) -> torch.Tensor:
        """Run the uncached prompt; return (batch, vocab) logits at each row's last real token."""
        new = self.prompt[:, self.cached:]
        if self.static is not None:
            self.stats["forward_passes"] += -(-new.shape[1] // PREFILL_CHUNK)
            return self.static.prefill(new, self.mask, self.last)
        logits = self._forward(new, self.logits_to_keep)
        first_kept = self.prompt_len - self.logits_to_keep
        return logits[torch.arange(self.batch, device=logits.device), self.last - first_kept]

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
        if self.padded and self.static is None:  # the static decoder keeps its own key mask
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        if draft is None or draft.numel() == 0:
            chunk = self._whole_steps(last) if self.schedule is None else None
            if chunk is not None:
                return chunk
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

    def _whole_steps(self, last: torch.Tensor) -> torch.Tensor | None:
        """The next chunk of (1, n) tokens emitted, decoded in one kernel call
        (:meth:`llm.model.buffer.FusedSteps.tokens`): the tokens, cache and random draws of as many
        one-token steps. None, with nothing done, where it does not run: a batch, padding, the
        repetition penalty, draws on another device, or a model off the fused kernel.

        A chunk's draws are taken from the generator when it is decoded, before its tokens are
        emitted: without ``seed``, code that draws from torch's global generator between two
        tokens of a stream (a streamer's ``put``, another stream read in turn) takes other numbers
        than it would one step a token. ``seed`` gives the call a generator of its own."""
        sampler = self.sampler
        generator = sampler.generator if sampler.generator is not None else torch.default_generator
        if (self.steps is None or self.batch != 1 or self.padded or self.seen is not None
                or (not sampler.greedy and generator.device.type != "cpu")):
            return None
        k = min(self._chunk, self.max_new_tokens - len(self.new_tokens[0]))
        sampling = uniforms = state = None
        if not sampler.greedy:  # one draw a token, as Sampler.pick's: the same numbers in the same order
            sampling = (sampler.temperature, sampler.top_k or 0, 1.0 if sampler.top_p is None else sampler.top_p,
                        sampler.min_p or 0.0)
            state = generator.get_state()
            uniforms = torch.rand(k, generator=generator, dtype=torch.float64)
        past = self.cache.get_seq_length()
        new = self.steps.tokens(int(last[0]), k, self.eos, sampling, uniforms)
        if new is None:
            if state is not None:
                generator.set_state(state)
            return None
        self._chunk = min(2 * self._chunk, _CHUNK_MOST)
        chunk = self._emit(new[None])
        self.stats["forward_passes"] += chunk.shape[1]  # the steps of the tokens kept, as one a token
        if chunk.shape[1] < len(new):  # a stop string inside: the cache of as many steps as tokens emitted
            self.cache.crop(past + chunk.shape[1])
        if state is not None and chunk.shape[1] < k:  # the generator as after the draws of the tokens emitted
            generator.set_state(state)
            torch.rand(chunk.shape[1], generator=generator, dtype=torch.float64)
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
        rows = tokens[:, : self.max_new_tokens - len(self.new_tokens[0])].tolist()  # one read, then Python
        keep = 0
        for j in range(len(rows[0])):
            if all(self.finished):
                break
            keep = j + 1
            for row, values in enumerate(rows):
                if self.finished[row]:
                    values[j] = self.pad
                    self.new_tokens[row].append(self.pad)
                    continue
                t = values[j]
                self.new_tokens[row].append(t)
                self.stats["new_tokens"] += 1
                if t in self.eos or (self.stop is not None and self.stop.hit(self.new_tokens[row])):
                    self.finished[row] = True
        tokens = torch.tensor([values[:keep] for values in rows], dtype=torch.long, device=tokens.device)
        if self.proposer is not None:  # the only reader of the history
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
