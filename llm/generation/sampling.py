"""Turning next-token logits into tokens: repetition penalty, greedy, temperature, top-k, top-p, min-p."""

from __future__ import annotations

import torch

from llm.generation.config import GenerationConfig
from llm.kernels import cpu_quant


def filter_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
    top_p: float | None = None, min_p: float | None = None,
) -> torch.Tensor:
    """Scale by temperature and set filtered-out tokens to -inf; (batch, vocab) -> (batch, vocab) fp32.

    top_k keeps the k largest; top_p keeps the smallest set whose probability reaches top_p
    (nucleus sampling, Holtzman et al. 2020; the most likely token always stays); min_p keeps
    tokens with probability >= min_p times the top token's (Nguyen et al. 2024). The arguments
    are taken as they are: :class:`~llm.generation.GenerationConfig` is where they are checked.
    """
    logits = logits.float() / temperature if temperature > 0 else logits.float()
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    if top_p is not None and top_p < 1.0:
        logits = _top_p(logits, top_p)
    return logits


# Candidates of the first top-p pass: the nucleus of a sampled distribution is nearly always
# smaller, and a top-k of them costs a tenth of sorting a 50k vocabulary (3.5 ms on 2 cores).
_NUCLEUS_CANDIDATES = 256


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` with every token outside each row's nucleus set to -inf.

    The nucleus is found among the row's largest logits (:func:`torch.topk`, sorted), 256 and
    then 16x as many until the probability of the candidates before the last one reaches
    ``top_p`` in every row (then the nucleus, the smallest prefix reaching it, lies within them),
    else among all: the same set as sorting the whole vocabulary, without the sort."""
    vocab = logits.shape[-1]
    every = logits.softmax(-1)  # (torch's softmax is vectorized: 10x its logsumexp or exp here)
    k = min(vocab, _NUCLEUS_CANDIDATES)
    while True:
        values, order = logits.topk(k, dim=-1)
        probs = every.gather(-1, order)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each candidate
        if k == vocab or bool((before[..., -1] >= top_p).all()):
            break
        k = min(vocab, 16 * k)
    kept = values.masked_fill(before >= top_p, float("-inf"))  # the top token has 0 before: always kept
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, kept)


class Sampler:
    """Turns a row's next-token logits into a distribution and picks from it.

    Processing order as in transformers: repetition penalty, then temperature, top-k, min-p and
    top-p. Greedy (``do_sample=False`` or ``temperature=0``) gives one-hot distributions, so the
    speculative acceptance rule reduces to "accept while the draft equals the argmax".

    Args:
        config: the (validated) options: do_sample, temperature, top_k, top_p, min_p,
            repetition_penalty.
        generator: the random source of every draw (seeded by ``generate(seed=...)``).
    """

    def __init__(self, config: GenerationConfig, generator: torch.Generator | None = None):
        self.greedy = config.greedy
        self.temperature, self.top_k, self.top_p, self.min_p = (config.temperature, config.top_k, config.top_p,
                                                                config.min_p)
        self.repetition_penalty = config.repetition_penalty if config.repetition_penalty != 1.0 else None
        self.generator = generator

    def scores(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
        """(n, vocab) logits -> (n, vocab) fp32 processed logits; ``seen`` (n, vocab) bool marks tokens
        already in the sequence, for the repetition penalty."""
        logits = self._penalised(logits, seen)
        if self.greedy:
            return logits
        return filter_logits(logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                             min_p=self.min_p)

    def _penalised(self, logits: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
        logits = logits.float()
        if self.repetition_penalty is not None and seen is not None:
            penalised = torch.where(logits > 0, logits / self.repetition_penalty, logits * self.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        return logits

    def probs(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
        """(n, vocab) logits -> (n, vocab) fp32 distribution (one-hot when greedy)."""
        scores = self.scores(logits, seen)
        if self.greedy:
            return torch.zeros_like(scores).scatter_(-1, scores.argmax(-1, keepdim=True), 1.0)
        return scores.softmax(-1)

    def pick(self, logits: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
        """(n, vocab) logits -> (n,) int64 tokens.

        One row on the CPU, where our kernels are loaded, is drawn by ``llm::sample_row``: the
        filters, the distribution and the draw of :meth:`probs` and :meth:`draw` (the same uniform
        number) in one pass over the vocabulary: 0.04-0.08 ms on SmolLM2's (0.07 within a decoding
        step) where torch's ops take 0.4-0.6 (a tenth of a step). It keeps the same tokens but where
        float rounding differs at the nucleus' edge (a flat distribution over a large vocabulary),
        among tied probabilities at that edge keeps the lower ids, and never draws a token whose
        probability is below float's smallest normal number (1e-38 of the top one's; the torch path
        draws one only for a uniform number of exactly 0)."""
        if self.greedy:
            return cpu_quant.argmax_rows(self.scores(logits, seen))
        if (logits.shape[0] == 1 and logits.device.type == "cpu" and not torch.compiler.is_compiling()
                and cpu_quant.loaded()):
            scores = self._penalised(logits, seen)
            u = torch.rand(1, 1, generator=self.generator, device=self._draw_device(logits), dtype=torch.float64)
            token = torch.ops.llm.sample_row(scores[0], self.temperature, self.top_k or 0,
                                             1.0 if self.top_p is None else self.top_p, self.min_p or 0.0, float(u))
            return torch.tensor([token], device=logits.device)
        return self.draw(self.probs(logits, seen))

    def _draw_device(self, like: torch.Tensor) -> torch.device:
        return self.generator.device if self.generator is not None else like.device

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One draw per row of (n, vocab) probabilities (not necessarily normalized) -> (n,) int64.

        Inverse transform sampling: the first token whose cumulative probability (float64)
        exceeds a uniform draw scaled by the row's total; a token of probability 0 is never
        drawn. Twenty times faster than :func:`torch.multinomial` over a 50k vocabulary on the
        CPU (0.05 ms against 1.1), which on a small model is a sixth of a decoding step. One row
        is drawn among its tokens of positive probability only (after top-p or top-k, a few out
        of the vocabulary): the same token, since zeros add nothing to a sum, without two passes
        over the whole vocabulary (0.36 ms a token on SmolLM2's)."""
        u = torch.rand(probs.shape[0], 1, generator=self.generator, device=self._draw_device(probs), dtype=torch.float64)
        if probs.shape[0] == 1:
            support = (probs[0] > 0).nonzero().squeeze(-1)  # in vocabulary order
            if len(support):
                cumulative = probs[0, support].double().cumsum(-1)
                k = torch.searchsorted(cumulative, u[0].to(probs.device) * cumulative[-1:], right=True)
                return support[k.clamp_max(len(support) - 1)]
        cumulative = probs.double().cumsum(-1)
        picked = torch.searchsorted(cumulative, u.to(probs.device) * cumulative[:, -1:], right=True)
        # u * total can round up to the total: the last token of positive probability then
        last = (probs > 0).cumsum(-1).argmax(-1, keepdim=True)
        return torch.minimum(picked, last).squeeze(-1)

    def uniform(self) -> float:
        """A draw from U[0, 1), from the same generator."""
        device = self.generator.device if self.generator is not None else "cpu"
        return float(torch.rand((), generator=self.generator, device=device))
