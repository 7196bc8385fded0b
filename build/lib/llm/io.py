"""File helpers shared by the model, the cache and the checkpoints: atomic writes and weight checks."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Mapping

import torch


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], *, prefix: str = ".") -> None:
    """Call ``write(temporary_path)``, flush it to disk, then rename it to ``path``.

    A crash at any point leaves either the old file or the new one under ``path``, never a
    half-written one; the temporary file (``prefix`` + name + random suffix, in the same
    folder) is removed on failure.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{prefix}{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def shape_mismatches(expected: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor]) -> list[str]:
    """What keeps ``found`` weights from loading into a module whose state dict is ``expected``.

    Returns one line per missing, unexpected or wrongly shaped tensor (empty if they fit).
    """
    problems = [f"missing {k} {tuple(v.shape)}" for k, v in expected.items() if k not in found]
    problems += [f"unexpected {k} {tuple(v.shape)}" for k, v in found.items() if k not in expected]
    problems += [
        f"{k}: file has {tuple(found[k].shape)}, model needs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in found and tuple(found[k].shape) != tuple(v.shape)
    ]
    return problems
