"""Sampling filters against hand computations and transformers' processors (the options' checks are in
test_config.py)."""

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from llm.generation import GenerationConfig, Sampler, filter_logits


def test_top_k_top_p_min_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    kept = lambda out: torch.isfinite(out)[0].tolist()
    assert kept(filter_logits(logits, top_k=2)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_p=0.5)) == [True, False, False, False]
    assert kept(filter_logits(logits, top_p=0.6)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_p=0.9)) == [True, True, True, False]
    assert kept(filter_logits(logits, top_p=1.0)) == [True] * 4
    assert kept(filter_logits(logits, min_p=0.3)) == [True, True, True, False]  # 0.3 * 0.5 = 0.15
    torch.testing.assert_close(filter_logits(logits, temperature=2.0), logits / 2)


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    previous = torch.tensor([[1, 3, 3, 7], [0, 2, 9, 9]])
    seen = torch.zeros(2, 10, dtype=torch.bool).scatter_(1, previous, True)
    ours = Sampler(GenerationConfig(repetition_penalty=1.3)).scores(logits, seen)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(previous, logits.clone())
    torch.testing.assert_close(ours, theirs)
