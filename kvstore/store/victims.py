"""Which block leaves a tier next (the store's eviction order), for the Mover that moves it.

::

    victim(t)       least recently used, unpinned, leaf-first; on the last tier a leaf (a prefix
                    leaves from its tail), on nvme a block it alone holds before one memory holds too
    predict(t, n)   the blocks n evictions from t would most likely demote (their frames are encoded
                    before the store's lock is taken)

Every method expects the store's lock to be held by the caller, and changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.store.index import TIER_MASK, Entry

if TYPE_CHECKING:
    from kvstore.store.movement import Mover

_SCAN = 64  # LRU entries examined for a leaf before settling for the oldest candidate
_TAIL_WALKS = 8  # nvme: prefixes whose tail victim() looks at for one nvme alone holds


class Victims:
    """The eviction order of one Mover's tiers (its pins, the blocks it moves, what nvme owes)."""

    def __init__(self, mover: Mover) -> None:
        self._mover = mover
        self._index, self._tiers = mover.index, mover.tiers

    def _owes_below(self, e: Entry) -> bool:
        return any(self._mover.owed(d) for d in self._index.subtree(e))

    def victim(self, t: int, exclude: set[bytes]) -> Entry | None:
        """The block to push out of tier ``t``: least recently used, unpinned, leaf-first.

        For a block whose only copy is in the last tier (leaving means its
        subtree goes too) a leaf is preferred and a pinned descendant rules it
        out; elsewhere a block none of whose children is in ``t`` or above is
        preferred (a prefix's tail goes down before its head).

        On nvme, a block a memory tier also holds goes only when no block nvme
        alone holds can (among the oldest _SCAN * 16): dropping the only copy
        of a cold block is an eviction, while dropping the disk copy of one in
        memory breaks what a flush promised. Among those, one with no child on
        nvme goes first, and never an ancestor of a block being written: the
        disk keeps the heads of prefixes, not their tails. An old prefix nvme
        alone holds whose tail on nvme a memory tier also holds (its head is
        older than the tail: a put continued it) counts as such a block.
        """
        bit, upto = 1 << t, (2 << t) - 1
        disk = t == self._tiers.nvme_t
        fallback: Entry | None = None
        held: list[Entry] = []  # nvme: blocks a memory tier also holds, oldest first
        held_tail: Entry | None = None  # nvme: the oldest prefix nvme alone holds but for its tail
        walks = 0  # tails walked for that (each a prefix long, under the lock: a few only)
        scanned = 0
        refusing = self._mover.disk_refusing()
        for e in self._index.lru(t):
            if e.key in exclude or self._mover.pinned(e) or refusing and self._mover.owed(e):
                continue
            if t == self._tiers.last and e.tiers & TIER_MASK == bit:
                if e.children is None:
                    return e
                if (
                    fallback is None
                    and not self._mover.subtree_pinned(e)
                    and not (refusing and self._owes_below(e))
                ):
                    if not disk:
                        fallback = e
                    elif walks < _TAIL_WALKS:  # (past them: a leaf, or the first such prefix)
                        walks += 1
                        if self._tail(e, bit, exclude).tiers & TIER_MASK == bit:
                            fallback = e
                        elif held_tail is None:
                            held_tail = e
            elif disk:
                held.append(e)
            else:
                if not any(c.tiers & upto for c in e.child_list()):
                    return e
                if fallback is None:
                    fallback = e
            scanned += 1
            if scanned >= _SCAN and fallback is not None or scanned >= _SCAN * 16 and (held or held_tail):
                break
        if fallback is not None and t == self._tiers.last and fallback.tiers & TIER_MASK == bit:
            return self._tail(fallback, bit, exclude)
        if fallback is None and held:
            return self._displacement(held, bit, exclude)
        if fallback is None and held_tail is not None:
            return self._tail(held_tail, bit, exclude)
        return fallback

    def _displacement(self, held: list[Entry], bit: int, exclude: set[bytes]) -> Entry | None:
        """Which of ``held`` (blocks on nvme a memory tier also holds, oldest first) gives up its disk
        copy: the oldest with no child on nvme, else the tail of the oldest; never an ancestor of a
        block being written (walked only here, where nvme holds nothing it could drop instead)."""
        heads = self._written_above()
        held = [e for e in held if e.key not in heads]
        if not held:
            return None
        leaf = next((e for e in held if not any(c.tiers & bit for c in e.child_list())), None)
        return leaf or self._tail(held[0], bit, exclude | heads | self._pinned_below(held[0], bit))

    def _written_above(self) -> set[bytes]:
        """The ancestors of the blocks being moved or written (``busy``): a block's disk copy is
        worth nothing after a restart without theirs."""
        above: set[bytes] = set()
        for k in self._mover.busy:
            e = self._index.get(k)
            p = e.parent if e is not None else None
            while p is not None and p.key not in above:
                above.add(p.key)
                p = p.parent
        return above

    def _pinned_below(self, e: Entry, bit: int) -> set[bytes]:
        """The pinned blocks on the tier of ``bit`` in ``e``'s subtree: a tail walk stops above them."""
        return {d.key for d in self._index.subtree(e) if d.tiers & bit and self._mover.pinned(d)}

    @staticmethod
    def _tail(e: Entry, bit: int, exclude: set[bytes]) -> Entry:
        """The last block of ``e``'s prefix held in the tier of ``bit`` (the first child there, each
        time): a long prefix at the bottom of the LRU leaves that tier from its tail, a block at a time,
        not whole (its subtree, unpinned, may go with it)."""
        while True:
            below = next((c for c in e.child_list() if c.tiers & bit and c.key not in exclude), None)
            if below is None:
                return e
            e = below

    def predict(self, t: int, room: int) -> list[Entry]:
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
