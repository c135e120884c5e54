"""The host process's allocator on a CPU run: keep freed memory for the next step instead of unmapping it.

glibc serves every allocation over its mmap threshold (at most 32 MB) with a fresh mmap and returns it with
munmap on free, so a CPU forward whose activations, logits or index scores pass 32 MB faults in and zeroes
every page of them again at every step. With mmap off (M_MMAP_MAX = 0) the heap serves them and keeps
what is freed, and with a 1 GiB trim threshold (M_TRIM_THRESHOLD) it gives memory back only past that much
free at its top. `mdi-trace check traces/examples/h200-tiny68m-zos.mdt --until 6` (tiny-68m, 2 CPU cores):
30.1 s -> 22.5 s, its system time 22.2 s -> 8.0 s, its peak resident memory 1.33 -> 1.82 GB. Set once
per process by `mdi-trace` (tui/cli.py) and by the tests; an `LLM` in a user's own process can call
`tune_cpu_allocator()` itself. Any MALLOC_* variable in the environment (glibc's own settings) leaves the
allocator as the user set it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc malloc.h
TRIM_BYTES = 1 << 30
_tuned: bool | None = None


def tune_cpu_allocator() -> bool:
    """Apply the settings above once; True where they hold (Linux with glibc, no MALLOC_* override)."""
    global _tuned
    if _tuned is None:
        _tuned = False
        if sys.platform.startswith("linux") and not any(k.startswith("MALLOC_") for k in os.environ):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.gnu_get_libc_version  # glibc only: musl's mallopt is a stub
                _tuned = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
            except (OSError, AttributeError):
                _tuned = False
    return _tuned
