"""The three user stories in shared/seeds, adapted to our API: each gives the same tokens with and
without the cache, for every position scheme, in float and quantized weight modes."""

import pytest
import torch

from llm import StaticCache
from tests.conftest import POSITION_SCHEMES, QUANTIZATIONS, tiny_model

SCHEMES = list(POSITION_SCHEMES)


def greedy_without_cache(model, embeds, n):
    """The reference: a full forward over the whole sequence for every new token."""
    tokens = []
    for _ in range(n):
        token = model(inputs_embeds=embeds).logits[:, -1].argmax(-1)
        tokens.append(token)
        embeds = torch.cat([embeds, model.get_input_embeddings()(token)[:, None]], dim=1)
    return torch.stack(tokens, dim=1)


@torch.no_grad()
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_seed_000_iterative_generation_from_inputs_embeds_with_a_static_cache(scheme, quantization):
    model = tiny_model(scheme, quantization=quantization, kernels="torch")
    embed = model.get_input_embeddings()
    prompt_cache = StaticCache(model.config, batch_size=1, max_cache_len=96)

    initial = torch.randint(0, 61, (1, 7))
    inputs_embeds = embed(initial)
    outputs = model.generate(inputs_embeds=inputs_embeds, past_key_values=prompt_cache, max_new_tokens=12)
    assert torch.equal(outputs, greedy_without_cache(model, inputs_embeds, 12))

    for prompt in (torch.randint(0, 61, (1, 5)), torch.randint(0, 61, (1, 3))):
        new_input_ids = torch.cat([outputs, prompt], dim=1)
        inputs_embeds = torch.cat([inputs_embeds, embed(new_input_ids)], dim=1)  # aligned with the cache
        cached = prompt_cache.get_seq_length()
        outputs = model.generate(inputs_embeds=inputs_embeds, past_key_values=prompt_cache, max_new_tokens=12)
        # only the part the cache did not hold was run: it now holds everything but the last token
        assert prompt_cache.get_seq_length() == inputs_embeds.shape[1] + 11 > cached
        assert torch.equal(outputs, greedy_without_cache(model, inputs_embeds, 12))


def cut_pkv(pkv, length):
    """Return past_key_values cut to the first `length` tokens (the seed's own helper)."""
    return tuple((t1[:, :, :length, :], t2[:, :, :length, :]) for (t1, t2) in pkv)


@torch.no_grad()
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("impl", ["torch", "sdpa"])
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_seed_002_past_key_values_with_two_new_tokens_each_step(scheme, impl, quantization):
    model = tiny_model(scheme, impl, quantization=quantization, kernels="torch")
    prompt = torch.randint(0, 61, (1, 6))

    without = prompt
    for _ in range(16):
        predicted = model(without).logits[0][-1].argmax()
        without = torch.cat((without, predicted.view(1, 1)), dim=1)

    with_pkv, pkv = prompt, None
    for _ in range(16):
        if pkv is None:
            output = model(with_pkv, use_cache=True)  # our forward's default is use_cache=False
        else:
            pkv = cut_pkv(pkv, length=with_pkv[0].shape[-1] - 2)
            output = model(with_pkv[0:1, -2:], past_key_values=pkv, use_cache=True)
        predicted = output.logits[0][-1].argmax()
        with_pkv = torch.cat((with_pkv, predicted.view(1, 1)), dim=1)
        pkv = output.past_key_values
    assert torch.equal(with_pkv, without)


@torch.no_grad()
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_seed_004_left_padded_batch_generates_each_row_as_if_alone(scheme, quantization):
    model = tiny_model(scheme, quantization=quantization, kernels="torch")
    prompts = [torch.randint(0, 61, (n,)) for n in (9, 4, 1)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=14)
    for row, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=14)
        assert torch.equal(batched[row, width:], alone[0, len(p):])
