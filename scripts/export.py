"""Export a model to transformers or to GGUF (llama.cpp): `python scripts/export.py --model M --to gguf --out F`.

A thin wrapper over `llm.cli.export`; `--help` lists every flag.
"""

import sys

from llm.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
