"""MosaicGPT as a Composer model: causal LM loss and language-modelling metrics (after llm-foundry)."""

from __future__ import annotations

import weakref
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity
from composer.models import ComposerModel
from torchmetrics import Metric

from llm.config import MosaicGPTConfig
from llm.model import MosaicGPT
from llm.train.speed import flops_per_batch

IGNORE_INDEX = -100


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in nats of (batch, seq, vocab_size) logits against (batch, seq) int64
    targets, over those that are not -100; float32 even under autocast (a bf16 log-softmax over
    the vocabulary loses precision). NaN if every target is -100."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


class TrainingCrossEntropy(LanguageCrossEntropy):
    """Composer's ``LanguageCrossEntropy`` (nats per scored token) that can also be updated from
    a loss already computed over logits: ``update(mean_loss, scored=n)`` adds ``mean_loss * n``
    over ``n`` scored tokens (a 0-dim float tensor and a 0-dim integer tensor), which is what
    ``update(logits, targets)`` would add without a second log-softmax over the vocabulary;
    ``update(logits, targets)`` works as in Composer."""

    def update(self, output: torch.Tensor, target: torch.Tensor | None = None, *,
               scored: torch.Tensor | None = None) -> None:
        if scored is None:
            super().update(output, target)
            return
        self.sum_loss += torch.where(scored > 0, output * scored, torch.zeros_like(output))
        self.total_items += scored


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets: ``labels`` shifted left by one, the last position set to -100.

    Args:
        labels: (batch, seq) int64 token ids, -100 where no loss is wanted.

    Returns:
        (batch, seq) int64, where position t holds ``labels[:, t + 1]``: the token that the
        logits at position t predict. The last position has no next token, so it is ignored.
    """
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


class ComposerMosaicGPT(ComposerModel):
    """A :class:`~llm.model.MosaicGPT` trained by Composer's ``Trainer`` as a causal LM.

    Batches are mappings with ``input_ids`` (batch, seq) int64, unshifted ``labels``
    (batch, seq) int64 with -100 for positions to ignore, and optionally ``attention_mask``
    (batch, seq), 1 for real tokens and 0 for padding. The loss and the metrics compare the
    logits at position t with ``labels[:, t + 1]`` (llm-foundry's convention).

    Metrics: ``LanguageCrossEntropy`` (nats/token) while training; ``LanguageCrossEntropy``
    and ``LanguagePerplexity`` on evaluation.

    Args:
        config_or_model: a :class:`~llm.config.MosaicGPTConfig` to build a freshly initialised
            model from, or an existing :class:`~llm.model.MosaicGPT` to wrap (not copied).

    Raises:
        TypeError: if ``config_or_model`` is neither.
    """

    def __init__(self, config_or_model: MosaicGPTConfig | MosaicGPT):
        super().__init__()
        if isinstance(config_or_model, MosaicGPT):
            self.model = config_or_model
        elif isinstance(config_or_model, MosaicGPTConfig):
            self.model = MosaicGPT(config_or_model)
        else:
            raise TypeError(
                f"expected a MosaicGPTConfig or a MosaicGPT, got {type(config_or_model).__name__}"
            )
        # bfloat16 autocast of the forward on a CPU, where Composer has none (set by the trainer)
        self.autocast_dtype: torch.dtype | None = None
        # the loss, compiled with the forward when the run compiles (see compile_loss)
        self._loss_fn = next_token_loss
        # (a weak reference to the logits, their mean loss, scored tokens) of the last loss, for
        # the training metric; weak, so that the model holds no activations and deep-copies
        self._last_loss: tuple[weakref.ref, torch.Tensor, torch.Tensor] | None = None
        # Plain dicts, not ModuleDicts: Composer deep-copies the metrics it uses, and metric
        # state must not end up in the model's state_dict.
        self.train_metrics = {"LanguageCrossEntropy": TrainingCrossEntropy(ignore_index=IGNORE_INDEX)}
        self.eval_metrics = {
            "LanguageCrossEntropy": LanguageCrossEntropy(ignore_index=IGNORE_INDEX),
            "LanguagePerplexity": LanguagePerplexity(ignore_index=IGNORE_INDEX),
        }

    @property
    def config(self) -> MosaicGPTConfig:
        """The wrapped model's configuration."""
        return self.model.config

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Logits (batch, seq, vocab_size) for ``batch["input_ids"]``, honouring an optional
        ``batch["attention_mask"]``.

        Raises:
            KeyError: if the batch has no ``input_ids``.
            ValueError: whatever :meth:`MosaicGPT.forward` raises (e.g. seq > max_seq_len with
                learned positions).
        """
        ids = batch["input_ids"]
        with torch.autocast(ids.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            return self.model(ids, attention_mask=batch.get("attention_mask")).logits

    def flops_per_batch(self, batch: Mapping[str, Any]) -> int:
        """Training FLOPs of ``batch`` (:func:`llm.train.speed.flops_per_batch`), for Composer's
        ``SpeedMonitor``."""
        return flops_per_batch(self.config, batch)

    def loss(self, outputs: torch.Tensor, batch: Mapping[str, Any], *args, **kwargs) -> torch.Tensor:
        """Mean next-token cross-entropy in nats over the positions whose target is not -100.

        Args:
            outputs: logits (batch, seq, vocab_size) from :meth:`forward`.
            batch: holds ``labels`` (batch, seq), unshifted (see :func:`shift_labels`).

        Returns:
            A scalar tensor; NaN if every target is -100 (nothing to average over).
        """
        targets = shift_labels(batch["labels"])
        loss = self._loss_fn(outputs, targets)
        self._last_loss = (weakref.ref(outputs), loss.detach().clone(), (targets != IGNORE_INDEX).sum())
        return loss

    def compile_loss(self, compile_config: Mapping[str, Any]) -> None:
        """Compile :func:`next_token_loss` with ``torch.compile(**compile_config)``.

        Composer's ``compile_config`` compiles the forward only, which leaves the loss's cast,
        float32 log-softmax over the vocabulary and their backward as separate eager passes over
        the logits; compiled, they fuse (the README's Training speed gives the figures).
        """
        self._loss_fn = torch.compile(next_token_loss, **compile_config)

    def eval_forward(self, batch: Mapping[str, Any], outputs: Any | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab_size) for evaluation; reuses ``outputs`` when Composer has them."""
        return outputs if outputs is not None else self.forward(batch)

    def update_metric(self, batch: Mapping[str, Any], outputs: torch.Tensor, metric: Metric) -> None:
        """Update ``metric`` with the logits (batch, seq, vocab_size), in float32, and the shifted
        targets; the training metric of logits that :meth:`loss` has just scored takes that loss."""
        last = self._last_loss
        if last is not None and last[0]() is outputs and isinstance(metric, TrainingCrossEntropy):
            # logits that loss() has just scored (a training microbatch): no second log-softmax
            _, loss, scored = last
            metric.update(loss, scored=scored)
            return
        # bf16 logits (autocast) would make the metric's log-softmax and its sum over the batch's
        # tokens bf16 too: eval cross-entropy came out rounded to ~1e-2 nats.
        metric.update(outputs.float(), shift_labels(batch["labels"]))

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        """The training metrics if ``is_train`` else the evaluation metrics, by name."""
        return self.train_metrics if is_train else self.eval_metrics
