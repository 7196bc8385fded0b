"""Train MosaicGPT on the Shakespeare plays with Composer, from an llm-foundry-style config.

The config (an omegaconf ``DictConfig`` or a plain mapping) has these top-level keys;
:data:`REQUIRED_KEYS` must be present, the others default to :data:`DEFAULTS`:

* ``model``: :class:`~llm.config.MosaicGPTConfig` options; ``vocab_size`` is taken from the
  tokenizer and must not be set.
* ``tokenizer``: ``kind: bpe`` with ``vocab_size``, or ``kind: char`` (see
  :func:`llm.data.build_tokenizer`).
* ``load_pretrained``: instead of ``model`` and ``tokenizer``, start from an exported bundle, a
  .gguf file or a registered name (e.g. ``smollm2-135m-instruct``), with its tokenizer.
* ``train_loader`` / ``eval_loader``: ``dataset`` (``split``, optional ``plays_dir`` and
  ``cache_dir``), ``shuffle``, ``drop_last``, optional ``num_workers`` (see
  :func:`llm.data.build_text_dataloader`); or, with ``dataset.kind: finetune``, a JSONL of
  prompt/response pairs (``path``, ``padding_side``; see :mod:`llm.data.finetune`).
* ``parallelism_config``: Composer's, e.g. ``{fsdp: {...}}`` (see configs/shakespeare-fsdp.yaml).
* ``optimizer``: ``name: decoupled_adamw`` plus ``lr``, ``betas``, ``eps``, ``weight_decay``.
  Composer's decoupled weight decay multiplies the weights by ``1 - weight_decay * lr / lr_0``
  every step, so it is about ``lr`` times the value one would give ``torch.optim.AdamW``.
* ``scheduler``: ``name: cosine_with_warmup`` plus ``t_warmup`` (e.g. ``30ba``) and ``alpha_f``.
* ``algorithms``: by name, e.g. ``gradient_clipping: {clipping_type: norm, clipping_threshold: 1.0}``.
* Composer ``Trainer`` settings passed through: ``max_duration``, ``eval_interval``,
  ``eval_subset_num_batches``, ``device_train_microbatch_size``, ``precision``, ``seed``,
  ``save_interval``, ``save_num_checkpoints_to_keep``, ``load_path``, ``autoresume``,
  ``progress_bar``, ``log_to_console``, ``console_log_interval``, ``run_name`` (default: the
  name of ``save_folder``; Composer's autoresume needs one).
* ``global_train_batch_size`` and ``device_eval_batch_size``: sequences per batch.
* ``save_folder``: the run folder. It holds Composer's checkpoints
  (:data:`CHECKPOINT_FILENAME`, and :data:`LATEST_CHECKPOINT` linking to the newest), the
  tokenizer (``tokenizer/``, reused when the run is resumed), and after training the inference
  bundle (``model/``, for :meth:`MosaicGPT.from_pretrained` and :func:`llm.data.load_tokenizer`)
  and ``metrics.json``; ``config.yaml`` (the resolved config) and ``curves.png`` / ``curves.json``
  (loss and eval curves, see :mod:`llm.train.callbacks`). Checkpoints are written atomically and
  checked before loading (see :mod:`llm.train.checkpointing`).
* ``num_samples``, ``sample_prompts``, ``sample_max_new_tokens``, ``sample_temperature``
  (0 is greedy), ``sample_top_k``: the samples printed after training.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from composer import Trainer
from composer.algorithms import GradientClipping
from composer.core import Evaluator
from composer.optim import CosineAnnealingWithWarmupScheduler, DecoupledAdamW
from composer.utils import dist, get_device, reproducibility
from omegaconf import DictConfig, OmegaConf
from transformers import PreTrainedTokenizerFast

from llm.train.callbacks import ConfigSaver, CurvePlotter
from llm.train.checkpointing import check_checkpoint, install_atomic_checkpoint_writes, repair_latest_checkpoint
from llm.train.composer_model import ComposerMosaicGPT
from llm.config import MosaicGPTConfig
from llm.convert.registry import load_tokenizer as load_pretrained_tokenizer
from llm.data import build_tokenizer, load_corpus, load_tokenizer, save_tokenizer
from llm.model import MosaicGPT
from llm.train.builders import (
    build_dataloader,
    device_batch_size,
    heldout_tokens_per_byte,
    load_pretrained,
    mark_fsdp_units,
    token_counting_data_spec,
)

REQUIRED_KEYS = (
    "train_loader", "eval_loader", "optimizer", "scheduler", "max_duration", "global_train_batch_size", "save_folder",
)
# Required unless load_pretrained names a bundle, .gguf file or registered model to start from.
MODEL_KEYS = ("model", "tokenizer")
DEFAULTS: dict[str, Any] = {
    "run_name": None,
    "load_pretrained": None,
    "parallelism_config": None,
    "algorithms": {},
    "eval_interval": "1ep",
    "eval_subset_num_batches": -1,
    "device_train_microbatch_size": None,  # the whole batch at once
    "device_eval_batch_size": None,  # global_train_batch_size
    "precision": None,  # Composer's choice: fp32 on CPU, amp_bf16 on GPU
    "seed": 17,
    "save_interval": "1ep",
    "save_num_checkpoints_to_keep": -1,
    "load_path": None,
    "autoresume": False,
    "progress_bar": True,
    "log_to_console": False,
    "console_log_interval": "1ba",
    "num_samples": 3,
    "sample_prompts": ["ROMEO:", "JULIET:", "HAMLET:"],
    "sample_max_new_tokens": 200,
    "sample_temperature": 0.8,
    "sample_top_k": 40,
}
ALLOWED_KEYS = (*REQUIRED_KEYS, *MODEL_KEYS, *DEFAULTS)

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"decoupled_adamw": DecoupledAdamW}
SCHEDULERS = {"cosine_with_warmup": CosineAnnealingWithWarmupScheduler}
ALGORITHMS = {"gradient_clipping": GradientClipping}

CHECKPOINT_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"
LATEST_CHECKPOINT = "latest-rank{rank}.pt"
TOKENIZER_DIR = "tokenizer"
MODEL_DIR = "model"
METRICS_FILE = "metrics.json"
# The tokenizer section that built <save_folder>/tokenizer, to refuse reusing it for another one.
TOKENIZER_SPEC_FILE = "llm_tokenizer_spec.yaml"


def _to_dict(cfg: Mapping | DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def validate_config(cfg: Mapping | DictConfig) -> None:
    """Check the top-level keys of a training config and its ``model`` section, before any work.

    Raises:
        ValueError: for an unknown top-level key (a typo), naming it and listing the allowed
            keys; for a missing required key; for ``model.vocab_size`` (it comes from the
            tokenizer); for an unknown or invalid ``model`` option (from
            :meth:`MosaicGPTConfig.from_dict`).
    """
    cfg = _to_dict(cfg)
    unknown = sorted(set(cfg) - set(ALLOWED_KEYS))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; allowed keys: {sorted(ALLOWED_KEYS)}")
    pretrained = cfg.get("load_pretrained") is not None
    given = [key for key in MODEL_KEYS if key in cfg]
    if pretrained and given:
        raise ValueError(f"load_pretrained gives the model and tokenizer: remove the {given} section(s)")
    required = REQUIRED_KEYS if pretrained else (*MODEL_KEYS, *REQUIRED_KEYS)
    missing = [key for key in required if key not in cfg]
    if missing:
        raise ValueError(f"missing config key(s) {missing}; required keys: {list(required)}")
    if pretrained:
        return
    if "vocab_size" in cfg["model"]:
        raise ValueError("model.vocab_size must not be set: it is taken from the tokenizer")
    # vocab_size is only known once the tokenizer exists; any valid stand-in checks the rest now.
    MosaicGPTConfig.from_dict({**cfg["model"], "vocab_size": 1})


def _build(section: str, registry: Mapping[str, Callable], cfg: Mapping[str, Any], *args: Any) -> Any:
    """``registry[name](*args, **options)`` for a config section ``{name: ..., **options}``.

    Raises:
        ValueError: for an unknown name or option, naming the section and what is allowed.
    """
    options = dict(cfg)
    name = options.pop("name", None)
    if name not in registry:
        raise ValueError(f"{section}.name must be one of {sorted(registry)}, got {name!r}")
    return _construct(f"{section} {name!r}", registry[name], options, *args)


def _construct(what: str, factory: Callable, options: Mapping[str, Any], *args: Any) -> Any:
    allowed = list(inspect.signature(factory).parameters)[len(args):]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {what}; allowed: {allowed}")
    return factory(*args, **options)


def build_algorithms(cfg: Mapping[str, Mapping[str, Any]]) -> list:
    """Composer algorithms from ``{name: options}``, e.g. ``{"gradient_clipping": {...}}``.

    Raises:
        ValueError: for an unknown algorithm or option.
    """
    unknown = sorted(set(cfg) - set(ALGORITHMS))
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; allowed: {sorted(ALGORITHMS)}")
    return [_construct(f"algorithm {name!r}", ALGORITHMS[name], options) for name, options in cfg.items()]


def prepare_tokenizer(
    tokenizer_cfg: Mapping[str, Any], directory: str | os.PathLike, *, plays_dir: str | None = None
) -> PreTrainedTokenizerFast:
    """The run's tokenizer: loaded from ``directory`` if it is there, else built and saved there.

    A new tokenizer is trained (BPE) or collected (char) on the train split's text, so a
    resumed run keeps the vocabulary its checkpoint was trained with.

    Raises:
        ValueError: if ``directory`` holds a tokenizer built from a different tokenizer config,
            or for a bad ``tokenizer_cfg`` (from :func:`llm.data.build_tokenizer`).
    """
    directory = Path(directory)
    spec = dict(tokenizer_cfg)
    if (directory / "tokenizer.json").is_file():
        spec_path = directory / TOKENIZER_SPEC_FILE
        saved = OmegaConf.to_container(OmegaConf.load(spec_path)) if spec_path.is_file() else spec
        if saved != spec:
            raise ValueError(
                f"{directory} holds a tokenizer built with {saved}, but the config asks for {spec}: "
                "use a new save_folder (or delete the old run)"
            )
        return load_tokenizer(directory)
    tokenizer = build_tokenizer(spec, load_corpus("train", plays_dir))
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Save into a fresh folder, then rename it into place: an interrupted run never leaves a
    # half-written tokenizer that the next run would load.
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}-"))
    save_tokenizer(tokenizer, tmp)
    OmegaConf.save(OmegaConf.create(spec), tmp / TOKENIZER_SPEC_FILE)
    os.replace(tmp, directory)
    return tokenizer


def resolve_config(cfg: Mapping | DictConfig) -> dict[str, Any]:
    """A validated training config as a plain dict, with :data:`DEFAULTS` filled in.

    Raises:
        ValueError: see :func:`validate_config`.
    """
    validate_config(cfg)
    cfg = {**DEFAULTS, **_to_dict(cfg)}
    if cfg["device_eval_batch_size"] is None:
        cfg["device_eval_batch_size"] = cfg["global_train_batch_size"]
    return cfg


def build_trainer(cfg: Mapping[str, Any], tokenizer: PreTrainedTokenizerFast) -> Trainer:
    """Composer's ``Trainer`` for a :func:`resolve_config` config, with a new seeded model.

    ``trainer.state.model`` is the :class:`~llm.train.composer_model.ComposerMosaicGPT` (one process,
    so not wrapped). Loads ``load_path`` (or, with ``autoresume``, the newest checkpoint in
    ``save_folder``), so ``trainer.state.timestamp`` is where training resumes.

    Raises:
        ValueError: for a bad model, loader, optimizer, scheduler or algorithm section, or
            whatever Composer raises for bad Trainer settings.
    """
    # Seed before building the model so its initial weights depend on the seed alone.
    reproducibility.seed_all(cfg["seed"])
    if cfg["load_pretrained"]:
        model, _ = load_pretrained(cfg["load_pretrained"])
    else:
        model = ComposerMosaicGPT(MosaicGPTConfig.from_dict({**cfg["model"], "vocab_size": len(tokenizer)}))
    max_seq_len = model.config.max_seq_len
    train_loader = build_dataloader(
        cfg["train_loader"], tokenizer, max_seq_len, device_batch_size(cfg["global_train_batch_size"]), seed=cfg["seed"]
    )
    eval_loader = build_dataloader(
        cfg["eval_loader"], tokenizer, max_seq_len, cfg["device_eval_batch_size"], seed=cfg["seed"]
    )
    fsdp = (cfg["parallelism_config"] or {}).get("fsdp")
    if fsdp is not None:
        mark_fsdp_units(model, activation_checkpointing=fsdp.get("activation_checkpointing", False))
    # Checkpoints are written atomically; before an autoresume, a half-written one (from an older
    # run) is moved aside and latest-rank0.pt repaired; the checkpoint to load must fit the model.
    install_atomic_checkpoint_writes()
    save_folder = Path(cfg["save_folder"])
    latest = save_folder / LATEST_CHECKPOINT.format(rank=0)
    if cfg["autoresume"] and dist.get_global_rank() == 0:
        repair_latest_checkpoint(save_folder, CHECKPOINT_FILENAME, LATEST_CHECKPOINT)
    dist.barrier()
    to_load = latest if cfg["autoresume"] and latest.is_file() else cfg["load_path"]
    if to_load is not None and Path(to_load).is_file():
        check_checkpoint(to_load, model)
    return Trainer(
        run_name=cfg["run_name"] or Path(cfg["save_folder"]).name,
        model=model,
        # Microbatches (and ranks) weighted by their scored tokens: exact for padded fine-tuning batches.
        train_dataloader=token_counting_data_spec(train_loader),
        accumulate_train_batch_on_tokens=True,
        eval_dataloader=Evaluator(
            label="eval", dataloader=eval_loader, metric_names=list(model.get_metrics(is_train=False))
        ),
        optimizers=_build("optimizer", OPTIMIZERS, cfg["optimizer"], model.parameters()),
        schedulers=_build("scheduler", SCHEDULERS, cfg["scheduler"]),
        algorithms=build_algorithms(cfg["algorithms"]),
        max_duration=cfg["max_duration"],
        eval_interval=cfg["eval_interval"],
        eval_subset_num_batches=cfg["eval_subset_num_batches"],
        device_train_microbatch_size=cfg["device_train_microbatch_size"],
        precision=cfg["precision"],
        seed=cfg["seed"],
        progress_bar=cfg["progress_bar"],
        log_to_console=cfg["log_to_console"],
        console_log_interval=cfg["console_log_interval"],
        save_folder=cfg["save_folder"],
        save_filename=CHECKPOINT_FILENAME,
        save_latest_filename=LATEST_CHECKPOINT,
        save_interval=cfg["save_interval"],
        save_num_checkpoints_to_keep=cfg["save_num_checkpoints_to_keep"],
        load_path=cfg["load_path"],
        autoresume=cfg["autoresume"],
        parallelism_config=cfg["parallelism_config"],
        callbacks=[CurvePlotter(save_folder), ConfigSaver(cfg, save_folder)],
    )


def evaluate_heldout(
    trainer: Trainer, cfg: Mapping[str, Any], tokenizer: PreTrainedTokenizerFast, max_seq_len: int
) -> dict[str, float]:
    """Cross-entropy of the trained model over the whole ``eval_loader`` split.

    Returns:
        ``nats_per_token`` (mean over every predicted token of every block), ``perplexity``,
        ``tokens_per_byte`` (of that split's text with ``tokenizer``) and ``bits_per_byte`` =
        nats_per_token * tokens_per_byte / ln 2, comparable across tokenizers.
    """
    loader = build_dataloader(
        cfg["eval_loader"], tokenizer, max_seq_len, cfg["device_eval_batch_size"], seed=cfg["seed"]
    )
    # A label of its own and subset -1: the "eval" evaluator stops at eval_subset_num_batches.
    evaluator = Evaluator(
        label="heldout", dataloader=loader, metric_names=["LanguageCrossEntropy"], subset_num_batches=-1
    )
    with warnings.catch_warnings():
        # The split's last batch is short by design (drop_last: false); Composer warns about it.
        warnings.filterwarnings("ignore", message="Cannot split tensor of length", category=UserWarning)
        trainer.eval(eval_dataloader=evaluator, subset_num_batches=-1)
    nats = float(trainer.state.eval_metrics["heldout"]["LanguageCrossEntropy"].compute())
    per_byte = heldout_tokens_per_byte(cfg["eval_loader"], tokenizer)
    return {
        "nats_per_token": nats,
        "perplexity": math.exp(nats),
        "tokens_per_byte": per_byte,
        "bits_per_byte": nats * per_byte / math.log(2),
    }


def generate_samples(
    model: MosaicGPT,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
) -> list[str]:
    """``num_samples`` continuations, the i-th of ``prompts[i % len(prompts)]``, prompt included.

    Sample i uses sampler seed ``seed + i``, so samples are reproducible; temperature 0 is greedy.
    Each sample stops at ``max_new_tokens`` or at the model's ``max_seq_len``, whichever is first.

    Raises:
        ValueError: if ``prompts`` is empty while samples are asked for, or a prompt does not
            leave room for one new token within ``max_seq_len``.
    """
    if num_samples > 0 and not prompts:
        raise ValueError("sample_prompts is empty but num_samples > 0")
    model.eval()
    samples = []
    for i in range(num_samples):
        ids = tokenizer.encode(prompts[i % len(prompts)], add_special_tokens=False)
        room = model.config.max_seq_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt {prompts[i % len(prompts)]!r} leaves no room within max_seq_len")
        out = model.generate(
            torch.tensor([ids], device=model.device),
            max_new_tokens=min(max_new_tokens, room),
            do_sample=True,
            temperature=temperature,
            top_k=top_k,
            eos_token_id=tokenizer.eos_token_id,
            seed=seed + i,
        )
        samples.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return samples


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    # Write then rename, so a reader never sees half a file.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def train(cfg: Mapping | DictConfig) -> dict[str, Any]:
    """Train, evaluate on the held-out plays, export the model, print samples.

    Steps: validate ``cfg``; build or reuse the tokenizer in ``<save_folder>/tokenizer``;
    train with Composer (checkpoints in ``save_folder``; resuming from ``load_path`` or, with
    ``autoresume``, from the newest checkpoint there); measure the cross-entropy over the whole
    ``eval_loader`` split; write ``<save_folder>/model`` and ``<save_folder>/metrics.json``; print
    the figures and ``num_samples`` samples.

    Returns:
        ``metrics.json``'s contents (``run_name``, ``start_batch`` (0, or the batch resumed
        from), ``batches`` and ``tokens`` trained in all, ``num_parameters``, ``vocab_size``,
        ``heldout_nats_per_token``, ``heldout_perplexity``, ``tokens_per_byte``,
        ``bits_per_byte``, ``fit_seconds``, ``wall_seconds``) plus ``samples`` (list of str),
        ``model_dir`` and ``checkpoint`` (the newest checkpoint's path, or None).

    Under ``composer -n N`` (data parallel; each rank gets ``global_train_batch_size / N``
    sequences per batch), rank 0 builds the tokenizer and writes the exports, samples and
    metrics; every rank trains and evaluates. The other ranks return the figures without
    ``samples``.

    Raises:
        ValueError: for a bad config (see :func:`validate_config`, :func:`build_trainer`).
    """
    started = time.perf_counter()
    cfg = resolve_config(cfg)
    if dist.get_world_size() > 1:
        dist.initialize_dist(get_device(None))  # the Trainer would, but the tokenizer needs a barrier first
    rank0 = dist.get_global_rank() == 0
    save_folder = Path(cfg["save_folder"])

    if cfg["load_pretrained"]:
        tokenizer = load_pretrained_tokenizer(cfg["load_pretrained"])
    else:
        if rank0:
            tokenizer = prepare_tokenizer(
                cfg["tokenizer"], save_folder / TOKENIZER_DIR, plays_dir=cfg["train_loader"]["dataset"].get("plays_dir")
            )
        dist.barrier()
        if not rank0:
            tokenizer = load_tokenizer(save_folder / TOKENIZER_DIR)
    trainer = build_trainer(cfg, tokenizer)
    model = getattr(trainer.state.model, "module", trainer.state.model)  # unwrapped from DDP
    start_batch = int(trainer.state.timestamp.batch)
    max_duration = trainer.state.max_duration
    # Composer refuses to fit a run that has reached max_duration (e.g. `make train` again after it
    # finished, with autoresume): evaluate and export it as it is.
    finished = trainer.state.timestamp.get(max_duration.unit) >= max_duration
    print(
        f"run {trainer.state.run_name}: {model.model.num_parameters():,} parameters, "
        f"{cfg['tokenizer']['kind'] if 'tokenizer' in cfg else cfg['load_pretrained']} tokenizer of "
        f"{len(tokenizer)} tokens, {len(trainer.state.train_dataloader.dataset):,} training sequences of up to "
        f"{model.config.max_seq_len} tokens, "
        f"max_duration {cfg['max_duration']}" + (f", resuming at batch {start_batch}" if start_batch else "")
        + (" (already trained that far: evaluating only)" if finished else ""),
        flush=True,
    )

    fit_started = time.perf_counter()
    if not finished:
        trainer.fit()
    fit_seconds = time.perf_counter() - fit_started

    heldout = evaluate_heldout(trainer, cfg, tokenizer, model.config.max_seq_len)  # on every rank
    model_dir = save_folder / MODEL_DIR
    if rank0:
        model.model.save_pretrained(model_dir, tokenizer=tokenizer)
    samples = generate_samples(
        model.model,
        tokenizer,
        list(cfg["sample_prompts"]),
        num_samples=cfg["num_samples"] if rank0 else 0,
        max_new_tokens=cfg["sample_max_new_tokens"],
        temperature=cfg["sample_temperature"],
        top_k=cfg["sample_top_k"],
        seed=cfg["seed"],
    )
    metrics = {
        "run_name": trainer.state.run_name,
        "start_batch": start_batch,
        "batches": int(trainer.state.timestamp.batch),
        "tokens": int(trainer.state.timestamp.token),
        "num_parameters": model.model.num_parameters(),
        "vocab_size": len(tokenizer),
        "heldout_nats_per_token": heldout["nats_per_token"],
        "heldout_perplexity": heldout["perplexity"],
        "tokens_per_byte": heldout["tokens_per_byte"],
        "bits_per_byte": heldout["bits_per_byte"],
        "fit_seconds": fit_seconds,
        "wall_seconds": time.perf_counter() - started,
    }
    latest = save_folder / LATEST_CHECKPOINT.format(rank=0)
    result = {**metrics, "samples": samples, "model_dir": str(model_dir),
              "checkpoint": os.path.realpath(latest) if latest.exists() else None}
    if not rank0:
        dist.barrier()  # rank 0 writes the exports
        return result
    _write_json(save_folder / METRICS_FILE, metrics)

    print(
        f"held-out {cfg['eval_loader']['dataset'].get('split', 'eval')}: {heldout['nats_per_token']:.4f} nats/token "
        f"(perplexity {heldout['perplexity']:.2f}), {heldout['tokens_per_byte']:.4f} tokens/byte, "
        f"{heldout['bits_per_byte']:.4f} bits/byte after {metrics['batches']} batches "
        f"({fit_seconds:.0f} s training, {metrics['wall_seconds']:.0f} s in all)"
    )
    print(f"model and tokenizer: {model_dir}; metrics: {save_folder / METRICS_FILE}")
    for i, sample in enumerate(samples, 1):
        print(f"\n--- sample {i} ---\n{sample}")
    dist.barrier()
    return result
