"""Where llm keeps what it builds and caches on this machine.

``$LLM_HOME`` if set, else ``$XDG_CACHE_HOME/llm`` (``~/.cache/llm``), as transformers'
``$HF_HOME`` and torch's ``$TORCH_HOME``: the CPU kernels built for this machine
(``kernels/``) and inductor's caches (``inductor/<machine>/``).
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path


def llm_home() -> Path:
    """The folder (not created here): ``$LLM_HOME``, else ``$XDG_CACHE_HOME/llm``, else ``~/.cache/llm``."""
    if os.environ.get("LLM_HOME"):
        return Path(os.environ["LLM_HOME"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm"


def _machine_key() -> str:
    """A short hash of this CPU's architecture, model and instruction-set flags (``/proc/cpuinfo``)."""
    described = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block describes them all
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    described.append(line.strip())
    except OSError:
        pass
    return hashlib.sha256("\n".join(described).encode()).hexdigest()[:12]


def use_inductor_cache() -> Path:
    """Point inductor's on-disk caches (``$TORCHINDUCTOR_CACHE_DIR``) at ``inductor/<machine>/`` under
    :func:`llm_home`, unless the user set the variable; returns the folder in use.

    Keyed by the CPU because inductor's FX-graph cache key holds no instruction set: a graph generated
    for AVX-512 and found in a home folder shared with (or moved to) another CPU model was loaded there
    and failed while it was being rebuilt (the kernels' own keys do hold the instruction set).
    """
    return Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(llm_home() / "inductor" / _machine_key())))
