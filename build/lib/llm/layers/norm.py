"""Normalization layers: LayerNorm (GPT-2, MPT) and RMSNorm (Llama)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llm.config import MosaicGPTConfig
from llm.kernels import cpu_quant


class RMSNorm(cpu_quant.Watched, nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 as transformers' ``LlamaRMSNorm``.

    (..., d) -> (..., d) in the input's dtype.
    """

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        # not torch.ones: on the meta device (a model about to be loaded) that imports sympy
        self.weight = nn.Parameter(nn.init.ones_(torch.empty(d_model)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm is h * rsqrt(mean(h^2) + eps) in one call (bitwise equal to the
        # longhand, a quarter faster on a decoding step's single row); in float32 it also
        # applies the weight (same products, one call fewer)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, eps=self.eps)
        h = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * h.to(x.dtype)


def build_norm(config: MosaicGPTConfig) -> nn.Module:
    """The norm named by ``config.norm_type``; LayerNorm has no bias when ``config.no_bias``."""
    if config.norm_type == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.layer_norm_epsilon)
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=not config.no_bias)
