"""llm.train.evaluate: a checkpoint, its exported bundle and the training run agree on held-out figures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm.data import load_corpus, tokenize_corpus, train_bpe_tokenizer
from llm.train.evaluate import block_texts, evaluate, format_table, spread_indices
from llm.train.trainer import train
from tests.train_helpers import make_tiny_plays, tiny_config

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    cfg = tiny_config(make_tiny_plays(root / "plays"), root / "run", max_duration="6ba", save_interval="3ba")
    return cfg, train(cfg)


def test_checkpoint_eval_reproduces_the_training_figures(run):
    cfg, result = run
    report = evaluate(cfg, load_path=str(Path(cfg["save_folder"]) / "ep0-ba6-rank0.pt"))
    heldout = report["evaluators"]["validation"]
    assert heldout["sequences"] == heldout["blocks"] > 100
    assert heldout["predicted_tokens"] == heldout["sequences"] * 31
    assert heldout["nats_per_token"] == pytest.approx(result["heldout_nats_per_token"], abs=1e-6)
    assert heldout["perplexity"] == pytest.approx(heldout["composer_perplexity"], rel=1e-5)
    assert heldout["bits_per_byte"] == pytest.approx(result["bits_per_byte"], abs=1e-6)
    assert report["output"] == str(Path(cfg["save_folder"]) / "eval.json")
    assert json.loads(Path(report["output"]).read_text())["evaluators"] == report["evaluators"]
    assert "validation" in format_table(report) and "bits/byte" in format_table(report)

    with pytest.raises(ValueError, match="give exactly one of"):
        evaluate(cfg)
    wider = {**cfg, "model": {**cfg["model"], "d_model": 64}}
    with pytest.raises(ValueError, match=r"checkpoint .*ep0-ba6-rank0.pt does not fit the model"):
        evaluate(wider, load_path=str(Path(cfg["save_folder"]) / "ep0-ba6-rank0.pt"))


def test_bundle_eval_on_a_subset_of_several_splits(run, tmp_path):
    cfg, result = run
    bundle = result["model_dir"]
    full = evaluate(cfg, model=bundle, output=tmp_path / "full.json")["evaluators"]["validation"]
    assert full["nats_per_token"] == pytest.approx(result["heldout_nats_per_token"], abs=1e-6)

    report = evaluate({**cfg, "eval_splits": ["validation", "train"], "eval_max_sequences": 20, "eval_seq_len": 16},
                      model=bundle)
    assert report["output"] == str(Path(bundle) / "eval.json")
    assert list(report["evaluators"]) == ["validation", "train"]
    for figures in report["evaluators"].values():
        assert figures["sequences"] == 20 and figures["predicted_tokens"] == 20 * 15
        assert 1.0 < figures["nats_per_token"] < 4.5
        assert figures["tokens_per_byte"] == pytest.approx(1.0, abs=0.01)  # characters


def test_spread_indices():
    assert spread_indices(10, None) == list(range(10))
    assert spread_indices(10, 50) == list(range(10))
    assert spread_indices(10, 4) == [0, 3, 6, 9]
    assert spread_indices(10, 1) == [0]
    with pytest.raises(ValueError, match="positive"):
        spread_indices(10, 0)


def test_block_texts_cover_the_text_of_their_tokens():
    text = load_corpus("validation")[:60_000]
    tokenizer = train_bpe_tokenizer(text, vocab_size=400)
    tokens = tokenize_corpus(tokenizer, text)
    n_blocks = len(tokens) // 64
    texts = block_texts(tokenizer, text, 64, range(n_blocks))
    joined = "".join(texts)
    assert text.startswith(joined) and len(text) - len(joined) < 64 * 8
    # Each block's text encodes back to (nearly) its tokens: only a cut inside a word can differ.
    same = sum(tokenize_corpus(tokenizer, t).tolist() == tokens[i * 64:(i + 1) * 64].tolist() for i, t in enumerate(texts))
    assert same > 0.5 * n_blocks
    with pytest.raises(IndexError):
        block_texts(tokenizer, text, 64, [n_blocks])


def test_command_line(run, tmp_path):
    cfg, result = run
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))  # JSON is YAML
    out = tmp_path / "cli.json"
    proc = subprocess.run([sys.executable, "scripts/eval.py", str(tmp_path / "cfg.json"), "--model", result["model_dir"],
                           "eval_max_sequences=8", f"eval_output={out}"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validation" in proc.stdout and "bits/byte" in proc.stdout and str(out) in proc.stdout
    assert json.loads(out.read_text())["evaluators"]["validation"]["sequences"] == 8
    proc = subprocess.run([sys.executable, "scripts/eval.py", str(tmp_path / "cfg.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "load_path=CHECKPOINT or --model" in proc.stderr
