"""File helpers shared by the model, the cache and the checkpoints: atomic writes and weight checks."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, Mapping

import torch


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], *, prefix: str = ".") -> None:
    """Call ``write(temporary_path)``, flush it to disk, then rename it to ``path``.

    A crash at any point leaves either the old file or the new one under ``path``, never a
    half-written one. The temporary file (:func:`fresh_sibling`) is removed on failure, and one
    left by a process killed mid-write is removed by the next write to ``path``.
    """
    path = Path(path)
    remove_stale_siblings(path, prefix)
    tmp = fresh_sibling(path, "tmp", prefix)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # private until renamed, as mkstemp's
    os.close(fd)
    try:
        write(str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def fresh_sibling(target: Path, suffix: str, prefix: str = ".") -> Path:
    """A name beside ``target`` that nothing has: ``prefix``, its name, this process's id and a random
    part, then ``suffix`` (``.model.gguf.4242-1a2b3c4d.tmp``): hidden, never a user's file, and
    recognizable by :func:`remove_stale_siblings` once the process that made it is gone."""
    return target.with_name(f"{prefix}{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.{suffix}")


def remove_stale_siblings(target: Path, prefix: str = ".") -> None:
    """Remove the :func:`fresh_sibling` files and folders of ``target`` whose process has exited (a
    write killed with ``kill -9`` leaves its temporary behind); a live process's are kept, so two
    writers of one path never delete each other's work. Nothing else is touched."""
    pattern = re.compile(re.escape(f"{prefix}{target.name}.") + r"(\d+)-[0-9a-f]{8}\.(tmp|old)")
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        if found is None or _alive(int(found.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


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
