"""The tokenizer of a registered name, a .gguf file or a bundle directory (:func:`load_tokenizer`).

Names and paths are resolved by :mod:`llm.utils.pretrained`; a model's generation defaults by
:func:`llm.generation.config.load_generation_config`. Both are re-exported here.
"""

from __future__ import annotations

import os

from llm.data.tokenizer import load_tokenizer as load_bundle_tokenizer
from llm.formats.gguf import gguf_tokenizer
from llm.generation.config import GENERATION_DEFAULTS, load_generation_config
from llm.utils.pretrained import PRETRAINED, REPO_ROOT, registered_path, resolve

__all__ = ["GENERATION_DEFAULTS", "PRETRAINED", "REPO_ROOT", "load_generation_config", "load_tokenizer",
           "registered_path", "resolve"]


def load_tokenizer(name_or_path: str | os.PathLike):
    """The tokenizer of a registered model, a .gguf file or a bundle directory.

    Raises:
        FileNotFoundError: for a missing file or directory (or registered file: run ``make data``).
        ValueError: for an unreadable GGUF file.
    """
    kind, path = resolve(name_or_path)
    return gguf_tokenizer(path) if kind == "gguf" else load_bundle_tokenizer(path)
