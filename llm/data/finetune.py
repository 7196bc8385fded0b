"""Fine-tuning data: prompt/response pairs from JSONL, padded per batch, loss on responses only.

Each line of the file is ``{"prompt": "...", "response": "..."}``. Under a chat template (the
default, :func:`use_chat_template`) an example is a user turn and the assistant's reply as the
template renders them: the prompt's tokens are the conversation up to the opened assistant turn
(``add_generation_prompt``), the response's the rest, the end-of-turn marker included, so the
model learns where its turn ends and the server's chat route can talk to it. Without one
(``chat_template: none``) an example is ``prompt tokens + response tokens + eos``. The labels
are -100 on the prompt (no loss there) and the token ids on the response. Batches are padded
to their longest example, on the left or the right, with ``attention_mask`` 0 on padding and
labels -100 there, so padding never changes a real token's loss: the model takes the mask as
both query and key padding mask and derives positions from it (as llm-foundry's finetuning
collator, with explicit masks).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Mapping

import torch
from torch.utils.data import DataLoader, Dataset

IGNORE_INDEX = -100
PADDING_SIDES = ("left", "right")
#: ``auto``: the tokenizer's own chat template, else ChatML; ``chatml``: ChatML; ``none``: raw text.
CHAT_TEMPLATES = ("auto", "chatml", "none")


def use_chat_template(tokenizer, chat_template: str = "auto") -> tuple[int, ...]:
    """Give ``tokenizer`` the chat template that fine-tuning renders examples with, and return the
    ids that end the assistant's turn (the special tokens the template closes a reply with, then
    eos): a model fine-tuned this way stops there, and its exported bundle carries the template.

    ``auto`` keeps a template the tokenizer has (SmolLM2's, say) and sets ChatML
    (:data:`llm.data.tokenizer.CHATML_TEMPLATE`) otherwise, or, where the tokenizer lacks ChatML's
    tokens too, warns and trains on plain text as ``none``; ``chatml`` sets ChatML; ``none`` sets
    nothing. Both fallbacks return ``(eos,)``. ChatML needs ``<|im_start|>`` and ``<|im_end|>`` as tokens,
    which every tokenizer trained by ``llm prepare`` reserves.

    Raises:
        ValueError: for another value, ``chatml`` on a tokenizer without its tokens, or a template that does
            not render a conversation as its prompt followed by the reply.
    """
    from llm.data.tokenizer import CHATML_TEMPLATE, CHATML_TOKENS

    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(f"chat_template must be one of {CHAT_TEMPLATES}, got {chat_template!r}")
    if chat_template == "none":
        return (tokenizer.eos_token_id,)
    if chat_template == "chatml" or not getattr(tokenizer, "chat_template", None):
        vocab = tokenizer.get_vocab()
        missing = [token for token in CHATML_TOKENS if token not in vocab]
        if missing and chat_template == "auto":  # a tokenizer trained before ChatML was reserved: plain text
            warnings.warn("chat_template auto: the tokenizer has no chat template and no ChatML tokens; fine-tuning "
                          "on prompt + response + eos as plain text (chat_template: none)", stacklevel=2)
            return (tokenizer.eos_token_id,)
        if missing:
            raise ValueError(f"chat_template {chat_template}: ChatML needs the tokens {' '.join(CHATML_TOKENS)}, which "
                             f"this tokenizer lacks ({' '.join(missing)}; tokenizers trained by llm prepare have them): "
                             "use a tokenizer with a chat template of its own, or chat_template: none")
        tokenizer.chat_template = CHATML_TEMPLATE
    prompt, reply = _render(tokenizer, "", "x")
    specials = set(tokenizer.all_special_ids) | {int(i) for i in tokenizer.added_tokens_decoder}
    ends = [i for i in tokenizer(reply, add_special_tokens=False).input_ids if i in specials]
    return tuple(dict.fromkeys([*ends, tokenizer.eos_token_id]))


def _render(tokenizer, prompt: str, response: str) -> tuple[str, str]:
    """(prompt text up to the opened assistant turn, the reply's text with its end-of-turn marker)."""
    user = [{"role": "user", "content": prompt}]
    head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": response}], tokenize=False)
    if not whole.startswith(head):
        raise ValueError("the tokenizer's chat template does not render a conversation as its generation prompt "
                         "followed by the reply; fine-tune with chat_template: none")
    return head, whole[len(head):]


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
    """Tokenized examples: ``{"input_ids": (n,) int64, "labels": (n,) int64}``, unpadded; rendered
    with the tokenizer's chat template when ``chat`` (set it with :func:`use_chat_template`).

    Raises:
        ValueError: if an example is longer than ``max_seq_len`` tokens, naming it.
    """

    def __init__(self, examples: list[Mapping[str, str]], tokenizer, max_seq_len: int, chat: bool = False):
        self.items = []
        eos = tokenizer.eos_token_id
        for i, ex in enumerate(examples):
            if chat:
                head, reply = _render(tokenizer, ex["prompt"], ex["response"])
                prompt = tokenizer(head, add_special_tokens=False).input_ids
                response = tokenizer(reply, add_special_tokens=False).input_ids
            else:
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


def build_finetune_dataset(path: str | Path, tokenizer, max_seq_len: int, chat: bool = False) -> FinetuneDataset:
    """The tokenized examples of a JSONL file of prompt/response pairs (see :func:`load_jsonl`),
    rendered with the tokenizer's chat template when ``chat``."""
    return FinetuneDataset(load_jsonl(path), tokenizer, max_seq_len, chat)
