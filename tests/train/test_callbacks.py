"""CurvePlotter and ConfigSaver: the curves match what Composer logs, survive a resume, and are drawn."""

import json
from pathlib import Path

import pytest
import torch
from composer.loggers import InMemoryLogger
from omegaconf import OmegaConf
from PIL import Image

from llm.train.callbacks import CONFIG_YAML, CURVES_JSON, CURVES_PNG, ConfigSaver, CurvePlotter
import llm.train
from llm.train.builders import run_data
from llm.train.trainer import build_trainer, resolve_config
from tests.train_helpers import extra_callbacks, tiny_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("callbacks")
    cfg = resolve_config(tiny_config(tiny_data, root / "run", max_duration="6ba", eval_interval="3ba", save_interval="3ba"))
    return cfg, run_data(cfg)


def _fit(cfg, tokenizer):
    folder = Path(cfg["save_folder"])
    logger = InMemoryLogger()
    with extra_callbacks(CurvePlotter(folder), ConfigSaver(cfg, folder), loggers=[logger]):
        trainer, _ = build_trainer(cfg, tokenizer)
    trainer.fit()
    trainer.close()
    return logger, json.loads((folder / CURVES_JSON).read_text())


def test_curves_match_composer_logs_and_are_plotted(setup):
    cfg, tokenizer = setup
    logger, curves = _fit(cfg, tokenizer)
    folder = Path(cfg["save_folder"])

    assert [row[0] for row in curves["train"]] == [1, 2, 3, 4, 5, 6]
    logged_loss = [value for _, value in logger.data["loss/train/total"]]
    assert [row[1] for row in curves["train"]] == pytest.approx(logged_loss, rel=1e-6)
    assert curves["train"][-1][1] < curves["train"][0][1]
    # The learning rate each batch used: Composer's linear warmup (t_warmup 2ba) starts at 0.
    assert [row[2] for row in curves["train"][:3]] == pytest.approx([0.0, 0.5e-2, 1e-2])
    eval_ce = curves["eval"]["validation"]["LanguageCrossEntropy"]
    assert [batch for batch, _ in eval_ce] == [3, 6]
    logged_ce = [float(v) for _, v in logger.data["metrics/validation/LanguageCrossEntropy"]]
    assert [value for _, value in eval_ce] == pytest.approx(logged_ce, rel=1e-6)
    assert "LanguagePerplexity" in curves["eval"]["validation"]

    with Image.open(folder / CURVES_PNG) as image:
        assert image.format == "PNG" and image.size == (800, 600)
    assert OmegaConf.to_container(OmegaConf.load(folder / CONFIG_YAML)) == cfg


def test_resumed_run_keeps_the_whole_curve(setup, tmp_path):
    cfg, tokenizer = setup
    _, full = _fit({**cfg, "save_folder": str(tmp_path / "full")}, tokenizer)
    resumed_cfg = {**cfg, "save_folder": str(tmp_path / "resumed"), "load_path": str(tmp_path / "full" / "ep0-ba3-rank0.pt")}
    _, resumed = _fit(resumed_cfg, tokenizer)
    assert [row[0] for row in resumed["train"]] == [1, 2, 3, 4, 5, 6]
    assert [row[1] for row in resumed["train"]] == pytest.approx([row[1] for row in full["train"]], abs=1e-6)
    resumed_ce, full_ce = (dict(run["eval"]["validation"]["LanguageCrossEntropy"]) for run in (resumed, full))
    assert list(resumed_ce) == list(full_ce) == [3, 6]
    assert list(resumed_ce.values()) == pytest.approx(list(full_ce.values()), abs=1e-6)


def test_train_writes_curves_and_config(setup, tmp_path):
    cfg, _ = setup
    cfg = {**cfg, "save_folder": str(tmp_path / "run"), "num_samples": 0}
    result = llm.train.train(cfg)
    folder = Path(cfg["save_folder"])
    curves = json.loads((folder / CURVES_JSON).read_text())
    assert [row[0] for row in curves["train"]] == list(range(1, result["batches"] + 1))
    # The final held-out evaluation is plotted too, at the last batch.
    assert curves["eval"]["heldout/validation"]["LanguageCrossEntropy"] == [[6, pytest.approx(result["heldout_nats_per_token"])]]
    assert (folder / CURVES_PNG).stat().st_size > 10_000
    assert OmegaConf.to_container(OmegaConf.load(folder / CONFIG_YAML)) == llm.train.resolve_config(cfg)


@pytest.mark.parametrize("terminal", [True, False])
def test_the_progress_bar_is_drawn_on_a_terminal_and_logged_as_lines_elsewhere(setup, monkeypatch, terminal):
    import llm.train.trainer as trainer_module

    cfg, data = setup
    seen = {}

    class Stop(Exception):
        pass

    def fake_trainer(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(trainer_module, "output_is_terminal", lambda: terminal)
    monkeypatch.setattr(trainer_module, "Trainer", fake_trainer)
    with pytest.raises(Stop):
        trainer_module.build_trainer(dict(cfg, progress_bar=True, log_to_console=False), data)
    assert (seen["progress_bar"], seen["log_to_console"]) == ((True, False) if terminal else (False, True))


def test_the_batch_clock_leaves_the_first_batch_out_of_tokens_per_s_and_reports_it_as_compiling():
    from llm.train.callbacks import BatchClock

    clock = BatchClock()
    clock.seconds, clock.tokens = [9.0, 1.0, 2.0, 1.5], [100, 100, 100, 100]
    compiled = clock.speed(compiled=True)
    assert compiled == {"train_seconds": 13.5, "tokens_per_s": 300 / 4.5, "compile_seconds": 9.0 - 1.5}
    assert clock.speed(compiled=False)["compile_seconds"] == 0.0  # an eager first batch is just slower
    clock.seconds, clock.tokens = [2.0], [50]  # a fit of one batch: its own speed
    assert clock.speed(compiled=True) == {"train_seconds": 2.0, "tokens_per_s": 25.0, "compile_seconds": 0.0}
    assert BatchClock().speed(compiled=True)["tokens_per_s"] == 0.0  # nothing trained (already finished)
