"""``scripts/eval.py CONFIG.yaml (load_path=CKPT | --model DIR_OR_NAME) [--out FILE] [--quantize Q] [--compile] [key=value ...]``.

Evaluates a checkpoint of the config's run, or an exported bundle / ``.gguf`` / registered model,
on the config's ``eval_loader`` (see :mod:`llm.train.evaluate`): prints a table of nats/token,
perplexity and bits per byte per evaluator, then writes the figures as JSON to ``--out``
(default: ``<save_folder>/eval.json`` for a checkpoint, ``./eval-<model>.json`` for a model).
Every bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from llm.cli.common import (BACKEND_HELP, QUANTIZE_HELP, THREADS_HELP, ArgumentParser, CliError, integer,
                            load_yaml_config, model_problem, set_threads)


def _parser(prog: str = "eval.py") -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=prog, description="Held-out cross-entropy, perplexity and bits per byte of a checkpoint or model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Options as key=value: eval_seq_len=512 eval_max_sequences=64 device_eval_batch_size=8 "
               "eval_loader.dataset.local=DIR (any config key).\n\nexample:\n"
               "  llm eval configs/shakespeare.yaml --model runs/shakespeare/model eval_max_sequences=64")
    parser.add_argument("config", help="a training config (YAML)")
    parser.add_argument("--model", help="a bundle directory, .gguf file or registered name (instead of load_path=)")
    parser.add_argument("--out", help="where to write the JSON results (default: <save_folder>/eval.json for a "
                                          "checkpoint, ./eval-<model name>.json for --model)")
    parser.add_argument("--quantize", choices=["none", "int8", "int4", "gguf"], help=QUANTIZE_HELP)
    parser.add_argument("--backend", choices=["auto", "llm", "torch"], default="auto", help=BACKEND_HELP)
    parser.add_argument("--threads", type=integer(), help=THREADS_HELP)
    parser.add_argument("--compile", action="store_true", help="run the forward through torch.compile")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. load_path=CKPT")
    return parser


def main(argv: list[str] | None = None, prog: str = "eval.py") -> int:
    """Run the command line; returns the exit status (0, or 2 for a bad input)."""
    parser = _parser(prog)
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_yaml_config(args.config, args.overrides)
        if args.model is None and not cfg.get("load_path"):
            raise CliError("give load_path=CHECKPOINT or --model DIR_OR_NAME")
        if args.model is not None and model_problem(args.model):
            raise CliError(model_problem(args.model))
        from llm.train.evaluate import default_output, evaluate, format_table, write_report

        set_threads(args.threads)
        report = evaluate(cfg, load_path=None if args.model else cfg.get("load_path"), model=args.model,
                          quantization=args.quantize, backend=args.backend, compile=args.compile)
    except (CliError, ValueError, FileNotFoundError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    print(f"{report.get('checkpoint') or report.get('model')}: {report['num_parameters']:,} parameters, "
          f"vocabulary {report['vocab_size']}, sequences of {report['seq_len']} tokens")
    print(format_table(report), flush=True)
    output = args.out or default_output(cfg, model=args.model)
    try:
        path = write_report(report, output)
    except OSError as error:
        print(f"{prog}: error: cannot write the results to {output}: {error}", file=sys.stderr)
        return 1
    print(f"results: {path} ({report['wall_seconds']:.0f} s in all)")
    return 0
