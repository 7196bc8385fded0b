"""scripts/generate.py (llm.cli.generate): completions equal the Python API's, statistics on stderr,
prompt caches on disk, the model's generation config under the flags, no autograd, and one-line exits
(status 2) on every bad input."""

import re
import string

import pytest
import torch

from llm.data import build_char_tokenizer
from llm.cli.generate import main
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


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_compile_and_quantize_flags_print_that_modes_greedy_text(bundle, capsys, monkeypatch, quantize):
    from llm.generation import compiled
    from llm.quant import quantize as quantize_model

    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")  # dynamo's graphs, run by eager kernels: fast
    path, model, tokenizer = bundle
    reference = quantize_model(tiny_model("alibi", vocab_size=len(tokenizer)), "int8") if quantize == "int8" else model
    prompts = ["the cat", "a dog sat on"]
    out = run(capsys, "--model", path, *sum([["--prompt", p] for p in prompts], []), "--temperature", 0,
              "--max-new-tokens", 12, "--compile", "--quantize", quantize)
    assert out.out.split("\n\n")[:2] == [greedy_text(reference, tokenizer, p, 12) for p in prompts]
    assert "compiling the first call's steps is counted" in out.err


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


def test_a_prompt_cache_from_another_model_or_unreadable_is_recomputed_and_said(bundle, capsys, tmp_path):
    path, _, tokenizer = bundle
    other = tmp_path / "other"  # the same shape and tokenizer, other weights: a fine-tuned twin
    tiny_model("alibi", seed=1, vocab_size=len(tokenizer)).save_pretrained(other, tokenizer=tokenizer)
    cache = tmp_path / "sys.cache"
    args = ["--system", "you are a cat. ", "--prompt", "hello", "--temperature", 0, "--max-new-tokens", 10]
    plain = run(capsys, "--model", path, *args)
    run(capsys, "--model", other, *args, "--prompt-cache", cache)

    reused = run(capsys, "--model", path, *args, "--prompt-cache", cache)
    assert reused.out == plain.out
    said = [line for line in reused.err.splitlines() if "recomputing" in line]
    assert len(said) == 1 and str(cache) in said[0] and "model identity" in said[0]
    again = run(capsys, "--model", path, *args, "--prompt-cache", cache)  # the file was refreshed
    assert again.out == plain.out and "recomputing" not in again.err

    cache.write_bytes(cache.read_bytes()[:200])  # truncated
    truncated = run(capsys, "--model", path, *args, "--prompt-cache", cache)
    assert truncated.out == plain.out
    said = [line for line in truncated.err.splitlines() if "recomputing" in line]
    assert len(said) == 1 and f"{cache} is not a readable cache file" in said[0]
    assert "recomputing" not in run(capsys, "--model", path, *args, "--prompt-cache", cache).err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "a", "--top-p", "1.5"], "argument --top-p: must be a number in (0, 1], got 1.5"),
        (["--prompt", "a", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got 0"),
        (["--prompt", "a", "--speculative", "draft"], "needs --draft-model"),
        (["--prompt", "a", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
        # NaN and infinities: before, --temperature nan decoded greedily with exit status 0
        (["--prompt", "a", "--temperature", "nan"], "argument --temperature: must be a finite number >= 0 (0: greedy), "
                                                    "got nan"),
        (["--prompt", "a", "--temperature", "inf"], "argument --temperature: must be a finite number >= 0"),
        (["--prompt", "a", "--repetition-penalty", "nan"], "--repetition-penalty: must be a finite number > 0"),
        (["--prompt", "a", "--top-p=-inf"], "argument --top-p: must be a number in (0, 1], got -inf"),
        (["--prompt", "a", "--min-p", "nan"], "argument --min-p: must be a number in [0, 1], got nan"),
        # no internal names (before: "invalid _positive_int value")
        (["--prompt", "a", "--batch-size", "x"], "argument --batch-size: expected an integer, got 'x'"),
        (["--prompt", "a", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got 0"),
        (["--prompt", "a", "--max-new-tokens", "2.5"], "argument --max-new-tokens: expected an integer, got '2.5'"),
        (["--prompt", "a", "--top-k", "-3"], "argument --top-k: must be an integer >= 0"),
        (["--prompt", "a", "--temperature", "warm"], "argument --temperature: expected a number, got 'warm'"),
        (["--prompt", "a", "--seed", "-1"], "argument --seed: must be an integer in [0, 2**64), got -1"),
        (["--prompt", "a", "--num-speculative-tokens", "0"], "--num-speculative-tokens: must be an integer >= 1"),
        # devices that are not there: before, a traceback
        (["--prompt", "a", "--device", "foo"], "argument --device: unknown device 'foo'; use cpu, cuda, cuda:N or mps"),
        (["--prompt", "a", "--device", "meta"], "argument --device: 'meta' holds no weights"),
        ([], "give at least one --prompt or a --prompts-file"),
        (["--prompt", "a", "--prompts-file", "/no/such/file"], "--prompts-file /no/such/file: No such file or "
                                                                 "directory"),
        (["--prompt", "a", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["--prompt", "a", "--speculative", "lookup", "--speculative-schedule", "adaptive"], "invalid choice: 'adaptive'"),
        (["--prompt", "a", "--chat"], "no chat template"),
        (["--prompt", "ab", "--max-new-tokens", "100000"], "a prompt of 2 tokens + --max-new-tokens 100000 needs "
                                                          "100001 positions, more than the model's context of"),
        (["--prompts-file", "/dev/null"], "--prompts-file /dev/null holds no prompt: give one per line"),
        (["--prompt", "a", "--system", "", "--prompt-cache", "x.cache"], "give a non-empty --system too"),
        (["--prompt", "a", "--system", "s", "--prompt-cache", "/"], "--prompt-cache / is a folder: give a file name"),
        (["--prompt", "a", "--system", "s", "--prompt-cache", "/no/such/x.cache"], "no folder /no/such to keep it in"),
        (["--model", "nosuch", "--prompt", "a"], "nosuch: no such model folder or .gguf file, and not a registered name"),
        # a wrong --model is named as such, before the tokenizer (loaded first) could complain
        (["--model", "/", "--prompt", "a"], "no config.yaml in /: not a model saved by MosaicGPT.save_pretrained"),
        (["--model", "/etc/passwd", "--prompt", "a"], "/etc/passwd is a file but not a .gguf one"),
        (["--model", "/no/such.gguf", "--prompt", "a"], "no GGUF file at /no/such.gguf"),
        (["--prompt", "a", "--speculative", "draft", "--draft-model", "nosuch"], "--draft-model nosuch: no such model"),
    ],
)
def test_bad_input_exits_2_with_a_message(bundle, capsys, argv, message):
    path, _, _ = bundle
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(path), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("generate.py: error: ") and err.count("\n") == 1  # one line, no usage block
    assert message in err


@pytest.mark.skipif(torch.cuda.is_available() and torch.backends.mps.is_available(), reason="both devices exist")
def test_an_unavailable_device_is_one_line(bundle, capsys):
    path, _, _ = bundle
    device = "mps" if torch.cuda.is_available() else "cuda"
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(path), "--prompt", "a", "--device", device])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"generate.py: error: argument --device: device '{device}' is not available on this "
                          f"machine (")


def test_a_prompts_file_that_is_not_utf8_is_named_with_the_byte_offset(bundle, capsys, tmp_path):
    path, model, tokenizer = bundle
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("the cat\na dog\n".encode() + b"caf\xe9\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(path), "--prompts-file", str(prompts)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"generate.py: error: --prompts-file {prompts} is not UTF-8 text: byte 0xe9 at "
                                       f"byte offset 17 (invalid continuation byte)\n")
    prompts.write_bytes("\ufeffthe cat\n\na dog\n".encode())  # a BOM and blank lines are no prompts
    out = run(capsys, "--model", path, "--prompts-file", prompts, "--temperature", 0, "--max-new-tokens", 4)
    assert out.out.split("\n\n")[:2] == [greedy_text(model, tokenizer, p, 4) for p in ("the cat", "a dog")]


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0 (0: greedy), got nan"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "foo"], "argument --device: "),
])
def test_the_script_exits_2_with_one_line(bundle, argv, message):
    """The real script, in its own process: nothing but one line on stderr, no completion."""
    import subprocess
    import sys

    from llm.utils.pretrained import REPO_ROOT

    path, _, _ = bundle
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "generate.py"), "--model", str(path),
                           "--prompt", "the cat", *argv], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("generate.py: error: ") and done.stderr.count("\n") == 1
    assert message in done.stderr


@pytest.mark.parametrize("stream", [[], ["--stream"]])
def test_the_script_ends_its_process_with_everything_written(bundle, capsys, stream):
    """The real script ends its process without the interpreter's teardown (os._exit, see
    llm.cli.main.launch): what it prints is all there, as the same command in-process prints it,
    and the exit status is 0."""
    import subprocess
    import sys

    from llm.utils.pretrained import REPO_ROOT

    path, _, _ = bundle
    argv = ["--model", str(path), "--prompt", "the cat", "--prompt", "a dog", "--temperature", "0",
            "--max-new-tokens", "40", *stream]
    assert main(argv) == 0
    expected = capsys.readouterr()
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "generate.py"), *argv], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == expected.out and done.stdout.startswith("the cat")
    def counts(err: str) -> str:  # the statistics line without its speeds
        return re.sub(r"[0-9.]+ tokens/s", "", err)

    assert counts(done.stderr) == counts(expected.err) and "decode: " in done.stderr


@pytest.mark.parametrize("closed", [">&-", "2>&-"])
def test_the_script_exits_0_with_a_closed_output(bundle, closed):
    """A process whose stdout or stderr is closed (Python's sys.stdout is then None) ends as it
    would through the interpreter's exit: status 0, no traceback."""
    import shlex
    import subprocess
    import sys

    from llm.utils.pretrained import REPO_ROOT

    path, _, _ = bundle
    command = shlex.join([sys.executable, str(REPO_ROOT / "scripts" / "generate.py"), "--model", str(path),
                          "--prompt", "the cat", "--max-new-tokens", "5"])
    done = subprocess.run(["sh", "-c", f"{command} {closed}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_missing_model_exits_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path / "nope"), "--prompt", "a"])
    assert exit_info.value.code == 2 and "nope: no such model folder or .gguf file" in capsys.readouterr().err


@pytest.mark.parametrize("flags, expected, warning", [
    ([], dict(do_sample=True, temperature=0.3, top_p=0.5, top_k=None), None),  # the model's generation config
    (["--temperature", "0.9", "--top-k", "4"], dict(do_sample=True, temperature=0.9, top_p=0.5, top_k=4), None),
    (["--temperature", "0"], dict(do_sample=False, temperature=0.0, top_p=0.5), None),  # the model's top_p: quiet
    (["--temperature", "0", "--top-k", "4"], dict(do_sample=False, top_k=4),
     "generate.py: warning: decoding is greedy (--temperature 0), so --top-k 4 is ignored"),
])
def test_sampling_defaults_come_from_the_models_generation_config_unless_flags_say_otherwise(
        bundle, capsys, monkeypatch, tmp_path, flags, expected, warning):
    import llm.cli.generate as cli
    from llm import GenerationConfig

    _, model, tokenizer = bundle
    model.save_pretrained(tmp_path, tokenizer=tokenizer,
                          generation_config=GenerationConfig(do_sample=True, temperature=0.3, top_p=0.5))
    seen = []
    real = cli.generate
    monkeypatch.setattr(cli, "generate", lambda *a, **kw: seen.append(kw["generation_config"]) or real(*a, **kw))
    out = run(capsys, "--model", tmp_path, "--prompt", "the cat", "--max-new-tokens", 3, *flags)
    assert {k: getattr(seen[0], k) for k in expected} == expected
    assert seen[0].eos_token_id == tokenizer.eos_token_id and seen[0].max_new_tokens == 3
    warnings = [line for line in out.err.splitlines() if "warning" in line]
    assert warnings == ([warning] if warning else [])


def test_without_a_generation_config_the_cli_samples_at_its_default_temperature(bundle, capsys, monkeypatch):
    import llm.cli.generate as cli

    path, _, _ = bundle
    seen = []
    real = cli.generate
    monkeypatch.setattr(cli, "generate", lambda *a, **kw: seen.append(kw["generation_config"]) or real(*a, **kw))
    run(capsys, "--model", path, "--prompt", "the cat", "--max-new-tokens", 3, "--seed", 1)
    assert (seen[0].do_sample, seen[0].temperature, seen[0].top_p, seen[0].seed) == (True, cli.DEFAULT_TEMPERATURE,
                                                                                      None, 1)


def test_the_cli_records_no_autograd(bundle, capsys):
    """Before, the CLI's generate call recorded a graph at every forward."""
    import llm

    path, _, _ = bundle
    modes = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: modes.append(torch.is_grad_enabled()) if isinstance(module, llm.MosaicGPT) else None)
    try:
        run(capsys, "--model", path, "--prompt", "the cat", "--max-new-tokens", 3)
        run(capsys, "--model", path, "--prompt", "the cat", "--max-new-tokens", 3, "--stream")
    finally:
        hook.remove()
    assert modes and not any(modes)


def _one_line_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    return err


def test_non_finite_weights_are_refused_at_load_naming_the_tensor(bundle, capsys, tmp_path):
    # a diverged run (or a corrupt file) saved NaN weights: an error, not the prompt and nothing
    path, model, tokenizer = bundle
    broken = tiny_model("alibi", vocab_size=len(tokenizer))
    with torch.no_grad():
        broken.blocks[1].ffn.down_proj.weight[3, 5] = float("nan")
        broken.norm_f.weight[0] = float("inf")
    broken.save_pretrained(tmp_path / "nan", tokenizer=tokenizer)
    err = _one_line_error(capsys, "--model", tmp_path / "nan", "--prompt", "the")
    assert "blocks.1.ffn.down_proj.weight holds 1 NaN or infinite value(s)" in err and "diverged" in err
    with pytest.raises(ValueError, match="norm_f.weight holds 1 NaN"):
        from llm import MosaicGPT
        broken.blocks[1].ffn.down_proj.weight.data[3, 5] = 0.0
        broken.save_pretrained(tmp_path / "inf", tokenizer=tokenizer)
        MosaicGPT.from_pretrained(tmp_path / "inf")


def test_a_tokenizer_that_is_not_the_models_is_refused(bundle, capsys, tmp_path):
    import shutil

    path, model, tokenizer = bundle
    folder = tmp_path / "swapped"
    shutil.copytree(path, folder)
    # another char tokenizer of the same size: saved over the model's, it would give garbage
    build_char_tokenizer(string.ascii_uppercase + " .,\n").save_pretrained(str(folder))
    assert "is not the one saved with its weights" in _one_line_error(capsys, "--model", folder, "--prompt", "A")
    # a model saved without its tokenizer: a tokenizer with more tokens than its vocabulary
    model.save_pretrained(tmp_path / "bare")
    wide = build_char_tokenizer(string.printable)
    wide.save_pretrained(str(tmp_path / "bare"))
    err = _one_line_error(capsys, "--model", tmp_path / "bare", "--prompt", "a")
    assert f"has {len(wide)} tokens, more than the model's vocabulary of {len(tokenizer)}" in err
    # the model's own tokenizer passes, saved and loaded back
    assert "the" in run(capsys, "--model", path, "--prompt", "the", "--max-new-tokens", "2").out
    # the Python API refuses them as it loads the folder's tokenizer, with the same lines
    from llm import load_tokenizer

    with pytest.raises(ValueError, match="is not the one saved with its weights"):
        load_tokenizer(folder)
    with pytest.raises(ValueError, match=f"has {len(wide)} tokens, more than the model's vocabulary"):
        load_tokenizer(tmp_path / "bare")
    assert len(load_tokenizer(path)) == len(tokenizer)
