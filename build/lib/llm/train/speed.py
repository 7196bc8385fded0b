"""Training speed: the model's FLOPs per batch and the machine's peak FLOP/s, for Composer's
``SpeedMonitor`` (tokens/s and MFU), which knows the peaks of GPUs but not of CPUs.

FLOPs follow nanoGPT's ``estimate_mfu`` (after the PaLM paper, Chowdhery et al. 2022, appendix B):
6 per parameter per token (forward and backward) for the non-embedding parameters plus the
output layer, and 12 * n_layers * d_model * seq_len per token for attention's two products.
"""

from __future__ import annotations

import time

import torch

#: Matrix side of the peak measurement: large enough for the CPU's GEMM to reach its peak.
PEAK_SIZE = 2048


def flops_per_token(config, seq_len: int) -> int:
    """Training FLOPs per token of a MosaicGPT of ``config`` at sequence length ``seq_len``."""
    d, layers = config.d_model, config.n_layers
    hidden = config.ffn_hidden_size or int(config.expansion_ratio * d)
    kv = config.kv_n_heads * config.head_dim
    attention = d * (d + 2 * kv) + d * d  # Wqkv and out_proj
    ffn = (3 if config.ffn_type == "glu" else 2) * d * hidden
    matrices = layers * (attention + ffn) + config.vocab_size * d  # blocks and the output layer
    return 6 * matrices + 12 * layers * d * seq_len


def flops_per_batch(config, batch) -> int:
    """Training FLOPs of a batch (a mapping with ``input_ids`` (batch, seq))."""
    ids = batch["input_ids"]
    return flops_per_token(config, ids.shape[1]) * ids.numel()


def measure_peak_flops(dtype: torch.dtype = torch.float32, size: int = PEAK_SIZE, seconds: float = 0.5) -> float:
    """FLOP/s of a square matrix product in ``dtype`` on this CPU with torch's threads, best of a
    few runs over about ``seconds``: the peak MFU is measured against."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm-up: the kernel's first call
    best, spent = float("inf"), 0.0
    while spent < seconds:
        start = time.perf_counter()
        torch.mm(a, b)
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return 2 * size**3 / best
