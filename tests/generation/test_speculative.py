"""Reference (LLMA / prompt lookup) and draft-model speculative decoding: greedy output identical to
plain greedy decoding, and with sampling exactly the model's distribution."""

import itertools

import pytest
import torch

from tests.conftest import POSITION_SCHEMES, QUANTIZATIONS, tiny_model


@torch.no_grad()
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("scheme", list(POSITION_SCHEMES))
def test_reference_decoding_is_greedy_decoding_and_copies_in_few_forwards(scheme, quantization):
    model = tiny_model(scheme, quantization=quantization, kernels="torch")
    prompt = torch.randint(0, 61, (1, 8))
    plain = model.generate(prompt, max_new_tokens=40, return_dict_in_generate=True)
    answer = plain.sequences[0, 8:]
    # the answer itself as the reference document: drafts are right, so few forwards are needed
    copied = model.generate(prompt, max_new_tokens=40, prompt_lookup_num_tokens=8, max_matching_ngram_size=3,
                            reference_ids=[answer], return_dict_in_generate=True)
    assert torch.equal(copied.sequences, plain.sequences)
    assert copied.stats["forward_passes"] <= 12 < plain.stats["forward_passes"] == 40
    # every forward gives one token of its own, the rest are accepted drafts
    assert copied.stats["accepted_tokens"] == 40 - copied.stats["forward_passes"]
    # wrong drafts (a random document, and the prompt itself) cost forwards but never change tokens
    noisy = model.generate(prompt, max_new_tokens=40, prompt_lookup_num_tokens=4, max_matching_ngram_size=1,
                           reference_ids=[torch.randint(0, 61, (200,))], return_dict_in_generate=True)
    assert torch.equal(noisy.sequences, plain.sequences)
    assert noisy.stats["proposed_tokens"] > noisy.stats["accepted_tokens"]


@torch.no_grad()
def test_heuristic_schedule_shortens_failing_drafts_and_keeps_right_ones_long():
    model = tiny_model("llama")
    prompt = torch.randint(0, 61, (1, 8))
    plain = model.generate(prompt, max_new_tokens=40)
    noise = [torch.randint(0, 61, (300,), generator=torch.Generator().manual_seed(2))]
    runs = {schedule: model.generate(prompt, max_new_tokens=40, prompt_lookup_num_tokens=6, max_matching_ngram_size=1,
                                     reference_ids=noise, num_assistant_tokens_schedule=schedule,
                                     return_dict_in_generate=True)
            for schedule in ("constant", "heuristic")}
    for out in runs.values():
        assert torch.equal(out.sequences, plain)
    constant, heuristic = runs["constant"].stats, runs["heuristic"].stats
    assert constant["proposed_tokens"] - constant["accepted_tokens"] > 4 * constant["forward_passes"]
    # after a rejection the draft shrinks to one token: rejected tokens ~ one per verification
    wasted = heuristic["proposed_tokens"] - heuristic["accepted_tokens"]
    assert wasted < 0.5 * (constant["proposed_tokens"] - constant["accepted_tokens"])
    # right drafts stay at full length (the answer as the reference: the first draft is right)
    copied = model.generate(prompt, max_new_tokens=40, prompt_lookup_num_tokens=6, max_matching_ngram_size=3,
                            reference_ids=[plain[0, 8:]], return_dict_in_generate=True)
    assert torch.equal(copied.sequences, plain) and copied.stats["forward_passes"] <= 1 + 40 // 7 + 2
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule must be 'heuristic' or 'constant'"):
        model.generate(prompt, prompt_lookup_num_tokens=3, num_assistant_tokens_schedule="adaptive")


@torch.no_grad()
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("scheme", ["learned", "alibi", "llama"])
def test_draft_model_decoding_is_greedy_decoding(scheme, quantization):
    model = tiny_model(scheme, quantization=quantization, kernels="torch")
    draft = tiny_model(scheme, seed=5, n_layers=1, quantization=quantization, kernels="torch")
    prompt = torch.randint(0, 61, (1, 6))
    plain = model.generate(prompt, max_new_tokens=30)
    out = model.generate(prompt, max_new_tokens=30, assistant_model=draft, num_assistant_tokens=3,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.stats["proposed_tokens"] > 0
    # the model as its own draft: every draft token is accepted, k + 1 tokens per verification
    same = model.generate(prompt, max_new_tokens=30, assistant_model=model, num_assistant_tokens=4,
                          return_dict_in_generate=True)
    assert torch.equal(same.sequences, plain)
    assert same.stats["accepted_tokens"] == same.stats["proposed_tokens"] == 4 * 5 + 3  # last step: room for 3
    assert same.stats["forward_passes"] == 1 + 6


@torch.no_grad()
def test_speculative_batch_equals_plain_batch():
    model = tiny_model("alibi")
    ids = torch.randint(0, 61, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=16)
    lookup = model.generate(ids, attention_mask=mask, max_new_tokens=16, prompt_lookup_num_tokens=3,
                            max_matching_ngram_size=1)
    drafted = model.generate(ids, attention_mask=mask, max_new_tokens=16, assistant_model=model)
    assert torch.equal(lookup, plain) and torch.equal(drafted, plain)


def exact_distribution(model, prompt, n, vocab, **filters):
    """P(t1..tn | prompt) for every sequence, by enumeration, from the sampler's own filters."""
    from llm.generation import GenerationConfig, Sampler

    sampler = Sampler(GenerationConfig(do_sample=True, **filters))
    probs = {}
    for seq in itertools.product(range(vocab), repeat=n):
        ids = torch.cat([prompt, torch.tensor([seq[:-1]], dtype=torch.long)], dim=1)
        p = 1.0
        for i, t in enumerate(seq):
            dist = sampler.probs(model(ids[:, : prompt.shape[1] + i]).logits[:, -1])[0]
            p *= float(dist[t])
        probs[seq] = p
    return probs


def chi_square(samples, probs):
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    return sum((counts.get(s, 0) - n * p) ** 2 / (n * p) for s, p in probs.items() if n * p >= 5)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["draft", "lookup"])
def test_speculative_sampling_gives_exactly_the_models_distribution(mode):
    vocab, n_new, n_samples = 4, 3, 1200
    model = tiny_model("alibi", vocab_size=vocab, seed=1, init_std=0.5)
    draft = tiny_model("alibi", vocab_size=vocab, seed=2, init_std=0.5, n_layers=1)
    prompt = torch.tensor([[1, 3, 0, 2]])
    filters = dict(temperature=0.9, top_k=3)
    probs = exact_distribution(model, prompt, n_new, vocab, **filters)
    extra = (dict(assistant_model=draft, num_assistant_tokens=2) if mode == "draft" else
             dict(prompt_lookup_num_tokens=2, max_matching_ngram_size=1,
                  reference_ids=[torch.tensor([0, 1, 2, 3, 3, 2, 1, 0, 2, 0, 3, 1])]))
    samples, accepted = [], 0
    for seed in range(n_samples):
        out = model.generate(prompt, max_new_tokens=n_new, do_sample=True, seed=seed, return_dict_in_generate=True,
                             **filters, **extra)
        samples.append(tuple(out.sequences[0, 4:].tolist()))
        accepted += out.stats["accepted_tokens"]
    assert accepted > n_samples // 20  # drafts were accepted: the acceptance rule was exercised
    cells = sum(1 for p in probs.values() if n_samples * p >= 5)
    # chi-square with `cells - 1` degrees of freedom: mean dof, sd sqrt(2 dof); 5 sd is far out
    bound = cells - 1 + 5 * (2 * (cells - 1)) ** 0.5
    assert chi_square(samples, probs) < bound
    # the draft's own distribution is far from the model's: the test can tell them apart
    if mode == "draft":
        wrong = exact_distribution(draft, prompt, n_new, vocab, **filters)
        wrong_samples = [s for s, p in wrong.items() for _ in range(round(p * n_samples))]
        assert chi_square(wrong_samples, probs) > 3 * bound


@torch.no_grad()
@pytest.mark.parametrize("mode", ["lookup", "draft"])
def test_stopping_inside_an_accepted_draft_leaves_a_cache_to_continue_from(mode):
    model = tiny_model("rope")
    prompt = torch.randint(0, 61, (1, 8))
    answer = model.generate(prompt, max_new_tokens=30)[0, 8:]
    eos = int(answer[6])  # drafts are right (the answer itself, or the model as its own draft): eos lands inside one
    extra = (dict(prompt_lookup_num_tokens=8, reference_ids=[answer]) if mode == "lookup" else
             dict(assistant_model=model, num_assistant_tokens=8))
    out = model.generate(prompt, max_new_tokens=30, eos_token_id=eos, num_assistant_tokens_schedule="constant",
                         return_dict_in_generate=True, **extra)
    assert torch.equal(out.sequences, model.generate(prompt, max_new_tokens=30, eos_token_id=eos))
    assert out.stats["accepted_tokens"] > 0
    # the cache holds all but the last token, so a later call continues from it
    assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1
    more = model.generate(out.sequences, max_new_tokens=5, past_key_values=out.past_key_values)
    assert torch.equal(more, model.generate(out.sequences, max_new_tokens=5))


@torch.no_grad()
def test_batch_statistics_count_real_tokens_in_every_mode():
    model = tiny_model("alibi")
    ids = torch.randint(0, 61, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    eos = int(model.generate(ids[:1], max_new_tokens=3)[0, -1])  # row 0 stops after 3 tokens
    runs = [model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, return_dict_in_generate=True,
                           **extra) for extra in ({}, dict(prompt_lookup_num_tokens=2, max_matching_ngram_size=1))]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    real_new = int((runs[0].sequences[:, 6:] != eos).sum()) + int((runs[0].sequences[:, 6:] == eos).any(1).sum())
    for out in runs:
        assert out.stats["prefill_tokens"] == 6 + 2
        assert out.stats["new_tokens"] == real_new


def test_speculative_errors_name_the_problem():
    model = tiny_model("learned")
    prompt = torch.randint(0, 61, (2, 5))
    with pytest.raises(ValueError, match="streaming speculative decoding needs a batch of one prompt"):
        list(model.stream(prompt, max_new_tokens=3, prompt_lookup_num_tokens=2))
    short = tiny_model("learned", seed=3, max_seq_len=12)
    with pytest.raises(ValueError, match=r"assistant_model has learned positions up to max_seq_len=12.*needs 14"):
        model.generate(prompt[:1], max_new_tokens=10, assistant_model=short)
