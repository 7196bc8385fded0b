"""Serve a model over an OpenAI-compatible HTTP API: `python scripts/serve.py --model M`.

A thin wrapper over `llm.cli.serve`; `--help` lists every flag.
"""

import sys

from llm.cli.main import run

if __name__ == "__main__":
    sys.exit(run("serve", prog="serve.py"))
