"""A run folder holds one run: a running training locks it (and a SIGKILLed one does not leave it locked),
a resume under other settings than its config.yaml is refused before anything is written, falling back
past a corrupt checkpoint is said on stderr, save_num_checkpoints_to_keep holds across restarts, and
metrics.json is saved before sampling can fail."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import llm.train.trainer
from llm.cli.train import main as train_main
from llm.train.callbacks import CONFIG_YAML
from llm.train.checkpointing import repair_latest_checkpoint
from llm.train.run_folder import LOCK_FILE, RunFolderError, config_changes, hold_run_folder
from llm.train.trainer import METRICS_FILE, resolve_config, train
from tests.train_helpers import tiny_config

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]

# A training run that stops at the end of batch 5 (checkpoints of batches 2 and 4 written), still
# holding its folder, until it is killed: argv[1] its config (JSON), argv[2] a file it touches then.
HOLDER = """
import json, sys, time
from pathlib import Path
import torch
from composer.core import Callback
from llm.train import train
from tests.train_helpers import extra_callbacks

class Hold(Callback):
    def batch_end(self, state, logger):
        if int(state.timestamp.batch) == 5:
            Path(sys.argv[2]).touch()
            time.sleep(600)

torch.set_num_threads(1)
with extra_callbacks(Hold()):
    train(json.loads(Path(sys.argv[1]).read_text()))
"""


def _snapshot(folder: Path) -> dict[str, str]:
    """Every entry of ``folder``: a symlink's target, a file's hash, or ``dir``."""
    return {p.name: f"-> {os.readlink(p)}" if p.is_symlink() else
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir" for p in folder.iterdir()}


@pytest.fixture(scope="module")
def interrupted(tiny_data, tmp_path_factory):
    """A run (keep 1 checkpoint, one every 2 batches) holding its folder at batch 5; another train() on
    the folder meanwhile; then the holder SIGKILLed and the run resumed to batch 10."""
    root = tmp_path_factory.mktemp("held")
    cfg = tiny_config(tiny_data, root / "run", autoresume=True, save_num_checkpoints_to_keep=1)
    folder = Path(cfg["save_folder"])
    (root / "run.json").write_text(json.dumps(cfg))
    with open(root / "holder.log", "w") as log:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root / "run.json"), str(root / "at-batch-5")],
                                  cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not (root / "at-batch-5").exists():
            assert holder.poll() is None and time.monotonic() < deadline, (root / "holder.log").read_text()[-3000:]
            time.sleep(0.2)
        held = _snapshot(folder)
        try:
            train(cfg)
            refusal = None
        except RunFolderError as error:
            refusal = error
        after_refusal = _snapshot(folder)
    finally:
        holder.kill()
        holder.wait()
    assert holder.returncode == -9
    killed = _snapshot(folder)
    return {"cfg": cfg, "pid": holder.pid, "refusal": refusal, "held": held, "after_refusal": after_refusal,
            "killed": killed, "resumed": train(cfg)}


def test_a_running_training_holds_its_folder_and_a_killed_one_does_not(interrupted):
    folder = Path(interrupted["cfg"]["save_folder"])
    assert interrupted["refusal"] is not None, "a second training on a held folder was not refused"
    message = str(interrupted["refusal"])
    assert f"save_folder {folder} is in use by another training run (PID {interrupted['pid']} on " in message
    assert interrupted["after_refusal"] == interrupted["held"]  # the refused run touched nothing
    # SIGKILLed, the holder leaves its lock file behind, but the kernel has dropped the lock.
    assert LOCK_FILE in interrupted["killed"]
    assert (interrupted["resumed"]["start_batch"], interrupted["resumed"]["batches"]) == (4, 10)


def test_checkpoints_to_keep_hold_across_restarts(interrupted):
    # The killed process pruned its own checkpoints (ba2 when it wrote ba4); the resumed one prunes ba4 too.
    assert sorted(n for n in interrupted["killed"] if n.endswith(".pt")) == ["ep0-ba4-rank0.pt", "latest-rank0.pt"]
    folder = Path(interrupted["cfg"]["save_folder"])
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["ep0-ba10-rank0.pt", "latest-rank0.pt", CONFIG_YAML, "curves.json", "curves.png", METRICS_FILE, "model"])
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba10-rank0.pt"


def test_the_command_line_refuses_a_held_folder_in_one_line(tiny_data, tmp_path, capsys):
    folder = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_data, folder)))
    with hold_run_folder(folder):
        assert (folder / LOCK_FILE).read_text().split()[0] == str(os.getpid())
        assert train_main([str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"train.py: error: save_folder {folder} is in use by another "
                                                   f"training run (PID {os.getpid()} on ")
    assert not folder.exists()  # created for the lock, and removed with it: nothing was written
    folder.mkdir()
    with hold_run_folder(folder):
        pass
    assert folder.is_dir() and not list(folder.iterdir())


@pytest.fixture(scope="module")
def finished(tiny_data, tmp_path_factory):
    """A finished 4-batch run (checkpoints at batches 2 and 4) and its config."""
    cfg = tiny_config(tiny_data, tmp_path_factory.mktemp("finished") / "run", max_duration="4ba", eval_interval="2ba")
    train(cfg)
    return cfg


def _copy(cfg, tmp_path, **changes):
    """A copy of ``cfg``'s run folder in ``tmp_path``, and the config with ``changes``, pointing at it."""
    folder = tmp_path / "run"
    shutil.copytree(cfg["save_folder"], folder, symlinks=True)
    return folder, {**cfg, "save_folder": str(folder), **changes}


def test_resuming_under_another_config_is_refused_before_anything_is_written(finished, tmp_path):
    folder, cfg = _copy(finished, tmp_path, autoresume=True, max_duration="8ba", seed=6,
                        optimizer={**finished["optimizer"], "lr": 0.02})
    good = (folder / "ep0-ba4-rank0.pt").read_bytes()
    (folder / "ep0-ba6-rank0.pt").write_bytes(good[: len(good) // 2])  # a corrupt newest checkpoint
    before = _snapshot(folder)
    with pytest.raises(RunFolderError) as refused:
        train(cfg)
    message = str(refused.value)
    assert f"the run in {folder} was trained under another config" in message
    # Each difference by its dotted path, derived values included (shuffle_seed follows seed).
    assert ("change 4 setting(s): eval_loader.dataset.shuffle_seed: 5 -> 6; optimizer.lr: 0.01 -> 0.02; seed: 5 -> 6; "
            "train_loader.dataset.shuffle_seed: 5 -> 6.") in message
    assert "max_duration:" not in message and "allow_config_change: true" in message
    assert _snapshot(folder) == before  # the corrupt checkpoint is not even moved aside

    # load_path into a folder that has a config.yaml: the same check.
    cfg = {**finished, "save_folder": str(folder), "load_path": str(folder / "ep0-ba4-rank0.pt"),
           "global_train_batch_size": 16}
    with pytest.raises(RunFolderError, match=r"change 1 setting\(s\): global_train_batch_size: 8 -> 16\."):
        train(cfg)
    assert _snapshot(folder) == before


def test_run_length_and_logging_changes_resume(finished, tmp_path, capfd):
    folder, cfg = _copy(finished, tmp_path, autoresume=True, max_duration="6ba", eval_interval="3ba",
                        save_interval="3ba", num_samples=1, sample_max_new_tokens=4, sample_prompts=["ROMEO:"],
                        run_name="renamed", device_train_microbatch_size=4, console_log_interval="2ba")
    result = train(cfg)
    assert (result["start_batch"], result["batches"]) == (4, 6)
    assert yaml.safe_load((folder / CONFIG_YAML).read_text()) == resolve_config(cfg)
    assert "warning:" not in capfd.readouterr().err


def test_allow_config_change_resumes_and_says_so(finished, tmp_path, capfd):
    folder, cfg = _copy(finished, tmp_path, autoresume=True, max_duration="6ba", allow_config_change=True,
                        optimizer={**finished["optimizer"], "lr": 0.02})
    result = train(cfg)
    assert (result["start_batch"], result["batches"]) == (4, 6)
    err = capfd.readouterr().err
    assert (f"warning: resuming the run in {folder} under a changed config (allow_config_change: true): "
            "optimizer.lr: 0.01 -> 0.02. config.yaml will be rewritten") in err
    saved = yaml.safe_load((folder / CONFIG_YAML).read_text())
    assert saved == resolve_config(cfg) and saved["optimizer"]["lr"] == 0.02


def test_metrics_are_saved_before_sampling(finished, tmp_path, monkeypatch):
    folder, cfg = _copy(finished, tmp_path, autoresume=True, num_samples=1)
    (folder / METRICS_FILE).unlink()

    def broken_sampling(*args, **kwargs):
        raise RuntimeError("sampling broke")

    monkeypatch.setattr(llm.train.trainer, "generate_samples", broken_sampling)
    with pytest.raises(RuntimeError, match="sampling broke"):
        train(cfg)
    metrics = json.loads((folder / METRICS_FILE).read_text())
    assert metrics["batches"] == 4 and metrics["heldout_nats_per_token"] > 0
    assert not (folder / LOCK_FILE).exists()  # released on the way out


def test_config_changes_name_dotted_paths():
    old = {"optimizer": {"lr": 0.01, "betas": [0.9, 0.95]}, "model": {"d_model": 32}, "max_duration": "4ba",
           "tokenizer": None}
    new = {"optimizer": {"lr": 0.01, "betas": [0.9, 0.99]}, "model": {"d_model": 32, "vocab_size": 80},
           "max_duration": "8ba", "tokenizer": {"name": "gpt2"}}
    assert config_changes(old, new) == [
        "model.vocab_size: (absent) -> 80",
        "optimizer.betas: [0.9, 0.95] -> [0.9, 0.99]",
        "tokenizer: None -> (absent)",
        "tokenizer.name: (absent) -> 'gpt2'",
    ]
    assert config_changes(old, old) == []
    # compiling or not is a speed setting: a run trained eager resumes under the compiled default
    compiled = {**old, "compile_config": {"backend": "inductor", "mode": None, "fullgraph": False, "dynamic": None}}
    assert config_changes({**old, "compile_config": None}, compiled) == []
    assert config_changes(compiled, old) == []


def _checkpoints(folder: Path, batches, corrupt=()):
    folder.mkdir()
    for batch in batches:
        path = folder / f"ep0-ba{batch}-rank0.pt"
        torch.save({"state": {"model": {"w": torch.full((64,), float(batch))}}}, path)
        if batch in corrupt:
            path.write_bytes(path.read_bytes()[:100])


def test_falling_back_past_a_corrupt_checkpoint_is_said(tmp_path, capsys):
    folder = tmp_path / "some"
    _checkpoints(folder, [2, 4, 6], corrupt=[6])
    assert repair_latest_checkpoint(folder) == folder / "ep0-ba4-rank0.pt"
    err = capsys.readouterr().err
    assert err.startswith(f"warning: incomplete or corrupt checkpoint(s) in {folder}")
    assert f"moved aside: ep0-ba6-rank0.pt -> ep0-ba6-rank0.pt.incomplete; resuming from the older " \
           f"{folder / 'ep0-ba4-rank0.pt'}\n" in err
    assert repair_latest_checkpoint(folder) == folder / "ep0-ba4-rank0.pt"
    assert capsys.readouterr().err == ""  # nothing new to say

    folder = tmp_path / "none"
    _checkpoints(folder, [2, 4], corrupt=[2, 4])
    assert repair_latest_checkpoint(folder) is None
    err = capsys.readouterr().err
    assert ("moved aside: ep0-ba4-rank0.pt -> ep0-ba4-rank0.pt.incomplete, ep0-ba2-rank0.pt -> "
            "ep0-ba2-rank0.pt.incomplete; no complete checkpoint is left, so the run starts from scratch") in err
    _checkpoints(tmp_path / "fallback", [2], corrupt=[2])
    repair_latest_checkpoint(tmp_path / "fallback", fallback="start.pt")
    assert "the run starts from start.pt" in capsys.readouterr().err


def test_a_diverging_run_stops_at_its_first_non_finite_loss_and_saves_nothing_nan(tiny_data, tmp_path, capsys):
    # optimizer.lr = 1e30 makes the loss NaN or infinite within a few batches: one line naming the
    # batch and the newest checkpoint, exit 1, and every checkpoint it left is finite
    folder = tmp_path / "run"
    config = tmp_path / "run.yaml"
    cfg = tiny_config(tiny_data, folder, save_interval="1ba", algorithms={})
    cfg["optimizer"]["lr"] = 1.0e30
    config.write_text(yaml.safe_dump(cfg))
    assert train_main([str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("train.py: error: the training loss is not finite (") and "at batch " in err
    assert "the newest checkpoint is" in err or "no checkpoint was saved yet" in err
    assert not (folder / "model").exists() and not (folder / METRICS_FILE).exists()
    checkpoints = list(folder.glob("ep*-ba*-rank0.pt"))
    assert checkpoints  # the batches before it diverged were saved
    for checkpoint in checkpoints:
        weights = torch.load(checkpoint, weights_only=False)["state"]["model"]
        assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point()), checkpoint


@pytest.mark.parametrize("over, message", [
    ({"precision": "amp_fp16"}, "precision: amp_fp16 needs a GPU (PyTorch has no float16 autocast for CPU training)"),
    ({"load_path": "nowhere/ep1-ba9-rank0.pt"}, "load_path: no checkpoint file nowhere/ep1-ba9-rank0.pt (give a"),
])
def test_a_cpu_fp16_run_or_a_missing_checkpoint_is_one_line(tiny_data, tmp_path, capsys, over, message):
    if over.get("precision") == "amp_fp16" and torch.cuda.is_available():
        pytest.skip("amp_fp16 runs on a GPU")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_data, tmp_path / "run", **over)))
    assert train_main([str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train.py: error: ") and message in err, err
