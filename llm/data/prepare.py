"""Prepare any corpus as token shards (MosaicML Streaming MDS) for training and evaluation.

Documents are tokenized without special tokens, each followed by the tokenizer's end-of-text id,
concatenated per split and cut into rows of exactly ``seq_len`` tokens (the shorter tail is
dropped and counted). The output folder DIR holds::

    .llm_prepare.json       the run's options and inputs, written first: marks DIR as ours
    tokenizer/              transformers tokenizer folder + llm_tokenizer.json (hash, spec, ...)
    train/, validation/     MDS shards (index.json, shard.*.mds) + llm_split.json (the counts)
    llm_data.json           the manifest, written last: only a finished run has one

Each folder is written under a temporary name (``.tmp-*``) and renamed once complete, so a killed
run leaves only complete parts, which a rerun with the same options and inputs keeps. With a
validation fraction, the train pass also spools the held-out documents to ``.tmp-held-out.jsonl``
so the validation pass need not read the inputs again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from llm.data.sources import (
    ENCODING_ERRORS,
    SPLIT_MODES,
    DataError,
    Document,
    check_choice,
    input_fingerprint,
    iter_documents,
    resolve_inputs,
)
from llm.data.tokenizer import (
    INFO_FILE,
    BatchEncoder,
    eos_token_id,
    load_prepared_tokenizer,
    load_tokenizer,
    save_prepared_tokenizer,
    tokenizer_hash,
    train_tokenizer,
    trained_spec,
)
from llm.io import atomic_write

FORMAT = "llm-prepared/1"
MANIFEST_FILE = "llm_data.json"
STATE_FILE = ".llm_prepare.json"
SPLIT_FILE = "llm_split.json"
COLUMN = "tokens"
DEFAULT_SEQ_LEN = 2048
#: Share of documents held out when no validation inputs are given: enough documents for a
#: stable held-out estimate on small corpora (40 files -> about 2); lower it for large ones.
DEFAULT_VALIDATION_FRACTION = 0.05
DEFAULT_SHARD_SIZE = 1 << 25  # bytes per shard file; the writer holds up to one shard's rows in memory
_TMP_PREFIX = ".tmp-"
_BATCH_BYTES = 1 << 20  # text per batch of documents tokenized together
_BATCH_DOCS = 1024

logger = logging.getLogger(__name__)
_UMASK = os.umask(0)
os.umask(_UMASK)


def in_validation(identity: str, seed: int, fraction: float) -> bool:
    """Whether the document ``identity`` is held out for validation: the first 8 bytes of
    SHA-256(``"{seed}:{identity}"``), as a fraction of 2**64, fall below ``fraction``.

    Deterministic, decided one document at a time, and holds out about ``fraction`` of them."""
    digest = hashlib.sha256(f"{seed}:{identity}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


def token_dtype(tokenizer) -> str:
    """``"uint16"`` if every token id of ``tokenizer`` fits in 16 bits, else ``"uint32"``."""
    bound = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    return "uint16" if bound <= 1 << 16 else "uint32"


def load_manifest(directory: str | os.PathLike) -> dict:
    """The manifest (``llm_data.json``) of a finished preparation in ``directory``.

    Raises:
        DataError: if ``directory`` holds no manifest (not a prepared dataset, or a run that did
            not finish), one of another format, or a split folder without its MDS index.
    """
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not path.is_file():
        where = "" if directory.is_absolute() else f" (relative to the current folder {Path.cwd()})"
        if not directory.is_dir():
            raise DataError(f"no folder {directory}{where}: prepare one with `llm prepare`")
        raise DataError(f"no {MANIFEST_FILE} in {directory}{where}: not a prepared dataset (run `llm prepare`) "
                        "or a preparation that did not finish")
    manifest = _read_json(path)
    if manifest is None or manifest.get("format") != FORMAT:
        raise DataError(f"{path} is not a manifest of format {FORMAT!r}")
    for split in manifest["splits"]:
        if not (directory / split / "index.json").is_file():
            raise DataError(f"{directory / split} has no index.json: the preparation is damaged; prepare it again")
    return manifest


def prepare(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    tokenizer_spec: str,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    validation: Sequence[str | os.PathLike] | None = None,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    seed: int = 0,
    fmt: str = "auto",
    text_field: str = "text",
    split_documents: str = "file",
    encoding_errors: str = "strict",
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> dict:
    """Tokenize the documents of ``inputs`` into MDS shards of ``seq_len``-token rows in ``out``
    (see the module doc for the layout) and return the manifest written there.

    Rows are ``uint16`` (``uint32`` for vocabularies beyond 65536 ids) arrays in the column
    ``tokens`` (MDS encoding ``ndarray:DTYPE:SEQ_LEN``, uncompressed, ``shard_size`` bytes per
    shard). ``validation`` inputs make the validation split (all of ``inputs`` is then train);
    otherwise documents go to it by :func:`in_validation` with ``validation_fraction`` and
    ``seed`` (0: no validation split). Each split records ``documents``, ``tokens`` (with the eos
    separators, before the tail is dropped), ``bytes`` (UTF-8 of the texts), ``rows``,
    ``dropped_tokens``, ``replacements`` (U+FFFD decodes) and ``seconds``; bits per byte is
    nats/token * tokens/bytes / ln 2. ``tokenizer_spec``: see :mod:`llm.data.tokenizer`; a trained
    one sees only the train split. ``workers`` threads (default: the CPUs), each encoding a batch
    of documents on one CPU, tokenize in order, so the shards are the same for any number. Other
    options: see :func:`llm.data.sources.resolve_inputs` and :func:`llm.data.sources.read_documents`.

    If ``out`` already holds this preparation (same options and input files, sizes and mtimes)
    it is returned without work; an unfinished one is resumed, keeping its finished tokenizer
    and splits. Anything else non-empty in ``out`` is refused unless ``overwrite``, which
    deletes it first.

    Raises:
        DataError: bad inputs or options (see the sources and tokenizer functions), a split with
            fewer tokens than one row, an ``out`` holding something else, inputs inside ``out``.
    """
    _check_options(seq_len, validation_fraction, workers, shard_size, split_documents, encoding_errors)
    out = Path(out)
    train_sources = resolve_inputs(inputs, fmt)
    validation_sources = resolve_inputs(validation, fmt) if validation else None
    fraction = 0.0 if validation_sources is not None else float(validation_fraction)
    read = {"text_field": text_field, "split_documents": split_documents, "encoding_errors": encoding_errors}
    options = {
        "tokenizer": tokenizer_spec, "seq_len": seq_len, "format": fmt, **read, "seed": seed,
        "validation_fraction": None if validation_sources is not None else fraction, "shard_size": shard_size,
        "sources": [{"path": str(s.path.resolve()), "name": s.name, "format": s.format, "split": split}
                    for sources, split in ((train_sources, "train" if fraction == 0 else "train+validation"),
                                           (validation_sources or [], "validation")) for s in sources],
    }
    all_sources = train_sources + (validation_sources or [])
    trained = trained_spec(tokenizer_spec) is not None
    tokenizer = None if trained else load_tokenizer(tokenizer_spec)
    if tokenizer is not None:
        eos_token_id(tokenizer, tokenizer_spec)  # every document ends with it
    run = {"options": options, "inputs": input_fingerprint(all_sources),
           "tokenizer_hash": None if trained else tokenizer_hash(tokenizer)}
    done = _claim(out, run, overwrite, [s.path.resolve() for s in all_sources])
    if done is not None:
        return done

    docs = _Documents(train_sources, validation_sources, read, fraction, seed, out / f"{_TMP_PREFIX}held-out.jsonl")
    tokenizer, info = _tokenizer_folder(out, tokenizer, tokenizer_spec, docs, progress)
    dtype = token_dtype(tokenizer)

    stats = {}
    for split in docs.splits:
        finished = _read_json(out / split / SPLIT_FILE)
        if finished is not None and finished.get("tokenizer_hash") == info["hash"]:
            logger.info(f"keeping the finished {split} split in {out / split}")
            stats[split] = finished["stats"]
            continue
        _remove(out / split)

        def write(tmp: Path, split: str = split) -> dict:
            counts = _write_split(split, docs(split, spool=split == "train"), tmp, tokenizer=tokenizer,
                                  seq_len=seq_len, dtype=dtype, shard_size=shard_size,
                                  workers=workers or _cpu_count(), progress=progress)
            if counts["documents"] == 0:
                raise docs.none_error(split)
            if counts["rows"] == 0:
                raise DataError(f"the {split} split has {counts['tokens']} tokens, fewer than one row of --seq-len "
                                f"{seq_len}: use a smaller --seq-len or more data")
            _write_json(tmp / SPLIT_FILE, {"tokenizer_hash": info["hash"], "stats": counts})
            return counts

        stats[split] = _publish(out, split, write)
    _remove(docs.held_out)

    manifest = {"format": FORMAT, "seq_len": seq_len, "column": COLUMN, "dtype": dtype,
                "tokenizer": {"path": "tokenizer", **info}, "splits": stats, "options": options,
                "inputs": run["inputs"]}
    atomic_write(out / MANIFEST_FILE, lambda tmp: _write_json(Path(tmp), manifest))
    return manifest


class _Documents:
    """The documents of each split, read from the inputs: the ``validation`` inputs, or those of
    the train inputs that :func:`in_validation` sends there.

    A train pass with a validation fraction spools the held-out documents to ``held_out`` (JSON
    lines), so that the validation pass does not read the inputs again. ``seen`` counts the
    documents the last pass read.
    """

    def __init__(self, train_sources, validation_sources, read: dict, fraction: float, seed: int, held_out: Path):
        self.train_sources, self.validation_sources = train_sources, validation_sources
        self.read, self.fraction, self.seed, self.held_out = read, fraction, seed, held_out
        self.seen = 0
        self.separate = validation_sources is not None
        self.splits = ["train"] + (["validation"] if self.separate or fraction > 0 else [])

    def __call__(self, split: str, spool: bool = False) -> Iterator[Document]:
        if not self.separate and split == "validation" and self.held_out.is_file():
            with open(self.held_out, encoding="utf-8") as f:
                yield from (Document(*json.loads(line)) for line in f)
            return
        self.seen = 0
        spool = spool and not self.separate and self.fraction > 0
        sources = self.validation_sources if split == "validation" and self.separate else self.train_sources
        with open(self.held_out, "w", encoding="utf-8") if spool else contextlib.nullcontext() as f:
            for doc in iter_documents(sources, **self.read):
                self.seen += doc.end
                if not self.separate and self.fraction > 0 and in_validation(doc.identity, self.seed, self.fraction):
                    if split == "validation":
                        yield doc
                    elif f is not None:
                        f.write(json.dumps([doc.text, doc.identity, doc.replacements, doc.end]) + "\n")
                elif split == "train" or self.separate:
                    yield doc

    def none_error(self, split: str) -> DataError:
        """The error for a split that got no document in the last pass."""
        if self.seen == 0:
            which = "--validation inputs" if split == "validation" and self.separate else "inputs"
            return DataError(f"no documents in the {which}: every file is empty or holds only whitespace")
        return DataError(f"the {split} split gets none of the {self.seen} documents with --validation-fraction "
                         f"{self.fraction} and --seed {self.seed}: split the text into more documents "
                         "(--split-documents blank-line or line), or change --validation-fraction")


def _tokenizer_folder(out: Path, tokenizer, spec: str, docs: _Documents, progress: bool):
    """``out/tokenizer`` written unless finished (``tokenizer``, or one trained on the train split
    when it is None), and read back with its info: the data is then exactly that of
    ``--tokenizer DIR/tokenizer``."""
    folder = out / "tokenizer"
    if not (folder / INFO_FILE).is_file():
        _remove(folder)
        if tokenizer is None:
            trained_on = [0]
            with _bar("tokenizer", progress) as bar:
                tokenizer = train_tokenizer(spec, _texts(docs("train"), bar, trained_on))
            if trained_on[0] == 0:
                raise docs.none_error("train")
        _publish(out, "tokenizer", lambda tmp: save_prepared_tokenizer(tokenizer, tmp, spec))
    return load_prepared_tokenizer(folder)


def _check_options(seq_len, fraction, workers, shard_size, split_documents, encoding_errors) -> None:
    for name, value in (("--seq-len", seq_len), ("--shard-size", shard_size), ("--workers", workers)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise DataError(f"{name} must be a positive integer, got {value!r}")
    if not seq_len * 4 + 1024 <= shard_size < 1 << 32:
        raise DataError(f"--shard-size {shard_size} must hold a row of {seq_len} 4-byte tokens and a shard header "
                        f"(at least {seq_len * 4 + 1024} bytes) and be below 2**32 (MDS offsets are 32-bit)")
    if not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise DataError(f"--validation-fraction must be in [0, 1), got {fraction}")
    check_choice("--split-documents", split_documents, SPLIT_MODES)
    check_choice("--encoding-errors", encoding_errors, ENCODING_ERRORS)


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.chmod(path, 0o666 & ~_UMASK)  # atomic_write's temporary files are private (0600)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _publish(out: Path, name: str, write: Callable[[Path], dict]) -> dict:
    """Run ``write`` on a new temporary folder in ``out``, then rename it to ``out/name``."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}-", dir=out))
    os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp's folders are private (0700)
    try:
        result = write(tmp)
        tmp.rename(out / name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return result


def _claim(out: Path, run: dict, overwrite: bool, input_paths: list[Path]) -> dict | None:
    """Make ``out`` ready for ``run``; return its manifest if it already holds ``run`` finished."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; it must be a folder")
    resolved = out.resolve()
    for path in input_paths:
        if path == resolved or resolved in path.parents:
            raise DataError(f"input {path} is inside --out {out}: write the preparation to another folder")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    names = {e.name for e in entries}
    if STATE_FILE in names and all(n == STATE_FILE or n.startswith(_TMP_PREFIX) for n in names):
        # Ours with nothing finished (a run that failed early, e.g. on a bad input): start afresh.
        for entry in entries:
            _remove(entry)
        entries = []
    if entries:
        state = _read_json(out / STATE_FILE)
        same = state == json.loads(json.dumps(run))
        if same and not overwrite:
            if (out / MANIFEST_FILE).is_file():
                logger.info(f"already prepared: {out} holds this preparation (same options and inputs); nothing to do")
                return load_manifest(out)
            logger.info(f"resuming the unfinished preparation in {out}")
            for entry in entries:
                if entry.name.startswith(_TMP_PREFIX):
                    _remove(entry)
            return None
        if not overwrite:
            if state is None and not (out / MANIFEST_FILE).is_file():
                raise DataError(f"--out {out} is not empty and holds no preparation (no {MANIFEST_FILE} or "
                                f"{STATE_FILE}): refusing to touch it; choose a new or empty folder, or pass "
                                "--overwrite to replace its contents")
            kind = "a different" if (out / MANIFEST_FILE).is_file() else "an unfinished different"
            raise DataError(f"--out {out} holds {kind} preparation ({_differences(state, run)}); pass --overwrite "
                            "to replace it, or choose another --out")
        logger.info(f"--overwrite: removing the contents of {out}")
        for entry in entries:
            _remove(entry)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / STATE_FILE, lambda tmp: _write_json(Path(tmp), run))
    return None


def _differences(state: dict | None, run: dict) -> str:
    if state is None:
        return f"no readable {STATE_FILE}"
    old, new = state.get("options", {}), json.loads(json.dumps(run["options"]))
    changed = [f"--{key.replace('_', '-')}" for key in new if old.get(key) != new[key]]
    changed += ["input files (paths, sizes or times)"] if state.get("inputs") != run["inputs"] else []
    changed += ["tokenizer contents"] if state.get("tokenizer_hash") != run["tokenizer_hash"] else []
    return "differs in " + ", ".join(changed or ["its record"])


def _bar(desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(desc=desc, unit="B", unit_scale=True, file=sys.stderr,
                disable=not progress or not sys.stderr.isatty())


def _texts(documents: Iterator[Document], bar, count: list[int]) -> Iterator[str]:
    for doc in documents:
        bar.update(len(doc.text.encode("utf-8")))
        count[0] += doc.end
        yield doc.text


def _batches(documents: Iterator[Document]) -> Iterator[tuple[tuple[list[str], list[bool]], tuple[int, int, int]]]:
    """Documents grouped into batches: ((texts, ends), (documents, UTF-8 bytes, replacements)),
    ``ends[i]`` False where ``texts[i]`` is a piece that its document's next piece continues."""
    texts, ends, n_docs, n_bytes, replaced = [], [], 0, 0, 0
    for doc in documents:
        text = doc.text
        texts.append(text)
        ends.append(doc.end)
        n_docs += doc.end
        n_bytes += len(text) if text.isascii() else len(text.encode("utf-8"))  # isascii: a flag, no scan
        replaced += doc.replacements
        if n_bytes >= _BATCH_BYTES or len(texts) >= _BATCH_DOCS:
            yield (texts, ends), (n_docs, n_bytes, replaced)
            texts, ends, n_docs, n_bytes, replaced = [], [], 0, 0, 0
    if texts:
        yield (texts, ends), (n_docs, n_bytes, replaced)


class _ShardWriter:
    """Writes rows of one fixed-size ndarray column as MDS shards (Streaming's format, version 2),
    byte for byte what ``streaming.MDSWriter(out=out, columns={column: encoding}, compression=None,
    size_limit=shard_size)`` writes for the same rows, without importing Streaming (and through it
    torchvision, transformers' models, sympy...: some 200 MB of a preparing process's memory) and
    holding at most one shard's rows.

    A shard file is ``num_samples`` (uint32), the ``num_samples + 1`` byte offsets of the samples
    (uint32, from the start of the file), the writer's JSON config, then the samples, each the row's
    bytes (a fixed-size column has no size header). A shard holds as many rows as fit in
    ``shard_size`` bytes, counting 4 bytes per row for its offset and the header's other bytes.
    ``index.json`` lists the shards, written by :meth:`finish`.
    """

    def __init__(self, out: Path, column: str, encoding: str, row_bytes: int, shard_size: int):
        self.out, self.row_bytes = out, row_bytes
        self.config = {"version": 2, "format": "mds", "compression": None, "hashes": [], "size_limit": shard_size,
                       "column_names": [column], "column_encodings": [encoding], "column_sizes": [row_bytes]}
        self._config_data = json.dumps(self.config, sort_keys=True).encode("utf-8")
        # MDSWriter starts a new shard when the next sample (its bytes + a 4-byte offset) would
        # take the shard (num_samples, the final offset and the config included) past size_limit.
        self.rows_per_shard = (shard_size - 4 - 4 - len(self._config_data)) // (row_bytes + 4)
        if self.rows_per_shard < 1:
            raise ValueError(f"a shard of {shard_size} bytes cannot hold a row of {row_bytes} bytes")
        self.shards: list[dict] = []
        self._parts: list[bytes] = []
        self._rows = 0
        out.mkdir(parents=True, exist_ok=True)

    def write(self, data: bytes) -> None:
        """Append whole rows, ``data`` holding ``len(data) // row_bytes`` of them back to back."""
        if len(data) % self.row_bytes:
            raise ValueError(f"{len(data)} bytes are not whole rows of {self.row_bytes} bytes")
        start, end = 0, len(data)
        while start < end:
            take = min(end - start, (self.rows_per_shard - self._rows) * self.row_bytes)
            self._parts.append(data[start : start + take])
            self._rows += take // self.row_bytes
            start += take
            if self._rows == self.rows_per_shard:
                self._flush()

    def _flush(self) -> None:
        n = self._rows
        head = 4 + 4 * (n + 1) + len(self._config_data)
        offsets = head + self.row_bytes * np.arange(n + 1, dtype=np.int64)
        basename = f"shard.{len(self.shards):05}.mds"
        with open(self.out / basename, "wb") as f:
            f.write(np.uint32(n).tobytes())
            f.write(offsets.astype(np.uint32).tobytes())
            f.write(self._config_data)
            f.writelines(self._parts)
        self.shards.append({"samples": n, "raw_data": {"basename": basename, "bytes": head + n * self.row_bytes,
                                                       "hashes": {}}, "zip_data": None, **self.config})
        self._parts, self._rows = [], 0

    def finish(self) -> None:
        """Write the last, partly filled shard (if any) and ``index.json``."""
        if self._rows:
            self._flush()
        with open(self.out / "index.json", "w") as f:
            json.dump({"version": 2, "shards": self.shards}, f, sort_keys=True)


def _write_split(split: str, documents: Iterator[Document], out: Path, *, tokenizer, seq_len: int, dtype: str,
                 shard_size: int, workers: int, progress: bool) -> dict:
    """Write the rows of ``documents`` to MDS shards in ``out``; return the split's counts."""
    start = time.perf_counter()
    counts = dict(documents=0, tokens=0, bytes=0, rows=0, dropped_tokens=0, replacements=0)
    carry = np.empty(0, np.uint32)
    writer = _ShardWriter(out, COLUMN, f"ndarray:{dtype}:{seq_len}", seq_len * np.dtype(dtype).itemsize, shard_size)
    with BatchEncoder(tokenizer, workers) as encoder, _bar(split, progress) as bar:
        for ids, (n_docs, n_bytes, replaced) in encoder.map(_batches(documents)):
            carry = np.concatenate([carry, ids])
            rows = len(carry) // seq_len
            writer.write(carry[: rows * seq_len].astype(dtype).tobytes())
            carry = carry[rows * seq_len:]
            for key, value in (("documents", n_docs), ("tokens", len(ids)), ("bytes", n_bytes),
                               ("rows", rows), ("replacements", replaced)):
                counts[key] += value
            bar.update(n_bytes)
            bar.set_postfix(tokens=counts["tokens"], refresh=False)
    writer.finish()
    counts["dropped_tokens"] = len(carry)
    counts["seconds"] = round(time.perf_counter() - start, 3)
    return counts
