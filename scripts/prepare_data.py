"""Prepare any corpus as token shards: ``python scripts/prepare_data.py INPUT [INPUT ...] --out DIR --tokenizer SPEC``.

A thin wrapper over :mod:`llm.cli.prepare`; ``--help`` lists every option.
"""

import sys

from llm.cli.main import run

if __name__ == "__main__":
    sys.exit(run("prepare", prog="prepare_data.py"))
