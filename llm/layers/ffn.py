"""Feed-forward layers: the GPT MLP and the gated GLU (SwiGLU when ``ffn_act: silu``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llm.config import MosaicGPTConfig
from llm.kernels import cpu_quant
from llm.layers.linear import Linear

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (So et al. 2021, "Primer")
    "silu": F.silu,
}


class MLP(nn.Module):
    """``down_proj(act(up_proj(x)))`` as in GPT-2 and MPT; (batch, seq, d_model) -> same."""

    def __init__(self, config: MosaicGPTConfig):
        super().__init__()
        bias = not config.no_bias
        self.up_proj = Linear(config.d_model, config.hidden_size, bias=bias)
        self.down_proj = Linear(config.hidden_size, config.d_model, bias=bias)
        self.act = ACTIVATIONS[config.ffn_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GLU(cpu_quant.Watched, nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: gated linear units (Shazeer 2020), as Llama's MLP."""

    def __init__(self, config: MosaicGPTConfig):
        super().__init__()
        bias = not config.no_bias
        self.gate_proj = Linear(config.d_model, config.hidden_size, bias=bias)
        self.up_proj = Linear(config.d_model, config.hidden_size, bias=bias)
        self.down_proj = Linear(config.hidden_size, config.d_model, bias=bias)
        self.act = ACTIVATIONS[config.ffn_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def build_ffn(config: MosaicGPTConfig) -> nn.Module:
    """The feed-forward layer named by ``config.ffn_type``."""
    return GLU(config) if config.ffn_type == "glu" else MLP(config)
