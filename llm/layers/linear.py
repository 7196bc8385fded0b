"""A linear layer whose few-row products (decoding steps) use every CPU thread."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# Above this many rows MKL's GEMM already uses every thread; the split measured no faster at 128.
MAX_SPLIT_ROWS = 64
# Weight elements per thread below which the split loses: the product is then too short to pay
# for starting the threads (measured on 2 cores: 0.8x for a 256 x 256 weight, 1.2x for 384 x 384).
MIN_BLOCK_ELEMENTS = 1 << 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, faster for few rows on a multi-threaded CPU.

    MKL runs a float32 product of a few rows (a decoding step: batch x new tokens) on one
    thread, so a step reads the weights at about half the memory bandwidth that two threads
    get. Here such a product is a batched product over row blocks of the weight (a view:
    nothing is copied), which MKL's batched GEMM spreads over the threads, one block each.
    Measured on 2 cores with SmolLM2-135M's projections: 1.5-2x faster for 1-4 rows, 1.1-1.3x
    for 8-64 rows (``scripts/bench_generate.py`` shows the whole-model effect). Each output
    element is the same dot product; results equal ``F.linear``'s to float32 rounding.

    Only inference takes the split (no gradient wanted for ``weight``): on the CPU, float32,
    at most ``MAX_SPLIT_ROWS`` rows, and at least ``MIN_BLOCK_ELEMENTS`` weight elements per
    block, the block count being the largest divisor of ``out_features`` that is at most the
    thread count; everything else is ``F.linear``.

    Args:
        x: (..., in_features).
        weight: (out_features, in_features), as ``nn.Linear``.
        bias: (out_features,) or None.

    Returns:
        (..., out_features), x's dtype.
    """
    if x.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.shape[-1]:
        in_features = x.shape[-1]
        rows = x.numel() // in_features
        if 0 < rows <= MAX_SPLIT_ROWS and not (weight.requires_grad and torch.is_grad_enabled()):
            out_features = weight.shape[0]
            most = min(torch.get_num_threads(), weight.numel() // MIN_BLOCK_ELEMENTS)
            blocks = math.gcd(out_features, most) if most > 1 else 1
            if blocks > 1 and weight.is_contiguous():
                blocked = weight.view(blocks, out_features // blocks, in_features).transpose(1, 2)
                # (blocks, rows, out / blocks); torch.bmm of an expanded x, not torch.matmul's
                # broadcasting, which costs ~10 us more per call (150 calls in a SmolLM2 step)
                parts = torch.bmm(x.reshape(1, rows, in_features).expand(blocks, rows, in_features), blocked)
                out = parts.view(*x.shape[:-1], out_features) if rows == 1 else (
                    parts.transpose(0, 1).reshape(*x.shape[:-1], out_features))
                return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state-dict keys and initialization) computed by :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
