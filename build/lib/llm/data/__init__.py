"""Data side: sources of documents, tokenizers, preparation into token shards, streaming datasets, fine-tuning data.

The submodules are imported where needed (:mod:`llm.data.prepare`, :mod:`llm.data.streaming`, ...);
this package exports the Shakespeare corpus helpers and the tokenizer builders."""

from llm.data.shakespeare import (
    DEFAULT_PLAYS_DIR,
    SPLITS,
    VALIDATION_PLAYS,
    load_corpus,
    markdown_to_text,
    play_paths,
    split_plays,
)
from llm.data.tokenizer import (
    EOS_TOKEN,
    UNK_TOKEN,
    build_char_tokenizer,
    load_tokenizer,
    save_tokenizer,
    train_bpe_tokenizer,
)

__all__ = [
    "DEFAULT_PLAYS_DIR",
    "EOS_TOKEN",
    "SPLITS",
    "UNK_TOKEN",
    "VALIDATION_PLAYS",
    "build_char_tokenizer",
    "load_corpus",
    "load_tokenizer",
    "markdown_to_text",
    "play_paths",
    "split_plays",
    "save_tokenizer",
    "train_bpe_tokenizer",
]
