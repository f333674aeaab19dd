"""The write-through thread: a bounded queue of block keys written to nvme off the callers' threads.

::

    put() --key--> [ bounded queue (policy.write_queue) ] --> writer thread: write(key)
                                                                   |  (read the block, encode int4,
    store tasks --> [ small unbounded task list ] ----------------->|   LMDB put, all off the caller)
                                                     every `tick` s: idle()  (TTL sweep, record updates)

Back-pressure: ``submit`` blocks the putter while the queue is full, up to
``timeout``; a key still not queued then is returned as refused and the
store keeps it in its deferred set (it is written on the next idle tick or
``flush``), so nothing is lost and a slow disk slows putters down instead of
growing memory without bound. ``drain`` waits until nothing is queued or
running: the store's ``flush`` is ``drain`` plus an LMDB sync.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from enum import Enum

log = logging.getLogger("kvstore.store.writer")


class Admission(str, Enum):
    """When a block is written through to nvme."""

    ALWAYS = "always"  # as it is stored
    SECOND_USE = "second_use"  # on its second hit (or when it is demoted there)

    def __str__(self) -> str:
        return self.value


class WriteThrough:
    """One background thread running ``write(key)`` for queued keys and ``idle()`` every ``tick`` seconds.

    Keys and tasks may be queued before ``start``; they run once it is called.
    """

    def __init__(self, *, maxsize: int = 1024, tick: float = 1.0, name: str = "kvstore-writer") -> None:
        if maxsize < 1:
            raise ValueError(f"write queue size must be at least 1, got {maxsize}")
        self._maxsize = maxsize
        self._tick = tick
        self._name = name
        self._keys: deque[bytes] = deque()
        self._tasks: deque[Callable[[], None]] = deque()
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def start(self, write: Callable[[bytes], None], idle: Callable[[], None]) -> None:
        """Start the thread: ``write(key)`` for each queued key, ``idle()`` every tick. Once only."""
        if self._thread is not None:
            raise RuntimeError("the write-through thread is already running")
        self._thread = threading.Thread(target=self._run, args=(write, idle), name=self._name, daemon=True)
        self._thread.start()

    def depth(self) -> int:
        """Keys and tasks waiting (not counting the one being written)."""
        with self._cv:
            return len(self._keys) + len(self._tasks)

    def submit(self, keys: list[bytes], timeout: float) -> list[bytes]:
        """Queue ``keys`` in order, waiting up to ``timeout`` seconds in all for room. Returns those refused."""
        deadline = time.monotonic() + timeout
        with self._cv:
            for i, k in enumerate(keys):
                while len(self._keys) >= self._maxsize and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._cv.notify_all()
                        return keys[i:]
                    self._cv.wait(min(left, 1.0))
                if self._closed:
                    return keys[i:]
                self._keys.append(k)
                self._cv.notify_all()
        return []

    def run_soon(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the writer thread (small bookkeeping: session and namespace records)."""
        with self._cv:
            if self._closed:
                task()
                return
            self._tasks.append(task)
            self._cv.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running. False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while (self._keys or self._tasks or self._busy) and self._alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 1.0)
            return not (self._keys or self._tasks or self._busy)

    def discard(self) -> tuple[int, int]:
        """Forget the keys and tasks still waiting (not the one being run); returns how many of each."""
        with self._cv:
            n = len(self._keys), len(self._tasks)
            self._keys.clear()
            self._tasks.clear()
            self._cv.notify_all()
        return n

    def close(self, timeout: float | None = None) -> bool:
        """Finish what is queued, then stop the thread. False if it did not finish within ``timeout``."""
        drained = self.drain(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        return drained and not self._alive()

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, write: Callable[[bytes], None], idle: Callable[[], None]) -> None:
        next_idle = time.monotonic() + self._tick
        while True:
            with self._cv:
                while not (self._keys or self._tasks or self._closed):
                    left = next_idle - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                if self._closed and not (self._keys or self._tasks):
                    return
                task: Callable[[], None] | None = self._tasks.popleft() if self._tasks else None
                key = self._keys.popleft() if task is None and self._keys else None
                self._busy = True
                self._cv.notify_all()  # room in the queue for a waiting putter
            try:
                if task is not None:
                    task()
                elif key is not None:
                    write(key)
                if time.monotonic() >= next_idle:
                    next_idle = time.monotonic() + self._tick
                    idle()
            except Exception:  # the thread must outlive any one bad block; the store counts failures
                log.exception("write-through failed")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
