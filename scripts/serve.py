"""Serve a model over an OpenAI-compatible HTTP API: `python scripts/serve.py --model M`.

A thin wrapper over `llm.cli.serve`; `--help` lists every flag.
"""

from llm.cli.main import launch

if __name__ == "__main__":
    launch("serve", prog="serve.py")
