"""Sample from a saved or registered model: `python scripts/generate.py --model DIR --prompt TEXT`.

A thin wrapper over `llm.cli.generate`; `--help` lists every flag.
"""

import sys

from llm.cli.main import run

if __name__ == "__main__":
    sys.exit(run("generate", prog="generate.py"))
