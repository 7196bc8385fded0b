"""Position schemes: position ids under a cache and left padding, ALiBi biases, rotary embeddings."""

from __future__ import annotations

import math

import torch
from torch import nn


def position_ids_from_mask(
    attention_mask: torch.Tensor | None, past_length: int, seq_len: int, device: torch.device
) -> torch.Tensor:
    """Positions of the new tokens, shifted by the cache length and by left padding.

    Follows transformers' GPT-2/Llama generation (``cumsum(attention_mask) - 1``): each row's first
    real token gets position 0, whatever padding precedes it.

    Args:
        attention_mask: (batch, past_length + seq_len) bool/int, 1 for real tokens, or None for
            no padding.
        past_length: number of positions already in the cache.
        seq_len: number of new tokens.

    Returns:
        (batch or 1, seq_len) int64 positions. Padding positions get 0.
    """
    if attention_mask is None:
        return torch.arange(past_length, past_length + seq_len, device=device)[None]
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp_min(0)[:, -seq_len:]


def alibi_slopes(n_heads: int, alibi_bias_max: int = 8, device=None) -> torch.Tensor:
    """ALiBi's per-head slopes, (n_heads,) float32, as in Press et al. (2022) and MPT's ``gen_slopes``.

    For a head count that is not a power of two, the slopes of the next power of two are
    interleaved (MPT's and transformers' ``build_mpt_alibi_tensor`` rule).
    """
    n_pow2 = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, n_pow2 + 1, dtype=torch.float32, device=device) * (alibi_bias_max / n_pow2)
    slopes = 1.0 / torch.pow(2, m)
    if n_pow2 != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes


def alibi_bias(slopes: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ALiBi's additive attention bias over all keys, the cache included: (batch or 1, n_heads, 1, seq_k).

    As in MPT, the bias of a key is ``slope * (position - last position)``, the negated distance
    to the last key. Within a row this differs from ``-slope * (i - j)`` by a constant, which
    softmax ignores, so it is exact for every query under a cache. Positions count real tokens
    only, so padding anywhere in the row (left, or between a cached prefix and a new prompt)
    does not stretch distances.

    Args:
        slopes: (n_heads,) from :func:`alibi_slopes`.
        key_positions: (batch or 1, seq_k) int positions of the keys.
    """
    distance = (key_positions - key_positions[:, -1:]).to(torch.float32)
    return (slopes[None, :, None, None] * distance[:, None, None, :]).to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021, "RoFormer"), in transformers' Llama layout.

    The head is split in halves that rotate together (``rotate_half``), as in transformers'
    ``LlamaRotaryEmbedding`` / GPT-NeoX.
    """

    #: Positions of the first table of angles kept on the CPU; it doubles as positions need.
    _TABLE = 1024

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        # (cos, signed sin) of positions [0, n), float32: a plain attribute, not a buffer, which
        # would be cast with the model to bf16/fp16
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def angles(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) float32 (*position_ids.shape, head_dim) of int ``position_ids``: the cosines,
        and the sines with the first half negated (:class:`Rotation`'s layout)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=position_ids.device)
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        freqs = position_ids[..., None].float() * inv_freq
        sin = freqs.sin()
        return torch.cat([freqs, freqs], dim=-1).cos(), torch.cat([-sin, sin], dim=-1)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids: (batch or 1, seq) int -> a callable rotating (batch, heads, seq, head_dim) tensors.

        On the CPU (eager) the angles are rows of a table made once by :meth:`angles` (a decoding
        step then indexes it instead of running ten ops); elsewhere they are computed, by the same
        elementwise ops, so the two give the same bits.
        """
        lowest = highest = -1  # negative positions (and the cases without a table) are computed
        if position_ids.device.type == "cpu" and not torch.compiler.is_compiling() and position_ids.numel():
            lowest, highest = (int(v) for v in torch.aminmax(position_ids))
        if lowest < 0:
            cos, sin = self.angles(position_ids)
        else:
            cos, sin = self.table_rows(position_ids, highest)
        return Rotation(cos[:, None].to(dtype), sin[:, None].to(dtype))

    def table(self, highest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU table of :meth:`angles` at positions 0 .. at least ``highest`` (made, or doubled,
        to reach it): float32 (positions, head_dim) cos and sin, rows as :meth:`table_rows` reads them."""
        if self._table is None or self._table[0].shape[0] <= highest:
            size = max(self._TABLE, 2 * (self._table[0].shape[0] if self._table is not None else 0), highest + 1)
            self._table = self.angles(torch.arange(size))
        return self._table

    def table_rows(self, position_ids: torch.Tensor, highest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`angles` of CPU ``position_ids`` in [0, ``highest``], read from the table (made,
        or doubled, to reach ``highest``): float32 (*position_ids.shape, head_dim) each."""
        cos, sin = self.table(highest)
        return cos[position_ids], sin[position_ids]


class Rotation:
    """Rotary embedding at some positions, as :meth:`RotaryEmbedding.forward` makes it: called on
    (batch, heads, seq, head_dim) tensors, it rotates them.

    Attributes:
        cos: (batch or 1, 1, seq, head_dim), the angles' cosines, in the model's dtype.
        sin: the same shape, the sines with the first half negated (``rotate_half``'s sign), so
            that kernels applying it themselves take the same numbers.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos = cos
        self.sin = sin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # rotate_half(x) * sin = (-x2, x1) * (sin, sin) = roll(x) * (-sin, sin), bitwise:
        # one roll instead of chunk, neg and cat in every layer
        return x * self.cos + x.roll(x.shape[-1] // 2, dims=-1) * self.sin
