"""The worker's saves to kvstore for vLLM's connector (kvstore.integrations.vllm): one request's
load or save as the scheduler plans it (``Transfer``), and the thread that runs saves one after
another (``Saver``)."""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import ClientClosed
from kvstore.integrations.vllm_clients import Clients, VariantRefused
from kvstore.integrations.vllm_settings import Variant
from kvstore.kvbuffers import PagedKV
from kvstore.results import MISSING_PARENT

log = logging.getLogger("kvstore.integrations.vllm")

MAX_QUEUED = 256  # saves waiting at most: past it a save is dropped (the request's blocks go back sooner)
CLOSE_WAIT = 10.0  # seconds shutdown waits for the queued saves, then drops the rest


class _Cancelled(Exception):
    """The save's request was preempted: its blocks are no longer its own to read."""


@dataclass
class Transfer:
    """One request's load or save: tokens ``start .. end-1`` of ``tokens`` (its first ``end``), in
    vLLM's blocks ``block_ids`` (those of the request, from its first token)."""

    req_id: str
    variant: Variant
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int
    session: str | None = None


class Saver:
    """Saves run one after another on a thread; counts what each request still has queued.

    A save that failed (the daemon away, busy, short of room) leaves a gap that the scheduler does
    not know of: the request's next save is sent from the gap, not from where it was planned,
    or every later block of the request would be refused for its missing parent::

        planned    [0 ....... 128)[128 ... 192)[192 ... 256)
        outcome       in kvstore      failed
        sent                                   [128 ........ 256)   <- from the last block stored

    The engine never waits on the daemon here: at most MAX_QUEUED saves wait (one past it is
    dropped, as a failed one is: a gap the request's next save fills), a preemption waits only
    for a copy out of vLLM's blocks under way (``cancel``), and shutdown for CLOSE_WAIT seconds.
    """

    def __init__(self, clients: Clients) -> None:
        self._clients = clients
        self._jobs: deque[tuple[Transfer, PagedKV, Any]] = deque()
        self._pending: dict[str, int] = {}
        self._stored: dict[str, int] = {}  # request -> its tokens [0, n) known to be in kvstore
        self._running: str | None = None  # the request whose save the thread runs
        self._reading = False  # and that save is copying out of vLLM's blocks now
        self._cancelled: set[str] = set()  # the running save's request, preempted: it reads no more
        self._cv = threading.Condition()
        self._stop = False
        self.saved_blocks = 0
        self.failed_saves = 0
        self.cancelled_saves = 0
        self.dropped_saves = 0
        self._thread = threading.Thread(target=self._run, name="kvstore-save", daemon=True)
        self._thread.start()

    def submit(self, t: Transfer, paged: PagedKV, ready: Any = None) -> None:
        """Queue ``t``'s save out of ``paged``; ``ready``: a CUDA event recorded on the engine's stream
        after its forward pass was queued, waited for before the blocks are read (that stream runs
        apart from this thread's: without it the copy may read blocks the forward has not written)."""
        with self._cv:
            if len(self._jobs) >= MAX_QUEUED:  # the daemon is not keeping up: this one is not cached
                if not self.dropped_saves:
                    log.warning(
                        "kvstore saves are %d behind; dropping the newest (later ones are counted, "
                        "not logged): their blocks are recomputed, not fetched, next time",
                        len(self._jobs),
                    )
                self.dropped_saves += 1
                return
            self._jobs.append((t, paged, ready))
            self._pending[t.req_id] = self._pending.get(t.req_id, 0) + 1
            self._cv.notify_all()

    def pending(self, req_id: str) -> int:
        with self._cv:
            return self._pending.get(req_id, 0)

    def forget(self, req_id: str) -> None:
        """``req_id`` is done: no save of it comes again."""
        with self._cv:
            self._stored.pop(req_id, None)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no save is queued or running; False when ``timeout`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending, timeout)

    def cancel(self, req_ids: set[str]) -> None:
        """Drop the queued saves of ``req_ids`` (preempted: vLLM gives their blocks to others); the
        one the thread runs, if it is theirs, reads none of their blocks after this returns (a copy
        out of them under way is waited for, the daemon's calls are not). The saves of other
        requests run on. The request's next save, once resumed, is sent from the last block stored
        (see the class)."""
        with self._cv:
            kept = deque(job for job in self._jobs if job[0].req_id not in req_ids)
            self.cancelled_saves += len(self._jobs) - len(kept)
            self._jobs = kept
            for rid in req_ids:
                self._pending.pop(rid, None)
            if self._running in req_ids:
                self._pending[self._running] = 1
                self._cancelled.add(self._running)
            self._cv.wait_for(lambda: self._running not in req_ids or not self._reading)

    def cancel_all(self) -> None:
        """``cancel`` every request's saves (vLLM is putting its KV caches to sleep)."""
        with self._cv:
            req_ids = set(self._pending) | ({self._running} if self._running else set())
        self.cancel(req_ids)

    def close(self) -> None:
        """Stop, once the queued saves are done or CLOSE_WAIT seconds have passed (the rest dropped).
        A save still waiting on the daemon then ends as its client is closed (Clients.close, which
        the connector calls next), and ``join`` waits for that."""
        if not self.drain(CLOSE_WAIT):
            with self._cv:
                self.dropped_saves += len(self._jobs)
                log.warning("kvstore: %d saves not done at shutdown are dropped", sum(self._pending.values()))
                self._jobs.clear()
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def join(self, timeout: float = CLOSE_WAIT) -> None:
        self._thread.join(timeout)

    def _count(self, counter: str) -> None:
        """One more of ``counter``, under the lock: ``submit``, ``cancel`` and ``close`` count on
        the engine's threads at the same time as this one."""
        with self._cv:
            setattr(self, counter, getattr(self, counter) + 1)

    def _guarded(self, req_id: str, paged: PagedKV) -> PagedKV:
        """``paged`` whose reads of vLLM's blocks say so (``_reading``), and stop once ``req_id`` was
        preempted (``_Cancelled``): what was read before goes on to the daemon, nothing after."""
        guarded = copy.copy(paged)

        def read(t0: int, out: Any) -> Any:
            with self._cv:
                if req_id in self._cancelled:
                    raise _Cancelled(req_id)
                self._reading = True
            try:
                return paged.read(t0, out)
            finally:
                with self._cv:
                    self._reading = False
                    self._cv.notify_all()

        guarded.read = read  # type: ignore[method-assign]
        return guarded

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._stop)
                if not self._jobs:
                    return
                t, paged, ready = self._jobs.popleft()
                began: float | None = None
                self._running = t.req_id
                # the first save of a request starts where kvstore's lookup said its prefix ends
                start = min(t.start, self._stored.setdefault(t.req_id, t.start))
            try:
                if paged.device.type == "cuda":  # (a new thread starts on device 0)
                    torch.cuda.set_device(paged.device)
                if ready is not None:
                    ready.synchronize()
                if not self._clients.saves.available():
                    self._count("failed_saves")
                    continue
                client = self._clients.get(t.variant, "save")
                # the daemon takes up to max_tokens_per_request token ids a call, and every block's
                # key chains from the first token: a longer prompt is stored up to that limit
                T = client.namespace.layout.block_tokens if client.namespace is not None else 1
                end = min(t.end, self._clients.token_limit(client) // T * T)
                if end <= start:
                    continue
                began = time.monotonic()
                r = client.put_from(t.tokens[:end], self._guarded(t.req_id, paged), t.session, start=start)
                stored = end
                if r.failed:
                    first = r.failed[0]
                    log.debug("kvstore refused blocks of %s: %s", t.req_id, first)
                    # its parent missing: what the lookup said was there is gone, send all again
                    stored = (
                        0 if first.code == MISSING_PARENT and first.block * T <= start else first.block * T
                    )
                with self._cv:
                    if t.req_id not in self._cancelled:  # (cancelled: forgotten, or about to be)
                        self._stored[t.req_id] = stored
                    self.saved_blocks += r.stored
                    self.failed_saves += bool(r.failed)
            except VariantRefused:
                pass  # logged once by Clients
            except _Cancelled:
                self._count("cancelled_saves")
            except ClientClosed:  # shutting down: the save is dropped, quietly
                self._count("dropped_saves")
            except Exception as e:  # never the engine's problem: the blocks are simply not cached
                self._count("failed_saves")
                # a save waits on a busy daemon up to its time-out: one that waited it out backs off
                waited = began is not None and time.monotonic() - began >= self._clients.timeout
                self._clients.saves.failed(f"save of {t.req_id}", e, waited=waited)
            finally:
                with self._cv:
                    self._running = None
                    self._cancelled.discard(t.req_id)
                    n = self._pending.get(t.req_id, 0) - 1
                    if n > 0:
                        self._pending[t.req_id] = n
                    else:
                        self._pending.pop(t.req_id, None)
                    self._cv.notify_all()
