"""generate(..., compile=True): the static-cache steps of llm.generation.compiled give the eager
tokens in every position scheme and weight mode, compile once and serve every position, prompt
length and call without recompiling, and fall back to eager with one warning when compiling fails."""

import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from llm import DynamicCache
from llm.generation import compiled
from tests.conftest import POSITION_SCHEMES, QUANTIZATIONS, tiny_model


@pytest.fixture
def counter(monkeypatch):
    """Compile through dynamo into eager kernels (fast, the graphs are the same) and count the
    graphs compiled; dynamo's caches are reset around the test."""
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("eager")
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", backend)
    yield backend
    torch._dynamo.reset()


def left_padded(batch=3, length=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 61, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, : 2 * row] = 0
    return ids, mask


@torch.no_grad()
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("scheme", list(POSITION_SCHEMES))
def test_compiled_greedy_and_sampled_tokens_equal_eager(scheme, quantization, counter):
    model = tiny_model(scheme, quantization=quantization, kernels="torch")
    ids, mask = left_padded()
    # a prompt longer than one prefill chunk, so that prefill runs twice with a padded last chunk
    long_ids = torch.randint(0, 61, (1, compiled.PREFILL_CHUNK + 5))
    for prompt, prompt_mask in ((ids, mask), (long_ids, None)):
        eager = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=20, do_sample=False)
        fast = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=20, do_sample=False, compile=True)
        assert torch.equal(fast, eager)
    sampled = dict(do_sample=True, temperature=0.9, top_k=20, seed=3, max_new_tokens=15)
    assert torch.equal(model.generate(ids, attention_mask=mask, compile=True, **sampled),
                       model.generate(ids, attention_mask=mask, **sampled))
    assert counter.frame_count > 0


@torch.no_grad()
@pytest.mark.parametrize("scheme", ["learned", "llama"])
def test_compiled_logits_equal_the_uncached_forward(scheme, counter):
    model = tiny_model(scheme)
    ids, mask = left_padded()
    # the static decoder's prefill and steps against forward() on the whole sequence
    sequences = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
    full_mask = torch.cat([mask, torch.ones(3, 9, dtype=mask.dtype)], dim=1)
    reference = model(sequences[:, :-1], attention_mask=full_mask[:, :-1]).logits
    decoder = compiled.StaticDecoder(model, full_mask.bool(), sequences.shape[1] + 8, None, compile=True)
    last = torch.full((3,), ids.shape[1] - 1)
    first = decoder.prefill(ids, full_mask.bool(), last)
    torch.testing.assert_close(first, reference[:, ids.shape[1] - 1], atol=1e-5, rtol=1e-5)
    for step in range(ids.shape[1], sequences.shape[1] - 1):
        logits = decoder.forward(sequences[:, step:step + 1])
        torch.testing.assert_close(logits[:, 0], reference[:, step], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_one_compile_serves_every_position_prompt_length_and_call(counter):
    model = tiny_model("llama")
    ids, mask = left_padded()
    model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, compile=True)
    after_first = counter.frame_count
    assert after_first == 2  # prefill and the one-token step, each once for 30 positions
    for length, new in ((4, 50), (40, 7), (17, 1), (11, 33)):
        prompt = torch.randint(0, 61, (3, length))
        eager = model.generate(prompt, max_new_tokens=new, do_sample=False)
        assert torch.equal(model.generate(prompt, max_new_tokens=new, do_sample=False, compile=True), eager)
    assert counter.frame_count == after_first
    # a cached prefix is copied into the static buffer: still no new graph, same tokens
    prefix = DynamicCache()
    model(ids[:1, :6], past_key_values=prefix)
    eager = model.generate(ids[:1], past_key_values=prefix.copy(), max_new_tokens=12, do_sample=False)
    fast = model.generate(ids[:1], past_key_values=prefix, max_new_tokens=12, do_sample=False, compile=True)
    assert torch.equal(fast, eager) and prefix.get_seq_length() == 6  # the given cache is not written
    # another batch size is another prefill and step, made once (by the prefix call above)
    model.generate(ids[:1], max_new_tokens=5, do_sample=False, compile=True)
    model.generate(ids[:1, :3], max_new_tokens=9, do_sample=False, compile=True)
    assert counter.frame_count == after_first + 2


@torch.no_grad()
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_reference_and_draft_decoding_compiled_equal_plain_greedy(quantization, counter):
    model = tiny_model("llama", quantization=quantization, kernels="torch")
    draft = tiny_model("llama", seed=1, n_layers=1, quantization=quantization, kernels="torch")
    prompt = torch.randint(0, 61, (1, 8))
    plain = model.generate(prompt, max_new_tokens=40, do_sample=False)
    copied = model.generate(prompt, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=6,
                            reference_ids=[plain[0, 8:]], compile=True, return_dict_in_generate=True)
    assert torch.equal(copied.sequences, plain) and copied.stats["forward_passes"] < 20
    drafted = model.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=draft,
                             num_assistant_tokens=4, num_assistant_tokens_schedule="constant", compile=True)
    assert torch.equal(drafted, plain)
    frames = counter.frame_count
    model.generate(torch.randint(0, 61, (1, 13)), max_new_tokens=25, do_sample=False, assistant_model=draft,
                   num_assistant_tokens=4, num_assistant_tokens_schedule="constant", compile=True)
    assert counter.frame_count == frames  # every draft length verifies in one padded graph


@torch.no_grad()
def test_a_failing_compiler_warns_once_and_decodes_eagerly(monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("no C++ compiler")

    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", broken)
    monkeypatch.setattr(compiled, "_failure", None)
    model = tiny_model("rope")
    ids, mask = left_padded()
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    with pytest.warns(RuntimeWarning, match="torch.compile failed .no C\\+\\+ compiler.; decoding runs .* uncompiled.*needs a working C\\+\\+ compiler") as caught:
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                          compile=True), eager)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process, not at every call
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                          compile=True), eager)
    torch._dynamo.reset()


@torch.no_grad()
@pytest.mark.parametrize("quantization", [None, "int4"])  # int4 blocks and the int8 head
def test_inductor_compiles_the_steps_to_the_eager_tokens(tmp_path, monkeypatch, quantization):
    # the real backend (C++ kernels from inductor), on the smallest model
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    model = tiny_model("llama", n_layers=1, quantization=quantization, kernels="torch")
    ids, mask = left_padded(batch=2)
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback: it really compiled
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                          compile=True), eager)
    assert compiled._failure is None
    torch._dynamo.reset()
