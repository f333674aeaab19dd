"""Blocks a get read from the cluster, stored on this host after the get has answered.

::

    daemon worker: get --> fill reads the cluster's blocks into the client's staging (or the result)
                       --> reply                                  Adopter thread, one job per get:
    client: copies the blocks --> finish --> Adoption.start ----> wait for start (or ``wait`` s)
                                                                  put the blocks here (hbm), offer nvme
                                                                  Adoption.done(): staging given back
    a later lookup / get / locate / evict / stats ... --> settle: start every queued job, wait for it

Storing the blocks before answering made the client wait for a put it does not
need; storing them while the client copies them made the two compete for the
cores. ``settle`` keeps "a block served from the cluster is held here from the
next call on" true for every call that reads or changes the index.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

ADOPT_WAIT = 30.0  # seconds a call waits at most for the blocks earlier gets are storing here


@dataclass
class Adoption:
    """How a get (``Store.get(adopted=...)``) leaves storing the blocks the cluster sent to after it
    returns: on the Adopter's thread, no sooner than ``start`` is set (a daemon sets it when its
    client has copied them), ``wait`` seconds at the latest, or when a later call needs them
    (``settle``); ``done()`` is called once they are stored (or failed to be), and the get's ``out``
    is not read after that."""

    done: Callable[[], None]
    start: threading.Event = field(default_factory=threading.Event)
    wait: float = 0.0

    @classmethod
    def now(cls, done: Callable[[], None] = lambda: None) -> Adoption:
        """Stored as soon as the get has returned."""
        a = cls(done)
        a.start.set()
        return a


class Adopter:
    """One thread that stores what gets read from the cluster, in the order the gets came (a
    prefix's later blocks after its earlier ones: a put needs the block before)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-cluster-adopt")
        self._lock = threading.Lock()
        self._queued: list[tuple[Future[None], threading.Event]] = []

    def submit(self, store: Callable[[], None], adoption: Adoption) -> None:
        """Run ``store()`` once ``adoption`` lets it start, then ``adoption.done()``, whatever happens
        (at once, on this thread, when the adopter is closed)."""

        def job() -> None:
            try:
                adoption.start.wait(adoption.wait)
                store()
            except Exception:  # a block the cluster sent that this host failed to keep: it is still there
                log.exception("storing blocks read from the cluster failed")
            finally:
                adoption.done()

        try:
            queued = self._pool.submit(job)
        except RuntimeError:  # closed (the store is closing): what it would store is refused anyway
            adoption.start.set()
            job()
            return
        with self._lock:
            self._queued.append((queued, adoption.start))

    def pending(self) -> bool:
        """Whether some blocks are still to be stored."""
        with self._lock:
            self._queued = [(j, s) for j, s in self._queued if not j.done()]
            return bool(self._queued)

    def settle(self, timeout: float | None = ADOPT_WAIT) -> bool:
        """Start what is queued now and wait up to ``timeout`` seconds until it is stored; False when
        some is not yet."""
        with self._lock:
            queued = list(self._queued)
        for _, start in queued:
            start.set()
        _, left = wait([j for j, _ in queued], timeout)
        self.pending()
        return not left

    def close(self) -> None:
        """Store what is queued (at once), then stop."""
        self.settle(None)
        self._pool.shutdown(wait=True)
