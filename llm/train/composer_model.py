"""MosaicGPT as a Composer model: causal LM loss and language-modelling metrics (after llm-foundry)."""

from __future__ import annotations

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
        # Plain dicts, not ModuleDicts: Composer deep-copies the metrics it uses, and metric
        # state must not end up in the model's state_dict.
        self.train_metrics = {"LanguageCrossEntropy": LanguageCrossEntropy(ignore_index=IGNORE_INDEX)}
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
        # In float32 even under autocast: a bf16 log-softmax over the vocabulary loses precision.
        return F.cross_entropy(
            outputs.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX
        )

    def eval_forward(self, batch: Mapping[str, Any], outputs: Any | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab_size) for evaluation; reuses ``outputs`` when Composer has them."""
        return outputs if outputs is not None else self.forward(batch)

    def update_metric(self, batch: Mapping[str, Any], outputs: torch.Tensor, metric: Metric) -> None:
        """Update ``metric`` with the logits (batch, seq, vocab_size), in float32, and the shifted targets."""
        # bf16 logits (autocast) would make the metric's log-softmax and its sum over the batch's
        # tokens bf16 too: eval cross-entropy came out rounded to ~1e-2 nats.
        metric.update(outputs.float(), shift_labels(batch["labels"]))

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        """The training metrics if ``is_train`` else the evaluation metrics, by name."""
        return self.train_metrics if is_train else self.eval_metrics
