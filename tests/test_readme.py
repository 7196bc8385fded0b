"""Every ```python and ```bash block of README.md and of the docs site's pages (in the order of
``mkdocs.yml``'s nav) runs, as written, in a work folder like a user's; a block that repeats an
earlier one word for word runs once.

The work folder (a session fixture) mirrors a checkout after ``make install``: ``configs/``,
``scripts/`` and ``.venv`` are links to the repository's (registered models are in ``$LLM_HOME``),
and ``runs/`` starts empty.
What would take minutes on two cores is substituted; the whole table is here:

* ``data/shakespeare/{text,bpe-2048}``: a slice of the plays (three training plays and the four
  held-out ones, cut short), prepared with the real BPE 2048 tokenizer, so a training run's final
  held-out evaluation takes seconds, not minutes. ``data/shakespeare/char`` is the same slice in characters.
* ``my_texts/``: three whole training plays cut into ``.txt`` files of 4 paragraphs (enough for a
  5% validation split of one 2048-token row) (the README's "your own data").
* ``runs/shakespeare``: the default config trained for 2 batches (the training overrides below),
  so ``runs/shakespeare/model`` and ``latest-rank0.pt`` exist.
* ``scripts/train.py`` commands (also under ``composer``): ``TRAIN_OVERRIDES`` appended (2 batches,
  eager: compiling each config's step would take most of a 2-batch run; ``tests/train/test_speed.py``
  compiles training for real).
* ``scripts/eval.py`` commands: ``EVAL_OVERRIDES`` appended (a few short sequences).
* ``scripts/generate.py --model smollm2-135m-instruct``: ``--max-new-tokens 8`` appended, and
  ``--compile`` dropped (compiling 30 blocks takes minutes on two cores;
  ``tests/generation/test_compiled.py`` compiles for real, and the CLI's flag is tested there too).
* Skipped lines: ``make train`` / ``make test`` (they are what runs this),
  ``composer -n 2`` (two processes; ``tests/train/test_ddp.py`` covers data-parallel training), and
  ``make bench-peers`` (it builds llama.cpp from source and benchmarks for many minutes; never CI).

Each block is one test, named by its file and line (``README.md:53``, ``docs/training.md:12``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def documents() -> list[Path]:
    """README.md, then the docs pages in the site's order."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [README] + [ROOT / "docs" / next(iter(item.values())) for item in nav]
PYTHON = ROOT / ".venv" / "bin" / "python"
if not PYTHON.exists():
    PYTHON = Path(sys.executable)

TRAIN_OVERRIDES = ("max_duration=2ba scheduler.t_warmup=1ba eval_interval=2ba save_interval=2ba "
                   "global_train_batch_size=4 device_train_microbatch_size=4 device_eval_batch_size=4 "
                   "eval_subset_num_batches=1 progress_bar=false num_samples=0 compile_config=null")
EVAL_OVERRIDES = "eval_max_sequences=2 eval_seq_len=64 device_eval_batch_size=2"
SKIP_PREFIXES = ("make train", "make test", "make bench-peers", ".venv-peers/", ".venv/bin/composer -n 2", "composer -n 2")


def readme_blocks() -> list[tuple[str, str, str]]:
    """``(file:line of the opening fence, language, code)`` for every python and bash block of the
    documents, each distinct block once."""
    blocks, seen = [], set()
    for document in documents():
        lang, start, body = None, 0, []
        for number, line in enumerate(document.read_text().splitlines(), 1):
            if lang is None:
                m = re.match(r"^```(\w*)\s*$", line)
                if m:
                    lang, start, body = m.group(1) or "text", number, []
            elif line.startswith("```"):
                code = "\n".join(body) + "\n"
                if lang in ("python", "bash", "sh", "shell") and code not in seen:
                    seen.add(code)
                    blocks.append((f"{document.relative_to(ROOT)}:{start}", "python" if lang == "python" else "bash",
                                   code))
                lang = None
            else:
                body.append(line)
    return blocks


def shell_commands(code: str) -> list[str]:
    """The block's commands, continuation lines joined, comment lines dropped."""
    commands, current = [], ""
    for line in code.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        commands.append(current + line)
        current = ""
    return commands


def substitute(command: str) -> str | None:
    """The command as run here (see the module docstring), or None to skip it."""
    if command.strip().startswith(SKIP_PREFIXES):
        return None
    # A trailing ``# comment`` stays a comment once arguments are appended before it.
    code, comment = command, ""
    m = re.search(r"\s+#[^'\"]*$", command)
    if m:
        code, comment = command[:m.start()], command[m.start():]
    if "scripts/train.py" in code or re.search(r"\bllm train\b", code):
        code += " " + TRAIN_OVERRIDES
    elif "scripts/eval.py" in code or re.search(r"\bllm eval\b", code):
        code += " " + EVAL_OVERRIDES
    elif ("scripts/generate.py" in code or re.search(r"\bllm generate\b", code)) and "smollm2-135m-instruct" in code:
        code = code.replace(" --compile", "") + " --max-new-tokens 8"
    return code + comment


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    from tests.train_helpers import make_tiny_data

    work = tmp_path_factory.mktemp("readme")
    for name in ("configs", "scripts", ".venv"):
        (work / name).symlink_to(ROOT / name)
    shakespeare = work / "data" / "shakespeare"
    shakespeare.mkdir(parents=True)
    slice_dir = tmp_path_factory.mktemp("readme-data")
    bpe = make_tiny_data(slice_dir / "bpe", tokenizer=str(ROOT / "data/shakespeare/bpe-2048"), seq_len=256,
                         validation_chars=3000)
    (shakespeare / "bpe-2048").symlink_to(bpe)
    (shakespeare / "text").symlink_to(slice_dir / "bpe" / "text")
    char = make_tiny_data(slice_dir / "char", tokenizer="char", seq_len=512, validation_chars=3000)
    (shakespeare / "char").symlink_to(char)
    mine = work / "my_texts"
    mine.mkdir()
    for path in sorted((ROOT / "data/shakespeare/text/train").glob("*.txt"))[:3]:
        scenes = path.read_text().split("\n\n")
        for i in range(0, len(scenes), 4):  # enough documents for a 5% validation split
            (mine / f"{path.stem}-{i:04d}.txt").write_text("\n\n".join(scenes[i:i + 4]) + "\n")
    train = [str(PYTHON), "scripts/train.py", "configs/shakespeare.yaml", *TRAIN_OVERRIDES.split()]
    done = subprocess.run(train, cwd=work, env=environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return work


def environment() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{PYTHON.parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.mark.parametrize("start,lang,code", [pytest.param(*b, id=b[0]) for b in readme_blocks()])
def test_readme_block(workdir, start, lang, code):
    name = re.sub(r"[^\w]+", "_", start)  # README.md:53 -> README_md_53
    if lang == "python":
        script = workdir / f"{name}.py"
        script.write_text(code)
        argv = [str(PYTHON), script.name]
    else:
        commands = [c for c in map(substitute, shell_commands(code)) if c is not None]
        if not commands:
            pytest.skip("nothing to run here (make targets)")
        script = workdir / f"{name}.sh"
        script.write_text("set -euo pipefail\n" + "\n".join(commands) + "\n")
        argv = ["bash", script.name]
    done = subprocess.run(argv, cwd=workdir, env=environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"{start} ({lang}) failed with status {done.returncode}\n--- ran:\n{script.read_text()}"
        f"\n--- stdout:\n{done.stdout[-4000:]}\n--- stderr:\n{done.stderr[-4000:]}"
    )
