"""scripts/generate.py (llm.generation.cli): completions equal the Python API's, statistics on stderr,
prompt caches on disk, and clean exits on bad input."""

import string

import pytest
import torch

from llm.data import build_char_tokenizer
from llm.generation.cli import main
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tokenizer = build_char_tokenizer(string.ascii_lowercase + " .,\n")
    model = tiny_model("alibi", vocab_size=len(tokenizer))
    path = tmp_path_factory.mktemp("bundle")
    model.save_pretrained(path, tokenizer=tokenizer)
    return path, model, tokenizer


def run(capsys, *argv):
    assert main([str(a) for a in argv]) == 0
    return capsys.readouterr()


def greedy_text(model, tokenizer, text, n):
    ids = tokenizer(text, return_tensors="pt").input_ids
    return text + tokenizer.decode(model.generate(ids, max_new_tokens=n)[0, ids.shape[1]:], skip_special_tokens=True)


def test_batch_of_prompts_equals_the_python_api(bundle, capsys):
    path, model, tokenizer = bundle
    prompts = ["the cat", "a dog sat on", "x"]
    out = run(capsys, "--model", path, *sum([["--prompt", p] for p in prompts], []), "--temperature", 0,
              "--max-new-tokens", 12, "--batch-size", 2)
    expected = [greedy_text(model, tokenizer, p, 12) for p in prompts]
    assert out.out.split("\n\n")[:3] == expected
    assert "prefill:" in out.err and "tokens/s" in out.err


@pytest.mark.parametrize("mode", ["lookup", "lookup-constant", "stream"])
def test_lookup_and_streaming_print_the_greedy_text(bundle, capsys, mode):
    path, model, tokenizer = bundle
    flags = {"lookup": ["--speculative", "lookup"], "stream": ["--stream"],
             "lookup-constant": ["--speculative", "lookup", "--speculative-schedule", "constant"]}[mode]
    out = run(capsys, "--model", path, "--prompt", "the cat sat on the mat. the cat", "--temperature", 0,
              "--max-new-tokens", 20, *flags)
    assert greedy_text(model, tokenizer, "the cat sat on the mat. the cat", 20) in out.out
    if mode.startswith("lookup"):
        assert "accepted" in out.err


def test_system_prompt_cache_file_gives_the_uncached_output(bundle, capsys, tmp_path):
    path, model, tokenizer = bundle
    args = ["--model", path, "--system", "you are a cat. ", "--prompt", "hello", "--prompt", "the mat",
            "--temperature", 0, "--max-new-tokens", 10]
    first = run(capsys, *args, "--prompt-cache", tmp_path / "sys.cache")
    assert (tmp_path / "sys.cache").is_file()
    second = run(capsys, *args, "--prompt-cache", tmp_path / "sys.cache")
    plain = run(capsys, *args)
    assert first.out == second.out == plain.out
    # the prefix and each request are encoded separately, then joined
    ids = tokenizer("you are a cat. ", return_tensors="pt").input_ids
    request = tokenizer("hello", return_tensors="pt").input_ids
    new = model.generate(torch.cat([ids, request], 1), max_new_tokens=10)[0, ids.shape[1] + request.shape[1]:]
    assert "hello" + tokenizer.decode(new, skip_special_tokens=True) in plain.out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "a", "--top-p", "1.5"], "top_p must be in"),
        (["--prompt", "a", "--max-new-tokens", "0"], "must be an integer >= 1"),
        (["--prompt", "a", "--speculative", "draft"], "needs --draft-model"),
        (["--prompt", "a", "--temperature", "-1"], "temperature must be >= 0"),
        ([], "at least one --prompt"),
        (["--prompt", "a", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["--prompt", "a", "--speculative", "lookup", "--speculative-schedule", "adaptive"], "invalid choice: 'adaptive'"),
        (["--prompt", "a", "--chat"], "no chat template"),
    ],
)
def test_bad_input_exits_2_with_a_message(bundle, capsys, argv, message):
    path, _, _ = bundle
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(path), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_model_exits_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path / "nope"), "--prompt", "a"])
    assert exit_info.value.code == 2 and "config.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("flags, expected", [
    ([], dict(temperature=0.3, top_p=0.5, top_k=None)),  # the model's recommendation
    (["--temperature", "0", "--top-k", "4"], dict(temperature=0.0, top_p=0.5, top_k=4, do_sample=False)),
])
def test_sampling_defaults_come_from_the_registered_model_unless_flags_say_otherwise(
        bundle, capsys, monkeypatch, flags, expected):
    import llm.generation.cli as cli

    path, _, _ = bundle
    seen = {}
    real = cli.generate

    def spy(model, ids, **options):
        seen.update(options)
        return real(model, ids, **options)

    monkeypatch.setattr(cli, "generation_defaults", lambda name: {"temperature": 0.3, "top_p": 0.5})
    monkeypatch.setattr(cli, "generate", spy)
    run(capsys, "--model", path, "--prompt", "the cat", "--max-new-tokens", 3, *flags)
    assert {k: seen[k] for k in expected} == expected


def test_registered_models_recommended_sampling():
    from llm.convert.registry import generation_defaults

    assert generation_defaults("smollm2-135m-instruct") == {"temperature": 0.2, "top_p": 0.9}
    assert generation_defaults("runs/no-such-model") == {}
