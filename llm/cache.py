"""The KV cache: keys and values of every position seen so far, one pair of tensors per layer.

A small, explicit interface after transformers' ``cache_utils.py``:

- :class:`DynamicCache` grows as tokens come (capacity doubles, so appending a token is an
  in-place write, not a copy of the whole cache as with ``torch.cat``);
- :class:`StaticCache` is allocated once for ``max_cache_len`` positions and written in place.

Both store, per layer, keys and values shaped (batch, kv_n_heads, capacity, head_dim), of which
the first :meth:`Cache.get_seq_length` positions are valid. Cropping (speculative decoding's
rollback) only moves that length; the next write overwrites what was cut.
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import torch

from llm.config import MosaicGPTConfig
from llm.io import atomic_write

_FORMAT = "llm.cache/v1"


class Cache:
    """Base class of the caches; see :class:`DynamicCache` and :class:`StaticCache`."""

    def __init__(self) -> None:
        self.metadata: dict = {}
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._lengths: list[int] = []

    # -- the interface the model uses -------------------------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one layer's new keys and values; return all of that layer's keys and values.

        Args:
            key, value: (batch, kv_n_heads, new_tokens, head_dim).
            layer_idx: the layer, 0-based; layers are first written in order.

        Returns:
            (keys, values), each (batch, kv_n_heads, past + new_tokens, head_dim): views of the
            cache's storage, valid until the cache is next written.
        """
        if layer_idx == len(self._keys):
            self._allocate_layer(key, value)
        start = self._lengths[layer_idx]
        end = start + key.shape[2]
        if end > self._keys[layer_idx].shape[2]:
            self._grow(layer_idx, end)
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        # narrow + copy_ rather than slice assignment: fewer ops in every layer of every step
        keys.narrow(2, start, end - start).copy_(key)
        values.narrow(2, start, end - start).copy_(value)
        self._lengths[layer_idx] = end
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of cached positions (of ``layer_idx``; all layers agree between forwards)."""
        return self._lengths[layer_idx] if layer_idx < len(self._lengths) else 0

    def get_max_length(self) -> int | None:
        """The most positions this cache can hold, or None if unbounded."""
        return None

    @property
    def batch_size(self) -> int | None:
        """Batch size of the stored tensors, or None while nothing is stored."""
        return self._keys[0].shape[0] if self._keys else None

    def validate(
        self, config: MosaicGPTConfig, batch_size: int, new_tokens: int, dtype: torch.dtype | None = None
    ) -> None:
        """Check, before any compute, that this cache fits a model and a forward of ``new_tokens``.

        Raises:
            ValueError: naming what does not fit: layer count, batch size, key heads, head size,
                dtype, or (static cache) room for the new tokens.
        """
        if self._keys:
            k = self._keys[0]
            checks = (
                ("layers", len(self._keys), config.n_layers),
                ("batch size", k.shape[0], batch_size),
                ("key/value heads", k.shape[1], config.kv_n_heads),
                ("head size", k.shape[3], config.head_dim),
                ("dtype", k.dtype, dtype or k.dtype),
            )
            for what, have, want in checks:
                if have != want:
                    raise ValueError(
                        f"past_key_values does not fit: the cache has {what} {have}, "
                        f"the model/input needs {want}"
                    )

    # -- manipulation ------------------------------------------------------------------------
    def crop(self, max_length: int) -> "Cache":
        """Keep the first ``max_length`` positions (a negative value drops that many from the end).

        Used to roll back rejected draft tokens in speculative decoding. Returns self.
        """
        length = self.get_seq_length()
        if max_length < 0:
            max_length = max(length + max_length, 0)
        self._lengths = [min(n, max_length) for n in self._lengths]
        return self

    def select(self, batch_indices: torch.Tensor | Sequence[int]) -> "Cache":
        """Keep (and reorder, or repeat) the batch rows ``batch_indices`` in every layer. Returns self."""
        if self._keys:
            idx = torch.as_tensor(batch_indices, dtype=torch.long, device=self._keys[0].device)
            self._keys = [k.index_select(0, idx) for k in self._keys]
            self._values = [v.index_select(0, idx) for v in self._values]
        return self

    def reorder(self, beam_idx: torch.Tensor | Sequence[int]) -> "Cache":
        """Reorder the batch rows for beam search: row i becomes old row ``beam_idx[i]``. Returns self."""
        return self.select(beam_idx)

    def copy(self) -> "Cache":
        """A deep copy: reuse one prompt's cache for many continuations."""
        other = self._empty_like()
        other._keys = [k.clone() for k in self._keys]
        other._values = [v.clone() for v in self._values]
        other._lengths = list(self._lengths)
        other.metadata = dict(self.metadata)
        return other

    # -- iteration and the legacy tuple format ---------------------------------------------
    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._lengths[layer_idx]
        return self._keys[layer_idx][:, :, :n], self._values[layer_idx][:, :, :n]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield each layer's (key, value), each (batch, kv_n_heads, seq, head_dim), as transformers does."""
        return (self[i] for i in range(len(self)))

    def to_legacy(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """transformers' legacy format: a tuple per layer of (key, value) views of this cache."""
        return tuple(self)

    @classmethod
    def from_legacy(cls, past_key_values) -> "DynamicCache":
        """A :class:`DynamicCache` holding a COPY of legacy (key, value) tuples.

        Args:
            past_key_values: a sequence per layer of (key, value), each (batch, kv_heads, seq, head_dim).

        Raises:
            ValueError: if an entry is not a pair of 4-D tensors of the same shape.
        """
        cache = DynamicCache()
        for i, layer in enumerate(past_key_values):
            if len(layer) != 2 or any(t.dim() != 4 for t in layer) or layer[0].shape != layer[1].shape:
                raise ValueError(
                    f"legacy past_key_values[{i}] must be a (key, value) pair of tensors shaped "
                    "(batch, heads, seq, head_dim)"
                )
            cache.update(layer[0], layer[1], i)
        return cache

    # -- files ----------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """Write the cached positions to ``path`` (``torch.save`` format), atomically.

        ``metadata`` (plain ints, floats, strings, lists and dicts; e.g. the token ids the cache
        holds) is stored alongside and comes back as :attr:`metadata` from :meth:`load`.
        """
        state = {
            "format": _FORMAT,
            "metadata": metadata or {},
            "class": type(self).__name__,
            "max_cache_len": self.get_max_length(),
            "keys": [k.contiguous() for k, _ in self],
            "values": [v.contiguous() for _, v in self],
        }
        atomic_write(path, lambda tmp: torch.save(state, tmp))

    @staticmethod
    def load(path: str | os.PathLike, device: torch.device | str | None = None) -> "Cache":
        """Read a cache written by :meth:`save`, as the class it was saved from.

        Raises:
            FileNotFoundError: if there is no such file.
            ValueError: if the file is not a cache written by :meth:`save` (corrupt or foreign).
        """
        try:
            state = torch.load(path, map_location=device, weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as err:
            raise ValueError(f"{path} is not a readable cache file: {err}") from err
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a cache file written by llm.Cache.save")
        if state["class"] == "StaticCache":
            batch_size = state["keys"][0].shape[0] if state["keys"] else None
            cache: Cache = StaticCache(None, batch_size, state["max_cache_len"])
        else:
            cache = DynamicCache()
        for i, (k, v) in enumerate(zip(state["keys"], state["values"])):
            cache.update(k, v, i)
        cache.metadata = state.get("metadata", {})
        return cache

    # -- storage, specialised by subclasses ------------------------------------------------------
    def _allocate_layer(self, key: torch.Tensor, value: torch.Tensor) -> None:
        raise NotImplementedError

    def _grow(self, layer_idx: int, needed: int) -> None:
        raise NotImplementedError

    def _empty_like(self) -> "Cache":
        raise NotImplementedError

    def __repr__(self) -> str:
        shape = tuple(self._keys[0].shape) if self._keys else None
        return f"{type(self).__name__}(layers={len(self)}, seq_length={self.get_seq_length()}, storage={shape})"


def _empty(like: torch.Tensor, capacity: int, batch: int | None = None) -> torch.Tensor:
    b, h, _, d = like.shape
    return torch.zeros(batch or b, h, capacity, d, dtype=like.dtype, device=like.device)


class DynamicCache(Cache):
    """A cache that grows as tokens come; what ``use_cache=True`` returns when no cache is given.

    Storage doubles when full, so decoding a token writes in place (amortised O(1) copies per
    token, against O(length) for transformers' ``torch.cat``-based DynamicCache).
    """

    _MIN_CAPACITY = 64

    def _allocate_layer(self, key, value):
        capacity = max(key.shape[2], self._MIN_CAPACITY)
        self._keys.append(_empty(key, capacity))
        self._values.append(_empty(value, capacity))
        self._lengths.append(0)

    def _grow(self, layer_idx, needed):
        n = self._lengths[layer_idx]
        capacity = max(needed, 2 * self._keys[layer_idx].shape[2])
        for store in (self._keys, self._values):
            old = store[layer_idx]
            new = _empty(old, capacity)
            new[:, :, :n] = old[:, :, :n]
            store[layer_idx] = new

    def _empty_like(self):
        return DynamicCache()


class StaticCache(Cache):
    """A cache allocated once for ``max_cache_len`` positions and written in place.

    Args:
        config: the model's config (layer count, key heads, head size); may be None, in which
            case storage is allocated at the first write from the keys' shape.
        batch_size: rows of the batch; None to take it from the first write.
        max_cache_len: the most positions the cache can hold.
        device, dtype: of the storage. If both config and batch_size are given, storage is
            allocated now (dtype defaults to torch's default dtype); otherwise at first write,
            in the keys' dtype and device.

    Raises:
        ValueError: if max_cache_len < 1, and (on write) when the new tokens do not fit, naming
            the cache length, the new tokens and the limit.
    """

    def __init__(
        self,
        config: MosaicGPTConfig | None,
        batch_size: int | None,
        max_cache_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
        self.max_cache_len = max_cache_len
        self.batch_size_hint = batch_size
        if config is not None and batch_size is not None:
            shape = (batch_size, config.kv_n_heads, max_cache_len, config.head_dim)
            dtype = dtype or torch.get_default_dtype()
            for _ in range(config.n_layers):
                self._keys.append(torch.zeros(shape, dtype=dtype, device=device))
                self._values.append(torch.zeros(shape, dtype=dtype, device=device))
                self._lengths.append(0)

    def get_max_length(self) -> int:
        return self.max_cache_len

    def validate(self, config, batch_size, new_tokens, dtype=None):
        super().validate(config, batch_size, new_tokens, dtype)
        if self.batch_size_hint is not None and self.batch_size_hint != batch_size:
            raise ValueError(
                f"past_key_values does not fit: the StaticCache was made for batch size "
                f"{self.batch_size_hint}, the input has batch size {batch_size}"
            )
        self._check_room(self.get_seq_length(), new_tokens)

    def _check_room(self, length: int, new_tokens: int) -> None:
        if length + new_tokens > self.max_cache_len:
            raise ValueError(
                f"StaticCache is full: it holds {length} positions, {new_tokens} new tokens "
                f"would need {length + new_tokens}, but max_cache_len is {self.max_cache_len}"
            )

    def _allocate_layer(self, key, value):
        self._keys.append(_empty(key, self.max_cache_len, self.batch_size_hint))
        self._values.append(_empty(value, self.max_cache_len, self.batch_size_hint))
        self._lengths.append(0)

    def _grow(self, layer_idx, needed):
        self._check_room(self._lengths[layer_idx], needed - self._lengths[layer_idx])

    def select(self, batch_indices):
        super().select(batch_indices)
        self.batch_size_hint = len(batch_indices)
        return self

    def _empty_like(self):
        return StaticCache(None, self.batch_size_hint, self.max_cache_len)
