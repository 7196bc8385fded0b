"""Giving memory back to the OS after a load."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> bool:
    """Return the C heap's free pages to the OS (glibc's ``malloc_trim(0)``): a load frees many
    blocks of a megabyte or so (codes before packing, float rows before quantizing), which glibc
    otherwise keeps mapped, tens of MB of a small model's resident memory. Returns whether
    anything could be asked (False off glibc)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
