"""Evaluate a training checkpoint, an exported bundle or a registered pretrained model on prepared held-out data.

``scripts/eval.py CONFIG.yaml load_path=CKPT [key=value ...]`` rebuilds the model of a training
config and loads the checkpoint's weights; ``scripts/eval.py CONFIG.yaml --model DIR_OR_NAME``
evaluates an exported bundle (``<save_folder>/model``), a ``.gguf`` file or a registered model
such as ``smollm2-135m-instruct`` with that model's own tokenizer. Either way the data is the
config's ``eval_loader``: prepared shards (``scripts/prepare_data.py``; their tokenizer must be the
model's, compared by hash) with one evaluator per stream, or a fine-tuning JSONL file.

Evaluation runs through Composer's ``Trainer.eval``. For each evaluator it reports
cross-entropy in nats per predicted token, perplexity, tokens per byte of the evaluated split
(from the counts its preparation recorded) and bits per byte = nats/token * tokens/byte / ln 2,
comparable across tokenizers. The config is an :class:`llm.train.config.EvalConfig`: a training
config's keys plus ``eval_seq_len`` (tokens per sequence; default: the model's ``max_seq_len``,
at most :data:`DEFAULT_MAX_SEQ_LEN`) and ``eval_max_sequences`` (at most this many sequences per
evaluator, evenly spread over the split; default all), all checked up front.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig

DEFAULT_MAX_SEQ_LEN = 512
EVAL_FILE = "eval.json"


def load_for_eval(cfg: Mapping[str, Any], *, load_path: str | None = None, model: str | None = None,
                  quantization: str | None = None, backend: str = "auto"):
    """The model to evaluate and the eval data, as ``(ComposerMosaicGPT, RunData, source)``.

    With ``model`` (a bundle directory, .gguf file or registered name) the weights are loaded
    here and its tokenizer must be the data's; with ``load_path`` the model is built from
    ``cfg["model"]`` (or ``load_pretrained``) with the data's tokenizer (or ``tokenizer.name``) and
    the checkpoint is checked (:func:`llm.train.checkpointing.check_checkpoint`); Composer loads it.
    ``quantization`` and ``backend`` (see :meth:`~llm.model.MosaicGPT.from_pretrained`) apply to
    ``model`` here; a checkpoint is quantized by :func:`evaluate` once Composer has loaded it.

    Raises:
        ValueError: if both or neither of ``load_path`` and ``model`` are given, the checkpoint does
            not fit (naming the file and tensors), or the tokenizer does not fit the data.
        FileNotFoundError: for a missing model or checkpoint.
    """
    from llm.model import MosaicGPT
    from llm.train.builders import build_model, run_data
    from llm.train.checkpointing import check_checkpoint
    from llm.train.composer_model import ComposerMosaicGPT

    if (load_path is None) == (model is None):
        raise ValueError("give exactly one of load_path=CHECKPOINT and --model DIR_OR_NAME")
    eval_only = {**cfg, "train_loader": None}
    if model is not None:
        data = run_data({**eval_only, "load_pretrained": model, "model": None})
        pretrained = MosaicGPT.from_pretrained(model, quantization=quantization, backend=backend)
        return ComposerMosaicGPT(pretrained), data, {"model": str(model)}
    if quantization == "gguf":
        raise ValueError("--quantize gguf keeps a GGUF file's own quantization: give --model FILE.gguf")
    data = run_data(eval_only)
    composer_model = build_model(cfg, data.tokenizer)  # a fine-tuning run's is the pretrained one
    check_checkpoint(load_path, composer_model)
    return composer_model, data, {"checkpoint": str(load_path)}


def default_output(cfg: Mapping[str, Any], *, model: str | None) -> Path:
    """Where results go without ``--out``: ``<save_folder>/eval.json`` for a checkpoint, else
    ``eval-<model name>.json`` in the current folder (never inside a model bundle)."""
    if model is None and cfg.get("save_folder"):
        return Path(cfg["save_folder"]) / EVAL_FILE
    return Path(f"eval-{Path(str(model or 'checkpoint')).stem}.json")


def evaluate(cfg: Mapping | DictConfig, *, load_path: str | None = None, model: str | None = None,
             quantization: str | None = None, backend: str = "auto", compile: bool = False) -> dict[str, Any]:
    """Evaluate a checkpoint (``load_path``, or ``cfg["load_path"]``) or a model (``model``).

    ``quantization``: None (as stored), ``"none"``, ``"int8"``, ``"int4"`` or ``"gguf"`` (a
    ``.gguf`` model's own blocks), and ``backend``, as :meth:`~llm.model.MosaicGPT.from_pretrained`;
    ``compile``: run the forward through ``torch.compile`` (``nn.Module.compile``).

    Returns:
        The report (nothing is written: see :func:`write_report`): the source (``checkpoint`` or
        ``model``), ``num_parameters``, ``vocab_size``, ``seq_len``, ``device_eval_batch_size``,
        ``wall_seconds`` and ``evaluators``, by label (the stream, or the JSONL file's name):
        ``split``, ``sequences`` (evaluated), ``available`` (in the split), ``predicted_tokens``,
        ``nats_per_token``, ``perplexity``, ``tokens_per_byte``, ``bits_per_byte``, ``seconds``.

    Raises:
        llm.utils.config.ConfigError: for any unknown key or bad value of ``cfg``.
        ValueError: see :func:`load_for_eval`; for an ``eval_seq_len`` beyond the model's.
    """
    from composer import Trainer

    from llm.train.builders import build_eval_loaders
    from llm.train.config import load_eval_config
    from llm.train.trainer import composer_precision, evaluate_sets, output_is_terminal

    started = time.perf_counter()
    cfg = load_eval_config(cfg).to_dict()
    if load_path is None and model is None:
        load_path = cfg.get("load_path")
    composer_model, data, source = load_for_eval(cfg, load_path=load_path, model=model, quantization=quantization,
                                                 backend=backend)
    max_len = composer_model.config.max_seq_len
    seq_len = cfg.get("eval_seq_len") or min(max_len, DEFAULT_MAX_SEQ_LEN)
    if seq_len > max_len:
        raise ValueError(f"eval_seq_len must be at most the model's max_seq_len={max_len}, got {seq_len}")
    batch_size = cfg.get("device_eval_batch_size") or cfg.get("global_train_batch_size") or 8
    eval_sets = build_eval_loaders(cfg["eval_loader"], data.eval, data.tokenizer, seq_len, batch_size,
                                   seed=cfg.get("seed", 17), max_sequences=cfg.get("eval_max_sequences"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No optimizer was specified")  # nothing trains here
        trainer = Trainer(model=composer_model, load_path=load_path, load_weights_only=True,
                          precision=composer_precision(cfg.get("precision"), composer_model), seed=cfg.get("seed", 17),
                          progress_bar=cfg.get("progress_bar", False) and output_is_terminal(), log_to_console=False,
                          run_name="eval")
    if quantization not in (None, "none") and model is None:
        from llm.quant import quantize

        quantize(composer_model.model, quantization, backend=backend)  # the checkpoint's weights, loaded by the Trainer
    if compile:
        composer_model.model.compile()
    results = {}
    for eval_set in eval_sets:
        set_started = time.perf_counter()
        figures = evaluate_sets(trainer, [eval_set])[eval_set.label]
        results[eval_set.label] = {"split": eval_set.split, "sequences": eval_set.sequences,
                                   "available": eval_set.available, **figures,
                                   "seconds": time.perf_counter() - set_started}
    return {
        **source,
        "quantization": composer_model.model.quantization.method if composer_model.model.quantization else None,
        "compile": compile,
        "num_parameters": composer_model.model.num_parameters(),
        "vocab_size": len(data.tokenizer),
        "seq_len": seq_len if data.eval else max_len,
        "device_eval_batch_size": batch_size,
        "evaluators": results,
        "wall_seconds": time.perf_counter() - started,
    }


def write_report(report: Mapping[str, Any], output: str | os.PathLike) -> Path:
    """Write ``report`` as JSON to ``output`` atomically (folders created); returns the path."""
    from llm.io import atomic_write

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(output, lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2) + "\n"))
    return output


def format_table(report: Mapping[str, Any]) -> str:
    """The results of :func:`evaluate` as a plain-text table, one row per evaluator."""
    header = ("evaluator", "sequences", "tokens", "nats/token", "perplexity", "tokens/byte", "bits/byte", "seconds")
    rows = [header]
    for label, r in report["evaluators"].items():
        rows.append((label, f"{r['sequences']}/{r['available']}", f"{r['predicted_tokens']:,}",
                     f"{r['nats_per_token']:.4f}", f"{r['perplexity']:.2f}", f"{r['tokens_per_byte']:.4f}",
                     f"{r['bits_per_byte']:.4f}", f"{r['seconds']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
