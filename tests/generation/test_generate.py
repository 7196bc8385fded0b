"""generate: greedy and sampled decoding, stopping, streaming, prompt caches, padding on either side,
token ids outside the vocabulary, and no autograd at any entry point."""

import io
import string
import warnings
from contextlib import redirect_stdout

import pytest
import torch
from transformers import TextStreamer

import llm
from llm import Cache, DynamicCache, GenerationConfig, StaticCache
from llm.data import build_char_tokenizer, load_tokenizer, save_tokenizer, train_bpe_tokenizer
from tests.conftest import POSITION_SCHEMES, tiny_model
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
def test_decoding_past_a_rotary_models_context_warns_and_runs_on():
    from llm.generation.decoding import ContextLengthWarning

    model = tiny_model("rope", max_seq_len=16)
    ids = torch.randint(0, 61, (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(ids, max_new_tokens=9)  # position 16: still inside
    with pytest.warns(ContextLengthWarning, match="reaches position 17, past the model's context of max_seq_len=16"):
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert out.shape == (1, 18)


@torch.no_grad()
def test_a_model_with_nan_weights_is_refused_not_answered_with_nothing():
    from llm.serve import Engine

    model = tiny_model("rope")
    model.blocks[0].attn.Wqkv.weight[0, 0] = float("nan")
    ids = torch.randint(0, 61, (2, 5))
    for options in ({"do_sample": False}, {"do_sample": True, "seed": 0}):
        with pytest.raises(ValueError, match="the model's logits are NaN: its weights hold NaN or are corrupt"):
            model.generate(ids, max_new_tokens=4, **options)
    engine = Engine(model)
    (sequence,) = engine.submit([([1, 2, 3], GenerationConfig(max_new_tokens=3))])
    engine.step()
    assert sequence.finish_reason == "error" and "logits are NaN" in sequence.error


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
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\], got 2.0"):
        model.generate(ids, do_sample=True, top_p=2.0)
    cache = DynamicCache()
    model(ids, past_key_values=cache)
    with pytest.raises(ValueError, match="already holds 8 positions but the prompt has 8"):
        model.generate(ids, past_key_values=cache)


def padded(rows, sides, pad=0):
    """(ids, mask) of token lists padded to one width: side "left", "right" or "middle" (the row's
    padding between its first token and the rest)."""
    width = max(len(r) for r in rows) + 1  # every row gets at least one pad
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (row, side) in enumerate(zip(rows, sides)):
        n, gap = len(row), width - len(row)
        spots = {"left": range(gap, width), "right": range(n),
                 "middle": [0, *range(1 + gap, width)]}[side]
        ids[i, list(spots)] = torch.tensor(row)
        mask[i, list(spots)] = 1
    return ids, mask


@torch.no_grad()
@pytest.mark.parametrize("scheme", list(POSITION_SCHEMES))
def test_right_and_middle_padded_rows_decode_as_if_alone(scheme):
    """Tokenizers pad on the right by default; before, such a row continued from a pad position."""
    model = tiny_model(scheme)
    rows = [torch.randint(0, 61, (n,)).tolist() for n in (7, 3, 5, 2)]
    ids, mask = padded(rows, ["right", "right", "middle", "left"], pad=60)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10)
    streamed = torch.cat(list(llm.stream(model, ids, attention_mask=mask, max_new_tokens=10)), dim=1)
    for i, row in enumerate(rows):
        alone = model.generate(torch.tensor([row]), max_new_tokens=10)[0, len(row):]
        assert torch.equal(out[i, ids.shape[1]:], alone), i
        assert torch.equal(streamed[i], alone), i
    assert torch.equal(out[:, :ids.shape[1]], ids)  # the prompt comes back as it was given
    assert torch.equal(llm.generate(model, ids, attention_mask=mask, max_new_tokens=10, prompt_lookup_num_tokens=2),
                       out)  # speculative decoding drops each row's padding, wherever it stands
    # continuing from the output with the mask extended by ones is the same decoding, 5 more tokens
    more = model.generate(out, attention_mask=torch.cat([mask, torch.ones(4, 10, dtype=torch.long)], 1),
                          max_new_tokens=5)
    for i, row in enumerate(rows):
        alone = model.generate(torch.tensor([row]), max_new_tokens=15)[0, len(row):]
        assert torch.equal(more[i, ids.shape[1]:], alone), i


@torch.no_grad()
def test_right_padding_with_a_cached_prefix_and_rows_that_cannot_continue():
    model = tiny_model("llama")
    prefix, rows = torch.randint(0, 61, (1, 6)), [[5, 6, 7], [8]]
    request, request_mask = padded(rows, ["right", "right"])
    ids = torch.cat([prefix.expand(2, -1), request], dim=1)
    mask = torch.cat([torch.ones(2, 6, dtype=torch.long), request_mask], dim=1)
    cache = DynamicCache()
    model(prefix, past_key_values=cache)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache.copy().select([0, 0]), max_new_tokens=6)
    for i, row in enumerate(rows):
        alone = model.generate(torch.cat([prefix, torch.tensor([row])], 1), max_new_tokens=6)[0, 6 + len(row):]
        assert torch.equal(out[i, ids.shape[1]:], alone)
    with pytest.raises(ValueError, match="row 1 of attention_mask has no real token"):
        model.generate(ids[:, 6:], attention_mask=torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"row 1's last real token \(position 5\) is inside past_key_values, which "
                                         r"holds 6 positions"):
        model.generate(ids, attention_mask=torch.cat([mask[:, :6], torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]])], 1),
                       past_key_values=cache.copy().select([0, 0]))


def test_our_tokenizers_pad_on_the_left(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")  # a byte-level BPE vocabulary, no weights
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<|endoftext|>", "a", "b", "c", "\u0120"])
    writer.add_token_types([3, 1, 1, 1, 1])
    writer.add_token_merges([])
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    char = build_char_tokenizer("abc ")
    save_tokenizer(char, tmp_path / "bundle")
    built = [char, train_bpe_tokenizer("abc abd abe " * 20, 300)]
    loaded = [load_tokenizer(tmp_path / "bundle"), llm.load_tokenizer(tmp_path / "bundle"),
              llm.load_tokenizer(tmp_path / "tiny.gguf")]
    for tokenizer in built + loaded:
        assert tokenizer.padding_side == "left"
        short = tokenizer(["a", "a b c a b c"], padding=True).attention_mask[0]
        assert short[0] == 0 and short[-1] == 1
    char.padding_side = "right"
    save_tokenizer(char, tmp_path / "right")
    assert llm.load_tokenizer(tmp_path / "right").padding_side == "left"  # even from a folder that says right


@pytest.mark.parametrize("bad", [-1, 61, 1000])
def test_token_ids_outside_the_vocabulary_are_named(bad):
    """Before: an IndexError from the embedding (or a device-side assert on a GPU)."""
    model = tiny_model()
    ids = torch.tensor([[1, 2, bad, 3]])
    message = rf"input_ids holds token id {bad} \(at index \[0, 2\]\), outside the vocabulary of 61 tokens"
    for call in (lambda: model.generate(ids), lambda: list(llm.stream(model, ids)), lambda: model(ids),
                 lambda: llm.generate(model, ids, prompt_lookup_num_tokens=2)):
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(ValueError, match=rf"reference_ids\[0\] holds token id {bad}"):
        model.generate(ids[:, :2], prompt_lookup_num_tokens=2, reference_ids=[ids[0]])
    with pytest.raises(ValueError, match="input_ids must hold integer token ids, got dtype torch.float32"):
        model.generate(ids[:, :2].float())
    with pytest.raises(ValueError, match="pad_token_id is 61, outside the vocabulary of 61 tokens"):
        model.generate(ids[:, :2], pad_token_id=61)
    with pytest.raises(ValueError, match=r"pad_token_id \(by default the first eos_token_id\) is 70"):
        model.generate(ids[:, :2], eos_token_id=[70, 1])


def test_no_entry_point_records_autograd(monkeypatch):
    """Every forward that inference runs sees grad mode off: before, llm.generate and llm.stream
    recorded a graph (2x slower on SmolLM2) unless the caller turned it off."""
    model = tiny_model("llama")
    ids = torch.randint(0, 61, (2, 5))
    modes = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: modes.append(torch.is_grad_enabled()) if isinstance(module, llm.MosaicGPT) else None)
    try:
        assert torch.is_grad_enabled()
        calls = {
            "llm.generate": lambda: llm.generate(model, ids, max_new_tokens=3),
            "llm.stream": lambda: list(llm.stream(model, ids, max_new_tokens=3)),
            "MosaicGPT.generate": lambda: model.generate(ids, max_new_tokens=3),
            "MosaicGPT.stream": lambda: list(model.stream(ids, max_new_tokens=3)),
            "lookup": lambda: llm.generate(model, ids, max_new_tokens=3, prompt_lookup_num_tokens=2),
            "draft model": lambda: llm.generate(model, ids, max_new_tokens=3, assistant_model=tiny_model("llama")),
        }
        for name, call in calls.items():
            modes.clear()
            out = call()
            assert modes and not any(modes), name
            assert torch.is_grad_enabled(), name  # and the caller's mode is back
            tensors = out if isinstance(out, list) else [out]
            assert not any(t.requires_grad for t in tensors), name
    finally:
        hook.remove()
