"""The running batch of the serving engine: rows of different lengths in one static cache.

Every row writes its next key at the same buffer column, so one
:meth:`~llm.model.MosaicGPT.forward_static` call decodes a token for all of them, with shapes
that depend only on the number of slots and the buffer's capacity (gpt-fast's static cache,
compiled once per pair). A row's tokens stand in columns ``[start, column)``: it joins
right-aligned to the current column (its prompt's keys and values copied in from its own
prefill), and the key mask hides everything left of it, so its positions (counted from the mask)
are those it would have alone. Slots of finished rows are reused; the buffer is re-laid out
(columns shifted left, capacity and slot count resized) when a joining prompt is longer than the
current column, when the column reaches the capacity, or when most slots are empty.
"""

from __future__ import annotations

import torch

from llm.cache import StaticCache
from llm.generation.compiled import cache_capacity, compiled_step, decode_one_token
from llm.model.buffer import masked_keys_unread


def _slots_for(rows: int, most: int) -> int:
    """The slot count for ``rows`` rows: the next power of two, at most ``most``."""
    return min(most, 1 << max(rows - 1, 0).bit_length())


class SlotBatch:
    """Rows decoding together over one :class:`~llm.cache.StaticCache`.

    Args:
        model: the :class:`~llm.model.MosaicGPT` (float or quantized).
        max_slots: the most rows at once.
        compile: run the decoding step through ``torch.compile``
            (:func:`~llm.generation.compiled.compiled_step`).

    Attributes:
        rows: per slot, the caller's object for the row there, or None for a free slot.
    """

    def __init__(self, model, max_slots: int, compile: bool = False):
        self.model, self.max_slots, self.compile = model, max_slots, compile
        self.rows: list = []
        self.starts: list[int] = []
        self.column = 0
        self.capacity = 0
        self.cache: StaticCache | None = None
        self.key_mask: torch.Tensor | None = None
        self._step = None

    def __len__(self) -> int:
        """The number of rows (not slots)."""
        return sum(row is not None for row in self.rows)

    def _relayout(self, slots: int, column: int) -> None:
        """New buffers of ``slots`` slots holding every row, the current column moved to at least
        ``column`` and at least the rows' longest span; the capacity is what that needs, twice."""
        live = [s for s, row in enumerate(self.rows) if row is not None]
        low = min((self.starts[s] for s in live), default=self.column)
        span = self.column - low
        new_column = max(span, column)
        capacity = cache_capacity(max(2 * new_column, 1))
        shift = new_column - self.column
        model = self.model
        # zeroing a buffer of 16 slots x 1024 positions (720 MiB for SmolLM2) takes 0.2 s: not
        # needed where no attention reads a masked position
        cache = StaticCache(model.config, slots, capacity, device=model.device, dtype=model.dtype,
                            zeroed=not masked_keys_unread(model))
        key_mask = torch.zeros(slots, capacity, dtype=torch.bool, device=model.device)
        if live and span:
            old = torch.tensor(live, device=model.device)
            for store, old_store in ((cache._keys, self.cache._keys), (cache._values, self.cache._values)):
                for new_layer, old_layer in zip(store, old_store):
                    new_layer[: len(live), :, new_column - span:new_column] = old_layer[old, :, low:self.column]
            key_mask[: len(live), new_column - span:new_column] = self.key_mask[old, low:self.column]
        self.rows = [self.rows[s] for s in live] + [None] * (slots - len(live))
        self.starts = [self.starts[s] + shift for s in live] + [new_column] * (slots - len(live))
        self.cache, self.key_mask, self.capacity, self.column = cache, key_mask, capacity, new_column
        self.cache.set_seq_length(new_column)
        # a new wrapper: its first call picks the graph for the new shapes
        self._step = compiled_step(decode_one_token, self.compile)

    def join_all(self, joining: list) -> None:
        """Add the rows of ``joining``, ``(row, past)`` pairs whose prompt is in ``past``: per layer
        (key, value), each (1, kv_n_heads, P, head_dim) in the model's dtype, P >= 1. Their next
        tokens are fed at the next :meth:`step`. The buffer is re-laid out at most once for all of
        them (a re-layout allocates and copies the whole buffer).

        Raises:
            RuntimeError: if they do not all fit in the free slots.
        """
        if not joining:
            return
        rows = len(self) + len(joining)
        if rows > self.max_slots:
            raise RuntimeError(f"{len(joining)} rows do not fit: {len(self)} of the {self.max_slots} slots are taken")
        longest = max(past[0][0].shape[2] for _, past in joining)
        slots = len(self.rows) if rows <= len(self.rows) else _slots_for(rows, self.max_slots)
        if slots != len(self.rows) or self.column < longest or self.column >= self.capacity:
            self._relayout(slots, longest)
        for row, past in joining:
            length = past[0][0].shape[2]
            slot = self.rows.index(None)
            start = self.column - length
            for i, (key, value) in enumerate(past):
                self.cache._keys[i][slot, :, start:self.column] = key[0]
                self.cache._values[i][slot, :, start:self.column] = value[0]
            self.key_mask[slot] = False
            self.key_mask[slot, start:self.column] = True
            self.rows[slot], self.starts[slot] = row, start

    def leave(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Free ``slot``; return its row's keys and values, per layer (1, kv_n_heads, n, head_dim) copies."""
        start = self.starts[slot]
        past = [(k[slot:slot + 1, :, start:self.column].clone(), v[slot:slot + 1, :, start:self.column].clone())
                for k, v in zip(self.cache._keys, self.cache._values)]
        self.rows[slot] = None
        self.key_mask[slot] = False
        return past

    def shrink(self) -> None:
        """Fewer slots when at most a quarter are taken (rows move: slots are renumbered)."""
        if len(self.rows) > 1 and len(self) * 4 <= len(self.rows):
            self._relayout(_slots_for(max(len(self), 1), self.max_slots), 0)

    def step(self, token_of) -> torch.Tensor:
        """Feed each row's next token, ``token_of(row)`` (an int); return (slots, vocab_size)
        next-token logits, row i's in row i of :attr:`rows` (a free slot's are meaningless)."""
        if self.column >= self.capacity:
            self._relayout(len(self.rows), 0)
        column = self.column
        device = self.key_mask.device
        self.key_mask[:, column] = torch.tensor([row is not None for row in self.rows], device=device)
        ids = torch.tensor([[token_of(row) if row is not None else 0] for row in self.rows], device=device)
        position = torch.tensor([column], device=self.key_mask.device)
        logits = self._step(self.model, ids, self.cache, position, self.key_mask)
        self.column += 1
        self.cache.set_seq_length(self.column)
        return logits[:, 0]
