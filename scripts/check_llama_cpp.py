"""Check that llama.cpp decodes a GGUF export as we do: `.venv-peers/bin/python scripts/check_llama_cpp.py F.gguf`.

A thin wrapper over `llm.formats.llama_cpp_check`; needs `make bench-peers`'s environment.
"""

import sys

from llm.formats.llama_cpp_check import main

if __name__ == "__main__":
    sys.exit(main())
