"""Export a model to transformers or to GGUF (llama.cpp): ``llm export --model M --to gguf --out F``.

M: a saved model folder, a registered name, a .gguf file, or a training checkpoint (with --config,
the run's YAML).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llm.cli.common import ArgumentParser, describe
from llm.formats.gguf.writer import GGUF_TYPES


def build_parser(prog: str = "export.py") -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=describe(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example:\n  llm export --model runs/shakespeare/model --to gguf --gguf-type q8_0 "
                              "--out shakespeare.gguf\n  llm export --model runs/shakespeare/model --to transformers "
                              "--out shakespeare-hf")
    p.add_argument("--model", required=True,
                   help="a saved model folder, a registered name, a .gguf file, or a Composer checkpoint (.pt) with --config")
    p.add_argument("--config", help="the training YAML of a checkpoint (its model and tokenizer)")
    p.add_argument("--to", required=True, choices=["transformers", "gguf"], help="the format to write")
    p.add_argument("--out", required=True, type=Path,
                   help="the folder (transformers) or .gguf file to write (folders above it are made if missing)")
    p.add_argument("--gguf-type", choices=GGUF_TYPES, default="f32",
                   help="GGUF tensor type: f32, f16, q8_0, q4_0 or q4_1 (norms stay f32; with q4_0 / q4_1 the embedding and "
                        "output layer are q8_0, as in llama.cpp's Q4_1 files); default f32")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return p


def _load(args):
    """(model, tokenizer) of --model."""
    path = Path(args.model)
    if path.is_file() and path.suffix.lower() != ".gguf":
        if not args.config:
            raise ValueError(f"{path} is a file but not a .gguf one: a training checkpoint needs --config, the "
                             "training YAML it was written with")
        from llm.cli.common import load_yaml_config
        from llm.train.evaluate import load_for_eval
        from llm.train.checkpointing import check_checkpoint

        cfg = load_yaml_config(args.config, [])
        composer_model, data, _ = load_for_eval(cfg, load_path=str(path))
        composer_model.load_state_dict(check_checkpoint(path, composer_model))
        return composer_model.model.eval(), data.tokenizer
    if args.config:
        raise ValueError(f"--config is for a training checkpoint (a .pt file); {args.model} is not one")
    from llm.data.tokenizer import load_tokenizer
    from llm.model import MosaicGPT

    # an export writes float weights (quantized again by --gguf-type): a .gguf file is dequantized
    return MosaicGPT.from_pretrained(args.model, quantization="none"), load_tokenizer(args.model)


def main(argv: list[str] | None = None, prog: str = "export.py") -> int:
    """Run the export; returns the exit status (0; 2 with one line for a bad input; 1 with one line
    when the file system refuses the write)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.to == "transformers" and args.gguf_type != "f32":
        parser.error("--gguf-type is for --to gguf")
    if not str(args.out).strip() or str(args.out) in (".", ".."):
        parser.error(f"--out must name a folder or file to write, got {str(args.out)!r}")
    if args.to == "gguf" and args.out.suffix.lower() != ".gguf":
        parser.error(f"--out {args.out}: a GGUF file's name ends in .gguf (how llm and llama.cpp know one), "
                     f"e.g. {args.out.with_name(args.out.name + '.gguf')}")
    try:
        if args.out.exists() and not args.overwrite:
            raise FileExistsError(f"{args.out} exists: pass --overwrite to replace it")
        model, tokenizer = _load(args)
        if args.to == "transformers":
            from llm.formats.transformers import save_transformers

            arch = save_transformers(model, args.out, tokenizer, overwrite=args.overwrite)
            print(f"{args.out}: transformers {arch} model, {model.num_parameters():,} parameters")
        else:
            from llm.formats.gguf import save_gguf

            save_gguf(model, tokenizer, args.out, args.gguf_type, overwrite=args.overwrite)
            print(f"{args.out}: GGUF ({args.gguf_type}), {args.out.stat().st_size / 1e6:.1f} MB")
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as err:
        parser.error(str(err))
    except OSError as err:  # the disk's answer: permissions, a read-only or full file system
        print(f"{prog}: error: cannot write {args.out}: {err.strerror or err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
