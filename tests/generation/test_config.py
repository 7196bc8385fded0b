"""GenerationConfig: every option checked once when built (NaN and infinities refused by name), the
greedy-ignores-sampling warning of transformers, JSON files both ways with transformers, and the
model defaults that generate, from_pretrained and save_pretrained use."""

import dataclasses
import json
import math
import warnings

import pytest
import torch

import llm
from llm import GenerationConfig, MosaicGPT
from llm.generation.config import GENERATION_DEFAULTS, load_generation_config
from tests.conftest import tiny_model

FLOATS = ["temperature", "top_p", "min_p", "repetition_penalty"]


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinities_are_refused_for_every_float_option(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be .*, got {value!r}$"):
        GenerationConfig(do_sample=True, **{name: value})


@pytest.mark.parametrize("name, value, allowed", [
    ("max_new_tokens", 0, "an integer >= 1"),
    ("max_new_tokens", 2.0, "an integer >= 1"),
    ("max_new_tokens", True, "an integer >= 1"),
    ("temperature", -0.5, r"a finite number >= 0 \(0: greedy\)"),
    ("temperature", "0.7", r"a finite number >= 0 \(0: greedy\)"),
    ("top_k", -1, r"an integer >= 0 \(0 or None: no top-k\)"),
    ("top_k", 1.5, r"an integer >= 0 \(0 or None: no top-k\)"),
    ("top_p", 0.0, r"a number in \(0, 1\]"),
    ("top_p", 1.5, r"a number in \(0, 1\]"),
    ("min_p", -0.1, r"a number in \[0, 1\]"),
    ("min_p", 2.0, r"a number in \[0, 1\]"),
    ("repetition_penalty", 0.0, r"a finite number > 0 \(1.0: no penalty\)"),
    ("pad_token_id", -1, "an integer >= 0"),
    ("seed", -1, r"an integer in \[0, 2\*\*64\)"),
    ("seed", 2**64, r"an integer in \[0, 2\*\*64\)"),
    ("prompt_lookup_num_tokens", 0, "an integer >= 1"),
    ("max_matching_ngram_size", 0, "an integer >= 1"),
    ("num_assistant_tokens", 0, "an integer >= 1"),
    ("do_sample", "yes", "True or False"),
    ("return_dict_in_generate", 1, "True or False"),
])
def test_each_range_is_named_with_the_value(name, value, allowed):
    with pytest.raises(ValueError, match=rf"^{name} must be {allowed}, got {value!r}$"):
        GenerationConfig(**{"do_sample": True, name: value})


@pytest.mark.parametrize("kwargs, message", [
    (dict(eos_token_id=[]), "eos_token_id must be a token id >= 0 or a non-empty list"),
    (dict(eos_token_id=[1, -2]), "eos_token_id must be"),
    (dict(stop_strings=""), "stop_strings must be a non-empty string"),
    (dict(stop_strings=["a", ""]), "stop_strings must be"),
    (dict(num_assistant_tokens_schedule="adaptive"), "num_assistant_tokens_schedule must be 'heuristic' or 'constant'"),
])
def test_impossible_values_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)


def test_edges_of_the_ranges_are_accepted_and_values_normalised():
    config = GenerationConfig(do_sample=True, temperature=None, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1,
                              eos_token_id=[2, 3], stop_strings="\n\n", seed=2**64 - 1)
    assert config.temperature == 1.0 and isinstance(config.repetition_penalty, float)
    assert config.eos_token_id == (2, 3) and config.stop_strings == ("\n\n",)
    assert GenerationConfig(temperature=0.0).greedy and GenerationConfig(do_sample=True, temperature=0.0).greedy


def test_a_config_is_frozen_and_update_returns_a_new_validated_one():
    config = GenerationConfig(max_new_tokens=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.temperature = math.nan
    other = config.update(do_sample=True, temperature=0.5)
    assert (config.do_sample, config.temperature) == (False, 1.0)
    assert (other.max_new_tokens, other.do_sample, other.temperature) == (5, True, 0.5)
    with pytest.raises(ValueError, match="repetition_penalty must be"):
        config.update(repetition_penalty=math.nan)
    with pytest.raises(TypeError, match="unknown generation option 'temprature' .did you mean 'temperature'"):
        config.update(temprature=0.5)


def test_greedy_decoding_with_sampling_options_warns_naming_them():
    with pytest.warns(UserWarning, match=r"greedy \(do_sample=False\).*ignored: temperature=0.7, top_k=5, top_p=0.9, "
                                         r"min_p=0.1"):
        GenerationConfig(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)
    with pytest.warns(UserWarning, match=r"greedy \(temperature=0\).*ignored: top_k=5"):
        GenerationConfig(do_sample=True, temperature=0, top_k=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GenerationConfig()  # the defaults
        GenerationConfig(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.3)  # nothing ignored
        sampling = GenerationConfig(do_sample=True, temperature=0.2, top_p=0.9)
        # a call asking for greedy decoding is not told that the base's sampling settings wait unused
        greedy = sampling.update(do_sample=False, max_new_tokens=3)
    assert greedy.ignored_sampling_options() == {"temperature": 0.2, "top_p": 0.9}
    with pytest.warns(UserWarning, match="ignored: top_k=4$|ignored: top_k=4;"):
        greedy.update(top_k=4)


def test_dict_and_json_round_trip(tmp_path):
    config = GenerationConfig(max_new_tokens=7, do_sample=True, temperature=0.6, top_k=40, top_p=0.9, min_p=0.05,
                              repetition_penalty=1.1, eos_token_id=[1, 2], pad_token_id=0, stop_strings=["\n\n"],
                              seed=3, prompt_lookup_num_tokens=4, max_matching_ngram_size=3, num_assistant_tokens=6,
                              num_assistant_tokens_schedule="constant", return_dict_in_generate=True)
    assert GenerationConfig.from_dict(config.to_dict()) == config
    json.dumps(config.to_dict())  # JSON-ready
    path = tmp_path / llm.generation.GENERATION_CONFIG_FILE
    config.to_json_file(path)
    assert path.name == "generation_config.json" and GenerationConfig.from_json_file(path) == config


def test_files_are_exchanged_with_transformers(tmp_path):
    from transformers import GenerationConfig as HFConfig

    ours = GenerationConfig(max_new_tokens=9, do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=[1, 2])
    ours.to_json_file(tmp_path / "generation_config.json")
    theirs = HFConfig.from_pretrained(tmp_path)
    assert (theirs.max_new_tokens, theirs.do_sample, theirs.temperature, theirs.top_p, theirs.eos_token_id) == (
        9, True, 0.6, 0.9, [1, 2])
    assert theirs.top_k in (None, 0)  # no top-k there either (transformers' default would be 50)

    HFConfig(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=[1, 2], bos_token_id=1).save_pretrained(
        tmp_path / "hf")
    back = GenerationConfig.from_json_file(tmp_path / "hf" / "generation_config.json")
    assert (back.do_sample, back.temperature, back.top_p, back.eos_token_id) == (True, 0.6, 0.9, (1, 2))
    assert back.top_k == 50  # transformers' default where its file says nothing: the same sampling

    HFConfig(eos_token_id=2).save_pretrained(tmp_path / "greedy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no top_k=50 to warn about when greedy
        assert GenerationConfig.from_json_file(tmp_path / "greedy" / "generation_config.json") == GenerationConfig(
            eos_token_id=2)

    HFConfig(num_beams=4).save_pretrained(tmp_path / "beams")
    with pytest.raises(ValueError, match="generation_config.json: generation option num_beams=4 is not supported"):
        GenerationConfig.from_json_file(tmp_path / "beams" / "generation_config.json")
    (tmp_path / "bad.json").write_text('{"temperature": NaN}')
    with pytest.raises(ValueError, match=r"bad.json: temperature must be .*, got nan"):
        GenerationConfig.from_json_file(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json: not a JSON generation config"):
        GenerationConfig.from_json_file(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="unknown generation option 'temprature'"):
        GenerationConfig.from_dict({"temprature": 0.5})


@torch.no_grad()
def test_generate_takes_a_config_plus_overrides_and_defaults_to_the_models():
    model = tiny_model()
    ids = torch.randint(0, 61, (2, 5))
    config = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=10, seed=4)
    by_config = llm.generate(model, ids, generation_config=config)
    assert torch.equal(by_config, model.generate(ids, max_new_tokens=6, do_sample=True, top_k=10, seed=4))
    assert torch.equal(model.generate(ids, generation_config=config, seed=5),
                       model.generate(ids, max_new_tokens=6, do_sample=True, top_k=10, seed=5))
    model.generation_config = config
    assert torch.equal(model.generate(ids), by_config)
    assert torch.equal(torch.cat(list(model.stream(ids)), dim=1), by_config[:, 5:])
    with pytest.raises(TypeError, match="generation_config must be an llm.GenerationConfig, got dict"):
        model.generate(ids, generation_config={"max_new_tokens": 3})
    with pytest.raises(TypeError, match="unknown generation option 'max_length'"):
        model.generate(ids, max_length=3)


@pytest.mark.parametrize("entry", ["generate", "stream", "model.generate"])
@pytest.mark.parametrize("option, value", [("temperature", math.nan), ("repetition_penalty", math.nan),
                                           ("top_p", math.inf), ("temperature", math.inf)])
def test_nan_options_are_refused_by_every_entry_point(entry, option, value):
    """Before: temperature=nan decoded greedily and repetition_penalty=nan repeated one token."""
    model = tiny_model()
    ids = torch.randint(0, 61, (1, 4))
    call = {"generate": lambda **kw: llm.generate(model, ids, **kw),
            "stream": lambda **kw: list(llm.stream(model, ids, **kw)),
            "model.generate": lambda **kw: model.generate(ids, **kw)}[entry]
    with pytest.raises(ValueError, match=f"{option} must be .*, got {value}"):
        call(do_sample=True, max_new_tokens=4, **{option: value})


def test_save_pretrained_writes_the_generation_config_and_from_pretrained_reads_it(tmp_path):
    model = tiny_model()
    assert model.generation_config == GenerationConfig()
    model.save_pretrained(tmp_path)
    assert not (tmp_path / "generation_config.json").exists()  # all defaults: no file
    assert load_generation_config(tmp_path) is None

    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, eos_token_id=3)
    model.save_pretrained(tmp_path, generation_config=config)
    loaded = MosaicGPT.from_pretrained(tmp_path)
    assert loaded.generation_config == config == load_generation_config(tmp_path)
    loaded.save_pretrained(tmp_path / "again")  # the model's own config travels with it
    assert MosaicGPT.from_pretrained(tmp_path / "again").generation_config == config

    model.save_pretrained(tmp_path)  # defaults again: the older file must not outlive them
    assert MosaicGPT.from_pretrained(tmp_path).generation_config == GenerationConfig()
    (tmp_path / "generation_config.json").write_text('{"top_p": 2}')
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be a number in \(0, 1\], got 2"):
        MosaicGPT.from_pretrained(tmp_path)


def test_registered_models_recommended_settings_are_their_generation_config():
    smollm2 = GENERATION_DEFAULTS["smollm2-135m-instruct"]
    assert (smollm2.do_sample, smollm2.temperature, smollm2.top_p) == (True, 0.2, 0.9)
    assert load_generation_config("smollm2-135m-instruct") == smollm2  # by name, without the file
    assert load_generation_config("runs/no-such-model") is None
