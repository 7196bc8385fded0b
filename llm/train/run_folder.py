"""A run folder (``save_folder``) holds one run: a lock while it trains, and a config that describes its weights.

* :func:`hold_run_folder`: while :func:`llm.train.train` runs (from when its config and data are
  checked), global rank 0 holds an exclusive ``fcntl.flock`` on ``<save_folder>/.train.lock``
  (which records its PID and host, and is removed when the run ends). A second training started
  on the folder meanwhile is refused, naming the folder and that PID. The kernel drops the lock
  when its process dies, so a run killed with SIGKILL leaves nothing stuck. Only rank 0 takes it,
  so the ranks of one ``composer -n N`` run never refuse each other; its verdict is broadcast, so
  every rank stops together.
* :func:`check_resume_config`: resuming into a folder whose ``config.yaml`` (the resolved config
  the weights beside it were trained under) differs from the new resolved config in anything
  but :data:`MAY_CHANGE_ON_RESUME` is refused, listing each difference as ``dotted.key: old ->
  new``, before anything in the folder is touched; ``allow_config_change: true`` lets the run go
  on, and says loudly that ``config.yaml`` is rewritten.

Warnings that something is not as the user may assume (a changed config, a checkpoint moved
aside) go to stderr, on a line starting ``warning:``, through :func:`warn`.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

import yaml
from composer.utils import dist

LOCK_FILE = ".train.lock"

#: Top-level keys a resumed run may change. Weights trained so far do not depend on them:
#: the run's length (``max_duration``: extending a run is what resuming is for, though a schedule
#: over ``1dur`` then stretches from the resume on), what is evaluated, logged, saved or printed
#: along the way, its label, how a batch is split to fit in memory (microbatches give the full
#: batch's update), whether the step is compiled (the same update through other kernels: a run
#: trained eager resumes under the compiled default), and where and how the run resumes (a copied
#: folder has a new ``save_folder``).
MAY_CHANGE_ON_RESUME = frozenset({
    "max_duration",
    "eval_interval", "eval_subset_num_batches", "device_eval_batch_size",
    "save_interval", "save_num_checkpoints_to_keep",
    "progress_bar", "log_to_console", "console_log_interval",
    "num_samples", "sample_prompts", "sample_max_new_tokens", "sample_temperature", "sample_top_k",
    "run_name",
    "device_train_microbatch_size", "compile_config",
    "save_folder", "load_path", "autoresume", "allow_config_change",
})

_ABSENT = "(absent)"


class RunFolderError(RuntimeError):
    """A run folder that cannot be used as asked: held by another run, or holding another config."""


def warn(message: str) -> None:
    """Print ``warning: <message>`` to stderr, at once (for what must not go unnoticed)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


T = TypeVar("T")


def on_rank_zero(work: Callable[[], T]) -> T | None:
    """Run ``work`` on global rank 0 only; call on every rank, which all wait for it.

    Returns:
        ``work()``'s result on rank 0, None on the others.

    Raises:
        RunFolderError: on every rank, if ``work`` raises one on rank 0.
    """
    result, problem = None, None
    if dist.get_global_rank() == 0:
        try:
            result = work()
        except RunFolderError as error:
            problem = str(error)
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RunFolderError(box[0])
    return result


def _same_file(path: Path, fd: int) -> bool:
    try:
        found, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def _lock(folder: Path) -> tuple[int, bool]:
    """Lock ``folder`` (creating it); returns the lock file's descriptor and whether the folder is new."""
    path, created = folder / LOCK_FILE, False
    while True:
        try:
            folder.mkdir(parents=True)
            created = True
        except FileExistsError:
            pass
        # No O_TRUNC: the holder's PID stays readable until we hold the lock ourselves.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").split()
            os.close(fd)
            who = (f"PID {holder[0]} on {holder[1]}" if len(holder) >= 2
                   else "a process that has not written its PID yet")
            raise RunFolderError(
                f"save_folder {folder} is in use by another training run ({who} holds {path}); wait for it "
                "to finish or stop it, or give this run another save_folder"
            ) from None
        if _same_file(path, fd):
            break
        os.close(fd)  # its holder removed that file as we opened it: lock the one there now
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return fd, created


def _unlock(folder: Path, fd: int, created: bool) -> None:
    # Removed while still held, so a process that opened it meanwhile sees it is gone (_same_file).
    (folder / LOCK_FILE).unlink(missing_ok=True)
    os.close(fd)
    if created:
        try:
            folder.rmdir()  # a run refused before writing anything leaves no folder behind
        except OSError:
            pass  # not empty: the run wrote in it


@contextmanager
def hold_run_folder(save_folder: str | os.PathLike) -> Iterator[None]:
    """Hold ``save_folder``'s lock within the block (global rank 0 takes it; call on every rank).

    Creates the folder, and removes it again if the block leaves it empty (e.g. the run was
    refused before writing anything). A run killed with SIGKILL leaves the lock file, unlocked.
    Needs ``composer.utils.dist`` initialized when there are several ranks.

    Raises:
        RunFolderError: on every rank, if another process holds the lock (naming the folder and
            the holder's PID and host).
    """
    folder = Path(save_folder)
    held = on_rank_zero(lambda: _lock(folder))
    try:
        yield
    finally:
        if held is not None:
            _unlock(folder, *held)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping) and value:
        flat = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any],
                   may_change: frozenset[str] = MAY_CHANGE_ON_RESUME) -> list[str]:
    """Where two resolved configs differ, outside the top-level keys ``may_change``.

    Returns:
        ``"dotted.key: old -> new"`` lines (values as ``repr``; ``(absent)`` for a key one side
        lacks), sorted by key.
    """
    flat_old, flat_new = _flatten(old), _flatten(new)
    changes = []
    for key in sorted(flat_old.keys() | flat_new.keys()):
        if key.split(".", 1)[0] in may_change:
            continue
        before, after = flat_old.get(key, _ABSENT), flat_new.get(key, _ABSENT)
        if before != after:
            changes.append(f"{key}: {before if before is _ABSENT else repr(before)} -> "
                           f"{after if after is _ABSENT else repr(after)}")
    return changes


def _saved_config(path: Path) -> dict[str, Any]:
    """``config.yaml`` resolved again, so defaults added to the schema since it was written compare equal."""
    from llm.train.config import load_train_config
    from llm.utils.config import ConfigError

    try:
        return load_train_config(yaml.safe_load(path.read_text())).to_dict()
    except (OSError, yaml.YAMLError, ConfigError) as error:
        raise RunFolderError(
            f"cannot read {path}, the config of the weights in its folder ({' '.join(str(error).split())}); "
            "fix or remove it, or set allow_config_change: true to resume under this run's config"
        ) from error


def check_resume_config(cfg: Mapping[str, Any], config_yaml: str | os.PathLike) -> None:
    """Refuse to resume under a config that differs from ``config_yaml``, the saved one (if any).

    Args:
        cfg: the new run's resolved config (:func:`llm.train.trainer.resolve_config`).
        config_yaml: the run folder's ``config.yaml``; nothing is checked if it does not exist.

    Raises:
        RunFolderError: listing every difference outside :data:`MAY_CHANGE_ON_RESUME`, unless
            ``cfg["allow_config_change"]``: then the differences are printed as a warning.
    """
    path = Path(config_yaml)
    if not path.is_file():
        return
    if cfg["allow_config_change"]:
        try:
            changes = config_changes(_saved_config(path), cfg)
        except RunFolderError as error:
            changes = [str(error)]
        if changes:
            warn(f"resuming the run in {path.parent} under a changed config (allow_config_change: true): "
                 + "; ".join(changes) + f". {path.name} will be rewritten with the new values once training "
                 "continues, though the weights so far were trained under the old ones")
        return
    changes = config_changes(_saved_config(path), cfg)
    if changes:
        raise RunFolderError(
            f"the run in {path.parent} was trained under another config ({path.name}); resuming it would "
            f"change {len(changes)} setting(s): " + "; ".join(changes) + ". Use the saved settings, another "
            "save_folder, or set allow_config_change: true to resume under the new ones (config.yaml is "
            "then rewritten). Only these may change on a resume: " + ", ".join(sorted(MAY_CHANGE_ON_RESUME))
        )
