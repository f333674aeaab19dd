"""Host memory for get results: large buffers handed out again once nothing refers to them.

The kernel faults a fresh buffer's pages in, zeroed, as they are first written: 3.4 ms for 47 MB on
the 2-core VM even in huge pages, as long as copying the K/V into them takes. A get's result is
usually dropped before the next get of about the same size, so its buffer is kept (KEEP_BYTES of
free buffers at most) and handed to the next result it fits, its pages already there: the reuse
malloc makes of small buffers, and torch's caching allocators of device and pinned memory.

::

    HostBuffers.get(n) --> an array over a kept buffer of n bytes rounded up to STEP, or a new one
    ... the view is gone (the tensor made from it, and every view of that) -->
    weakref.finalize: its buffer is kept again (the oldest kept are let go past KEEP_BYTES)

Buffers below MIN_BYTES are malloc's to keep. numpy asks the kernel for huge pages for large
arrays (madvise): new buffers come from it. A result shorter than asked for (a get sizes its result
for the whole prefix, then returns the matched part) holds its whole buffer while it lives.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np

MIN_BYTES = 4 << 20  # smaller buffers: malloc's own reuse
STEP = 2 << 20  # sizes rounded up to a huge page: a kept buffer serves requests up to 2 MiB smaller
KEEP_BYTES = 512 << 20  # free buffers kept at most, all sizes together


class HostBuffers:
    """One client's free buffers (each KVStoreClient owns one), oldest first. Thread-safe: a
    finalizer runs on whatever thread drops the last reference, possibly inside another call here
    (the lock is re-entrant)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.RLock()
        self._free: OrderedDict[int, np.ndarray] = OrderedDict()  # id -> buffer, oldest first
        self.kept = 0  # bytes of the buffers in _free
        self.reused = 0  # buffers handed out again (for tests and stats)

    def get(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of uninitialised uint8 host memory: an array whose buffer is kept for reuse once
        the array is gone, and with it every view of it (numpy's and torch's: each refers to it)."""
        if nbytes < max(MIN_BYTES, 1):
            return np.empty(nbytes, dtype=np.uint8)
        size = -(-nbytes // STEP) * STEP
        buf = self._take(size)
        if buf is None:
            buf = np.empty(size, dtype=np.uint8)
        # through a memoryview: a numpy slice of ``view`` then refers to ``view`` (a slice of a plain
        # slice of ``buf`` would refer to ``buf`` directly, and outlive the finalizer's watch)
        view = np.frombuffer(buf.data[:nbytes], dtype=np.uint8)
        done = weakref.finalize(view, self._give_back, buf)
        done.atexit = False  # at exit live tensors still use it: never handed out again then
        return view

    def _take(self, size: int) -> np.ndarray | None:
        with self._lock:
            for key, buf in list(self._free.items()):  # a finalizer may add to it meanwhile
                if buf.nbytes == size:
                    del self._free[key]
                    self.kept -= size
                    self.reused += 1
                    return buf
        return None

    def _give_back(self, buf: np.ndarray) -> None:
        with self._lock:  # the bound read under the lock: a close meanwhile keeps none after it
            if buf.nbytes > self.keep_bytes:
                return
            while self._free and self.kept + buf.nbytes > self.keep_bytes:
                _, old = self._free.popitem(last=False)
                self.kept -= old.nbytes
            self._free[id(buf)] = buf
            self.kept += buf.nbytes

    def close(self) -> None:
        """Let every kept buffer go, and keep none from now on (results still held are the caller's)."""
        with self._lock:
            self.keep_bytes = 0
            self._free.clear()
            self.kept = 0
