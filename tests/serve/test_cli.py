"""scripts/serve.py as a user runs it: a real process serving a saved bundle, stopped by Ctrl-C;
a model that cannot load ends the process with one line; --help names every flag."""

import re
import signal
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


def test_the_script_serves_a_bundle_until_interrupted(bundle):
    process = subprocess.Popen([*SCRIPT, "--model", str(bundle), "--port", "0", "--served-model-name", "tiny",
                                "--threads", "1"], stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in process.stderr:
            m = re.search(r"Uvicorn running on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server never said where it listens"
        deadline = time.time() + 60
        while httpx.get(url + "/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.1)
        out = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 4}).json()
        assert out["model"] == "tiny" and out["usage"]["completion_tokens"] >= 1
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0


def test_a_model_that_cannot_load_ends_the_server_with_one_line(tmp_path):
    done = subprocess.run([*SCRIPT, "--model", str(tmp_path / "missing"), "--port", "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(f"serve.py: error: loading {tmp_path / 'missing'} failed")


def test_help_documents_every_flag():
    done = subprocess.run([*SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for flag in ("--model", "--host", "--port", "--max-batch-size", "--max-queue", "--prefix-cache-tokens",
                 "--quantize", "--compile", "--dtype", "--device", "--served-model-name", "--threads"):
        assert flag in done.stdout
