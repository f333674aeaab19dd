"""The store's cluster link, its upkeep of the cluster's copies (``ClusterLink`` is made of this and
cluster.py; the same thread, state and lock):

::

    served here  --> touch --> TTL set anew (a quarter of the TTL apart) --> absent? lost: written back
    a put of blocks held here, not known there --> asked about (_verify) --> absent? written back
    the cluster back after a failover --> the blocks written last asked about again (_recheck)

A block written back is one this host holds; an operator's evict of it (its mark) is checked as it is
written (cluster.py ``_write``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice
from typing import TYPE_CHECKING

from kvstore.tiers.cluster import ClusterTier, ClusterUnavailable

if TYPE_CHECKING:
    from kvstore.store.index import BlockIndex
    from kvstore.store.sessions import SessionTable
    from kvstore.store.writer import WriteThrough

REFRESH_SHARE = 0.25  # a block served here has its cluster TTL set anew once this share of it has passed
REFRESH_MEMORY = 1 << 16  # blocks whose last refresh is remembered (~8 MB); the others are refreshed again
REFRESH_BATCH = 256  # TTLs set in one round trip
RECHECK = 4096  # blocks known to be in the cluster last, looked up again once it is back after being down
UNSENT_LIMIT = 1 << 16  # dropped blocks remembered to send again (2 MiB of keys, ~7 MB as Python objects)


class ClusterUpkeep:
    """TTL refreshes of what this host serves, and write-backs of what the cluster lost."""

    if TYPE_CHECKING:
        cluster: ClusterTier
        _lock: threading.RLock
        _unsent_lock: threading.Lock
        _index: BlockIndex
        _sessions: SessionTable
        _writer: WriteThrough
        _reconnects: int
        _there: OrderedDict[bytes, None]
        _unsent: dict[bytes, bool]
        _refused_codec: OrderedDict[bytes, None]
        _unknown: OrderedDict[bytes, None]
        _evicted: OrderedDict[bytes, None]
        _refreshed: OrderedDict[bytes, float]
        _refresh_due: OrderedDict[bytes, None]
        _records_due: dict[str, None]
        _records_refreshed: OrderedDict[str, float]

        def _dropped(
            self,
            keys: Sequence[bytes],
            counted: set[bytes] | frozenset[bytes] = frozenset(),
            *,
            count: bool = True,
            back: bool | None = None,
        ) -> None: ...

        def _known_there(self, keys: Sequence[bytes]) -> None: ...

    def _check_held(self, new: list[bytes], touched: Sequence[bytes]) -> None:
        """Blocks of a put found held here (``touched`` less ``new``) whose presence in the cluster
        this process does not know: queued for ``_verify``. After a restart every block is such a
        block once: the blocks an outage kept from the cluster before it would else never go (no put
        sends a block it holds), and other hosts miss the conversation from the first of them."""
        fresh = set(new)
        with self._unsent_lock:
            idle = not self._unknown
            for k in touched:
                if (
                    k in fresh
                    or k in self._there
                    or k in self._unsent
                    or k in self._refused_codec
                    or k in self._evicted
                ):
                    continue
                self._unknown[k] = None
            while len(self._unknown) > UNSENT_LIMIT:  # the oldest are asked about at a later put
                self._unknown.popitem(last=False)
            waiting = bool(self._unknown)
        if idle and waiting:
            self._writer.run_soon(self._verify)

    def _verify(self) -> None:
        """(The cluster thread.) Ask the cluster which of the blocks ``_check_held`` queued it holds:
        those it holds are known from now on, those it lacks are written (held here still, and not on
        their way already: queued for writing, or dropped and to go with the next put of them)."""
        queued = self._writer.queued()  # none is being written: this is the writer's thread
        while True:
            with self._unsent_lock:
                batch = list(islice(self._unknown, REFRESH_BATCH))
                for k in batch:
                    del self._unknown[k]
            if not batch:
                return
            try:
                found = self.cluster.exists(batch)
            except ClusterUnavailable:  # asked again at a later put of them
                return
            with self._unsent_lock:
                self._known_there([k for k, there in zip(batch, found, strict=True) if there])
                absent = [
                    k
                    for k, there in zip(batch, found, strict=True)
                    if not there and k not in queued and k not in self._unsent
                ]
            self._send_held(absent)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Blocks served from this host's tiers: their cluster copies' TTL is set anew on the cluster
        thread, each at most once per REFRESH_SHARE of the TTL. Only reads from the cluster refreshed
        it: a prefix this host serves all day (a system prompt) expired for every other host, and
        with it, lookups being prefix-closed, every conversation built on it."""
        ttl = self.cluster.ttl
        if not keys or not math.isfinite(ttl):
            return
        now, every = time.monotonic(), ttl * REFRESH_SHARE
        with self._unsent_lock:
            idle = not self._refresh_due
            due = [k for k in keys if now - self._refreshed.get(k, -math.inf) >= every]
            self._remember(due, now)
            self._refresh_due.update(dict.fromkeys(due))
            while len(self._refresh_due) > REFRESH_MEMORY:  # the cluster thread is behind: the oldest
                self._refreshed.pop(self._refresh_due.popitem(last=False)[0], None)  # go, asked again later
            waiting = bool(self._refresh_due)
        if due:
            with self._lock:  # the conversations this host knows that end at these blocks
                names = [n for k in due for n in self._sessions.ending_at(k)]
            self._touch_records(names)
        if waiting and idle:
            self._writer.run_soon(self._refresh)

    def _touch_records(self, names: Sequence[str]) -> None:
        """Sessions whose last block was just served (from this host's tiers, or read from the
        cluster): their records' TTL is set anew on the cluster thread, each at most once per
        REFRESH_SHARE of the TTL. A session's record lives as long as its blocks: one that expired
        while they lived on lost the conversation for inspect and prefetch on other hosts, and for
        evict of another session, which no longer saw that it builds on it."""
        ttl = self.cluster.ttl
        if not names or not math.isfinite(ttl):
            return
        now, every = time.monotonic(), ttl * REFRESH_SHARE
        with self._unsent_lock:
            due = [
                n for n in dict.fromkeys(names) if now - self._records_refreshed.get(n, -math.inf) >= every
            ]
            for n in due:
                self._records_refreshed[n] = now
                self._records_refreshed.move_to_end(n)
            while len(self._records_refreshed) > REFRESH_MEMORY:
                self._records_refreshed.popitem(last=False)
            self._records_due.update(dict.fromkeys(due))
        if due:
            self._writer.run_soon(self._refresh)

    def _remember(self, keys: Sequence[bytes], now: float) -> None:
        """(``_unsent_lock`` held.) ``keys`` had their cluster TTL set at ``now``."""
        for k in keys:
            self._refreshed[k] = now
            self._refreshed.move_to_end(k)
        while len(self._refreshed) > REFRESH_MEMORY:
            self._refreshed.popitem(last=False)

    def _refresh(self) -> None:
        """(The cluster thread.) Set anew the TTL of the blocks ``touch`` found due, a batch at a time,
        then of the session records ending at them."""
        while True:
            with self._unsent_lock:
                batch = list(islice(self._refresh_due, REFRESH_BATCH))
                for k in batch:
                    del self._refresh_due[k]
                names = [] if batch else list(self._records_due)
                if not batch:
                    self._records_due.clear()
            if not batch:
                if names:
                    try:
                        self.cluster.refresh_sessions(names)
                    except ClusterUnavailable:  # refreshed at a later touch of their tails
                        pass
                return
            try:
                absent = self.cluster.refresh(batch)
            except ClusterUnavailable:  # refreshed at a later touch instead
                with self._unsent_lock:
                    for k in batch:
                        self._refreshed.pop(k, None)
                continue
            if absent:  # the cluster lost them (its maxmemory, a failover, an operator) while this
                self._write_again(absent)  # host serves them: the blocks after them are unreachable

    def _write_again(self, keys: Sequence[bytes]) -> None:
        """(The cluster thread.) Queue for the cluster those of ``keys`` this host still holds: lookups
        are prefix-closed, so a block the cluster lost hides every block after it from other hosts,
        and no put of this host sends a block it holds. Only blocks known to have been there (a block
        not written yet is on its way; one dropped or refused for memory goes with the next put of
        it, as before). Dropped (and counted) when the queue is full, to go with the next put of them."""
        with self._unsent_lock:
            lost = [
                k for k in keys if k in self._there and k not in self._unsent and k not in self._refused_codec
            ]
            for k in lost:
                del self._there[k]
        self._send_held(lost)

    def _send_held(self, keys: Sequence[bytes]) -> None:
        """(The cluster thread.) Queue those of ``keys`` this host still holds, to be written back
        unless an operator evicted them from the cluster meanwhile (``_write`` checks); those the full
        queue refuses are dropped (counted), to go with the next put of them."""
        with self._lock:
            held = [k for k in keys if self._index.get(k) is not None]
        if held:
            refused = self._writer.submit(held, 0.0)
            if refused:
                self._dropped(refused)

    def _idle(self) -> None:
        """(The cluster thread, every tick.) The cluster came back after it was down: the blocks
        written (or read) last are looked up again (``_recheck``)."""
        n = self.cluster.reconnects
        if n != self._reconnects:
            self._reconnects = n
            self._recheck()

    def _recheck(self) -> None:
        """(The cluster thread.) A failover loses the writes its replica had not received yet: the
        newest. The RECHECK blocks known to be there last are asked about again (``_verify``), and
        those it lacks written, where they waited for a refresh a quarter of the TTL away (while this
        host served them, every other host missed the conversation from the first of them)."""
        with self._unsent_lock:
            recent = list(islice(reversed(self._there), RECHECK))[::-1]  # oldest first: parents first
            for k in recent:
                del self._there[k]
            self._unknown.update(dict.fromkeys(recent))
            while len(self._unknown) > UNSENT_LIMIT:
                self._unknown.popitem(last=False)
        self._verify()
