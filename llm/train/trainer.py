"""Train MosaicGPT with Composer from an llm-foundry-style config, on prepared token shards.

The config is validated once, up front, by :func:`llm.train.config.load_train_config` (every key
and value, at any depth; see :class:`llm.train.config.TrainConfig` for the keys and defaults).
Then :func:`llm.train.builders.run_data` resolves the data (``train_loader`` / ``eval_loader``:
MosaicML Streaming datasets over folders written by ``scripts/prepare_data.py``, or JSONL
prompt/response pairs for fine-tuning) and the tokenizer (the shards' own by default), refusing
a mismatch before anything is written. Composer's ``Trainer`` then trains (DecoupledAdamW or
AdamW, warm-up schedules, gradient clipping, periodic evaluation, checkpoints holding the data
loader's position, autoresume), and the run ends with a held-out evaluation of every eval stream
(cross-entropy, perplexity, bits per byte), the inference bundle and samples.

``save_folder`` holds Composer's checkpoints (:data:`CHECKPOINT_FILENAME`, and
:data:`LATEST_CHECKPOINT` linking to the newest), and after training the inference bundle
(``model/``, for :meth:`MosaicGPT.from_pretrained` and :func:`llm.load_tokenizer`),
``metrics.json``, ``config.yaml`` (the resolved config) and ``curves.png`` / ``curves.json``.
Checkpoints are written atomically and checked before loading (see
:mod:`llm.train.checkpointing`). The folder holds one run (:mod:`llm.train.run_folder`): it is
locked while a run trains, and resuming under settings other than its ``config.yaml`` is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from composer import Trainer
from composer.algorithms import GradientClipping
from composer.callbacks import SpeedMonitor
from composer.core import Evaluator
from composer.optim import (
    ConstantWithWarmupScheduler,
    CosineAnnealingWithWarmupScheduler,
    DecoupledAdamW,
    LinearWithWarmupScheduler,
)
from composer.utils import dist, get_device, reproducibility
from omegaconf import DictConfig

from llm.data.finetune import use_chat_template
from llm.data.streaming import clean_stale_registrations
from llm.io import atomic_write
from llm.model import MosaicGPT
from llm.utils.cpu import native_bf16
from llm.utils.home import use_inductor_cache
from llm.train.builders import (
    EvalSet,
    RunData,
    build_eval_loaders,
    build_model,
    build_train_loader,
    device_batch_size,
    mark_fsdp_units,
    run_data,
    token_counting_data_spec,
)
from llm.utils.config import ConfigError
from llm.train.callbacks import CONFIG_YAML, BatchClock, ConfigSaver, CurvePlotter, RunPlan, StopOnNonFiniteLoss
from llm.train.checkpointing import (
    adopt_earlier_checkpoints,
    check_checkpoint,
    install_atomic_checkpoint_writes,
    newest_complete_checkpoint,
    repair_latest_checkpoint,
)
from llm.train.run_folder import check_resume_config, hold_run_folder, on_rank_zero
from llm.train.schedule import WarmupStableDecayScheduler
from llm.train.speed import flops_per_token, measure_peak_flops

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "decoupled_adamw": DecoupledAdamW, "adamw": torch.optim.AdamW,
}
SCHEDULERS = {
    "cosine_with_warmup": CosineAnnealingWithWarmupScheduler,
    "constant_with_warmup": ConstantWithWarmupScheduler,
    "linear_with_warmup": LinearWithWarmupScheduler,
    "warmup_stable_decay": WarmupStableDecayScheduler,
}
ALGORITHMS = {"gradient_clipping": GradientClipping}

CHECKPOINT_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"
LATEST_CHECKPOINT = "latest-rank{rank}.pt"
MODEL_DIR = "model"
METRICS_FILE = "metrics.json"


def resolve_config(cfg: Mapping | DictConfig) -> dict[str, Any]:
    """A training config validated (:func:`llm.train.config.load_train_config`), defaults filled, as a dict.

    Raises:
        llm.utils.config.ConfigError: for any unknown key or bad value, naming its dotted path.
    """
    from llm.train.config import load_train_config

    return load_train_config(cfg).to_dict()


def _build(registry: Mapping[str, Callable], cfg: Mapping[str, Any], *args: Any) -> Any:
    options = {k: v for k, v in cfg.items() if k != "name"}
    return registry[cfg["name"]](*args, **options)


def optimizer_groups(model: torch.nn.Module, weight_decay: float, decay: str = "matrices") -> list[dict]:
    """The optimizer's parameter groups: with ``decay="matrices"`` (nanoGPT's
    ``configure_optimizers``) weight decay on the parameters of 2 or more dimensions (projections
    and embeddings) and none on norms and biases; with ``"all"``, one group decayed whole."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay == "all":
        return [{"params": params, "weight_decay": weight_decay}]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _optimizer(cfg: Mapping[str, Any], model: torch.nn.Module) -> torch.optim.Optimizer:
    options = {k: v for k, v in cfg.items() if k not in ("name", "decay")}
    if cfg["name"] == "muon":
        from llm.train.muon import Muon, muon_groups

        groups = muon_groups(model, lr=options["lr"], adamw_lr=options.pop("adamw_lr"),
                             weight_decay=options["weight_decay"])
        return Muon(groups, **options)
    groups = optimizer_groups(model, options.pop("weight_decay"), cfg["decay"])
    return OPTIMIZERS[cfg["name"]](groups, **options)


def cpu_run() -> bool:
    """Whether Composer trains on the CPU here (its device default: a GPU when there is one)."""
    return not torch.cuda.is_available()


def run_precision(precision: str | None) -> str | None:
    """The precision a run computes in: ``precision``, except ``amp_bf16`` on a CPU without native
    bfloat16 (:func:`llm.utils.cpu.native_bf16`), which becomes ``fp32`` with one line on stderr
    saying so (there, bf16 autocast trains ~30x slower than float32).

    Raises:
        ConfigError: ``amp_fp16`` on a CPU."""
    if precision == "amp_fp16" and cpu_run():
        raise ConfigError("precision", "amp_fp16 needs a GPU (PyTorch has no float16 autocast for CPU training); "
                          "on a CPU use amp_bf16 or fp32")
    if precision == "amp_bf16" and cpu_run() and not native_bf16():
        _say_once("warning: this CPU has no native bfloat16 (AVX512-BF16 or AMX), so precision amp_bf16 "
                  "runs as fp32 (bfloat16 would be ~30x slower here)")
        return "fp32"
    return precision


def run_compile_config(options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``compile_config`` a run uses: ``options``, except on a CPU without a C++ compiler (``$CXX``,
    else ``g++``), which inductor needs there: None (eager), with one line on stderr saying so."""
    if options is None or not cpu_run() or options.get("backend", "inductor") != "inductor":
        return options
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        _say_once(f"warning: compile_config: no C++ compiler ({compiler}; set $CXX to name one) for torch.compile's "
                  "inductor on this CPU, so the run trains eager (uncompiled)")
        return None
    return options


@functools.lru_cache(maxsize=None)
def _say_once(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def composer_precision(precision: str | None, model) -> str | None:
    """Composer's precision for a run's ``precision`` (after :func:`run_precision`); ``amp_bf16``
    on a CPU (which Composer refuses) becomes our own autocast of ``model``'s forward
    (``model.autocast_dtype``, a :class:`~llm.train.composer_model.ComposerMosaicGPT`) under
    Composer's fp32, saying so once on stderr."""
    precision = run_precision(precision)
    if precision == "amp_bf16" and cpu_run():
        _say_once("precision: amp_bf16 (the forward autocast to bfloat16 on the CPU; weights, optimizer and loss "
                  "in float32; Composer's own log says fp32)")
        model.autocast_dtype = torch.bfloat16
        return "fp32"
    return precision


@functools.lru_cache(maxsize=None)
def _peak_flops(dtype: torch.dtype) -> float:
    return measure_peak_flops(dtype, size=1024, seconds=0.2)


def peak_flops(cfg: Mapping[str, Any], again: bool = False) -> float | None:
    """The FLOP/s that MFU is measured against: on a CPU, the measured matmul peak of the dtype the
    run computes in (Composer knows only GPUs'), probed once per process; with ``again``, the higher
    of that and a new probe (contention only ever lowers one: a compiled run's first probe shares
    the cores with inductor's compile workers starting up, and read 60% low). None on a GPU
    (Composer's own table)."""
    if not cpu_run():
        return None
    dtype = torch.bfloat16 if run_precision(cfg["precision"]) == "amp_bf16" else torch.float32
    return max(_peak_flops(dtype), _peak_flops.__wrapped__(dtype)) if again else _peak_flops(dtype)


def _prepare_run_folder(cfg: Mapping[str, Any], save_folder: Path) -> None:
    """Before the trainer (one rank): refuse a resume under another config, then repair for autoresume.

    The config is checked first, so a refused run leaves the folder as it was.
    """
    resuming = cfg["load_path"] is not None or (
        cfg["autoresume"] and newest_complete_checkpoint(save_folder, CHECKPOINT_FILENAME) is not None)
    if resuming:
        check_resume_config(cfg, save_folder / CONFIG_YAML)
    if cfg["autoresume"]:
        repair_latest_checkpoint(save_folder, CHECKPOINT_FILENAME, LATEST_CHECKPOINT, fallback=cfg["load_path"])


def build_trainer(cfg: Mapping[str, Any], data: RunData, callbacks=()) -> tuple[Trainer, list[EvalSet]]:
    """Composer's ``Trainer`` for a :func:`resolve_config` config and its :func:`run_data`, with a new seeded model.

    ``trainer.state.model`` is the :class:`~llm.train.composer_model.ComposerMosaicGPT` (one
    process, so not wrapped). Loads ``load_path`` (or, with ``autoresume``, the newest checkpoint
    in ``save_folder``), so ``trainer.state.timestamp`` is where training resumes. A resume into a
    folder whose ``config.yaml`` holds other settings is refused first (see
    :mod:`llm.train.run_folder`); checkpoints earlier runs left there count towards
    ``save_num_checkpoints_to_keep``. :func:`train` also holds the folder's lock; this does not.
    Composer's ``SpeedMonitor`` logs tokens/s and MFU (against :func:`peak_flops`); ``callbacks``
    are added to the trainer's.

    Returns:
        The trainer, and the eval sets (one per eval stream) its evaluators run on.

    Raises:
        PreparedDataError: if ``max_seq_len`` exceeds the prepared rows.
        RunFolderError: for a resume under a config other than the folder's ``config.yaml``.
        ValueError: for a checkpoint that does not fit the model, or whatever Composer raises.
    """
    # Seed before building the model so its initial weights depend on the seed alone.
    reproducibility.seed_all(cfg["seed"])
    model = build_model(cfg, data.tokenizer)
    text = cfg["train_loader"].get("name", "text") == "text"
    compile_config = _compile_config(cfg["compile_config"], text)
    if compile_config is not None:
        use_inductor_cache()
        model.compile_loss(compile_config)
    max_seq_len = model.config.max_seq_len
    bucketed = compile_config is not None
    train_loader = build_train_loader(cfg["train_loader"], data.train, data.tokenizer, max_seq_len,
                                      device_batch_size(cfg["global_train_batch_size"]), seed=cfg["seed"],
                                      bucketed=bucketed)
    _check_one_batch(train_loader, cfg)
    eval_sets = build_eval_loaders(cfg["eval_loader"], data.eval, data.tokenizer, max_seq_len,
                                   cfg["device_eval_batch_size"], seed=cfg["seed"], bucketed=bucketed)
    if not text:  # the exported model stops where its fine-tuned turns end
        ends = use_chat_template(data.tokenizer, cfg["train_loader"]["dataset"].get("chat_template", "auto"))
        model.model.generation_config = dataclasses.replace(model.model.generation_config, eos_token_id=ends)
    metric_names = list(model.get_metrics(is_train=False))
    evaluators = [Evaluator(label=s.label, dataloader=s.loader, metric_names=metric_names) for s in eval_sets]
    fsdp = (cfg["parallelism_config"] or {}).get("fsdp")
    if fsdp is not None:
        mark_fsdp_units(model, activation_checkpointing=fsdp.get("activation_checkpointing", False))
    # Checkpoints are written atomically; before an autoresume, a half-written one (from an older
    # run) is moved aside and latest-rank0.pt repaired; the checkpoint to load must fit the model.
    install_atomic_checkpoint_writes()
    save_folder = Path(cfg["save_folder"])
    latest = save_folder / LATEST_CHECKPOINT.format(rank=0)
    on_rank_zero(lambda: _prepare_run_folder(cfg, save_folder))
    to_load = latest if cfg["autoresume"] and latest.is_file() else cfg["load_path"]
    if to_load is not None and "://" not in str(to_load) and not Path(to_load).is_file():
        raise ConfigError("load_path", f"no checkpoint file {to_load} (give a training checkpoint, e.g. "
                          f"{save_folder / LATEST_CHECKPOINT.format(rank=0)}; or autoresume: true to take the "
                          "run's newest)")
    if to_load is not None and Path(to_load).is_file():
        check_checkpoint(to_load, model)
    trainer = Trainer(
        run_name=cfg["run_name"] or save_folder.name,
        model=model,
        # Microbatches (and ranks) weighted by their scored tokens: exact for padded fine-tuning batches.
        train_dataloader=token_counting_data_spec(train_loader),
        accumulate_train_batch_on_tokens=True,
        eval_dataloader=evaluators,
        optimizers=_optimizer(cfg["optimizer"], model),
        schedulers=_build(SCHEDULERS, cfg["scheduler"]),
        algorithms=[ALGORITHMS[name](**options) for name, options in cfg["algorithms"].items()],
        max_duration=cfg["max_duration"],
        eval_interval=cfg["eval_interval"],
        eval_subset_num_batches=cfg["eval_subset_num_batches"],
        device_train_microbatch_size=cfg["device_train_microbatch_size"],
        precision=composer_precision(cfg["precision"], model),
        compile_config=compile_config,
        seed=cfg["seed"],
        # a bar redrawn with cursor escapes is noise in a log file: there, one console line per interval
        progress_bar=cfg["progress_bar"] and output_is_terminal(),
        log_to_console=cfg["log_to_console"] or (cfg["progress_bar"] and not output_is_terminal()),
        console_log_interval=cfg["console_log_interval"],
        save_folder=str(save_folder),
        save_filename=CHECKPOINT_FILENAME,
        save_latest_filename=LATEST_CHECKPOINT,
        save_interval=cfg["save_interval"],
        save_num_checkpoints_to_keep=cfg["save_num_checkpoints_to_keep"],
        load_path=cfg["load_path"],
        autoresume=cfg["autoresume"],
        parallelism_config=cfg["parallelism_config"],
        callbacks=[StopOnNonFiniteLoss(), CurvePlotter(save_folder), ConfigSaver(cfg, save_folder),
                   RunPlan(max_seq_len if text else None, compiled=compile_config is not None),
                   SpeedMonitor(window_size=10, gpu_flops_available=peak_flops(cfg)), *callbacks],
    )
    adopt_earlier_checkpoints(trainer, save_folder, CHECKPOINT_FILENAME)
    return trainer, eval_sets


def _check_one_batch(loader, cfg: Mapping[str, Any]) -> None:
    """Refuse training data that makes no batch (fewer sequences than ``global_train_batch_size``
    with ``train_loader.drop_last``), on which Composer would train nothing.

    Raises:
        ConfigError: naming the sizes and the two ways out.
    """
    try:
        batches, sequences = len(loader), len(loader.dataset) * dist.get_world_size()
    except TypeError:  # a loader of unknown length
        return
    if batches == 0:
        raise ConfigError("global_train_batch_size",
                          f"{cfg['global_train_batch_size']} is more than the training data's {sequences} sequences "
                          "and train_loader.drop_last is true, so there is no batch to train on: use a "
                          f"global_train_batch_size of at most {sequences} or train_loader.drop_last: false")


def _compile_config(options: dict[str, Any] | None, text: bool) -> dict[str, Any] | None:
    """The run's ``compile_config`` (``options``): a fine-tuning run's (not ``text``) batches come
    in a few padded lengths (see ``bucketed`` in :func:`~llm.train.builders.build_train_loader`),
    each compiled statically (``dynamic: false`` unless the config says otherwise): torch 2.7's
    dynamic-shape backward fails an inductor size/stride assertion on them."""
    options = run_compile_config(options)
    if options is None or text or options.get("dynamic") is not None:
        return options
    return {**options, "dynamic": False}


def output_is_terminal() -> bool:
    """Whether the run's output goes to a terminal (both stdout and stderr)."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def figures(nats_per_token: float, predicted_tokens: int, tokens_per_byte: float) -> dict[str, float]:
    """Cross-entropy figures of one evaluation: nats/token, perplexity, tokens/byte, bits/byte.

    Bits per byte = nats/token * tokens/byte / ln 2, comparable across tokenizers.
    """
    return {
        "nats_per_token": nats_per_token,
        "perplexity": math.exp(nats_per_token),
        "predicted_tokens": predicted_tokens,
        "tokens_per_byte": tokens_per_byte,
        "bits_per_byte": nats_per_token * tokens_per_byte / math.log(2),
    }


def combine(results: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The figures of several evaluations taken together: total nats over total tokens and bytes."""
    tokens = sum(r["predicted_tokens"] for r in results.values())
    nats = sum(r["nats_per_token"] * r["predicted_tokens"] for r in results.values())
    n_bytes = sum(r["predicted_tokens"] / r["tokens_per_byte"] for r in results.values())
    return figures(nats / tokens, tokens, tokens / n_bytes)


def _ignore_short_eval_warnings() -> None:
    """Silence (inside ``warnings.catch_warnings``) Composer's warnings about what a small split
    does by design: a last batch shorter than the batch size, and a split of fewer batches than
    ``eval_subset_num_batches`` (then the evaluations during training read all of it), which a
    small corpus of one's own repeats at every evaluation."""
    warnings.filterwarnings("ignore", message="Cannot split (tensor|list) of length", category=UserWarning)
    warnings.filterwarnings("ignore", message="DataloaderNumBatchesWarning")


def evaluate_sets(trainer: Trainer, eval_sets: list[EvalSet], *, prefix: str = "") -> dict[str, dict[str, float]]:
    """Cross-entropy of the trainer's model over the whole of each eval set, by label.

    Returns:
        ``{label: figures(...)}`` (see :func:`figures`); the mean is over every predicted token of
        the set (every sequence's positions 1..n-1 for text, the responses for fine-tuning).
    """
    results = {}
    for eval_set in eval_sets:
        label = f"{prefix}{eval_set.label}"
        # A label of its own and subset -1: the training evaluators stop at eval_subset_num_batches.
        evaluator = Evaluator(label=label, dataloader=eval_set.loader, metric_names=["LanguageCrossEntropy"],
                              subset_num_batches=-1)
        with warnings.catch_warnings():
            _ignore_short_eval_warnings()
            trainer.eval(eval_dataloader=evaluator, subset_num_batches=-1)
        nats = float(trainer.state.eval_metrics[label]["LanguageCrossEntropy"].compute())
        results[eval_set.label] = figures(nats, eval_set.predicted_tokens, eval_set.tokens_per_byte)
    return results


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


def train(cfg: Mapping | DictConfig) -> dict[str, Any]:
    """Train, evaluate every eval stream on its whole split, export the model, print samples.

    Steps: validate ``cfg`` (:func:`resolve_config`) and its data and tokenizer
    (:func:`llm.train.builders.run_data`) before anything is written; train with Composer
    (checkpoints in ``save_folder``; resuming from ``load_path`` or, with ``autoresume``, from the
    newest checkpoint there, at the same place in the data); evaluate; write
    ``<save_folder>/model`` (weights and tokenizer) and ``<save_folder>/metrics.json``; print the
    figures and ``num_samples`` samples.

    Returns:
        ``metrics.json``'s contents (``run_name``, ``start_batch`` (0, or the batch resumed
        from), ``batches`` and ``tokens`` trained in all, ``num_parameters``, ``vocab_size``,
        ``heldout`` (by eval set: ``nats_per_token``, ``perplexity``, ``predicted_tokens``,
        ``tokens_per_byte``, ``bits_per_byte``), the same figures for all eval sets together as
        ``heldout_nats_per_token``, ``heldout_perplexity``, ``tokens_per_byte`` and
        ``bits_per_byte``, ``fit_seconds`` (training with its evaluations and checkpoints),
        ``wall_seconds``, ``train_seconds`` (the batches alone), ``tokens_per_s`` (over this call's
        batches after the first, so without a compiled run's compiling), ``compile_seconds`` (a
        compiled run's first batch less a typical one), ``mfu`` (tokens_per_s's FLOPs over
        :func:`peak_flops`; None on a GPU)) plus
        ``samples`` (list of str),
        ``model_dir`` and ``checkpoint`` (the newest checkpoint's path, or None).

    Under ``composer -n N`` (data parallel; each rank gets ``global_train_batch_size / N``
    sequences per batch, disjoint samples), rank 0 writes the exports, samples and metrics;
    every rank trains and evaluates. The other ranks return the figures without ``samples``.

    Once the config and data are checked, ``save_folder`` is locked until this returns
    (:func:`llm.train.run_folder.hold_run_folder`): a second training on it meanwhile is refused.

    Raises:
        llm.utils.config.ConfigError: for a bad config (any key, any depth).
        PreparedDataError: for missing shards or a tokenizer / vocabulary that does not fit them.
        RunFolderError: if another run holds ``save_folder``, or it holds a run trained under
            other settings (see :func:`build_trainer`).
    """
    started = time.perf_counter()
    cfg = resolve_config(cfg)
    data = run_data(cfg)
    if dist.get_world_size() > 1:
        dist.initialize_dist(get_device(None))
    with hold_run_folder(cfg["save_folder"]):
        return _train(cfg, data, started)


def _metrics(cfg, trainer, model, vocab_size: int, heldout: dict, start_batch: int, fit_seconds: float,
             started: float, clock: BatchClock) -> dict[str, Any]:
    """What ``metrics.json`` holds: the run's size and progress, the held-out results (per eval
    set and over all), the speed of this fit's batches (compiling left out) and its MFU where the
    device's peak is known."""
    overall = combine(heldout)
    metrics = {
        "run_name": trainer.state.run_name,
        "start_batch": start_batch,
        "batches": int(trainer.state.timestamp.batch),
        "tokens": int(trainer.state.timestamp.token),
        "num_parameters": model.model.num_parameters(),
        "vocab_size": vocab_size,
        "heldout": heldout,
        "heldout_nats_per_token": overall["nats_per_token"],
        "heldout_perplexity": overall["perplexity"],
        "tokens_per_byte": overall["tokens_per_byte"],
        "bits_per_byte": overall["bits_per_byte"],
        "fit_seconds": fit_seconds,
        "wall_seconds": time.perf_counter() - started,
        **clock.speed(compiled=run_compile_config(cfg["compile_config"]) is not None),
    }
    peak = peak_flops(cfg, again=True)
    metrics["mfu"] = (metrics["tokens_per_s"] * flops_per_token(model.config, model.config.max_seq_len) / peak
                      if peak and metrics["tokens_per_s"] else None)
    return metrics


def _print_results(heldout: dict, metrics: dict[str, Any]) -> None:
    for label, r in heldout.items():
        print(f"held-out {label}: {r['nats_per_token']:.4f} nats/token (perplexity {r['perplexity']:.2f}), "
              f"{r['tokens_per_byte']:.4f} tokens/byte, {r['bits_per_byte']:.4f} bits/byte")
    print(
        f"held-out{' (all eval sets)' if len(heldout) > 1 else ''}: {metrics['bits_per_byte']:.4f} bits/byte after "
        f"{metrics['batches']} batches ({metrics['fit_seconds']:.0f} s training, {metrics['wall_seconds']:.0f} s in "
        f"all; {metrics['tokens_per_s']:,.0f} tokens/s" + (f", MFU {metrics['mfu']:.1%}" if metrics["mfu"] else "")
        + (f"; compiling {metrics['compile_seconds']:.0f} s" if metrics["compile_seconds"] else "") + ")"
    )


def _train(cfg: dict[str, Any], data: RunData, started: float) -> dict[str, Any]:
    """:func:`train`'s work once the config and data are checked and the run folder is held."""
    rank0 = dist.get_global_rank() == 0
    save_folder = Path(cfg["save_folder"])
    if dist.get_local_rank() == 0:
        clean_stale_registrations(data.train + data.eval)
    dist.barrier()
    tokenizer = data.tokenizer
    clock = BatchClock()
    trainer, eval_sets = build_trainer(cfg, data, callbacks=[clock])
    model = getattr(trainer.state.model, "module", trainer.state.model)  # unwrapped from DDP
    start_batch = int(trainer.state.timestamp.batch)
    max_duration = trainer.state.max_duration
    # Composer refuses to fit a run that has reached max_duration (e.g. `make train` again after it
    # finished, with autoresume): evaluate and export it as it is.
    finished = trainer.state.timestamp.get(max_duration.unit) >= max_duration
    sources = ", ".join(f"{s.name} ({s.local}, {s.split})" for s in data.train) or cfg["train_loader"]["dataset"].get("path")
    print(
        f"run {trainer.state.run_name}: {model.model.num_parameters():,} parameters, tokenizer of "
        f"{len(tokenizer)} tokens, training on {sources} in sequences of {model.config.max_seq_len} tokens, "
        f"max_duration {cfg['max_duration']}" + (f", resuming at batch {start_batch}" if start_batch else "")
        + (" (already trained that far: evaluating only)" if finished else ""),
        flush=True,
    )

    fit_started = time.perf_counter()
    if not finished:
        with warnings.catch_warnings():
            _ignore_short_eval_warnings()
            trainer.fit()
    fit_seconds = time.perf_counter() - fit_started

    heldout = evaluate_sets(trainer, eval_sets, prefix="heldout/")  # on every rank
    metrics = _metrics(cfg, trainer, model, len(tokenizer), heldout, start_batch, fit_seconds, started, clock)
    model_dir = save_folder / MODEL_DIR
    latest = save_folder / LATEST_CHECKPOINT.format(rank=0)
    result = {**metrics, "samples": [], "model_dir": str(model_dir),
              "checkpoint": os.path.realpath(latest) if latest.exists() else None}
    if not rank0:
        dist.barrier()  # rank 0 writes the exports
        return result
    model.model.save_pretrained(model_dir, tokenizer=tokenizer)
    # Written before sampling, so nothing computed is lost to a late error.
    atomic_write(save_folder / METRICS_FILE, lambda tmp: Path(tmp).write_text(json.dumps(metrics, indent=2) + "\n"))
    _print_results(heldout, metrics)
    print(f"model and tokenizer: {model_dir}; metrics: {save_folder / METRICS_FILE}")
    result["samples"] = generate_samples(
        model.model,
        tokenizer,
        list(cfg["sample_prompts"]),
        num_samples=cfg["num_samples"],
        max_new_tokens=cfg["sample_max_new_tokens"],
        temperature=cfg["sample_temperature"],
        top_k=cfg["sample_top_k"],
        seed=cfg["seed"],
    )
    for i, sample in enumerate(result["samples"], 1):
        print(f"\n--- sample {i} ---\n{sample}")
    dist.barrier()
    return result
