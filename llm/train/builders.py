"""Pieces :mod:`llm.train` uses for fine-tuning, pretrained starts and several processes.

* :func:`build_dataloader`: dispatches on ``<loader>.dataset.kind``: ``text`` (the default; packed
  blocks of a Shakespeare split, :func:`llm.data.build_text_dataloader`) or ``finetune``
  (prompt/response JSONL, :func:`llm.data.finetune.build_finetune_dataloader`).
* :func:`load_pretrained`: a ``ComposerMosaicGPT`` and tokenizer from an exported bundle, a .gguf
  file or a registered name (config key ``load_pretrained``).
* :func:`device_batch_size`: a global batch size split over the ranks.
* :func:`mark_fsdp_units`: makes Composer's FSDP wrap each transformer block on its own.
* :func:`token_counting_data_spec`: lets Composer weight microbatches by scored tokens.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from torch.utils.data import DataLoader

DATASET_KINDS = ("text", "finetune")
FINETUNE_LOADER_KEYS = ("dataset", "shuffle", "drop_last", "num_workers")


def dataset_kind(loader_cfg: Mapping[str, Any]) -> str:
    """``loader_cfg["dataset"]["kind"]``, ``"text"`` when absent.

    Raises:
        ValueError: for another kind.
    """
    kind = loader_cfg["dataset"].get("kind", "text")
    if kind not in DATASET_KINDS:
        raise ValueError(f"loader.dataset.kind must be one of {list(DATASET_KINDS)}, got {kind!r}")
    return kind


def build_dataloader(loader_cfg: Mapping[str, Any], tokenizer, max_seq_len: int, device_batch_size: int, *,
                     seed: int = 0) -> DataLoader:
    """The loader for a ``train_loader`` / ``eval_loader`` section, by ``dataset.kind``.

    ``text``: see :func:`llm.data.build_text_dataloader` (``dataset``: ``split``, ``plays_dir``,
    ``cache_dir``). ``finetune``: ``dataset``: ``path`` (JSONL of ``{"prompt", "response"}``),
    ``padding_side``; batches are padded to their longest example (see
    :mod:`llm.data.finetune`). Both shard by rank with Composer's distributed sampler.

    Raises:
        ValueError: for an unknown kind, key or value, naming it.
    """
    from llm.data import build_text_dataloader
    from llm.data.finetune import build_finetune_dataloader

    kind = dataset_kind(loader_cfg)
    dataset_cfg = {k: v for k, v in loader_cfg["dataset"].items() if k != "kind"}
    if kind == "text":
        return build_text_dataloader({**loader_cfg, "dataset": dataset_cfg}, tokenizer, max_seq_len,
                                     device_batch_size, seed=seed)
    unknown = sorted(set(loader_cfg) - set(FINETUNE_LOADER_KEYS))
    if unknown:
        raise ValueError(f"unknown loader key(s) {unknown}; allowed keys: {list(FINETUNE_LOADER_KEYS)}")
    for key in ("shuffle", "drop_last"):
        if not isinstance(loader_cfg.get(key), bool):
            raise ValueError(f"loader.{key} must be true or false, got {loader_cfg.get(key)!r}")
    if "path" not in dataset_cfg:
        raise ValueError("a finetune loader needs dataset.path (a JSONL file of prompt/response pairs)")
    return build_finetune_dataloader(
        loader_cfg["dataset"], tokenizer, max_seq_len, device_batch_size, shuffle=loader_cfg["shuffle"],
        drop_last=loader_cfg["drop_last"], num_workers=loader_cfg.get("num_workers", 0), seed=seed,
    )


def load_pretrained(name_or_path: str | os.PathLike):
    """``(ComposerMosaicGPT, tokenizer)`` of a bundle directory, .gguf file or registered name.

    The model is in training mode (Composer switches modes itself); its config (``max_seq_len``,
    vocabulary, ...) is the pretrained one.

    Raises:
        FileNotFoundError, ValueError: see :meth:`llm.model.MosaicGPT.from_pretrained`.
    """
    from llm.train.composer_model import ComposerMosaicGPT
    from llm.convert.registry import load_tokenizer
    from llm.model import MosaicGPT

    tokenizer = load_tokenizer(name_or_path)
    model = MosaicGPT.from_pretrained(name_or_path).train()
    if model.config.vocab_size < len(tokenizer):
        raise ValueError(
            f"{name_or_path}: the tokenizer has {len(tokenizer)} tokens but the model only {model.config.vocab_size}"
        )
    return ComposerMosaicGPT(model), tokenizer


def device_batch_size(global_batch_size: int, world_size: int | None = None) -> int:
    """Sequences per rank for a global batch size.

    Raises:
        ValueError: if the global batch does not split evenly over the ranks.
    """
    if world_size is None:
        from composer.utils import dist

        world_size = dist.get_world_size()
    if global_batch_size % world_size:
        raise ValueError(
            f"global_train_batch_size {global_batch_size} is not divisible by the {world_size} processes"
        )
    return global_batch_size // world_size


def mark_fsdp_units(composer_model, *, activation_checkpointing: bool = False) -> None:
    """Mark each transformer block as its own FSDP unit (``_fsdp_wrap``), as llm-foundry's MPT does.

    Composer's FSDP wraps the children of the ``ComposerModel`` (here ``.model``), and inside them
    only the modules marked ``_fsdp_wrap = True`` (or chosen by a ``fsdp_wrap_fn``): unmarked, the
    whole model is a single unit, gathered whole for every forward. With
    ``activation_checkpointing`` the blocks are also marked ``_activation_checkpointing`` (used
    when ``parallelism_config.fsdp.activation_checkpointing`` is true).
    """
    for block in composer_model.model.blocks:
        block._fsdp_wrap = True
        if activation_checkpointing:
            block._activation_checkpointing = True


def heldout_tokens_per_byte(loader_cfg: Mapping[str, Any], tokenizer) -> float:
    """Tokens per UTF-8 byte of the text whose tokens an eval loader scores, for bits per byte.

    ``text``: the whole split (:func:`llm.data.tokens_per_byte`). ``finetune``: the responses,
    counting each example's eos token (scored too) but no bytes for it, so bits per byte include
    the cost of ending the reply.
    """
    from llm.data import load_corpus, tokens_per_byte
    from llm.data.finetune import load_jsonl

    dataset_cfg = loader_cfg["dataset"]
    if dataset_kind(loader_cfg) == "text":
        return tokens_per_byte(tokenizer, load_corpus(dataset_cfg["split"], dataset_cfg.get("plays_dir")))
    responses = [ex["response"] for ex in load_jsonl(dataset_cfg["path"])]
    n_tokens = sum(len(tokenizer(r, add_special_tokens=False).input_ids) + 1 for r in responses)
    return n_tokens / sum(len(r.encode("utf-8")) for r in responses)


def token_counting_data_spec(dataloader: DataLoader):
    """The train loader as a Composer ``DataSpec`` that counts loss-generating tokens.

    With ``Trainer(accumulate_train_batch_on_tokens=True)``, Composer then weights each
    microbatch's mean loss by its share of the batch's scored tokens (targets that are not -100
    after the shift) instead of its share of the examples. For packed text the two are the same;
    for padded fine-tuning batches only the token weighting gives microbatches (and ranks) the
    full batch's gradient: the mean over all its scored tokens. ``total`` stays Composer's
    default count (every position), so ``timestamp.token`` is unchanged.
    """
    from composer.core import DataSpec

    from llm.train.composer_model import IGNORE_INDEX, shift_labels

    def num_tokens(batch) -> dict[str, int]:
        return {"total": int(batch["input_ids"].numel()),
                "loss_generating": int((shift_labels(batch["labels"]) != IGNORE_INDEX).sum())}

    return DataSpec(dataloader, get_num_tokens_in_batch=num_tokens)
