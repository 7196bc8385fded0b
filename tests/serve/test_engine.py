"""The engine on real (tiny) models: every request's tokens equal the same request run alone
through ``generate``, in every position scheme and weight mode, greedy and seeded sampling,
with prefix caching, stop strings, repetition penalty, reference decoding and compiled steps."""

import random
import string

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from llm import GenerationConfig
from llm.data import build_char_tokenizer
from llm.generation import compiled
from llm.generation.compiled import cache_capacity
from llm.serve import Engine
from llm.serve.batch import SlotBatch
from tests.conftest import POSITION_SCHEMES, QUANTIZATIONS, tiny_model


def alone(model, prompt, options, tokenizer=None):
    out = model.generate(torch.tensor([prompt]), generation_config=options, tokenizer=tokenizer)
    return out[0, len(prompt):].tolist()


def requests(count, seed=0, vocab=61, longest=40, **extra):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, longest))]
        sampled = i % 2 == 1
        options = GenerationConfig(max_new_tokens=rng.randrange(1, 25), do_sample=sampled,
                                   temperature=0.9 if sampled else 1.0, top_k=20 if sampled else None,
                                   seed=i, eos_token_id=7, **extra)
        out.append((prompt, options))
    return out


def drive(engine, reqs, join_every=3):
    """Submit the requests a few at a time, stepping in between: rows join a running batch."""
    sequences = []
    for start in range(0, len(reqs), 4):
        sequences += engine.submit(reqs[start:start + 4])
        for _ in range(join_every):
            engine.step()
    while engine.step():
        pass
    return sequences


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("scheme", POSITION_SCHEMES)
def test_every_request_decodes_as_it_would_alone(scheme, quantization):
    model = tiny_model(scheme, quantization=quantization)
    reqs = requests(12, seed=len(scheme))
    sequences = drive(Engine(model, max_batch_size=4), reqs)
    for (prompt, options), sequence in zip(reqs, sequences):
        assert sequence.tokens == alone(model, prompt, options), (prompt, options)


def test_shared_prefixes_come_from_the_prefix_cache_and_change_nothing():
    model = tiny_model("llama")
    system = list(range(1, 30))
    reqs = [(system + tail, GenerationConfig(max_new_tokens=6)) for tail in ([3], [4, 5], [6, 7, 8], [3, 9])]
    engine = Engine(model, max_batch_size=2, prefix_cache_tokens=500)
    sequences = drive(engine, reqs)
    assert [s.cached_tokens for s in sequences] == [0, 29, 29, 30]
    for (prompt, options), sequence in zip(reqs, sequences):
        assert sequence.tokens == alone(model, prompt, options)


def test_stop_strings_and_repetition_penalty_per_row():
    tokenizer = build_char_tokenizer(string.ascii_lowercase + " .")
    model = tiny_model("rope", vocab_size=len(tokenizer))
    base = GenerationConfig(max_new_tokens=30)
    text = tokenizer.decode(alone(model, tokenizer("the cat").input_ids, base))
    stop = text[5:7]
    reqs = [(tokenizer(p).input_ids, o) for p, o in (
        ("the cat", base.update(stop_strings=stop)),
        ("a dog", base.update(repetition_penalty=1.5)),
        ("the cat", base),
    )]
    engine = Engine(model, tokenizer, max_batch_size=4)
    sequences = drive(engine, reqs)
    assert sequences[0].finish_reason == "stop" and len(sequences[0].tokens) < 30
    for (prompt, options), sequence in zip(reqs, sequences):
        assert sequence.tokens == alone(model, prompt, options, tokenizer)


@pytest.mark.parametrize("scheme", POSITION_SCHEMES)
def test_speculating_rows_decode_in_the_batch_as_they_would_alone(scheme):
    # drafts copied from the prompt, verified in the batch's steps beside plain rows: greedy and
    # seeded sampling give the tokens of decoding without drafts (a float model: a verification
    # forward of several tokens may round otherwise than one token at a time only at near-ties)
    model = tiny_model(scheme)
    copy = list(range(5, 25)) * 2
    reqs = [(copy, GenerationConfig(max_new_tokens=20, prompt_lookup_num_tokens=4)),
            (copy[:7], GenerationConfig(max_new_tokens=15)),
            ([1, 2, 3], GenerationConfig(max_new_tokens=12, prompt_lookup_num_tokens=2)),
            (copy[3:], GenerationConfig(max_new_tokens=18, prompt_lookup_num_tokens=3, do_sample=True, seed=4,
                                        top_k=5)),
            (copy, GenerationConfig(max_new_tokens=9, prompt_lookup_num_tokens=6, eos_token_id=7))]
    sequences = drive(Engine(model, max_batch_size=3), reqs, join_every=2)
    for (prompt, options), sequence in zip(reqs, sequences):
        assert sequence.tokens == alone(model, prompt, options.update(prompt_lookup_num_tokens=None))
    assert sequences[0].accepted_tokens > 0  # a copy of the prompt: drafts were verified and taken
    assert all(s.draft_tokens == 0 for s in sequences[1::4])


def test_rejected_drafts_are_left_behind_when_the_buffer_grows():
    # each step a speculating row takes 1 + draft columns; those of rejected drafts are dropped at
    # the next re-layout, so the buffer grows with the tokens kept, not with the drafts fed
    model = tiny_model("llama", max_seq_len=512)
    prompt = list(range(5, 25)) * 2
    options = GenerationConfig(max_new_tokens=300, prompt_lookup_num_tokens=8, do_sample=False)
    engine = Engine(model, max_batch_size=2, prefix_cache_tokens=0)
    [sequence] = engine.submit([(prompt, options)])
    widest = 0
    while engine.step():
        widest = max(widest, engine.batch.capacity)
    assert sequence.tokens == alone(model, prompt, options.update(prompt_lookup_num_tokens=None))
    assert sequence.draft_tokens - sequence.accepted_tokens > 1000  # far more columns fed than kept
    assert widest <= 2 * cache_capacity(len(prompt) + 300)


def test_speculating_rows_keep_their_tokens_when_a_growing_buffer_moves_them_to_other_slots():
    # short rows leave the front slots; a re-layout for a wide step moves the others forward
    model = tiny_model("llama", max_seq_len=512)
    reqs = [([3, 4, 5], GenerationConfig(max_new_tokens=3, do_sample=False)),
            ([6, 7], GenerationConfig(max_new_tokens=2, do_sample=False)),
            (list(range(5, 25)) * 2, GenerationConfig(max_new_tokens=120, prompt_lookup_num_tokens=8, do_sample=False)),
            ([9, 9, 9], GenerationConfig(max_new_tokens=60, prompt_lookup_num_tokens=3, do_sample=False))]
    sequences = drive(Engine(model, max_batch_size=4, prefix_cache_tokens=0), reqs)
    for (prompt, options), sequence in zip(reqs, sequences):
        assert sequence.tokens == alone(model, prompt, options.update(prompt_lookup_num_tokens=None))


def test_a_draft_model_drafts_for_rows_that_ask_and_their_tokens_are_the_models_alone():
    model = tiny_model("llama")
    draft = tiny_model("llama", n_layers=1, seed=3)
    twin = tiny_model("llama")  # the model itself as its draft: every draft is taken
    copy = list(range(5, 25)) * 2
    reqs = [(copy, GenerationConfig(max_new_tokens=16, num_assistant_tokens=4)),
            (copy[:9], GenerationConfig(max_new_tokens=12)),
            (copy[4:], GenerationConfig(max_new_tokens=14, num_assistant_tokens=3, do_sample=True, seed=2, top_k=8))]
    for drafter in (draft, twin):
        sequences = drive(Engine(model, max_batch_size=3, draft_model=drafter), reqs, join_every=2)
        for (prompt, options), sequence in zip(reqs, sequences):
            assert sequence.tokens == alone(model, prompt, options.update(num_assistant_tokens=None))
        assert sequences[0].draft_tokens > 0 and sequences[1].draft_tokens == 0
    assert sequences[0].accepted_tokens > 0
    with pytest.raises(ValueError, match="a draft must share the tokenizer"):
        Engine(model, draft_model=tiny_model("llama", vocab_size=50))


@pytest.fixture
def counter(monkeypatch):
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("eager")
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", backend)
    yield backend
    torch._dynamo.reset()


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_compiled_steps_decode_as_eager_generate_with_a_graph_per_batch_shape(counter, quantization):
    model = tiny_model("rope", quantization=quantization)
    reqs = requests(10, seed=3)
    engine = Engine(model, max_batch_size=4, compile=True)
    sequences = drive(engine, reqs)
    for (prompt, options), sequence in zip(reqs, sequences):
        assert sequence.tokens == alone(model, prompt, options)
    # prefill: one graph (batch 1, one capacity); the step: one per slot count (1, 2, 4) at most
    assert counter.frame_count <= 4
    again = drive(engine, requests(10, seed=4))
    assert counter.frame_count <= 4 and all(s.finish_reason in ("stop", "length") for s in again)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("quantization,kv_n_heads", [("int4", 1), ("int8", 2), ("int4", 4)])
def test_on_our_kernels_a_row_is_bit_identical_alone_or_in_any_batch(quantization, kv_n_heads, monkeypatch):
    # batch invariance: a greedy request's logprobs (the model's log-softmax) are the same bits
    # whatever joins or leaves the batch around it, whether its prompt came from the prefix cache
    # or not, in how many chunks it was prefilled, whether other prompts were prefilled in the same
    # forward, and whatever slot count and buffer layout the batch has when it decodes
    prefilled_together = []
    step_many = SlotBatch.step_many

    def spy(self, tokens_of, last_only=False):
        if last_only:
            prefilled_together.append(len(self))
        return step_many(self, tokens_of, last_only)

    monkeypatch.setattr(SlotBatch, "step_many", spy)
    model = tiny_model("llama", d_model=64, n_heads=4, kv_n_heads=kv_n_heads, vocab_size=97, max_seq_len=256,
                       quantization=quantization, kernels="llm", seed=kv_n_heads)
    rng = random.Random(kv_n_heads)
    shared = [rng.randrange(97) for _ in range(12)]  # a common system prompt: prefix-cache hits
    reqs = []
    for i in range(16):
        head = shared if i % 3 else []
        prompt = head + [rng.randrange(97) for _ in range(rng.randrange(1, 50))]
        if i % 5 == 4:  # an earlier prompt again: cached but for its last token, fed by a batch step
            prompt = reqs[i - 3][0]
        reqs.append((prompt, GenerationConfig(max_new_tokens=rng.randrange(4, 30), do_sample=False, eos_token_id=7)))

    def logprobs(sequences):
        return [(s.tokens, [lp for _, lp, _ in s.token_logprobs]) for s in sequences]

    alone_runs = []
    for prompt, options in reqs:
        engine = Engine(model, max_batch_size=1, prefix_cache_tokens=0)
        sequence = engine.submit([(prompt, options)], logprobs=2)
        while engine.step():
            pass
        alone_runs += logprobs(sequence)
    for join_every, prefix_tokens, chunk, lookup in ((1, 4096, 256, None), (3, 0, 7, 3), (5, 4096, 16, 5)):
        engine = Engine(model, max_batch_size=8, prefix_cache_tokens=prefix_tokens, prefill_chunk=chunk)
        # with lookup, every other row speculates: its drafts are verified in the batch's steps
        # (several tokens of a row in one forward, rejected ones masked in the buffer after)
        batch = [(p, o.update(prompt_lookup_num_tokens=lookup) if i % 2 == 0 else o) for i, (p, o) in enumerate(reqs)]
        sequences = []
        for start in range(0, len(batch), 3):
            sequences += engine.submit(batch[start:start + 3], logprobs=2)
            for _ in range(join_every):
                engine.step()
        while engine.step():
            pass
        assert logprobs(sequences) == alone_runs
        if prefix_tokens:
            assert any(s.cached_tokens == len(s.prompt) - 1 for s in sequences)
        if lookup:  # drafts were verified (accepted ones: the test above and test_invariance)
            assert sum(s.draft_tokens for s in sequences) > 0
    assert prefilled_together and max(prefilled_together) >= 3


def test_a_long_prompt_is_prefilled_in_chunks_while_the_batch_decodes():
    # chunked prefill: no step runs more than prefill_chunk prompt tokens, the running rows get a
    # token at every step while a long prompt arrives, and every answer is still the one alone
    model = tiny_model("llama", max_seq_len=256)
    short = ([5, 6, 7], GenerationConfig(max_new_tokens=40, do_sample=False))
    long = (list(range(1, 50)) * 3, GenerationConfig(max_new_tokens=5, do_sample=False))
    engine = Engine(model, max_batch_size=4, prefill_chunk=16)
    sizes = []
    original = model.forward

    def forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[0] == 1:
            sizes.append(ids.shape[1])
        return original(*args, **kwargs)

    model.forward = forward
    try:
        first = engine.submit([short])[0]
        engine.step()
        before = len(first.tokens)
        second = engine.submit([long])[0]
        steps = 0
        while not second.tokens:
            engine.step()
            steps += 1
        assert steps == -(-len(long[0]) // 16) and len(first.tokens) == before + steps
        while engine.step():
            pass
    finally:
        del model.forward
    assert max(sizes) <= 16
    for (prompt, options), sequence in ((short, first), (long, second)):
        assert sequence.tokens == alone(model, prompt, options)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(model, prefill_chunk=0)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_on_our_kernels_the_batch_buffer_needs_no_zeros(quantization, monkeypatch):
    # a batch re-laid out over buffers that are uninitialized memory (here: NaN wherever nothing
    # was written) decodes the same tokens: our kernels never read a masked position; a float
    # model, on torch's attention, keeps zeroed buffers
    from llm.model.buffer import masked_keys_unread
    from llm.serve import batch as batch_module

    shape = dict(d_model=64, n_heads=4, kv_n_heads=2, max_seq_len=256)  # head_dim 16: our attention takes it
    model = tiny_model("llama", **shape, quantization=quantization, kernels="llm")
    assert masked_keys_unread(model) and not masked_keys_unread(tiny_model("llama", **shape))
    made = []

    def nan_cache(*args, zeroed=True, **kwargs):
        cache = batch_module.StaticCache.__wrapped__(*args, zeroed=zeroed, **kwargs)
        made.append(zeroed)
        for storage in (*cache._keys, *cache._values):
            storage.fill_(0.0 if zeroed else float("nan"))
        return cache

    nan_cache.__wrapped__ = batch_module.StaticCache
    monkeypatch.setattr(batch_module, "StaticCache", nan_cache)
    reqs = requests(10, seed=5)
    sequences = drive(Engine(model, max_batch_size=4), reqs)
    assert made and not any(made)
    assert [s.tokens for s in sequences] == [alone(model, p, o) for p, o in reqs]
