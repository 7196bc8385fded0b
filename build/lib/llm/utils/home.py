"""Where llm keeps what it builds and caches on this machine.

``$LLM_HOME`` if set, else ``$XDG_CACHE_HOME/llm`` (``~/.cache/llm``), as transformers'
``$HF_HOME`` and torch's ``$TORCH_HOME``: the CPU kernels built for this machine
(``kernels/``) and inductor's caches (``inductor/``).
"""

from __future__ import annotations

import os
from pathlib import Path


def llm_home() -> Path:
    """The folder (not created here): ``$LLM_HOME``, else ``$XDG_CACHE_HOME/llm``, else ``~/.cache/llm``."""
    if os.environ.get("LLM_HOME"):
        return Path(os.environ["LLM_HOME"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm"
