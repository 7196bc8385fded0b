"""Draft proposers for speculative decoding: copies from references (LLMA) and a draft model."""

from __future__ import annotations

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
