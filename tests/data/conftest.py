"""Shared fixtures: the real corpus (needs `make data`) and small tokenizers trained on it."""

import pytest

from llm.data import build_char_tokenizer, load_corpus, train_bpe_tokenizer


@pytest.fixture(scope="session")
def train_text() -> str:
    return load_corpus("train")


@pytest.fixture(scope="session")
def validation_text() -> str:
    return load_corpus("validation")


@pytest.fixture(scope="session")
def char_tokenizer(train_text, validation_text):
    return build_char_tokenizer(train_text + validation_text)


@pytest.fixture(scope="session")
def bpe_tokenizer(train_text):
    # A 300 KB slice and a small vocabulary keep training well under a second.
    return train_bpe_tokenizer(train_text[:300_000], vocab_size=512)
