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
        grow: leave room for the rows to grow (the capacity twice what they need); False for a
            batch of one step (prompts prefilled together), whose buffer holds just what it needs.

    Attributes:
        rows: per slot, the caller's object for the row there, or None for a free slot.
    """

    def __init__(self, model, max_slots: int, compile: bool = False, grow: bool = True):
        self.model, self.max_slots, self.compile, self.grow = model, max_slots, compile, grow
        self.rows: list = []
        self.starts: list[int] = []
        self.column = 0
        self.capacity = 0
        self.cache: StaticCache | None = None
        self.key_mask: torch.Tensor | None = None
        self._step = None
        self._fed = (0, 0)  # the columns of the last step_many: (first, width)

    def __len__(self) -> int:
        """The number of rows (not slots)."""
        return sum(row is not None for row in self.rows)

    def _relayout(self, slots: int, column: int, room: int = 1) -> None:
        """New buffers of ``slots`` slots holding every row, the current column moved to at least
        ``column`` and at least the rows' longest span; the capacity is what that needs, twice
        (unless the batch does not grow), and at least ``room`` columns past it. A row's masked
        columns (rejected drafts) are left behind: its real ones move together, so the buffer
        grows with the tokens kept only."""
        live = [s for s, row in enumerate(self.rows) if row is not None]
        if any(int(self.key_mask[s, self.starts[s]:self.column].sum()) != self.column - self.starts[s] for s in live):
            self._compact(live)
        low = min((self.starts[s] for s in live), default=self.column)
        span = self.column - low
        new_column = max(span, column)
        capacity = cache_capacity(max(2 * new_column if self.grow else 0, new_column + room))
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

    def _compact(self, live: list[int]) -> None:
        """Move each live row's real columns right-aligned to the current column, in order (its
        masked columns dropped), so that its keys are contiguous again."""
        for s in live:
            real = self.key_mask[s, self.starts[s]:self.column].nonzero().squeeze(1) + self.starts[s]
            start = self.column - real.numel()
            for store in (self.cache._keys, self.cache._values):
                for layer in store:
                    layer[s, :, start:self.column] = layer[s, :, real].clone()
            self.key_mask[s, :self.column] = False
            self.key_mask[s, start:self.column] = True
            self.starts[s] = start

    def join_all(self, joining: list, room: int = 1) -> None:
        """Add the rows of ``joining``, ``(row, past)`` pairs whose tokens so far are in ``past``: per
        layer (key, value), each (1, kv_n_heads, P, head_dim) in the model's dtype, or ``[]`` for a
        row with none yet (P = 0). Their next tokens are fed at the next :meth:`step` or
        :meth:`step_many`, for which at least ``room`` columns are left. The buffer is re-laid out
        at most once for all of them (a re-layout allocates and copies the whole buffer).

        Raises:
            RuntimeError: if they do not all fit in the free slots.
        """
        if not joining:
            return
        rows = len(self) + len(joining)
        if rows > self.max_slots:
            raise RuntimeError(f"{len(joining)} rows do not fit: {len(self)} of the {self.max_slots} slots are taken")
        longest = max(past[0][0].shape[2] if past else 0 for _, past in joining)
        slots = len(self.rows) if rows <= len(self.rows) else _slots_for(rows, self.max_slots)
        if slots != len(self.rows) or self.column < longest or self.column + room > self.capacity:
            self._relayout(slots, longest, room)
        for row, past in joining:
            length = past[0][0].shape[2] if past else 0
            slot = self.rows.index(None)
            start = self.column - length
            for i, (key, value) in enumerate(past):
                self.cache._keys[i][slot, :, start:self.column] = key[0]
                self.cache._values[i][slot, :, start:self.column] = value[0]
            self.key_mask[slot] = False
            self.key_mask[slot, start:self.column] = True
            self.rows[slot], self.starts[slot] = row, start

    def leave(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Free ``slot``; return its row's keys and values, per layer (1, kv_n_heads, n, head_dim)
        copies of its real positions in order (a rejected draft's columns left out)."""
        start = self.starts[slot]
        real = self.key_mask[slot, start:self.column].nonzero().squeeze(1) + start
        if real.numel() == self.column - start:  # no holes: a slice
            past = [(k[slot:slot + 1, :, start:self.column].clone(), v[slot:slot + 1, :, start:self.column].clone())
                    for k, v in zip(self.cache._keys, self.cache._values)]
        else:
            past = [(k[slot:slot + 1, :, real], v[slot:slot + 1, :, real])
                    for k, v in zip(self.cache._keys, self.cache._values)]
        self.rows[slot] = None
        self.key_mask[slot] = False
        return past

    def shrink(self) -> None:
        """Fewer slots when at most a quarter are taken (rows move: slots are renumbered)."""
        if len(self.rows) > 1 and len(self) * 4 <= len(self.rows):
            self._relayout(_slots_for(max(len(self), 1), self.max_slots), 0)

    def step_many(self, tokens_of, last_only: bool = False) -> torch.Tensor:
        """Feed each row its next tokens, ``tokens_of(row)`` (a list of at least one int: the last
        token, then a draft to verify; or a prompt's tokens), in one forward of width W, the
        longest list: row r's i-th token at column ``column + i``, the columns past its own list
        masked. Return (slots, W, vocab_size) logits, row r's i-th the next-token logits after its
        i-th token (a free slot's and those past a row's list are meaningless); with
        ``last_only``, (slots, 1, vocab_size): only those after each row's last token (a batch of
        prompts, whose other positions need no output layer). The column moves on by W; call
        :meth:`keep` for each row that accepted fewer than all of its tokens.

        One call's logits of a row are those of its tokens fed one step at a time: the key mask
        gives each query the keys and the positions (counted over the mask) that it would have had
        (on our kernels, bit for bit: a query's reduction order does not depend on its neighbours).
        """
        fed = {id(row): tokens_of(row) for row in self.rows if row is not None}
        width = max(map(len, fed.values()))
        if width == 1 and not last_only:
            return self.step(lambda row: fed[id(row)][0])[:, None]
        if self.column + width > self.capacity:
            self._relayout(len(self.rows), 0, room=width)  # rows may move to other slots
        feeds = [fed[id(row)] if row is not None else [] for row in self.rows]
        column, device = self.column, self.key_mask.device
        for slot, feed in enumerate(feeds):
            self.key_mask[slot, column:column + width] = False
            self.key_mask[slot, column:column + len(feed)] = True
        ids = torch.tensor([f + [0] * (width - len(f)) for f in feeds], device=device)
        position = torch.arange(column, column + width, device=device)
        last = (torch.tensor([[max(len(f), 1) - 1] for f in feeds], device=device) if last_only else None)
        logits = self.model.forward_static(ids, self.cache, position, self.key_mask, last)
        self._fed = (column, width)
        self.column += width
        self.cache.set_seq_length(self.column)
        return logits

    def keep(self, slot: int, count: int) -> None:
        """After :meth:`step_many`: keep only the first ``count`` tokens fed to ``slot`` (those whose
        next token was accepted); the later columns are masked, never read again."""
        column, width = self._fed
        self.key_mask[slot, column + count:column + width] = False

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
