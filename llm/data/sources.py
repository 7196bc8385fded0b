"""Corpus sources for data preparation: files, folders and globs of plain text, JSON Lines, Parquet
and Hugging Face ``save_to_disk`` datasets, streamed one document at a time.

Memory stays bounded whatever the corpus size: text and JSON Lines files are read line by line,
Parquet files in record batches and Hugging Face datasets (memory-mapped Arrow) in batches of
rows. The one exception is ``split_documents="file"``, where a whole text file is one document.
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
    records) and ``replacements``, the invalid UTF-8 sequences decoded as U+FFFD (0 unless
    ``encoding_errors="replace"``)."""

    text: str
    identity: str
    replacements: int = 0


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
    are dropped).

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
    for index, (text, replacements) in enumerate(units):
        if text.strip():
            yield Document(text, f"{source.name}:{index}", replacements)


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


def _lines(path: Path, errors: str) -> Iterator[tuple[str, int]]:
    """The lines of a file without their "\\n", each with its count of replaced sequences."""
    offset = 0
    with open(path, "rb") as f:
        if f.read(3) == _BOM:  # a UTF-8 byte order mark marks the encoding; it is not text
            offset = len(_BOM)
        else:
            f.seek(0)
        # Whole lines, about a block at a time, decoded together: much faster than line by line.
        while raw_lines := f.readlines(_BLOCK_BYTES):
            data = b"".join(raw_lines)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                if errors == "strict":
                    raise _not_utf8(path, data, offset, e) from None
                # A newline byte never belongs to a UTF-8 sequence: decoding line by line is exact
                # and gives each line its own count.
                for raw in raw_lines:
                    line, n = _decode(raw, path, 0, errors)
                    yield line.removesuffix("\n"), n
            else:
                lines = text.split("\n")
                if text.endswith("\n"):
                    lines.pop()
                yield from zip(lines, repeat(0))
            offset += len(data)


def _text_units(path: Path, mode: str, errors: str) -> Iterator[tuple[str, int]]:
    if mode == "file":
        with open(path, "rb") as f:
            data = f.read()
        skip = len(_BOM) if data.startswith(_BOM) else 0  # a byte order mark is not text
        yield _decode(data[skip:], path, skip, errors)
        return
    paragraph, replaced = [], 0
    for line, n in _lines(path, errors):
        line = line.removesuffix("\r")
        if mode == "line":
            yield line, n
        elif line.strip():
            paragraph.append(line)
            replaced += n
        elif paragraph:
            yield "\n".join(paragraph), replaced
            paragraph, replaced = [], 0
    if paragraph:
        yield "\n".join(paragraph), replaced


def _jsonl_units(path: Path, field: str, errors: str) -> Iterator[tuple[str, int]]:
    for number, (line, n) in enumerate(_lines(path, errors), 1):
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
        yield text, n


def _check_column(path: Path, field: str, columns: list[str], kind: str, is_string: bool) -> None:
    if field not in columns:
        raise DataError(f"{path}: no column {field!r} (its columns: {columns}); "
                        "pass --text-field to name the column that holds the text")
    if not is_string:
        raise DataError(f"{path}: column {field!r} holds {kind}, not strings")


def _null(path: Path, row: int, field: str) -> DataError:
    return DataError(f"{path}, row {row}: column {field!r} is null; every row needs a string")


def _parquet_units(path: Path, field: str) -> Iterator[tuple[str, int]]:
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
            yield text, 0
            row += 1


def _hf_units(path: Path, field: str) -> Iterator[tuple[str, int]]:
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
            yield text, 0
            row += 1
