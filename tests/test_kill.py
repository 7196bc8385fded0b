"""kill -9 in the middle of data preparation and of exports, then the same command again: the rerun
completes, and what it leaves is byte for byte what an uninterrupted run writes (training's kills
are in tests/train/test_resume.py). A killed run publishes nothing half-written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llm.data import markdown_to_text, play_paths
from llm.data.tokenizer import train_tokenizer
from tests.conftest import tiny_model

REPO = Path(__file__).resolve().parents[1]


def _run(args, kill: tuple[str, int] | None = None) -> subprocess.CompletedProcess:
    """``llm ARGS`` in a child, SIGKILLed at the Nth call of ``kill``'s function (tests/kill_helpers.py)."""
    command = [sys.executable, "-m", "tests.kill_helpers", *map(str, kill or ("os:getpid", 0)), *map(str, args)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def _untimed(value):
    """A JSON value without its ``seconds`` (a run's timings)."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k != "seconds"}
    return [_untimed(v) for v in value] if isinstance(value, list) else value


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path; preparation's JSON files without their timings."""
    found = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name in ("llm_data.json", "llm_split.json"):
            data = json.dumps(_untimed(json.loads(data)), sort_keys=True).encode()
        found[str(path.relative_to(root))] = data
    return found


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill-corpus")
    for name in ("hamlet", "macbeth"):
        (root / f"{name}.txt").write_text(markdown_to_text(play_paths()[name].read_text(encoding="utf-8")))
    return root


@pytest.fixture(scope="module")
def prepared_once(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("kill-clean") / "data"
    done = _run(_prepare_args(corpus, out))
    assert done.returncode == 0, done.stderr
    return _files(out)


def _prepare_args(corpus, out):
    return ["prepare", corpus, "--out", out, "--tokenizer", "char", "--seq-len", 128, "--validation-fraction", 0.2,
            "--split-documents", "blank-line", "--shard-size", 65536, "--quiet"]


@pytest.mark.parametrize("kill", [
    ("llm.data.prepare:_ShardWriter._flush", 3),  # the train split half written
    ("llm.data.prepare:_write_json", 3),  # every split written, the manifest not
])
def test_a_preparation_killed_then_run_again_writes_what_one_run_writes(corpus, prepared_once, tmp_path, kill):
    out = tmp_path / "data"
    killed = _run(_prepare_args(corpus, out), kill)
    assert killed.returncode == -9, killed.stderr
    assert not (out / "llm_data.json").exists()  # nothing says it is complete
    again = _run(_prepare_args(corpus, out))
    assert again.returncode == 0, again.stderr
    assert _files(out) == prepared_once


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill-bundle")
    tokenizer = train_tokenizer("bpe:300", ["a few words to learn a few merges from " * 20])  # GGUF takes byte-level BPE
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(root / "model", tokenizer=tokenizer)
    return root / "model"


@pytest.fixture(scope="module")
def exported_once(bundle, tmp_path_factory):
    root = tmp_path_factory.mktemp("kill-exports")
    for to, name in (("gguf", "model.gguf"), ("transformers", "hf")):
        done = _run(["export", "--model", bundle, "--to", to, "--out", root / name])
        assert done.returncode == 0, done.stderr
    return root


@pytest.mark.parametrize("to, name, kill", [
    ("gguf", "model.gguf", ("gguf:GGUFWriter.write_tensors_to_file", 1)),  # the header written, no tensor
    ("transformers", "hf", ("os:replace", 1)),  # every file written, the folder not yet in place
])
def test_an_export_killed_then_run_again_writes_what_one_run_writes(bundle, exported_once, tmp_path, to, name, kill):
    out = tmp_path / name
    killed = _run(["export", "--model", bundle, "--to", to, "--out", out], kill)
    assert killed.returncode == -9, killed.stderr
    assert not out.exists()  # nothing half-written where the export goes
    assert [p.name.startswith(f".{name}.") for p in tmp_path.iterdir()] == [True]  # the killed write's
    again = _run(["export", "--model", bundle, "--to", to, "--out", out])
    assert again.returncode == 0, again.stderr
    assert [p.name for p in tmp_path.iterdir()] == [name]  # the rerun removed what the killed one left
    if to == "gguf":
        assert out.read_bytes() == (exported_once / name).read_bytes()
    else:
        assert _files(out) == _files(exported_once / name)
