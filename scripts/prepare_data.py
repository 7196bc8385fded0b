"""Prepare any corpus as token shards: ``python scripts/prepare_data.py INPUT [INPUT ...] --out DIR --tokenizer SPEC``.

A thin wrapper over :mod:`llm.cli.prepare`; ``--help`` lists every option.
"""

from llm.cli.main import launch

if __name__ == "__main__":
    launch("prepare", prog="prepare_data.py")
