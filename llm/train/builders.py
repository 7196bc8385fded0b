"""What :mod:`llm.train.trainer` and :mod:`llm.train.evaluate` build from a validated config.

* :func:`run_data`: the prepared token shards a config names (train and eval loaders), the run's
  tokenizer (the shards' own, ``tokenizer.name`` or ``load_pretrained``'s, checked against the
  shards) — everything that can be refused, before anything is written.
* :func:`build_train_loader` / :func:`build_eval_loaders`: streaming text loaders (one evaluator
  per eval stream) or prompt/response fine-tuning loaders.
* :func:`load_pretrained`: a ``ComposerMosaicGPT`` and tokenizer from a bundle, .gguf or name.
* :func:`device_batch_size`, :func:`mark_fsdp_units`, :func:`token_counting_data_spec`.

Loader sections follow llm-foundry: ``{name: text | finetuning, dataset: {...}, drop_last,
num_workers, pin_memory, prefetch_factor, persistent_workers, timeout}``; a ``text`` dataset holds
MosaicML Streaming's keys (``local``, ``remote``, ``split``, ``streams``, ``shuffle``, ...; see
:mod:`llm.data.streaming`), a ``finetuning`` dataset ``path``, ``padding_side`` and ``shuffle``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from torch.utils.data import DataLoader, Subset

from llm.data.streaming import PreparedDataError, PreparedSplit, build_token_dataset, check_tokenizer, data_tokenizer
from llm.data.streaming import resolve_sources

LOADER_OPTIONS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "timeout")


@dataclass
class RunData:
    """The data side of a run, resolved and checked: the tokenizer and each text loader's sources."""

    tokenizer: Any
    train: list[PreparedSplit] = field(default_factory=list)
    eval: list[PreparedSplit] = field(default_factory=list)


def _text_sources(loader_cfg: Mapping[str, Any] | None, default_split: str) -> list[PreparedSplit]:
    if not loader_cfg or loader_cfg.get("name", "text") != "text":
        return []
    return resolve_sources(loader_cfg["dataset"], default_split)


def run_data(cfg: Mapping[str, Any]) -> RunData:
    """Resolve a config's data and tokenizer, refusing whatever does not fit, without writing anything.

    The tokenizer is ``load_pretrained``'s, else the one ``tokenizer.name`` names, else the one the
    training shards were prepared with. Every text source (train and eval) must have been
    prepared with that tokenizer (compared by hash), and ``model.vocab_size``, when given, must
    hold its ids.

    Raises:
        PreparedDataError: for missing or incomplete shards, a tokenizer or vocabulary that does
            not match them (naming both), or a fine-tuning-only config without a tokenizer.
        FileNotFoundError, ValueError: for a ``load_pretrained`` or ``tokenizer.name`` that cannot
            be loaded.
    """
    from llm.data.tokenizer import load_tokenizer

    train = _text_sources(cfg.get("train_loader"), "train")
    evals = _text_sources(cfg.get("eval_loader"), "validation")
    sources = train + evals
    if cfg.get("load_pretrained"):
        tokenizer, what = load_tokenizer(cfg["load_pretrained"]), f"the tokenizer of {cfg['load_pretrained']}"
    elif (cfg.get("tokenizer") or {}).get("name"):
        tokenizer, what = load_tokenizer(cfg["tokenizer"]["name"]), f"tokenizer.name {cfg['tokenizer']['name']}"
    elif sources:
        tokenizer, _ = data_tokenizer(sources)
        what = f"the tokenizer of {sources[0].local}"
    else:
        raise PreparedDataError(
            "no tokenizer: fine-tuning loaders need load_pretrained or tokenizer.name (a tokenizer folder or model)"
        )
    vocab_size = (cfg.get("model") or {}).get("vocab_size")
    for group in (train, evals):
        if group:
            check_tokenizer(group, tokenizer, vocab_size=vocab_size, what=what)
    return RunData(tokenizer, train, evals)


def _loader_options(loader_cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: loader_cfg[k] for k in LOADER_OPTIONS if loader_cfg.get(k) is not None}


def build_train_loader(loader_cfg: Mapping[str, Any], sources: list[PreparedSplit], tokenizer, max_seq_len: int,
                       device_batch_size: int, *, seed: int, bucketed: bool = False) -> DataLoader:
    """The training loader: a Streaming dataset over ``sources`` (text) or padded fine-tuning batches.

    ``bucketed`` (a compiled run): fine-tuning batches are padded to power-of-two lengths
    (:class:`~llm.data.finetune.PaddingCollator`'s ``bucket_to``), so the model compiles once per
    length. Text batches are ``{"input_ids", "labels"}`` int64 (device_batch_size, max_seq_len); the
    dataset's ``state_dict`` goes into Composer's checkpoints, so a resumed run sees the batches
    an uninterrupted run would.

    Raises:
        PreparedDataError: if ``max_seq_len`` exceeds the prepared rows.
    """
    if loader_cfg.get("name", "text") == "text":
        dataset = build_token_dataset(sources, loader_cfg["dataset"], max_seq_len=max_seq_len,
                                      device_batch_size=device_batch_size, seed=seed)
        return DataLoader(dataset, batch_size=device_batch_size, drop_last=loader_cfg.get("drop_last", True),
                          **_loader_options(loader_cfg))
    return _finetune_loader(loader_cfg, tokenizer, max_seq_len, device_batch_size, seed=seed, bucketed=bucketed)


def _finetune_loader(loader_cfg: Mapping[str, Any], tokenizer, max_seq_len: int, device_batch_size: int, *,
                     seed: int, indices: list[int] | None = None, bucketed: bool = False) -> DataLoader:
    from composer.utils import dist

    from llm.data.finetune import PaddingCollator, build_finetune_dataset, use_chat_template

    dataset_cfg = loader_cfg["dataset"]
    chat_template = dataset_cfg.get("chat_template", "auto")
    use_chat_template(tokenizer, chat_template)
    chat = chat_template != "none" and bool(getattr(tokenizer, "chat_template", None))
    dataset = build_finetune_dataset(dataset_cfg["path"], tokenizer, max_seq_len, chat)
    if indices is not None:
        dataset = Subset(dataset, indices)
    drop_last = loader_cfg.get("drop_last", False)
    sampler = dist.get_sampler(dataset, shuffle=dataset_cfg.get("shuffle", False), drop_last=drop_last, seed=seed)
    return DataLoader(dataset, batch_size=device_batch_size, sampler=sampler, drop_last=drop_last,
                      collate_fn=PaddingCollator(tokenizer.pad_token_id, dataset_cfg.get("padding_side", "right"),
                                                 bucket_to=max_seq_len if bucketed else None),
                      **_loader_options(loader_cfg))


@dataclass
class EvalSet:
    """One evaluator's data: its label, loader and what bits per byte need.

    ``sequences`` / ``available``: sequences evaluated / in the split; ``predicted_tokens``:
    tokens whose loss is scored; ``tokens_per_byte``: of the whole split (text) or of the
    responses (fine-tuning).
    """

    label: str
    loader: DataLoader
    sequences: int
    available: int
    predicted_tokens: int
    tokens_per_byte: float
    split: str


def spread_indices(n: int, max_sequences: int | None) -> list[int]:
    """All of ``range(n)``, or ``max_sequences`` indices evenly spaced from the first to the last."""
    if max_sequences is None or max_sequences >= n:
        return list(range(n))
    if max_sequences == 1:
        return [0]
    return sorted({round(i * (n - 1) / (max_sequences - 1)) for i in range(max_sequences)})


def build_eval_loaders(loader_cfg: Mapping[str, Any], sources: list[PreparedSplit], tokenizer, seq_len: int,
                       batch_size: int, *, seed: int, max_sequences: int | None = None,
                       bucketed: bool = False) -> list[EvalSet]:
    """One :class:`EvalSet` per eval stream (text) or one for a fine-tuning file.

    Text: the split's ``seq_len``-token sequences in order (or ``max_sequences`` of them evenly
    spread), each rank scoring its share; tokens per byte are the split's (its manifest counts).
    Fine-tuning: the responses' loss, labelled after the file; ``bucketed`` as
    :func:`build_train_loader`'s.

    Raises:
        PreparedDataError: if ``seq_len`` exceeds the prepared rows.
    """
    from composer.utils import dist

    if loader_cfg.get("name", "text") != "text":
        from llm.data.finetune import IGNORE_INDEX, load_jsonl

        path = loader_cfg["dataset"]["path"]
        examples = load_jsonl(path)
        indices = spread_indices(len(examples), max_sequences)
        loader = _finetune_loader({**loader_cfg, "drop_last": False}, tokenizer, seq_len, batch_size, seed=seed,
                                  indices=indices, bucketed=bucketed)
        predicted = sum(int((item["labels"][1:] != IGNORE_INDEX).sum()) for item in loader.dataset)
        n_bytes = sum(len(examples[i]["response"].encode("utf-8")) for i in indices)
        return [EvalSet(Path(path).stem, loader, len(indices), len(examples), predicted, predicted / n_bytes,
                        str(path))]
    sets = []
    for source in sources:
        options = {"shuffle": False, **{k: v for k, v in loader_cfg["dataset"].items()
                                        if k in ("download_retry", "download_timeout", "validate_hash")}}
        dataset = build_token_dataset([source], options, max_seq_len=seq_len, device_batch_size=batch_size,
                                      seed=seed)
        indices = spread_indices(dataset.num_samples, max_sequences)
        subset = Subset(dataset, indices)
        loader = DataLoader(subset, batch_size=batch_size, sampler=dist.get_sampler(subset, shuffle=False),
                            **_loader_options(loader_cfg))
        sets.append(EvalSet(source.name, loader, len(indices), dataset.num_samples, len(indices) * (seq_len - 1),
                            source.tokens_per_byte, f"{source.local}:{source.split}"))
    return sets


def build_model(cfg: Mapping[str, Any], tokenizer):
    """The run's ``ComposerMosaicGPT``: ``load_pretrained``'s weights, else a new model of ``cfg["model"]``
    whose ``vocab_size`` defaults to the tokenizer's size (seed first for reproducible weights).

    Raises:
        FileNotFoundError, ValueError: see :func:`load_pretrained` and :class:`llm.config.MosaicGPTConfig`.
    """
    from llm.config import MosaicGPTConfig
    from llm.train.composer_model import ComposerMosaicGPT

    if cfg.get("load_pretrained"):
        return load_pretrained(cfg["load_pretrained"])[0]
    model_cfg = dict(cfg["model"])
    if model_cfg.get("vocab_size") is None:
        model_cfg["vocab_size"] = len(tokenizer)
    return ComposerMosaicGPT(MosaicGPTConfig.from_dict(model_cfg))


def load_pretrained(name_or_path: str | os.PathLike):
    """``(ComposerMosaicGPT, tokenizer)`` of a bundle directory, .gguf file or registered name.

    The model is in training mode (Composer switches modes itself); its config (``max_seq_len``,
    vocabulary, ...) is the pretrained one.

    Raises:
        FileNotFoundError, ValueError: see :meth:`llm.model.MosaicGPT.from_pretrained`.
    """
    from llm.data.tokenizer import load_tokenizer
    from llm.model import MosaicGPT
    from llm.train.composer_model import ComposerMosaicGPT

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

