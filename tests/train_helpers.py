"""Helpers for tests that train: a tiny copy of the plays, a tiny config, and test-only callbacks.

Run as a script (``python -m tests.train_helpers CONFIG.json [--kill-after N] [--record FILE]``)
it trains with :func:`llm.train.train`, recording the batches it sees and SIGKILLing itself at
the end of batch N, as a crash would; under ``composer -n 2 -m tests.train_helpers ...`` each
process runs it (data-parallel training).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from composer.core import Callback

from llm.data import VALIDATION_PLAYS, markdown_to_text, play_paths

TRAIN_PLAYS = ("julius-caesar", "macbeth", "pericles")


def make_tiny_data(directory: Path, *, tokenizer: str = "char", seq_len: int = 64, train_chars: int = 40_000,
                   validation_chars: int = 10_000) -> Path:
    """The first paragraphs of three training plays and of the four validation plays, prepared into
    token shards by :func:`llm.data.prepare.prepare` (one document per play); returns the data folder."""
    from llm.data.prepare import prepare

    text = Path(directory) / "text"
    for name, path in play_paths().items():
        if name in VALIDATION_PLAYS or name in TRAIN_PLAYS:
            split = "validation" if name in VALIDATION_PLAYS else "train"
            play = markdown_to_text(path.read_text())
            cut = play.rfind("\n\n", 0, validation_chars if split == "validation" else train_chars)
            (text / split).mkdir(parents=True, exist_ok=True)
            (text / split / f"{name}.txt").write_text(play[:cut] + "\n")
    out = Path(directory) / "data"
    prepare([text / "train"], out, tokenizer, seq_len=seq_len, validation=[text / "validation"], workers=1,
            progress=False)
    return out


def tiny_config(data_dir: Path, save_folder: Path, **overrides) -> dict:
    """A 2-layer d_model 32 model, 32-token sequences, batches of 8, a checkpoint every 2 batches, on ``data_dir``."""
    cfg = {
        "model": {"max_seq_len": 32, "d_model": 32, "n_heads": 2, "n_layers": 2},
        "train_loader": {"name": "text", "dataset": {"local": str(data_dir), "split": "train", "shuffle": True},
                         "drop_last": True},
        "eval_loader": {"name": "text", "dataset": {"local": str(data_dir), "split": "validation"}, "drop_last": False},
        "optimizer": {"name": "decoupled_adamw", "lr": 1.0e-2, "betas": [0.9, 0.95], "eps": 1.0e-8,
                      "weight_decay": 1.0e-4},
        "scheduler": {"name": "cosine_with_warmup", "t_warmup": "2ba", "alpha_f": 0.1},
        "algorithms": {"gradient_clipping": {"clipping_type": "norm", "clipping_threshold": 1.0}},
        "max_duration": "10ba",
        "eval_interval": "5ba",
        "eval_subset_num_batches": 2,
        "global_train_batch_size": 8,
        "device_eval_batch_size": 64,
        "seed": 5,
        "save_folder": str(save_folder),
        "save_interval": "2ba",
        "progress_bar": False,
        "num_samples": 0,
    }
    cfg.update(overrides)
    return cfg


def batch_digest(batch) -> str:
    """A short hash of a batch's ``input_ids``."""
    return hashlib.sha256(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16]


class BatchRecorder(Callback):
    """Appends ``"<batch> <digest of input_ids> <loss> <row digests>"`` to a file after every batch
    (fsynced, so it survives a SIGKILL). The loss is Composer's ``loss/train/total``, averaged over
    ranks; the digests are of this rank's batch; ``{rank}`` in ``path`` becomes the global rank."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)

    def batch_end(self, state, logger) -> None:
        from composer.utils import dist

        loss = state.total_loss_dict["loss/train/total"]
        rows = ",".join(sorted(batch_digest({"input_ids": row}) for row in state.batch["input_ids"]))
        with open(self.path.format(rank=dist.get_global_rank()), "a") as f:
            f.write(f"{int(state.timestamp.batch)} {batch_digest(state.batch)} {loss!r} {rows}\n")
            f.flush()
            os.fsync(f.fileno())


def read_record(path: str | os.PathLike) -> dict[int, tuple[str, float, set[str]]]:
    """:class:`BatchRecorder`'s file as ``{batch: (digest, loss, row digests)}`` (a resumed batch overwrites)."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        batch, digest, loss, row_digests = line.split()
        rows[int(batch)] = (digest, float(loss), set(row_digests.split(",")))
    return rows


class KillAfter(Callback):
    """SIGKILLs the process at the end of batch ``n``, before that batch's checkpoint is written."""

    def __init__(self, n: int):
        self.n = n

    def batch_end(self, state, logger) -> None:
        if int(state.timestamp.batch) == self.n:
            os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def extra_callbacks(*callbacks: Callback, loggers=()):
    """Within the block, :func:`llm.train.train` and :func:`llm.train.build_trainer` build their
    ``Trainer`` with ``callbacks`` (except those of a type it already has) and ``loggers`` added."""
    from composer.utils import ensure_tuple

    import llm.train.trainer

    original = llm.train.trainer.Trainer

    def trainer(*args, **kwargs):
        own = list(ensure_tuple(kwargs.get("callbacks")))
        kwargs["callbacks"] = own + [c for c in callbacks if type(c) not in {type(o) for o in own}]
        kwargs["loggers"] = [*ensure_tuple(kwargs.get("loggers")), *loggers]
        return original(*args, **kwargs)

    llm.train.trainer.Trainer = trainer
    try:
        yield
    finally:
        llm.train.trainer.Trainer = original


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    from llm.train.trainer import train

    cfg = json.loads(Path(argv[0]).read_text())
    callbacks = []
    args = iter(argv[1:])
    for arg in args:
        if arg == "--kill-after":
            callbacks.append(KillAfter(int(next(args))))
        elif arg == "--record":
            callbacks.insert(0, BatchRecorder(next(args)))
        else:
            raise SystemExit(f"unknown argument {arg}")
    with extra_callbacks(*callbacks):
        train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
