"""Prompt/response pairs from the plays for fine-tuning: a speaker's cue line, and the reply to it.

An example is two consecutive speeches by different speakers within a scene, written as in
:func:`llm.data.load_corpus` text: the prompt is ``"A:\\n<A's last line>\\n\\nB:\\n"`` and the
response the first lines of B's reply. Stage directions and headings between speeches break a
pair, so every cue really is answered.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from llm.data.shakespeare import markdown_to_text, play_paths, split_plays

_SPEAKER_LINE = re.compile(r"^([^\s\[\]][^\[\]:]*):$")


def speeches(text: str) -> list[tuple[str, list[str]] | None]:
    """The paragraphs of a play's text: ``(speaker, lines)`` for a speech, None for anything else."""
    out = []
    for para in text.split("\n\n"):
        lines = [line for line in para.split("\n") if line.strip()]
        match = _SPEAKER_LINE.match(lines[0]) if lines else None
        body = [line for line in lines[1:] if not line.startswith("[")]
        out.append((match[1], body) if match and body else None)
    return out


def cue_pairs(text: str, *, max_response_lines: int = 2, max_chars: int = 240) -> list[dict[str, str]]:
    """Every (cue, reply) example of one play's text whose prompt + response fit in ``max_chars``."""
    paragraphs = speeches(text)
    examples = []
    for first, second in zip(paragraphs, paragraphs[1:]):
        if first is None or second is None or first[0] == second[0]:
            continue
        prompt = f"{first[0]}:\n{first[1][-1]}\n\n{second[0]}:\n"
        response = "\n".join(second[1][:max_response_lines])
        if len(prompt) + len(response) <= max_chars:
            examples.append({"prompt": prompt, "response": response})
    return examples


def make_cue_dataset(split: str, n: int, *, seed: int = 0, plays_dir: str | Path | None = None,
                     **kwargs) -> list[dict[str, str]]:
    """``n`` examples (or all, if fewer) drawn with ``seed`` from the plays of ``split``, in play order."""
    paths = play_paths(plays_dir)
    examples = [ex for name in split_plays(split, plays_dir)
                for ex in cue_pairs(markdown_to_text(paths[name].read_text()), **kwargs)]
    keep = sorted(random.Random(seed).sample(range(len(examples)), min(n, len(examples))))
    return [examples[i] for i in keep]


def write_jsonl(examples: list[dict[str, str]], path: str | Path) -> None:
    """One ``{"prompt": ..., "response": ...}`` object per line."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(ex, ensure_ascii=False) + "\n" for ex in examples))
