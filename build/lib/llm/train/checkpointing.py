"""Safer Composer checkpoints: atomic writes, a repair step before autoresume, clear load errors.

Composer 0.32.1 (``composer/utils/checkpoint.py: _write_checkpoint_file``) writes a monolithic
checkpoint with ``open(filename, "wb")`` + ``torch.save``, straight under its final name: a run
killed while writing leaves a truncated ``ep{epoch}-ba{batch}-rank0.pt``. The ``latest-rank0.pt``
symlink is only moved after the write (``CheckpointSaver._save_checkpoint``), so ``autoresume``
still finds the previous checkpoint, but Composer's ``fit_start`` check
(``ensure_folder_has_no_conflicting_files``) then refuses to resume because the truncated file is
"a future checkpoint" (``FileExistsError``). The symlink itself is replaced by ``os.remove`` then
``os.symlink``: a kill between the two leaves no ``latest-rank0.pt``, and autoresume starts
from batch 0, which the same check then refuses.

* :func:`install_atomic_checkpoint_writes` makes Composer write each plain ``.pt`` checkpoint to
  a hidden temporary file in the same folder, fsync it, and rename it into place.
* :func:`repair_latest_checkpoint`, before an autoresume, deletes leftover temporary files, moves
  incomplete checkpoints aside (``*.pt.incomplete``, each named in a warning on stderr with the
  checkpoint resumed from instead) and points ``latest-rank0.pt`` at the newest complete
  checkpoint; :func:`newest_complete_checkpoint` finds that one without changing anything.
* :func:`adopt_earlier_checkpoints` makes ``save_num_checkpoints_to_keep`` hold across restarts
  (Composer prunes only the checkpoints its own process wrote).
* :func:`check_checkpoint` checks that a checkpoint file is readable and fits a model, with an
  error naming the file and the tensors that do not fit (Composer's own errors name neither).
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

from llm.io import atomic_write, shape_mismatches

INCOMPLETE_SUFFIX = ".incomplete"
_TMP_PREFIX = ".partial-"  # a leading dot: no checkpoint pattern of Composer's matches it
DEFAULT_FILENAME = "ep{epoch}-ba{batch}-rank{rank}.pt"

_original_write_checkpoint_file = None


def _atomic_write_checkpoint_file(state_dict: dict[str, Any], filename: str) -> None:
    from composer.utils.checkpoint import is_compressed_pt, is_tar

    if is_tar(filename) or is_compressed_pt(filename):
        return _original_write_checkpoint_file(state_dict, filename)
    atomic_write(filename, lambda tmp: torch.save(state_dict, tmp), prefix=_TMP_PREFIX)


def install_atomic_checkpoint_writes() -> None:
    """Make Composer write plain ``.pt`` checkpoints atomically (temp file, fsync, rename).

    Replaces ``composer.utils.checkpoint._write_checkpoint_file`` (looked up at call time by
    ``_save_checkpoint``) for the whole process; compressed and tar checkpoints keep Composer's
    writer. Idempotent.
    """
    global _original_write_checkpoint_file
    from composer.utils import checkpoint

    if checkpoint._write_checkpoint_file is _atomic_write_checkpoint_file:
        return
    _original_write_checkpoint_file = checkpoint._write_checkpoint_file
    checkpoint._write_checkpoint_file = _atomic_write_checkpoint_file


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a whole ``torch.save`` zip archive (every member's CRC checks out).

    A file truncated by a kill mid-write has no zip central directory and fails this test.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError):
        return False


def _checkpoint_pattern(filename: str, rank: int) -> re.Pattern:
    pattern = re.escape(filename)
    for unit in ("epoch", "batch", "sample", "token"):
        pattern = pattern.replace(re.escape(f"{{{unit}}}"), f"(?P<{unit}>\\d+)")
    pattern = pattern.replace(re.escape("{rank}"), str(rank))
    return re.compile(f"^{pattern}$")


def _checkpoints(folder: Path, filename: str, rank: int) -> list[tuple[dict[str, int], Path]]:
    """The checkpoint files in ``folder`` named by ``filename`` for ``rank``, newest first, with their times."""
    if not folder.is_dir():
        return []
    pattern = _checkpoint_pattern(filename, rank)
    found = []
    for entry in folder.iterdir():
        if (match := pattern.match(entry.name)) and entry.is_file() and not entry.is_symlink():
            found.append(({unit: int(v) for unit, v in match.groupdict().items()}, entry))
    return sorted(found, key=lambda item: tuple(item[0].values()), reverse=True)


def newest_complete_checkpoint(
    save_folder: str | os.PathLike, filename: str = DEFAULT_FILENAME, *, rank: int = 0
) -> Path | None:
    """The newest complete checkpoint in ``save_folder`` (what an autoresume after
    :func:`repair_latest_checkpoint` loads), or None; reads the folder, changes nothing."""
    for _, path in _checkpoints(Path(save_folder), filename, rank):
        if is_complete_checkpoint(path):
            return path
    return None


def repair_latest_checkpoint(
    save_folder: str | os.PathLike,
    filename: str = DEFAULT_FILENAME,
    latest_filename: str = "latest-rank{rank}.pt",
    *,
    rank: int = 0,
    fallback: str | None = None,
) -> Path | None:
    """Make ``save_folder/latest_filename`` point at the newest complete checkpoint; run before autoresume.

    Deletes temporary files left by :func:`install_atomic_checkpoint_writes` in a killed run,
    renames checkpoints that are not complete (see :func:`is_complete_checkpoint`) to
    ``<name>.incomplete`` so Composer's conflicting-files check does not refuse to resume, and
    (re)creates the ``latest`` symlink if it is missing, dangling or points at an incomplete or
    older file. Call it on one process only (the rank that writes checkpoints).

    Falling back past a checkpoint is never silent: each one moved aside is named in a warning on
    stderr (:func:`llm.train.run_folder.warn`), with the checkpoint the run resumes from instead,
    or, if none is left, that it starts from ``fallback`` (e.g. the run's ``load_path``) or from
    scratch.

    Args:
        filename: Composer's ``save_filename`` format (``{epoch}``, ``{batch}``, ``{rank}``...).
        latest_filename: Composer's ``save_latest_filename`` format.
        fallback: what autoresume loads when no complete checkpoint is left (None: nothing).

    Returns:
        The newest complete checkpoint, or None if there is none (or no such folder).
    """
    from llm.train.run_folder import warn

    folder = Path(save_folder)
    if not folder.is_dir():
        return None
    for entry in folder.iterdir():
        if entry.name.startswith(_TMP_PREFIX):
            entry.unlink()  # half-written by an atomic write that was killed
    newest, moved = None, []
    for _, path in _checkpoints(folder, filename, rank):
        if is_complete_checkpoint(path):
            newest = path
            break
        aside = path.with_name(path.name + INCOMPLETE_SUFFIX)
        os.replace(path, aside)
        moved.append(f"{path.name} -> {aside.name}")
    if moved:
        instead = (f"resuming from the older {newest}" if newest is not None
                   else f"no complete checkpoint is left, so the run starts from {fallback or 'scratch (batch 0)'}")
        warn(f"incomplete or corrupt checkpoint(s) in {folder} (was a run killed while writing?) moved aside: "
             f"{', '.join(moved)}; {instead}")
    latest = folder / latest_filename.format(rank=rank)
    if newest is None:
        return None
    if not (latest.is_symlink() and latest.resolve() == newest.resolve()):
        tmp = latest.with_name(f"{_TMP_PREFIX}{latest.name}.{os.getpid()}")
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(newest.name, tmp)
        os.replace(tmp, latest)  # atomic, unlike Composer's remove-then-symlink
    return newest


def adopt_earlier_checkpoints(trainer: Any, save_folder: str | os.PathLike, filename: str = DEFAULT_FILENAME) -> None:
    """Make Composer's ``save_num_checkpoints_to_keep`` count the checkpoints earlier processes left.

    Composer's ``CheckpointSaver`` rotates only the checkpoints it wrote itself (its
    ``saved_checkpoints``), so after a resume those of the killed or finished run before it would
    stay for good. This puts them, oldest first, at the head of that list (those up to the
    trainer's current time: later ones Composer refuses at ``fit_start`` anyway), so the next save
    prunes the folder to the limit. Call it after the trainer is built (the checkpoint loaded),
    before ``fit``; a no-op without a saver or with ``-1`` (keep all).
    """
    from composer.callbacks import CheckpointSaver
    from composer.utils import dist

    saver = next((c for c in trainer.state.callbacks if isinstance(c, CheckpointSaver)), None)
    if saver is None or saver.num_checkpoints_to_keep < 0:
        return
    now = trainer.state.timestamp
    earlier = [str(path) for time, path in _checkpoints(Path(save_folder), filename, dist.get_global_rank())
               if all(value <= int(getattr(now, unit)) for unit, value in time.items())]
    saver.saved_checkpoints[:0] = [path for path in reversed(earlier) if path not in saver.saved_checkpoints]


def check_checkpoint(path: str | os.PathLike, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Check that a Composer checkpoint file is readable and its weights fit ``model``.

    Args:
        path: a local monolithic checkpoint written by Composer (``{"state": {"model": ...}}``).
        model: the model Composer will load it into (the ``ComposerModel``; key prefixes such as
            ``model.`` must match Composer's ``state.model`` keys).

    Returns:
        The checkpoint's model state dict.

    Raises:
        FileNotFoundError: if there is no such file.
        ValueError: naming the file, if it is not a torch.save file at all, cannot be read
            (truncated or corrupt: e.g. the run was killed while writing it), is not a Composer checkpoint, or has missing, unexpected or
            differently shaped tensors (naming them, with both shapes).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    with path.open("rb") as f:
        magic = f.read(4)
    # torch.save writes a zip archive (legacy: a pickle, protocol 2); an empty file is a truncated one
    if magic and magic != b"PK\x03\x04" and magic[:1] != b"\x80":
        raise ValueError(f"{path} is not a checkpoint: torch.save files are zip archives, and this one starts "
                         f"with {magic!r}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise ValueError(
            f"cannot read checkpoint {path} ({path.stat().st_size:,} bytes): {err}; the file is "
            "truncated or corrupt (was the run killed while writing it?): delete it and load an "
            "earlier checkpoint"
        ) from err
    state = checkpoint.get("state") if isinstance(checkpoint, Mapping) else None
    weights = state.get("model") if isinstance(state, Mapping) else None
    if not isinstance(weights, Mapping):
        raise ValueError(f"{path} is not a Composer checkpoint: it has no state.model weights")
    problems = shape_mismatches(model.state_dict(), weights)
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ValueError(
            f"checkpoint {path} does not fit the model ({len(problems)} problem(s)): "
            + "; ".join(problems[:10]) + more
            + ". Was it written with another model config or tokenizer (vocab_size)?"
        )
    return dict(weights)
