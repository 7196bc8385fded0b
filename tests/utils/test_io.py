"""llm.io's atomic writes: a write killed half-way leaves a hidden sibling that the next write removes,
while a live writer's sibling and everything else beside the file are kept."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm.io import atomic_write, fresh_sibling, remove_stale_siblings


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_a_killed_writers_leftovers_go_and_nothing_else(tmp_path):
    target = tmp_path / "model.gguf"
    dead = _dead_pid()
    stale_file = tmp_path / f".model.gguf.{dead}-0123abcd.tmp"
    stale_folder = tmp_path / f".model.gguf.{dead}-89abcdef.old"
    live = fresh_sibling(target, "tmp")  # this process's: a writer still at work
    others = [tmp_path / ".model.gguf.notes", tmp_path / f".other.gguf.{dead}-0123abcd.tmp",
              tmp_path / f"model.gguf.{dead}-0123abcd.tmp"]
    for path in (stale_file, live, *others):
        path.write_text("x")
    stale_folder.mkdir()
    (stale_folder / "config.json").write_text("{}")
    atomic_write(target, lambda tmp: Path(tmp).write_text("new"))
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (target, live, *others))
    remove_stale_siblings(target)  # idempotent
    assert live.exists()


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_sibling(tmp_path):
    target = tmp_path / "metrics.json"
    target.write_text("old")

    def failing(tmp):
        Path(tmp).write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, failing)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["metrics.json"]
