"""The training and evaluation configurations: OmegaConf structured configs (dataclasses, as
llm-foundry's), validated once, before any work.

:func:`load_train_config` turns an llm-foundry-style YAML config (a mapping, or an omegaconf
``DictConfig`` with the command line's ``key=value`` overrides merged in) into a
:class:`TrainConfig`; :func:`load_eval_config` gives an :class:`EvalConfig` for
``scripts/eval.py``. Both refuse, with a :class:`~llm.utils.config.ConfigError` whose message
starts with the full dotted path of the key (``train_loader.dataset.splt: unknown key; allowed
keys: [...]``), any unknown key at any depth, a missing required key, a value of the wrong type
and a value out of range (the ranges are each field's ``check``); see :mod:`llm.utils.config`
for the type rules.

The sections (field names are the YAML keys):

* ``model``: :class:`llm.config.MosaicGPTConfig` options, validated by it (errors as
  ``model.<key>: ...``) and kept as a dict with its defaults filled in. ``vocab_size`` may be
  given; by default it is the tokenizer's size (compared with the tokenizer when the run starts,
  not here). Exclusive with ``load_pretrained`` (a bundle directory, a .gguf file or a
  registered name to start from); one of the two is required for training.
* ``tokenizer``: optional :class:`TokenizerConfig` ``{name: ...}``, which must match the data's
  tokenizer (checked when the data is opened); by default the data's own tokenizer is used.
* ``train_loader`` / ``eval_loader``: :class:`LoaderConfig`, llm-foundry's shape:
  ``name: text`` with a :class:`StreamingDatasetConfig` (MosaicML Streaming shards written by
  ``scripts/prepare_data.py``), or ``name: finetuning`` with a :class:`FinetuneDatasetConfig`.
* ``optimizer`` (:class:`OptimizerConfig`), ``scheduler`` (:class:`SchedulerConfig`),
  ``algorithms`` (:class:`AlgorithmsConfig`), ``parallelism_config``
  (:class:`ParallelismConfig`, Composer's FSDP options).
* Composer ``Trainer`` settings and the samples printed after training: see :class:`RunConfig`.

``TrainConfig.to_dict()`` is the resolved configuration (every default filled in, splits,
``drop_last``, ``shuffle_seed``, ``device_eval_batch_size`` and the scheduler's ``alpha_f``
resolved) as plain dicts and lists: what the run folder's ``config.yaml`` holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from llm.utils.config import (
    ConfigError,
    at_least,
    each,
    from_dict,
    in_range,
    non_empty,
    non_negative,
    one_of,
    positive,
    setting,
    to_dict,
)

__all__ = [
    "AlgorithmsConfig",
    "ConfigError",
    "EvalConfig",
    "FinetuneDatasetConfig",
    "GradientClippingConfig",
    "LoaderConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "RunConfig",
    "SchedulerConfig",
    "StreamConfig",
    "StreamingDatasetConfig",
    "TokenizerConfig",
    "TrainConfig",
    "load_eval_config",
    "load_train_config",
    "validate_model_section",
]

# ------------------------------------------------------------------------ Composer time strings

_UNIT_NAMES = {"ba": "batches", "ep": "epochs", "sp": "samples", "tok": "tokens", "dur": "fraction of max_duration"}
#: Units of ``max_duration`` (``dur`` is relative to max_duration itself).
DURATION_UNITS = ("ba", "ep", "sp", "tok")
#: Units of ``eval_interval`` and ``save_interval`` (Composer's interval schedulers).
INTERVAL_UNITS = ("ba", "ep", "sp", "tok", "dur")
#: Units of ``console_log_interval`` (Composer's console logger takes batches or epochs only).
LOG_INTERVAL_UNITS = ("ba", "ep")
#: Units of the scheduler's ``t_warmup`` and ``t_max``.
SCHEDULER_UNITS = ("ba", "ep", "sp", "tok", "dur")


def _units(units: tuple[str, ...]) -> str:
    return ", ".join(f"{u} ({_UNIT_NAMES[u]})" for u in units)


def parse_time(value: str):
    """``composer.core.Time`` of a time string such as ``"700ba"``, or a message saying what is wrong."""
    from composer.core import Time

    try:
        return Time.from_timestring(value)
    except (ValueError, TypeError) as e:
        return str(e)


def time_check(units: tuple[str, ...], *, allow_zero: bool = False, example: str = "100ba"):
    """A check for a Composer time string: parses, has one of ``units``, and is > 0 (>= 0 with
    ``allow_zero``); ``dur`` values (fractions of the run) must also be at most 1.

    Ints are left to the field's own rule (see ``max_duration`` and ``eval_interval``); None passes.
    """

    def check(value: Any) -> str | None:
        if not isinstance(value, str):
            return None
        time = parse_time(value)
        if isinstance(time, str):
            return (f"expected a Composer time string: an integer and a unit, one of {_units(units)} "
                    f"(e.g. {example!r}), got {value!r}")
        unit = time.unit.value
        if unit not in units:
            return f"unit {unit!r} is not allowed here; use one of {_units(units)} (e.g. {example!r}), got {value!r}"
        if time.value < 0 or (time.value == 0 and not allow_zero):
            return f"must be {'>=' if allow_zero else '>'} 0, got {value!r}"
        if unit == "dur" and time.value > 1:
            return f"a fraction of the run (dur) must be at most 1, got {value!r}"
        return None

    return check


def _max_duration_check(value: Any) -> str | None:
    if isinstance(value, int):
        return (f"give a unit: e.g. '{value}ep' ({value} epochs) or '{value}ba' ({value} batches); "
                f"allowed units: {_units(DURATION_UNITS)}")
    return time_check(DURATION_UNITS, example="700ba")(value)


def _interval_check(value: Any) -> str | None:
    if isinstance(value, int):  # Composer reads an int as epochs
        return positive(value)
    return time_check(INTERVAL_UNITS)(value)


def _microbatch_check(value: Any) -> str | None:
    if isinstance(value, str) and value != "auto":
        return f"expected an int, 'auto' or null, got {value!r} (str)"
    return positive(value)


def _eval_subset_check(value: Any) -> str | None:
    if isinstance(value, int) and value != -1 and value < 1:
        return f"must be -1 (the whole eval split) or > 0, got {value!r}"
    return None


# ----------------------------------------------------------------------------------- model


def validate_model_section(model: Mapping[str, Any], path: str = "model") -> dict[str, Any]:
    """The ``model`` section checked as :class:`llm.config.MosaicGPTConfig` options, defaults filled in.

    ``vocab_size`` is optional: when absent, a stand-in checks the other options and the result
    has no ``vocab_size`` (the run takes the tokenizer's size).

    Raises:
        ConfigError: ``model.<key>: ...`` for an unknown key, a wrong type or a bad value.
    """
    from llm.config import MosaicGPTConfig

    if not isinstance(model, Mapping):
        raise ConfigError(path, f"expected a mapping of model options, got {model!r}")
    given_vocab = "vocab_size" in model
    options = dict(model) if given_vocab else {**model, "vocab_size": 1}
    config = from_dict(MosaicGPTConfig, options, path)
    resolved = config.to_dict()
    if not given_vocab:
        del resolved["vocab_size"]
    return resolved


# ----------------------------------------------------------------------------------- sections

@dataclass(kw_only=True)
class TokenizerConfig:
    """The tokenizer the run expects: its ``name`` (a tokenizer folder or file, a bundle or a
    registered name) must be the one the data was prepared with (checked when the data is opened).
    """

    name: str = setting(check=non_empty)


def _stream_weights(stream: Any) -> list[str]:
    return [key for key in ("proportion", "repeat", "choose") if getattr(stream, key) is not None]


@dataclass(kw_only=True)
class StreamConfig:
    """One source of a mixture (MosaicML Streaming's ``Stream``): where its shards are and its weight.

    At most one of ``proportion`` (relative), ``repeat`` (times over) and ``choose`` (samples per
    epoch) may be given; without any, the stream is read once per epoch.
    """

    local: str | None = None
    remote: str | None = None
    split: str | None = None
    proportion: float | None = setting(None, check=positive)
    repeat: float | None = setting(None, check=positive)
    choose: int | None = setting(None, check=positive)

    def __post_init__(self) -> None:
        if not (self.local or self.remote):
            raise ConfigError("", "a stream needs local (a folder of prepared shards) and/or remote "
                                  "(an object store URL, cached in local)")
        given = _stream_weights(self)
        if len(given) > 1:
            raise ConfigError(given[1], "give at most one of proportion, repeat and choose "
                                        f"(got {' and '.join(given)})")


@dataclass(kw_only=True)
class StreamingDatasetConfig:
    """A ``name: text`` loader's dataset: MosaicML Streaming's options, as llm-foundry's text loader takes them.

    Exactly one of: ``local`` (a folder of prepared shards), ``remote`` (an object store URL;
    ``local`` is then its cache folder, a temporary one if absent), or ``streams`` (a named
    mixture of :class:`StreamConfig`, either all weighted by ``proportion`` or none).
    ``split`` is the split folder (default: ``train`` for the train loader, ``validation`` for the
    eval loader; for ``streams``, the default of those without their own). ``shuffle_seed``
    defaults to the run's ``seed``.
    """

    local: str | None = None
    remote: str | None = None
    split: str | None = None
    streams: dict[str, StreamConfig] | None = None
    shuffle: bool = False
    shuffle_seed: int | None = setting(None, check=in_range(0, 2**32 - 1))
    shuffle_algo: str = setting("py1e", check=one_of("naive", "py1b", "py1br", "py1e", "py1s", "py2s"))
    shuffle_block_size: int | None = setting(None, check=positive)
    num_canonical_nodes: int | None = setting(None, check=positive)
    predownload: int | None = setting(None, check=positive)
    cache_limit: str | int | None = setting(None, check=lambda v: _cache_limit_check(v))
    sampling_method: str = setting("balanced", check=one_of("balanced", "fixed"))
    sampling_granularity: int = setting(1, check=positive)
    batching_method: str = setting("random",
                                   check=one_of("random", "stratified", "per_stream", "device_per_stream"))
    download_retry: int = setting(2, check=non_negative)
    download_timeout: float = setting(60.0, check=positive)
    validate_hash: str | None = setting(None, check=lambda v: _hash_check(v))
    keep_zip: bool = False


    def __post_init__(self) -> None:
        single = self.local is not None or self.remote is not None
        if self.streams is not None and single:
            key = "local" if self.local is not None else "remote"
            raise ConfigError(key, "give either streams or local/remote, not both "
                                   "(MosaicML Streaming takes one or the other)")
        if self.streams is None and not single:
            raise ConfigError("", "give local (a folder of shards prepared by scripts/prepare_data.py), "
                                  "remote (an object store URL, with local as its cache) or streams (a mixture)")
        if self.streams is not None:
            if not self.streams:
                raise ConfigError("streams", "give at least one stream")
            names = list(self.streams)
            proportional = [name for name in names if self.streams[name].proportion is not None]
            if proportional and len(proportional) != len(names):
                other = next(name for name in names if name not in proportional)
                raise ConfigError(
                    f"streams.{other}",
                    f"either every stream gives a proportion or none does (stream {proportional[0]!r} "
                    f"has one, {other!r} has {' '.join(_stream_weights(self.streams[other])) or 'none'}): "
                    "MosaicML Streaming cannot mix relative (proportion) and absolute (repeat, choose) weights",
                )


def _cache_limit_check(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, int):
        return positive(value)
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*[kmgtpezy]?b\s*", value, re.IGNORECASE):
        return f"expected a number of bytes such as '10gb' or 1000000, got {value!r}"
    return None


def _hash_check(value: Any) -> str | None:
    if value is None:
        return None
    try:
        from streaming.base.hashing import get_hashes

        allowed = sorted(get_hashes())
    except ImportError:  # pragma: no cover - streaming is a dependency
        return None
    return None if value in allowed else f"expected one of {allowed}, got {value!r}"


@dataclass(kw_only=True)
class FinetuneDatasetConfig:
    """A ``name: finetuning`` loader's dataset: a JSONL file of ``{"prompt", "response"}`` lines.

    The loss is on the responses only; batches are padded on ``padding_side``. ``chat_template``:
    ``auto`` renders examples as a user turn and the assistant's reply with the tokenizer's chat
    template, or ChatML where it has none (the exported bundle carries it, and stops at its
    end-of-turn token); ``chatml`` always ChatML; ``none`` trains on prompt + response + eos
    (:func:`llm.data.finetune.use_chat_template`).
    """

    path: str = setting(check=non_empty)
    padding_side: str = setting("right", check=one_of("left", "right"))
    shuffle: bool = False
    chat_template: str = setting("auto", check=one_of("auto", "chatml", "none"))


DATASET_SCHEMAS: dict[str, type] = {"text": StreamingDatasetConfig, "finetuning": FinetuneDatasetConfig}


@dataclass(kw_only=True)
class LoaderConfig:
    """``train_loader`` / ``eval_loader``: llm-foundry's loader shape.

    ``name`` picks ``dataset``'s schema (``text``: :class:`StreamingDatasetConfig`;
    ``finetuning``: :class:`FinetuneDatasetConfig`); the other keys are torch ``DataLoader``
    options. ``drop_last`` defaults to true for the train loader, false for the eval loader.
    """

    name: str = setting("text", check=one_of("text", "finetuning"))
    dataset: Any = setting()  # StreamingDatasetConfig or FinetuneDatasetConfig, by name
    drop_last: bool | None = None
    num_workers: int = setting(0, check=non_negative)
    pin_memory: bool = False
    prefetch_factor: int | None = setting(None, check=positive)
    persistent_workers: bool = False
    timeout: float = setting(0.0, check=non_negative)


    @classmethod
    def config_field_types(cls, data: Mapping[str, Any]) -> dict[str, type]:
        """``dataset``'s schema from ``name`` (an unknown name is reported by the ``name`` field)."""
        return {"dataset": DATASET_SCHEMAS.get(data.get("name", "text"), StreamingDatasetConfig)}

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, DATASET_SCHEMAS[self.name]):  # built directly, not by from_dict
            raise ConfigError("dataset", f"a {self.name!r} loader needs a {DATASET_SCHEMAS[self.name].__name__}")
        if self.num_workers == 0:
            for key in ("prefetch_factor", "persistent_workers"):
                if getattr(self, key) not in (None, False):
                    raise ConfigError(key, "needs num_workers > 0 (torch's DataLoader has no worker processes "
                                           "to prefetch with or keep)")

    def resolve(self, *, train: bool, seed: int) -> None:
        """Fill the defaults that depend on the loader's role and the run's seed."""
        if self.drop_last is None:
            self.drop_last = train
        if isinstance(self.dataset, StreamingDatasetConfig):
            if self.dataset.split is None:
                self.dataset.split = "train" if train else "validation"
            if self.dataset.shuffle_seed is None:
                self.dataset.shuffle_seed = seed


#: The keys only ``optimizer.name: muon`` takes.
MUON_KEYS = ("momentum", "nesterov", "ns_steps", "adamw_lr")


@dataclass(kw_only=True)
class OptimizerConfig:
    """``optimizer``: ``decoupled_adamw`` (Composer's ``DecoupledAdamW``), ``adamw`` (torch's) or
    ``muon`` (:class:`llm.train.muon.Muon`: Muon at ``lr`` for the blocks' matrices, AdamW at
    ``adamw_lr`` with ``betas`` and ``eps`` for the rest).

    Defaults are ``DecoupledAdamW``'s, for all. Decoupled weight decay multiplies the weights by
    ``1 - weight_decay * lr / lr_0`` every step, ``adamw`` and ``muon`` by ``1 - lr * weight_decay``
    (each group its own ``lr``): ``decoupled_adamw``'s value is about ``lr`` times theirs.
    ``momentum``, ``nesterov``, ``ns_steps`` and ``adamw_lr`` are ``muon``'s only (defaults 0.95,
    true, 5 and 3e-3).
    """

    name: str = setting(check=one_of("decoupled_adamw", "adamw", "muon"))
    lr: float = setting(1.0e-3, check=positive)
    betas: tuple[float, float] = setting((0.9, 0.95), check=each(in_range(0, 1, hi_inclusive=False)))
    eps: float = setting(1.0e-8, check=positive)
    weight_decay: float = setting(1.0e-5, check=non_negative)
    #: which parameters weight_decay applies to: ``matrices`` (every parameter of 2 or more
    #: dimensions: the projections and the embeddings; not norms or biases), as nanoGPT's
    #: ``configure_optimizers``; or ``all``
    decay: str = setting("matrices", check=one_of("matrices", "all"))
    momentum: float | None = setting(None, check=in_range(0, 1, hi_inclusive=False))
    nesterov: bool | None = None
    ns_steps: int | None = setting(None, check=at_least(1))
    adamw_lr: float | None = setting(None, check=positive)

    config_omit_none: ClassVar[bool] = True  # to_dict: no muon keys for the AdamWs

    def __post_init__(self) -> None:
        if self.name != "muon":
            for key in MUON_KEYS:
                if getattr(self, key) is not None:
                    raise ConfigError(key, f"is an option of optimizer muon only, not of {self.name}")
            return
        if self.decay != "matrices":
            raise ConfigError("decay", "muon decays the matrices only: remove decay or set it to matrices")
        for key, default in zip(MUON_KEYS, (0.95, True, 5, 3.0e-3)):
            if getattr(self, key) is None:
                setattr(self, key, default)


@dataclass(kw_only=True)
class SchedulerConfig:
    """``scheduler``: Composer's ``*WithWarmupScheduler`` by name.

    ``t_warmup`` and ``t_max`` are Composer time strings (``t_max`` ``1dur``: the whole run;
    ``t_warmup`` may be a fraction of it, ``0.05dur``). ``alpha_f`` (the final learning-rate
    multiplier) defaults to 0 for ``cosine_with_warmup``, ``linear_with_warmup`` and
    ``warmup_stable_decay``; ``constant_with_warmup`` has none (it is left out of ``to_dict()``, so
    every key there is an option of the named scheduler). ``warmup_stable_decay``
    (:class:`llm.train.schedule.WarmupStableDecayScheduler`) takes ``t_decay`` (default
    ``0.3dur``: a linear cool-down over the last 30% of the run) instead of ``t_max``.
    """

    name: str = setting(check=one_of("cosine_with_warmup", "constant_with_warmup", "linear_with_warmup",
                                     "warmup_stable_decay"))
    t_warmup: str = setting(check=time_check(SCHEDULER_UNITS, allow_zero=True, example="100ba"))
    alpha_f: float | None = setting(None, check=in_range(0, 1))
    t_max: str | None = setting(None, check=time_check(SCHEDULER_UNITS, example="1dur"))
    t_decay: str | None = setting(None, check=time_check(SCHEDULER_UNITS, allow_zero=True, example="0.3dur"))

    config_omit_none: ClassVar[bool] = True  # to_dict: no alpha_f for constant_with_warmup

    def __post_init__(self) -> None:
        if self.name == "warmup_stable_decay":
            if self.t_max is not None:
                raise ConfigError("t_max", "warmup_stable_decay decays over the run's last t_decay: use t_decay")
            self.t_decay = self.t_decay if self.t_decay is not None else "0.3dur"
        elif self.t_decay is not None:
            raise ConfigError("t_decay", f"is an option of warmup_stable_decay only, not of {self.name}")
        else:
            self.t_max = self.t_max if self.t_max is not None else "1dur"
        if self.name == "constant_with_warmup":
            if self.alpha_f is not None:
                raise ConfigError("alpha_f", "constant_with_warmup has no final multiplier: remove alpha_f")
        elif self.alpha_f is None:
            self.alpha_f = 0.0
        span = "t_decay" if self.name == "warmup_stable_decay" else "t_max"
        warmup, length = parse_time(self.t_warmup), parse_time(getattr(self, span))
        if isinstance(warmup, str) or isinstance(length, str):
            bad = "t_warmup" if isinstance(warmup, str) else span
            raise ConfigError(bad, f"expected a Composer time string, got {getattr(self, bad)!r}")
        if span == "t_max" and warmup.unit == length.unit and warmup.value > length.value:
            raise ConfigError("t_warmup", f"{self.t_warmup} is longer than t_max {self.t_max}")
        if span == "t_decay" and warmup.unit.value == length.unit.value == "dur" and warmup.value + length.value > 1:
            raise ConfigError("t_decay", f"warmup {self.t_warmup} and decay {self.t_decay} overlap (more than 1dur)")


@dataclass(kw_only=True)
class GradientClippingConfig:
    """Composer's ``GradientClipping`` algorithm."""

    clipping_type: str = setting(check=one_of("norm", "value", "adaptive"))
    clipping_threshold: float = setting(check=positive)


@dataclass(kw_only=True)
class AlgorithmsConfig:
    """``algorithms``: Composer algorithms by name (those not given are off)."""

    gradient_clipping: GradientClippingConfig | None = None

    config_omit_none: ClassVar[bool] = True  # to_dict: only the algorithms that are on


def _fsdp_options() -> dict[str, Any]:
    """Composer's ``FSDPConfig`` fields that a config may set, by name, with their annotations."""
    import dataclasses

    from composer.utils.parallelism import FSDPConfig

    return {f.name: f.type for f in dataclasses.fields(FSDPConfig) if not f.name.startswith("_")}


def _fsdp_choices() -> dict[str, list[str]]:
    from composer.distributed.mosaic_parallelism import BACKWARD_PREFETCH_MAP, SHARDING_MAP

    return {"sharding_strategy": sorted(SHARDING_MAP), "backward_prefetch": sorted(BACKWARD_PREFETCH_MAP),
            "mixed_precision": ["DEFAULT", "FULL", "PURE"]}


def _compile_backend(value: Any) -> str | None:
    """Check: a backend ``torch.compile`` knows (``torch._dynamo.list_backends``, its debugging ones
    included), so that a misspelt one is a config error rather than a traceback at the first batch."""
    if not isinstance(value, str) or value in ("", "inductor"):
        return non_empty(value)
    from torch._dynamo import list_backends

    if value in list_backends(exclude_tags=()):
        return None
    return f"expected a torch.compile backend ({', '.join(sorted({*list_backends(), 'eager', 'aot_eager'}))}), got {value!r}"


@dataclass(kw_only=True)
class CompileConfig:
    """``compile_config``: Composer's, the options of ``torch.compile`` for the training model
    (``{}``: torch's defaults)."""

    backend: str = setting("inductor", check=_compile_backend)
    mode: str | None = setting(None, check=one_of("default", "reduce-overhead", "max-autotune",
                                                  "max-autotune-no-cudagraphs"))
    fullgraph: bool = False
    dynamic: bool | None = None


@dataclass(kw_only=True)
class ParallelismConfig:
    """``parallelism_config``: Composer's, ``{fsdp: {...}}`` with the keys of
    ``composer.utils.parallelism.FSDPConfig`` (values passed through; simple types and the
    sharding / prefetch / mixed-precision names are checked).
    """

    fsdp: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.fsdp is None:
            return
        options = _fsdp_options()
        simple = {bool: "a bool (true or false)", int: "an int", str: "a str"}
        for key, value in self.fsdp.items():
            path = f"fsdp.{key}"
            if key not in options:
                raise ConfigError(path, f"unknown FSDP option; allowed keys: {sorted(options)}")
            annotation = options[key]
            if annotation in simple and not (
                isinstance(value, annotation) and (annotation is bool or not isinstance(value, bool))
            ):
                if not (key == "mixed_precision" and isinstance(value, dict)):  # Composer also takes a dict
                    raise ConfigError(path, f"expected {simple[annotation]}, got {value!r}")
            choices = _fsdp_choices().get(key)
            if choices and isinstance(value, str) and value.upper() not in choices:
                raise ConfigError(path, f"expected one of {choices}, got {value!r}")


# ----------------------------------------------------------------------------------- top level

_SEED_CHECK = in_range(0, 2**32 - 1)
# A newline is a token of every byte-level or character vocabulary and starts a fresh line of any
# corpus, so the default samples show what the model writes unprompted, whatever it was trained on.
DEFAULT_SAMPLE_PROMPTS = ("\n",)


@dataclass(kw_only=True)
class RunConfig:
    """What training and evaluation configs share: every key, none required.

    :class:`TrainConfig` makes the training keys required; :class:`EvalConfig` adds evaluation's.
    The scalar keys are Composer ``Trainer`` settings (time strings such as ``700ba``, ``2ep``):

    * ``max_duration``: units ba, ep, sp, tok, > 0. ``eval_interval``, ``save_interval``: units ba,
      ep, sp, tok or dur (a fraction of the run), > 0 (an int ``eval_interval`` is epochs).
      ``console_log_interval``: ba or ep. ``eval_subset_num_batches``: -1 (all) or > 0, for the
      evaluations during training (the final one reads every batch).
    * ``global_train_batch_size`` (> 0, over all ranks), ``device_train_microbatch_size`` (> 0,
      ``auto``, or null: the whole per-rank batch), ``device_eval_batch_size`` (> 0; default:
      ``global_train_batch_size`` in training), ``precision`` (null: Composer's choice;
      ``amp_bf16`` on a CPU, which Composer refuses there, autocasts the forward to bfloat16
      around fp32 weights, optimizer state and loss; on a CPU without native bfloat16 it runs as
      fp32, saying so), ``compile_config`` (:class:`CompileConfig`, null: no compiling).
    * ``progress_bar`` (a bar on a terminal; where the output is not a terminal, one console line
      per ``console_log_interval`` instead), ``log_to_console``, ``console_log_interval``.
    * ``seed`` (0 to 2**32 - 1), ``save_folder`` (the run folder), ``save_num_checkpoints_to_keep``
      (-1: all), ``load_path``, ``autoresume``, ``run_name`` (default: the name of save_folder).
      ``allow_config_change``: resume a run folder under settings that differ from its
      ``config.yaml`` (refused by default; see :mod:`llm.train.run_folder`).
    * Samples printed after training: ``num_samples`` (>= 0), ``sample_prompts`` (non-empty when
      num_samples > 0), ``sample_max_new_tokens`` (> 0), ``sample_temperature`` (>= 0; 0 is
      greedy), ``sample_top_k`` (> 0, or null for none).
    """

    model: dict[str, Any] | None = None
    tokenizer: TokenizerConfig | None = None
    load_pretrained: str | None = setting(None, check=non_empty)
    train_loader: LoaderConfig | None = None
    eval_loader: LoaderConfig | None = None
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    algorithms: AlgorithmsConfig = field(default_factory=AlgorithmsConfig)
    parallelism_config: ParallelismConfig | None = None
    compile_config: CompileConfig | None = None
    max_duration: str | int | None = setting(None, check=_max_duration_check)
    eval_interval: str | int = setting("1ep", check=_interval_check)
    eval_subset_num_batches: int = setting(-1, check=_eval_subset_check)
    global_train_batch_size: int | None = setting(None, check=positive)
    device_train_microbatch_size: int | str | None = setting(None, check=lambda v: _microbatch_check(v))
    device_eval_batch_size: int | None = setting(None, check=positive)
    precision: str | None = setting(None, check=one_of("fp32", "amp_fp16", "amp_bf16", "amp_fp8"))
    seed: int = setting(17, check=_SEED_CHECK)
    save_folder: str | None = setting(None, check=non_empty)
    save_interval: str | int = setting("1ep", check=_interval_check)
    save_num_checkpoints_to_keep: int = setting(-1, check=at_least(-1))
    load_path: str | None = None
    autoresume: bool = False
    allow_config_change: bool = False
    run_name: str | None = setting(None, check=non_empty)
    progress_bar: bool = True
    log_to_console: bool = False
    console_log_interval: str = setting("1ba", check=time_check(LOG_INTERVAL_UNITS, example="50ba"))
    num_samples: int = setting(3, check=non_negative)
    sample_prompts: list[str] = field(default_factory=lambda: list(DEFAULT_SAMPLE_PROMPTS))
    sample_max_new_tokens: int = setting(200, check=positive)
    sample_temperature: float = setting(0.8, check=non_negative)
    sample_top_k: int | None = setting(40, check=positive)

    def __post_init__(self) -> None:
        if self.model is not None and self.load_pretrained is not None:
            raise ConfigError("model", "load_pretrained gives the model: remove the model section "
                                       "(or load_pretrained, to train a new model)")
        if self.model is not None:
            self.model = validate_model_section(self.model)
        if self.num_samples > 0 and not self.sample_prompts:
            raise ConfigError("sample_prompts", f"is empty but num_samples is {self.num_samples}: "
                                                "give at least one prompt, or num_samples: 0")
        for loader, train in ((self.train_loader, True), (self.eval_loader, False)):
            if loader is not None:
                loader.resolve(train=train, seed=self.seed)
        if self.scheduler is not None and isinstance(self.max_duration, str):
            warmup, duration = parse_time(self.scheduler.t_warmup), parse_time(self.max_duration)
            if not isinstance(duration, str) and warmup.unit == duration.unit and warmup.value > duration.value:
                raise ConfigError("scheduler.t_warmup", f"{self.scheduler.t_warmup} is longer than "
                                                        f"max_duration {self.max_duration}: shorten it, e.g. "
                                                        f"scheduler.t_warmup=0.1dur (a tenth of the run)")
            if self.scheduler.t_decay is not None and not isinstance(duration, str):
                decay = parse_time(self.scheduler.t_decay)
                if decay.unit.value != "dur" and (decay.unit != duration.unit or decay.value > duration.value):
                    raise ConfigError("scheduler.t_decay", f"{self.scheduler.t_decay} must be in max_duration's unit "
                                                           f"and at most {self.max_duration}, or a fraction of the "
                                                           "run (as 0.3dur)")
                if warmup.unit == decay.unit == duration.unit and warmup.value + decay.value > duration.value:
                    raise ConfigError("scheduler.t_decay", f"warmup {self.scheduler.t_warmup} and decay "
                                                           f"{self.scheduler.t_decay} overlap in {self.max_duration}")

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration as plain dicts and lists (for ``config.yaml``)."""
        return to_dict(self)


@dataclass(kw_only=True)
class TrainConfig(RunConfig):
    """A training run's configuration (see the module docstring and :class:`RunConfig`).

    Required: ``train_loader``, ``eval_loader``, ``optimizer``, ``scheduler``, ``max_duration``,
    ``global_train_batch_size``, ``save_folder``, and ``model`` or ``load_pretrained``.
    """

    # setting(): no default (a bare annotation would inherit RunConfig's None).
    train_loader: LoaderConfig = setting()
    eval_loader: LoaderConfig = setting()
    optimizer: OptimizerConfig = setting()
    scheduler: SchedulerConfig = setting()
    max_duration: str | int = setting(check=_max_duration_check)
    global_train_batch_size: int = setting(check=positive)
    save_folder: str = setting(check=non_empty)

    def __post_init__(self) -> None:
        if self.model is None and self.load_pretrained is None:
            raise ConfigError("model", "missing: give a model section, or load_pretrained (a bundle directory, "
                                       "a .gguf file or a registered name) to start from")
        super().__post_init__()
        if self.device_eval_batch_size is None:
            self.device_eval_batch_size = self.global_train_batch_size


@dataclass(kw_only=True)
class EvalConfig(RunConfig):
    """``scripts/eval.py CONFIG.yaml [key=value ...]``: any training config, plus evaluation's keys.

    Only ``eval_loader`` is required (and, to evaluate a checkpoint, ``model`` or
    ``load_pretrained``: see :func:`load_eval_config`). Evaluation keys:

    * ``eval_seq_len``: tokens per sequence, >= 2 (default: the model's ``max_seq_len``, capped by
      the evaluator; it must not exceed the evaluated model's, which may be a ``--model`` bundle's,
      so that is checked by the evaluator, not here).
    * ``eval_max_sequences``: at most this many sequences per evaluator, > 0 (default: all).

    The results file is the command line's ``--out``.
    """

    eval_loader: LoaderConfig = setting()
    eval_seq_len: int | None = setting(None, check=at_least(2))
    eval_max_sequences: int | None = setting(None, check=positive)



# ----------------------------------------------------------------------------------- loading


def _plain(cfg: Any) -> Any:
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return cfg
    if isinstance(cfg, DictConfig):
        try:
            return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        except Exception as e:  # interpolation / missing value errors, which name the key
            raise ConfigError("", " ".join(str(e).split())) from None
    return cfg


def load_train_config(cfg: Mapping[str, Any] | Any) -> TrainConfig:
    """A validated :class:`TrainConfig` from a mapping or an omegaconf ``DictConfig``.

    Raises:
        ConfigError: for any unknown key, missing key, wrong type or bad value, its message
            starting with the key's full dotted path.
    """
    return from_dict(TrainConfig, _plain(cfg))


def load_eval_config(cfg: Mapping[str, Any] | Any, *, require_model: bool = False) -> EvalConfig:
    """A validated :class:`EvalConfig` from a mapping or an omegaconf ``DictConfig``.

    ``require_model``: the model is built from the config (evaluating a checkpoint, not a bundle
    given with ``--model``), so ``model`` or ``load_pretrained`` must be there.

    Raises:
        ConfigError: as :func:`load_train_config`.
    """
    config = from_dict(EvalConfig, _plain(cfg))
    if require_model and config.model is None and config.load_pretrained is None:
        raise ConfigError("model", "missing: evaluating a checkpoint needs the run's model section (or its "
                                   "load_pretrained); or evaluate an exported bundle with --model DIR")
    return config
