"""llm.train.evaluate on the registered pretrained SmolLM2 model, on held-out plays prepared with its own tokenizer."""

import pytest
import torch

from llm.data import markdown_to_text, play_paths
from llm.data.prepare import prepare
from llm.train.evaluate import evaluate
from llm.utils.pretrained import pretrained_path

torch.set_num_threads(1)
NAME = "smollm2-135m-instruct"


@pytest.mark.skipif(not pretrained_path(NAME).is_file(), reason="run `llm fetch smollm2-135m-instruct` for the SmolLM2 file")
def test_smollm2_on_held_out_shakespeare(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "hamlet.txt").write_text(markdown_to_text(play_paths()["hamlet"].read_text())[:20_000])
    prepare([tmp_path / "text"], tmp_path / "data", NAME, seq_len=128, validation_fraction=0, workers=1, progress=False)
    cfg = {"eval_loader": {"name": "text", "dataset": {"local": str(tmp_path / "data"), "split": "train"}},
           "device_eval_batch_size": 2, "eval_max_sequences": 2, "eval_seq_len": 128}
    report = evaluate(cfg, model=NAME)
    figures = report["evaluators"]["train"]
    assert report["vocab_size"] == 49152 and report["seq_len"] == 128
    assert figures["sequences"] == 2 and figures["predicted_tokens"] == 2 * 127
    # About 3.2 characters per token; far better than our small models' 2 to 2.5 bits per byte.
    assert 0.25 < figures["tokens_per_byte"] < 0.4
    assert 0.8 < figures["bits_per_byte"] < 2.2
