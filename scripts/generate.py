"""Sample from a saved or registered model: `python scripts/generate.py --model DIR --prompt TEXT`.

A thin wrapper over `llm.generation.cli`; `--help` lists every flag.
"""

import sys

from llm.generation.cli import main

if __name__ == "__main__":
    sys.exit(main())
