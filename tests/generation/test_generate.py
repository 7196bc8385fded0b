"""generate: greedy and sampled decoding, stopping, streaming and prompt caches."""

import io
import string
from contextlib import redirect_stdout

import pytest
import torch
from transformers import TextStreamer

from llm import Cache, DynamicCache, StaticCache
from llm.data import build_char_tokenizer
from tests.conftest import tiny_model
from tests.test_seeds import greedy_without_cache


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(string.ascii_lowercase + " .\n")


@pytest.fixture(scope="module")
def char_model(tokenizer):
    return tiny_model("rope", vocab_size=len(tokenizer))


@torch.no_grad()
@pytest.mark.parametrize("scheme", ["learned", "alibi", "llama"])
def test_greedy_equals_the_uncached_loop(scheme):
    model = tiny_model(scheme)
    ids = torch.randint(0, 61, (2, 6))
    out = model.generate(ids, max_new_tokens=20)
    ref = greedy_without_cache(model, model.get_input_embeddings()(ids), 20)
    assert torch.equal(out[:, 6:], ref) and torch.equal(out[:, :6], ids)


@torch.no_grad()
def test_sampling_is_reproducible_with_a_seed_and_temperature_zero_is_greedy():
    model = tiny_model()
    ids = torch.randint(0, 61, (3, 5))
    kwargs = dict(max_new_tokens=15, do_sample=True, top_k=20, top_p=0.95, min_p=0.01, repetition_penalty=1.2)
    a = model.generate(ids, seed=7, **kwargs)
    assert torch.equal(a, model.generate(ids, seed=7, **kwargs))
    assert not torch.equal(a, model.generate(ids, seed=8, **kwargs))
    greedy = model.generate(ids, max_new_tokens=15)
    assert torch.equal(model.generate(ids, max_new_tokens=15, do_sample=True, temperature=0.0), greedy)
    assert torch.equal(model.generate(ids, max_new_tokens=15, do_sample=True, top_k=1, seed=3), greedy)


@torch.no_grad()
def test_rows_stop_on_their_own_eos_and_are_padded():
    model = tiny_model()
    ids = torch.randint(0, 61, (3, 5))
    free = model.generate(ids, max_new_tokens=12)[:, 5:]
    eos = [int(free[0, 2]), int(free[1, 6])]
    out = model.generate(ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=60)[:, 5:]
    for row in range(3):
        hits = [j for j in range(12) if int(free[row, j]) in eos]
        stop = hits[0] + 1 if hits else 12
        assert torch.equal(out[row, :stop], free[row, :stop])
        assert (out[row, stop:] == 60).all()
    # once every row has stopped, decoding ends
    alone = model.generate(ids[:1], max_new_tokens=12, eos_token_id=eos[0])
    first = [j for j in range(12) if int(free[0, j]) == eos[0]][0]
    assert alone.shape[1] == 5 + first + 1 and int(alone[0, -1]) == eos[0]


@torch.no_grad()
def test_stop_strings(char_model, tokenizer):
    ids = tokenizer("the cat", return_tensors="pt").input_ids
    free = tokenizer.decode(char_model.generate(ids, max_new_tokens=30)[0, ids.shape[1]:])
    stop = free[5:7]
    out = char_model.generate(ids, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer)
    text = tokenizer.decode(out[0, ids.shape[1]:])
    assert text.endswith(stop) and stop not in text[:-1] and free.startswith(text)
    with pytest.raises(ValueError, match="stop_strings needs tokenizer"):
        char_model.generate(ids, stop_strings=["x"])


@torch.no_grad()
def test_streamer_protocol_text_streamer_and_iterator(char_model, tokenizer):
    ids = tokenizer("a cat sat", return_tensors="pt").input_ids
    out = char_model.generate(ids, max_new_tokens=25)

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value)

        def end(self):
            self.ended = True

    rec = Recorder()
    char_model.generate(ids, max_new_tokens=25, streamer=rec)
    assert rec.ended and torch.equal(rec.puts[0], ids)
    assert torch.equal(torch.cat(rec.puts[1:]), out[0, ids.shape[1]:])
    assert len(rec.puts) == 26  # the prompt, then one put per new token

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        char_model.generate(ids, max_new_tokens=25, streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert buffer.getvalue().rstrip("\n") == tokenizer.decode(out[0, ids.shape[1]:]).rstrip("\n")

    chunks = list(char_model.stream(ids, max_new_tokens=25))
    assert len(chunks) == 25 and torch.equal(torch.cat(chunks, dim=1)[0], out[0, ids.shape[1]:])


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_prompt_cache_reused_and_from_a_file_gives_the_recomputed_output(tmp_path, kind):
    model = tiny_model("alibi")
    system = torch.randint(0, 61, (1, 12))
    cache = DynamicCache() if kind == "dynamic" else StaticCache(model.config, 1, 64)
    model(system, past_key_values=cache)
    cache.save(tmp_path / "system.cache")
    kwargs = dict(max_new_tokens=10, do_sample=True, seed=1, repetition_penalty=1.5)
    for request in (torch.randint(0, 61, (1, 4)), torch.randint(0, 61, (1, 7))):
        full = torch.cat([system, request], dim=1)
        fresh = model.generate(full, **kwargs)
        reused = model.generate(full, past_key_values=cache.copy(), **kwargs)
        loaded = model.generate(full, past_key_values=Cache.load(tmp_path / "system.cache"), **kwargs)
        assert torch.equal(reused, fresh) and torch.equal(loaded, fresh)
    assert cache.get_seq_length() == 12  # the shared prefix cache itself is untouched


@torch.no_grad()
def test_argument_errors():
    model = tiny_model(max_seq_len=20)
    ids = torch.randint(0, 61, (1, 8))
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        model.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"needs 20 positions, more than max_seq_len=20|needs 21 positions"):
        model.generate(ids, max_new_tokens=14)
    with pytest.raises(ValueError, match="max_cache_len=10"):
        model.generate(ids, max_new_tokens=5, past_key_values=StaticCache(model.config, 1, 10))
    with pytest.raises(ValueError, match="top_p must be in"):
        model.generate(ids, do_sample=True, top_p=2.0)
    cache = DynamicCache()
    model(ids, past_key_values=cache)
    with pytest.raises(ValueError, match="already holds 8 positions but the prompt has 8"):
        model.generate(ids, past_key_values=cache)
