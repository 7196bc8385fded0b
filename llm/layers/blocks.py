"""The pre-norm transformer block of GPT-2 / MPT / Llama."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llm.config import MosaicGPTConfig
from llm.kernels import cpu_quant
from llm.layers.attention import DECODE_ATTENTION_QUERIES, MultiheadAttention
from llm.layers.ffn import GLU, build_ffn
from llm.layers.norm import RMSNorm, build_norm


class MosaicGPTBlock(nn.Module):
    """``x + attn(norm_1(x))`` then ``x + ffn(norm_2(x))``, with residual dropout.

    (batch, seq, d_model) -> (batch, seq, d_model); keyword arguments go to the attention.

    ``fused_decode`` (True when the block is made while our CPU kernels are on, as the
    attention's ``decode_kernel``) sends a static cache's decoding steps (up to
    :data:`~llm.layers.attention.DECODE_ATTENTION_QUERIES` float32 tokens a row, no gradient) to
    :func:`llm.kernels.cpu_quant.decoder_block` when the block is Llama's (RMSNorm, rotary or no
    positions, SiLU-gated FFN, no biases; head_dim a multiple of 16 up to 128) and its five
    projections are quantized on our kernels;
    any other block or step takes the layers one by one.
    """

    def __init__(self, config: MosaicGPTConfig, layer_idx: int):
        super().__init__()
        self.norm_1 = build_norm(config)
        self.attn = MultiheadAttention(config, layer_idx)
        self.norm_2 = build_norm(config)
        self.ffn = build_ffn(config)
        self.resid_drop = nn.Dropout(config.resid_pdrop)
        self.fused_decode = cpu_quant.available()

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        if self.fused_decode:
            out = self._decode_step(x, **attn_kwargs)
            if out is not None:
                return out
        x = x + self.resid_drop(self.attn(self.norm_1(x), **attn_kwargs))
        return x + self.resid_drop(self.ffn(self.norm_2(x)))

    def _fused_weights(self) -> tuple[list, list[int]] | None:
        """The fused kernel's weights and output sizes, or None if this block cannot take it."""
        attn, ffn = self.attn, self.ffn
        if not (attn.decode_kernel and attn.head_dim % 16 == 0 and attn.head_dim <= 128
                and isinstance(ffn, GLU) and ffn.act is F.silu
                and isinstance(self.norm_1, RMSNorm) and isinstance(self.norm_2, RMSNorm)
                and self.norm_1.eps == self.norm_2.eps
                and self.norm_1.weight.dtype == self.norm_2.weight.dtype == torch.float32):
            return None
        layers = (attn.Wqkv, attn.out_proj, ffn.gate_proj, ffn.up_proj, ffn.down_proj)
        tensors = [layer.kernel_tensors() if hasattr(layer, "kernel_tensors") else None for layer in layers]
        if any(t is None for t in tensors):
            return None
        return [t for triple in tensors for t in triple], [layer.out_features for layer in layers]

    def _decode_step(self, x, past_key_values=None, attn_bias=None, attn_mask=None, rotary=None, cache_position=None,
                     key_padding_mask=None, query_padding_mask=None) -> torch.Tensor | None:
        """The block through the fused kernel, or None where it does not apply."""
        if (cache_position is None or attn_mask is None or attn_bias is not None or key_padding_mask is not None
                or query_padding_mask is not None or x.dtype != torch.float32 or x.device.type != "cpu"
                or x.shape[1] > DECODE_ATTENTION_QUERIES or self.training
                or (torch.is_grad_enabled() and x.requires_grad)):
            return None
        fused = self._fused_weights()
        if fused is None:
            return None
        keys, values = past_key_values.storage(self.attn.layer_idx)
        if keys.dtype != torch.float32 or not (keys.is_contiguous() and values.is_contiguous()):
            return None
        batch, seq = x.shape[:2]
        cos = sin = None
        if rotary is not None:
            cos, sin = rotary.cos[:, 0], rotary.sin[:, 0]
        mask = attn_mask.expand(batch, 1, seq, keys.shape[2])[:, 0]
        weights, out_features = fused
        return cpu_quant.decoder_block(x, self.norm_1.weight, self.norm_2.weight, self.norm_1.eps, weights, out_features,
                                       cos, sin, keys, values, cache_position, mask, self.attn.n_heads,
                                       1.0 / math.sqrt(self.attn.head_dim))
