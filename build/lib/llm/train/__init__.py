"""Training and evaluation through MosaicML Composer: the only part of ``llm`` that imports Composer.

* :mod:`llm.train.trainer`: :func:`train` from an llm-foundry-style YAML config.
* :mod:`llm.train.builders`: data loaders, pretrained starts, FSDP marks, token-weighted batches.
* :mod:`llm.train.composer_model`: :class:`ComposerMosaicGPT`, the causal-LM loss and metrics.
* :mod:`llm.train.evaluate`: held-out cross-entropy, perplexity and bits per byte.
* :mod:`llm.train.callbacks`, :mod:`llm.train.checkpointing`: curves, saved config, atomic checkpoints.
"""

from llm.utils.extras import require

require("train", "composer", "streaming")

from llm.train.trainer import build_trainer, resolve_config, train  # noqa: E402

__all__ = ["build_trainer", "resolve_config", "train"]
