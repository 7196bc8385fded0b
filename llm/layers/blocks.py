"""The pre-norm transformer block of GPT-2 / MPT / Llama."""

from __future__ import annotations

import torch
from torch import nn

from llm.config import MosaicGPTConfig
from llm.layers.attention import MultiheadAttention
from llm.layers.ffn import build_ffn
from llm.layers.norm import build_norm


class MosaicGPTBlock(nn.Module):
    """``x + attn(norm_1(x))`` then ``x + ffn(norm_2(x))``, with residual dropout.

    (batch, seq, d_model) -> (batch, seq, d_model); keyword arguments go to the attention.
    """

    def __init__(self, config: MosaicGPTConfig, layer_idx: int):
        super().__init__()
        self.norm_1 = build_norm(config)
        self.attn = MultiheadAttention(config, layer_idx)
        self.norm_2 = build_norm(config)
        self.ffn = build_ffn(config)
        self.resid_drop = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        x = x + self.resid_drop(self.attn(self.norm_1(x), **attn_kwargs))
        return x + self.resid_drop(self.ffn(self.norm_2(x)))
