"""The serving engine: continuous batching of many requests over one model, with prefix caching.

Requests join the running batch at step boundaries and leave when they finish (Orca's
iteration-level scheduling, Yu et al. 2022; vLLM's and llama.cpp server's continuous batching):

- a joining request's prompt is prefilled (only the part after the longest cached prefix,
  :class:`~llm.serve.prefix.PrefixCache`) in chunks mixed with the batch's steps (chunked prefill,
  as Sarathi-Serve and vLLM): each engine step prefills at most ``prefill_chunk`` prompt tokens
  before the batch's decoding step, so a long prompt arriving delays the running rows' next
  tokens by one chunk's time, not its whole prefill; a prompt that fits in a chunk is never cut.
  The prompts whose rests fit in a step's chunk go first and are prefilled together, in one
  forward over a :class:`~llm.serve.batch.SlotBatch` of their own (Sarathi-Serve's and vLLM's
  batched prefill); the oldest longer prompt takes what is left, at least a quarter of the chunk.
  A prompt's first token is sampled from the last chunk's logits, and its keys and values copied into a
  free slot of the :class:`~llm.serve.batch.SlotBatch`. A prompt cached but for its last token
  (a repeated prompt: a lookup leaves at least one token to compute) joins the batch at once, and
  the batch's step feeds that token with the other rows' (as vLLM computes only the last token of
  a cached prompt): no forward of its own, so a wave of repeated prompts starts in one step;
- each step then feeds every row's last token in one forward; each row samples from its own
  logits with its own :class:`~llm.generation.sampling.Sampler` and random generator, and stops
  on its own eos, stop strings or ``max_new_tokens``. A row's tokens are those of the same
  request run alone through ``generate`` (greedy; with a seed, the same draws): its positions,
  mask and sampling are its own, whatever else is in the batch;
- a row with ``prompt_lookup_num_tokens`` speculates (reference decoding: LLMA, Yang et al.
  2023; vLLM's n-gram speculation): its step feeds its last token and a draft copied from where
  its last n-gram occurred before (:class:`~llm.generation.candidates.PromptLookup`), or, on an
  engine with a ``draft_model``, a row with ``num_assistant_tokens`` feeds the greedy tokens of
  the draft model (:class:`~llm.generation.candidates.DraftModel`, a cache per row); all rows'
  in one forward (:meth:`~llm.serve.batch.SlotBatch.step_many`), and it emits tokens in order
  from the logits after each fed token for as long as the token picked equals the draft's next:
  the tokens (greedy, or sampled with the row's own generator, one draw per token) are those of
  decoding without a draft, and a step gives a row one token more per accepted draft token.

The engine runs on one thread (:meth:`Engine.start`); :meth:`Engine.submit` is safe to call from
any other, and reports each new token through a callback on the engine's thread. The queue of
requests waiting for a slot is bounded: a full queue raises :class:`QueueFull` at submission.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from llm.cache import DynamicCache
from llm.generation.candidates import DraftModel, PromptLookup
from llm.generation.compiled import PREFILL_CHUNK, StaticDecoder
from llm.generation.config import GenerationConfig
from llm.generation.decoding import StopStrings, check_finite_logits, check_token_ids
from llm.generation.sampling import Sampler
from llm.serve.batch import SlotBatch
from llm.serve.prefix import PrefixCache, layers_of
from llm.utils.tokens import common_prefix

log = logging.getLogger(__name__)

_ids = itertools.count()


class QueueFull(RuntimeError):
    """The engine's queue of waiting requests is full: try again later (HTTP 429)."""


class ShuttingDown(RuntimeError):
    """The engine takes no new requests: :meth:`Engine.shutdown` was called."""


@dataclass(eq=False)
class Sequence:
    """One submitted prompt and what the engine has made of it.

    Attributes:
        prompt: the prompt's token ids; options: its decoding options.
        tokens: the new token ids so far.
        finish_reason: None while running; "stop" (eos or a stop string), "length"
            (``max_new_tokens``), "cancelled", "shutdown" or "error" (then ``error`` says what went wrong).
        cached_tokens: prompt positions taken from the prefix cache instead of computed.
        logprobs: None, or how many alternatives each new token's ``token_logprobs`` entry lists.
        token_logprobs: per new token (with ``logprobs``), ``(token id, log probability,
            [(id, log probability) of the ``logprobs`` most likely tokens]``) under the model's
            distribution (log-softmax of its logits, before temperature or truncation, as vLLM's).
    """

    prompt: list[int]
    options: GenerationConfig
    callback: Callable[["Sequence", list[int], str | None], None] | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: str | None = None
    logprobs: int | None = None
    token_logprobs: list = field(default_factory=list)
    matcher: object = None  # llguidance's LLMatcher of the answer's grammar, or None
    # the engine's state of the running row
    sampler: Sampler | None = None
    seen: torch.Tensor | None = None
    eos: frozenset = frozenset()
    stop: StopStrings | None = None
    drafter: PromptLookup | DraftModel | None = None  # the drafts of a speculating row
    draft_tokens: int = 0  # draft tokens it fed, and of them those accepted
    accepted_tokens: int = 0
    prefill_cache: object = None  # the prompt's cache while it is prefilled chunk by chunk
    prefilled: int = 0  # prompt positions in prefill_cache

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop decoding this sequence (a client gone; ``reason="shutdown"``: the server stops):
        its row is freed at the next step and it finishes with ``reason``."""
        self.cancelled = self.cancelled or reason


class Engine:
    """Continuous batching over one model.

    Args:
        model: a :class:`~llm.model.MosaicGPT` as ``from_pretrained`` loads it (any dtype, any
            quantization).
        tokenizer: decodes new tokens for stop strings (needed only by requests with
            ``stop_strings``).
        max_batch_size: the most sequences decoding at once.
        max_queue: the most sequences waiting for a slot; more raise :class:`QueueFull`.
        prefix_cache_tokens: positions the prefix cache may hold (0: no prefix caching).
        compile: run prefill and the batch's step through ``torch.compile``
            (:mod:`llm.generation.compiled`; one graph per slot count and buffer capacity).
        prefill_chunk: the most prompt tokens prefilled per engine step (uncompiled); longer
            prompts take several steps. On our kernels chunking changes no bit of the logits
            (:mod:`tests.quant.test_invariance`).
        draft_model: a smaller :class:`~llm.model.MosaicGPT` of the same vocabulary that drafts
            for rows whose options set ``num_assistant_tokens`` (and not ``prompt_lookup_num_tokens``).

    Raises:
        ValueError: for a max_batch_size, max_queue or prefill_chunk below 1, or a negative
            prefix_cache_tokens.
    """

    def __init__(self, model, tokenizer=None, *, max_batch_size: int = 8, max_queue: int = 64,
                 prefix_cache_tokens: int = 4096, compile: bool = False, prefill_chunk: int = 256, draft_model=None):
        if max_batch_size < 1 or max_queue < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch_size, max_queue and prefill_chunk must be >= 1, got {max_batch_size}, "
                             f"{max_queue} and {prefill_chunk}")
        if draft_model is not None and draft_model.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_model.config.vocab_size} tokens) is not the "
                             f"model's ({model.config.vocab_size}): a draft must share the tokenizer")
        self.draft_model = draft_model
        self.prefill_chunk = prefill_chunk
        self.prefilling: list[Sequence] = []
        self._joining: list[tuple[Sequence, list]] = []  # rows prefilled this step: they join together
        self.model, self.tokenizer, self.compile = model, tokenizer, compile
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.batch = SlotBatch(model, max_batch_size, compile=compile)
        self.prefix = PrefixCache(prefix_cache_tokens)
        self._waiting: deque[Sequence] = deque()
        self._work = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = self._refusing = False
        self._ll_tokenizer = None
        self.steps = 0

    # -- submission (any thread) ------------------------------------------------------------
    def submit(self, requests: list[tuple[list[int], GenerationConfig]],
               callback: Callable[[Sequence, list[int], str | None], None] | None = None,
               logprobs: int | None = None, grammar: str | None = None) -> list[Sequence]:
        """Queue prompts (all or none); return their :class:`Sequence`\\ s.

        Args:
            requests: (prompt token ids, options) pairs; options as ``generate``'s
                (``max_new_tokens``, sampling, ``seed``, ``eos_token_id``, ``stop_strings``,
                ``prompt_lookup_num_tokens``...).
            callback: called on the engine's thread as ``callback(sequence, new_token_ids,
                finish_reason)`` for each step's new tokens, finish_reason None until the last.
            logprobs: record each new token's log probability and this many alternatives
                (``Sequence.token_logprobs``, filled before the callback hears of the token).
            grammar: an llguidance grammar (``LLMatcher.grammar_from_json_schema``) every answer
                keeps to: tokens that would leave it are masked before sampling, and an answer
                ends ("stop") when the grammar is complete (constrained decoding, as vLLM's and
                llama.cpp's structured outputs).

        Raises:
            QueueFull: if the waiting queue cannot take them all.
            ShuttingDown: after :meth:`shutdown`.
            ValueError: for an empty prompt, ids outside the vocabulary, stop strings without a
                tokenizer, more sequences than the queue holds, or (learned positions) a prompt
                and max_new_tokens beyond max_seq_len.
        """
        config = self.model.config
        sequences = []
        for prompt, options in requests:
            if not prompt:
                raise ValueError("the prompt is empty: give at least one token")
            check_token_ids(torch.tensor(prompt), config.vocab_size, "prompt")
            needed = len(prompt) + options.max_new_tokens - 1
            if config.learned_pos_emb and needed > config.max_seq_len:
                raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens={options.max_new_tokens} needs "
                                 f"{needed} positions, more than max_seq_len={config.max_seq_len}")
            if options.stop_strings and self.tokenizer is None:
                raise ValueError("stop strings need the engine's tokenizer")
            matcher = self._matcher(grammar) if grammar is not None else None
            sequences.append(Sequence(list(prompt), options, callback, logprobs=logprobs, matcher=matcher))
        if len(sequences) > self.max_queue:
            raise ValueError(f"{len(sequences)} sequences in one request, more than the queue of {self.max_queue}")
        with self._work:
            if self._refusing:
                raise ShuttingDown("the server is shutting down")
            waiting = sum(not s.cancelled for s in self._waiting)  # a cancelled one leaves at the next step
            if waiting + len(sequences) > self.max_queue:
                raise QueueFull(f"{waiting} sequences are waiting (the queue holds {self.max_queue})")
            self._waiting.extend(sequences)
            self._work.notify()
        return sequences

    def _matcher(self, grammar: str):
        """A new llguidance matcher of ``grammar`` over the model's vocabulary (the tokenizer's
        view for llguidance is built once, at the first grammar: ~0.6 s for 49,152 tokens)."""
        from llguidance import LLMatcher
        from llguidance.hf import from_tokenizer

        from llm.data.text_tokenizer import as_transformers

        if self.tokenizer is None:
            raise ValueError("a grammar needs the engine's tokenizer")
        if self._ll_tokenizer is None:
            try:
                self._ll_tokenizer = from_tokenizer(as_transformers(self.tokenizer), n_vocab=self.model.config.vocab_size)
            except Exception as err:  # llguidance reads byte-level BPE and SentencePiece tokenizers
                raise ValueError(f"response_format needs a tokenizer llguidance can read, and this model's is "
                                 f"not one ({err})") from None
        matcher = LLMatcher(self._ll_tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {matcher.get_error()}")
        return matcher

    def shutdown(self) -> None:
        """Refuse new requests (:meth:`submit` raises :class:`ShuttingDown`) and end every waiting
        and running sequence at the next step with finish_reason "shutdown" (any thread)."""
        with self._work:
            self._refusing = True
            batch = [s for s in self.batch.rows if s is not None]
            for sequence in [*self._waiting, *self.prefilling, *batch]:
                sequence.cancel("shutdown")
            self._work.notify()

    @property
    def waiting(self) -> int:
        return sum(not s.cancelled for s in self._waiting)

    @property
    def running(self) -> int:
        return len(self.batch) + len(self.prefilling) + len(self._joining)

    # -- the loop (the engine's thread) -----------------------------------------------------
    def start(self) -> "Engine":
        """Run :meth:`step` on a thread of its own until :meth:`close`."""
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the engine's thread (after its current step)."""
        with self._work:
            self._closed = True
            self._work.notify()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._closed:
            if not self.step():
                with self._work:
                    if not self._waiting and not self._closed:
                        self._work.wait(timeout=1.0)

    @torch.no_grad()
    def step(self) -> bool:
        """One iteration: drop cancelled sequences, admit waiting ones while slots are free, prefill
        up to ``prefill_chunk`` of their prompt tokens (a prompt done: its first token emitted, its
        row joins the batch), then one token for every batch row (more for a speculating row whose
        draft is accepted). Returns whether there was anything to do (False: idle)."""
        self._drop_cancelled()
        admitted = self._admit()
        self._prefill_some()
        joining, self._joining = self._joining, []
        self.batch.join_all(joining)  # one re-layout of the buffer for all of them
        if len(self.batch):
            self._decode_batch()
        self.steps += 1
        return bool(admitted or self.running or self._waiting)

    def _drop_cancelled(self) -> None:
        gone = []
        with self._work:
            for sequence in [s for s in self._waiting if s.cancelled]:
                self._waiting.remove(sequence)
                gone.append(sequence)
        for slot, sequence in enumerate(self.batch.rows):
            if sequence is not None and sequence.cancelled:
                self.batch.leave(slot)
                gone.append(sequence)
        for sequence in [s for s in self.prefilling if s.cancelled]:
            self.prefilling.remove(sequence)
            gone.append(sequence)
        self.batch.shrink()
        for sequence in gone:
            sequence.finish_reason = sequence.cancelled
            self._report(sequence, [], sequence.cancelled)

    def _admit(self) -> int:
        admitted = 0
        while self.running < self.max_batch_size:
            with self._work:
                if not self._waiting:
                    break
                sequence = self._waiting.popleft()
            admitted += 1
            try:
                self._start(sequence)
            except Exception as err:  # one bad request must not stop the others
                log.exception("request %d failed at prefill", sequence.id)
                self._fail(sequence, err)
        return admitted

    def _start(self, sequence: Sequence) -> None:
        options, model = sequence.options, self.model
        ids = torch.tensor([sequence.prompt], device=model.device)
        if self.compile:
            cached, past = self.prefix.lookup(sequence.prompt)
            sequence.cached_tokens = cached
        if options.prompt_lookup_num_tokens is not None:
            sequence.drafter = PromptLookup(options.prompt_lookup_num_tokens, options.max_matching_ngram_size or 2)
        elif self.draft_model is not None and options.num_assistant_tokens is not None:
            # greedy drafts: the row's own generator draws only its emitted tokens
            sequence.drafter = DraftModel(self.draft_model, options.num_assistant_tokens,
                                          Sampler(GenerationConfig(do_sample=False)))
        generator = (torch.Generator(device=model.device).manual_seed(options.seed)
                     if options.seed is not None else None)
        sequence.sampler = Sampler(options, generator)
        if sequence.sampler.repetition_penalty is not None:
            sequence.seen = torch.zeros(1, model.config.vocab_size, dtype=torch.bool, device=model.device)
            sequence.seen[0, ids[0]] = True
        eos = options.eos_token_id
        sequence.eos = frozenset([eos] if isinstance(eos, int) else (eos or ()))
        sequence.stop = StopStrings(options.stop_strings, self.tokenizer) if options.stop_strings else None
        if self.compile:  # the whole prompt at once, through the compiled prefill's fixed chunks
            length = ids.shape[1]
            end = cached + -(-(length - cached) // PREFILL_CHUNK) * PREFILL_CHUNK
            mask = torch.ones_like(ids, dtype=torch.bool)
            decoder = StaticDecoder(model, mask, end, past, compile=True)
            logits = decoder.prefill(ids[:, cached:], mask, torch.tensor([length - 1], device=ids.device))
            self._prefilled(sequence, logits, layers_of(decoder.cache, length))
            return
        self.prefilling.append(sequence)  # its prefix-cache lookup waits for its first chunk

    def _prefill_some(self) -> None:
        """Prefill the admitted prompts, up to ``prefill_chunk`` tokens in all. Prompts whose rest
        fits in a chunk go first, oldest first, each whole or not at all this step, all of them
        in one forward (:meth:`_prefill_together`); the oldest longer prompt takes what the step
        has left, at least a quarter of the chunk when short ones are waiting, so that a short
        prompt arriving behind a long one waits one step, not the whole long prefill, and the
        long one still moves on. A prompt that repeats most of one prefilled beside it (``n > 1``,
        a resent prompt) waits for that one's keys and values, then takes them from the prefix
        cache (in the same step, if that one was prefilled whole)."""
        budget, deferred = self.prefill_chunk, True
        while deferred and budget > 0:
            budget, deferred = self._prefill_pass(budget)

    def _prefill_pass(self, budget: int) -> tuple[int, bool]:
        """One pass of :meth:`_prefill_some` over the prefilling prompts; returns the budget left
        and whether a prompt waits for the keys and values of one prefilled whole in this pass."""
        short, long, awaited = [], [], []  # awaited: the prompts a repeat waits for
        for sequence in list(self.prefilling):
            if sequence.prefill_cache is None:  # now: a prompt prefilled just before may share its prefix
                half = len(sequence.prompt) // 2
                repeated = next((o for o in short + long if common_prefix(sequence.prompt, o.prompt) > half), None)
                if repeated is not None:
                    awaited.append(repeated)
                    continue
                sequence.cached_tokens, past = self.prefix.lookup(sequence.prompt)
                sequence.prefill_cache = past if past is not None else DynamicCache()
                sequence.prefilled = sequence.cached_tokens
            left = len(sequence.prompt) - sequence.prefilled
            if left == 1 and sequence.prefilled:
                # all but the last token cached: the row joins the batch and its step feeds that
                # token, beside the other rows' (a step of its own would cost a forward)
                self.prefilling.remove(sequence)
                self._joining.append((sequence, self._prefill_layers(sequence)))
                sequence.prefill_cache = None
            else:
                (long if left > self.prefill_chunk else short).append(sequence)
        reserve = min(budget, max(1, self.prefill_chunk // 4)) if long else 0
        together = []
        for sequence in short:
            left = len(sequence.prompt) - sequence.prefilled
            if left <= budget - reserve:
                together.append(sequence)
                budget -= left
        if long and budget > 0:
            sequence, start = long[0], long[0].prefilled
            try:
                ids = torch.tensor([sequence.prompt[start:start + budget]], device=self.model.device)
                self.model(input_ids=ids, past_key_values=sequence.prefill_cache, use_cache=True, logits_to_keep=1)
                sequence.prefilled += budget
                budget = 0
            except Exception as err:  # one bad request must not stop the others
                self._prefill_failed([sequence], err)
        if together:
            self._prefill_together(together)
        return budget, any(other in together for other in awaited)

    @staticmethod
    def _prefill_layers(sequence: Sequence) -> list:
        """The prompt positions a prefilling sequence holds, per layer (key, value) views (joining
        copies them)."""
        return [(k[:, :, :sequence.prefilled], v[:, :, :sequence.prefilled]) for k, v in sequence.prefill_cache]

    def _prefill_together(self, group: list[Sequence]) -> None:
        """Prefill the rest of every prompt of ``group`` and emit their first tokens. One prompt runs
        through the model's cached forward; several through one forward over a batch of their own
        (a :class:`~llm.serve.batch.SlotBatch` holding each one's cached prefix), so a projection's
        weights are read once for all of them. A row's logits are those it has alone: its keys,
        positions and mask are its own (bit for bit on our kernels). If that forward fails, each
        prompt is tried alone, so that a bad request fails alone."""
        if len(group) == 1:
            sequence = group[0]
            try:
                ids = torch.tensor([sequence.prompt[sequence.prefilled:]], device=self.model.device)
                out = self.model(input_ids=ids, past_key_values=sequence.prefill_cache, use_cache=True,
                                 logits_to_keep=1)
            except Exception as err:  # one bad request must not stop the others
                self._prefill_failed(group, err)
                return
            results = [(sequence, out.logits[:, -1], layers_of(sequence.prefill_cache, len(sequence.prompt)))]
        else:
            try:
                batch = SlotBatch(self.model, len(group), grow=False)
                batch.join_all([(s, self._prefill_layers(s)) for s in group],
                               room=max(len(s.prompt) - s.prefilled for s in group))
                logits = batch.step_many(lambda s: s.prompt[s.prefilled:], last_only=True)
            except Exception:
                log.exception("a batch of %d prompts failed at prefill: each is tried alone", len(group))
                for sequence in group:
                    self._prefill_together([sequence])
                return
            results = [(s, logits[slot], batch.leave(slot)) for slot, s in enumerate(batch.rows) if s is not None]
        for sequence, logits, layers in results:
            self.prefilling.remove(sequence)
            sequence.prefill_cache, sequence.prefilled = None, len(sequence.prompt)
            try:
                self._prefilled(sequence, logits, layers)
            except Exception as err:
                self._prefill_failed([sequence], err)

    def _prefill_failed(self, sequences: list[Sequence], err: Exception) -> None:
        for sequence in sequences:
            log.error("request %d failed at prefill: %s", sequence.id, err, exc_info=err)
            if sequence in self.prefilling:
                self.prefilling.remove(sequence)
            sequence.prefill_cache = None
            self._fail(sequence, err)

    def _prefilled(self, sequence: Sequence, logits: torch.Tensor, layers: list) -> None:
        """A prompt is in ``layers``: keep it in the prefix cache, emit its first token (from
        ``logits``, (1, vocab)) and, unless that ends it, join the batch."""
        check_finite_logits(logits)
        self.prefix.store(sequence.prompt, layers)
        token = int(sequence.sampler.pick(self._allowed(sequence, logits), sequence.seen)[0])
        if not self._emit(sequence, token, logits):
            self._joining.append((sequence, layers))

    def _decode_batch(self) -> None:
        # a row that joined with its prompt's last token still to feed has no token yet
        feeds = {id(s): self._feed(s) for s in self.batch.rows if s is not None}
        try:
            logits = self.batch.step_many(lambda sequence: feeds[id(sequence)])
        except Exception as err:  # the batch is lost; the server goes on with new requests
            log.exception("a batch step failed")
            for sequence in self.batch.rows:
                if sequence is not None:
                    self._fail(sequence, err)
            self.batch = SlotBatch(self.model, self.max_batch_size, compile=self.compile)
            return
        finished = []
        for slot, sequence in enumerate(self.batch.rows):
            if sequence is None:
                continue
            feed = feeds[id(sequence)]
            for i in range(len(feed)):  # the logits after fed token i give the next token
                row_logits = logits[slot, i:i + 1]
                token = int(sequence.sampler.pick(self._allowed(sequence, row_logits), sequence.seen)[0])
                if self._emit(sequence, token, row_logits):
                    finished.append(slot)
                    break
                if i + 1 == len(feed) or token != feed[i + 1]:  # the draft's next token is not it
                    break
            sequence.draft_tokens += len(feed) - 1
            sequence.accepted_tokens += i
            if i + 1 < len(feed):
                self.batch.keep(slot, i + 1)  # the fed tokens after the last one emitted from
        for slot in finished:
            sequence = self.batch.rows[slot]
            # the cache holds the prompt and every new token but the last (never fed)
            self.prefix.store(sequence.prompt + sequence.tokens[:-1], self.batch.leave(slot))
        self.batch.shrink()

    def _feed(self, sequence: Sequence) -> list[int]:
        """The tokens a row's step feeds: its last token, then (speculating) a draft of at most the
        tokens it may still emit less one, since the step emits one past an accepted draft."""
        if sequence.drafter is None:  # the decode loop's common case: no copy of the history
            return [sequence.tokens[-1] if sequence.tokens else sequence.prompt[-1]]
        history = sequence.prompt + sequence.tokens
        room = sequence.options.max_new_tokens - len(sequence.tokens) - 1
        ids = torch.tensor(history, device=self.model.device)
        sequence.drafter.accepted(ids)  # a draft model's cache forgets the tokens not taken
        draft, _ = sequence.drafter.propose(ids, room)
        return history[-1:] + draft.tolist()

    @staticmethod
    def _allowed(sequence: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (1, vocab) with the tokens the sequence's grammar forbids at -inf (a copy;
        the same tensor without a grammar)."""
        if sequence.matcher is None:
            return logits
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        vocab = logits.shape[-1]
        mask = allocate_token_bitmask(1, vocab)
        fill_next_token_bitmask(sequence.matcher, mask, 0)
        # bit j of word i allows token 32 i + j; unpacked here in eager mode, as llguidance's own
        # helper is a torch.compile'd function: a compile wait at the first grammar, and a crash
        # where inductor's cache holds another machine's build
        bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = logits.to("cpu", torch.float32, copy=True)  # masked on the CPU; the raw logits stay for logprobs
        allowed.masked_fill_(bits.view(1, -1)[:, :vocab] == 0, float("-inf"))
        return allowed.to(logits.device)

    def _emit(self, sequence: Sequence, token: int, logits: torch.Tensor) -> bool:
        """Record a batch row's new token (sampled from ``logits``, (1, vocab)); report it; return
        whether the row is finished."""
        if sequence.logprobs is not None:
            logprobs = torch.log_softmax(logits[0].float(), dim=-1)
            top = logprobs.topk(sequence.logprobs) if sequence.logprobs else None
            sequence.token_logprobs.append(
                (token, float(logprobs[token]), list(zip(top.indices.tolist(), top.values.tolist())) if top else []))
        sequence.tokens.append(token)
        if sequence.seen is not None:
            sequence.seen[0, token] = True
        reason = None
        if sequence.matcher is not None and token not in sequence.eos:
            sequence.matcher.consume_token(token)
        if token in sequence.eos or (sequence.stop is not None and sequence.stop.hit(sequence.tokens)):
            reason = "stop"
        elif sequence.matcher is not None and sequence.matcher.is_stopped():  # the answer is complete
            reason = "stop"
        elif len(sequence.tokens) >= sequence.options.max_new_tokens:
            reason = "length"
        sequence.finish_reason = reason
        self._report(sequence, [token], reason)
        return reason is not None

    def _fail(self, sequence: Sequence, err: Exception) -> None:
        sequence.finish_reason, sequence.error = "error", f"{type(err).__name__}: {err}"
        self._report(sequence, [], "error")

    def _report(self, sequence: Sequence, tokens: list[int], reason: str | None) -> None:
        if sequence.callback is not None:
            try:
                sequence.callback(sequence, tokens, reason)
            except Exception:
                log.exception("the callback of request %d failed", sequence.id)
