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
growing memory without bound. ``drain`` waits until what was queued before a
``mark`` has run (the store's ``flush`` is that plus an LMDB sync): under a
steady load the queue is never empty, and a flush must not wait for puts
that came after it. Tasks and keys take turns, so neither starves the other.
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
        # each with the number it was queued under (from 1, in order), for drain's marks
        self._keys: deque[tuple[int, bytes]] = deque()
        self._tasks: deque[tuple[int, Callable[[], None]]] = deque()
        self._seq = 0  # the number of the latest key or task queued
        self._running: int | None = None  # the number of the key or task being run
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
                self._seq += 1
                self._keys.append((self._seq, k))
                self._cv.notify_all()
        return []

    def queued(self) -> set[bytes]:
        """The keys waiting to be written (on the writer thread, between two of its runs: all not
        written yet)."""
        with self._cv:
            return {k for _, k in self._keys}

    def run_soon(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the writer thread (small bookkeeping: session and namespace records)."""
        with self._cv:
            if self._closed:
                task()
                return
            self._seq += 1
            self._tasks.append((self._seq, task))
            self._cv.notify_all()

    @property
    def running(self) -> int | None:
        """The queue number of the key or task being run (read it on the writer thread: stable there)."""
        return self._running

    def mark(self) -> int:
        """The number of the latest key or task queued: ``drain(upto=mark())`` waits for it and those before."""
        with self._cv:
            return self._seq

    def drain(self, timeout: float | None = None, *, upto: int | None = None) -> bool:
        """Wait until nothing is queued or running (or, with ``upto``, nothing queued under that mark or
        before). False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending(upto) and self._alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 1.0)
            return not self._pending(upto)

    def _pending(self, upto: int | None) -> bool:
        """(Lock held.) Whether a key or task numbered up to ``upto`` (any, when None) waits or runs."""
        last = self._seq if upto is None else upto
        return (
            bool(self._keys and self._keys[0][0] <= last)
            or bool(self._tasks and self._tasks[0][0] <= last)
            or (self._running is not None and self._running <= last)
        )

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
        last_was_task = False
        while True:
            with self._cv:
                while not (self._keys or self._tasks or self._closed):
                    left = next_idle - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                if self._closed and not (self._keys or self._tasks):
                    return
                # turns: a stream of session rows must not hold block writes back, nor the reverse
                task: Callable[[], None] | None = None
                key: bytes | None = None
                if self._tasks and not (last_was_task and self._keys):
                    self._running, task = self._tasks.popleft()
                elif self._keys:
                    self._running, key = self._keys.popleft()
                last_was_task = task is not None
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
                    self._running = None
                    self._cv.notify_all()
