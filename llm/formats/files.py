"""Writing exports without losing anything: atomic replacement, and only of what an export wrote."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from llm.io import fresh_sibling, remove_stale_siblings


def replace_directory(target: Path, write, overwrite: bool) -> None:
    """Run ``write(tmp)`` on a new folder beside ``target``, then move it to ``target`` (a crash
    leaves ``target`` as it was). Only a model folder is ever replaced: one that holds
    ``config.json`` and files only (what an export or ``save_pretrained`` writes).

    Raises:
        FileExistsError: if ``target`` exists and not ``overwrite``, or exists and is not a model
            folder (it is never deleted then).
        NotADirectoryError: if an existing parent of ``target`` is a file.
    """
    target = Path(target)
    check_replaceable(target, overwrite, _is_model_folder, "a model folder (config.json and files only)")
    make_parent(target)
    remove_stale_siblings(target)
    tmp = fresh_sibling(target, "tmp")
    tmp.mkdir()  # unlike tempfile.mkdtemp (0700), with the umask's permissions, as any folder
    try:
        write(tmp)
        if target.exists():
            old = fresh_sibling(target, "old")
            os.replace(target, old)
            os.replace(tmp, target)
            if old.is_symlink():  # target was a link to an export: the link is replaced, not what it named
                old.unlink()
            else:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_replaceable(target: Path, overwrite: bool, is_ours, what: str) -> None:
    """Refuse to write ``target`` unless it is new, or ``overwrite`` and ``is_ours(target)`` (what
    an export writes, described by ``what``); the current folder and its parents are never replaced.

    Raises:
        FileExistsError: naming ``target`` and why it is kept.
    """
    if not target.exists():
        return
    if Path.cwd().resolve().is_relative_to(target.resolve()):
        raise FileExistsError(f"{target} is the current folder or holds it: not replacing it; write elsewhere")
    if not overwrite:
        raise FileExistsError(f"{target} exists: pass overwrite=True (--overwrite) to replace it")
    if not is_ours(target):
        raise FileExistsError(f"{target} exists and is not {what}: not replacing it; remove it yourself or "
                              "write elsewhere")


def _is_model_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and all(p.is_file() for p in path.iterdir())


def make_parent(target: Path) -> None:
    """Create ``target``'s parent folders; an existing file in the way is named."""
    for parent in reversed(target.parents):
        if parent.exists() and not parent.is_dir():
            raise NotADirectoryError(f"cannot write {target}: {parent} is a file, not a folder")
    target.parent.mkdir(parents=True, exist_ok=True)
