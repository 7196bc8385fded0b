"""llm.train end to end on the real corpus with a tiny char-level model: fit, checkpoint, resume, export."""

import json
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from llm import MosaicGPT
from llm.data import load_tokenizer
from llm.train.trainer import build_trainer, prepare_tokenizer, resolve_config, train
from tests.train_helpers import tiny_config


@pytest.fixture
def tiny_cfg(tmp_path):
    """train_helpers' tiny config on the real corpus, in two microbatches, with samples."""
    cfg = tiny_config(None, tmp_path / "run", max_duration="6ba", eval_interval="3ba", save_interval="3ba",
                      global_train_batch_size=16, device_train_microbatch_size=8, device_eval_batch_size=256, seed=3,
                      num_samples=2, sample_max_new_tokens=12, sample_prompts=["ROMEO:"])
    cfg["optimizer"]["weight_decay"] = 0.0
    return OmegaConf.create(cfg)


def test_fit_lowers_the_training_loss(tiny_cfg, tmp_path):
    cfg = resolve_config(tiny_cfg)
    tokenizer = prepare_tokenizer(cfg["tokenizer"], tmp_path / "tokenizer")
    trainer = build_trainer(cfg, tokenizer)
    model = trainer.state.model
    batch = next(iter(trainer.state.train_dataloader))
    with torch.no_grad():
        before = model.loss(model(batch), batch).item()
    trainer.fit()
    with torch.no_grad():
        after = model.loss(model(batch), batch).item()
    assert after < before - 0.5, (before, after)
    assert (Path(cfg["save_folder"]) / "ep0-ba6-rank0.pt").is_file()


def test_train_checkpoints_resumes_and_exports(tiny_cfg):
    save_folder = Path(tiny_cfg.save_folder)
    first = train(tiny_cfg)
    assert (first["start_batch"], first["batches"]) == (0, 6)
    checkpoint = save_folder / "ep0-ba6-rank0.pt"
    assert checkpoint.is_file() and (save_folder / "ep0-ba3-rank0.pt").is_file()
    assert first["checkpoint"] == os.path.realpath(checkpoint)
    assert json.loads((save_folder / "metrics.json").read_text()) == {
        k: v for k, v in first.items() if k not in ("samples", "model_dir", "checkpoint")
    }
    # A char model after 6 batches is better than uniform but far from trained.
    assert 1.0 < first["heldout_nats_per_token"] < torch.log(torch.tensor(first["vocab_size"])).item()
    assert first["tokens_per_byte"] == pytest.approx(1.0, abs=0.01)
    assert len(first["samples"]) == 2 and all(s.startswith("ROMEO:") for s in first["samples"])

    # The exported bundle loads on its own and generates.
    model = MosaicGPT.from_pretrained(first["model_dir"])
    tokenizer = load_tokenizer(first["model_dir"])
    ids = torch.tensor([tokenizer.encode("JULIET:")])
    out = model.generate(ids, max_new_tokens=10, do_sample=True, top_k=5, seed=0)
    assert out.shape == (1, ids.shape[1] + 10)
    assert tokenizer.decode(out[0]).startswith("JULIET:")

    # Resuming from the checkpoint continues its step count, with the run's saved tokenizer.
    tokenizer_mtime = (save_folder / "tokenizer" / "tokenizer.json").stat().st_mtime_ns
    tiny_cfg.load_path = str(checkpoint)
    tiny_cfg.max_duration = "9ba"
    second = train(tiny_cfg)
    assert (second["start_batch"], second["batches"]) == (6, 9)
    assert (save_folder / "ep0-ba9-rank0.pt").is_file()
    assert (save_folder / "tokenizer" / "tokenizer.json").stat().st_mtime_ns == tokenizer_mtime

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

    tiny_cfg.tokenizer = {"kind": "bpe", "vocab_size": 300}
    with pytest.raises(ValueError, match="holds a tokenizer built with"):
        train(tiny_cfg)


@pytest.mark.parametrize(
    ("key", "section", "match"),
    [
        ("max_duraton", None, "unknown config key.*'max_duraton'.*allowed keys.*'max_duration'"),
        ("d_modle", "model", "unknown model config key.*'d_modle'"),
        ("vocab_size", "model", "model.vocab_size must not be set"),
    ],
)
def test_bad_keys_raise_before_any_work(tiny_cfg, key, section, match):
    (tiny_cfg[section] if section else tiny_cfg)[key] = 64
    with pytest.raises(ValueError, match=match):
        train(tiny_cfg)
    assert not Path(tiny_cfg.save_folder).exists()


def test_missing_key_and_bad_sections_raise(tiny_cfg, tmp_path):
    del tiny_cfg["optimizer"]
    with pytest.raises(ValueError, match=r"missing config key\(s\) \['optimizer'\]"):
        resolve_config(tiny_cfg)
    tokenizer = prepare_tokenizer({"kind": "char"}, tmp_path / "tokenizer")
    for section, value, match in [
        ("optimizer", {"name": "adam", "lr": 1e-3}, "optimizer.name must be one of"),
        ("optimizer", {"name": "decoupled_adamw", "learning_rate": 1e-3}, r"unknown option\(s\) \['learning_rate'\]"),
        ("algorithms", {"grad_clip": {}}, r"unknown algorithm\(s\) \['grad_clip'\]"),
    ]:
        cfg = resolve_config({**OmegaConf.to_container(tiny_cfg), "optimizer": {"name": "decoupled_adamw"}})
        cfg[section] = value
        with pytest.raises(ValueError, match=match):
            build_trainer(cfg, tokenizer)


@pytest.mark.parametrize("path", ["configs/shakespeare.yaml", "configs/shakespeare-char.yaml",
                                  "configs/shakespeare-alibi.yaml", "configs/finetune-shakespeare.yaml",
                                  "configs/shakespeare-fsdp.yaml"])
def test_shipped_configs_are_valid(path):
    from llm.train.trainer import validate_config

    validate_config(OmegaConf.load(Path(__file__).parents[1] / path))
