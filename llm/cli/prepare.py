"""Prepare any corpus as token shards (MosaicML Streaming MDS) for training and evaluation:
``llm prepare INPUT [INPUT ...] --out DIR --tokenizer SPEC [options]``.

All the work is in :func:`llm.data.prepare.prepare`. Every bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from llm.cli.common import ArgumentParser, describe, integer
from llm.data.prepare import (
    DEFAULT_SEQ_LEN,
    DEFAULT_SHARD_SIZE,
    DEFAULT_VALIDATION_FRACTION,
    MANIFEST_FILE,
    prepare,
)
from llm.data.sources import ENCODING_ERRORS, FORMATS, SPLIT_MODES, DataError
from llm.data.tokenizer import SPEC_FORMS

PROG = "prepare_data.py"


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}")
    return value


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = ArgumentParser(prog=prog, description=describe(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example:\n  llm prepare my_texts/ --tokenizer bpe:4096 --seq-len 1024 --out data/mine")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, folders (searched recursively) or glob patterns: .txt/.md text, .jsonl/.json "
                        "JSON Lines, .parquet, or folders saved by Hugging Face datasets' save_to_disk")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created; must be new, empty or ours)")
    p.add_argument("--tokenizer", required=True, metavar="SPEC", help=f"{SPEC_FORMS}")
    p.add_argument("--seq-len", type=integer(), default=DEFAULT_SEQ_LEN,
                   help="tokens per row (default %(default)s)")
    p.add_argument("--validation", nargs="+", metavar="INPUT",
                   help="inputs of the validation split (then every INPUT is train and the fraction is ignored)")
    p.add_argument("--validation-fraction", type=_fraction, default=DEFAULT_VALIDATION_FRACTION,
                   help="share of documents held out for validation, chosen by --seed; 0: no validation split "
                        "(default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation choice (default %(default)s)")
    p.add_argument("--format", choices=FORMATS, default="auto", help="input format (default: by extension)")
    p.add_argument("--text-field", default="text", help="JSON field / column holding the text (default %(default)s)")
    p.add_argument("--split-documents", choices=SPLIT_MODES, default="file",
                   help="text files: one document per file, per blank-line-separated paragraph, or per line")
    p.add_argument("--encoding-errors", choices=ENCODING_ERRORS, default="strict",
                   help="invalid UTF-8: stop with an error, or decode as U+FFFD and count (default %(default)s)")
    p.add_argument("--workers", type=integer(), default=None, help="tokenizing processes (default: the CPUs)")
    p.add_argument("--shard-size", type=integer(), default=DEFAULT_SHARD_SIZE,
                   help="bytes per shard file (default %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace whatever --out holds")
    p.add_argument("--quiet", action="store_true", help="print only errors and warnings (no progress, no summary)")
    return p


def summary(manifest: dict, out: str | Path) -> list[str]:
    """The lines printed after a preparation: the tokenizer's vocabulary (a BPE trained on a small
    corpus can hold fewer tokens than asked), then per split its counts, tokens/byte and input MB/s."""
    tokenizer = manifest["tokenizer"]
    asked = tokenizer.get("spec", "")
    short = (asked.startswith("bpe:") and asked[4:].isdigit() and int(asked[4:]) > tokenizer["vocab_size"])
    lines = [f"tokenizer: {asked or tokenizer['path']}, {tokenizer['vocab_size']:,} tokens"
             + (f" (the corpus holds too few distinct pieces for {int(asked[4:]):,})" if short else "")]
    for split, s in manifest["splits"].items():
        rate = f"{s['bytes'] / 1e6 / s['seconds']:.2f} MB/s" if s.get("seconds") else "- MB/s"
        replaced = f", {s['replacements']:,} invalid UTF-8 sequences replaced" if s["replacements"] else ""
        lines.append(f"{split}: {s['documents']:,} documents, {s['tokens']:,} tokens, {s['bytes']:,} bytes "
                     f"({s['tokens'] / s['bytes']:.4f} tokens/byte), {s['rows']:,} rows of {manifest['seq_len']} "
                     f"({s['dropped_tokens']:,} tokens dropped), {rate}{replaced}")
    lines.append(f"manifest: {Path(out) / MANIFEST_FILE}")
    return lines


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the command; returns the exit status: 0, 2 for bad input, 130 if interrupted."""
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    logger = logging.getLogger("llm.data")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        manifest = prepare(
            args.inputs, args.out, args.tokenizer, seq_len=args.seq_len, validation=args.validation,
            validation_fraction=args.validation_fraction, seed=args.seed, fmt=args.format,
            text_field=args.text_field, split_documents=args.split_documents,
            encoding_errors=args.encoding_errors, workers=args.workers, overwrite=args.overwrite,
            progress=not args.quiet, shard_size=args.shard_size,
        )
    except (DataError, OSError) as e:
        message = str(e).replace("\n", " ")
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    if not args.quiet:
        print("\n".join(summary(manifest, args.out)))
    return 0
