"""The KV cache: keys and values of every position seen so far, one pair of tensors per layer.

A small, explicit interface after transformers' ``cache_utils.py``:

- :class:`DynamicCache` grows as tokens come (capacity doubles, so appending a token is an
  in-place write, not a copy of the whole cache as with ``torch.cat``);
- :class:`StaticCache` is allocated once for ``max_cache_len`` positions and written in place.

Both store, per layer, keys and values shaped (batch, kv_n_heads, capacity, head_dim), of which
the first :meth:`Cache.get_seq_length` positions are valid. Cropping (speculative decoding's
rollback) only moves that length; the next write overwrites what was cut.

A cache saved to a file records the model that made it (:meth:`MosaicGPT.identity
<llm.model.MosaicGPT.identity>`) and its tokenizer (:func:`tokenizer_digest`), so that loading it
for another model, even one of the same shape (the same model trained further, a fine-tuned
one), is refused instead of silently changing the output.
"""

from __future__ import annotations

import os
import weakref
from typing import Iterator, Sequence

import torch

from llm.config import MosaicGPTConfig
from llm.io import atomic_write
from llm.utils.tokens import tokenizer_digest

_FORMAT = "llm.cache/v1"


class Cache:
    """Base class of the caches; see :class:`DynamicCache` and :class:`StaticCache`."""

    def __init__(self) -> None:
        self.metadata: dict = {}
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._lengths: list[int] = []
        #: the identity (:meth:`~llm.model.MosaicGPT.identity`) of the model whose keys and values
        #: this holds, when known without its model: read from a file, or met another model
        self.model_identity: str | None = None
        self._owner: weakref.ref | None = None  # the model that filled it, while it lives
        self._owner_version = 0  # its weights_version then

    # -- the model the cache belongs to -----------------------------------------------------
    def claim(self, model) -> None:
        """Stamp the cache with ``model`` (called by every forward that takes it): a cache holds
        one model's keys and values, so a forward by another model raises, with no argument to
        remember, and a forward by the model that filled it after its weights were written raises
        too. The model that filled it costs a :meth:`~llm.model.MosaicGPT.weights_version` per
        forward (about 40 us for SmolLM2); another model's
        identity (its weights hashed once, :meth:`~llm.model.MosaicGPT.identity`) is computed only
        when it meets a cache stamped by something else.

        Raises:
            ValueError: the cache holds positions made by a model of another identity (config
                and weights), naming both; or by this model before its weights were written.
        """
        if self._owner is not None and self._owner() is model:
            if model.weights_version() == self._owner_version:
                return
            if self.get_seq_length() > 0:
                raise ValueError("past_key_values holds keys and values this model computed before its weights were "
                                 "written (an optimizer step, load_state_dict...): they are stale; start a new cache")
        stamp = self._stamp() if self.get_seq_length() > 0 else None  # an empty cache is nobody's yet
        if stamp is not None:
            identity = model.identity()
            if identity != stamp:
                raise ValueError(f"past_key_values holds the keys and values of another model (identity "
                                 f"{stamp[:12]}, this model's {identity[:12]}): a cache serves the model that "
                                 f"filled it; start a new one")
            self.model_identity = stamp
        self._owner, self._owner_version = weakref.ref(model), model.weights_version()

    def _stamp(self) -> str | None:
        """The identity of the model that filled the cache, if known."""
        owner = self._owner() if self._owner is not None else None
        return self.model_identity or (owner.identity() if owner is not None else None)

    # -- the interface the model uses -------------------------------------------------------
    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_position: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one layer's new keys and values; return all of that layer's keys and values.

        Args:
            key, value: (batch, kv_n_heads, new_tokens, head_dim).
            layer_idx: the layer, 0-based; layers are first written in order.
            cache_position: None to append; or a (new_tokens,) int64 tensor of the buffer positions
                to write (gpt-fast's ``KVCache.update(input_pos, k, v)``), for a storage already
                allocated (a :class:`StaticCache` made with a config and a batch size). The length
                is then NOT moved (no Python-side bookkeeping, so a compiled step has fixed shapes):
                the caller sets it with :meth:`StaticCache.set_seq_length`.

        Returns:
            (keys, values): appending, each (batch, kv_n_heads, past + new_tokens, head_dim) views
            of the cache's storage, valid until the cache is next written; with ``cache_position``,
            the whole storage, (batch, kv_n_heads, capacity, head_dim), whose positions past the
            written ones hold stale values for the caller's mask to hide.

        Raises:
            ValueError: with ``cache_position``, if the layer's storage is not allocated.
        """
        if cache_position is not None:
            if layer_idx >= len(self._keys):
                raise ValueError(
                    "a write at cache_position needs allocated storage: make the StaticCache with a config "
                    "and a batch size"
                )
            keys, values = self._keys[layer_idx], self._values[layer_idx]
            keys.index_copy_(2, cache_position, key)
            values.index_copy_(2, cache_position, value)
            return keys, values
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

    def storage(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole key and value storage, each (batch, kv_n_heads, capacity, head_dim),
        for a kernel that writes new keys at ``cache_position`` itself, as :meth:`update` does
        (:func:`llm.kernels.cpu_quant.decoder_blocks`).

        Raises:
            ValueError: if the layer's storage is not allocated.
        """
        if layer_idx >= len(self._keys):
            raise ValueError(f"layer {layer_idx} has no storage: the cache holds {len(self._keys)} layers")
        return self._keys[layer_idx], self._values[layer_idx]

    def storages(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's whole key storage and value storage (see :meth:`storage`), in layer order."""
        return list(self._keys), list(self._values)

    def reserve(self, config, batch_size: int, length: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate (or grow) every layer's storage for at least ``length`` positions, for a
        forward that writes its new keys at ``cache_position`` (:meth:`storage`); the length is not
        moved (:meth:`set_seq_length` does that).

        Raises:
            ValueError: if a :class:`StaticCache` has no room for ``length`` positions.
        """
        like = torch.empty(batch_size, config.kv_n_heads, 0, config.head_dim, dtype=dtype, device=device)
        for layer in range(config.n_layers):
            if layer == len(self._keys):
                self._allocate_layer(like, like)
            if self._keys[layer].shape[2] < length:
                self._grow(layer, length)

    def set_seq_length(self, length: int) -> "Cache":
        """Declare the first ``length`` positions of every layer valid, after writes at
        ``cache_position`` (see :meth:`update`), which do not move the length. Returns self.

        Raises:
            ValueError: if ``length`` is negative or beyond a layer's storage.
        """
        if any(not 0 <= length <= keys.shape[2] for keys in self._keys):
            raise ValueError(f"length must be in [0, {min(k.shape[2] for k in self._keys)}], got {length}")
        self._lengths = [length] * len(self._keys)
        return self

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
        other.model_identity, other._owner, other._owner_version = self.model_identity, self._owner, self._owner_version
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
    def save(self, path: str | os.PathLike, metadata: dict | None = None, *, model=None, tokenizer=None) -> None:
        """Write the cached positions to ``path`` (``torch.save`` format), atomically.

        Args:
            path: the file; written under a temporary name, then renamed.
            metadata: plain ints, floats, strings, lists and dicts (e.g. the token ids the cache
                holds), stored alongside; they come back as :attr:`metadata` from :meth:`load`.
            model: the model that made the cache: its :meth:`~llm.model.MosaicGPT.identity` is
                recorded, for :meth:`load` to refuse the file for any other model (default: the
                model that filled it, whose stamp the file keeps either way).
            tokenizer: the tokenizer of the cached token ids: its :func:`tokenizer_digest` is
                recorded, for :meth:`load` to refuse the file for another tokenizer.
        """
        state = {
            "format": _FORMAT,
            "metadata": metadata or {},
            "class": type(self).__name__,
            "max_cache_len": self.get_max_length(),
            "model_identity": model.identity() if model is not None else self._stamp(),
            "tokenizer": tokenizer_digest(tokenizer) if tokenizer is not None else None,
            "keys": [k.contiguous() for k, _ in self],
            "values": [v.contiguous() for _, v in self],
        }
        atomic_write(path, lambda tmp: torch.save(state, tmp))

    @staticmethod
    def load(
        path: str | os.PathLike, device: torch.device | str | None = None, *, model=None, tokenizer=None
    ) -> "Cache":
        """Read a cache written by :meth:`save`, as the class it was saved from.

        Args:
            path: the file.
            device: where to put the tensors; default: ``model``'s device if given, else where
                they were saved from.
            model: the model that is to use the cache: the file must have been saved with
                ``model=`` this same model (same :meth:`~llm.model.MosaicGPT.identity`: config
                and weights) and fit its dtype and shapes.
            tokenizer: the tokenizer that is to extend the cached token ids: the file must have
                been saved with ``tokenizer=`` one of the same :func:`tokenizer_digest`.

        Raises:
            OSError: if the file cannot be read (FileNotFoundError: there is no such file).
            ValueError: one line naming the file: that it is not a readable cache (truncated,
                corrupt or foreign); or, given ``model`` / ``tokenizer``, everything that does not
                match them: model identity (also when the file records none), tokenizer (likewise),
                dtype, layer count, key/value heads, head size.
        """
        if device is None and model is not None:
            device = model.device
        try:
            state = torch.load(path, map_location=device, weights_only=True)
        except OSError:  # no such file, no permission: not the file's fault
            raise
        except Exception as err:
            # not torch's message: for a pickle of something else it advises weights_only=False
            raise ValueError(f"{path} is not a readable cache file (truncated or corrupt)") from err
        if not _is_cache_state(state):
            raise ValueError(f"{path} is not a cache file written by llm.Cache.save")
        problems = _mismatches(state, model, tokenizer)
        if problems:
            raise ValueError(f"{path} was made by another model or tokenizer: " + "; ".join(problems))
        if state["class"] == "StaticCache":
            batch_size = state["keys"][0].shape[0] if state["keys"] else None
            cache: Cache = StaticCache(None, batch_size, state["max_cache_len"])
        else:
            cache = DynamicCache()
        for i, (k, v) in enumerate(zip(state["keys"], state["values"])):
            cache.update(k, v, i)
        cache.metadata = state["metadata"]
        cache.model_identity = state.get("model_identity")  # its first forward checks it
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


def _is_cache_state(state) -> bool:
    """Whether ``state`` (what torch.load read) has the layout :meth:`Cache.save` writes."""
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        return False
    keys, values = state.get("keys"), state.get("values")
    return (
        state.get("class") in ("DynamicCache", "StaticCache")
        and isinstance(state.get("metadata"), dict)
        and isinstance(keys, list) and isinstance(values, list) and len(keys) == len(values)
        and all(isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4 and k.shape == v.shape
                for k, v in zip(keys, values))
    )


def _mismatches(state: dict, model, tokenizer) -> list[str]:
    """What keeps a saved cache (``state``, see :meth:`Cache.save`) from serving ``model`` and
    ``tokenizer`` (either may be None: not checked); one phrase per mismatch."""
    problems = []
    if model is not None:
        # files saved before identities were recorded hold none (.get): unknown, so refused
        saved, identity = state.get("model_identity"), model.identity()
        if saved is None:
            problems.append("it records no model identity (saved without model=)")
        elif saved != identity:
            problems.append(f"its model identity is {saved[:12]}, this model's {identity[:12]}")
        if state["keys"]:
            k, config = state["keys"][0], model.config
            for what, have, want in (
                ("dtype", k.dtype, model.dtype),
                ("layers", len(state["keys"]), config.n_layers),
                ("key/value heads", k.shape[1], config.kv_n_heads),
                ("head size", k.shape[3], config.head_dim),
            ):
                if have != want:
                    problems.append(f"its {what} is {have}, this model's {want}")
    if tokenizer is not None:
        saved, digest = state.get("tokenizer"), tokenizer_digest(tokenizer)
        if saved is None:
            problems.append("it records no tokenizer (saved without tokenizer=)")
        elif saved != digest:
            problems.append(f"its tokenizer is {saved[:12]}, this one's {digest[:12]}")
    return problems


def _empty(like: torch.Tensor, capacity: int, batch: int | None = None) -> torch.Tensor:
    b, h, _, d = like.shape
    return torch.zeros(batch or b, h, capacity, d, dtype=like.dtype, device=like.device)


class DynamicCache(Cache):
    """A cache that grows as tokens come; what ``use_cache=True`` returns when no cache is given.

    Storage doubles when full, so decoding a token writes in place (amortised O(1) copies per
    token, against O(length) for transformers' ``torch.cat``-based DynamicCache).
    A caller that knows how far it will decode (``generate``: prompt + ``max_new_tokens``) makes
    room once with :meth:`expect`, so no step pays for a grow.
    """

    _MIN_CAPACITY = 64

    def __init__(self) -> None:
        super().__init__()
        self._capacity = self._MIN_CAPACITY  # positions a layer's first write allocates, at least

    def expect(self, length: int) -> "DynamicCache":
        """Make room for ``length`` positions now: allocated layers grow once to it, layers
        written later start with it (a caller about to decode to a known length). Returns self."""
        self._capacity = max(self._capacity, int(length))
        for layer, keys in enumerate(self._keys):
            if keys.shape[2] < length:
                self._grow(layer, length, exact=True)
        return self

    def _allocate_layer(self, key, value):
        capacity = max(key.shape[2], self._capacity)
        self._keys.append(_empty(key, capacity))
        self._values.append(_empty(value, capacity))
        self._lengths.append(0)

    def _grow(self, layer_idx, needed, exact=False):
        n = self._lengths[layer_idx]
        capacity = needed if exact else max(needed, 2 * self._keys[layer_idx].shape[2])
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
        zeroed: whether storage allocated now starts as zeros; False (uninitialized memory,
            which the OS hands over without a write) only for a caller whose attention never
            reads a masked key (:func:`llm.model.buffer.masked_keys_unread`): masked garbage
            would otherwise be multiplied by a zero weight, and NaN * 0 is NaN.

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
        zeroed: bool = True,
    ):
        super().__init__()
        if not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
        self.max_cache_len = max_cache_len
        self.batch_size_hint = batch_size
        if config is not None and batch_size is not None:
            shape = (batch_size, config.kv_n_heads, max_cache_len, config.head_dim)
            dtype = dtype or torch.get_default_dtype()
            make = torch.zeros if zeroed else torch.empty
            for _ in range(config.n_layers):
                self._keys.append(make(shape, dtype=dtype, device=device))
                self._values.append(make(shape, dtype=dtype, device=device))
                self._lengths.append(0)

    def get_max_length(self) -> int:
        return self.max_cache_len

    def set_seq_length(self, length: int) -> "StaticCache":
        """Declare the first ``length`` positions of every layer valid, after writes at
        ``cache_position`` (see :meth:`Cache.update`), which do not move the length. Returns self.

        Raises:
            ValueError: if ``length`` is not in [0, max_cache_len].
        """
        if not 0 <= length <= self.max_cache_len:
            raise ValueError(f"length must be in [0, max_cache_len={self.max_cache_len}], got {length}")
        self._lengths = [length] * len(self._keys)
        return self

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
