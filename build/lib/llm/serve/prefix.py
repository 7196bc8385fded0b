"""Prefix caching: keys and values of token sequences the server has computed, reused by later prompts.

llama.cpp's ``--cache-prompt`` and vLLM's automatic prefix caching: a prompt that starts with a
sequence computed before (a system prompt, the chat so far) runs only its new tokens. Entries are
whole sequences (a prompt after its prefill; a prompt and its completion when a request ends);
a lookup takes the longest common prefix with any entry. Memory is bounded by a token budget,
least recently used entries evicted first.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from llm.cache import DynamicCache


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    """Keys and values of token sequences, found by their longest common prefix with a prompt.

    Args:
        max_tokens: the most positions held over all entries (0 disables caching).

    Attributes:
        hits, misses: lookups that reused at least one position, and those that did not.
        reused_tokens: positions not recomputed thanks to the cache.
    """

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], tuple[np.ndarray, list]] = OrderedDict()
        self.tokens = 0
        self.hits = self.misses = self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> tuple[int, DynamicCache | None]:
        """The cached positions for ``ids``: (L, a new DynamicCache of batch 1 holding ``ids[:L]``),
        L the longest prefix of ``ids`` held, at most ``len(ids) - 1`` (a prompt's last token is
        always run: its logits give the first new token); (0, None) when nothing matches."""
        query = np.asarray(ids, dtype=np.int64)
        best, best_key = 0, None
        for key, (tokens, _) in self._entries.items():
            n = _common_prefix(tokens, query)
            if n > best:
                best, best_key = n, key
        best = min(best, len(ids) - 1)
        if best <= 0:
            self.misses += 1
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        past = self._entries[best_key][1]
        return best, DynamicCache.from_legacy([(k[:, :, :best], v[:, :, :best]) for k, v in past])

    def store(self, ids: list[int], past) -> None:
        """Hold ``past`` (per layer (key, value), each (1, kv_n_heads, len(ids), head_dim); kept,
        not copied) as the positions of ``ids``. Entries that are a prefix of ``ids`` are dropped
        (the new one serves them); then least recently used entries go until the budget holds.
        A sequence longer than the whole budget is not stored."""
        n = len(ids)
        if n == 0 or n > self.max_tokens:
            return
        if past[0][0].shape[2] != n:
            raise ValueError(f"{n} token ids but {past[0][0].shape[2]} cached positions")
        tokens = np.asarray(ids, dtype=np.int64)
        for key in [k for k, (t, _) in self._entries.items() if len(t) <= n and _common_prefix(t, tokens) == len(t)]:
            self._drop(key)
        key = tuple(ids)
        self._entries[key] = (tokens, [(k, v) for k, v in past])
        self.tokens += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key) -> None:
        tokens, _ = self._entries.pop(key)
        self.tokens -= len(tokens)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0


def layers_of(cache, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of a batch-1 cache's first ``length`` positions, per layer (key, value)."""
    return [(k[:, :, :length].clone(), v[:, :, :length].clone()) for k, v in cache]
