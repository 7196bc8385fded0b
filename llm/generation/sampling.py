"""Turning next-token logits into tokens: greedy, temperature, top-k, top-p and min-p sampling."""

from __future__ import annotations

import torch


def validate_sampling(
    *, temperature: float, top_k: int | None, top_p: float | None, min_p: float | None,
    repetition_penalty: float | None,
) -> None:
    """Raise ValueError naming the first argument outside its allowed range."""
    if temperature is None or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 or None: no top-k), got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    if repetition_penalty is not None and repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1.0: none), got {repetition_penalty!r}")


def apply_repetition_penalty(logits: torch.Tensor, previous: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019), as transformers applies it.

    Args:
        logits: (batch, vocab) float.
        previous: (batch, n) int64, every token seen so far (prompt, cached ones included).
        penalty: > 1 discourages repeats: positive logits are divided by it, negative multiplied.
    """
    seen = logits.gather(-1, previous)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(-1, previous, seen)


def filter_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
    top_p: float | None = None, min_p: float | None = None,
) -> torch.Tensor:
    """Scale by temperature and set filtered-out tokens to -inf; (batch, vocab) -> (batch, vocab) fp32.

    top_k keeps the k largest; top_p keeps the smallest set whose probability reaches top_p
    (nucleus sampling, Holtzman et al. 2020; the most likely token always stays); min_p keeps
    tokens with probability >= min_p times the top token's (Nguyen et al. 2024).
    """
    logits = logits.float() / temperature if temperature > 0 else logits.float()
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(
    logits: torch.Tensor, *, do_sample: bool, temperature: float = 1.0, top_k: int | None = None,
    top_p: float | None = None, min_p: float | None = None, generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row: (batch, vocab) logits -> (batch,) int64.

    Greedy (argmax) unless ``do_sample`` and ``temperature`` > 0; then a draw from the
    filtered distribution with ``generator``.
    """
    if not do_sample or temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
