"""Registered pretrained models, and loaders that accept a registered name, a .gguf file or a bundle directory.

A registered name maps to a file under the repository's ``models/`` directory, fetched by
``make data`` (git-ignored).
"""

from __future__ import annotations

import os
from pathlib import Path

from llm.generation.config import GENERATION_CONFIG_FILE, GenerationConfig

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Registered name -> GGUF file (relative to the repository root).
PRETRAINED = {
    "smollm2-135m-instruct": Path("models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

#: Registered name -> the generation settings its authors recommend, the model's
#: ``generation_config`` when loaded by that name (what transformers keeps in a model's
#: generation_config.json). SmolLM2: "temperature=0.2, top_p=0.9" with sampling (the
#: SmolLM2-135M-Instruct model card). At the CLI's general default (temperature 0.8, no
#: truncation) 4 of 12 seeds missed "Berlin" for "What is the capital of Germany?"; with these,
#: none did.
GENERATION_DEFAULTS = {
    "smollm2-135m-instruct": GenerationConfig(do_sample=True, temperature=0.2, top_p=0.9),
}


def load_generation_config(name_or_path: str | os.PathLike) -> GenerationConfig | None:
    """The generation defaults that come with a model: a bundle directory's
    ``generation_config.json``, else a registered name's ``GENERATION_DEFAULTS``; None for neither.

    Raises:
        ValueError: for a ``generation_config.json`` that is not a valid config (naming it).
    """
    path = Path(name_or_path)
    if (path / GENERATION_CONFIG_FILE).is_file():
        return GenerationConfig.from_json_file(path / GENERATION_CONFIG_FILE)
    if not path.exists() and isinstance(name_or_path, str):
        return GENERATION_DEFAULTS.get(name_or_path)
    return None


def registered_path(name: str) -> Path:
    """The file of a registered model.

    Raises:
        KeyError: for a name that is not registered.
        FileNotFoundError: if the file is missing (it is fetched by ``make data``).
    """
    path = REPO_ROOT / PRETRAINED[name]
    if not path.is_file():
        raise FileNotFoundError(
            f"pretrained model {name!r} expects {path}, which is missing: run `make data` to fetch it"
        )
    return path


def resolve(name_or_path: str | os.PathLike) -> tuple[str, Path]:
    """Where to load ``name_or_path`` from: ``("gguf", file)`` or ``("bundle", directory)``.

    An existing path wins over a registered name; a registered name gives its GGUF file; any
    other path ending in ``.gguf`` is a GGUF file (which may not exist: the loader says so);
    everything else is a directory written by ``save_pretrained``.

    Raises:
        FileNotFoundError: for a registered name whose file is missing (run ``make data``).
    """
    path = Path(name_or_path)
    if not path.exists() and isinstance(name_or_path, str) and name_or_path in PRETRAINED:
        return "gguf", registered_path(name_or_path)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        return "gguf", path
    return "bundle", path


def load_tokenizer(name_or_path: str | os.PathLike):
    """The tokenizer of a registered model, a .gguf file or a bundle directory.

    Raises:
        FileNotFoundError: for a missing file or directory (or registered file: run ``make data``).
        ValueError: for an unreadable GGUF file.
    """
    kind, path = resolve(name_or_path)
    if kind == "gguf":
        from llm.formats.gguf import gguf_tokenizer

        return gguf_tokenizer(path)
    from llm.data.tokenizer import load_tokenizer as load_bundle_tokenizer

    return load_bundle_tokenizer(path)
