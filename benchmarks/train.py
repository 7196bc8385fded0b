"""Training tokens/s on this machine: a plain PyTorch loop against ours through Composer.

Five rows, one process, the same model (a config's ``model`` section), batch, microbatches and
data (the config's prepared training shards): a nanoGPT-style loop (torch's AdamW, fp32, no
Composer), and :func:`~llm.train.trainer.train`'s Composer run in fp32 and in bf16 autocast, each
eager and compiled. Each row trains ``--batches`` batches after ``--warmup`` untimed ones, in
``--repeats`` rounds (the rows taking turns), and reports its median tokens/s, MFU against the
measured matmul peak of its dtype, and its ratio to ours in fp32.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from composer.core import Callback

from llm.cli.common import ArgumentParser, CliError, integer, load_yaml_config
from llm.train.speed import flops_per_token, measure_peak_flops


class _Clock(Callback):
    """Seconds of each training batch after the first ``skip``."""

    def __init__(self, skip: int):
        self.skip, self.times, self.start = skip, [], None

    def batch_start(self, state, logger) -> None:
        self.start = time.perf_counter()

    def batch_end(self, state, logger) -> None:
        if int(state.timestamp.batch) > self.skip:
            self.times.append(time.perf_counter() - self.start)


def _composer_row(cfg: dict, precision: str, compile_config: dict | None, batches: int, warmup: int) -> float:
    """Seconds per batch of ours through Composer."""
    from llm.train.trainer import build_trainer, resolve_config, run_data

    with tempfile.TemporaryDirectory() as tmp:
        run = resolve_config({**copy.deepcopy(cfg), "precision": precision, "compile_config": compile_config,
                              "max_duration": f"{batches + warmup}ba", "eval_interval": "1000000ba",
                              "scheduler": {**cfg["scheduler"], "t_warmup": "1ba"},
                              "save_interval": "1000000ba", "save_folder": tmp, "autoresume": False,
                              "load_path": None, "progress_bar": False, "log_to_console": False,
                              "num_samples": 0})
        clock = _Clock(warmup)
        trainer, _ = build_trainer(run, run_data(run), callbacks=[clock])
        trainer.fit()
        trainer.close()
    return sum(clock.times) / len(clock.times)


def _plain_row(cfg: dict, batches: int, warmup: int) -> float:
    """Seconds per batch of a nanoGPT-style loop: the same model and batches, torch's AdamW, fp32."""
    from llm.train.builders import build_model, build_train_loader, device_batch_size
    from llm.train.trainer import resolve_config, run_data

    run = resolve_config({**copy.deepcopy(cfg), "save_folder": tempfile.mkdtemp(), "num_samples": 0})
    data = run_data(run)
    torch.manual_seed(run["seed"])
    model = build_model(run, data.tokenizer).model.train()
    opt = run["optimizer"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=opt["betas"], eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    loader = build_train_loader(run["train_loader"], data.train, data.tokenizer, model.config.max_seq_len,
                                device_batch_size(run["global_train_batch_size"]), seed=run["seed"])
    micro = run["device_train_microbatch_size"] or run["global_train_batch_size"]
    times = []
    for step, batch in enumerate(loader):
        if step == batches + warmup:
            break
        start = time.perf_counter()
        ids, labels = batch["input_ids"], batch["labels"]
        for chunk in range(0, ids.shape[0], micro):
            logits = model(ids[chunk:chunk + micro]).logits
            targets = F.pad(labels[chunk:chunk + micro, 1:], (0, 1), value=-100)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
            (loss * min(micro, ids.shape[0] - chunk) / ids.shape[0]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return sum(times) / len(times)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m benchmarks.train", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default="configs/shakespeare.yaml")
    p.add_argument("--batches", type=integer(1), default=20, help="timed batches per row (default 20)")
    p.add_argument("--warmup", type=integer(0), default=3,
                   help="untimed batches first (compiling happens there; default 3)")
    p.add_argument("--repeats", type=integer(1), default=2,
                   help="rounds, the rows taking turns; each row reports its median (default 2)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json {args.json}: {args.json.parent} is not an existing folder")
    try:
        cfg = load_yaml_config(args.config, [])
        if not isinstance(cfg.get("model"), dict) or "max_seq_len" not in cfg["model"]:
            raise CliError(f"{args.config} is not a training config: it has no model.max_seq_len")
    except CliError as err:
        p.error(str(err))
    tokens = cfg["global_train_batch_size"] * cfg["model"]["max_seq_len"]
    from llm.config import MosaicGPTConfig

    model_cfg = {k: v for k, v in cfg["model"].items() if k != "name"}
    flops = flops_per_token(MosaicGPTConfig(**{**model_cfg, "vocab_size": 2048}), cfg["model"]["max_seq_len"])
    peaks = {"fp32": measure_peak_flops(torch.float32, seconds=2), "bf16": measure_peak_flops(torch.bfloat16, seconds=2)}
    runs = (("plain PyTorch loop (nanoGPT-style, torch AdamW), fp32", lambda: _plain_row(cfg, args.batches, args.warmup), "fp32"),
            ("ours through Composer, fp32", lambda: _composer_row(cfg, "fp32", None, args.batches, args.warmup), "fp32"),
            ("ours, fp32 compiled", lambda: _composer_row(cfg, "fp32", {}, args.batches, args.warmup), "fp32"),
            ("ours, bf16 autocast", lambda: _composer_row(cfg, "amp_bf16", None, args.batches, args.warmup), "bf16"),
            ("ours, bf16 compiled", lambda: _composer_row(cfg, "amp_bf16", {}, args.batches, args.warmup), "bf16"))
    # The rows take turns, --repeats rounds, and each reports its median: a slow spell of a shared
    # machine falls on every row rather than on one (single rounds moved rows by 20%).
    seconds = {name: [] for name, _, _ in runs}
    for round_ in range(args.repeats):
        for name, run, _ in runs:
            print(f"{name}: measuring (round {round_ + 1} of {args.repeats})", file=sys.stderr, flush=True)
            seconds[name].append(run())
    rows = []
    for name, _, dtype in runs:
        median = statistics.median(seconds[name])
        rows.append({"run": name, "tokens_per_s": tokens / median, "mfu": tokens * flops / median / peaks[dtype],
                     "peak": dtype, "seconds_per_batch": seconds[name]})
    ours = rows[1]["tokens_per_s"]
    print(f"peak matmul ({torch.get_num_threads()} threads, {2048}x{2048}): fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s; {flops / 1e6:.1f} MFLOP per token")
    print("| run | tokens/s | vs ours fp32 | MFU (of its dtype's peak) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / ours:.2f}x | {r['mfu']:.1%} |")
    if args.json:
        args.json.write_text(json.dumps({"peaks": peaks, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
