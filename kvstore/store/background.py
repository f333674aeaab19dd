"""What the store's writer thread does: write-through, TTL expiry, record updates, deferred keys.

::

    write(key)   lock: find the block's best copy, build its record
                 no lock: read + decode it, encode int4, LMDB put        <- the expensive part
                 lock: mark it on nvme; if it was dropped meanwhile, drop the new copy again
    idle()       every tick: expire blocks past the TTL (with descendants), requeue deferred keys,
                 persist changed session tags / access times into the nvme records, purge lapsed pins

A mixin of Store (store.py): it uses the store's lock, index, tiers and mover.
Also here: flush and close, and the session records the writer persists.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

from kvstore.errors import FrameError, KVStoreError
from kvstore.store.index import TIER_MASK, BlockIndex, Entry
from kvstore.store.movement import Mover
from kvstore.store.pins import PinTable
from kvstore.store.sessions import SessionState
from kvstore.store.writer import WriteThrough
from kvstore.tiers.base import Tier, TierFull, TierIOError

_EXPIRE_BATCH = 10000  # blocks dropped per tick at most, so the lock is never held for long
_RECORD_BATCH = 4096


class Background:
    _lock: Any
    _clock: Any
    _index: BlockIndex
    _tiers: list[Tier]
    _nvme: Any
    _nvme_t: int | None
    _mover: Mover
    _pins: PinTable
    _writer: WriteThrough | None
    _deferred: dict[bytes, None]
    _dirty: set[bytes]
    _writing: set[bytes]
    _counts: dict[str, int]
    _ttl: float
    _backpressure: float
    _closed: bool
    _check_open: Any

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every stored block has reached nvme and LMDB is synced: the durable acknowledgement.
        False when ``timeout`` passed first (nothing is lost; a later flush goes on)."""
        if self._writer is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            keys = list(self._deferred)
            self._deferred.clear()
        self._submit(keys, wait=math.inf if deadline is None else max(0.0, deadline - time.monotonic()))
        self._writer.run_soon(self._persist_dirty)
        if not self._writer.drain(None if deadline is None else max(0.0, deadline - time.monotonic())):
            return False
        with self._lock:
            if self._deferred:
                return False
        self._nvme.sync()
        return True

    def close(self) -> None:
        """Flush, stop the writer thread and close the tiers. Further calls raise StoreClosed."""
        with self._lock:
            if self._closed:
                return
        self.flush()
        with self._lock:
            self._closed = True
        if self._writer is not None:
            self._writer.close()
        for tier in self._tiers:
            tier.close()

    def _persist_session(self, s: SessionState) -> None:
        if self._writer is not None:
            nvme, d = self._nvme, s.to_dict()
            self._writer.run_soon(lambda: nvme.put_session(s.name, d))

    def _forget_session(self, name: str) -> None:
        if self._writer is not None:
            nvme = self._nvme
            self._writer.run_soon(lambda: nvme.drop_session(name))

    def _submit(self, keys: list[bytes], wait: float | None = None) -> list[bytes]:
        """Queue keys for write-through (no lock held); those refused go to the deferred set."""
        if not keys or self._writer is None:
            return []
        refused = self._writer.submit(keys, self._backpressure if wait is None else wait)
        if refused:
            with self._lock:
                self._deferred.update(dict.fromkeys(refused))
        return refused

    def _write_one(self, key: bytes) -> None:
        """Write one block through to nvme (writer thread). Holds no pin: an explicit evict may drop
        the block meanwhile, and then the fresh nvme copy is dropped again."""
        nvme, t_n = self._nvme, self._nvme_t
        if nvme is None or t_n is None:
            return
        with self._lock:
            self._writing.add(key)  # check_integrity: the nvme copy may lead the index for a moment
        try:
            self._write_locked_steps(key, nvme, t_n)
        finally:
            with self._lock:
                self._writing.discard(key)

    def _write_locked_steps(self, key: bytes, nvme: Any, t_n: int) -> None:
        block = None
        for _ in range(3):  # a demotion may move the copy between finding and reading it
            with self._lock:
                e = self._index.get(key)
                if e is None or e.tiers & (1 << t_n) or self._closed or e.highest() < 0:
                    return
                t = e.highest()
                try:
                    rec = self._mover.record(e)
                except KVStoreError:
                    return
            try:
                block = self._tiers[t].get(key)
                break
            except KeyError:
                continue
            except FrameError:
                with self._lock:
                    self._mover.corrupt(e, t)
                return
        if block is None:
            return
        for _ in range(3):
            try:
                nvme.put(key, block, rec)
                break
            except TierFull:
                with self._lock:
                    if not self._mover.make_room(t_n, block, position=rec.position):
                        self._write_failed(key)
                        return
            except TierIOError:
                with self._lock:
                    self._write_failed(key)
                return
        else:
            with self._lock:
                self._write_failed(key)
            return
        with self._lock:
            now = self._index.get(key)
            if now is None or not now.tiers & TIER_MASK:
                nvme.drop(key)  # dropped while it was being written: do not resurrect it
                return
            self._index.set_tier(now, t_n)
            now.pending = None
            self._counts["written"] += 1
            if now.sessions != rec.sessions or now.last_access != rec.last_access:
                self._dirty.add(key)

    def _write_failed(self, key: bytes) -> None:
        """(Lock held.) ``key`` did not reach nvme (full disk, I/O error): counted, and kept among the
        deferred keys, retried at the next tick or flush, so that flush does not call it durable."""
        self._counts["write_failures"] += 1
        if key in self._index:
            self._deferred[key] = None

    def _idle(self) -> None:
        """Periodic upkeep on the writer thread."""
        self._expire()
        with self._lock:
            keys = list(self._deferred)[:1024]
            for k in keys:
                del self._deferred[k]
        self._submit(keys, wait=0.0)
        self._persist_dirty()
        with self._lock:
            self._pins.purge()

    def _expire(self) -> int:
        """Drop blocks not accessed for ``ttl`` seconds, with their descendants. Returns blocks dropped."""
        if not math.isfinite(self._ttl):
            return 0
        dropped = 0
        with self._lock:
            cutoff = self._clock() - self._ttl
            old: list[Entry] = []
            for e in self._index.entries():  # least recently accessed first: stop at the first fresh one
                if e.last_access >= cutoff or len(old) >= _EXPIRE_BATCH:
                    break
                old.append(e)
            for e in old:
                if self._index.get(e.key) is e and not self._mover.subtree_pinned(e):
                    dropped += len(self._mover.drop_block(e))
            self._counts["expired"] += dropped
        return dropped

    def _persist_dirty(self) -> None:
        """Write changed session tags and access times into the blocks' nvme records."""
        nvme, t_n = self._nvme, self._nvme_t
        if nvme is None or t_n is None:
            return
        while True:
            with self._lock:
                keys = [self._dirty.pop() for _ in range(min(len(self._dirty), _RECORD_BATCH))]
                items = []
                for k in keys:
                    e = self._index.get(k)
                    if e is not None and e.tiers & (1 << t_n):
                        items.append((k, e.sessions, e.last_access))
            if not keys:
                return
            records = []
            for k, sessions, accessed in items:
                try:
                    rec = nvme.record(k)
                except (KeyError, FrameError):
                    continue
                records.append(replace(rec, sessions=sessions, last_access=accessed))
            if records:
                nvme.update_records(records)
