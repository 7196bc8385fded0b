"""The cache objects' interface: growth, crop, select, copy, files (which know the model and
tokenizer that made them), legacy tuples and fit checks; the model identity they rest on."""

import argparse
import string

import pytest
import torch

import llm.bundle
from llm import Cache, DynamicCache, MosaicGPT, StaticCache
from llm.data import build_char_tokenizer
from tests.conftest import tiny_model


def prefilled(model, cache, ids):
    model(ids, past_key_values=cache)
    return cache


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_interface(kind):
    model = tiny_model("llama")
    ids = torch.randint(0, 61, (3, 12))
    cache = DynamicCache() if kind == "dynamic" else StaticCache(model.config, 3, 40)
    prefilled(model, cache, ids)
    assert cache.get_seq_length() == 12 and len(cache) == model.config.n_layers
    layers = list(cache)
    assert [tuple(k.shape) for k, _ in layers] == [(3, 2, 12, 8)] * 2  # kv_n_heads=2, head_dim=8

    # copy is deep: writing to the copy leaves the original alone
    twin = cache.copy()
    assert type(twin) is type(cache)
    model(ids[:, :2], past_key_values=twin)
    assert twin.get_seq_length() == 14 and cache.get_seq_length() == 12
    assert torch.equal(list(cache)[0][0], layers[0][0])

    # crop keeps the first positions; a negative length drops from the end
    cache.crop(10)
    assert cache.get_seq_length() == 10
    cache.crop(-3)
    assert cache.get_seq_length() == 7
    torch.testing.assert_close(list(cache)[1][1], layers[1][1][:, :, :7])

    # select keeps and reorders rows
    cache.select([2, 0])
    assert cache.batch_size == 2
    torch.testing.assert_close(list(cache)[0][0], layers[0][0][[2, 0], :, :7])
    cache.reorder(torch.tensor([1, 1]))
    torch.testing.assert_close(list(cache)[0][0], layers[0][0][[0, 0], :, :7])


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_save_and_load_give_the_same_continuation(tmp_path, kind):
    model = tiny_model("alibi")
    ids = torch.randint(0, 61, (2, 15))
    cache = DynamicCache() if kind == "dynamic" else StaticCache(model.config, 2, 32)
    prefilled(model, cache, ids[:, :10])
    cache.save(tmp_path / "prompt.cache")
    loaded = Cache.load(tmp_path / "prompt.cache")
    assert type(loaded) is type(cache) and loaded.get_seq_length() == 10
    assert loaded.get_max_length() == cache.get_max_length()
    a = model(ids[:, 10:], past_key_values=cache).logits
    b = model(ids[:, 10:], past_key_values=loaded).logits
    assert torch.equal(a, b)


@torch.no_grad()
def test_load_refuses_foreign_and_corrupt_files_in_one_line(tmp_path):
    with pytest.raises(FileNotFoundError):
        Cache.load(tmp_path / "missing")
    prefilled(tiny_model("alibi"), DynamicCache(), torch.randint(0, 61, (1, 6))).save(tmp_path / "good")
    (tmp_path / "truncated").write_bytes((tmp_path / "good").read_bytes()[:300])
    (tmp_path / "junk").write_bytes(b"not a cache")
    torch.save(argparse.Namespace(keys=[]), tmp_path / "pickle")  # torch's refusal advises weights_only=False
    for name in ("truncated", "junk", "pickle"):
        with pytest.raises(ValueError) as err:
            Cache.load(tmp_path / name)
        assert str(err.value) == f"{tmp_path / name} is not a readable cache file (truncated or corrupt)"
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a cache file written by llm.Cache.save"):
        Cache.load(tmp_path / "other.pt")
    torch.save({"format": "llm.cache/v1", "class": "DynamicCache", "metadata": {}, "keys": [torch.zeros(2)],
                "values": [torch.zeros(2)]}, tmp_path / "damaged")
    with pytest.raises(ValueError, match="damaged is not a cache file written by llm.Cache.save"):
        Cache.load(tmp_path / "damaged")


def twins():
    """Two models of the same shape and config, other weights (as before and after fine-tuning)."""
    return tiny_model("rope", seed=0), tiny_model("rope", seed=1)


@torch.no_grad()
def test_a_cache_from_another_model_of_the_same_shape_is_refused(tmp_path):
    a, b = twins()
    ids = torch.randint(0, 61, (1, 8))
    prefilled(a, DynamicCache(), ids).save(tmp_path / "a.cache", model=a)
    with pytest.raises(ValueError) as err:
        Cache.load(tmp_path / "a.cache", model=b)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'a.cache'} was made by another model or tokenizer: ")
    assert f"its model identity is {a.identity()[:12]}, this model's {b.identity()[:12]}" in message
    assert "\n" not in message and "dtype" not in message and "layers" not in message  # only what differs
    cache = Cache.load(tmp_path / "a.cache", model=a)
    assert torch.equal(a(ids[:, :1], past_key_values=cache).logits,
                       a(ids[:, :1], past_key_values=prefilled(a, DynamicCache(), ids)).logits)

    # the config counts too (same weights), but not the attention implementation
    assert tiny_model("rope", rope_theta=500.0).identity() != a.identity()
    assert tiny_model("rope", attn_impl="sdpa").identity() == a.identity()

    # a cache no model filled (built from tensors) records no identity: unknown, refused
    Cache.from_legacy(prefilled(a, DynamicCache(), ids).to_legacy()).save(tmp_path / "anonymous.cache")
    with pytest.raises(ValueError, match="it records no model identity"):
        Cache.load(tmp_path / "anonymous.cache", model=a)
    assert Cache.load(tmp_path / "anonymous.cache").get_seq_length() == 8  # unchecked without model=


@torch.no_grad()
def test_a_cache_is_stamped_by_the_model_that_fills_it(tmp_path):
    # with no argument to remember: another model's forward over it raises, in memory, after a
    # copy, and after a save and load without model=; the same weights (a copy of the model) pass
    import copy

    a, b = twins()
    ids = torch.randint(0, 61, (1, 8))
    cache = prefilled(a, DynamicCache(), ids)
    for other in (cache, cache.copy()):
        with pytest.raises(ValueError, match=f"another model \\(identity {a.identity()[:12]}, this model's "
                                             f"{b.identity()[:12]}\\)"):
            b(ids[:, :1], past_key_values=other)
    copy.deepcopy(a)(ids[:, :1], past_key_values=cache.copy())
    cache.save(tmp_path / "a.cache")  # no model=: the filling model's stamp is kept
    loaded = Cache.load(tmp_path / "a.cache")
    with pytest.raises(ValueError, match="another model"):
        b(ids[:, :1], past_key_values=loaded)
    assert torch.equal(a(ids[:, :1], past_key_values=Cache.load(tmp_path / "a.cache")).logits,
                       a(ids[:, :1], past_key_values=prefilled(a, DynamicCache(), ids)).logits)
    Cache.load(tmp_path / "a.cache", model=a)  # and the explicit check agrees
    # an empty cache belongs to nobody yet; generate refuses another model's prompt cache too
    b(ids, past_key_values=DynamicCache())
    with pytest.raises(ValueError, match="another model"):
        b.generate(ids[:, :3], past_key_values=prefilled(a, DynamicCache(), ids[:, :2]), max_new_tokens=2)


@torch.no_grad()
def test_a_cache_is_stale_once_its_models_weights_are_written():
    a, _ = twins()
    ids = torch.randint(0, 61, (1, 8))
    cache = prefilled(a, DynamicCache(), ids)
    a(ids[:, :1], past_key_values=cache.copy())  # unchanged weights: accepted
    with torch.no_grad():
        a.blocks[0].ffn.down_proj.weight.add_(1e-3)
    with pytest.raises(ValueError, match="before its weights were written"):
        a(ids[:, :1], past_key_values=cache)
    a(ids[:, :1], past_key_values=prefilled(a, DynamicCache(), ids))  # a new cache serves the new weights


def test_a_bundle_keeps_its_identity_without_rehashing(tmp_path, monkeypatch):
    a, _ = twins()
    prefilled(a, DynamicCache(), torch.randint(0, 61, (1, 5))).save(tmp_path / "a.cache", model=a)
    a.save_pretrained(tmp_path / "a")

    def no_hashing(state):
        raise AssertionError("from_pretrained must take the digest save_pretrained stored")

    monkeypatch.setattr(llm.bundle, "weights_digest", no_hashing)
    loaded = MosaicGPT.from_pretrained(tmp_path / "a")
    assert loaded.identity() == a.identity()
    assert Cache.load(tmp_path / "a.cache", model=loaded).get_seq_length() == 5


@pytest.mark.parametrize("optimizer", ["sgd", "adamw-fused"])
def test_a_model_trained_after_loading_gets_a_new_identity(tmp_path, optimizer):
    a, _ = twins()
    a.save_pretrained(tmp_path / "a")
    model = MosaicGPT.from_pretrained(tmp_path / "a")
    before = model.identity()
    with torch.no_grad():
        prefilled(model, DynamicCache(), torch.randint(0, 61, (1, 5))).save(tmp_path / "a.cache", model=model)
    # a fused optimizer's step leaves the version counters as they were: training mode must do
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    model.train()
    model(torch.randint(0, 61, (2, 8))).logits.square().mean().backward()
    opt.step()
    model.eval()
    after = model.identity()
    assert after != before
    with pytest.raises(ValueError, match="its model identity is"):
        Cache.load(tmp_path / "a.cache", model=model)
    # an in-place write in eval mode is seen through the version counters
    with torch.no_grad():
        model.wte.weight[0, 0] += 1
    assert model.identity() not in (before, after)


@torch.no_grad()
def test_tokenizer_and_dtype_mismatches_are_refused(tmp_path):
    a, _ = twins()
    chars = build_char_tokenizer(string.ascii_lowercase)
    prefilled(a, DynamicCache(), torch.randint(0, 28, (1, 5))).save(tmp_path / "a.cache", model=a, tokenizer=chars)
    chars.save_pretrained(tmp_path / "tokenizer")
    reloaded = type(chars).from_pretrained(tmp_path / "tokenizer")
    reloaded(["ab", "a"], padding=True)  # rewrites the backend's padding settings, not its token ids
    assert Cache.load(tmp_path / "a.cache", model=a, tokenizer=reloaded).get_seq_length() == 5
    with pytest.raises(ValueError, match="its tokenizer is [0-9a-f]{12}, this one's [0-9a-f]{12}"):
        Cache.load(tmp_path / "a.cache", model=a, tokenizer=build_char_tokenizer(string.ascii_lowercase + "."))
    prefilled(a, DynamicCache(), torch.randint(0, 28, (1, 5))).save(tmp_path / "no-tokenizer.cache", model=a)
    with pytest.raises(ValueError, match="it records no tokenizer"):
        Cache.load(tmp_path / "no-tokenizer.cache", tokenizer=chars)

    a.save_pretrained(tmp_path / "a")
    half = MosaicGPT.from_pretrained(tmp_path / "a", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="its dtype is torch.float32, this model's torch.bfloat16"):
        Cache.load(tmp_path / "a.cache", model=half)
    assert half.identity() != a.identity()  # a cast model is another model


@torch.no_grad()
def test_static_cache_is_written_in_place_and_refuses_overflow():
    model = tiny_model("rope")
    cache = StaticCache(model.config, batch_size=1, max_cache_len=12)
    pointers = [k.data_ptr() for k in cache._keys]
    model(torch.randint(0, 61, (1, 8)), past_key_values=cache)
    for _ in range(4):
        model(torch.randint(0, 61, (1, 1)), past_key_values=cache)
    assert [k.data_ptr() for k in cache._keys] == pointers
    with pytest.raises(ValueError, match="it holds 12 positions, 2 new tokens would need 14, but max_cache_len is 12"):
        model(torch.randint(0, 61, (1, 2)), past_key_values=cache)
    assert cache.get_seq_length() == 12


@torch.no_grad()
def test_dynamic_cache_appends_in_place_until_full():
    model = tiny_model()
    cache = prefilled(model, DynamicCache(), torch.randint(0, 61, (1, 3)))
    pointer = cache._keys[0].data_ptr()
    for _ in range(10):
        model(torch.randint(0, 61, (1, 1)), past_key_values=cache)
    assert cache._keys[0].data_ptr() == pointer  # within capacity: no reallocation, no copy


@torch.no_grad()
def test_use_cache_without_a_cache_returns_a_dynamic_cache():
    model = tiny_model()
    out = model(torch.randint(0, 61, (2, 5)), use_cache=True)
    assert isinstance(out.past_key_values, DynamicCache) and out.past_key_values.get_seq_length() == 5
    assert model(torch.randint(0, 61, (2, 5))).past_key_values is None


@torch.no_grad()
def test_legacy_tuples_in_give_tuples_out_and_are_not_written():
    model = tiny_model()
    ids = torch.randint(0, 61, (1, 9))
    full = model(ids).logits
    legacy = model(ids[:, :6], past_key_values=(), use_cache=True).past_key_values
    assert isinstance(legacy, tuple) and all(isinstance(layer, tuple) for layer in legacy)
    assert legacy[0][0].shape == (1, 4, 6, 8)
    cut = tuple((k[:, :, :4], v[:, :, :4]) for k, v in legacy)
    before = [k.clone() for k, _ in legacy]
    out = model(ids[:, 4:], past_key_values=cut, use_cache=True)
    torch.testing.assert_close(out.logits, full[:, 4:], atol=1e-5, rtol=0)
    assert out.past_key_values[0][0].shape == (1, 4, 9, 8)
    assert all(torch.equal(k, b) for (k, _), b in zip(legacy, before))


@torch.no_grad()
def test_a_cache_that_does_not_fit_is_refused_before_any_compute():
    model = tiny_model("llama")
    cache = prefilled(model, DynamicCache(), torch.randint(0, 61, (2, 4)))
    with pytest.raises(ValueError, match="the cache has batch size 2, the model/input needs 3"):
        model(torch.randint(0, 61, (3, 1)), past_key_values=cache)
    other = tiny_model("llama", kv_n_heads=4)
    with pytest.raises(ValueError, match="the cache has key/value heads 2, the model/input needs 4"):
        other(torch.randint(0, 61, (2, 1)), past_key_values=cache)
    deeper = tiny_model("llama", n_layers=3)
    with pytest.raises(ValueError, match="the cache has layers 2, the model/input needs 3"):
        deeper(torch.randint(0, 61, (2, 1)), past_key_values=cache)
    wider = tiny_model("llama", d_model=64, n_heads=4)
    with pytest.raises(ValueError, match="the cache has head size 8, the model/input needs 16"):
        wider(torch.randint(0, 61, (2, 1)), past_key_values=cache)
    with pytest.raises(ValueError, match="the cache has batch size 1, the model/input needs 2"):
        model(torch.randint(0, 61, (2, 1)), past_key_values=StaticCache(model.config, 1, 8))
    with pytest.raises(ValueError, match="made for batch size 1, the input has batch size 2"):
        model(torch.randint(0, 61, (2, 1)), past_key_values=StaticCache(None, 1, 8))
    assert cache.get_seq_length() == 4  # nothing was written


def test_generate_sizes_a_new_cache_for_the_call_and_expect_keeps_what_is_cached():
    model = tiny_model()
    out = model.generate(torch.randint(0, 61, (1, 5)), max_new_tokens=80, do_sample=False, eos_token_id=None,
                         return_dict_in_generate=True)
    # prompt + new - 1 positions, allocated once: no grow while decoding
    assert {k.shape[2] for k in out.past_key_values._keys} == {84}
    cache = DynamicCache()
    ids = torch.randint(0, 61, (2, 9))
    model(ids, past_key_values=cache)
    before = [k[:, :, :9].clone() for k in cache._keys]
    assert cache.expect(300) is cache and {k.shape[2] for k in cache._keys} == {300}
    assert all(torch.equal(k[:, :, :9], b) for k, b in zip(cache._keys, before)) and cache.get_seq_length() == 9
    nxt = torch.randint(0, 61, (2, 1))
    fresh = model(torch.cat([ids, nxt], 1)).logits[:, -1]
    assert torch.allclose(model(nxt, past_key_values=cache).logits[:, -1], fresh, atol=1e-5)
