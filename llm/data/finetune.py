"""Fine-tuning data: prompt/response pairs from JSONL, padded per batch, loss on responses only.

Each line of the file is ``{"prompt": "...", "response": "..."}``. An example becomes
``prompt tokens + response tokens + eos``; its labels are -100 on the prompt (no loss there)
and the token ids on the response and eos. Batches are padded to their longest example, on the
left or the right, with ``attention_mask`` 0 on padding and labels -100 there, so padding never
changes a real token's loss: the model takes the mask as both query and key padding mask and
derives positions from it (as llm-foundry's finetuning collator, with explicit masks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from torch.utils.data import DataLoader, Dataset

IGNORE_INDEX = -100
PADDING_SIDES = ("left", "right")


def load_jsonl(path: str | Path) -> list[dict[str, str]]:
    """Read prompt/response pairs.

    Raises:
        FileNotFoundError: if there is no such file.
        ValueError: naming the line of a record that is not JSON or lacks a string ``prompt``
            or ``response`` (an empty response is refused: it would train nothing).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no fine-tuning data at {path}")
    examples = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err})") from err
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("prompt", "response")):
            raise ValueError(f'{path}:{number}: each line must be {{"prompt": str, "response": str}}')
        if not record["response"]:
            raise ValueError(f"{path}:{number}: the response is empty")
        examples.append({"prompt": record["prompt"], "response": record["response"]})
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples


class FinetuneDataset(Dataset):
    """Tokenized examples: ``{"input_ids": (n,) int64, "labels": (n,) int64}``, unpadded.

    Raises:
        ValueError: if an example is longer than ``max_seq_len`` tokens, naming it.
    """

    def __init__(self, examples: list[Mapping[str, str]], tokenizer, max_seq_len: int):
        self.items = []
        eos = tokenizer.eos_token_id
        for i, ex in enumerate(examples):
            prompt = tokenizer(ex["prompt"], add_special_tokens=False).input_ids
            response = tokenizer(ex["response"], add_special_tokens=False).input_ids + [eos]
            ids = prompt + response
            if len(ids) > max_seq_len:
                raise ValueError(
                    f"fine-tuning example {i} has {len(ids)} tokens, more than max_seq_len={max_seq_len}"
                )
            self.items.append({
                "input_ids": torch.tensor(ids, dtype=torch.long),
                "labels": torch.tensor([IGNORE_INDEX] * len(prompt) + response, dtype=torch.long),
            })

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


class PaddingCollator:
    """Pads a list of examples into a batch: ``input_ids``, ``labels`` and ``attention_mask``, (b, max n).

    Args:
        pad_token_id: the id put at padding positions of ``input_ids``.
        padding_side: ``"left"`` or ``"right"``.
        bucket_to: if given, batches are padded to the next power of two (at least 16) of their
            longest example, at most ``bucket_to`` (the context): a handful of shapes, so a
            compiled model compiles once per bucket instead of tracing dynamic lengths (which
            crashes inductor's backward in torch 2.7 with a size/stride assertion). Padding
            with labels ``IGNORE_INDEX`` changes no loss.

    Raises:
        ValueError: for another padding side.
    """

    def __init__(self, pad_token_id: int, padding_side: str = "right", bucket_to: int | None = None):
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.bucket_to = bucket_to

    def __call__(self, examples: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        width = max(len(ex["input_ids"]) for ex in examples)
        if self.bucket_to is not None:
            width = max(width, min(self.bucket_to, 1 << max(width - 1, 15).bit_length()))
        batch = {"input_ids": [], "labels": [], "attention_mask": []}
        for ex in examples:
            n = len(ex["input_ids"])
            pieces = {
                "input_ids": (ex["input_ids"], torch.full((width - n,), self.pad_token_id, dtype=torch.long)),
                "labels": (ex["labels"], torch.full((width - n,), IGNORE_INDEX, dtype=torch.long)),
                "attention_mask": (torch.ones(n, dtype=torch.long), torch.zeros(width - n, dtype=torch.long)),
            }
            for key, (real, pad) in pieces.items():
                batch[key].append(torch.cat([pad, real] if self.padding_side == "left" else [real, pad]))
        return {key: torch.stack(rows) for key, rows in batch.items()}


def build_finetune_dataset(path: str | Path, tokenizer, max_seq_len: int) -> FinetuneDataset:
    """The tokenized examples of a JSONL file of prompt/response pairs (see :func:`load_jsonl`)."""
    return FinetuneDataset(load_jsonl(path), tokenizer, max_seq_len)
