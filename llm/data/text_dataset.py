"""Token streams of the Shakespeare splits, packed into fixed-length blocks for causal LM training."""

import hashlib
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import PreTrainedTokenizerFast

from llm.data.shakespeare import load_corpus

DEFAULT_CACHE_DIR = Path(__file__).parents[2] / "data/cache"

LOADER_KEYS = ("dataset", "shuffle", "drop_last", "num_workers")
DATASET_KEYS = ("split", "plays_dir", "cache_dir")

# Cut between the two newlines of a blank line between non-blank lines: byte-level BPE and
# character pre-tokenizers both split there, so encoding the pieces separately gives the
# same ids as encoding the whole text.
_CHUNK_BOUNDARY = re.compile(r"(?<=\S\n)(?=\n\S)")


def tokenize_corpus(tokenizer: PreTrainedTokenizerFast, text: str) -> torch.Tensor:
    """Encode `text` into a 1-D int64 tensor of token ids, with no special tokens added.

    The text is cut at blank lines and the pieces are encoded in one parallel batch, which is
    much faster than one huge string and gives the same ids for this package's tokenizers.
    """
    encodings = tokenizer.backend_tokenizer.encode_batch(_CHUNK_BOUNDARY.split(text), add_special_tokens=False)
    return torch.tensor([i for encoding in encodings for i in encoding.ids], dtype=torch.long)


def tokens_per_byte(tokenizer: PreTrainedTokenizerFast, text: str) -> float:
    """Number of tokens of `text` per UTF-8 byte of it.

    Multiply a loss in nats per token by this and divide by ln 2 to get bits per byte.
    Raises ValueError for empty text.
    """
    n_bytes = len(text.encode("utf-8"))
    if n_bytes == 0:
        raise ValueError("tokens_per_byte needs non-empty text")
    return len(tokenize_corpus(tokenizer, text)) / n_bytes


def _sha256(data: str) -> str:
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def load_split_tokens(
    tokenizer: PreTrainedTokenizerFast,
    split: str,
    *,
    plays_dir: str | Path | None = None,
    cache_dir: str | Path | None = DEFAULT_CACHE_DIR,
) -> torch.Tensor:
    """Token ids (1-D int64 tensor) of the `split` corpus ("train" or "validation").

    With a `cache_dir` the tensor is cached there, keyed by the split and hashes of the
    tokenizer and of the text, so a changed tokenizer or corpus is re-tokenized; None
    disables the cache. Raises what `load_corpus` raises for a bad split or missing plays.
    """
    text = load_corpus(split, plays_dir)
    if cache_dir is None:
        return tokenize_corpus(tokenizer, text)
    key = f"{_sha256(tokenizer.backend_tokenizer.to_str())[:16]}-{_sha256(text)[:16]}"
    path = Path(cache_dir) / f"{split}-{key}.pt"
    if path.is_file():
        return torch.load(path)
    tokens = tokenize_corpus(tokenizer, text)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a concurrent or interrupted run never leaves a partial file at `path`.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(tokens, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return tokens


class PackedTextDataset(Dataset):
    """Non-overlapping `max_seq_len` blocks of a token stream; the incomplete tail is dropped.

    Item i is `{"input_ids": ids, "labels": ids.clone()}` with `ids` the int64 tokens
    `[i * max_seq_len, (i + 1) * max_seq_len)` of the stream. Labels are not shifted: the
    model shifts them when computing the loss. Raises ValueError if `tokens` is not 1-D,
    `max_seq_len` < 1, or the stream is shorter than one block.
    """

    def __init__(self, tokens: torch.Tensor, max_seq_len: int):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        if len(tokens) < max_seq_len:
            raise ValueError(f"{len(tokens)} tokens are fewer than one block of max_seq_len={max_seq_len}")
        self.tokens = tokens.long()
        self.max_seq_len = max_seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.max_seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} out of range for {len(self)} blocks")
        ids = self.tokens[index * self.max_seq_len : (index + 1) * self.max_seq_len].clone()
        return {"input_ids": ids, "labels": ids.clone()}


def _check_keys(cfg: Mapping, allowed: tuple[str, ...], required: tuple[str, ...], where: str) -> None:
    for key in cfg:
        if key not in allowed:
            raise ValueError(f"unknown key {where}.{key}; allowed keys: {list(allowed)}")
    for key in required:
        if key not in cfg:
            raise ValueError(f"missing key {where}.{key}; allowed keys: {list(allowed)}")


def build_text_dataloader(
    loader_cfg: Mapping,
    tokenizer: PreTrainedTokenizerFast,
    max_seq_len: int,
    device_batch_size: int,
    *,
    seed: int = 0,
) -> DataLoader:
    """DataLoader of packed blocks of one corpus split, sharded across ranks.

    `loader_cfg` (dict or OmegaConf DictConfig) holds `dataset` (`split`: train|validation,
    optional `plays_dir` and `cache_dir`, null for no cache), `shuffle` and `drop_last`
    (bools) and optional `num_workers` (default 0). Batches are dicts of int64 tensors
    `input_ids` and `labels` of shape (device_batch_size, max_seq_len). Shuffling uses
    Composer's DistributedSampler, so the order depends only on `seed` and the epoch
    Composer sets. Raises ValueError naming the key for an unknown or missing key or a
    bad split.
    """
    _check_keys(loader_cfg, LOADER_KEYS, ("dataset", "shuffle", "drop_last"), "loader")
    dataset_cfg = loader_cfg["dataset"]
    _check_keys(dataset_cfg, DATASET_KEYS, ("split",), "loader.dataset")
    for key in ("shuffle", "drop_last"):
        if not isinstance(loader_cfg[key], bool):
            raise ValueError(f"loader.{key} must be true or false, got {loader_cfg[key]!r}")
    tokens = load_split_tokens(
        tokenizer,
        dataset_cfg["split"],
        plays_dir=dataset_cfg.get("plays_dir"),
        cache_dir=dataset_cfg.get("cache_dir", DEFAULT_CACHE_DIR),
    )
    dataset = PackedTextDataset(tokens, max_seq_len)
    from composer.utils import dist  # here, not at the top: importing composer takes seconds

    sampler = dist.get_sampler(dataset, shuffle=loader_cfg["shuffle"], drop_last=loader_cfg["drop_last"], seed=seed)
    return DataLoader(
        dataset,
        batch_size=device_batch_size,
        sampler=sampler,
        drop_last=loader_cfg["drop_last"],
        num_workers=loader_cfg.get("num_workers", 0),
    )
