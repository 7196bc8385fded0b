"""The cache objects' interface: growth, crop, select, copy, files, legacy tuples and fit checks."""

import pytest
import torch

from llm import Cache, DynamicCache, StaticCache
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


def test_load_refuses_foreign_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        Cache.load(tmp_path / "missing")
    (tmp_path / "junk").write_bytes(b"not a cache")
    with pytest.raises(ValueError, match="junk is not a readable cache file"):
        Cache.load(tmp_path / "junk")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a cache file written by llm.Cache.save"):
        Cache.load(tmp_path / "other.pt")


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
