"""Evaluate a training checkpoint, an exported bundle or a registered pretrained model on held-out text.

``python scripts/eval.py CONFIG.yaml load_path=CKPT [key=value ...]`` rebuilds the model of a
training config (``model`` section, tokenizer from ``<save_folder>/tokenizer``) and loads the
checkpoint's weights; ``python scripts/eval.py CONFIG.yaml --model DIR_OR_NAME [key=value ...]``
evaluates an exported bundle (``<save_folder>/model``) or a registered model such as
``smollm2-135m-instruct``, with that model's own tokenizer (the config's ``model`` and
``tokenizer`` sections are then ignored).

Evaluation runs through Composer's ``Trainer.eval``, one :class:`~composer.core.Evaluator` per
split, over packed blocks of the Shakespeare split tokenized with the model's tokenizer. For each
it reports cross-entropy in nats per predicted token, perplexity, tokens per byte of the
evaluated text and bits per byte = nats/token * tokens/byte / ln 2 (comparable across
tokenizers), prints a table and writes JSON.

Config keys used: ``eval_loader`` (its ``dataset.split`` is the default split; ``plays_dir``,
``cache_dir`` apply to every split), ``device_eval_batch_size`` (default
``global_train_batch_size``), ``precision``, ``seed``, ``progress_bar``, ``save_folder`` and, for
a checkpoint, ``model``, ``tokenizer`` and ``load_path`` (or ``load_pretrained``, for a run that
started from a pretrained model). An ``eval_loader`` of ``dataset.kind: finetune`` gives one
evaluator, named after its JSONL file, scoring the responses (and their eos) only, with tokens
per byte of the responses. Evaluation options (usually given on the
command line, e.g. ``eval_max_sequences=32``), none of which a training config needs:

* ``eval_splits``: list of splits to evaluate (default: ``[eval_loader.dataset.split]``).
* ``eval_seq_len``: tokens per block (default: the model's ``max_seq_len``, at most
  :data:`DEFAULT_MAX_SEQ_LEN`).
* ``eval_max_sequences``: evaluate at most this many blocks per split, evenly spaced over the
  split (default: all). The training config's ``eval_subset_num_batches`` (meant for evaluation
  during training) is not used.
* ``eval_output``: the JSON file (default ``<save_folder>/eval.json`` for a checkpoint,
  ``<bundle>/eval.json`` for a bundle, ``<model file>.eval.json`` for a registered name).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Subset

DEFAULT_MAX_SEQ_LEN = 512
EVAL_KEYS = ("eval_splits", "eval_seq_len", "eval_max_sequences", "eval_output")
TOKENIZER_DIR = "tokenizer"  # as llm.train.TOKENIZER_DIR
EVAL_FILE = "eval.json"
METRIC_NAMES = ("LanguageCrossEntropy", "LanguagePerplexity")


def _to_dict(cfg: Mapping | DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def block_texts(tokenizer, text: str, max_seq_len: int, indices: Sequence[int]) -> list[str]:
    """The text behind packed blocks ``indices`` of ``text`` tokenized as :func:`llm.data.tokenize_corpus` does.

    Block i holds tokens ``[i * max_seq_len, (i + 1) * max_seq_len)``; its text runs from the end
    of the token before it to the end of its last token (character offsets from the tokenizer).

    Raises:
        IndexError: for a block beyond the last whole block.
    """
    from llm.data.text_dataset import _CHUNK_BOUNDARY

    chunks = _CHUNK_BOUNDARY.split(text)
    encodings = tokenizer.backend_tokenizer.encode_batch(chunks, add_special_tokens=False)
    ends, start = [], 0
    for chunk, encoding in zip(chunks, encodings):
        ends.extend(start + end for _, end in encoding.offsets)
        start += len(chunk)
    n_blocks = len(ends) // max_seq_len
    texts = []
    for i in indices:
        if not 0 <= i < n_blocks:
            raise IndexError(f"block {i} out of range for {n_blocks} blocks")
        first = ends[i * max_seq_len - 1] if i > 0 else 0
        texts.append(text[first : ends[(i + 1) * max_seq_len - 1]])
    return texts


def spread_indices(n_blocks: int, max_sequences: int | None) -> list[int]:
    """All block indices, or ``max_sequences`` of them evenly spaced from the first to the last."""
    if max_sequences is None or max_sequences >= n_blocks:
        return list(range(n_blocks))
    if max_sequences < 1:
        raise ValueError(f"eval_max_sequences must be positive, got {max_sequences}")
    if max_sequences == 1:
        return [0]
    return sorted({round(i * (n_blocks - 1) / (max_sequences - 1)) for i in range(max_sequences)})


def _subset_loader(loader: DataLoader, indices: Sequence[int], batch_size: int) -> DataLoader:
    from composer.utils import dist

    subset = Subset(loader.dataset, list(indices))
    return DataLoader(subset, batch_size=batch_size, drop_last=False, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, sampler=dist.get_sampler(subset, shuffle=False, drop_last=False))


def _finetune_evaluator(loader_cfg, tokenizer, max_seq_len: int, batch_size: int, max_sequences: int | None):
    """``(label, loader, info)`` for a ``kind: finetune`` eval loader: the loss on the responses.

    Tokens per byte count each scored response token and eos over the responses' bytes.
    """
    from llm.data.finetune import IGNORE_INDEX, load_jsonl
    from llm.train.builders import build_dataloader

    loader_cfg = {**loader_cfg, "shuffle": False, "drop_last": False}
    loader = build_dataloader(loader_cfg, tokenizer, max_seq_len, batch_size)
    n_examples = len(loader.dataset)
    indices = spread_indices(n_examples, max_sequences)
    if len(indices) < n_examples:
        loader = _subset_loader(loader, indices, batch_size)
    examples = load_jsonl(loader_cfg["dataset"]["path"])
    predicted = sum(int((loader.dataset[i]["labels"][1:] != IGNORE_INDEX).sum()) for i in range(len(loader.dataset)))
    n_bytes = sum(len(examples[i]["response"].encode("utf-8")) for i in indices)
    label = Path(loader_cfg["dataset"]["path"]).stem
    return label, loader, {"split": str(loader_cfg["dataset"]["path"]), "sequences": len(indices),
                           "blocks": n_examples, "predicted_tokens": predicted, "tokens_per_byte": predicted / n_bytes}


def load_for_eval(cfg: Mapping[str, Any], *, load_path: str | None = None, model: str | None = None):
    """The model to evaluate, as ``(ComposerMosaicGPT, tokenizer, source)``.

    With ``model`` (a bundle directory, .gguf file or registered name) the weights are loaded
    here; with ``load_path`` the model is built from ``cfg["model"]`` with the run's tokenizer and
    the checkpoint is checked (:func:`llm.train.checkpointing.check_checkpoint`); Composer loads it.

    Raises:
        ValueError: if both or neither of ``load_path`` and ``model`` are given, or the checkpoint
            does not fit (naming the file and tensors).
        FileNotFoundError: for a missing model, checkpoint or run tokenizer.
    """
    from llm.train.checkpointing import check_checkpoint
    from llm.train.composer_model import ComposerMosaicGPT
    from llm.config import MosaicGPTConfig
    from llm.convert.registry import load_tokenizer
    from llm.model import MosaicGPT

    if (load_path is None) == (model is None):
        raise ValueError("give exactly one of load_path=CHECKPOINT and --model DIR_OR_NAME")
    if model is not None:
        tokenizer = load_tokenizer(model)
        composer_model = ComposerMosaicGPT(MosaicGPT.from_pretrained(model))
        return composer_model, tokenizer, {"model": str(model)}
    if cfg.get("load_pretrained"):  # a fine-tuning run: its model and tokenizer are the pretrained ones
        from llm.train.builders import load_pretrained

        composer_model, tokenizer = load_pretrained(cfg["load_pretrained"])
        check_checkpoint(load_path, composer_model)
        return composer_model, tokenizer, {"checkpoint": str(load_path)}
    tokenizer_dir = Path(cfg["save_folder"]) / TOKENIZER_DIR
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no run tokenizer in {tokenizer_dir}: evaluate a checkpoint with the config (save_folder) "
            "of the run that wrote it, or evaluate its exported bundle with --model"
        )
    tokenizer = load_tokenizer(tokenizer_dir)
    model_cfg = {**cfg["model"], "vocab_size": len(tokenizer)}
    composer_model = ComposerMosaicGPT(MosaicGPTConfig.from_dict(model_cfg))
    check_checkpoint(load_path, composer_model)
    return composer_model, tokenizer, {"checkpoint": str(load_path)}


def default_output(cfg: Mapping[str, Any], *, load_path: str | None, model: str | None) -> Path:
    """Where the JSON results go when ``eval_output`` is not set (see the module docstring)."""
    if model is None:
        return Path(cfg["save_folder"]) / EVAL_FILE
    from llm.convert.registry import resolve

    kind, path = resolve(model)
    return path / EVAL_FILE if kind == "bundle" else path.with_name(path.stem + ".eval.json")


def evaluate(
    cfg: Mapping | DictConfig,
    *,
    load_path: str | None = None,
    model: str | None = None,
    output: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint (``load_path``, or ``cfg["load_path"]``) or a model (``model``).

    Returns:
        The JSON written to ``output`` (default: ``cfg["eval_output"]`` or
        :func:`default_output`): the source (``checkpoint`` or ``model``), ``num_parameters``,
        ``vocab_size``, ``seq_len``, ``wall_seconds`` and ``evaluators``, by label (the split):
        ``split``, ``sequences`` (blocks evaluated), ``blocks`` (in the split),
        ``predicted_tokens``, ``nats_per_token``, ``perplexity`` (exp of it),
        ``composer_perplexity`` (Composer's ``LanguagePerplexity``), ``tokens_per_byte``,
        ``bits_per_byte`` and ``seconds``.

    Raises:
        ValueError: see :func:`load_for_eval`; for a bad split or option.
    """
    from composer import Trainer
    from composer.core import Evaluator
    from composer.utils import dist

    from llm.data import build_text_dataloader, load_corpus, tokens_per_byte
    from llm.train.builders import dataset_kind

    started = time.perf_counter()
    cfg = _to_dict(cfg)
    if load_path is None and model is None:
        load_path = cfg.get("load_path")
    composer_model, tokenizer, source = load_for_eval(cfg, load_path=load_path, model=model)
    max_len = composer_model.config.max_seq_len
    seq_len = int(cfg.get("eval_seq_len") or min(max_len, DEFAULT_MAX_SEQ_LEN))
    if not 1 < seq_len <= max_len:
        raise ValueError(f"eval_seq_len must be in [2, max_seq_len={max_len}], got {seq_len}")
    batch_size = int(cfg.get("device_eval_batch_size") or cfg.get("global_train_batch_size") or 8)
    max_sequences = cfg.get("eval_max_sequences")
    evaluators, infos = [], {}
    loader_cfg = dict(cfg["eval_loader"])
    if dataset_kind(loader_cfg) == "finetune":
        label, loader, info = _finetune_evaluator(loader_cfg, tokenizer, max_len, batch_size, max_sequences)
        seq_len = max_len
        evaluators.append(Evaluator(label=label, dataloader=loader, metric_names=list(METRIC_NAMES)))
        infos[label] = info
    dataset_cfg = dict(loader_cfg["dataset"])
    splits = [] if evaluators else list(cfg.get("eval_splits") or [dataset_cfg["split"]])
    for split in splits:
        split_loader_cfg = {**loader_cfg, "dataset": {**dataset_cfg, "split": split}, "shuffle": False,
                            "drop_last": False}
        loader = build_text_dataloader(split_loader_cfg, tokenizer, seq_len, batch_size, seed=cfg.get("seed", 0))
        n_blocks = len(loader.dataset)
        indices = spread_indices(n_blocks, max_sequences)
        text = load_corpus(split, dataset_cfg.get("plays_dir"))
        if len(indices) < n_blocks:
            loader = _subset_loader(loader, indices, batch_size)
            text = "".join(block_texts(tokenizer, text, seq_len, indices))
        evaluators.append(Evaluator(label=split, dataloader=loader, metric_names=list(METRIC_NAMES)))
        infos[split] = {"split": split, "sequences": len(indices), "blocks": n_blocks,
                        "predicted_tokens": len(indices) * (seq_len - 1),
                        "tokens_per_byte": tokens_per_byte(tokenizer, text)}

    trainer = Trainer(
        model=composer_model,
        load_path=load_path,
        load_weights_only=True,
        precision=cfg.get("precision"),
        seed=cfg.get("seed", 17),
        progress_bar=cfg.get("progress_bar", False),
        log_to_console=False,
        run_name="eval",
    )
    results = {}
    for evaluator in evaluators:
        label = evaluator.label
        eval_started = time.perf_counter()
        with warnings.catch_warnings():
            # A split's last batch is short by design; Composer warns about it.
            warnings.filterwarnings("ignore", message="Cannot split tensor of length", category=UserWarning)
            trainer.eval(eval_dataloader=evaluator, subset_num_batches=-1)
        metrics = trainer.state.eval_metrics[label]
        nats = float(metrics["LanguageCrossEntropy"].compute())
        info = infos[label]
        results[label] = {
            **info,
            "nats_per_token": nats,
            "perplexity": math.exp(nats),
            "composer_perplexity": float(metrics["LanguagePerplexity"].compute()),
            "bits_per_byte": nats * info["tokens_per_byte"] / math.log(2),
            "seconds": time.perf_counter() - eval_started,
        }
    report = {
        **source,
        "num_parameters": composer_model.model.num_parameters(),
        "vocab_size": len(tokenizer),
        "seq_len": seq_len,
        "device_eval_batch_size": batch_size,
        "evaluators": results,
        "wall_seconds": time.perf_counter() - started,
    }
    output = Path(output or cfg.get("eval_output") or default_output(cfg, load_path=load_path, model=model))
    if dist.get_global_rank() == 0:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = output.with_name(f".{output.name}.tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, output)
    report["output"] = str(output)
    return report


def format_table(report: Mapping[str, Any]) -> str:
    """The results of :func:`evaluate` as a plain-text table, one row per evaluator."""
    header = ("evaluator", "sequences", "tokens", "nats/token", "perplexity", "tokens/byte", "bits/byte", "seconds")
    rows = [header]
    for label, r in report["evaluators"].items():
        rows.append((label, f"{r['sequences']}/{r['blocks']}", f"{r['predicted_tokens']:,}", f"{r['nats_per_token']:.4f}",
                     f"{r['perplexity']:.2f}", f"{r['tokens_per_byte']:.4f}", f"{r['bits_per_byte']:.4f}",
                     f"{r['seconds']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


USAGE = """usage: scripts/eval.py CONFIG.yaml load_path=CHECKPOINT [key=value ...]
       scripts/eval.py CONFIG.yaml --model DIR_OR_NAME [key=value ...]

Evaluate a checkpoint of the config's run, or an exported bundle / registered model
(e.g. smollm2-135m-instruct), on held-out Shakespeare: nats/token, perplexity, bits/byte.
Options (key=value): eval_splits=[validation,train] eval_seq_len=512
eval_max_sequences=32 device_eval_batch_size=8 eval_output=PATH.json"""


def main(argv: list[str]) -> int:
    """Command line: see :data:`USAGE`. Returns the exit status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    config_path, rest, model = argv[0], [], None
    args = iter(argv[1:])
    for arg in args:
        if arg == "--model":
            model = next(args, None)
            if model is None:
                print("--model needs a directory, .gguf file or registered name", file=sys.stderr)
                return 2
        elif arg.startswith("--model="):
            model = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    cfg = OmegaConf.merge(OmegaConf.load(config_path), OmegaConf.from_dotlist(rest))
    load_path = cfg.get("load_path") if model is None else None
    if model is None and not load_path:
        print("give load_path=CHECKPOINT or --model DIR_OR_NAME\n\n" + USAGE, file=sys.stderr)
        return 2
    report = evaluate(cfg, load_path=load_path, model=model)
    print(f"{report.get('checkpoint') or report.get('model')}: {report['num_parameters']:,} parameters, "
          f"vocabulary {report['vocab_size']}, blocks of {report['seq_len']} tokens")
    print(format_table(report))
    print(f"results: {report['output']} ({report['wall_seconds']:.0f} s in all)")
    return 0
