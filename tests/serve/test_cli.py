"""scripts/serve.py as a user runs it: a real process serving a saved bundle, stopped by Ctrl-C;
a model that cannot load ends the process with one line; --help names every flag."""

import json
import re
import signal
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from llm.data import build_char_tokenizer
from tests.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, str(ROOT / "scripts" / "serve.py")]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tokenizer = build_char_tokenizer(string.ascii_lowercase + " ")
    path = tmp_path_factory.mktemp("bundle")
    tiny_model("rope", vocab_size=len(tokenizer)).save_pretrained(path, tokenizer=tokenizer)
    return path


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_script_serves_a_bundle_until_interrupted(bundle, quantization, tmp_path):
    model = bundle
    if quantization is not None:  # its weights are buffers: the log still counts them
        model = tmp_path / "quantized"
        tokenizer = build_char_tokenizer(string.ascii_lowercase + " ")
        tiny = tiny_model("rope", vocab_size=len(tokenizer), quantization=quantization)
        tiny.save_pretrained(model, tokenizer=tokenizer)
    vocab_size = len(build_char_tokenizer(string.ascii_lowercase + " "))
    expected = f"serving tiny ({tiny_model('rope', vocab_size=vocab_size).num_parameters():,} parameters)"
    # the quantized one drafts for itself (--speculative draft): every greedy draft is taken
    speculative = ["--speculative", "draft", "--draft-model", str(model)] if quantization else []
    process = subprocess.Popen([*SCRIPT, "--model", str(model), "--port", "0", "--served-model-name", "tiny",
                                "--threads", "1", *speculative], stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in process.stderr:
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server never said where it listens"
        deadline = time.time() + 60
        while httpx.get(url + "/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.1)
        out = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 12,
                                                        "temperature": 0}).json()
        assert out["model"] == "tiny" and out["usage"]["completion_tokens"] >= 1
        accepted = [line for line in httpx.get(url + "/metrics").text.splitlines()
                    if line.startswith("llm:spec_decode_num_accepted_tokens_total ")]
        assert (float(accepted[0].split()[-1]) > 0) == bool(speculative), accepted
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
    assert expected in process.stderr.read()


def test_a_model_that_cannot_load_ends_the_server_with_one_line(tmp_path):
    # a folder that looks like a bundle (so it passes the check before anything loads) but is not one
    (tmp_path / "config.yaml").write_text("d_model: [\n")
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    done = subprocess.run([*SCRIPT, "--model", str(tmp_path), "--port", "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(f"serve.py: error: loading {tmp_path} failed")


def test_what_cannot_start_is_one_line_before_anything_loads(bundle, tmp_path):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    for argv, status, message in [
        (["--model", str(tmp_path / "missing")], 2, "missing: no such model folder or .gguf file, and not a registered name"),
        (["--model", str(tmp_path)], 2, f"no config.yaml in {tmp_path}: not a model saved by MosaicGPT.save_pretrained"),
        (["--model", str(bundle), "--port", "99999"], 2, "argument --port: must be an integer <= 65535, got 99999"),
        (["--model", str(bundle), "--port", str(port)], 1, f"cannot listen on 127.0.0.1:{port}: Address already in use"),
        (["--model", str(bundle), "--host", "no-such-host.invalid"], 1, "cannot listen on no-such-host.invalid:8000"),
        (["--model", str(bundle), "--speculative", "draft"], 2, "--speculative draft needs --draft-model"),
        (["--model", str(bundle), "--speculative", "lookup", "--draft-model", str(bundle)], 2,
         "--draft-model drafts only with --speculative draft (got --speculative lookup)"),
        (["--model", str(bundle), "--speculative", "draft", "--draft-model", str(tmp_path / "nope")], 2,
         f"--draft-model {tmp_path / 'nope'}: no such model folder"),
    ]:
        done = subprocess.run([*SCRIPT, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == status, (argv, done.stderr[-2000:])
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("serve.py: error: ") and message in lines[0], (argv, lines)
    taken.close()


def test_help_documents_every_flag():
    done = subprocess.run([*SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for flag in ("--model", "--host", "--port", "--max-batch-size", "--max-queue", "--prefix-cache-tokens",
                 "--quantize", "--compile", "--dtype", "--device", "--served-model-name", "--threads",
                 "--speculative", "--draft-model", "--num-speculative-tokens"):
        assert flag in done.stdout


def test_ctrl_c_while_the_model_loads_exits_0(tmp_path):
    """The loading thread is inside torch (a slow load), and Ctrl-C comes meanwhile: the process
    used to abort in the interpreter's teardown (status 134)."""
    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, torch\n"
        "import llm.cli.serve as serve\n"
        "serve.loader = lambda args: (lambda: [torch.randn(256, 256) @ torch.randn(256, 256) for _ in range(10**7)])\n"
        "sys.exit(serve.main(sys.argv[1:]))\n")
    process = subprocess.Popen([sys.executable, str(script), "--model", "smollm2-135m-instruct", "--port", "0"],
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for line in process.stderr:
            if "Application startup complete" in line:
                break
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
        assert "stopped while the model was loading" in process.stderr.read()
    finally:
        process.kill()


def _slow_server(tmp_path, bundle, *flags):
    """The serve command on ``bundle`` with each decoding step slowed to 0.2 s, and its URL."""
    script = tmp_path / "slow_steps.py"
    script.write_text(
        "import sys, time\n"
        "from llm.serve.engine import Engine\n"
        "step = Engine._decode_batch\n"
        "Engine._decode_batch = lambda self: (time.sleep(0.2), step(self))[1]\n"
        "from llm.cli.main import run\n"
        "sys.exit(run('serve'))\n")
    process = subprocess.Popen([sys.executable, str(script), "--model", str(bundle), "--port", "0", *flags],
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for line in process.stderr:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    deadline = time.time() + 60
    while httpx.get(url + "/health").status_code != 200 and time.time() < deadline:
        time.sleep(0.1)
    return process, url


@pytest.mark.parametrize("interrupts", [1, 2])
def test_ctrl_c_ends_running_streams_cleanly_after_the_grace_time_or_at_a_second_one(bundle, tmp_path, interrupts):
    """One Ctrl-C: the stream runs on for --shutdown-timeout, then ends with a 503 error event and
    [DONE]; a second Ctrl-C ends it at once. Either way: exit 0, no traceback, no abort."""
    timeout = 1 if interrupts == 1 else 60
    process, url = _slow_server(tmp_path, bundle, "--shutdown-timeout", str(timeout))
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "the", "max_tokens": 80, "stream": True, "temperature": 0}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            started = time.time()
            for _ in range(interrupts):
                process.send_signal(signal.SIGINT)
                time.sleep(0.3)
            events = [line for line in lines if line]
        ended = time.time() - started
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "shutting_down" and error["message"] == "the server is shutting down"
        assert ended < 10  # 80 steps of 0.2 s would take 16 s
        assert process.wait(30) == 0
        err = process.stderr.read()
        assert "Traceback" not in err and "terminate called" not in err and "CancelledError" not in err, err
    finally:
        process.kill()
