"""Fault tolerance: a run SIGKILLed mid-training resumes from its latest checkpoint to the same weights
as an uninterrupted run; half-written checkpoints and bad load paths fail clearly or are repaired."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from composer.core import Timestamp
from composer.utils.file_helpers import ensure_folder_has_no_conflicting_files
from safetensors.torch import load_file

from llm.train import checkpointing
from llm.train.checkpointing import (
    check_checkpoint,
    install_atomic_checkpoint_writes,
    is_complete_checkpoint,
    repair_latest_checkpoint,
)
from llm.train.composer_model import ComposerMosaicGPT
from llm.config import MosaicGPTConfig
from llm.data import load_tokenizer
from llm.train.trainer import CHECKPOINT_FILENAME, train
from tests.train_helpers import BatchRecorder, extra_callbacks, read_record, tiny_config

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
KILL_AFTER = 5  # checkpoints at batches 2 and 4, so the resumed run redoes batch 5


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """Run A (10 batches, uninterrupted) and run B (the same config, SIGKILLed after batch 5)."""
    return _run_and_kill(tiny_data, tmp_path_factory.mktemp("resume"))


@pytest.fixture(scope="module")
def muon_runs(tiny_data, tmp_path_factory):
    """As ``runs``, trained with optimizer muon."""
    optimizer = {"name": "muon", "lr": 0.02, "adamw_lr": 1.0e-2, "weight_decay": 1.0e-4}
    return _run_and_kill(tiny_data, tmp_path_factory.mktemp("resume-muon"), optimizer=optimizer)


def _run_and_kill(tiny_data, root, **overrides):
    a = tiny_config(tiny_data, root / "a", **overrides)
    with extra_callbacks(BatchRecorder(root / "a.batches")):
        result_a = train(a)
    b = tiny_config(tiny_data, root / "b", autoresume=True, **overrides)
    (root / "b.json").write_text(json.dumps(b))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.train_helpers", str(root / "b.json"), "--kill-after", str(KILL_AFTER),
         "--record", str(root / "b.batches")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    return {"root": root, "a": a, "b": b, "result_a": result_a}


def _weights(run_cfg):
    return load_file(str(Path(run_cfg["save_folder"]) / "model" / "model.safetensors"))


def _resume(cfg, record):
    with extra_callbacks(BatchRecorder(record)):
        return train(cfg)


@pytest.mark.parametrize("which", ["runs", "muon_runs"])
def test_killed_run_resumes_to_the_same_weights_and_data_order(which, request, tmp_path):
    runs = request.getfixturevalue(which)
    b_folder = Path(runs["b"]["save_folder"])
    assert sorted(p.name for p in b_folder.glob("ep*.pt")) == ["ep0-ba2-rank0.pt", "ep0-ba4-rank0.pt"]
    assert os.readlink(b_folder / "latest-rank0.pt") == "ep0-ba4-rank0.pt"
    assert not (b_folder / "model").exists()
    # Resume a copy, so the other tests see the folder as the kill left it.
    b = {**runs["b"], "save_folder": str(tmp_path / "b")}
    shutil.copytree(b_folder, b["save_folder"], symlinks=True)
    shutil.copy(runs["root"] / "b.batches", tmp_path / "b.batches")
    result = _resume(b, tmp_path / "b.batches")
    assert (result["start_batch"], result["batches"]) == (4, 10)

    seen_a, seen_b = read_record(runs["root"] / "a.batches"), read_record(tmp_path / "b.batches")
    assert sorted(seen_a) == sorted(seen_b) == list(range(1, 11))
    assert [seen_b[i][0] for i in range(1, 11)] == [seen_a[i][0] for i in range(1, 11)]  # same batches, same order
    assert [seen_b[i][1] for i in range(1, 11)] == pytest.approx([seen_a[i][1] for i in range(1, 11)], abs=1e-6)

    weights_a, weights_b = _weights(runs["a"]), _weights(b)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_b[name], weights_a[name]), name  # bitwise, on CPU
    assert result["heldout_nats_per_token"] == pytest.approx(runs["result_a"]["heldout_nats_per_token"], abs=1e-6)


def test_half_written_checkpoint_blocks_autoresume_until_repaired(runs, tmp_path):
    """What a kill while Composer writes ep0-ba6 (in place, not atomically) and moves the latest
    symlink (remove, then create) leaves behind; repair_latest_checkpoint makes it resumable."""
    folder = tmp_path / "b"
    shutil.copytree(runs["b"]["save_folder"], folder, symlinks=True)
    good = (folder / "ep0-ba4-rank0.pt").read_bytes()
    (folder / "ep0-ba6-rank0.pt").write_bytes(good[: len(good) // 2])
    (folder / "latest-rank0.pt").unlink()
    (folder / ".partial-ep0-ba8-rank0.pt.x1y2").write_bytes(good[:100])
    assert not is_complete_checkpoint(folder / "ep0-ba6-rank0.pt")
    cfg = {**runs["b"], "save_folder": str(folder)}

    # Stock Composer: with no latest symlink autoresume starts at batch 0, and fit_start's check
    # refuses to go on next to checkpoints of later batches (this names one of them); with the
    # symlink back, the truncated ep0-ba6 alone still blocks a resume from batch 4.
    with pytest.raises(FileExistsError, match=r"ep0-ba[246]-rank0.pt may conflict with a future checkpoint"):
        ensure_folder_has_no_conflicting_files(folder, CHECKPOINT_FILENAME, Timestamp())
    with pytest.raises(FileExistsError, match=r"ep0-ba6-rank0.pt may conflict with a future checkpoint"):
        ensure_folder_has_no_conflicting_files(folder, CHECKPOINT_FILENAME, Timestamp(batch=4, sample=32, token=1024))

    assert repair_latest_checkpoint(folder) == folder / "ep0-ba4-rank0.pt"
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba4-rank0.pt"
    assert (folder / "ep0-ba6-rank0.pt.incomplete").is_file() and not (folder / "ep0-ba6-rank0.pt").exists()
    assert not list(folder.glob(".partial-*"))
    assert repair_latest_checkpoint(folder) == folder / "ep0-ba4-rank0.pt"  # idempotent
    ensure_folder_has_no_conflicting_files(folder, CHECKPOINT_FILENAME, Timestamp(batch=4, sample=32, token=1024))

    result = train(cfg)
    assert (result["start_batch"], result["batches"]) == (4, 10)
    for name, tensor in _weights(runs["a"]).items():
        torch.testing.assert_close(_weights(cfg)[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_atomic_writes_leave_no_partial_checkpoint(tmp_path, monkeypatch):
    """Composer's writer leaves a truncated file under the checkpoint's name when torch.save dies
    half-way; after install_atomic_checkpoint_writes nothing appears under that name."""
    from composer.utils import checkpoint

    class Killed(BaseException):
        pass

    def dying_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as out:
                out.write(b"PK\x03\x04 half a checkpoint")
        else:
            f.write(b"PK\x03\x04 half a checkpoint")
        raise Killed

    # Start from Composer's own writer (train() may have installed ours already); both restored after.
    stock_writer = checkpointing._original_write_checkpoint_file or checkpoint._write_checkpoint_file
    monkeypatch.setattr(checkpointing, "_original_write_checkpoint_file", checkpointing._original_write_checkpoint_file)
    monkeypatch.setattr(checkpoint, "_write_checkpoint_file", stock_writer)
    real_save = torch.save
    monkeypatch.setattr(torch, "save", dying_save)  # the module Composer's writer and ours call
    stock = tmp_path / "stock" / "ep0-ba2-rank0.pt"
    stock.parent.mkdir()
    with pytest.raises(Killed):
        checkpoint._write_checkpoint_file({"state": {}}, str(stock))
    assert stock.is_file() and not is_complete_checkpoint(stock)

    install_atomic_checkpoint_writes()
    install_atomic_checkpoint_writes()  # idempotent
    atomic = tmp_path / "atomic" / "ep0-ba2-rank0.pt"
    atomic.parent.mkdir()
    with pytest.raises(Killed):
        checkpoint._write_checkpoint_file({"state": {}}, str(atomic))
    assert list(atomic.parent.iterdir()) == []

    monkeypatch.setattr(torch, "save", real_save)
    checkpoint._write_checkpoint_file({"state": {"model": {"w": torch.ones(2)}}}, str(atomic))
    assert [p.name for p in atomic.parent.iterdir()] == [atomic.name] and is_complete_checkpoint(atomic)
    assert torch.load(atomic, weights_only=False)["state"]["model"]["w"].tolist() == [1.0, 1.0]


def test_bad_checkpoints_name_the_file_and_what_did_not_fit(runs, tmp_path):
    checkpoint = Path(runs["b"]["save_folder"]) / "ep0-ba4-rank0.pt"
    vocab_size = len(load_tokenizer(Path(runs["b"]["train_loader"]["dataset"]["local"]) / "tokenizer"))
    model_cfg = {**runs["b"]["model"], "vocab_size": vocab_size}
    assert check_checkpoint(checkpoint, ComposerMosaicGPT(MosaicGPTConfig.from_dict(model_cfg)))["model.wte.weight"].shape == (vocab_size, 32)

    truncated = tmp_path / "ep0-ba4-rank0.pt"
    truncated.write_bytes(checkpoint.read_bytes()[:5000])
    with pytest.raises(ValueError, match=rf"cannot read checkpoint {truncated} \(5,000 bytes\).*truncated or corrupt"):
        check_checkpoint(truncated, ComposerMosaicGPT(MosaicGPTConfig.from_dict(model_cfg)))
    picture = tmp_path / "curves.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with pytest.raises(ValueError, match=rf"{picture} is not a checkpoint: torch.save files are zip archives"):
        check_checkpoint(picture, ComposerMosaicGPT(MosaicGPTConfig.from_dict(model_cfg)))

    wider = ComposerMosaicGPT(MosaicGPTConfig.from_dict({**model_cfg, "d_model": 64}))
    with pytest.raises(ValueError, match=rf"checkpoint {checkpoint} does not fit the model .*"
                                         r"model.wte.weight: file has \(\d+, 32\), model needs \(\d+, 64\)"):
        check_checkpoint(checkpoint, wider)
    deeper = ComposerMosaicGPT(MosaicGPTConfig.from_dict({**model_cfg, "n_layers": 3}))
    with pytest.raises(ValueError, match=r"missing model.blocks.2.\S+"):
        check_checkpoint(checkpoint, deeper)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_checkpoint(tmp_path / "nope.pt", deeper)


def test_train_repairs_a_half_written_checkpoint_by_itself(runs, tmp_path, capfd):
    folder = tmp_path / "b"
    shutil.copytree(runs["b"]["save_folder"], folder, symlinks=True)
    good = (folder / "ep0-ba4-rank0.pt").read_bytes()
    (folder / "ep0-ba6-rank0.pt").write_bytes(good[: len(good) // 3])
    (folder / "latest-rank0.pt").unlink()
    result = train({**runs["b"], "save_folder": str(folder)})
    assert (result["start_batch"], result["batches"]) == (4, 10)
    assert (folder / "ep0-ba6-rank0.pt.incomplete").is_file() and is_complete_checkpoint(folder / "ep0-ba6-rank0.pt")
    # The fall-back to an older checkpoint is said on stderr, naming both files.
    assert (f"moved aside: ep0-ba6-rank0.pt -> ep0-ba6-rank0.pt.incomplete; resuming from the older "
            f"{folder / 'ep0-ba4-rank0.pt'}") in capfd.readouterr().err

    # A load_path that does not fit is named, with what did not fit.
    cfg = {**runs["b"], "save_folder": str(tmp_path / "c"), "autoresume": False, "load_path": str(folder / "ep0-ba4-rank0.pt"),
           "model": {**runs["b"]["model"], "n_heads": 4, "d_model": 64}}
    with pytest.raises(ValueError, match=r"checkpoint .*ep0-ba4-rank0.pt does not fit the model .*model.wte.weight"):
        train(cfg)
