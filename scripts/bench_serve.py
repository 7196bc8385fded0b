"""Drive scripts/serve.py (and llama-cpp-python's server, when built) with 1, 4 and 16 concurrent clients.

A thin wrapper over `llm.serve.bench`; `--help` lists every flag. Run it alone on the machine.
"""

import sys

from llm.serve.bench import main

if __name__ == "__main__":
    sys.exit(main())
