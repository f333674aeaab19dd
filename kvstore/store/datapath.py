"""The store's data path below the index: placing a new block, reading one, what a hit changes.

::

    store_new(e, block)       new block -> the uppermost tier that can make room (lock held)
    read(e, device, out)      decode from the uppermost good copy into out; a bad copy is deleted (no lock)
    after_get(read)           hit/miss counts, touch, admission on second use, promotions (lock held)
    prepare_demotions(keys)   ram frames of the hbm blocks a put will likely push down (no lock)
    prepare_promotions(read)  ram frames of the blocks a get will promote from below (no lock)

The ``prepare_*`` methods do codec work before the lock is taken; what they
return is handed to the locked step as its ``ready`` frames (see movement.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstore.codecs.frame import Buffer
from kvstore.errors import CodecError, FrameError, KVStoreError, LayoutError
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store.counts import TierCounters
from kvstore.store.index import SEEN, TIER_MASK, Entry
from kvstore.store.movement import NO_FRAMES, Frames, Mover
from kvstore.store.parts import StoreParts
from kvstore.tiers.base import TierFull, TierIOError

# a block read: its entry, the tensor (None: a client read it from shared memory; not promoted), its tier
Read = tuple[Entry, torch.Tensor | None, int]


_LOST_TRIES = 3  # reads of a copy the index holds and the tier does not find, before it counts as lost


class DataPath:
    """Block placement and reads over one index; ``touch(e, now)`` marks a block used (lock held),
    ``admit(keys)`` queues blocks for nvme on their second use (lock held)."""

    def __init__(
        self,
        parts: StoreParts,
        mover: Mover,
        touch: Callable[[Entry, float], None],
        admit: Callable[[list[bytes]], None] | None,
        *,
        promote: bool,
    ) -> None:
        """``admit``: None unless nvme admits blocks on second use only."""
        self._lock, self._tiers, self._index = parts.lock, parts.tiers, parts.index
        self._mover = mover
        self._touch = touch
        self._admit = admit
        self._promote = promote

    @property
    def promotes(self) -> bool:
        """Whether hits move blocks up a tier (``promote_on_hit``)."""
        return self._promote

    @property
    def counters(self) -> list[TierCounters]:
        return self._mover.counters

    def prepare_promotions(self, read: list[Read]) -> Frames:
        """Encode, before the lock is taken, the frames of blocks a get will promote into a frame tier."""
        frames: dict[bytes, tuple[int, Buffer]] = {}
        if not self._promote:
            return frames
        for e, block, t in read:
            if block is not None and t > 0 and e.highest() == t:
                got = self.encode_for(t - 1, block)
                if got is not None:
                    frames[e.key] = (t - 1, got)
        return frames

    def encode_for(self, t: int, block: torch.Tensor) -> Buffer | None:
        """(No lock.) ``block`` encoded for frame tier ``t``; None when ``t`` takes no frames or the
        block does not encode (the locked path then handles it)."""
        tier = self._tiers.frames(t)
        if tier is None:
            return None
        try:
            return tier.codec.encode(block)
        except KVStoreError:
            return None

    def prepare_demotions(self, ns: Namespace, keys: list[bytes]) -> Frames:
        """Encode, before the lock is taken, the ram frames of the hbm blocks that storing the new
        blocks among ``keys`` will most likely push down (a guess: a wrong one costs only time)."""
        if len(self._tiers) < 2 or self._tiers.frames(1) is None:
            return NO_FRAMES
        hbm = self._tiers[0]
        with self._lock:
            cost = max(1, hbm.block_cost(ns.layout))
            room = sum(1 for k in keys if k not in self._index) - hbm.usage().free_bytes // cost
            victims = [e.key for e in self._mover.victims.predict(0, room)] if room > 0 else []
        frames: dict[bytes, tuple[int, Buffer]] = {}
        for k in victims:
            try:
                frame = self.encode_for(1, hbm.get(k))
            except (KeyError, KVStoreError):
                continue  # gone meanwhile, or damaged: the locked path handles it
            if frame is not None:
                frames[k] = (1, frame)
        return frames

    def store_new(self, e: Entry, block: torch.Tensor, ready: Frames = NO_FRAMES) -> bool:
        """(Lock held.) Put a new block into the uppermost tier that can make room; index it there.
        False when every tier is full of pinned blocks (or ``e``'s parent went while room was made);
        nothing is indexed then. Tier failures are not raised: the next tier down is tried. When no
        tier took it and a codec refused it (inf or NaN), that CodecError is raised: the put says why."""
        p = e.parent
        if p is not None:
            self._mover.busy.add(p.key)  # its own descendants-to-be must not push it out
        refused: CodecError | None = None
        try:
            for t, tier in enumerate(self._tiers):
                if not self._mover.make_room(t, block, position=self._mover.position(e), ready=ready):
                    continue
                if p is not None and self._index.get(p.key) is not p:
                    return False
                nvme = self._tiers.nvme
                try:
                    if t == self._tiers.nvme_t and nvme is not None:
                        nvme.put(e.key, block, self._mover.record(e))
                        e.pending = None
                        self._mover.disk_took()
                    else:
                        tier.put(e.key, block)
                except CodecError as err:
                    refused = err
                    continue
                except (TierFull, TierIOError, KVStoreError):
                    continue
                self._index.add(e, t)
                return True
            if refused is not None:
                raise refused
            return False
        finally:
            if p is not None:
                self._mover.busy.discard(p.key)

    def read(
        self, e: Entry, device: torch.device, out: torch.Tensor | None = None, layout: KVLayout | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """(No lock held.) Decode ``e`` from its uppermost good copy, into ``out`` if given (then the
        tensor returned is ``out``). None: it is gone or every copy was bad (those were deleted).

        ``out`` (made in its namespace's layout) or ``layout`` (its namespace's) is what the block
        must be: a copy of another layout (a value moved under this key on disk) is a bad copy."""
        lost = 0
        while True:
            with self._lock:
                t = e.highest() if self._index.get(e.key) is e else -1
            if t < 0:
                return None
            try:
                block = self._tiers[t].get(e.key, device=device, out=out)
                if out is None and layout is not None:
                    layout.check_tensor(
                        block, tokens=layout.block_tokens, what=f"the {self._tiers.names[t]} copy"
                    )
                return block, t
            except (FrameError, LayoutError):
                with self._lock:
                    self._mover.corrupt(e, t)
            except KeyError:
                # a move between the memory tiers (a promotion) drops the source copy and puts it
                # back when the tier above has no room: read again unless it is truly lost
                lost += 1
                with self._lock:
                    if (
                        self._index.get(e.key) is e
                        and e.tiers & (1 << t)
                        and (lost > _LOST_TRIES or e.key not in self._tiers[t])
                    ):
                        self._mover.corrupt(e, t, damaged=False)  # the index says it is there: a lost copy

    def after_get(self, read: list[Read], missed: int, now: float, ready: Frames = NO_FRAMES) -> None:
        """(Lock held.) Count hits and misses, touch what was read, admit on second use, promote.
        ``missed``: the blocks asked for and not read (a miss in every tier, each)."""
        counters = self._mover.counters
        admit: list[bytes] = []
        for e, _block, t in read:
            counters[t].hits += 1
            for above in range(t):
                counters[above].misses += 1
            if self._index.get(e.key) is not e:
                continue
            self._touch(e, now)
            if self._admit is not None and self._needs_record(e):
                if e.tiers & SEEN:
                    admit.append(e.key)
                e.tiers |= SEEN
        for c in counters:  # per block, as the hits above
            c.misses += missed
        if self._promote:
            for e, block, t in read:
                if block is not None and t > 0 and e.tiers & TIER_MASK and e.highest() == t:
                    self._mover.promote(e, block, t - 1, t, ready)
        if admit and self._admit is not None:
            self._admit(admit)  # queued from the writer's next tick: never block a get

    def _needs_record(self, e: Entry) -> bool:
        t = self._tiers.nvme_t
        return t is not None and not e.tiers & (1 << t)
