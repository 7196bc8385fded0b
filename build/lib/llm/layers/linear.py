"""A linear layer whose few-row products (decoding steps) use every CPU thread."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# Above this many rows MKL's own GEMM uses every thread: the split measured within 15% of it at 128-512.
MAX_SPLIT_ROWS = 64
# Up to this many rows the product is computed as W x^T, beyond as x W^T: MKL picks different
# kernels for the two, and W x^T took 0.7-0.9x the time for 1-6 rows but up to 1.4x for 11-15.
COLUMN_ROWS = 8
# Weight elements per thread below which the split loses: the product is then too short to pay
# for starting the threads (measured on 2 cores: 0.8x for a 256 x 256 weight, 1.2x for 384 x 384).
MIN_BLOCK_ELEMENTS = 1 << 16

_PLAIN = (torch.Tensor, nn.Parameter)


def _num_threads() -> int:
    # torch.compile cannot trace torch.get_num_threads: a compiled graph takes the count it was
    # traced with as a constant (the split is then of the same blocks as eagerly)
    return torch.get_num_threads()


# what torch.compiler.assume_constant_result does, without importing dynamo (seconds) at import time
_num_threads._dynamo_marked_constant = True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, faster for few rows on a multi-threaded CPU.

    MKL runs a float32 product of a few rows (a decoding step: batch x new tokens) on one
    thread, so a step reads the weights at about half the memory bandwidth that two threads
    get. Here such a product is a batched product over row blocks of the weight (a view:
    nothing is copied), which MKL's batched GEMM spreads over the threads, one block each: the
    output-row partitioning that llama.cpp's ggml gives its threads in matrix-vector products.
    Measured on 2 cores over SmolLM2-135M's 151 projections, tied head included
    (``python -m benchmarks.generate --linear``): 1.6-2.3x faster for 1-4 rows, 1.3-1.5x for 6-64.
    Each output element is the same dot product; results equal ``F.linear``'s to float32
    rounding.

    Only inference takes the split (autograd not recording ``x`` or ``weight``, no autocast): on
    the CPU, float32, a plain contiguous weight, at most ``MAX_SPLIT_ROWS`` rows, and at least
    ``MIN_BLOCK_ELEMENTS`` weight elements per block, the block count being the largest divisor
    of ``out_features`` that is at most the thread count; everything else is ``F.linear``.

    Args:
        x: (..., in_features).
        weight: (out_features, in_features), as ``nn.Linear``.
        bias: (out_features,) or None.

    Returns:
        (..., out_features), x's dtype.
    """
    # anything F.linear would reject or treat specially (autocast, sparse x, mismatched shapes
    # or dtypes) goes to F.linear, so that it behaves and fails exactly as F.linear does
    if (
        x.is_cpu and x.layout == torch.strided and x.dtype == torch.float32 and weight.dtype == torch.float32
        and x.dim() >= 1 and weight.dim() == 2 and x.shape[-1] == weight.shape[1] and x.shape[-1]
        and (bias is None or (bias.dim() == 1 and bias.dtype == torch.float32))
        and not torch.is_autocast_enabled("cpu")
    ):
        in_features = x.shape[-1]
        rows = x.numel() // in_features
        if 0 < rows <= MAX_SPLIT_ROWS and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
            out_features = weight.shape[0]
            most = min(_num_threads(), weight.numel() // MIN_BLOCK_ELEMENTS)
            blocks = math.gcd(out_features, most) if most > 1 else 1
            # plain tensors only: a tensor subclass (a sharded DTensor, a quantized weight) may
            # not view as blocks the way its values are laid out
            if blocks > 1 and type(weight) in _PLAIN and weight.is_contiguous():
                blocked = weight.view(blocks, out_features // blocks, in_features)
                flat = x.reshape(rows, in_features)
                if rows <= COLUMN_ROWS:
                    # out^T = W_block x^T: (blocks, out / blocks, in) @ (in, rows)
                    parts = torch.bmm(blocked, flat.t().expand(blocks, in_features, rows))
                    out = parts.view(*x.shape[:-1], out_features) if rows == 1 else (
                        parts.permute(2, 0, 1).reshape(*x.shape[:-1], out_features))
                else:
                    # out = x W_block^T: (rows, in) @ (in, out / blocks), per block
                    parts = torch.bmm(flat.expand(blocks, rows, in_features), blocked.transpose(1, 2))
                    out = parts.transpose(0, 1).reshape(*x.shape[:-1], out_features)
                return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state-dict keys and initialization) computed by :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
