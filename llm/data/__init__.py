"""Data side: the Shakespeare corpus, tokenizers, and packed-token dataloaders."""

from llm.data.shakespeare import (
    DEFAULT_PLAYS_DIR,
    SPLITS,
    VALIDATION_PLAYS,
    load_corpus,
    markdown_to_text,
    play_paths,
    split_plays,
)
from llm.data.text_dataset import (
    DEFAULT_CACHE_DIR,
    PackedTextDataset,
    build_text_dataloader,
    load_split_tokens,
    tokenize_corpus,
    tokens_per_byte,
)
from llm.data.tokenizer import (
    EOS_TOKEN,
    TOKENIZER_KINDS,
    UNK_TOKEN,
    build_char_tokenizer,
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
    train_bpe_tokenizer,
)

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_PLAYS_DIR",
    "EOS_TOKEN",
    "SPLITS",
    "TOKENIZER_KINDS",
    "UNK_TOKEN",
    "VALIDATION_PLAYS",
    "PackedTextDataset",
    "build_char_tokenizer",
    "build_text_dataloader",
    "build_tokenizer",
    "load_corpus",
    "load_split_tokens",
    "load_tokenizer",
    "markdown_to_text",
    "play_paths",
    "split_plays",
    "save_tokenizer",
    "tokenize_corpus",
    "tokens_per_byte",
    "train_bpe_tokenizer",
]
