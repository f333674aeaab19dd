"""The daemon keeps its codecs' scratch memory instead of handing it back to the kernel after every block.

Decoding one SmolLM2 block (1.47 MB of bf16) through int4 with rotation makes
four temporaries of 1.5-3 MB (codes as floats, the float32 block, its rotation,
the cast). glibc serves allocations that large with a fresh ``mmap`` and returns
them with ``munmap`` when freed, so every temporary is faulted in and zeroed by
the kernel page by page, on every block:

    int4 + rotation decodes, one after another into one tensor, one core
                                          8.0-10.5 ms a block -> 3.6-4.6 ms with this setting
    a daemon's get of a 2K-token prefix that only the cluster holds (31 int4 blocks decoded)
                                          0.24-0.25 s -> 0.15-0.17 s   (bench/cluster.py's setup)

``keep_scratch`` raises glibc's mmap threshold so such blocks come from the
heap, and its trim threshold so a freed one stays there for the next block.
What it costs: up to ``trim`` bytes of freed heap kept per malloc arena (an
arena per thread that allocates at once: about ten in the daemon). The pools
are unaffected: they are shared-memory segments or allocations far above the
threshold, mapped once at start. Not glibc (musl, macOS): nothing changes.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("kvstore.daemon.server")

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 2**20  # above every block-sized temporary; below glibc's per-arena heap (64 MiB)
TRIM_THRESHOLD = 64 * 2**20


def keep_scratch(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Tune this process's malloc as the module says; True when glibc took both settings."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library to ask, or one without mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
    if not ok:
        log.debug("malloc tuning not available here; codec temporaries are mapped afresh")
    return ok
