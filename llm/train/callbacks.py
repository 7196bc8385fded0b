"""Composer callbacks for looking at a run: loss curves as a PNG, and the resolved config as YAML.

* :class:`CurvePlotter` records the training loss (Composer's all-reduced ``loss/train/total``,
  nats/token) and learning rate after every batch, and every evaluator's metrics at the end of
  each evaluation; it draws them into ``<folder>/curves.png`` (and writes the numbers to
  ``<folder>/curves.json``) after each evaluation and at the end of ``fit``. Its history is part
  of Composer's checkpoints (``state_dict``), so a resumed run's plot covers the whole run.
* :class:`ConfigSaver` writes the run's resolved config to ``<folder>/config.yaml`` when ``fit``
  starts.
* :class:`RunPlan` says, when ``fit`` starts, how many batches, tokens and epochs the run makes
  (from ``max_duration`` and the training data's size), and after its first batches how long
  it will take at the speed measured.
* :class:`BatchClock` times every training batch of this process (evaluations and checkpoints
  left out), for tokens/s without the first batch's compiling.
* :class:`StopOnNonFiniteLoss` ends the run with :class:`NonFiniteLossError` at the first batch
  whose loss is NaN or infinite, before that batch's optimizer step and checkpoint, so nothing
  NaN is saved.

Both write on global rank 0 only, to a temporary file renamed into place.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from composer.core import Callback, State, TimeUnit
from composer.loggers import Logger
from composer.utils import dist
from omegaconf import DictConfig, OmegaConf

from llm.io import atomic_write

CURVES_PNG = "curves.png"
CURVES_JSON = "curves.json"
CONFIG_YAML = "config.yaml"


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite (a diverged run): raised by :class:`StopOnNonFiniteLoss`."""


class StopOnNonFiniteLoss(Callback):
    """Stop training at the first batch whose loss is not finite, naming the batch and the loss.

    Checked after the loss (``AFTER_LOSS``), before backward, the optimizer step and any
    checkpoint of the batch, so the weights, checkpoints, metrics and model bundle the run leaves
    are all from before it diverged. The flag is reduced over ranks (max), so that every rank
    stops at the same batch under DDP."""

    def after_loss(self, state: State, logger: Logger) -> None:
        import torch

        losses = state.loss.values() if isinstance(state.loss, dict) else (
            state.loss if isinstance(state.loss, (list, tuple)) else [state.loss])
        values = [torch.as_tensor(v).detach() for v in losses]
        # on the loss's device (NCCL reduces only GPU tensors), read once: one sync per batch
        bad = torch.stack([~torch.isfinite(v).all() for v in values]).any().float().reshape(1)
        dist.all_reduce(bad, reduce_operation="MAX")
        if bad.item():
            shown = ", ".join(f"{float(v.float().mean()):g}" for v in values)
            raise NonFiniteLossError(
                f"the training loss is not finite ({shown}) at batch {int(state.timestamp.batch) + 1}: the run "
                f"diverged (a learning rate too high for the model, or bad data?); training stopped before this "
                f"batch's update, so its checkpoints hold no NaN")


def _replace_file(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: write(Path(tmp)))


class CurvePlotter(Callback):
    """Record training loss, learning rate and evaluation metrics; plot them to a PNG.

    Args:
        folder: where ``curves.png`` and ``curves.json`` go (the run's ``save_folder``).
        title: the plot's title (default: the run name).

    Attributes:
        train: ``[[batch, loss, lr], ...]``, one row per training batch.
        eval: ``{label: {metric: [[batch, value], ...]}}``, one point per evaluation.
    """

    def __init__(self, folder: str | os.PathLike, title: str | None = None):
        self.folder = Path(folder)
        self.title = title
        self.train: list[list[float]] = []
        self.eval: dict[str, dict[str, list[list[float]]]] = {}

    # -- Composer events ------------------------------------------------------------------------
    def batch_end(self, state: State, logger: Logger) -> None:
        loss = (state.total_loss_dict or {}).get("loss/train/total")
        if loss is None:  # e.g. a skipped step under gradient scaling
            return
        lr = state.optimizers[0].param_groups[0]["lr"] if state.optimizers else math.nan
        self.train.append([int(state.timestamp.batch), float(loss), float(lr)])

    def eval_end(self, state: State, logger: Logger) -> None:
        label = state.dataloader_label or "eval"
        batch = int(state.timestamp.batch)
        for name, value in state.eval_metric_values.items():
            self.eval.setdefault(label, {}).setdefault(name, []).append([batch, float(value)])
        self.save(state.run_name)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.save(state.run_name)

    # -- checkpointed state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"train": [list(row) for row in self.train],
                "eval": {k: {m: [list(p) for p in v] for m, v in d.items()} for k, d in self.eval.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train = [list(row) for row in state.get("train", [])]
        self.eval = {k: {m: [list(p) for p in v] for m, v in d.items()} for k, d in state.get("eval", {}).items()}

    # -- output -----------------------------------------------------------------------------------
    def save(self, run_name: str | None = None) -> None:
        """Write ``curves.json`` and ``curves.png`` (global rank 0 only)."""
        if dist.get_global_rank() != 0:
            return
        data = {"run_name": run_name, **self.state_dict()}
        _replace_file(self.folder / CURVES_JSON, lambda p: p.write_text(json.dumps(data) + "\n"))
        _replace_file(self.folder / CURVES_PNG, lambda p: self.figure(run_name).savefig(p, format="png", dpi=100))

    def figure(self, run_name: str | None = None):
        """A matplotlib ``Figure`` (Agg canvas, no pyplot): loss and eval cross-entropy over batches, and lr."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 6), layout="constrained")
        FigureCanvasAgg(fig)
        loss_ax, lr_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
        if self.train:
            batches, losses, lrs = zip(*self.train)
            loss_ax.plot(batches, losses, lw=0.8, alpha=0.8, label="train loss")
            lr_ax.plot(batches, lrs, color="tab:gray")
        for label, metrics in self.eval.items():
            points = metrics.get("LanguageCrossEntropy")
            if points:
                xs, ys = zip(*points)
                loss_ax.plot(xs, ys, marker="o", ms=4, lw=1.2, label=f"{label} cross-entropy")
        loss_ax.set_ylabel("nats / token")
        loss_ax.grid(alpha=0.3)
        if loss_ax.has_data():
            loss_ax.legend()
        lr_ax.set_ylabel("learning rate")
        lr_ax.set_xlabel("batch")
        lr_ax.grid(alpha=0.3)
        fig.suptitle(self.title or run_name or "training")
        return fig


class ConfigSaver(Callback):
    """Write the run's resolved config to ``<folder>/config.yaml`` at ``fit_start`` (global rank 0).

    A resumed run overwrites it with its own config: one that differs only in keys that leave the
    weights as they are (e.g. a longer ``max_duration``), or that ``allow_config_change`` let through
    (:mod:`llm.train.run_folder` checks before training). It is written when ``fit`` starts, not
    before: a run that does not train (already at ``max_duration``) keeps the config its weights had.
    """

    def __init__(self, cfg: Mapping | DictConfig, folder: str | os.PathLike, filename: str = CONFIG_YAML):
        container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        self.yaml = OmegaConf.to_yaml(OmegaConf.create(container))
        self.path = Path(folder) / filename

    def fit_start(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() == 0:
            _replace_file(self.path, lambda p: p.write_text(self.yaml))


class BatchClock(Callback):
    """Seconds and tokens (all ranks') of each training batch of this ``fit``, from its start to its
    end: evaluations and checkpoints, which come after a batch ends, are not in them.

    Attributes:
        seconds: per batch, in order; tokens: per batch.
    """

    def __init__(self):
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self._start, self._tokens = 0.0, 0

    def batch_start(self, state: State, logger: Logger) -> None:
        self._start, self._tokens = time.perf_counter(), int(state.timestamp.token)

    def batch_end(self, state: State, logger: Logger) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        self.tokens.append(int(state.timestamp.token) - self._tokens)

    def speed(self, compiled: bool) -> dict[str, float]:
        """``train_seconds`` (all batches), ``tokens_per_s`` (over the batches after the first, which
        compiles a compiled run's step; the first alone for a one-batch fit) and
        ``compile_seconds`` (a compiled run's first batch less the median of the others; 0 for an
        eager run or a fit of one batch)."""
        seconds, tokens = self.seconds, self.tokens
        result = {"train_seconds": sum(seconds), "tokens_per_s": 0.0, "compile_seconds": 0.0}
        if not seconds:
            return result
        steady_s, steady_tokens = (seconds[1:], tokens[1:]) if len(seconds) > 1 else (seconds, tokens)
        result["tokens_per_s"] = sum(steady_tokens) / sum(steady_s) if sum(steady_s) > 0 else 0.0
        if compiled and len(seconds) > 1:
            result["compile_seconds"] = max(0.0, seconds[0] - sorted(seconds[1:])[len(seconds[1:]) // 2])
        return result


class RunPlan(Callback):
    """Lines on stderr (rank 0) that size the run against its data: at ``fit_start``, the batches
    left, the tokens per batch and per epoch and the epochs the run makes (``max_duration`` in
    batches, epochs, samples or tokens); after batch ``after`` of this process, the time left at
    the speed of its batches so far, the first (which may compile) left out. A ``compiled`` run
    says at ``fit_start`` that its first batch waits for ``torch.compile``, and after it how long
    that batch took.

    Args:
        tokens_per_sample: the sequence length (text batches are full rows of it); None for
            padded batches of varying length (fine-tuning), counted in samples instead.
        after: the batch after which the time is estimated.
        compiled: whether the run compiles its training step (``compile_config``).
    """

    def __init__(self, tokens_per_sample: int | None, after: int = 10, compiled: bool = False):
        self.tokens_per_sample, self.after, self.compiled = tokens_per_sample, after, compiled
        self._batches: int | None = None
        self._seen, self._start, self._fit_start = 0, None, None

    def fit_start(self, state: State, logger: Logger) -> None:
        batches = self._total_batches(state)
        if batches is None or state.dataloader_len is None:
            return
        done = int(state.timestamp.batch)
        self._batches = batches - done
        per_epoch, samples = int(state.dataloader_len), self._samples_per_batch(state)
        unit = "samples" if self.tokens_per_sample is None else "tokens"
        size = samples * (self.tokens_per_sample or 1)

        def amount(n: int) -> str:
            return f"{n / 1e6:.2f}M {unit}" if n >= 1e6 else f"{n:,} {unit}"

        if dist.get_global_rank() == 0:
            print(f"run plan: {batches:,} batches of {amount(size)} ({amount(batches * size)}), an epoch is {per_epoch:,} "
                  f"batch{'es' if per_epoch != 1 else ''} ({amount(per_epoch * size)}): {batches / per_epoch:.2f} epochs"
                  + (f"; resuming at batch {done:,}" if done else "")
                  + ("; the first batch compiles the training step (torch.compile)" if self.compiled else ""),
                  file=sys.stderr, flush=True)
        self._fit_start = time.perf_counter()

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._batches is None:
            return
        self._seen += 1
        if self._seen == 1:
            self._start = time.perf_counter()
            if self.compiled and dist.get_global_rank() == 0:
                print(f"run plan: the first batch took {self._start - self._fit_start:.0f} s (compiling)",
                      file=sys.stderr, flush=True)
        elif self._seen == self.after and dist.get_global_rank() == 0:
            per_batch = (time.perf_counter() - self._start) / (self._seen - 1)
            left = self._batches - self._seen
            print(f"run plan: {per_batch:.2f} s per batch over this run's batches 2-{self._seen}: about "
                  f"{left * per_batch / 60:.1f} minutes of training left (evaluations not counted)",
                  file=sys.stderr, flush=True)

    @staticmethod
    def _samples_per_batch(state: State) -> int:
        loader = state.train_dataloader
        size = int(getattr(loader, "batch_size", 0) or 0)
        try:  # data smaller than a batch (drop_last: false) makes one short batch
            size = min(size, len(loader.dataset))
        except TypeError:  # a dataset of unknown length
            pass
        return size * dist.get_world_size()

    def _total_batches(self, state: State) -> int | None:
        total = state.max_duration
        if total is None:
            return None
        per_epoch = int(state.dataloader_len) if state.dataloader_len is not None else None
        samples = self._samples_per_batch(state)
        if total.unit == TimeUnit.BATCH:
            return int(total.value)
        if total.unit == TimeUnit.EPOCH and per_epoch:
            return int(total.value) * per_epoch
        if total.unit == TimeUnit.SAMPLE and samples:
            return -(-int(total.value) // samples)
        if total.unit == TimeUnit.TOKEN and samples and self.tokens_per_sample:
            return -(-int(total.value) // (samples * self.tokens_per_sample))
        return None
