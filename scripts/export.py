"""Export a model to transformers or to GGUF (llama.cpp): `python scripts/export.py --model M --to gguf --out F`.

A thin wrapper over `llm.cli.export`; `--help` lists every flag.
"""

import sys

from llm.cli.main import run

if __name__ == "__main__":
    sys.exit(run("export", prog="export.py"))
