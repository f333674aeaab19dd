"""Moving blocks between tiers: making room, demotion, dropping subtrees, promotion, corruption.

::

    make_room(t)  -> victim = LRU unpinned block of tier t, leaf-first
      evict_from(t, victim):
        no copy above t nor in t+1 ............ demote: read t's copy, place it in t+1 (make_room(t+1)), drop t's
        another tier holds a copy ............. drop the copy in t
        t held the only copy (last tier) ...... drop the block and its descendants everywhere (prefix-closed)

Every method here expects the store's lock to be held by the caller. So that
codec work stays outside the lock where it can, the store encodes the frames
an operation will most likely need before taking the lock and hands them over
in ``prepared`` (key -> (tier, frame)); ``place`` stores such a frame as it is
and encodes under the lock only what was not foreseen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.errors import FrameError, KVStoreError
from kvstore.keys import Namespace
from kvstore.record import BlockRecord
from kvstore.store.index import LOSSY, TIER_MASK, BlockIndex, Entry
from kvstore.store.pins import PinTable
from kvstore.store.sessions import SessionState, SessionTable
from kvstore.tiers.base import Tier, TierFull, TierIOError

_SCAN = 64  # LRU entries examined for a leaf before settling for the oldest candidate


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # copies that left this tier (demoted, dropped, expired, evicted on request)
    demotions: int = 0  # of those, moved down one tier
    promotions: int = 0  # copies made here from a lower tier on a hit or prefetch
    corrupt: int = 0


class Mover:
    """Tier movements over one index. ``nvme_tier``: the index of the LMDB tier, or None."""

    def __init__(
        self,
        tiers: list[Tier],
        nvme_tier: int | None,
        index: BlockIndex,
        pins: PinTable,
        sessions: SessionTable,
        namespaces: dict[str, Namespace],
        roots: dict[str, bytes],
        persist_session: Callable[[SessionState], None],
    ) -> None:
        self.tiers = tiers
        self.names = [t.name for t in tiers]
        self.last = len(tiers) - 1
        self.nvme_tier = nvme_tier
        self.index = index
        self.pins = pins
        self.sessions = sessions
        self.namespaces = namespaces
        self.roots = roots
        self.persist_session = persist_session
        self.counters = [TierCounters() for _ in tiers]
        self.lossless = [bool(getattr(getattr(t, "codec", None), "lossless", True)) for t in tiers]
        self.busy: set[bytes] = set()  # blocks in the middle of a move or write: as good as pinned
        # key -> (tier, frame) encoded outside the lock for the operation under way (see store.py)
        self.prepared: dict[bytes, tuple[int, bytes | bytearray]] = {}

    # -- checks -----------------------------------------------------------------------
    def pinned(self, e: Entry) -> bool:
        return e.key in self.busy or self.pins.is_pinned(e.key)

    def subtree_pinned(self, e: Entry) -> bool:
        return any(self.pinned(d) for d in self.index.subtree(e))

    def victim(self, t: int, exclude: set[bytes]) -> Entry | None:
        """The block to push out of tier ``t``: least recently used, unpinned, leaf-first.

        For a block whose only copy is in the last tier (leaving means its
        subtree goes too) a leaf is preferred and a pinned descendant rules it
        out; elsewhere a block none of whose children is in ``t`` or above is
        preferred (a prefix's tail goes down before its head).
        """
        bit, upto = 1 << t, (2 << t) - 1
        fallback: Entry | None = None
        scanned = 0
        for e in self.index.lru(t):
            if e.key in exclude or self.pinned(e):
                continue
            if t == self.last and e.tiers & TIER_MASK == bit:
                if e.children is None:
                    return e
                if fallback is None and not self.subtree_pinned(e):
                    fallback = e
            else:
                if not any(c.tiers & upto for c in e.child_list()):
                    return e
                if fallback is None:
                    fallback = e
            scanned += 1
            if scanned >= _SCAN and fallback is not None:
                break
        return fallback

    # -- making room ------------------------------------------------------------------
    def make_room(
        self, t: int, block: torch.Tensor | None, frame_bytes: int = 0, *, position: int | None = None
    ) -> bool:
        """Push blocks out of tier ``t`` until ``block`` (or a frame of ``frame_bytes``) fits.
        ``position``: the block's index in its prefix, which picks the nvme tier's codec (a head
        block's frame is larger). False when only pinned blocks are left."""
        tier = self.tiers[t]
        tried: set[bytes] = set()

        def fits() -> bool:
            if block is None:
                return bool(tier.can_put_frame(frame_bytes))  # type: ignore[attr-defined]
            if t == self.nvme_tier and position is not None:
                return bool(tier.can_put(block, position))  # type: ignore[call-arg]
            return tier.can_put(block)

        while not fits():
            e = self.victim(t, tried)
            if e is None:
                return False
            tried.add(e.key)
            self.evict_from(t, e)
        return True

    def evict_from(self, t: int, e: Entry) -> bool:
        """Make tier ``t`` let go of ``e`` (see the module sketch). True when ``t`` no longer holds it."""
        bit = 1 << t
        if not e.tiers & bit:
            return True
        if t < self.last and not e.tiers & (bit - 1) and not e.tiers & (bit << 1):
            return self.demote(e, t)  # no copy above, none in the next tier: it moves down
        if e.tiers & TIER_MASK & ~bit:
            if t == self.nvme_tier and not self.keep_record(e):
                self.drop_block(e)
                return True
            self.drop_copy(e, t)
            return True
        if self.subtree_pinned(e):
            return False
        self.drop_block(e)
        return True

    def demote(self, e: Entry, t: int) -> bool:
        """Move ``e`` from ``t`` to ``t+1``, re-encoded from ``t``'s copy (the best one left)."""
        try:
            block = None if self.has_prepared(e, t + 1) else self.tiers[t].get(e.key)
        except FrameError:
            self.corrupt(e, t)
            return True
        except KeyError:
            self.index.clear_tier(e, t)
            return True
        self.busy.add(e.key)
        try:
            placed = self.place(e, block, t + 1)
        finally:
            self.busy.discard(e.key)
        if self.index.get(e.key) is not e:
            return True  # went with an ancestor while room was made below
        if not placed:
            if e.tiers & TIER_MASK & ~(1 << t):
                self.drop_copy(e, t)  # no room below, but a copy further down remains
                return True
            if self.subtree_pinned(e):
                return False
            self.drop_block(e)
            return True
        self.drop_copy(e, t)
        self.counters[t].demotions += 1
        return True

    def has_prepared(self, e: Entry, t: int) -> bool:
        got = self.prepared.get(e.key)
        return got is not None and got[0] == t

    def place(self, e: Entry, block: torch.Tensor | None, t: int) -> bool:
        """Put ``block`` into tier ``t`` for indexed block ``e``, making room first. False: no room.

        A frame for ``t`` in ``prepared`` (encoded before the lock was taken) is stored as it is;
        ``block`` may then be None.
        """
        if e.tiers & (1 << t):
            return True
        prepared = self.prepared.pop(e.key, None)
        frame = prepared[1] if prepared is not None and prepared[0] == t else None
        if frame is None and block is None:
            return False
        if frame is None and self.frame_tier(t):
            # encoded first, so that room is made for its exact size (under the lock: no frame was prepared)
            frame = self.tiers[t].codec.encode(block)  # type: ignore[attr-defined]
        for _ in range(3):
            room = (
                self.make_room(t, None, len(frame))
                if frame is not None
                else self.make_room(t, block, position=self.position(e))
            )
            if not room or self.index.get(e.key) is not e:
                return False
            try:
                if frame is not None:
                    self.tiers[t].put_frame(e.key, frame)  # type: ignore[attr-defined]
                elif t == self.nvme_tier:
                    self.tiers[t].put(e.key, block, self.record(e))  # type: ignore[call-arg]
                    e.pending = None
                else:
                    self.tiers[t].put(e.key, block)
            except TierFull:
                continue  # the size estimate was short (zstd); make more room
            except TierIOError:
                return False
            self.index.set_tier(e, t)
            return True
        return False

    # -- records (what nvme stores beside the frame) ------------------------------------
    def record(self, e: Entry) -> BlockRecord:
        """The block's full record; needs ``pending`` (kept while no nvme copy exists)."""
        if e.pending is None:
            raise KVStoreError(f"block {e.key.hex()[:16]} has no record in memory to write to nvme")
        position, tokens = e.pending
        parent = e.parent.key if e.parent is not None else self.roots[e.ns]
        return BlockRecord(
            key=e.key,
            parent=parent,
            namespace=e.ns,
            position=position,
            tokens=tokens,
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
        if e.pending is not None or self.nvme_tier is None:
            return True
        try:
            rec = self.tiers[self.nvme_tier].record(e.key)  # type: ignore[attr-defined]
        except (KeyError, FrameError, TierIOError):
            return False
        e.pending = (rec.position, rec.tokens)
        if rec.position == 0:
            self.roots.setdefault(e.ns, rec.parent)
        return True

    # -- dropping -----------------------------------------------------------------------
    def drop_copy(self, e: Entry, t: int) -> int:
        freed = self.tiers[t].drop(e.key)
        self.index.clear_tier(e, t)
        self.counters[t].evictions += 1
        return freed

    def drop_block(self, e: Entry) -> list[Entry]:
        """Remove ``e`` and its descendants from every tier and the index (leaves first)."""
        gone = self.index.subtree(e)
        batch: list[bytes] = []  # nvme copies go in one LMDB transaction
        for d in gone:
            for t in d.tier_list():
                if t == self.nvme_tier and hasattr(self.tiers[t], "drop_many"):
                    batch.append(d.key)
                else:
                    self.tiers[t].drop(d.key)
                self.counters[t].evictions += 1
            self.index.remove(d)
            ns = self.namespaces.get(d.ns)
            step = ns.layout.block_tokens if ns is not None else 0
            for s in self.sessions.tail_gone(d.key, d.parent.key if d.parent is not None else None, step):
                self.persist_session(s)
        if batch:
            self.tiers[self.nvme_tier or 0].drop_many(batch)  # type: ignore[attr-defined]
        return gone

    def corrupt(self, e: Entry, t: int, *, damaged: bool = True) -> None:
        """Tier ``t``'s copy of ``e`` failed its checks (``damaged``, counted) or was not there: delete
        it; no copy left -> drop the block and its descendants."""
        self.counters[t].corrupt += damaged
        if self.index.get(e.key) is not e or not e.tiers & (1 << t):
            self.tiers[t].drop(e.key)
            return
        if t == self.nvme_tier and e.tiers & TIER_MASK & ~(1 << t) and not self.keep_record(e):
            self.drop_block(e)
            return
        self.tiers[t].drop(e.key)
        self.index.clear_tier(e, t)
        if not e.tiers & TIER_MASK:
            self.drop_block(e)

    # -- promotion --------------------------------------------------------------------
    def frame_tier(self, t: int) -> bool:
        """Whether tier ``t`` stores codec frames it can take ready-made (ram): then encoding can
        happen before the lock is taken."""
        return t != self.nvme_tier and hasattr(self.tiers[t], "put_frame") and hasattr(self.tiers[t], "codec")

    def predict_victims(self, t: int, room: int) -> list[Entry]:
        """The blocks ``room`` evictions from tier ``t`` would most likely demote into ``t+1`` (no
        copy there yet). A guess made under the lock so their frames can be encoded outside it."""
        out: list[Entry] = []
        tried: set[bytes] = set()
        for _ in range(room):
            e = self.victim(t, tried)
            if e is None:
                break
            tried.add(e.key)
            below = 1 << (t + 1)
            if not e.tiers & below and not e.tiers & ((1 << t) - 1):
                out.append(e)
        return out

    def promote(self, e: Entry, block: torch.Tensor, to: int, source: int) -> bool:
        """Bring ``block`` (read from tier ``source`` below) up into tier ``to``.

        From nvme it is a copy (the durable one stays); between the memory
        tiers it is a move, so a block never takes room twice there: the
        source copy goes first (making room for what ``to`` pushes down) and
        comes back if ``to`` has no room.
        """
        if self.index.get(e.key) is not e or e.tiers & (1 << to):
            return False
        move = source != self.nvme_tier and bool(e.tiers & (1 << source))
        self.busy.add(e.key)
        try:
            if move:
                self.tiers[source].drop(e.key)
                self.index.clear_tier(e, source)
            placed = self.place(e, block, to)
            if not placed and move and self.index.get(e.key) is e:
                self.place(e, block, source)
                if not e.tiers & TIER_MASK:
                    self.drop_block(
                        e
                    )  # neither tier could take it back: it is gone, and so are its descendants
        finally:
            self.busy.discard(e.key)
        if placed:
            if not self.lossless[source]:
                e.tiers |= LOSSY  # the copy above holds the lower tier's error, not the original bytes
            self.counters[to].promotions += 1
        return placed
