"""Draft proposers for speculative decoding (copies from references (LLMA), a draft model) and the
schedule that decides how much to draft at each step."""

from __future__ import annotations

import time

import torch

from llm.cache import DynamicCache
from llm.generation.sampling import Sampler


class PromptLookup:
    """Reference decoding: copy a draft from where the last n tokens occur before.

    As in "Inference with Reference: Lossless Acceleration of Large Language Models" (Yang et
    al., 2023, LLMA) and transformers' prompt lookup decoding: the last ``n`` tokens of the
    sequence (n from ``max_matching_ngram_size`` down to 1) are searched in the sequence itself
    (prompt and generated text) and then in the reference documents; the ``num_tokens`` tokens
    that followed the first match are the draft. The draft's distribution is one-hot.

    Args:
        num_tokens: the most tokens to propose per step (``prompt_lookup_num_tokens``).
        max_matching_ngram_size: the longest n-gram to match.
        references: 1-D int64 token tensors of documents to copy from, besides the sequence.
    """

    def __init__(self, num_tokens: int, max_matching_ngram_size: int = 2, references=()):
        self.num_tokens = num_tokens
        self.ngram = max_matching_ngram_size
        self.references = [r.reshape(-1) for r in references]

    def propose(self, history: torch.Tensor, k: int):
        """history: (n,) int64 tokens so far -> ((m,) draft tokens, None), m <= k (possibly 0)."""
        k = min(k, self.num_tokens)
        if k <= 0:
            return history[:0], None
        for n in range(min(self.ngram, history.numel() - 1), 0, -1):
            tail = history[-n:]
            # the sequence itself, without the tail's own occurrence, then the references
            for source in (history[:-1], *self.references):
                if source.numel() <= n:
                    continue
                windows = source.unfold(0, n, 1)[:-1]  # a match must have a token after it
                hits = (windows == tail).all(dim=1).nonzero()
                if hits.numel():
                    start = int(hits[0]) + n
                    return source[start:start + k], None
        return history[:0], None

    def accepted(self, history: torch.Tensor) -> None:
        """Nothing to roll back: lookup keeps no state."""


class DraftModel:
    """Draft-model speculative decoding (Leviathan et al., 2023; Chen et al., 2023).

    A smaller model sharing the tokenizer proposes tokens one by one with its own KV cache,
    drawing from its own (processed) distribution q, which the acceptance rule needs.

    Args:
        model: the draft :class:`~llm.model.MosaicGPT` (same vocabulary as the target).
        num_tokens: tokens to propose per step (``num_assistant_tokens``).
        sampler: the target's sampler, so the draft's q is processed the same way.
    """

    def __init__(self, model, num_tokens: int, sampler: Sampler):
        self.model = model
        self.num_tokens = num_tokens
        self.sampler = sampler
        self.cache = DynamicCache()

    @torch.no_grad()
    def propose(self, history: torch.Tensor, k: int):
        """history: (n,) int64 -> ((m,) draft tokens, (m, vocab) fp32 draft probabilities)."""
        k = min(k, self.num_tokens)
        if k <= 0:
            return history[:0], None
        new = history[self.cache.get_seq_length():][None]
        tokens, probs = [], []
        seen = None
        if self.sampler.repetition_penalty is not None:
            seen = torch.zeros(1, self.model.config.vocab_size, dtype=torch.bool, device=history.device)
            seen[0, history] = True
        for _ in range(k):
            logits = self.model(new, past_key_values=self.cache).logits[:, -1]
            p = self.sampler.probs(logits, seen)
            token = p.argmax(-1) if self.sampler.greedy else self.sampler.draw(p)
            tokens.append(token)
            probs.append(p)
            if seen is not None:
                seen[0, token] = True
            new = token[None]
        return torch.cat(tokens), torch.cat(probs)

    def accepted(self, history: torch.Tensor) -> None:
        """Roll the draft's cache back to what ``history`` (all accepted tokens) confirms."""
        self.cache.crop(min(self.cache.get_seq_length(), history.numel() - 1))


class DraftSchedule:
    """How many tokens to draft at each step of speculative decoding (0: decode plainly).

    ``"constant"``: ``num_tokens`` at every step. ``"heuristic"`` (transformers' schedule of that
    name, extended): the draft length, at most ``num_tokens``, grows by 2 after a fully accepted
    draft and shrinks by 1 (to no less than 1) after a rejection; and a step drafts only while
    drafting has paid. A forward of a few tokens costs from about one 1-token forward (small
    models, GPUs) to about two (a CPU, where the weights are read by GEMM instead of GEMV), so
    drafting pays when (1 + accepted draft tokens per verification) x plain-step seconds >
    verify-step seconds, all three running means measured as decoding goes. After 15 steps
    without a draft the next one drafts anyway, to notice when copying starts paying again.
    """

    def __init__(self, num_tokens: int, kind: str = "heuristic"):
        self.num_tokens = num_tokens
        self.kind = kind
        self.draft_len = num_tokens
        self.gain = float(num_tokens)  # running mean of accepted draft tokens, optimistic start
        self.step_s: dict[str, float] = {}  # running mean seconds of a "plain" and a "verify" step
        self.idle = 0  # steps since the last draft
        self.started = 0.0

    def next_draft_len(self) -> int:
        """The most tokens to draft at the step that starts now (0: none); starts its clock."""
        self.started = time.perf_counter()
        if self.kind == "constant":
            return self.num_tokens
        plain, verify = self.step_s.get("plain"), self.step_s.get("verify")
        if verify is None:
            pays = True
        elif plain is None:
            pays = self.gain >= 1  # otherwise a plain step, which measures one
        else:
            pays = (1 + self.gain) * plain > verify
        if pays or self.idle >= 15:
            self.idle = 0
            return self.draft_len
        self.idle += 1
        return 0

    def step_done(self, proposed: int, accepted: int) -> None:
        """Record the step: draft tokens proposed (0 for a plain step) and accepted."""
        if self.kind == "constant":
            return
        seconds = time.perf_counter() - self.started
        kind = "verify" if proposed else "plain"
        old = self.step_s.get(kind)
        self.step_s[kind] = seconds if old is None else 0.7 * old + 0.3 * seconds
        if proposed:
            longer, shorter = min(self.num_tokens, self.draft_len + 2), max(1, self.draft_len - 1)
            self.draft_len = longer if accepted == proposed else shorter
            self.gain = 0.5 * self.gain + 0.5 * accepted
