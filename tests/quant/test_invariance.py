"""Exact by construction: on our kernels a token's logits depend only on the tokens before it, to
the bit: not on how many tokens share the call (prefill, one-token step, a speculative chunk), on
the batch's other rows, their padding or masked columns among a row's keys, on the cache (none,
dynamic, static) or on the threads. Checked as properties over random models (grouped heads; int4,
int8 per row, int8 in Q8_0's groups and Q4_0's symmetric int4), prompts, chunkings and batch mixes,
against the uncached forward of each row alone."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm.cache import DynamicCache, StaticCache
from llm.generation import compiled
from llm.kernels import cpu_quant
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("cpu_kernels")

_MODELS: dict = {}


def model_for(quantization: str, kv_n_heads: int):
    """A small Llama (head_dim 16, 4 query heads) on our kernels, made once per test session."""
    key = (quantization, kv_n_heads)
    if key not in _MODELS:
        _MODELS[key] = tiny_model("llama", d_model=64, n_heads=4, kv_n_heads=kv_n_heads, vocab_size=97,
                                  max_seq_len=256, quantization=quantization, kernels="llm", seed=kv_n_heads)
    return _MODELS[key]


models = st.tuples(st.sampled_from(["int4", "int8", "q8_0", "q4_0"]), st.sampled_from([1, 2, 4]))
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def alone(model, ids: torch.Tensor) -> torch.Tensor:
    """(n, vocab) logits of one row (n,) run alone and uncached."""
    return model(ids[None]).logits[0]


@torch.no_grad()
@SETTINGS
@given(models, st.integers(1, 70), st.lists(st.integers(1, 9), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_cached_logits_are_the_uncached_ones_whatever_the_chunks(spec, length, chunks, rnd):
    model = model_for(*spec)
    ids = torch.tensor([rnd.randrange(97) for _ in range(length)])
    reference = alone(model, ids)
    for cache in (DynamicCache(), StaticCache(model.config, 1, 128, dtype=torch.float32)):
        pieces, start, i = [], 0, 0
        while start < length:
            end = min(length, start + chunks[i % len(chunks)])
            pieces.append(model(ids[None, start:end], past_key_values=cache, use_cache=True).logits[0])
            start, i = end, i + 1
        assert torch.equal(torch.cat(pieces), reference)


@torch.no_grad()
@SETTINGS
@given(models, st.lists(st.integers(1, 40), min_size=1, max_size=5), st.randoms(use_true_random=False))
def test_a_row_in_a_left_padded_batch_is_the_row_alone(spec, lengths, rnd):
    model = model_for(*spec)
    rows = [torch.tensor([rnd.randrange(97) for _ in range(n)]) for n in lengths]
    width = max(lengths)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, ids in enumerate(rows):
        batch[r, width - len(ids):] = ids
        mask[r, width - len(ids):] = True
    logits = model(batch, attention_mask=mask).logits
    for r, ids in enumerate(rows):
        assert torch.equal(logits[r, width - len(ids):], alone(model, ids))
    # and one more token each, from the batch's cache
    cache = DynamicCache()
    model(batch, attention_mask=mask, past_key_values=cache)
    nxt = torch.tensor([[rnd.randrange(97)] for _ in rows])
    step = model(nxt, attention_mask=torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.bool)], 1),
                 past_key_values=cache).logits[:, 0]
    for r, ids in enumerate(rows):
        assert torch.equal(step[r], alone(model, torch.cat([ids, nxt[r]]))[-1])


@torch.no_grad()
@SETTINGS
@given(models, st.integers(2, 60), st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=8),
       st.integers(0, 30), st.randoms(use_true_random=False))
def test_masked_columns_among_a_rows_keys_change_no_bit(spec, length, plan, gap, rnd):
    # a server row speculating: each call feeds tokens and a draft, the rejected draft's columns are
    # masked after; and a prefix, padding, then a request (a batch of prompts behind one system prompt)
    model = model_for(*spec)
    ids = torch.tensor([rnd.randrange(97) for _ in range(length)])
    reference = alone(model, ids)
    cache = StaticCache(model.config, 1, 512, dtype=torch.float32)
    key_mask = torch.zeros(1, 512, dtype=torch.bool)
    got, column, done, i = [], 0, 0, 0
    while done < length:
        kept, rejected = plan[i % len(plan)]
        kept = min(kept, length - done)
        feed = torch.cat([ids[done:done + kept], torch.tensor([rnd.randrange(97) for _ in range(rejected)], dtype=torch.long)])
        key_mask[0, column:column + len(feed)] = True
        got.append(model.forward_static(feed[None], cache, torch.arange(column, column + len(feed)), key_mask)[0, :kept])
        key_mask[0, column + kept:column + len(feed)] = False
        column, done, i = column + len(feed), done + kept, i + 1
    assert torch.equal(torch.cat(got), reference)
    split = rnd.randrange(1, length)
    padded = torch.cat([ids[:split], torch.zeros(gap, dtype=torch.long), ids[split:]])
    mask = torch.cat([torch.ones(split, dtype=torch.bool), torch.zeros(gap, dtype=torch.bool),
                      torch.ones(length - split, dtype=torch.bool)])
    logits = model(padded[None], attention_mask=mask[None]).logits[0]
    assert torch.equal(logits[mask], reference)


@torch.no_grad()
@pytest.mark.parametrize("threads", [1, 2])
def test_threads_do_not_change_a_bit(threads):
    model = model_for("int4", 2)
    ids = torch.randint(0, 97, (3, 50), generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    reference = model(ids).logits
    try:
        torch.set_num_threads(threads)
        assert torch.equal(model(ids).logits, reference)
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def test_greedy_decoding_equals_the_uncached_argmax_on_every_path(monkeypatch):
    model = model_for("int4", 2)
    prompt = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    plain = model.generate(prompt, max_new_tokens=30, do_sample=False)
    logits = model(plain).logits[0, 11:-1]
    assert torch.equal(logits.argmax(-1), plain[0, 12:])
    # speculative: prompt lookup with the answer as reference, a draft model, and a static cache
    lookup = model.generate(prompt, max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=5,
                            reference_ids=[plain[0, 12:]])
    draft = model.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=model_for("int8", 2))
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    static = model.generate(prompt, max_new_tokens=30, do_sample=False, compile=True)
    torch._dynamo.reset()
    for out in (lookup, draft, static):
        assert torch.equal(out, plain)
