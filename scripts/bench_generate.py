"""Benchmark decoding: greedy vs reference vs draft-model decoding, and ours vs transformers.

A thin wrapper over `llm.generation.bench`; `--help` lists the options.
"""

import sys

from llm.generation.bench import main

if __name__ == "__main__":
    sys.exit(main())
