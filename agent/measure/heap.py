"""The agent's own heap in a long-lived process with a thread per job (serve, run).

Measured with 16 watched jobs (benchmarks/service_memory.py, bcc backend): every
job's thread gets a malloc arena of its own (glibc: up to 8 per core) and keeps the
memory bcc's compiler freed in it, 745 MB in all. Capping the arenas at two gives
256 MB; handing freed memory back to the system after each session's set-up
(where the compiler's memory is freed), 182 MB. Both are glibc calls; on another C
library they do nothing.
"""

from __future__ import annotations

import ctypes

_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
MALLOC_ARENAS = 2


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap malloc's arenas for this process (as MALLOC_ARENA_MAX does), before the
    per-job threads start; False where the C library has no mallopt."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    return bool(mallopt(_M_ARENA_MAX, arenas)) if mallopt is not None else False


def release_freed_memory() -> None:
    """Give the memory malloc holds freed back to the system (malloc_trim)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
