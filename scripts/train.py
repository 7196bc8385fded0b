"""Train MosaicGPT: ``python scripts/train.py CONFIG.yaml [key=value ...]``.

Overrides use omegaconf's dotlist syntax, e.g. ``max_duration=20ba model.n_layers=2``; the config
is checked whole before anything runs, and all the work is in :func:`llm.cli.train.main`.
"""

from llm.cli.main import launch

if __name__ == "__main__":
    launch("train", prog="train.py")
