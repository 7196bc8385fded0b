"""Benchmark the data pipeline: ``python scripts/bench_data.py [--size-mb MB] [--workers N] [--json FILE]``.

Prints a markdown table: preparation throughput (``scripts/prepare_data.py`` on a generated corpus
of real text) against raw ``tokenizers`` batch encoding of the same files, the preparing process's
peak RSS, and the training loader's tokens/s against what a training step of the default model
consumes, each with its goal. See :mod:`llm.data.bench` for what is measured and how.

Runtime is dominated by tokenizing the corpus twice (raw, then prepare): at the default 1024 MB
on an otherwise idle 2-CPU machine about 12 minutes in all (writing the corpus under half a minute,
loader and training steps under a minute), several times that when other work shares the CPUs;
``--size-mb 2`` takes well under a minute. The corpus and the prepared data (about 1.9x the corpus
size on disk in all) go to a temporary folder, removed at the end.
"""

import sys

from llm.data.bench import main

if __name__ == "__main__":
    sys.exit(main())
