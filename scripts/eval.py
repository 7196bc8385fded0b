"""Evaluate a checkpoint or model on prepared held-out data: ``python scripts/eval.py CONFIG.yaml load_path=CKPT``
or ``python scripts/eval.py CONFIG.yaml --model DIR_OR_NAME [--out FILE] [key=value ...]``.

All the work is in :func:`llm.cli.eval.main` (``--help`` lists the options). On CPU it uses one
thread unless OMP_NUM_THREADS says otherwise (small models run faster on one uncontended thread).
"""

import os

import torch

from llm.cli.main import launch

if __name__ == "__main__":
    # Small CPU models run faster on one thread than on two contended ones; GPU runs are unaffected.
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    launch("eval", prog="eval.py")
