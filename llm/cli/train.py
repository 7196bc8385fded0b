"""``scripts/train.py CONFIG.yaml [key=value ...]``: train MosaicGPT from an llm-foundry-style YAML config.

Overrides use omegaconf's dotlist syntax (``max_duration=20ba model.n_layers=2
train_loader.dataset.local=DIR``). The merged config is validated whole
(:func:`llm.train.config.load_train_config`) before anything is read, written or trained; a bad
config, a missing or unreadable file or a malformed override is one line on stderr,
``train.py: error: <message>``, and exit status 2; so is a run folder that another run holds, or
that holds a run trained under other settings (:mod:`llm.train.run_folder`). The work is in
:func:`llm.train.train`.
"""

from __future__ import annotations

import re
import sys

USAGE = """usage: {command} CONFIG.yaml [key=value ...]

Train MosaicGPT through Composer from an llm-foundry-style YAML config (see configs/*.yaml).
Overrides use omegaconf's dotlist syntax.

example:
  {command} configs/shakespeare.yaml max_duration=20ba scheduler.t_warmup=2ba model.n_layers=2 save_folder=runs/try

The whole config is checked before training starts: every unknown key, wrong type or bad value
is reported with its full dotted path (e.g. train_loader.dataset.split)."""


def _command(prog: str) -> str:
    """How the user typed the command: ``scripts/train.py`` or ``llm train``."""
    return f"scripts/{prog}" if prog.endswith(".py") else prog


def _one_line(message: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(message)).strip()


def _error(prog: str, message: str) -> int:
    print(f"{prog}: error: {_one_line(message)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None, prog: str = "train.py") -> int:
    """Run the command line; returns the exit status (0, or 2 for a bad command line or config)."""
    from llm.cli.common import CliError, load_yaml_config
    from llm.utils.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE.format(command=_command(prog)))
        return 0
    if not argv:
        return _error(prog, f"give a config file: {_command(prog)} CONFIG.yaml [key=value ...] (see --help)")
    if argv[0].startswith("-"):
        return _error(prog, f"unknown option {argv[0]!r}: {_command(prog)} CONFIG.yaml [key=value ...]")
    path, overrides = argv[0], argv[1:]
    try:
        cfg = load_yaml_config(path, overrides)
        from llm.train.config import load_train_config

        config = load_train_config(cfg)
    except (CliError, ConfigError) as error:
        return _error(prog, str(error))

    from llm.data.prepare import DataError
    from llm.data.streaming import PreparedDataError
    from llm.train import train
    from llm.train.callbacks import NonFiniteLossError
    from llm.train.run_folder import RunFolderError

    cfg = config.to_dict()
    try:
        train(cfg)
    # ConfigError: a check that needs the data or tokenizer (e.g. model.vocab_size).
    except (ConfigError, RunFolderError, PreparedDataError, DataError) as error:
        return _error(prog, str(error))
    except NonFiniteLossError as error:
        print(f"{prog}: error: {_one_line(error)}; {_resume_hint(cfg)}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SystemExit) as stop:
        # Composer turns SIGINT and SIGTERM into sys.exit(128 + signal) (composer.core.engine)
        code = 130 if isinstance(stop, KeyboardInterrupt) else stop.code
        if code not in (130, 143):
            raise
        print(f"\n{prog}: interrupted; {_resume_hint(cfg)}", file=sys.stderr, flush=True)
        return code
    return 0


def _resume_hint(cfg: dict) -> str:
    """What an interrupted run left: its newest checkpoint and how to go on, or that there is none."""
    from pathlib import Path

    from llm.train.checkpointing import newest_complete_checkpoint
    from llm.train.trainer import CHECKPOINT_FILENAME

    folder = Path(cfg["save_folder"])
    newest = newest_complete_checkpoint(folder, CHECKPOINT_FILENAME) if folder.is_dir() else None
    if newest is None:
        return f"no checkpoint was saved yet (every {cfg['save_interval']}), so the run starts over when rerun"
    how = "rerun the same command to resume from it" if cfg["autoresume"] else "resume with load_path=IT"
    return f"the newest checkpoint is {newest}: {how}"


if __name__ == "__main__":
    sys.exit(main())
