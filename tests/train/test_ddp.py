"""Data-parallel training on CPU: ``composer -n 2`` (gloo) gives each rank its own half of every batch
(Streaming partitions the samples: disjoint between ranks, together the one-process batch), and the
loss curve and weights match one process with the same global batch size.

Both runs go through :func:`llm.train.train`; its held-out figures and exports are compared too.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import llm.train
from tests.train_helpers import BatchRecorder, extra_callbacks, read_record, tiny_config

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
COMPOSER = Path(sys.executable).with_name("composer")


@pytest.mark.skipif(not COMPOSER.is_file(), reason="needs Composer's launcher next to the Python interpreter")
@pytest.mark.parametrize("optimizer", [None, {"name": "muon", "lr": 0.02, "adamw_lr": 1.0e-2}])
def test_two_processes_match_one(optimizer, tiny_data, tmp_path):
    # muon: every rank orthogonalizes the same all-reduced gradients, so the ranks' weights agree
    single = tiny_config(tiny_data, tmp_path / "single", global_train_batch_size=16, max_duration="6ba",
                         eval_interval="3ba", save_interval="6ba", **({"optimizer": optimizer} if optimizer else {}))
    ddp = {**single, "save_folder": str(tmp_path / "ddp")}
    (tmp_path / "ddp.json").write_text(json.dumps(ddp))
    args = [str(COMPOSER), "-n", "2", "--stderr", str(tmp_path / "rank{rank}.stderr"), "-m", "tests.train_helpers",
            str(tmp_path / "ddp.json"), "--record", str(tmp_path / "ddp{rank}.batches")]
    with extra_callbacks(BatchRecorder(tmp_path / "single.batches")):
        result = llm.train.train(single)
    single_weights = load_file(str(Path(result["model_dir"]) / "model.safetensors"))
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    one, rank0, rank1 = (read_record(tmp_path / name) for name in ("single.batches", "ddp0.batches", "ddp1.batches"))
    assert sorted(one) == sorted(rank0) == sorted(rank1) == [1, 2, 3, 4, 5, 6]
    for batch in one:
        _, loss, rows = one[batch]
        assert len(rows) == 16 and len(rank0[batch][2]) == len(rank1[batch][2]) == 8
        assert not rank0[batch][2] & rank1[batch][2]  # each rank its own shard...
        assert rank0[batch][2] | rank1[batch][2] == rows  # ...together the one-process batch
        assert rank0[batch][1] == rank1[batch][1] == pytest.approx(loss, abs=1e-5)  # the all-reduced loss
    ddp_weights = load_file(str(tmp_path / "ddp" / "model" / "model.safetensors"))
    metrics = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert (metrics["batches"], metrics["tokens"]) == (result["batches"], result["tokens"])
    assert metrics["heldout_nats_per_token"] == pytest.approx(result["heldout_nats_per_token"], abs=1e-5)
    assert ddp_weights.keys() == single_weights.keys()
    # Adam's first steps are about lr * sign(g): float32 reduction-order differences of near-zero
    # gradients move a few weights by ~1e-6 (3.8e-6 at most here).
    for name, weight in single_weights.items():
        torch.testing.assert_close(ddp_weights[name], weight, atol=1e-5, rtol=0, msg=name)
