"""llm.train.config and llm.cli.train: every bad training config is refused up front, naming the key."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from llm.cli.train import main
from llm.train.config import (
    EvalConfig,
    FinetuneDatasetConfig,
    StreamingDatasetConfig,
    TrainConfig,
    load_eval_config,
    load_train_config,
)
from llm.utils.config import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))

BASE = {
    "model": {"max_seq_len": 64, "d_model": 32, "n_heads": 4, "n_layers": 2, "expansion_ratio": 4},
    "train_loader": {"name": "text", "dataset": {"local": "data/x", "shuffle": True}},
    "eval_loader": {"name": "text", "dataset": {"local": "data/x"}},
    "optimizer": {"name": "decoupled_adamw", "lr": 3.0e-3, "betas": [0.9, 0.95]},
    "scheduler": {"name": "cosine_with_warmup", "t_warmup": "10ba", "alpha_f": 0.1},
    "algorithms": {"gradient_clipping": {"clipping_type": "norm", "clipping_threshold": 1.0}},
    "max_duration": "100ba",
    "global_train_batch_size": 8,
    "save_folder": "runs/test",
}


def with_overrides(*overrides: str, base: dict | None = None) -> dict:
    """``base`` with omegaconf dotlist overrides merged in, as scripts/train.py does."""
    merged = OmegaConf.merge(OmegaConf.create(copy.deepcopy(base or BASE)), OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_container(merged, resolve=True)


def refused(*overrides: str, base: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_train_config(with_overrides(*overrides, base=base))
    return str(info.value)


def test_valid_config_resolves_defaults_and_roles():
    config = load_train_config(BASE)
    assert isinstance(config, TrainConfig)
    train, evaluation = config.train_loader, config.eval_loader
    assert isinstance(train.dataset, StreamingDatasetConfig)
    assert (train.dataset.split, train.drop_last, train.dataset.shuffle_seed) == ("train", True, 17)
    assert (evaluation.dataset.split, evaluation.drop_last) == ("validation", False)
    assert config.device_eval_batch_size == 8
    assert config.optimizer.betas == (0.9, 0.95)
    assert config.model["expansion_ratio"] == 4.0 and config.model["kv_n_heads"] == 4
    assert "vocab_size" not in config.model  # taken from the tokenizer later
    # seed drives the shuffle seed unless it is given
    assert load_train_config(with_overrides("seed=3")).train_loader.dataset.shuffle_seed == 3


def test_to_dict_is_plain_resolved_and_round_trips(tmp_path):
    config = load_train_config(OmegaConf.create(BASE))
    plain = config.to_dict()
    assert plain["optimizer"]["betas"] == [0.9, 0.95]
    assert plain["train_loader"]["dataset"]["split"] == "train"
    assert plain["algorithms"] == {"gradient_clipping": {"clipping_type": "norm", "clipping_threshold": 1.0}}
    assert plain["scheduler"]["t_max"] == "1dur" and plain["sample_prompts"] == ["\n"]
    OmegaConf.save(OmegaConf.create(plain), tmp_path / "config.yaml")  # YAML-safe
    assert load_train_config(OmegaConf.load(tmp_path / "config.yaml")) == config


@pytest.mark.parametrize(
    "override, message",
    [
        ("train_loader.dataset.splt=x",
         r"^train_loader\.dataset\.splt: unknown key \(did you mean 'split'\?\); allowed keys: \['local', 'remote', "),
        ("optimizer.lr=fast", r"^optimizer\.lr: expected a float, got 'fast' \(str\)$"),
        ("optimizer.betas=[0.9]", r"^optimizer\.betas: expected 2 values, got 1"),
        ("optimizer.betas=[0.9,1.0]", r"^optimizer\.betas: item 1 must be in \[0, 1\), got 1\.0"),
        ("device_train_microbatch_size=0", r"^device_train_microbatch_size: must be > 0, got 0"),
        ("device_train_microbatch_size=big", r"^device_train_microbatch_size: expected an int, 'auto' or null"),
        ("precision=fp64", r"^precision: expected one of \['fp32', 'amp_fp16', 'amp_bf16', 'amp_fp8'\].*got 'fp64'"),
        ("max_duration=0ba", r"^max_duration: must be > 0, got '0ba'"),
        ("max_duration=-5ba", r"^max_duration: must be > 0, got '-5ba'"),
        ("max_duration=3", r"^max_duration: give a unit: e\.g\. '3ep' .* allowed units: ba \(batches\), ep"),
        ("max_duration=1dur", r"^max_duration: unit 'dur' is not allowed here; use one of ba \(batches\)"),
        ("max_duration=soon", r"^max_duration: expected a Composer time string"),
        ("model.expansion_ratio=0.001",
         r"^model\.expansion_ratio: .*d_model 32 .*feed-forward width of 0.*ffn_hidden_size"),
        ("model.n_head=4", r"^model\.n_head: unknown key \(did you mean 'n_heads'\?\); allowed keys"),
        ("model.d_model=30", r"^model\.d_model: d_model \(30\) must be divisible by n_heads \(4\)"),
        ("model.init_std=.nan", r"^model\.init_std: expected a finite float"),
        ("model.vocab_size=0", r"^model\.vocab_size: vocab_size must be a positive integer"),
        ("sample_temperature=nan", r"^sample_temperature: expected a finite float, got nan"),
        ("sample_temperature=.inf", r"^sample_temperature: expected a finite float, got inf"),
        ("sample_temperature=-1", r"^sample_temperature: must be >= 0"),
        ("sample_prompts=[]", r"^sample_prompts: is empty but num_samples is 3"),
        ("sample_top_k=0", r"^sample_top_k: must be > 0"),
        ("eval_max_sequencs=8", r"^eval_max_sequencs: unknown key; allowed keys: \['model', "),
        ("bogus=1", r"^bogus: unknown key; allowed keys: \['model', 'tokenizer', 'load_pretrained', "),
        ("algorithms.label_smoothing.alpha=0.1",
         r"^algorithms\.label_smoothing: unknown key; allowed keys: \['gradient_clipping'\]"),
        ("algorithms.gradient_clipping.clipping_type=l2",
         r"^algorithms\.gradient_clipping\.clipping_type: expected one of \['norm', 'value', 'adaptive'\]"),
        ("algorithms.gradient_clipping.clipping_threshold=0",
         r"^algorithms\.gradient_clipping\.clipping_threshold: must be > 0"),
        ("parallelism_config.fsdp.sharding_stratgy=FULL_SHARD",
         r"^parallelism_config\.fsdp\.sharding_stratgy: unknown FSDP option; allowed keys: \[.*'sharding_strategy'"),
        ("parallelism_config.fsdp.sharding_strategy=FULL",
         r"^parallelism_config\.fsdp\.sharding_strategy: expected one of \["),
        ("parallelism_config.fsdp.verbose=1", r"^parallelism_config\.fsdp\.verbose: expected a bool"),
        ("parallelism_config.tp={}", r"^parallelism_config\.tp: unknown key; allowed keys: \['fsdp'\]"),
        ("tokenizer.kind=bpe", r"^tokenizer\.kind: unknown key; allowed keys: \['name'\]"),
        ("scheduler.t_warmup=1000ba", r"^scheduler\.t_warmup: 1000ba is longer than max_duration 100ba"),
        ("scheduler.t_warmup=-1ba", r"^scheduler\.t_warmup: must be >= 0"),
        ("scheduler.alpha_f=2", r"^scheduler\.alpha_f: must be in \[0, 1\]"),
        ("scheduler.name=constant_with_warmup", r"^scheduler\.alpha_f: constant_with_warmup has no final multiplier"),
        ("scheduler.name=step", r"^scheduler\.name: expected one of \['cosine_with_warmup', "),
        ("optimizer.name=sgd", r"^optimizer\.name: expected one of \['decoupled_adamw', 'adamw', 'muon'\]"),
        ("optimizer.weight_decay=-1", r"^optimizer\.weight_decay: must be >= 0"),
        ("eval_interval=0", r"^eval_interval: must be > 0"),
        ("eval_interval=2dur", r"^eval_interval: a fraction of the run \(dur\) must be at most 1"),
        ("save_interval=0ba", r"^save_interval: must be > 0"),
        ("console_log_interval=10tok",
         r"^console_log_interval: unit 'tok' is not allowed here; use one of ba \(batches\), ep"),
        ("eval_subset_num_batches=0", r"^eval_subset_num_batches: must be -1 \(the whole eval split\) or > 0"),
        ("global_train_batch_size=true", r"^global_train_batch_size: expected an int, got True \(bool\)"),
        ("save_num_checkpoints_to_keep=-2", r"^save_num_checkpoints_to_keep: must be >= -1"),
        ("seed=-1", r"^seed: must be in \[0, 4294967295\]"),
        ("progress_bar=maybe", r"^progress_bar: expected a bool \(true or false\), got 'maybe'"),
        ("load_pretrained=smollm2-135m-instruct", r"^model: load_pretrained gives the model: remove the model section"),
        ("model=3", r"^model: expected a mapping or null, got 3"),
        ("optimizer=null", r"^optimizer: expected a mapping"),
        ("train_loader.name=sql", r"^train_loader\.name: expected one of \['text', 'finetuning'\]"),
        ("train_loader.name=finetuning",
         r"^train_loader\.dataset\.local: unknown key; allowed keys: \['path', 'padding_side', 'shuffle', 'chat_template'\]"),
        ("train_loader.shuffle=true", r"^train_loader\.shuffle: unknown key; allowed keys: \['name', 'dataset', "),
        ("train_loader.num_workers=-1", r"^train_loader\.num_workers: must be >= 0"),
        ("train_loader.prefetch_factor=2", r"^train_loader\.prefetch_factor: needs num_workers > 0"),
        ("train_loader.persistent_workers=true", r"^train_loader\.persistent_workers: needs num_workers > 0"),
        ("eval_loader.dataset.local=null", r"^eval_loader\.dataset: give local .*, remote .* or streams"),
        ("eval_loader.dataset.shuffle_algo=random",
         r"^eval_loader\.dataset\.shuffle_algo: expected one of \['naive', "),
        ("eval_loader.dataset.download_timeout=0", r"^eval_loader\.dataset\.download_timeout: must be > 0"),
        ("eval_loader.dataset.cache_limit=lots", r"^eval_loader\.dataset\.cache_limit: expected a number of bytes"),
        ("eval_loader.dataset.validate_hash=sha9", r"^eval_loader\.dataset\.validate_hash: expected one of \["),
        ("eval_loader.dataset.streams={a: {local: x}}",
         r"^eval_loader\.dataset\.local: give either streams or local/remote, not both"),
    ],
)
def test_bad_values_are_refused_naming_the_full_path(override, message):
    assert pytest.raises(ConfigError, load_train_config, with_overrides(override)).match(message)


def test_a_tokenizer_section_names_the_datas_tokenizer():
    config = load_train_config({**BASE, "tokenizer": {"name": "data/x/tokenizer"}})
    assert config.tokenizer.name == "data/x/tokenizer"


def test_streams_weighting_rules():
    base = with_overrides("train_loader.dataset.local=null")

    def loader(streams):
        return {**base, "train_loader": {"dataset": {"streams": streams}}}

    mixed = {"a": {"local": "x", "proportion": 0.5}, "b": {"local": "y", "repeat": 2}}
    with pytest.raises(ConfigError, match=r"^train_loader\.dataset\.streams\.b: either every stream gives a proportion "
                                          r"or none does \(stream 'a' has one, 'b' has repeat\)"):
        load_train_config(loader(mixed))
    with pytest.raises(ConfigError, match=r"^train_loader\.dataset\.streams\.a\.repeat: give at most one of "
                                          r"proportion, repeat and choose"):
        load_train_config(loader({"a": {"local": "x", "proportion": 0.5, "repeat": 2}}))
    with pytest.raises(ConfigError, match=r"^train_loader\.dataset\.streams\.a: a stream needs local"):
        load_train_config(loader({"a": {"split": "train"}}))
    with pytest.raises(ConfigError, match=r"^train_loader\.dataset\.streams\.a\.proportion: must be > 0"):
        load_train_config(loader({"a": {"local": "x", "proportion": 0}}))
    with pytest.raises(ConfigError, match=r"^train_loader\.dataset\.streams\.a\.splt: unknown key"):
        load_train_config(loader({"a": {"local": "x", "splt": "train"}}))
    with pytest.raises(ConfigError, match=r"^train_loader\.dataset\.streams: give at least one stream"):
        load_train_config(loader({}))
    config = load_train_config(loader({"a": {"local": "x", "proportion": 0.7},
                                       "b": {"remote": "s3://b", "proportion": 0.3}}))
    assert config.train_loader.dataset.streams["b"].remote == "s3://b"
    config = load_train_config(loader({"a": {"local": "x", "repeat": 2}, "b": {"local": "y", "choose": 10},
                                       "c": {"local": "z"}}))
    assert config.train_loader.dataset.streams["b"].choose == 10


def test_remote_with_or_without_local_cache_is_accepted():
    config = load_train_config(with_overrides("train_loader.dataset.local=null",
                                              "train_loader.dataset.remote=s3://b/d"))
    assert config.train_loader.dataset.remote == "s3://b/d" and config.train_loader.dataset.local is None
    load_train_config(with_overrides("train_loader.dataset.remote=s3://b/d", "train_loader.dataset.cache_limit=10gb"))


def test_finetuning_loader_and_pretrained_start():
    base = {key: value for key, value in BASE.items() if key != "model"}
    loader = {"name": "finetuning", "dataset": {"path": "d.jsonl", "shuffle": True}}
    config = load_train_config({**base, "load_pretrained": "runs/x/model", "train_loader": loader,
                                "eval_loader": {"name": "finetuning", "dataset": {"path": "v.jsonl"}}})
    assert isinstance(config.train_loader.dataset, FinetuneDatasetConfig)
    assert config.train_loader.dataset.padding_side == "right" and config.model is None
    with pytest.raises(ConfigError, match=r"^train_loader\.dataset\.padding_side: expected one of \['left', 'right'\]"):
        bad = {**loader, "dataset": {"path": "d", "padding_side": "up"}}
        load_train_config({**base, "load_pretrained": "m", "train_loader": bad})
    with pytest.raises(ConfigError, match=r"^train_loader\.dataset\.path: missing required key"):
        load_train_config({**base, "load_pretrained": "m", "train_loader": {"name": "finetuning", "dataset": {}}})
    with pytest.raises(ConfigError, match=r"^model: missing: give a model section, or load_pretrained"):
        load_train_config(base)


def test_missing_required_keys_are_named():
    base = dict(BASE)
    del base["optimizer"]
    with pytest.raises(ConfigError, match=r"^optimizer: missing required key$"):
        load_train_config(base)
    with pytest.raises(ConfigError, match=r"^scheduler\.t_warmup: missing required key$"):
        load_train_config({**BASE, "scheduler": {"name": "cosine_with_warmup"}})


def test_every_scheduler_to_dict_key_is_an_option_of_the_composer_scheduler():
    import inspect

    from composer.optim import (
        ConstantWithWarmupScheduler,
        CosineAnnealingWithWarmupScheduler,
        LinearWithWarmupScheduler,
    )

    classes = {"cosine_with_warmup": CosineAnnealingWithWarmupScheduler,
               "constant_with_warmup": ConstantWithWarmupScheduler, "linear_with_warmup": LinearWithWarmupScheduler}
    for name, cls in classes.items():
        section = {"name": name, "t_warmup": "10ba"}
        options = load_train_config({**BASE, "scheduler": section}).to_dict()["scheduler"]
        options.pop("name")
        cls(**options)  # no unexpected option
        assert set(options) <= set(inspect.signature(cls).parameters)
    assert load_train_config(BASE).to_dict()["scheduler"]["alpha_f"] == 0.1


def test_vocab_size_may_be_given():
    assert load_train_config(with_overrides("model.vocab_size=2048")).model["vocab_size"] == 2048


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_are_valid(path):
    config = load_train_config(OmegaConf.load(path))
    assert load_train_config(config.to_dict()) == config


def test_the_default_config_trains_compiled_in_bf16_and_null_trains_eager():
    default = Path(__file__).resolve().parents[2] / "configs" / "shakespeare.yaml"
    config = load_train_config(OmegaConf.load(default))
    assert config.precision == "amp_bf16" and config.compile_config is not None
    assert config.compile_config.backend == "inductor" and config.compile_config.fullgraph is False
    eager = OmegaConf.merge(OmegaConf.load(default), OmegaConf.from_dotlist(["compile_config=null"]))
    assert load_train_config(eager).compile_config is None


# ------------------------------------------------------------------------------ EvalConfig


EVAL_LOADER = {"dataset": {"local": "data/x"}}


def test_eval_config_takes_a_training_config_plus_eval_keys():
    config = load_eval_config({**BASE, "eval_seq_len": 32, "eval_max_sequences": 4})
    assert isinstance(config, EvalConfig)
    assert (config.eval_seq_len, config.eval_max_sequences) == (32, 4)
    assert config.eval_loader.dataset.split == "validation" and config.eval_loader.drop_last is False
    minimal = load_eval_config({"eval_loader": EVAL_LOADER})
    assert minimal.model is None and minimal.device_eval_batch_size is None


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"eval_max_sequencs": 8}, r"^eval_max_sequencs: unknown key \(did you mean 'eval_max_sequences'\?\)"),
        ({"eval_max_sequences": 0}, r"^eval_max_sequences: must be > 0"),
        ({"eval_seq_len": 1}, r"^eval_seq_len: must be >= 2"),
        ({"eval_output": "x.json"}, r"^eval_output: unknown key; allowed keys: \['model', "),
        ({"precision": "fp64"}, r"^precision: expected one of"),
        ({"optimizer": {"name": "decoupled_adamw", "lr": "fast"}}, r"^optimizer\.lr: expected a float"),
    ],
)
def test_eval_config_refusals(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_eval_config({**BASE, **extra})


def test_eval_config_requires_only_the_eval_loader_and_a_model_for_checkpoints():
    with pytest.raises(ConfigError, match=r"^eval_loader: missing required key"):
        load_eval_config({"model": BASE["model"]})
    with pytest.raises(ConfigError, match=r"^model: missing: evaluating a checkpoint needs the run's model section"):
        load_eval_config({"eval_loader": EVAL_LOADER}, require_model=True)
    load_eval_config({"eval_loader": EVAL_LOADER, "load_pretrained": "m"}, require_model=True)
    load_eval_config({"eval_loader": EVAL_LOADER, "model": BASE["model"]}, require_model=True)


# ------------------------------------------------------------------------------ the CLI


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "run.yaml"
    OmegaConf.save(OmegaConf.create({**BASE, "save_folder": str(tmp_path / "run")}), path)
    return path


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train_loader.dataset.splt=x"], "train_loader.dataset.splt: unknown key"),
        (["optimizer.lr=fast"], "optimizer.lr: expected a float, got 'fast' (str)"),
        (["precision=fp64"], "precision: expected one of"),
        (["max_duration=0ba"], "max_duration: must be > 0, got '0ba'"),
        (["model.expansion_ratio=0.001"], "model.expansion_ratio: "),
        (["novalue"], "novalue"),
        (["optimizer.lr=${nowhere}"], "nowhere"),
        (["optimizer.betas=[0.9,"], "optimizer.betas=[0.9,"),
    ],
)
def test_cli_reports_one_line_and_exit_2(config_file, capsys, overrides, message):
    assert main([str(config_file), *overrides]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("train.py: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err and out == ""
    assert not (config_file.parent / "run").exists()  # nothing written


@pytest.mark.parametrize("argv, message", [
    (["missing.yaml"], "missing.yaml"), ([], "give a config file"), (["-x"], "unknown option"),
])
def test_cli_bad_files_and_arguments(tmp_path, capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: ") and message in err and err.count("\n") == 1


def test_cli_unreadable_yaml(tmp_path, capsys):
    for text in ("a: [1,\n", "- just\n- a list\n"):
        (tmp_path / "bad.yaml").write_text(text)
        assert main([str(tmp_path / "bad.yaml")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("train.py: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_help(capsys):
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: scripts/train.py CONFIG.yaml")
    assert main(["-h"]) == 0


def test_cli_trains_with_the_resolved_config(config_file, monkeypatch, capsys):
    import llm.train

    calls = []
    monkeypatch.setattr(llm.train, "train", lambda cfg: calls.append(cfg) or {})
    assert main([str(config_file), "max_duration=50ba", "model.n_layers=1"]) == 0
    (cfg,) = calls
    assert isinstance(cfg, dict) and cfg["max_duration"] == "50ba" and cfg["model"]["n_layers"] == 1
    assert cfg["train_loader"]["dataset"]["split"] == "train" and cfg["optimizer"]["betas"] == [0.9, 0.95]

    def refuse(cfg):
        raise ConfigError("model.vocab_size", "2048 does not match the data's tokenizer (4096 tokens)")

    monkeypatch.setattr(llm.train, "train", refuse)
    assert main([str(config_file)]) == 2
    assert capsys.readouterr().err == ("train.py: error: model.vocab_size: 2048 does not match the data's "
                                       "tokenizer (4096 tokens)\n")


def test_cli_a_missing_dataset_folder_is_one_line_naming_the_current_folder(tmp_path, monkeypatch, capsys):
    config = Path(__file__).resolve().parents[2] / "configs" / "shakespeare.yaml"
    monkeypatch.chdir(tmp_path)
    assert main([str(config), "max_duration=1ba", "scheduler.t_warmup=0ba", "save_folder=run",
                 "train_loader.dataset.local=nowhere/data", "eval_loader.dataset.local=nowhere/data"]) == 2
    err = capsys.readouterr().err
    assert err == (f"train.py: error: no folder nowhere/data (relative to the current folder {tmp_path}): "
                   "prepare one with `llm prepare`\n")
    assert not (tmp_path / "run").exists()


def test_cli_an_interrupted_run_says_what_it_left(config_file, tmp_path, monkeypatch, capsys):
    import llm.train

    def interrupted(cfg):
        raise SystemExit(130)  # what Composer's SIGINT handler does

    monkeypatch.setattr(llm.train, "train", interrupted)
    assert main([str(config_file), f"save_folder={tmp_path / 'run'}", "save_interval=5ba"]) == 130
    assert capsys.readouterr().err == ("\ntrain.py: interrupted; no checkpoint was saved yet (every 5ba), so the run "
                                       "starts over when rerun\n")
    monkeypatch.setattr(llm.train, "train", lambda cfg: (_ for _ in ()).throw(SystemExit(3)))
    with pytest.raises(SystemExit):
        main([str(config_file)])


def test_a_decay_that_does_not_fit_the_run_is_refused_before_training():
    wsd = "scheduler.name=warmup_stable_decay"
    assert re.match(r"scheduler\.t_decay: 3ep must be in max_duration's unit", refused(wsd, "scheduler.t_decay=3ep"))
    assert re.match(r"scheduler\.t_decay: 100000ba must be", refused(wsd, "scheduler.t_decay=100000ba"))
    duration = int(BASE["max_duration"].removesuffix("ba"))
    assert "overlap" in refused(wsd, f"scheduler.t_warmup={duration - 1}ba", "scheduler.t_decay=2ba")
    load_train_config(with_overrides(wsd, "scheduler.t_decay=0.3dur"))
