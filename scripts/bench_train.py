"""Training tokens/s: a plain PyTorch loop against ours through Composer in fp32, bf16 and bf16 compiled.

A thin wrapper over `llm.train.bench`; `--help` lists every flag. Run it alone on the machine.
"""

import sys

from llm.train.bench import main

if __name__ == "__main__":
    sys.exit(main())
