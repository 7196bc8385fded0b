"""Export a model to transformers or to GGUF (llama.cpp): `python scripts/export.py --model M --to gguf --out F`.

A thin wrapper over `llm.cli.export`; `--help` lists every flag.
"""

from llm.cli.main import launch

if __name__ == "__main__":
    launch("export", prog="export.py")
