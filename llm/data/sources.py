"""Corpus sources for data preparation: files, folders and globs of plain text, JSON Lines, Parquet
and Hugging Face ``save_to_disk`` datasets, streamed one document at a time.

Memory stays bounded whatever the corpus size and whatever the length of a line or a document:
text files are read in blocks of 1 MiB, JSON Lines files a record at a time, Parquet files in
record batches and Hugging Face datasets (memory-mapped Arrow) in batches of rows, and a document
longer than :data:`PIECE_CHARS` comes in pieces (:class:`Document` ``end``), each cut where every
tokenizer's pre-tokenization splits anyway, so that its tokens are the whole document's.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path

from llm.utils.extras import require

FORMATS = ("auto", "text", "jsonl", "parquet", "hf")
SPLIT_MODES = ("file", "blank-line", "line")
ENCODING_ERRORS = ("strict", "replace")
#: File extension -> format, for ``--format auto`` and for searching folders.
EXTENSIONS = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
# Files that `datasets`' save_to_disk writes: a Dataset folder, or a DatasetDict folder.
_HF_DATASET_MARKERS = ("state.json", "dataset_info.json")
_HF_DICT_MARKER = "dataset_dict.json"
_BATCH_ROWS = 1024
_BLOCK_BYTES = 1 << 20
#: A document longer than this many characters is read and tokenized in pieces of at most this size.
PIECE_CHARS = 1 << 16


class DataError(ValueError):
    """A bad input, option, tokenizer or output folder; the message says what was wrong and what is allowed."""


@dataclass(frozen=True)
class Source:
    """One thing to read: ``path`` (a file, or a Hugging Face dataset folder), ``name`` (its path
    relative to the input that found it, posix style: the stable part of document identities) and
    ``format`` (text, jsonl, parquet or hf)."""

    path: Path
    name: str
    format: str


@dataclass(frozen=True, slots=True)
class Document:
    """One document: its ``text``, its ``identity`` (``"NAME:INDEX"``, NAME its source's name and
    INDEX its 0-based position among the units the source holds: files, paragraphs, lines or
    records), ``replacements``, the invalid UTF-8 sequences decoded as U+FFFD (0 unless
    ``encoding_errors="replace"``), and ``end``: False for a piece of a long document that more
    pieces of the same identity follow (its text continues in the next piece, with no end of
    document between them)."""

    text: str
    identity: str
    replacements: int = 0
    end: bool = True


def check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    """Raise DataError unless ``value`` is one of ``allowed`` (``name`` is the option, for the message)."""
    if value not in allowed:
        raise DataError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def resolve_inputs(inputs: Sequence[str | os.PathLike], fmt: str = "auto") -> list[Source]:
    """The sources named by ``inputs``: files, folders (searched recursively, in sorted order) or
    glob patterns (``**`` allowed), in the order given; a file found twice is read once.

    With ``fmt="auto"`` a file's format comes from its extension (:data:`EXTENSIONS`) and a folder
    holding ``state.json`` / ``dataset_info.json`` (or ``dataset_dict.json``: each of its splits
    becomes a source) is a Hugging Face dataset; other folders are searched for files of known
    extensions (hidden entries skipped). With an explicit format every file is read in it and a
    folder search keeps the files with that format's extensions.

    Raises:
        DataError: an input that does not exist or matches nothing, a folder with nothing to
            read, an unknown extension with ``fmt="auto"``, a file given with ``fmt="hf"``.
    """
    check_choice("--format", fmt, FORMATS)
    if not inputs:
        raise DataError("no inputs given: pass files, folders or glob patterns")
    sources, seen = [], set()
    for spec in inputs:
        for source in _resolve_one(str(spec), fmt):
            key = source.path.resolve()
            if key not in seen:
                seen.add(key)
                sources.append(source)
    return sources


def _resolve_one(spec: str, fmt: str) -> list[Source]:
    path = Path(spec)
    if path.exists():
        return _expand(path, path.parent if path.is_file() else path, fmt)
    if any(c in spec for c in "*?["):
        matches = sorted(glob.glob(spec, recursive=True))
        if not matches:
            raise DataError(f"input {spec!r} matches nothing")
        parts = Path(spec).parts
        static = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
        base = Path(*parts[:static]) if static else Path(".")
        return [source for match in matches for source in _expand(Path(match), base, fmt)]
    raise DataError(f"input {spec!r} does not exist (expected a file, a folder or a glob pattern)")


def _name(path: Path, base: Path) -> str:
    return Path(os.path.relpath(path, base)).as_posix()


def _not_regular(path: Path) -> DataError:
    return DataError(f"input {path} is not a regular file (a FIFO, socket or device, which could block "
                     f"preparation forever or change between reads): give files or folders of files")


def _expand(path: Path, base: Path, fmt: str) -> list[Source]:
    if path.is_file():
        return [Source(path, _name(path, base), _file_format(path, fmt))]
    if not path.is_dir():
        raise _not_regular(path)
    sources = []
    for folder, dirs, files in os.walk(path):
        folder = Path(folder)
        if fmt in ("auto", "hf") and _is_hf(folder):
            dirs.clear()
            sources += _hf_sources(folder, _name(folder, base) if folder != base else folder.resolve().name)
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for file in sorted(f for f in files if not f.startswith(".")):
            kind = EXTENSIONS.get(Path(file).suffix.lower())
            if kind is not None and fmt in ("auto", kind):
                if not (folder / file).is_file():
                    raise _not_regular(folder / file)
                sources.append(Source(folder / file, _name(folder / file, base), kind))
    if not sources:
        wanted = "Hugging Face dataset folders" if fmt == "hf" else "files with extensions " + ", ".join(
            ext for ext, kind in EXTENSIONS.items() if fmt in ("auto", kind))
        raise DataError(f"folder {path} holds nothing to read: no {wanted}")
    return sources


def _is_hf(folder: Path) -> bool:
    return any((folder / marker).is_file() for marker in (*_HF_DATASET_MARKERS, _HF_DICT_MARKER))


def _hf_sources(folder: Path, name: str) -> list[Source]:
    dict_file = folder / _HF_DICT_MARKER
    if not dict_file.is_file():
        return [Source(folder, name, "hf")]
    splits = json.loads(dict_file.read_text(encoding="utf-8"))["splits"]
    return [Source(folder / split, f"{name}/{split}", "hf") for split in splits]


def _file_format(path: Path, fmt: str) -> str:
    if fmt == "hf":
        raise DataError(f"{path} is a file; --format hf takes a folder written by datasets' save_to_disk")
    if fmt != "auto":
        return fmt
    kind = EXTENSIONS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: unknown extension {path.suffix!r}; --format auto knows "
                        f"{', '.join(EXTENSIONS)} (or pass --format text|jsonl|parquet)")
    return kind


def source_files(source: Source) -> list[Path]:
    """The files a source reads: the file itself, or every file under a Hugging Face dataset folder."""
    if source.path.is_file():
        return [source.path]
    return sorted(p for p in source.path.rglob("*") if p.is_file())


def input_fingerprint(sources: Sequence[Source]) -> list[dict]:
    """``{"path": absolute path, "bytes": size, "mtime_ns": modification time}`` of every file the
    sources read: what tells a rerun whether the inputs changed."""
    rows = []
    for source in sources:
        for path in source_files(source):
            stat = path.stat()
            rows.append({"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return rows


def read_documents(source: Source, *, text_field: str = "text", split_documents: str = "file",
                   encoding_errors: str = "strict") -> Iterator[Document]:
    """Yield the non-empty documents of ``source``, one at a time (empty or whitespace-only ones
    are dropped), a document longer than :data:`PIECE_CHARS` characters in pieces (see :class:`Document`).

    Text files are one document each (``split_documents="file"``, the text exactly as decoded),
    or split at blank lines (``"blank-line"``: paragraphs, their lines joined by ``\\n``) or at
    line ends (``"line"``; ``\\n`` and ``\\r\\n`` removed). JSON Lines records (one JSON object per
    line; blank lines skipped), Parquet rows and Hugging Face dataset rows give the string in
    ``text_field``. ``encoding_errors="replace"`` decodes invalid UTF-8 as U+FFFD and counts it.

    Raises:
        DataError: a file that is not UTF-8 (naming the byte offset), a JSON Lines line that is
            not JSON or a record without a string ``text_field`` (file, line, the record's keys),
            a Parquet file or dataset without that column (naming its columns), an unreadable file.
    """
    check_choice("--split-documents", split_documents, SPLIT_MODES)
    check_choice("--encoding-errors", encoding_errors, ENCODING_ERRORS)
    if source.format == "text":
        units = _text_units(source.path, split_documents, encoding_errors)
    elif source.format == "jsonl":
        units = _jsonl_units(source.path, text_field, encoding_errors)
    elif source.format == "parquet":
        units = _parquet_units(source.path, text_field)
    else:
        units = _hf_units(source.path, text_field)
    pieces, index, started = _Pieces(), 0, False
    for fragment, replaced, whole in units:
        for text, n, end in pieces.add(fragment, replaced, whole):
            # whitespace before a long document's first text is dropped with it, as a blank document is
            if started or text.strip():
                yield Document(text, f"{source.name}:{index}", n, end)
                started = not end
        if whole:
            index, started = index + 1, False


def iter_documents(sources: Sequence[Source], **options) -> Iterator[Document]:
    """The documents of every source in order; ``options`` as for :func:`read_documents`."""
    for source in sources:
        yield from read_documents(source, **options)


# Counts the calls of the "replace" handler below: a decode call reads it before and after, which
# is exact because decoding is synchronous and this module only decodes in one thread.
_replaced = [0]


def _count_replacement(error: UnicodeDecodeError) -> tuple[str, int]:
    _replaced[0] += 1
    return "\ufffd", error.end


codecs.register_error("llm-count-replace", _count_replacement)


def _not_utf8(path: Path, data: bytes, offset: int, error: UnicodeDecodeError) -> DataError:
    return DataError(f"{path} is not UTF-8: invalid byte 0x{data[error.start]:02x} at byte offset "
                     f"{offset + error.start}; convert it to UTF-8, or pass --encoding-errors replace to "
                     "decode invalid bytes as U+FFFD (counted in the statistics)")


_BOM = "\ufeff".encode("utf-8")


def _decode(data: bytes, path: Path, offset: int, errors: str) -> tuple[str, int]:
    if errors == "strict":
        try:
            return data.decode("utf-8"), 0
        except UnicodeDecodeError as e:
            raise _not_utf8(path, data, offset, e) from None
    before = _replaced[0]
    text = data.decode("utf-8", "llm-count-replace")
    return text, _replaced[0] - before


def _cut(text: str, start: int, limit: int) -> int:
    """Where a piece of ``text[start:]`` (longer than ``limit``) ends: before the last space in
    ``text[start + limit // 2 : start + limit]`` that lies between two characters other than
    whitespace, else at ``start + limit``.

    Every pre-tokenizer of the tokenizers used here ends a pre-token there (GPT-2's and Llama 3's
    regexes, whose pre-tokens take a space only before the word it leads; whitespace splitting;
    Metaspace; characters), so the pieces' tokens are the whole text's (tested).
    """
    low, pos = start + limit // 2, start + limit
    while (pos := text.rfind(" ", low, pos)) >= low:
        if not text[pos - 1].isspace() and not text[pos + 1].isspace():
            return pos
    return start + limit


class _Pieces:
    """Cuts one document at a time, given in fragments, into pieces of at most :data:`PIECE_CHARS`
    characters (:func:`_cut`), holding at most about twice that."""

    def __init__(self):
        self.parts: list[str] = []
        self.size = self.replaced = 0

    def add(self, fragment: str, replaced: int, end: bool) -> Iterator[tuple[str, int, bool]]:
        """The pieces ``(text, replacements, end)`` that ``fragment`` completes; ``end``: the document ends with it."""
        self.parts.append(fragment)
        self.size += len(fragment)
        self.replaced += replaced
        if self.size <= 2 * PIECE_CHARS and not end:
            return
        text, start = "".join(self.parts), 0
        while len(text) - start > 2 * PIECE_CHARS or (end and len(text) - start > PIECE_CHARS):
            cut = _cut(text, start, PIECE_CHARS)
            yield text[start:cut], self.replaced, False
            start, self.replaced = cut, 0
        if end:
            yield text[start:], self.replaced, True
            self.parts, self.size, self.replaced = [], 0, 0
        else:
            self.parts = [text[start:]]
            self.size = len(self.parts[0])


def _whole_lines(data: bytes, path: Path, offset: int, errors: str) -> Iterator[tuple[str, int, bool]]:
    """The lines of ``data`` (whole lines, the last one's "\n" optional) without their "\n"."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if errors == "strict":
            raise _not_utf8(path, data, offset, e) from None
        # A newline byte never belongs to a UTF-8 sequence: decoding line by line is exact and gives
        # each line its own count.
        raw_lines = data.split(b"\n")
        if data.endswith(b"\n"):
            raw_lines.pop()
        for raw in raw_lines:
            line, n = _decode(raw, path, 0, errors)
            yield line, n, True
    else:
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()
        yield from zip(lines, repeat(0), repeat(True))


def _line_start(path: Path, errors: str, data: bytes, offset: int) -> tuple[str, int, int]:
    """The decodable start of a long line's bytes ``data``: (text, replacements, bytes used), never
    ending in "\r" (which may be half of a "\r\n")."""
    before = _replaced[0]
    try:
        text, used = codecs.utf_8_decode(data, "strict" if errors == "strict" else "llm-count-replace", False)
    except UnicodeDecodeError as e:
        raise _not_utf8(path, data, offset, e) from None
    if text.endswith("\r"):
        text, used = text[:-1], used - 1
    return text, _replaced[0] - before, used


def _lines(path: Path, errors: str) -> Iterator[tuple[str, int, bool]]:
    """The lines of a file without their "\n": ``(text, replacements, whole)``. A line longer than
    1 MiB comes in fragments, ``whole`` False but for its last, so memory stays bounded."""
    with open(path, "rb") as f:
        offset = len(_BOM) if f.read(3) == _BOM else 0  # a byte order mark marks the encoding; it is not text
        f.seek(offset)
        tail, open_line = b"", False  # the start of a line whose end is not read yet; part of it given
        # Whole lines, about a block at a time, decoded together: much faster than line by line.
        while block := f.read(_BLOCK_BYTES):
            data = tail + block
            end = data.rfind(b"\n") + 1
            if end:
                yield from _whole_lines(data[:end], path, offset, errors)
                offset, open_line = offset + end, False
            tail = data[end:]
            if len(tail) > _BLOCK_BYTES:
                text, n, used = _line_start(path, errors, tail, offset)
                yield text, n, False
                offset, tail, open_line = offset + used, tail[used:], True
        if tail or open_line:
            yield from _whole_lines(tail, path, offset, errors) if tail else [("", 0, True)]


def _file_fragments(path: Path, errors: str) -> Iterator[tuple[str, int, bool]]:
    """A whole file's text, a block at a time: ``(text, replacements, last)``."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict" if errors == "strict" else "llm-count-replace")
    with open(path, "rb") as f:
        offset = len(_BOM) if f.read(3) == _BOM else 0
        f.seek(offset)
        while True:
            block = f.read(_BLOCK_BYTES)
            pending, before = len(decoder.getstate()[0]), _replaced[0]
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:  # e.object: the bytes held back from the last block, then this one
                raise _not_utf8(path, e.object, offset - pending, e) from None
            yield text, _replaced[0] - before, not block
            if not block:
                return
            offset += len(block)


def _text_units(path: Path, mode: str, errors: str) -> Iterator[tuple[str, int, bool]]:
    if mode == "file":
        yield from _file_fragments(path, errors)
        return
    # pending: the fragments so far of a long line while all are whitespace (blank unless text follows);
    # in_text: part of the current line, which has text, was given
    in_paragraph, in_text, pending = False, False, []
    for line, n, whole in _lines(path, errors):
        if whole:
            line = line.removesuffix("\r")
        if mode == "line":
            yield line, n, whole
        elif in_text or line.strip():
            start = "" if in_text else ("\n" if in_paragraph else "") + "".join(pending)
            yield start + line, n, False
            in_paragraph, in_text, pending = True, not whole, []
        elif not whole:
            pending.append(line)
        else:  # a blank line ends the paragraph
            pending = []
            if in_paragraph:
                yield "", 0, True
                in_paragraph = False
    if in_paragraph:
        yield "", 0, True


def _jsonl_units(path: Path, field: str, errors: str) -> Iterator[tuple[str, int, bool]]:
    parts, replaced, number = [], 0, 0
    for fragment, n, whole in _lines(path, errors):
        parts.append(fragment)
        replaced += n
        if not whole:  # a JSON value is parsed whole: a record is held in memory, its text cut later
            continue
        line, n, number = "".join(parts), replaced, number + 1
        parts, replaced = [], 0
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}, line {number}: not JSON ({e.msg}, column {e.colno}); JSON Lines "
                            "files (.jsonl, .json) hold one JSON object per line") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}, line {number}: a JSON {type(record).__name__}, not an object; each "
                            f"line must be an object with a string field {field!r}")
        text = record.get(field)
        if not isinstance(text, str):
            problem = (f"lacks the field {field!r}" if field not in record
                       else f"has {type(text).__name__}, not a string, in the field {field!r}")
            raise DataError(f"{path}, line {number}: record {problem} (its keys: {sorted(record)}); "
                            "pass --text-field to name the field that holds the text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON escape of half a UTF-16 pair ("\ud800") is no character
            raise DataError(f"{path}, line {number}: the field {field!r} holds a lone UTF-16 surrogate "
                            f"({text[e.start]!r} at character {e.start}), which is not a character; fix the "
                            "JSON escapes (a pair such as \\ud83d\\ude00 is one character)") from None
        yield text, n, True


def _check_column(path: Path, field: str, columns: list[str], kind: str, is_string: bool) -> None:
    if field not in columns:
        raise DataError(f"{path}: no column {field!r} (its columns: {columns}); "
                        "pass --text-field to name the column that holds the text")
    if not is_string:
        raise DataError(f"{path}: column {field!r} holds {kind}, not strings")


def _null(path: Path, row: int, field: str) -> DataError:
    return DataError(f"{path}, row {row}: column {field!r} is null; every row needs a string")


def _parquet_units(path: Path, field: str) -> Iterator[tuple[str, int, bool]]:
    require("train", "pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    schema = parquet.schema_arrow
    kind = schema.field(field).type if field in schema.names else None
    is_string = kind is not None and (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                                      or pa.types.is_string_view(kind))
    _check_column(path, field, schema.names, str(kind), is_string)
    row = 0
    for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is None:
                raise _null(path, row, field)
            yield text, 0, True
            row += 1


def _hf_units(path: Path, field: str) -> Iterator[tuple[str, int, bool]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path} is a Hugging Face dataset folder: reading it needs the `datasets` "
                        "package (pip install datasets)") from None
    try:
        dataset = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable Hugging Face dataset folder ({e})") from None
    feature = dataset.features.get(field)
    is_string = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
    _check_column(path, field, dataset.column_names, str(feature), is_string)
    row = 0
    # Batches of rows from the memory-mapped Arrow files: only one batch is ever in memory.
    for batch in dataset.select_columns([field]).iter(batch_size=_BATCH_ROWS):
        for text in batch[field]:
            if text is None:
                raise _null(path, row, field)
            yield text, 0, True
            row += 1
