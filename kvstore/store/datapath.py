"""The store's data-path helpers: placing a new block, reading a block, after a get, frames made ahead.

::

    _store_new(e, block)      new block -> the uppermost tier that can make room (lock held)
    _read(e, device, out)     decode from the uppermost good copy into out; a bad copy is deleted (no lock held)
    _after_get(read)          hit/miss counts, touch, admission on second use, promotions (lock held)
    _prepare_demotions(keys)  ram frames of the hbm blocks a put will likely push down (no lock held)
    _prepare_promotions(read) ram frames of the blocks a get will promote from nvme (no lock held)

A mixin of Store (store.py).
"""

from __future__ import annotations

from typing import Any

import torch

from kvstore.errors import FrameError, KVStoreError
from kvstore.keys import Namespace
from kvstore.store.index import SEEN, TIER_MASK, BlockIndex, Entry
from kvstore.store.movement import Mover
from kvstore.store.writer import WriteThrough
from kvstore.tiers.base import Tier, TierFull, TierIOError


class DataPath:
    _lock: Any
    _clock: Any
    _closed: bool
    _index: BlockIndex
    _tiers: list[Tier]
    _nvme_t: int | None
    _mover: Mover
    _writer: WriteThrough | None
    _deferred: dict[bytes, None]
    _promote: bool
    _admit: str
    _write_through: bool
    _touch: Any
    _needs_record: Any

    def _prepare_promotions(
        self, read: list[tuple[Entry, torch.Tensor, int]]
    ) -> dict[bytes, tuple[int, bytes | bytearray]]:
        """Encode, before the lock is taken, the frames of blocks a get will promote into a frame tier."""
        frames: dict[bytes, tuple[int, bytes | bytearray]] = {}
        if not self._promote:
            return frames
        for e, block, t in read:
            if t > 0 and e.highest() == t and self._mover.frame_tier(t - 1):
                try:
                    frames[e.key] = (t - 1, self._tiers[t - 1].codec.encode(block))  # type: ignore[attr-defined]
                except KVStoreError:
                    continue
        return frames

    def _prepare_demotions(
        self, ns: Namespace, keys: list[bytes]
    ) -> dict[bytes, tuple[int, bytes | bytearray]]:
        """Encode, before the lock is taken, the ram frames of the hbm blocks that storing the new
        blocks among ``keys`` will most likely push down (a guess: a wrong one costs only time)."""
        if len(self._tiers) < 2 or not self._mover.frame_tier(1):
            return {}
        hbm, ram = self._tiers[0], self._tiers[1]
        page = int(getattr(hbm, "page_bytes", 1))
        cost = -(-ns.layout.block_nbytes // page) * page
        with self._lock:
            if self._closed:
                return {}
            room = sum(1 for k in keys if k not in self._index) - hbm.usage().free_bytes // cost
            victims = [e.key for e in self._mover.predict_victims(0, room)] if room > 0 else []
        frames: dict[bytes, tuple[int, bytes | bytearray]] = {}
        for k in victims:
            try:
                frames[k] = (1, ram.codec.encode(hbm.get(k)))  # type: ignore[attr-defined]
            except (KeyError, KVStoreError):
                continue  # gone meanwhile, or damaged: the locked path handles it
        return frames

    def _store_new(self, e: Entry, block: torch.Tensor) -> bool:
        """Put a new block into the uppermost tier that can make room; index it there."""
        p = e.parent
        if p is not None:
            self._mover.busy.add(p.key)  # its own descendants-to-be must not push it out
        try:
            for t, tier in enumerate(self._tiers):
                if not self._mover.make_room(t, block, position=self._mover.position(e)):
                    continue
                if p is not None and self._index.get(p.key) is not p:
                    return False
                try:
                    if t == self._nvme_t:
                        tier.put(e.key, block, self._mover.record(e))  # type: ignore[call-arg]
                        e.pending = None
                    else:
                        tier.put(e.key, block)
                except (TierFull, TierIOError):
                    continue
                self._index.add(e, t)
                return True
            return False
        finally:
            if p is not None:
                self._mover.busy.discard(p.key)

    def _read(
        self, e: Entry, device: torch.device, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """Decode ``e`` from its uppermost good copy (no lock held), into ``out`` if given (then the
        tensor returned is ``out``). None: it is gone or every copy was bad."""
        while True:
            with self._lock:
                t = e.highest() if self._index.get(e.key) is e else -1
            if t < 0:
                return None
            try:
                return self._tiers[t].get(e.key, device=device, out=out), t
            except FrameError:
                with self._lock:
                    self._mover.corrupt(e, t)
            except KeyError:
                with self._lock:
                    self._mover.corrupt(e, t, damaged=False)  # the index said it was there: a lost copy

    def _after_get(self, read: list[tuple[Entry, torch.Tensor, int]], missed: bool) -> None:
        now = self._clock()
        admit: list[bytes] = []
        for e, _block, t in read:
            counters = self._mover.counters
            counters[t].hits += 1
            for above in range(t):
                counters[above].misses += 1
            if self._index.get(e.key) is not e:
                continue
            self._touch(e, now)
            if self._admit == "second_use" and self._write_through and self._needs_record(e):
                if e.tiers & SEEN:
                    admit.append(e.key)
                e.tiers |= SEEN
        if missed:
            for c in self._mover.counters:
                c.misses += 1
        if self._promote:
            for e, block, t in read:
                if t > 0 and e.tiers & TIER_MASK and e.highest() == t:
                    self._mover.promote(e, block, t - 1, t)
        if admit and self._writer is not None:
            self._deferred.update(
                dict.fromkeys(admit)
            )  # queued from the writer's next tick: never block a get
