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
from llm.data.tokenizer import build_char_tokenizer
from llm.generation import compiled, decoding
from llm.kernels import cpu_quant
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("cpu_kernels")

_MODELS: dict = {}


def model_for(quantization: str, kv_n_heads: int, learned: bool = False, tied: bool = False):
    """A small Llama (head_dim 16, 4 query heads) on our kernels, made once per test session;
    ``learned``: with learned positions instead of rotary ones; ``tied``: the output layer shares
    the token embedding (an int8 embedding, as a GGUF file's), else a float embedding."""
    key = (quantization, kv_n_heads, learned, tied)
    if key not in _MODELS:
        positions = dict(learned_pos_emb=True, rope=False) if learned else {}
        _MODELS[key] = tiny_model("llama", d_model=64, n_heads=4, kv_n_heads=kv_n_heads, vocab_size=97,
                                  max_seq_len=256, quantization=quantization, kernels="llm", seed=kv_n_heads,
                                  tie_word_embeddings=tied, **positions)
    return _MODELS[key]


models = st.tuples(st.sampled_from(["int4", "int8", "q8_0", "q4_0"]), st.sampled_from([1, 2, 4]))
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids (n_i,) as one left-padded batch: (ids (rows, longest), mask (rows, longest) bool)."""
    width = max(len(ids) for ids in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, ids in enumerate(rows):
        batch[r, width - len(ids):] = ids
        mask[r, width - len(ids):] = True
    return batch, mask


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
    batch, mask = left_padded(rows)
    width = batch.shape[1]
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


@torch.no_grad()
@SETTINGS
@given(models, st.booleans(), st.lists(st.integers(1, 30), min_size=1, max_size=4), st.integers(1, 40),
       st.lists(st.integers(0, 3), max_size=4), st.booleans(), st.randoms(use_true_random=False))
def test_decoding_steps_give_the_forwards_logits(spec, learned, lengths, steps, crops, expect, rnd):
    """model.decoding_steps (the thin one-token step generate takes) == forward, bit for bit, on
    left-padded batches, over a cache that grows (or was sized up front) and is cropped between
    steps (a rejected draft), as speculative decoding does; rotary or learned positions."""
    model = model_for(*spec, learned=learned)
    rows = [torch.tensor([rnd.randrange(97) for _ in range(n)]) for n in lengths]
    batch, mask = left_padded(rows)
    width = batch.shape[1]
    padded = not bool(mask.all())
    caches = [DynamicCache().expect(width + steps) if expect else DynamicCache(), DynamicCache()]
    for cache in caches:
        model(batch, attention_mask=mask if padded else None, past_key_values=cache)
    fast = model.decoding_steps(caches[0])
    for i in range(steps):
        if i and i - 1 < len(crops) and crops[i - 1] and mask.shape[1] - crops[i - 1] >= width:
            keep = mask.shape[1] - crops[i - 1]
            mask = mask[:, :keep]
            for cache in caches:
                cache.crop(keep)
        nxt = torch.tensor([[rnd.randrange(97)] for _ in rows])
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.bool)], 1)
        got = fast(nxt, mask if padded else None)
        want = model(nxt, attention_mask=mask if padded else None, past_key_values=caches[1]).logits[:, -1]
        assert torch.equal(got, want)
        assert caches[0].get_seq_length() == caches[1].get_seq_length() == mask.shape[1]


@torch.no_grad()
def test_decoding_steps_run_forward_where_the_fused_blocks_do_not():
    """Other models (ALiBi, LayerNorm blocks), a new position that is padding, and forward's errors
    (a learned position past max_seq_len) are forward's own."""
    alibi = tiny_model("alibi", quantization="int8", kernels="llm")
    learned = tiny_model("learned", max_seq_len=8)
    for model in (alibi, learned):
        cache = DynamicCache()
        model(torch.tensor([[1, 2, 3]]), past_key_values=cache)
        steps = model.decoding_steps(cache)
        reference = DynamicCache()
        model(torch.tensor([[1, 2, 3]]), past_key_values=reference)
        for token in (4, 5):
            assert torch.equal(steps(torch.tensor([[token]])),
                               model(torch.tensor([[token]]), past_key_values=reference).logits[:, -1])
    for _ in range(3):
        steps(torch.tensor([[6]]))
    with pytest.raises(ValueError, match="max_seq_len"):
        steps(torch.tensor([[7]]))
    llama = model_for("int4", 2)
    cache, reference = DynamicCache(), DynamicCache()
    for c in (cache, reference):
        llama(torch.tensor([[1, 2, 3]]), past_key_values=c)
    mask = torch.tensor([[True, True, True, False]])
    got = llama.decoding_steps(cache)(torch.tensor([[4]]), mask)
    assert torch.equal(got, llama(torch.tensor([[4]]), attention_mask=mask, past_key_values=reference).logits[:, -1])


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 300), st.sampled_from([0.0, 0.05, 0.5]), st.sampled_from([0.0, 0.05]),
       st.randoms(use_true_random=False))
def test_argmax_rows_is_torchs_argmax(rows, n, infinite, nan, rnd):
    """The first of equal largest values, the first NaN, -inf and +inf rows: torch.argmax's index."""
    x = torch.tensor([[float(rnd.randrange(-3, 3)) for _ in range(n)] for _ in range(rows)])
    for value, share in ((float("-inf"), infinite), (float("inf"), infinite / 5), (float("nan"), nan)):
        x[torch.tensor([[rnd.random() < share for _ in range(n)] for _ in range(rows)])] = value
    assert torch.equal(cpu_quant.argmax_rows(x), x.argmax(-1))
    assert torch.equal(torch.ops.llm.argmax_rows(x), x.argmax(-1))


@torch.no_grad()
def test_decoding_steps_follow_a_changed_mask_and_refuse_what_forward_refuses():
    """A mask whose earlier columns change between steps (or that appears) is taken as forward
    takes it; bad ids and a batch that does not fit the cache raise forward's ValueErrors."""
    model = model_for("int4", 2)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    cache, reference = DynamicCache(), DynamicCache()
    for c in (cache, reference):
        model(ids, past_key_values=c)
    steps = model.decoding_steps(cache)
    nxt = torch.tensor([[5], [7]])
    assert torch.equal(steps(nxt), model(nxt, past_key_values=reference).logits[:, -1])
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, :2] = False  # row 1's first two positions are now padding
    assert torch.equal(steps(nxt, mask), model(nxt, attention_mask=mask, past_key_values=reference).logits[:, -1])
    for bad in (torch.tensor([[97], [1]]), torch.tensor([[-1], [1]])):
        with pytest.raises(ValueError, match="vocabulary"):
            steps(bad)
    with pytest.raises(ValueError, match="batch size"):
        steps(torch.tensor([[1]]))


def test_sample_row_takes_an_infinite_logit():
    """The largest logit infinite, or overflowing at the temperature: that token, as argmax."""
    assert torch.ops.llm.sample_row(torch.tensor([0.0, 1.0, float("inf"), 1.0]), 1.0, 0, 1.0, 0.0, 0.3) == 2
    assert torch.ops.llm.sample_row(torch.tensor([0.0, 3e38, 1.0]), 0.5, 0, 0.9, 0.0, 0.7) == 1


def one_step_at_a_time(model, prompt: torch.Tensor, **options):
    """generate as it runs and with one Python decoding step per token (no whole-steps call), from
    the same seed: (its output, the other's, the tokens each decode_tokens call of the first
    returned); the generator's states after the two are checked to be the same."""
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        real = cpu_quant.decode_tokens

        def counted(*args, **kwargs):
            new = real(*args, **kwargs)
            calls.append(len(new))
            return new

        patch.setattr(cpu_quant, "decode_tokens", counted)
        torch.manual_seed(options.pop("seed", 0))
        fast = model.generate(prompt, return_dict_in_generate=True, **options)
        fast_state = torch.get_rng_state()
        patch.setattr(decoding.Decoding, "_whole_steps", lambda self, last: None)
        torch.manual_seed(0)
        slow = model.generate(prompt, return_dict_in_generate=True, **options)
        assert torch.equal(fast_state, torch.get_rng_state())
    return fast, slow, calls


@torch.no_grad()
@SETTINGS
@given(models, st.booleans(), st.integers(1, 20), st.integers(1, 40),
       st.sampled_from([None, (1.0, None, None, None), (0.7, 5, 0.9, None), (1.3, None, 0.8, 0.05)]),
       st.booleans(), st.randoms(use_true_random=False))
def test_whole_steps_decode_what_one_step_at_a_time_decodes(spec, tied, length, max_new, sampling, eos, rnd):
    """generate's chunks of decoding steps in one kernel call (FusedSteps.tokens) give the tokens,
    the cache (contents and length) and the random generator's state that one Python step a token
    gives, greedy and drawn, stopping at an eos id or at max_new_tokens."""
    model = model_for(*spec, tied=tied)
    prompt = torch.tensor([[rnd.randrange(97) for _ in range(length)]])
    options = dict(max_new_tokens=max_new, do_sample=sampling is not None, eos_token_id=None)
    if sampling is not None:
        options.update(temperature=sampling[0], top_k=sampling[1], top_p=sampling[2], min_p=sampling[3])
    if eos:  # a token the free run emits, so that decoding stops there
        free = model.generate(prompt, **options, seed=0)[0, length:] if sampling else model.generate(prompt, **options)[0, length:]
        options["eos_token_id"] = int(free[rnd.randrange(len(free))])
    fast, slow, calls = one_step_at_a_time(model, prompt, **options)
    assert torch.equal(fast.sequences, slow.sequences)
    assert fast.stats["forward_passes"] == slow.stats["forward_passes"]
    assert sum(calls) == fast.sequences.shape[1] - length - 1  # every token but the prefill's
    assert fast.past_key_values.get_seq_length() == slow.past_key_values.get_seq_length()
    for (k1, v1), (k2, v2) in zip(fast.past_key_values.to_legacy(), slow.past_key_values.to_legacy()):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@torch.no_grad()
def test_whole_steps_stop_inside_a_chunk_at_a_stop_string_with_the_cache_of_the_tokens_emitted():
    tokenizer = build_char_tokenizer("abcdefgh ")
    model = tiny_model("llama", d_model=64, n_heads=4, kv_n_heads=2, vocab_size=len(tokenizer), max_seq_len=256,
                       quantization="int8", kernels="llm", seed=5)
    prompt = tokenizer("abc", return_tensors="pt").input_ids
    free = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None)[0, 3:].tolist()
    inside = 0
    for start in range(2, 30, 3):
        stop = tokenizer.decode(free[start:start + 2])
        fast, slow, calls = one_step_at_a_time(model, prompt, max_new_tokens=40, do_sample=False, eos_token_id=None,
                                               stop_strings=[stop], tokenizer=tokenizer)
        new = fast.sequences.shape[1] - 3
        assert calls and tokenizer.decode(fast.sequences[0, 3:]).endswith(stop) and new <= start + 2
        assert torch.equal(fast.sequences, slow.sequences)
        assert fast.stats["forward_passes"] == slow.stats["forward_passes"]
        assert fast.past_key_values.get_seq_length() == slow.past_key_values.get_seq_length() == 3 + new - 1
        inside += new not in (5, 13, 29)  # the ends of the chunks (the prefill's token, then 4, 8, 16)
    assert inside


@torch.no_grad()
def test_whole_steps_leave_to_one_step_at_a_time_what_they_do_not_run():
    """A batch, left padding, the repetition penalty, speculative decoding, a model off the fused
    kernel, and forward hooks on the embedding or the output layer (their own or global ones, which
    the kernel would skip) decode one step at a time, as before."""
    model = model_for("int4", 2)
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, :2] = False
    runs = [dict(input_ids=prompt), dict(input_ids=prompt[:1], attention_mask=mask[:1]),
            dict(input_ids=prompt[:1], repetition_penalty=1.3), dict(input_ids=prompt[:1], prompt_lookup_num_tokens=3)]
    for run in runs:
        ids = run.pop("input_ids")
        fast, slow, calls = one_step_at_a_time(model, ids, max_new_tokens=9, do_sample=False, **run)
        assert not calls and torch.equal(fast.sequences, slow.sequences)
    _, _, calls = one_step_at_a_time(tiny_model("alibi", quantization="int8", kernels="llm"), prompt[:1] % 61,
                                     max_new_tokens=9, do_sample=False)
    assert not calls
    free = model.generate(prompt[:1], max_new_tokens=9, do_sample=False)[0, 5:]

    def ban(module, args, output):  # a logits processor as a hook: the free run's second token never comes
        output[..., free[1]] = float("-inf")
        return output

    def count(module, args, output):
        counted.append(1)

    for module, hook, where in ((model.lm_head, ban, "own"), (model.wte, count, "own"), (model.lm_head, ban, "global")):
        counted = []
        if where == "own":
            handle = module.register_forward_hook(hook)
        else:
            handle = torch.nn.modules.module.register_module_forward_hook(
                lambda m, a, o: ban(m, a, o) if m is model.lm_head else o)
        try:
            fast, slow, calls = one_step_at_a_time(model, prompt[:1], max_new_tokens=9, do_sample=False)
        finally:
            handle.remove()
        assert not calls and torch.equal(fast.sequences, slow.sequences)
        assert hook is count or int(free[1]) not in fast.sequences[0, 5:].tolist()
        assert hook is ban or len(counted) == 2 * 9  # a lookup a token, in each of the two runs


@torch.no_grad()
def test_a_whole_steps_call_that_fails_part_way_leaves_the_next_step_exact():
    """An error after the kernel wrote some positions (their keys, their key mask columns) leaves
    the cache's length where it was, and the next step sets its mask up again: forward's logits."""
    model = model_for("q8_0", 2)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    cache, reference = DynamicCache(), DynamicCache()
    for c in (cache, reference):
        model(prompt, past_key_values=c)
    steps = model.decoding_steps(cache)
    new = steps.tokens(9, 2, ())  # the kernel runs here: 9 and new[0] fed
    model(torch.tensor([[9, int(new[0])]]), past_key_values=reference)
    with pytest.MonkeyPatch.context() as patch:
        real = cpu_quant.decode_tokens

        def fails(*args, **kwargs):
            real(*args, **kwargs)
            raise RuntimeError("part way")

        patch.setattr(cpu_quant, "decode_tokens", fails)
        with pytest.raises(RuntimeError, match="part way"):
            steps.tokens(7, 5, ())
    assert cache.get_seq_length() == 7
    got = steps(torch.tensor([[8]]))
    assert torch.equal(got, model(torch.tensor([[8]]), past_key_values=reference).logits[:, -1])
