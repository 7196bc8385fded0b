"""Train MosaicGPT: ``python scripts/train.py CONFIG.yaml [key=value ...]``.

Overrides use omegaconf's dotlist syntax, e.g. ``max_duration=20ba model.n_layers=2``; all
the work is in :func:`llm.train.train`.
"""

import sys

from omegaconf import OmegaConf

from llm.train import train


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    cfg = OmegaConf.merge(OmegaConf.load(argv[0]), OmegaConf.from_dotlist(argv[1:]))
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
