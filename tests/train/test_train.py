"""llm.train end to end on prepared tiny Shakespeare with a tiny char-level model: fit, checkpoint, resume,
export, and the data checks that refuse a run before anything is written."""

import json
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from llm import MosaicGPT
from llm.data import load_tokenizer
from llm.data.streaming import PreparedDataError
from llm.train.builders import run_data
from llm.train.trainer import build_trainer, resolve_config, train
from llm.utils.config import ConfigError
from tests.train_helpers import make_tiny_data, tiny_config


@pytest.fixture
def tiny_cfg(tiny_data, tmp_path):
    """train_helpers' tiny config, in two microbatches, with samples."""
    cfg = tiny_config(tiny_data, tmp_path / "run", max_duration="6ba", eval_interval="3ba", save_interval="3ba",
                      global_train_batch_size=16, device_train_microbatch_size=8, device_eval_batch_size=256, seed=3,
                      num_samples=2, sample_max_new_tokens=12, sample_prompts=["ROMEO:"])
    cfg["optimizer"]["weight_decay"] = 0.0
    return OmegaConf.create(cfg)


def test_fit_lowers_the_training_loss(tiny_cfg):
    cfg = resolve_config(tiny_cfg)
    trainer, _ = build_trainer(cfg, run_data(cfg))
    model = trainer.state.model
    batch = next(iter(trainer.state.train_dataloader))
    assert batch["input_ids"].shape == (16, 32)
    with torch.no_grad():
        before = model.loss(model(batch), batch).item()
    trainer.fit()
    with torch.no_grad():
        after = model.loss(model(batch), batch).item()
    assert after < before - 0.4, (before, after)
    assert (Path(cfg["save_folder"]) / "ep0-ba6-rank0.pt").is_file()
    trainer.close()


def test_train_checkpoints_resumes_and_exports(tiny_cfg, tiny_data, capfd):
    save_folder = Path(tiny_cfg.save_folder)
    first = train(tiny_cfg)
    assert (first["start_batch"], first["batches"]) == (0, 6)
    # the run sized against its data before the first batch: 16 rows of 32 tokens a batch
    train_rows = json.loads((tiny_data / "llm_data.json").read_text())["splits"]["train"]["rows"]
    per_epoch = train_rows * 2 // 16  # two 32-token sequences a prepared row, drop_last
    assert (f"run plan: 6 batches of 512 tokens (3,072 tokens), an epoch is {per_epoch} batches "
            f"({per_epoch * 512:,} tokens): {6 / per_epoch:.2f} epochs\n") in capfd.readouterr().err
    checkpoint = save_folder / "ep0-ba6-rank0.pt"
    assert checkpoint.is_file() and (save_folder / "ep0-ba3-rank0.pt").is_file()
    assert first["checkpoint"] == os.path.realpath(checkpoint)
    assert json.loads((save_folder / "metrics.json").read_text()) == {
        k: v for k, v in first.items() if k not in ("samples", "model_dir", "checkpoint")
    }
    # A char model after 6 batches is better than uniform but far from trained.
    assert 1.0 < first["heldout_nats_per_token"] < torch.log(torch.tensor(first["vocab_size"])).item()
    manifest = json.loads((tiny_data / "llm_data.json").read_text())["splits"]["validation"]
    assert first["tokens_per_byte"] == manifest["tokens"] / manifest["bytes"]
    assert first["heldout"]["validation"]["predicted_tokens"] == manifest["rows"] * 2 * 31  # 2 sequences a row
    assert len(first["samples"]) == 2 and all(s.startswith("ROMEO:") for s in first["samples"])

    # The exported bundle loads on its own and generates, with the data's tokenizer.
    model = MosaicGPT.from_pretrained(first["model_dir"])
    tokenizer = load_tokenizer(first["model_dir"])
    assert tokenizer.backend_tokenizer.to_str() == load_tokenizer(tiny_data / "tokenizer").backend_tokenizer.to_str()
    ids = torch.tensor([tokenizer.encode("JULIET:")])
    out = model.generate(ids, max_new_tokens=10, do_sample=True, top_k=5, seed=0)
    assert out.shape == (1, ids.shape[1] + 10)
    assert tokenizer.decode(out[0]).startswith("JULIET:")

    # Resuming from the checkpoint continues its step count.
    tiny_cfg.load_path = str(checkpoint)
    tiny_cfg.max_duration = "9ba"
    second = train(tiny_cfg)
    assert (second["start_batch"], second["batches"]) == (6, 9)
    err = capfd.readouterr().err
    assert "run plan: 9 batches of 512 tokens (4,608 tokens)" in err and "; resuming at batch 6\n" in err
    assert (save_folder / "ep0-ba9-rank0.pt").is_file()

    # autoresume picks the newest checkpoint in save_folder by itself.
    tiny_cfg.load_path = None
    tiny_cfg.autoresume = True
    tiny_cfg.max_duration = "10ba"
    third = train(tiny_cfg)
    assert (third["start_batch"], third["batches"]) == (9, 10)
    # Once max_duration is reached, running again only evaluates and exports (Composer's fit would raise).
    again = train(tiny_cfg)
    assert (again["start_batch"], again["batches"]) == (10, 10)
    assert again["heldout_nats_per_token"] == pytest.approx(third["heldout_nats_per_token"], rel=1e-5)


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """The same tiny plays prepared with a trained BPE tokenizer: another tokenizer than tiny_data's."""
    return make_tiny_data(tmp_path_factory.mktemp("bpe"), tokenizer="bpe:300")


def test_data_that_does_not_fit_is_refused_before_anything_is_written(tiny_cfg, tiny_data, bpe_data, tmp_path):
    cases = [
        # a tokenizer other than the shards' (by hash), named with both
        ({"tokenizer": {"name": str(bpe_data / "tokenizer")}}, r"tokenizer.name .*bpe.*hash .*is not the tokenizer .* was "
                                                               r"prepared with \('char'"),
        # a vocabulary too small for the shards' token ids
        ({"model": {**tiny_cfg.model, "vocab_size": 10}}, r"model.vocab_size 10 is smaller than .* \(\d+ tokens\)"),
        # eval shards prepared with another tokenizer than the training shards
        ({"eval_loader": {"name": "text", "dataset": {"local": str(bpe_data), "split": "validation"}}},
         "is not the tokenizer"),
        # streams of a mixture with different tokenizers
        ({"train_loader": {"name": "text", "dataset": {"streams": {
            "char": {"local": str(tiny_data), "proportion": 0.5}, "bpe": {"local": str(bpe_data), "proportion": 0.5}}}}},
         r"streams 'char' .* and 'bpe' .* different tokenizers"),
        # a folder that was never prepared, or a split it does not hold
        ({"eval_loader": {"name": "text", "dataset": {"local": str(tmp_path / "nothing")}}},
         "no folder .*nothing: prepare one with `llm prepare`"),
        ({"eval_loader": {"name": "text", "dataset": {"local": str(tmp_path)}}}, "no llm_data.json in .*not a prepared"),
        ({"eval_loader": {"name": "text", "dataset": {"local": str(tiny_data), "split": "test"}}},
         r"has no 'test' split; it holds \['train', 'validation'\]"),
        # sequences longer than the prepared rows
        ({"model": {**tiny_cfg.model, "max_seq_len": 128}}, r"rows of 64 tokens, shorter than the model's max_seq_len 128"),
    ]
    for overrides, match in cases:
        cfg = {**OmegaConf.to_container(tiny_cfg), **overrides}
        with pytest.raises(PreparedDataError, match=match):
            train(cfg)
        assert not Path(tiny_cfg.save_folder).exists()


def test_bad_config_raises_before_any_work(tiny_cfg):
    tiny_cfg.train_loader.dataset["splt"] = "train"
    with pytest.raises(ConfigError, match=r"train_loader\.dataset\.splt"):
        train(tiny_cfg)
    assert not Path(tiny_cfg.save_folder).exists()


def test_training_data_that_makes_no_batch_is_one_error_before_anything_is_written(tiny_data, tmp_path):
    # drop_last with fewer sequences than a batch: Composer would train nothing (and the run plan
    # divided by the 0 batches of an epoch)
    with pytest.raises(ConfigError, match=r"^global_train_batch_size: 4096 is more than the training data's \d+ "
                                          r"sequences and train_loader.drop_last is true, so there is no batch to "
                                          r"train on: use a global_train_batch_size of at most \d+ or "
                                          r"train_loader.drop_last: false$"):
        train(tiny_config(tiny_data, tmp_path / "run", global_train_batch_size=4096))
    assert not any((tmp_path / "run").glob("*.pt"))


def test_a_small_validation_split_gives_no_warning_at_each_evaluation(tiny_data, tmp_path, recwarn):
    # fewer batches than eval_subset_num_batches, a short last batch: what a small corpus of one's
    # own does by design, which Composer warned about
    train(tiny_config(tiny_data, tmp_path / "run", max_duration="4ba", eval_interval="2ba",
                      eval_subset_num_batches=100_000, device_eval_batch_size=1000))
    said = [str(w.message) for w in recwarn]
    assert not [m for m in said if "Cannot split" in m or "DataloaderNumBatchesWarning" in m], said


def test_the_run_plan_of_data_smaller_than_a_batch_counts_its_one_short_batch(tiny_data, tmp_path, capfd):
    rows = json.loads((tiny_data / "llm_data.json").read_text())["splits"]["train"]["rows"]
    sequences = rows * 2  # two 32-token sequences a prepared row
    cfg = tiny_config(tiny_data, tmp_path / "run", max_duration="2ba", global_train_batch_size=sequences + 100,
                      scheduler={"name": "cosine_with_warmup", "t_warmup": "0ba", "alpha_f": 0.1})
    cfg["train_loader"]["drop_last"] = False
    train(cfg)
    tokens = sequences * 32
    assert (f"run plan: 2 batches of {tokens:,} tokens ({2 * tokens:,} tokens), an epoch is 1 batch "
            f"({tokens:,} tokens): 2.00 epochs\n") in capfd.readouterr().err
