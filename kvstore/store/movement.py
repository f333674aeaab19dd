"""Moving blocks between tiers: making room, demotion, dropping subtrees, promotion, corruption.

::

    make_room(t)  -> victim = LRU unpinned block of tier t, leaf-first (victims.py)
      evict_from(t, victim):
        no copy above t nor in t+1 ............ demote: read t's copy, place it in t+1 (make_room(t+1)), drop t's
        another tier holds a copy ............. drop the copy in t
        t held the only copy (last tier) ...... drop the block and its descendants everywhere (prefix-closed)

Every method here expects the store's lock to be held by the caller. So that
codec work stays outside the lock where it can, the store encodes the frames
an operation will most likely need before taking the lock and hands them in
as ``ready`` (key -> (tier, frame)); ``place`` stores such a frame as it is
and encodes under the lock only what was not foreseen.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from kvstore.codecs.frame import Buffer
from kvstore.errors import CodecError, FrameError, KVStoreError
from kvstore.record import ENGINE_KEY, BlockRecord
from kvstore.store.counts import TierCounters
from kvstore.store.index import LOSSY, TIER_MASK, Entry, Pending
from kvstore.store.parts import StoreParts
from kvstore.store.sessions import SessionState
from kvstore.store.victims import Victims
from kvstore.tiers.base import TierFull, TierIOError

Frames = Mapping[bytes, tuple[int, Buffer]]  # key -> (tier, frame) encoded before the lock was taken
NO_FRAMES: Frames = MappingProxyType({})

PLACE_TRIES = 8  # puts into a tier that said it was full after room was made for the block
DISK_BACKOFF = 1.0  # seconds after the disk refused a block in which no block pushed down tries it again

log = logging.getLogger("kvstore.store")


class Mover:
    """Tier movements over one index."""

    def __init__(self, parts: StoreParts, persist_session: Callable[[SessionState], None]) -> None:
        """``persist_session``: called with each session whose tail moves up because its block went."""
        self.tiers, self.index, self.pins = parts.tiers, parts.index, parts.pins
        self.sessions, self.namespaces = parts.sessions, parts.namespaces
        self.persist_session = persist_session
        self.counts = parts.counts
        self.counters = [TierCounters() for _ in parts.tiers]
        self.busy: set[bytes] = set()  # blocks in the middle of a move or write: as good as pinned
        self.unencodable = 0  # copies a tier's codec refused (inf or NaN that got in): not moved there
        self.disk_refused_at = -math.inf  # when nvme last refused a block (I/O error, no pages left)
        self._refusal_logged = False  # since it last took one
        # blocks held in memory whose nvme copy went (for room, or evict --tier nvme): not on disk, so
        # a flush is not durable while one of them is indexed without an nvme copy (``displaced``)
        self._displaced: set[bytes] = set()
        self.victims = Victims(self)

    # -- checks -----------------------------------------------------------------------
    def pinned(self, e: Entry) -> bool:
        return e.key in self.busy or self.pins.is_pinned(e.key)

    def subtree_pinned(self, e: Entry) -> bool:
        return any(self.pinned(d) for d in self.index.subtree(e))

    def owed(self, e: Entry) -> bool:
        """Whether ``e`` is a block flush must still write: there is an nvme tier and no copy on it."""
        t = self.tiers.nvme_t
        return t is not None and not e.tiers & (1 << t)

    def disk_refusing(self) -> bool:
        """Whether nvme failed a write (an I/O error, not a full disk: that is a smaller capacity) within
        the last DISK_BACKOFF seconds, and has taken no block since.
        Meanwhile no block it owes is pushed out for room (flush answers not durable, rather than
        durable without it): ``victim`` passes over them, and over a last-tier block with one of them
        below it; a put that finds no other room is refused."""
        return self.disk_refused_at != -math.inf and time.monotonic() - self.disk_refused_at < DISK_BACKOFF

    def disk_refused(self, key: bytes, err: KVStoreError) -> None:
        """(Lock held.) nvme refused block ``key`` (the caller counts it): logged once until the disk
        takes a block again."""
        if not self._refusal_logged:
            self._refusal_logged = True
            log.warning(
                "nvme refused block %s (%s): blocks not yet on disk stay in memory, and puts that "
                "need their room are refused, until it takes writes again",
                key.hex()[:16],
                err,
            )
        self.disk_refused_at = time.monotonic()

    def disk_took(self) -> None:
        """(Lock held.) nvme took a block: it is not refusing writes (any more)."""
        if self.disk_refused_at != -math.inf:
            self.disk_refused_at = -math.inf
            if self._refusal_logged:
                self._refusal_logged = False
                log.warning("nvme takes writes again")

    # -- making room ------------------------------------------------------------------
    def make_room(
        self,
        t: int,
        block: torch.Tensor | None,
        frame_bytes: int = 0,
        *,
        position: int | None = None,
        ready: Frames = NO_FRAMES,
    ) -> bool:
        """Push blocks out of tier ``t`` until ``block`` (or a frame of ``frame_bytes`` for a frame
        tier) fits. ``position``: the block's index in its prefix, which picks the nvme tier's codec (a
        head block's frame is larger). ``ready``: frames encoded for the blocks pushed down. False when
        only pinned blocks are left."""
        if not self._fits(t, block, frame_bytes, position, empty=True):
            return False  # larger than the tier itself: nothing is pushed out for it
        tried: set[bytes] = set()
        while not self._fits(t, block, frame_bytes, position):
            e = self.victims.victim(t, tried)
            if e is None:
                return False
            tried.add(e.key)
            self.evict_from(t, e, ready)
        return True

    def _fits(
        self,
        t: int,
        block: torch.Tensor | None,
        frame_bytes: int,
        position: int | None,
        *,
        empty: bool = False,
    ) -> bool:
        """Whether ``block`` (or a ``frame_bytes`` frame) fits in tier ``t`` now; ``empty``: were it empty."""
        frames, nvme = self.tiers.frames(t), self.tiers.nvme
        if block is None:
            if frames is None:
                return False
            return frames.could_hold_frame(frame_bytes) if empty else frames.can_put_frame(frame_bytes)
        if t == self.tiers.nvme_t and nvme is not None:
            return nvme.could_hold(block, position) if empty else nvme.can_put(block, position)
        return self.tiers[t].could_hold(block) if empty else self.tiers[t].can_put(block)

    def evict_from(self, t: int, e: Entry, ready: Frames = NO_FRAMES, *, for_room: bool = True) -> bool:
        """Make tier ``t`` let go of ``e`` (see the module sketch). True when ``t`` no longer holds it.
        ``for_room`` (not an operator's evict): an nvme copy of a block memory keeps that goes is
        counted as displaced, and a flush is not durable until it is written again."""
        bit = 1 << t
        if not e.tiers & bit:
            return True
        if t < self.tiers.last and not e.tiers & (bit - 1) and not e.tiers & (bit << 1):
            return self.demote(e, t, ready)  # no copy above, none in the next tier: it moves down
        if e.tiers & TIER_MASK & ~bit:
            if t == self.tiers.nvme_t and not self.keep_record(e):
                # its record is unreadable: the block cannot outlive this copy, so it goes whole, once
                # nothing below it is read
                if self.subtree_pinned(e):
                    return False
                self.drop_block(e)
                return True
            self.drop_copy(e, t)
            if t == self.tiers.nvme_t and for_room:
                self._displace(e)
            return True
        if self.subtree_pinned(e):
            return False
        self.drop_block(e)
        return True

    def _displace(self, e: Entry) -> None:
        """``e``'s nvme copy went for room while a memory tier keeps it: it is on no disk now."""
        if not self._displaced:  # (blocks written again since leave it at the next flush's look)
            log.warning(
                "nvme dropped the disk copy of a block still held in memory (block %s): a flush is not "
                "durable until it is written again; nvme is full of blocks also in memory, raise "
                "[nvme] capacity to keep them all",
                e.key.hex()[:16],
            )
        self._displaced.add(e.key)

    def displaced(self) -> set[bytes]:
        """(Lock held.) The indexed blocks that lost their nvme copy while held in memory and have not
        been written to nvme again (a put of them, or their demotion, does). Do not change it."""
        bit = 0 if self.tiers.nvme_t is None else 1 << self.tiers.nvme_t
        for k in list(self._displaced):
            e = self.index.get(k)
            if e is None or e.tiers & bit:
                self._displaced.discard(k)
        return self._displaced

    def demote(self, e: Entry, t: int, ready: Frames = NO_FRAMES) -> bool:
        """Move ``e`` from ``t`` to ``t+1``, re-encoded from ``t``'s copy (the best one left), or
        as the frame ``ready`` holds for it; when ``t+1`` has no room (its blocks pinned, or smaller
        than the block), to the first tier below that has. Dropped only when no tier below takes it.
        False when it stays: something in its subtree is pinned, or it owes nvme a copy and the disk
        refuses writes (a block flush must write is never dropped for room: a flush after the disk
        is back would call the store durable without it)."""
        owed = self.owed(e)
        if owed and t + 1 == self.tiers.nvme_t and self.disk_refusing():
            return False
        try:
            block = None if _frame_for(ready, e, t + 1) is not None else self.tiers[t].get(e.key)
        except FrameError:
            self.corrupt(e, t)
            return True
        except KeyError:
            self.corrupt(e, t, damaged=False)  # a lost copy: the block goes if it was the last
            return True
        self.busy.add(e.key)
        try:
            placed = self.place(e, block, t + 1, ready)
        finally:
            self.busy.discard(e.key)
        if self.index.get(e.key) is not e:
            return True  # went with an ancestor while room was made below
        if not placed:
            if e.tiers & TIER_MASK & ~(1 << t):
                self.drop_copy(e, t)  # no room below, but a copy further down remains
                return True
            placed = self._place_further(e, t, block, ready)
            if self.index.get(e.key) is not e:
                return True
        if not placed:
            if self.subtree_pinned(e) or owed and self.disk_refusing():
                return False
            self.drop_block(e)
            return True
        self.drop_copy(e, t)
        self.counters[t].demotions += 1
        return True

    def _place_further(self, e: Entry, t: int, block: torch.Tensor | None, ready: Frames) -> bool:
        """(``demote``.) Place ``e``, held in ``t`` alone, in the first tier below ``t+1`` with room:
        the block must not go for want of room in one tier while another below has it."""
        for below in range(t + 2, len(self.tiers)):
            if below == self.tiers.nvme_t and self.owed(e) and self.disk_refusing():
                return False
            try:
                block = block if block is not None else self.tiers[t].get(e.key)
            except (FrameError, KeyError):
                return False  # (the copy read well a moment ago: it goes as if nothing took it)
            self.busy.add(e.key)
            try:
                if self.place(e, block, below, ready):
                    return True
            finally:
                self.busy.discard(e.key)
            if self.index.get(e.key) is not e:
                return False
        return False

    def place(self, e: Entry, block: torch.Tensor | None, t: int, ready: Frames = NO_FRAMES) -> bool:
        """Put ``block`` into tier ``t`` for indexed block ``e``, making room first. False: no room.

        A frame for ``t`` in ``ready`` (encoded before the lock was taken) is stored as it is;
        ``block`` may then be None.
        """
        if e.tiers & (1 << t):
            return True
        frames, nvme = self.tiers.frames(t), self.tiers.nvme
        frame = _frame_for(ready, e, t)
        if frame is None and block is None:
            return False
        if frame is None and frames is not None and block is not None:
            # encoded first, so that room is made for its exact size (under the lock: no frame was ready)
            try:
                frame = frames.codec.encode(block)
            except CodecError as err:
                # it never will encode: a demotion drops the block instead, or make_room would pick
                # it again and again and fail every put after it
                self.refused(e, t, err)
                return False
        for _ in range(PLACE_TRIES):
            room = (
                self.make_room(t, None, len(frame), ready=ready)
                if frame is not None
                else self.make_room(t, block, position=self.position(e), ready=ready)
            )
            if not room or self.index.get(e.key) is not e:
                return False
            try:
                if frame is not None and frames is not None:
                    frames.put_frame(e.key, frame)
                elif block is None:
                    return False  # a frame ready for a tier that does not take frames
                elif t == self.tiers.nvme_t and nvme is not None:
                    nvme.put(e.key, block, self.record(e))
                    e.pending = None
                else:
                    self.tiers[t].put(e.key, block)
            except TierFull:
                # the size estimate was short (zstd), or, on nvme, LMDB found no free run of pages
                # for the frame (the free pages are scattered, though the B-trees' size is within
                # the capacity): one more block goes, whatever the estimate says; its pages are a run
                if t == self.tiers.nvme_t and not self.push_out_one(t, e.key, ready):
                    return False  # a full disk is a smaller capacity: the block goes, as at capacity
                continue
            except TierIOError as err:  # the backing store failed
                if t == self.tiers.nvme_t:
                    self.disk_refused(e.key, err)
                    self.counts.write_failures += 1
                return False
            except KVStoreError:  # it cannot hold the record
                return False
            if t == self.tiers.nvme_t:
                self.disk_took()
            self.index.set_tier(e, t)
            return True
        return False

    def push_out_one(self, t: int, keep: bytes, ready: Frames = NO_FRAMES) -> bool:
        """Evict one block of tier ``t`` (not ``keep``) for room, after the tier refused a put that its
        estimate said fits; False when none can go."""
        tried = {keep}
        while (victim := self.victims.victim(t, tried)) is not None:
            tried.add(victim.key)
            try:
                if self.evict_from(t, victim, ready):
                    return True
            except KVStoreError:  # the disk refused even the delete (a full filesystem): no room now
                return False
        return False

    def refused(self, e: Entry, t: int, err: CodecError) -> None:
        """Count a copy of ``e`` tier ``t``'s codec cannot encode; the first one is logged."""
        self.unencodable += 1
        if self.unencodable == 1:
            log.warning(
                "tier %s cannot encode block %s (%s); it is dropped rather than kept unwritten. Later such blocks "
                "are counted, not logged",
                self.tiers.names[t],
                e.key.hex()[:16],
                err,
            )

    # -- records (what nvme stores beside the frame) ------------------------------------
    def record(self, e: Entry) -> BlockRecord:
        """The block's full record; needs ``pending`` (kept while no nvme copy exists)."""
        return self.record_of(e, self.namespaces.root(e.ns))

    @staticmethod
    def record_of(e: Entry, root: bytes) -> BlockRecord:
        """(Lock held.) ``record`` of ``e``, whose namespace's root (block 0's parent) is ``root``."""
        if e.pending is None:
            raise KVStoreError(f"block {e.key.hex()[:16]} has no record in memory to write to nvme")
        position, tokens, engine_key = e.pending
        parent = e.parent.key if e.parent is not None else root
        return BlockRecord(
            key=e.key,
            parent=parent,
            namespace=e.ns,
            position=position,
            tokens=tokens,
            extra={ENGINE_KEY: engine_key} if engine_key else {},
            sessions=e.sessions,
            created=e.created,
            last_access=e.last_access,
        )

    @staticmethod
    def position(e: Entry) -> int | None:
        """The block's index in its prefix when known in memory (kept while no nvme copy exists)."""
        return e.pending[0] if e.pending is not None else None

    def keep_record(self, e: Entry) -> bool:
        """Before the nvme copy goes while others stay: keep its position and tokens in memory."""
        nvme = self.tiers.nvme
        if e.pending is not None or nvme is None:
            return True
        try:
            rec = nvme.record(e.key)
        except (KeyError, FrameError, TierIOError):
            return False
        e.pending = Pending(rec.position, rec.tokens, rec.engine_key)
        if rec.position == 0:
            self.namespaces.note_root(e.ns, rec.parent)
        return True

    # -- dropping -----------------------------------------------------------------------
    def drop_copy(self, e: Entry, t: int) -> int:
        freed = self.tiers[t].drop(e.key)
        self.index.clear_tier(e, t)
        self.counters[t].evictions += 1
        return freed

    def drop_block(self, e: Entry) -> list[Entry]:
        """Remove ``e`` and its descendants from every tier and the index (leaves first). The nvme
        copies go first: when the disk refuses (TierIOError, TierFull), the index still names every
        block the disk holds, and nothing else has changed."""
        gone = self.index.subtree(e)
        nvme_t, nvme = self.tiers.nvme_t, self.tiers.nvme
        on_disk = [d.key for d in gone if nvme_t is not None and d.tiers & (1 << nvme_t)]
        if on_disk and nvme is not None:
            try:
                nvme.drop_many(on_disk)
            except Exception:
                # the batches before the failure are gone from the disk, the rest are not: the blocks
                # up to the last one gone leave the index too (``gone`` lists descendants first, so
                # they are whole subtrees), the rest stay as they were
                kept = next((i for i, k in enumerate(on_disk) if k in nvme), len(on_disk))
                if kept:
                    last = on_disk[kept - 1]
                    cut = next(i for i, d in enumerate(gone) if d.key == last) + 1
                    for d in gone[:cut]:
                        self._forget(d, nvme_t)
                raise
        for d in gone:
            self._forget(d, nvme_t)
        return gone

    def _forget(self, d: Entry, nvme_t: int | None) -> None:
        """``d``'s copies above nvme go (its nvme copy is gone already), and ``d`` leaves the index."""
        for t in d.tier_list():
            if t != nvme_t:
                self.tiers[t].drop(d.key)
            self.counters[t].evictions += 1
        self.index.remove(d)
        step = self.namespaces.block_tokens(d.ns)
        for s in self.sessions.tail_gone(d.key, d.parent.key if d.parent is not None else None, step):
            self.persist_session(s)

    def corrupt(self, e: Entry, t: int, *, damaged: bool = True) -> None:
        """Tier ``t``'s copy of ``e`` failed its checks (``damaged``, counted) or was not there: delete
        it; no copy left -> drop the block and its descendants. A disk that refuses the delete (a
        damaged LMDB page: its own checks fail) still never serves it: the index lets go of the copy
        (and of the blocks below it when none is left), which stays on disk until a restart finds
        it bad again."""
        self.counters[t].corrupt += damaged
        try:
            self._delete_bad(e, t)
        except (TierIOError, TierFull) as err:
            log.warning(
                "%s: a bad copy of a block could not be deleted (%s); it is no longer served",
                self.tiers.names[t],
                err,
            )
            self._unindex(e, t)

    def _unindex(self, e: Entry, t: int) -> None:
        """(A bad copy the tier could not delete.) ``e`` no longer names tier ``t``'s copy; with no
        copy left, it and its descendants go as a dropped block's do, those whose disk copies cannot
        be deleted either leaving the index all the same (their disk copies stay, unread)."""
        if self.index.get(e.key) is not e:
            return
        if e.tiers & (1 << t):
            self.index.clear_tier(e, t)
        if e.tiers & TIER_MASK:
            return
        try:
            self.drop_block(e)  # ``e`` is on no disk now: its descendants' disk copies are deleted
        except (TierIOError, TierFull):
            for d in self.index.subtree(e):  # those drop_block left (leaves first)
                self._forget(d, self.tiers.nvme_t)

    def _delete_bad(self, e: Entry, t: int) -> None:
        now = self.index.get(e.key)
        if now is not None and now is not e:
            return  # dropped and put again meanwhile: the copy there now is the new block's, checked when read
        if now is None or not e.tiers & (1 << t):
            self.tiers[t].drop(e.key)
            return
        if t == self.tiers.nvme_t and e.tiers & TIER_MASK & ~(1 << t) and not self.keep_record(e):
            self.drop_block(e)
            return
        self.tiers[t].drop(e.key)
        self.index.clear_tier(e, t)
        if not e.tiers & TIER_MASK:
            self.drop_block(e)

    # -- promotion --------------------------------------------------------------------
    def promote(self, e: Entry, block: torch.Tensor, to: int, source: int, ready: Frames = NO_FRAMES) -> bool:
        """Bring ``block`` (read from tier ``source`` below) up into tier ``to``.

        From nvme it is a copy (the durable one stays); between the memory
        tiers it is a move, so a block does not take room twice there: the
        source copy goes once ``to`` holds the block. Not before: what ``to``
        pushes down to make room may fill the room it left, and a block that
        then fits neither tier would be lost, pinned or not.
        """
        if self.index.get(e.key) is not e or e.tiers & (1 << to):
            return False
        move = source != self.tiers.nvme_t and bool(e.tiers & (1 << source))
        if move and (e.key in self.busy or self.pins.is_located(e.key)):
            return False  # a client reads its pages in place, by lease (a located read): they stay
        self.busy.add(e.key)
        try:
            placed = self.place(e, block, to, ready)
            if placed and move and e.tiers & (1 << source):
                self.tiers[source].drop(e.key)
                self.index.clear_tier(e, source)
        except KVStoreError:  # the disk refused what making room takes (a full filesystem): the block
            placed = False  # stays where it is; a promotion is never worth failing the get that asked
        finally:
            self.busy.discard(e.key)
        if placed:
            if not self.tiers.lossless[source]:
                e.tiers |= LOSSY  # the copy above holds the lower tier's error, not the original bytes
            self.counters[to].promotions += 1
        return placed


def _frame_for(ready: Frames, e: Entry, t: int) -> Buffer | None:
    got = ready.get(e.key)
    return got[1] if got is not None and got[0] == t else None
