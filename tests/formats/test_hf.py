"""MosaicGPT loaded with transformers' GPT-2 and MPT weights gives their logits and their greedy tokens."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MptConfig, MptForCausalLM

from llm import DynamicCache
from llm.formats import from_transformers

VOCAB = 97


def hf_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=48, n_layer=3, n_head=4,
                        initializer_range=0.1, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return GPT2LMHeadModel(config).eval()


def hf_mpt():
    torch.manual_seed(0)
    config = MptConfig(vocab_size=VOCAB, max_seq_len=128, d_model=48, n_layers=3, n_heads=4,
                       initializer_range=0.1, eos_token_id=1, pad_token_id=2)
    model = MptForCausalLM(config).eval()
    with torch.no_grad():  # MPT's init leaves norms at 1; perturb them so a missed norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


REFERENCES = {"gpt2": hf_gpt2, "mpt": hf_mpt}


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :8] = 0
    return ids.masked_fill(mask == 0, 2), mask


def hf_logits(hf, ids, mask, past=None, start=0):
    # transformers derives positions from the mask only inside generate; pass them explicitly.
    positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, start:start + ids.shape[1]]
    kwargs = {"position_ids": positions} if hf.config.model_type == "gpt2" else {}
    out = hf(ids, attention_mask=mask, past_key_values=past, use_cache=True, **kwargs)
    return out.logits, out.past_key_values


@pytest.fixture(params=[(arch, impl) for arch in REFERENCES for impl in ("torch", "sdpa")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request):
    arch, impl = request.param
    hf = REFERENCES[arch]()
    return hf, from_transformers(hf, attn_impl=impl)


def real(mask, x):
    return x[mask.bool()]


@torch.no_grad()
def test_logits_equal_reference_on_left_padded_batch(pair):
    hf, ours = pair
    ids, mask = batch()
    ref, _ = hf_logits(hf, ids, mask)
    got = ours(ids, attention_mask=mask).logits
    assert ref.abs().max() > 1.0  # logits of substance, not near-uniform noise
    torch.testing.assert_close(real(mask, got), real(mask, ref), atol=1e-4, rtol=0)


@torch.no_grad()
def test_logits_equal_reference_with_cache(pair):
    """Prefill 8, then token by token to 11, then a chunk of 3; both sides cached."""
    hf, ours = pair
    ids, mask = batch()
    ref_past, cache = None, DynamicCache()
    for a, b in ((0, 8), (8, 9), (9, 10), (10, 11), (11, 14)):
        ref, ref_past = hf_logits(hf, ids[:, a:b], mask[:, :b], ref_past, start=a)
        got = ours(ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache).logits
        torch.testing.assert_close(real(mask[:, a:b], got), real(mask[:, a:b], ref), atol=1e-4, rtol=0)


@torch.no_grad()
def test_greedy_generation_equals_transformers_generate(pair):
    hf, ours = pair
    ids, mask = batch()
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=None,
                      pad_token_id=2)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=32)
    assert got.shape == (3, 14 + 32)
    assert torch.equal(got, ref)


def test_unsupported_architecture_is_named():
    class Fake:
        class config:
            model_type = "bloom"

    with pytest.raises(ValueError, match="cannot convert a 'bloom' model; supported: \\['gpt2', 'mpt'\\]"):
        from_transformers(Fake())
