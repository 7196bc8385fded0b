"""What this CPU can do, read once: its instruction-set flags and whether it computes in bfloat16
natively."""

from __future__ import annotations

import functools
import platform

#: CPU flags (as Linux's /proc/cpuinfo names them) of native bfloat16 arithmetic: AVX512-BF16
#: (Intel Cooper Lake and later, AMD Zen 4 and later) and AMX-BF16 (Intel Sapphire Rapids).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (empty where there is none:
    not Linux, or an unreadable file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):  # x86 and ARM spell it differently
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=None)
def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 products in hardware (AVX512-BF16 or AMX-BF16 on x86-64;
    BF16 on ARM (``bf16`` flag); Apple silicon M2 and later).

    Without it torch converts every bfloat16 product to float32 and back: bf16 autocast trains
    30x slower than float32 on an AVX2-only AMD Zen 3 (61 s against 1.8 s a batch of
    ``make train``). Where the flags cannot be read (not Linux), macOS on arm64 counts as native and
    anything else as not.
    """
    flags = cpu_flags()
    if flags:
        return bool(flags & (BF16_FLAGS | {"bf16"}))
    return platform.system() == "Darwin" and platform.machine() == "arm64"
