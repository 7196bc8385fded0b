"""llm.train.evaluate: a checkpoint, its exported bundle and the training run agree on held-out figures;
one evaluator per eval stream; results go where the user says, after the table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm.data.streaming import PreparedDataError
from llm.train.builders import spread_indices
from llm.train.evaluate import evaluate, format_table
from llm.train.trainer import train
from llm.utils.config import ConfigError
from tests.train_helpers import make_tiny_data, tiny_config

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    cfg = tiny_config(tiny_data, root / "run", max_duration="6ba", save_interval="3ba")
    return cfg, train(cfg)


def test_checkpoint_eval_reproduces_the_training_figures(run, tiny_data):
    cfg, result = run
    report = evaluate(cfg, load_path=str(Path(cfg["save_folder"]) / "ep0-ba6-rank0.pt"))
    heldout = report["evaluators"]["validation"]
    rows = json.loads((tiny_data / "llm_data.json").read_text())["splits"]["validation"]["rows"]
    assert heldout["sequences"] == heldout["available"] == rows * 2  # two 32-token sequences per 64-token row
    assert heldout["predicted_tokens"] == heldout["sequences"] * 31
    assert heldout["nats_per_token"] == pytest.approx(result["heldout_nats_per_token"], abs=1e-6)
    assert heldout["bits_per_byte"] == pytest.approx(result["bits_per_byte"], abs=1e-6)
    assert "validation" in format_table(report) and "bits/byte" in format_table(report)

    with pytest.raises(ValueError, match="give exactly one of"):
        evaluate({**cfg, "load_path": None})
    wider = {**cfg, "model": {**cfg["model"], "d_model": 64}}
    with pytest.raises(ValueError, match=r"checkpoint .*ep0-ba6-rank0.pt does not fit the model"):
        evaluate(wider, load_path=str(Path(cfg["save_folder"]) / "ep0-ba6-rank0.pt"))
    with pytest.raises(ConfigError, match=r"^eval_max_sequencs: unknown key"):
        evaluate({**cfg, "eval_max_sequencs": 8}, load_path=str(Path(cfg["save_folder"]) / "ep0-ba6-rank0.pt"))


def test_quantized_eval_of_a_bundle_and_of_its_checkpoint_agree(run):
    cfg, result = run
    checkpoint = str(Path(cfg["save_folder"]) / "ep0-ba6-rank0.pt")
    fp32 = evaluate(cfg, model=result["model_dir"])
    bundle = evaluate(cfg, model=result["model_dir"], quantization="int8")
    ckpt = evaluate(cfg, load_path=checkpoint, quantization="int8")
    assert bundle["quantization"] == ckpt["quantization"] == "int8" and fp32["quantization"] is None
    quantized, exact = bundle["evaluators"]["validation"], fp32["evaluators"]["validation"]
    # the same weights quantized the same way, whichever way they were loaded
    assert ckpt["evaluators"]["validation"]["nats_per_token"] == pytest.approx(quantized["nats_per_token"], abs=1e-6)
    assert quantized["nats_per_token"] != exact["nats_per_token"]
    assert quantized["nats_per_token"] == pytest.approx(exact["nats_per_token"], rel=0.02)
    with pytest.raises(ValueError, match="--quantize gguf keeps a GGUF file's own quantization"):
        evaluate(cfg, load_path=checkpoint, quantization="gguf")


def test_bundle_eval_on_a_spread_subset_of_each_stream(run, tiny_data):
    cfg, result = run
    bundle = result["model_dir"]
    full = evaluate(cfg, model=bundle)["evaluators"]["validation"]
    assert full["nats_per_token"] == pytest.approx(result["heldout_nats_per_token"], abs=1e-6)

    streams = {"held_out": {"local": str(tiny_data), "split": "validation"},
               "seen": {"local": str(tiny_data), "split": "train"}}
    report = evaluate({**cfg, "eval_loader": {"name": "text", "dataset": {"streams": streams}},
                       "eval_max_sequences": 20, "eval_seq_len": 16}, model=bundle)
    assert list(report["evaluators"]) == ["held_out", "seen"]
    manifest = json.loads((tiny_data / "llm_data.json").read_text())["splits"]
    for label, split in (("held_out", "validation"), ("seen", "train")):
        figures = report["evaluators"][label]
        assert figures["sequences"] == 20 and figures["predicted_tokens"] == 20 * 15
        assert figures["available"] == manifest[split]["rows"] * 4
        assert figures["tokens_per_byte"] == manifest[split]["tokens"] / manifest[split]["bytes"]
        assert 1.0 < figures["nats_per_token"] < 4.5
    assert report["evaluators"]["seen"]["nats_per_token"] < report["evaluators"]["held_out"]["nats_per_token"] + 0.3


def test_a_model_whose_tokenizer_is_not_the_datas_is_refused(run, tmp_path_factory):
    cfg, result = run
    bpe = make_tiny_data(tmp_path_factory.mktemp("bpe"), tokenizer="bpe:300")
    with pytest.raises(PreparedDataError, match=r"the tokenizer of .*model.* is not the tokenizer .* prepared with"):
        evaluate({**cfg, "eval_loader": {"name": "text", "dataset": {"local": str(bpe)}}}, model=result["model_dir"])


def test_spread_indices():
    assert spread_indices(10, None) == list(range(10))
    assert spread_indices(10, 50) == list(range(10))
    assert spread_indices(10, 4) == [0, 3, 6, 9]
    assert spread_indices(10, 1) == [0]


def _eval(*args, cwd=REPO):
    return subprocess.run([sys.executable, str(REPO / "scripts/eval.py"), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_command_line(run, tmp_path, capsys, monkeypatch):
    cfg, result = run
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(cfg))  # JSON is YAML
    bundle_files = sorted(p.name for p in Path(result["model_dir"]).iterdir())
    out = tmp_path / "results" / "cli.json"
    # The script itself once, as a process; the other cases call its main() (the same code path).
    proc = _eval(config, "--model", result["model_dir"], "eval_max_sequences=8", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validation" in proc.stdout and "bits/byte" in proc.stdout and str(out) in proc.stdout
    assert json.loads(out.read_text())["evaluators"]["validation"]["sequences"] == 8

    from llm.cli.eval import main

    def _main(*args):
        code = main(list(map(str, args)))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    # Without --out, results go to the current folder, never into the model bundle.
    monkeypatch.chdir(tmp_path)
    code, _, err = _main(config, "--model", result["model_dir"], "eval_max_sequences=4")
    assert code == 0, err[-3000:]
    assert json.loads((tmp_path / "eval-model.json").read_text())["evaluators"]["validation"]["sequences"] == 4
    assert sorted(p.name for p in Path(result["model_dir"]).iterdir()) == bundle_files

    # A write error is one line after the table, which is printed first.
    blocked = tmp_path / "file"
    blocked.write_text("")
    code, stdout, err = _main(config, "--model", result["model_dir"], "eval_max_sequences=4", "--out", blocked / "x.json")
    assert code == 1 and "bits/byte" in stdout
    assert err.strip().splitlines()[-1].startswith("eval.py: error: cannot write the results to")

    for args, match in [((), "load_path=CHECKPOINT or --model"),
                        (("--model", result["model_dir"], "eval_max_sequencs=8"), "eval_max_sequencs: unknown key"),
                        (("--model", result["model_dir"], "eval_max_sequences=0"), "eval_max_sequences"),
                        (("--model", tmp_path / "missing"), "missing")]:
        code, _, err = _main(config, *args)
        assert code == 2 and match in err, (args, err[-2000:])
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    code, _, err = _main(tmp_path / "nope.yaml", "--model", result["model_dir"])
    assert code == 2 and "no config file" in err
