"""Registered pretrained models: a name -> its file, and where ``from_pretrained`` / ``load_tokenizer``
load a name or a path from (:func:`resolve`).

A registered name maps to a file under the repository's ``models/`` directory, fetched by
``make data`` (git-ignored). This module knows names and paths only (standard library), so every
layer of the package can resolve one; the loaders live with their formats (:mod:`llm.formats`).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Registered name -> GGUF file (relative to the repository root).
PRETRAINED = {
    "smollm2-135m-instruct": Path("models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


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
