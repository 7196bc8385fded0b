"""Sampling filters against hand computations and transformers' processors (the options' checks are in
test_config.py)."""

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from llm.generation import GenerationConfig, Sampler, filter_logits

NAN = float("nan")


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


def test_top_p_keeps_transformers_nucleus_over_large_vocabularies():
    # the nucleus is searched among the largest logits first (256, then 16x more): flat rows need
    # more than 256 tokens, peaked ones a few; in one batch each row must keep its own nucleus,
    # exactly the tokens transformers' TopPLogitsWarper (a full sort) keeps
    from transformers import TopPLogitsWarper

    generator = torch.Generator().manual_seed(0)
    for vocab in (50, 300, 49152):
        for scale in (0.01, 1.0, 8.0):
            logits = torch.randn(3, vocab, generator=generator) * torch.tensor([[scale], [1.0], [20.0]])
            for top_p in (0.1, 0.5, 0.9, 0.999):
                ours = torch.isfinite(filter_logits(logits, top_p=top_p))
                theirs = torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone()))
                assert torch.equal(ours, theirs), (vocab, scale, top_p)
                assert ours.any(-1).all()


def test_draws_follow_the_distribution_and_never_pick_impossible_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    sampler = Sampler(GenerationConfig(do_sample=True), torch.Generator().manual_seed(1))
    draws = torch.stack([sampler.draw(probs) for _ in range(4000)])
    counts = torch.bincount(draws[:, 0], minlength=6) / len(draws)
    assert counts[[0, 2, 5]].sum() == 0 and (draws[:, 1] == 5).all()
    torch.testing.assert_close(counts[[1, 3, 4]], probs[0, [1, 3, 4]], atol=0.03, rtol=0)
    # a uniform draw times the row's total can round up to the total: the last possible token
    original = torch.rand
    torch.rand = lambda *a, **k: torch.ones(a[0], 1, dtype=torch.float64)
    try:
        assert sampler.draw(probs * 7).tolist() == [4, 5]
    finally:
        torch.rand = original
    # the same seed gives the same draws
    again = Sampler(GenerationConfig(do_sample=True), torch.Generator().manual_seed(1))
    assert torch.equal(torch.stack([again.draw(probs) for _ in range(4000)]), draws)


def test_one_row_is_drawn_among_its_possible_tokens_as_over_the_whole_vocabulary():
    """The one-row path (the support's cumulative sum) picks the token the whole row's picks."""
    def whole_row(probs, u):
        cumulative = probs.double().cumsum(-1)
        picked = torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True)
        return torch.minimum(picked, (probs > 0).cumsum(-1).argmax(-1, keepdim=True)).squeeze(-1)

    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        probs = torch.rand(1, 5000, generator=g) ** 8
        probs[probs < torch.rand(1, generator=g) ** 0.1] = 0  # a nucleus of a few, or of many
        probs[0, torch.randint(0, 5000, (1,), generator=g)] = 0.5
        seed = int(torch.randint(0, 2**31, (1,), generator=g))
        u = torch.rand(1, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        sampler = Sampler(GenerationConfig(do_sample=True), torch.Generator().manual_seed(seed))
        assert torch.equal(sampler.draw(probs), whole_row(probs, u)), trial
    original = torch.rand  # u * total rounding up to the total: the last possible token
    torch.rand = lambda *a, **k: torch.ones(a[0], 1, dtype=torch.float64)
    try:
        assert sampler.draw(torch.tensor([[0.0, 0.25, 0.75, 0.0]]) * 7).tolist() == [2]
    finally:
        torch.rand = original


@pytest.mark.usefixtures("cpu_kernels")
def test_one_row_drawn_by_our_kernel_is_the_token_of_probs_and_draw():
    """Sampler.pick's one-row path (llm::sample_row: temperature, top-k, min-p, top-p and the draw
    in one pass) picks the token that Sampler.draw picks from Sampler.probs with the same uniform
    number, over vocabularies, scales, options and repetition penalties (distinct logits: among
    tied ones at the nucleus' edge it keeps the lower ids)."""
    generator = torch.Generator().manual_seed(0)
    options = [dict(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r)
               for t in (0.2, 1.0, 1.7) for k in (None, 1, 5) for p in (None, 0.5, 0.95) for m in (None, 0.1)
               for r in (None, 1.3)]
    for trial, option in enumerate(options * 3):
        vocab = (5, 97, 4096)[trial % 3]
        logits = torch.randn(1, vocab, generator=generator) * (1.0, 8.0)[trial % 2]
        seen = torch.rand(1, vocab, generator=generator) < 0.2
        seed = int(torch.randint(0, 2**31, (1,), generator=generator))
        config = GenerationConfig(do_sample=True, **option)
        fast = Sampler(config, torch.Generator().manual_seed(seed))
        slow = Sampler(config, torch.Generator().manual_seed(seed))
        for _ in range(3):
            assert torch.equal(fast.pick(logits, seen), slow.draw(slow.probs(logits, seen))), (trial, option)
    assert torch.ops.llm.sample_row(torch.tensor([0.0, 5.0, 5.0, 1.0]), 1.0, 0, 0.4, 0.0, 0.99) == 1  # ties: lower id


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("row", [[NAN, 5.0, 1.0, 4.0, 3.0], [5.0, 1.0, 4.0, 3.0, NAN], [NAN, NAN, NAN, 1.0, 2.0]])
def test_our_kernel_draws_no_nan_logit_and_always_returns(row):
    """A NaN logit counts as no token, with top-k (whose k-th largest value a NaN made undefined,
    leaving no weight and the nucleus search looping for ever) and with top-p too."""
    logits = torch.tensor(row)
    kept = set(torch.tensor([-math.inf if math.isnan(x) else x for x in row]).topk(2).indices.tolist())
    for top_p in (1.0, 0.9):
        for u in (0.0, 0.5, 0.999):
            assert torch.ops.llm.sample_row(logits, 1.0, 2, top_p, 0.0, u) in kept, (top_p, u)
