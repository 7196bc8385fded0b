"""Each change of the speedrun recipe on and off at equal wall time (``python -m benchmarks.ablation``).

Every variant is the config (default ``configs/shakespeare.yaml``) with some overrides. A variant is
first probed: ``--probe`` batches give its seconds per batch (after the first, which compiles a
compiled run's step) and its compiling time. It then trains the batches that fill ``--minutes`` of
training (compiling included) with its warm-up a fraction of the run, and is scored on the whole
held-out split in bits per byte. Each run is ``llm train`` in a process of its own (compiled
graphs and kernels do not carry over), reading the figures from its ``metrics.json``.

Equal wall time, not equal batches: a change that learns more per batch but costs more per batch
(Muon's orthogonalizations) is judged by what it buys in the minutes at hand.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.generate import markdown
from llm.cli.common import ArgumentParser, integer

#: (name, overrides of the config): the baseline, then one change each.
VARIANTS = [
    ("baseline (the config as it is)", []),
    ("eager (compile_config=null)", ["compile_config=null"]),
    ("Muon lr 0.02, AdamW 3e-3 for the rest", ["optimizer.name=muon", "optimizer.lr=0.02", "optimizer.adamw_lr=3e-3",
                                                "optimizer.weight_decay=0"]),
    ("warmup-stable-decay (last 40%)", ["scheduler.name=warmup_stable_decay", "scheduler.t_decay=0.4dur"]),
    ("QK-norm", ["model.qk_norm=true"]),
    ("ReLU^2 MLP (4x, no gate)", ["model.ffn_type=mlp", "model.ffn_act=relu2", "model.ffn_hidden_size=1024"]),
    ("untied output layer", ["model.tie_word_embeddings=false"]),
    ("logit soft-cap 30", ["model.logit_softcap=30"]),
    ("zero-init output projections", ["model.zero_init_residual=true"]),
]


def _train(config: str, overrides: list[str], folder: Path) -> dict:
    """``llm train config overrides`` into ``folder``; its metrics.json."""
    command = [sys.executable, "-m", "llm", "train", config, f"save_folder={folder}", "num_samples=0",
               "progress_bar=false", "autoresume=false", "save_interval=1000000ba", "eval_interval=1000000ba",
               *overrides]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads((folder / "metrics.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m benchmarks.ablation", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default="configs/shakespeare.yaml")
    p.add_argument("--minutes", type=float, default=3.0, help="training minutes per variant (default 3)")
    p.add_argument("--probe", type=integer(2), default=8, help="batches of the speed probe (default 8)")
    p.add_argument("--warmup", default="0.15dur", help="every variant's scheduler.t_warmup (default 0.15dur)")
    p.add_argument("--only", type=integer(0), nargs="+", help="run these rows of VARIANTS only (0: the baseline)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    rows = []
    chosen = [VARIANTS[i] for i in args.only] if args.only else VARIANTS
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(chosen):
            probe = _train(args.config, [*overrides, f"max_duration={args.probe}ba", "scheduler.t_warmup=1ba"],
                           Path(tmp) / f"probe{i}")
            per_batch = probe["tokens"] / probe["batches"] / probe["tokens_per_s"]
            batches = max(1, int((args.minutes * 60 - probe["compile_seconds"]) / per_batch))
            run = _train(args.config, [*overrides, f"max_duration={batches}ba", f"scheduler.t_warmup={args.warmup}"],
                         Path(tmp) / f"run{i}")
            rows.append({"variant": name, "overrides": overrides, "seconds_per_batch": per_batch, "batches": batches,
                         "train_seconds": run["train_seconds"], "compile_seconds": run["compile_seconds"],
                         "bits_per_byte": run["bits_per_byte"]})
            print(f"{name}: {batches} batches, {run['train_seconds']:.0f} s, {run['bits_per_byte']:.4f} bits/byte",
                  file=sys.stderr, flush=True)
    base = rows[0]["bits_per_byte"]
    print(f"\n{args.config}, {args.minutes:g} minutes of training each ({platform.processor() or platform.machine()}):\n")
    print(markdown([{"variant": r["variant"], "s/batch": r["seconds_per_batch"], "batches": r["batches"],
                     "training s (compiling)": f"{r['train_seconds']:.0f} ({r['compile_seconds']:.0f})",
                     "bits per byte": f"{r['bits_per_byte']:.4f}",
                     "vs the first row": f"{r['bits_per_byte'] - base:+.4f}"} for r in rows]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
