"""Sample from a saved or registered model: `python scripts/generate.py --model DIR --prompt TEXT`.

A thin wrapper over `llm.cli.generate`; `--help` lists every flag.
"""

from llm.cli.main import launch

if __name__ == "__main__":
    launch("generate", prog="generate.py")
