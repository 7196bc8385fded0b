"""The cache-aware forward equals the uncached forward, for every position scheme and attention impl."""

import pytest
import torch

from llm import DynamicCache, MosaicGPT, MosaicGPTConfig, StaticCache
from tests.conftest import tiny_model

ATOL = 1e-5


def left_padded_batch(seed=0, batch=3, seq=17, vocab=61):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    for row, pad in enumerate([0, 4, 9][:batch]):
        mask[row, :pad] = False
    return ids, mask


def run_in_chunks(model, ids, mask, bounds, cache=None):
    cache = cache if cache is not None else DynamicCache()
    logits = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        out = model(ids[:, a:b], attention_mask=None if mask is None else mask[:, :b], past_key_values=cache)
        logits.append(out.logits)
    return torch.cat(logits, dim=1), cache


def assert_close_on(mask, a, b, atol=ATOL):
    m = mask[..., None] if mask is not None else torch.ones_like(a[..., :1], dtype=torch.bool)
    diff = ((a - b).abs() * m).max()
    assert diff < atol, f"max difference at real positions {diff}"


@torch.no_grad()
def test_token_by_token_and_chunks_equal_uncached(model):
    ids, mask = left_padded_batch()
    full = model(ids, attention_mask=mask).logits
    seq = ids.shape[1]
    for bounds in (list(range(seq + 1)), [0, 5, 6, 9, 12, seq], [0, 1, seq]):
        for m in (mask, None):
            ref = full if m is not None else model(ids).logits
            cached, cache = run_in_chunks(model, ids, m, bounds)
            assert_close_on(m, cached, ref)
            assert cache.get_seq_length() == seq


@torch.no_grad()
def test_static_cache_equals_dynamic(model):
    ids, mask = left_padded_batch()
    full = model(ids, attention_mask=mask).logits
    static = StaticCache(model.config, batch_size=3, max_cache_len=40)
    cached, _ = run_in_chunks(model, ids, mask, [0, 6, 7, 8, 17], cache=static)
    assert_close_on(mask, cached, full)


@torch.no_grad()
def test_cache_cut_back_by_two_and_two_tokens_fed_again(model):
    """Seed scenario 002: crop the cache by two positions and feed the last two tokens again."""
    ids, _ = left_padded_batch(batch=1)
    full = model(ids).logits
    cache = DynamicCache()
    model(ids[:, :5], past_key_values=cache)
    for end in range(6, ids.shape[1] + 1):
        cache.crop(end - 2)
        out = model(ids[:, end - 2:end], past_key_values=cache)
        torch.testing.assert_close(out.logits, full[:, end - 2:end], atol=ATOL, rtol=0)
        assert cache.get_seq_length() == end


@torch.no_grad()
def test_left_padded_rows_equal_each_row_alone(model):
    ids, mask = left_padded_batch()
    batched, _ = run_in_chunks(model, ids, mask, [0, 10, 11, 12, 17])
    for row in range(ids.shape[0]):
        real = mask[row]
        alone = model(ids[row:row + 1, real]).logits
        torch.testing.assert_close(batched[row:row + 1, real], alone, atol=ATOL, rtol=0)


@torch.no_grad()
def test_inputs_embeds_with_cache_equal_input_ids(model):
    ids, mask = left_padded_batch()
    full = model(ids, attention_mask=mask).logits
    cache = DynamicCache()
    embeds = model.get_input_embeddings()(ids)
    first = model(inputs_embeds=embeds[:, :8], attention_mask=mask[:, :8], past_key_values=cache).logits
    rest = model(inputs_embeds=embeds[:, 8:], attention_mask=mask, past_key_values=cache).logits
    assert_close_on(mask, torch.cat([first, rest], 1), full)


@torch.no_grad()
def test_left_padding_shifts_positions_so_the_first_real_token_is_zero():
    model = tiny_model("learned")
    ids, mask = left_padded_batch()
    padded = model(ids, attention_mask=mask).logits
    explicit = torch.arange(17)[None].expand(3, 17) - (~mask).sum(1, keepdim=True)
    shifted = model(ids, attention_mask=mask, position_ids=explicit.clamp_min(0)).logits
    assert_close_on(mask, padded, shifted)
    unshifted = model(ids, attention_mask=mask, position_ids=torch.arange(17)[None]).logits
    assert ((unshifted - padded).abs()[2, 9:] > 1e-3).any()


def test_too_long_sequence_names_cached_and_new_lengths_and_max_seq_len():
    model = tiny_model("learned", max_seq_len=16)
    cache = DynamicCache()
    model(torch.zeros(1, 10, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match=r"10 cached \+ 7 new positions = 17 > max_seq_len=16"):
        model(torch.zeros(1, 7, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    # ALiBi extrapolates: no limit
    tiny_model("alibi", max_seq_len=16)(torch.zeros(1, 20, dtype=torch.long))


def test_input_errors():
    model = tiny_model()
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model(ids, inputs_embeds=torch.zeros(2, 5, 32))
    with pytest.raises(ValueError, match="exactly one"):
        model()
    with pytest.raises(ValueError, match=r"attention_mask must cover the cached and the new positions"):
        model(ids, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="d_model=32"):
        model(inputs_embeds=torch.zeros(2, 5, 8))


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(d_model=30, n_heads=4), "d_model .30. must be divisible by n_heads .4."),
        (dict(alibi=True, learned_pos_emb=True), "mutually exclusive"),
        (dict(rope=True, alibi=True, learned_pos_emb=False), "mutually exclusive"),
        (dict(attn_impl="flash"), r"attn_impl must be one of \('torch', 'sdpa'\)"),
        (dict(n_heads=4, kv_n_heads=3, d_model=32), "divisible by kv_n_heads"),
        (dict(resid_pdrop=1.5), "resid_pdrop must be in"),
        (dict(n_layers=0), "n_layers must be a positive integer"),
        (dict(ffn_act="swish"), "ffn_act must be one of"),
        (dict(logit_softcap=0), "logit_softcap must be a number > 0"),
        (dict(qk_norm="yes"), "qk_norm must be true or false"),
    ],
)
def test_config_errors_name_the_key(options, message):
    with pytest.raises(ValueError, match=message):
        MosaicGPTConfig(**options)


def test_config_unknown_key_and_yaml_roundtrip(tmp_path):
    with pytest.raises(ValueError, match=r"^n_head: unknown key \(did you mean 'n_heads'\?\); allowed keys"):
        MosaicGPTConfig.from_dict({"n_head": 4})
    config = MosaicGPTConfig(d_model=64, n_heads=2, alibi=True, learned_pos_emb=False)
    config.save(tmp_path / "c.yaml")
    assert MosaicGPTConfig.load(tmp_path / "c.yaml") == config


@torch.no_grad()
def test_save_and_load_pretrained_roundtrip(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    loaded = MosaicGPT.from_pretrained(tmp_path / "m")
    ids = torch.randint(0, 61, (2, 9))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert loaded.config == model.config


def test_load_pretrained_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        MosaicGPT.from_pretrained(tmp_path)
    tiny_model().save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ValueError, match="model.safetensors"):
        MosaicGPT.from_pretrained(tmp_path / "m")
    tiny_model(d_model=64).save_pretrained(tmp_path / "other")
    (tmp_path / "m" / "model.safetensors").write_bytes((tmp_path / "other" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"do not fit its config: .*wte.weight: file has \(61, 64\), model needs \(61, 32\)"):
        MosaicGPT.from_pretrained(tmp_path / "m")


@torch.no_grad()
def test_padding_between_a_cached_prefix_and_new_tokens_is_invisible(model):
    """[prefix][padding][suffix] with its mask equals [prefix][suffix] run alone, for every scheme."""
    ids = torch.randint(0, 61, (1, 12))
    alone = model(ids).logits
    gapped = torch.cat([ids[:, :5], torch.zeros(1, 3, dtype=torch.long), ids[:, 5:]], dim=1)
    mask = torch.ones_like(gapped, dtype=torch.bool)
    mask[:, 5:8] = False
    cache = DynamicCache()
    first = model(gapped[:, :5], past_key_values=cache).logits
    rest = model(gapped[:, 5:], attention_mask=mask, past_key_values=cache).logits
    torch.testing.assert_close(first, alone[:, :5], atol=ATOL, rtol=0)
    torch.testing.assert_close(rest[:, 3:], alone[:, 5:], atol=ATOL, rtol=0)


def test_the_model_pickles_and_its_parameters_are_plain_tensors(tmp_path):
    """What users and tools do with any nn.Module: pickle it, flatten its parameters, save its state dict."""
    import io
    import pickle

    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    again = pickle.loads(pickle.dumps(model))
    ids = torch.randint(0, 61, (1, 7))
    torch.testing.assert_close(again(ids).logits, model(ids).logits, atol=0, rtol=0)
    torch.save(model, io.BytesIO())
    vector = torch.nn.utils.parameters_to_vector(model.parameters())
    assert vector.numel() == model.num_parameters()
    save_file(model.state_dict(), tmp_path / "w.safetensors")
    assert load_file(tmp_path / "w.safetensors").keys() == model.state_dict().keys()


# -- the speedrun recipe's parts (MosaicGPTConfig: qk_norm, relu2, logit_softcap, zero_init_residual)
@torch.no_grad()
def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys():
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    for qk_norm in (True, False):
        model = tiny_model("rope", qk_norm=qk_norm)
        before = model(ids).logits
        for block in model.blocks:  # queries and keys 3x larger: their RMS norm undoes it
            rows = block.attn.n_heads * block.attn.head_dim + block.attn.kv_n_heads * block.attn.head_dim
            block.attn.Wqkv.weight[:rows] *= 3.0
        after = model(ids).logits
        if qk_norm:
            torch.testing.assert_close(after, before, atol=1e-4, rtol=0)
        else:
            assert (after - before).abs().max() > 0.1


@torch.no_grad()
def test_soft_capped_logits_are_the_capped_tanh_of_the_plain_ones():
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    capped = tiny_model("llama", logit_softcap=1.5)
    plain = tiny_model("llama")
    plain.load_state_dict(capped.state_dict())
    raw = plain(ids).logits
    assert raw.abs().max() > 3  # the cap bites
    torch.testing.assert_close(capped(ids).logits, 1.5 * torch.tanh(raw / 1.5), atol=1e-6, rtol=0)


@torch.no_grad()
def test_relu2_mlp_and_zero_initialized_residual_projections():
    model = MosaicGPT(MosaicGPTConfig(vocab_size=61, max_seq_len=32, d_model=32, n_heads=4, n_layers=2,
                                      ffn_act="relu2", zero_init_residual=True))
    ffn = model.blocks[0].ffn
    x = torch.randn(3, 32)
    torch.nn.init.normal_(ffn.down_proj.weight)
    torch.testing.assert_close(ffn(x), ffn.down_proj(torch.relu(ffn.up_proj(x)) ** 2))
    # every block starts as the identity: both projections into the residual stream are zero
    fresh = MosaicGPT(MosaicGPTConfig(vocab_size=61, max_seq_len=32, d_model=32, n_heads=4, n_layers=2,
                                      zero_init_residual=True))
    assert all(not b.attn.out_proj.weight.any() and not b.ffn.down_proj.weight.any() for b in fresh.blocks)
    ids = torch.randint(0, 61, (1, 8))
    embedded = fresh.wte(ids) + fresh.wpe(torch.arange(8))
    torch.testing.assert_close(fresh(ids).logits, fresh.norm_f(embedded) @ fresh.wte.weight.T)


@pytest.mark.parametrize("options", [dict(qk_norm=True), dict(logit_softcap=30.0), dict(ffn_act="relu2")])
def test_recipe_options_no_export_format_has_are_refused_there(options):
    from llm.formats.transformers import architecture

    config = MosaicGPTConfig(**{**dict(vocab_size=61, max_seq_len=32, d_model=32, n_heads=4, n_layers=2,
                                       learned_pos_emb=False, rope=True, ffn_type="glu", ffn_act="silu",
                                       norm_type="rmsnorm", no_bias=True), **options})
    name = " ".join(f"{k}" if v is True or isinstance(v, float) else f"{k} {v}" for k, v in options.items())
    with pytest.raises(ValueError, match=f"^{name}: none of the architectures .* has it;"):
        architecture(config)
    with pytest.raises(ValueError, match="^qk_norm and logit_softcap and ffn_act relu2: .* has them;"):
        architecture(MosaicGPTConfig(**{**config.to_dict(), "qk_norm": True, "logit_softcap": 30.0, "ffn_act": "relu2"}))
    assert architecture(MosaicGPTConfig(**{**config.to_dict(), "qk_norm": False, "logit_softcap": None,
                                           "ffn_act": "silu", "zero_init_residual": True})) == "llama"
