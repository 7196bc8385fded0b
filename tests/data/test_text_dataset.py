import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import llm.data.text_dataset as text_dataset
from llm.data import (
    PackedTextDataset,
    build_text_dataloader,
    load_split_tokens,
    tokenize_corpus,
    tokens_per_byte,
    train_bpe_tokenizer,
)

SEQ_LEN, BATCH = 32, 4
ALPHABET = "ab .\n\t"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def validation_tokens(char_tokenizer, cache_dir):
    return load_split_tokens(char_tokenizer, "validation", cache_dir=cache_dir)


def loader_cfg(cache_dir, **overrides):
    cfg = {"dataset": {"split": "validation", "cache_dir": str(cache_dir)}, "shuffle": False, "drop_last": True}
    return {**cfg, **overrides}


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_tokenize_corpus_matches_whole_text_encoding(kind, char_tokenizer, bpe_tokenizer, validation_text):
    tok = {"char": char_tokenizer, "bpe": bpe_tokenizer}[kind]
    text = validation_text[:30_000]
    tokens = tokenize_corpus(tok, text)
    assert tokens.dtype == torch.long and tokens.ndim == 1
    assert tokens.tolist() == tok(text)["input_ids"]


@pytest.fixture(scope="module")
def whitespace_bpe():
    # Trained on runs of mixed whitespace, so it has merges that a bad cut between chunks would break.
    rng = random.Random(0)
    return train_bpe_tokenizer("".join(rng.choice(ALPHABET) for _ in range(20_000)), vocab_size=400)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40))
def test_tokenize_corpus_chunking_is_exact(whitespace_bpe, text):
    assert tokenize_corpus(whitespace_bpe, text).tolist() == whitespace_bpe(text)["input_ids"]


def test_tokens_per_byte(char_tokenizer, bpe_tokenizer, validation_text):
    assert tokens_per_byte(char_tokenizer, "To be, or not to be\n") == 1.0
    # "—" is one character, three UTF-8 bytes.
    assert tokens_per_byte(char_tokenizer, "a—b") == 3 / 5
    ratio = tokens_per_byte(bpe_tokenizer, validation_text[:30_000])
    assert ratio == len(bpe_tokenizer(validation_text[:30_000])["input_ids"]) / 30_000
    with pytest.raises(ValueError, match="non-empty"):
        tokens_per_byte(char_tokenizer, "")


def test_packed_dataset_blocks():
    tokens = torch.arange(103)
    dataset = PackedTextDataset(tokens, max_seq_len=10)
    assert len(dataset) == 10
    item = dataset[3]
    assert item["input_ids"].tolist() == list(range(30, 40))
    assert item["input_ids"].dtype == torch.long
    assert torch.equal(item["labels"], item["input_ids"])
    item["labels"][0] = -100  # labels and input_ids must not share memory with each other or the stream
    assert dataset[3]["input_ids"][0] == 30 and item["input_ids"][0] == 30
    with pytest.raises(IndexError):
        dataset[10]


def test_packed_dataset_reassembles_real_stream(validation_tokens):
    dataset = PackedTextDataset(validation_tokens, max_seq_len=SEQ_LEN)
    assert len(dataset) == len(validation_tokens) // SEQ_LEN
    blocks = torch.cat([dataset[i]["input_ids"] for i in range(len(dataset))])
    assert torch.equal(blocks, validation_tokens[: len(dataset) * SEQ_LEN])


@pytest.mark.parametrize(
    "tokens, max_seq_len, match",
    [(torch.arange(5), 6, "fewer than one block"), (torch.arange(6).view(2, 3), 2, "1-D"), (torch.arange(5), 0, "positive")],
)
def test_packed_dataset_errors(tokens, max_seq_len, match):
    with pytest.raises(ValueError, match=match):
        PackedTextDataset(tokens, max_seq_len)


def test_token_cache(char_tokenizer, bpe_tokenizer, tmp_path, monkeypatch):
    tokens = load_split_tokens(char_tokenizer, "validation", cache_dir=tmp_path)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("validation-")

    def fail(*args):
        raise AssertionError("should have been read from the cache")

    monkeypatch.setattr(text_dataset, "tokenize_corpus", fail)
    assert torch.equal(load_split_tokens(char_tokenizer, "validation", cache_dir=tmp_path), tokens)
    monkeypatch.undo()
    # Another tokenizer gets its own entry.
    load_split_tokens(bpe_tokenizer, "validation", cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2
    assert not list(tmp_path.glob("*.tmp"))


def test_dataloader_batches_in_order(char_tokenizer, cache_dir, validation_tokens):
    loader = build_text_dataloader(loader_cfg(cache_dir), char_tokenizer, SEQ_LEN, BATCH)
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (BATCH, SEQ_LEN) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["input_ids"], validation_tokens[: BATCH * SEQ_LEN].view(BATCH, SEQ_LEN))
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert len(loader) == len(validation_tokens) // SEQ_LEN // BATCH


def first_batches(loader, n=3):
    batches = iter(loader)
    return torch.cat([next(batches)["input_ids"] for _ in range(n)])


def test_dataloader_shuffle_is_seeded(char_tokenizer, cache_dir):
    def build(shuffle, seed):
        return build_text_dataloader(loader_cfg(cache_dir, shuffle=shuffle), char_tokenizer, SEQ_LEN, BATCH, seed=seed)

    shuffled = first_batches(build(True, seed=0))
    assert torch.equal(shuffled, first_batches(build(True, seed=0)))
    assert not torch.equal(shuffled, first_batches(build(False, seed=0)))
    assert not torch.equal(shuffled, first_batches(build(True, seed=1)))
    loader = build(True, seed=0)
    assert sorted(loader.sampler) == list(range(len(loader.dataset)))


def test_dataloader_shards_by_rank(char_tokenizer, cache_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    shards = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        loader = build_text_dataloader(loader_cfg(cache_dir, shuffle=True), char_tokenizer, SEQ_LEN, BATCH)
        shards.append(set(loader.sampler))
    n_blocks = len(loader.dataset)
    assert shards[0].isdisjoint(shards[1])
    assert len(shards[0]) == len(shards[1]) == n_blocks // 2


def test_dataloader_accepts_omegaconf(char_tokenizer, cache_dir):
    cfg = OmegaConf.create(loader_cfg(cache_dir, num_workers=0))
    loader = build_text_dataloader(cfg, char_tokenizer, SEQ_LEN, BATCH)
    assert next(iter(loader))["input_ids"].shape == (BATCH, SEQ_LEN)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"batch_size": 8}, r"unknown key loader\.batch_size; allowed keys: \['dataset', 'shuffle'"),
        ({"dataset": {"split": "validation", "name": "x"}}, r"unknown key loader\.dataset\.name"),
        ({"dataset": {}}, r"missing key loader\.dataset\.split"),
        ({"shuffle": "yes"}, r"loader\.shuffle must be true or false"),
        ({"dataset": {"split": "test"}}, "'train', 'validation'"),
    ],
)
def test_dataloader_bad_config(char_tokenizer, cache_dir, overrides, match):
    with pytest.raises(ValueError, match=match):
        build_text_dataloader(loader_cfg(cache_dir, **overrides), char_tokenizer, SEQ_LEN, BATCH)


def test_dataloader_missing_key(char_tokenizer, cache_dir):
    cfg = loader_cfg(cache_dir)
    del cfg["drop_last"]
    with pytest.raises(ValueError, match=r"missing key loader\.drop_last"):
        build_text_dataloader(cfg, char_tokenizer, SEQ_LEN, BATCH)
