"""The in-memory block index: which blocks exist, in which tiers, their prefix tree and LRU order.

::

    entries: OrderedDict key -> Entry          least recently accessed first (TTL and the last tier scan it)
    lru[t]:  OrderedDict key -> None           one per tier above the last, least recently used first
    counts:  ns id -> [blocks in tier 0, .., blocks in the last tier, blocks]
                                               kept as blocks come and go: per-namespace and per-tenant
                                               figures never walk the entries
    Entry:   key, parent (Entry), children, tier bits, namespace id, session tags,
             created, last_access, pending (position, token bytes or engine key) while no nvme copy exists

The tree is prefix-closed: an entry's parent is always in the index (block 0
has none), so every indexed block is reachable by a lookup from its root.
Token ids are not kept (they live in the nvme record) except in ``pending``
for blocks not yet on nvme. Times and tag tuples are shared objects between
the blocks of one operation, which keeps an entry near 270 bytes.

Not thread-safe: the store holds its lock around every call.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from operator import attrgetter
from typing import NamedTuple

SEEN = 1 << 6  # flag in Entry.tiers: hit once already (nvme admission on second use)
LOSSY = 1 << 7  # flag in Entry.tiers: its copies in lossless tiers were decoded from a lossy one
TIER_MASK = (1 << 6) - 1


class Pending(NamedTuple):
    """What a block's nvme record will say, kept while no nvme copy exists."""

    position: int
    tokens: bytes  # its token ids (little-endian uint32); empty for a block named by an engine key
    engine_key: bytes = b""  # the engine's page key (kvstore.chains.KeyChain); empty for token blocks


class Entry:
    """One block. ``tiers`` holds one bit per tier (bit t = tier t) plus flags above TIER_MASK."""

    __slots__ = ("key", "parent", "children", "tiers", "ns", "sessions", "created", "last_access", "pending")

    def __init__(
        self,
        key: bytes,
        parent: Entry | None,
        ns: str,
        sessions: tuple[str, ...],
        created: float,
        last_access: float,
        pending: Pending | None = None,
        tiers: int = 0,
    ) -> None:
        self.key = key
        self.parent = parent
        self.children: Entry | list[Entry] | None = None
        self.tiers = tiers
        self.ns = ns
        self.sessions = sessions
        self.created = created
        self.last_access = last_access
        self.pending = pending

    def child_list(self) -> list[Entry]:
        c = self.children
        return [] if c is None else [c] if isinstance(c, Entry) else list(c)

    def position(self) -> int:
        n, e = 0, self.parent
        while e is not None:
            n, e = n + 1, e.parent
        return n

    def tier_list(self) -> list[int]:
        return [t for t in range(6) if self.tiers & (1 << t)]

    def highest(self) -> int:
        """The uppermost tier holding the block (lowest index); -1 when none."""
        bits = self.tiers & TIER_MASK
        return (bits & -bits).bit_length() - 1

    def _add_child(self, child: Entry) -> None:
        c = self.children
        if c is None:
            self.children = child
        elif isinstance(c, Entry):
            self.children = [c, child]
        else:
            c.append(child)

    def _remove_child(self, child: Entry) -> None:
        c = self.children
        if c is child:
            self.children = None
        elif isinstance(c, list):
            c.remove(child)
            if len(c) == 1:
                self.children = c[0]


class BlockIndex:
    """Blocks by key, their tree, their tier bits and LRU orders (see the module docstring)."""

    def __init__(self, ntiers: int) -> None:
        if not 1 <= ntiers <= 6:
            raise ValueError(f"the index supports 1 to 6 tiers, got {ntiers}")
        self.ntiers = ntiers
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._lru: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(ntiers - 1)]
        self._counts: dict[str, list[int]] = {}

    # -- queries ----------------------------------------------------------------------
    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> Iterator[Entry]:
        """Every entry, least recently accessed first (do not change the index while iterating)."""
        return iter(self._entries.values())

    def namespace_counts(self) -> dict[str, tuple[int, ...]]:
        """Per namespace id: blocks held in each tier, then blocks in all (a copy; O(namespaces))."""
        return {ns: tuple(c) for ns, c in self._counts.items()}

    def namespace_blocks(self, ns: str) -> int:
        """Blocks of namespace id ``ns`` held (O(1))."""
        c = self._counts.get(ns)
        return c[-1] if c else 0

    def _count(self, ns: str) -> list[int]:
        c = self._counts.get(ns)
        if c is None:
            c = self._counts[ns] = [0] * (self.ntiers + 1)
        return c

    def count(self, tier: int) -> int:
        if tier < self.ntiers - 1:
            return len(self._lru[tier])
        bit = 1 << tier
        return sum(1 for e in self._entries.values() if e.tiers & bit)

    def lru(self, tier: int) -> Iterator[Entry]:
        """Entries held in ``tier``, least recently used first (do not change the index while iterating)."""
        if tier < self.ntiers - 1:
            entries = self._entries
            return (entries[k] for k in self._lru[tier])
        bit = 1 << tier
        return (e for e in self._entries.values() if e.tiers & bit)

    def subtree(self, entry: Entry) -> list[Entry]:
        """``entry`` and all its descendants, descendants first (a safe removal order)."""
        out: list[Entry] = []
        stack: list[tuple[Entry, bool]] = [(entry, False)]
        while stack:
            e, expanded = stack.pop()
            if expanded or e.children is None:
                out.append(e)
            else:
                stack.append((e, True))
                stack.extend((c, False) for c in e.child_list())
        return out

    @staticmethod
    def any_below(entry: Entry, pred: Callable[[Entry], bool], memo: dict[bytes, bool]) -> bool:
        """Whether ``pred`` holds for ``entry`` or any of its descendants. ``memo`` keeps the answer
        for every block visited, so that asking about each block of a chain costs one walk of the
        tree below it, not one per block (pass the same dict for one question)."""
        known = memo.get(entry.key)
        if known is not None:
            return known
        stack: list[tuple[Entry, bool]] = [(entry, False)]
        while stack:
            e, expanded = stack.pop()
            if expanded:
                memo[e.key] = pred(e) or any(memo[c.key] for c in e.child_list())
            else:
                stack.append((e, True))
                stack.extend((c, False) for c in e.child_list() if c.key not in memo)
        return memo[entry.key]

    def chain(self, entry: Entry) -> list[Entry]:
        """Block 0 .. ``entry`` (its ancestors and itself), root first."""
        out = []
        e: Entry | None = entry
        while e is not None:
            out.append(e)
            e = e.parent
        out.reverse()
        return out

    # -- changes ----------------------------------------------------------------------
    def add(self, entry: Entry, tier: int) -> None:
        """Index a new block held in ``tier``. Its parent must be indexed; KeyError if the key is."""
        if entry.key in self._entries:
            raise KeyError(f"block {entry.key.hex()[:16]} is already indexed")
        p = entry.parent
        if p is not None:
            if self._entries.get(p.key) is not p:
                raise KeyError(f"parent {p.key.hex()[:16]} of block {entry.key.hex()[:16]} is not indexed")
            p._add_child(entry)
        self._entries[entry.key] = entry
        self._count(entry.ns)[-1] += 1
        self.set_tier(entry, tier)

    def insert_restored(self, entries: list[Entry], tier: int, *, keys: list[bytes] | None = None) -> None:
        """Bulk-load entries (already linked to each other, their tier bits set) held in ``tier``,
        in the given access order. ``keys``: their keys, when the caller has them as a list."""
        self._entries.update(
            zip(map(attrgetter("key"), entries) if keys is None else keys, entries, strict=True)
        )
        if tier < self.ntiers - 1:
            self._lru[tier].update(dict.fromkeys(e.key for e in entries))
        for ns, n in Counter(map(attrgetter("ns"), entries)).items():
            c = self._count(ns)
            c[tier] += n
            c[-1] += n

    def touch(self, entry: Entry, now: float) -> None:
        """Mark ``entry`` used now: it becomes the most recently used in every tier holding it."""
        entry.last_access = now
        self._entries.move_to_end(entry.key)
        for t in range(self.ntiers - 1):
            if entry.tiers & (1 << t):
                self._lru[t].move_to_end(entry.key)

    def set_tier(self, entry: Entry, tier: int) -> None:
        """Record a copy in ``tier`` (the most recently used there)."""
        if not entry.tiers & (1 << tier) and self._entries.get(entry.key) is entry:
            self._count(entry.ns)[tier] += 1
        entry.tiers |= 1 << tier
        if tier < self.ntiers - 1:
            self._lru[tier][entry.key] = None

    def clear_tier(self, entry: Entry, tier: int) -> None:
        if entry.tiers & (1 << tier) and self._entries.get(entry.key) is entry:
            self._count(entry.ns)[tier] -= 1
        entry.tiers &= ~(1 << tier)
        if tier < self.ntiers - 1:
            self._lru[tier].pop(entry.key, None)

    def remove(self, entry: Entry) -> None:
        """Unindex a block that has no children (remove a subtree leaves first)."""
        if entry.children is not None:
            raise ValueError(f"block {entry.key.hex()[:16]} still has children; remove its subtree")
        if entry.parent is not None:
            entry.parent._remove_child(entry)
        for t in range(self.ntiers - 1):
            self._lru[t].pop(entry.key, None)
        del self._entries[entry.key]
        c = self._count(entry.ns)
        for t in entry.tier_list():
            c[t] -= 1
        c[-1] -= 1
        if not c[-1]:
            del self._counts[entry.ns]
        entry.tiers &= ~TIER_MASK

    # -- invariants -------------------------------------------------------------------
    def check(
        self, tier_keys: list[set[bytes]], tier_names: list[str], pending_needed: Callable[[Entry], bool]
    ) -> list[str]:
        """Every broken invariant, as readable lines (empty when all hold)."""
        problems: list[str] = []
        bits = [1 << t for t in range(self.ntiers)]
        for key, e in self._entries.items():
            name = key.hex()[:16]
            if e.key is not key and e.key != key:
                problems.append(f"block {name}: entry carries another key")
            if e.parent is not None and self._entries.get(e.parent.key) is not e.parent:
                problems.append(f"block {name}: parent {e.parent.key.hex()[:16]} is not indexed (orphan)")
            for c in e.child_list():
                if c.parent is not e or self._entries.get(c.key) is not c:
                    problems.append(f"block {name}: child {c.key.hex()[:16]} is not linked back")
            if not e.tiers & TIER_MASK:
                problems.append(f"block {name}: indexed but held by no tier")
            for t, bit in enumerate(bits):
                held = key in tier_keys[t]
                if bool(e.tiers & bit) != held:
                    problems.append(
                        f"block {name}: index says {'' if e.tiers & bit else 'not '}in "
                        f"{tier_names[t]}, the tier {'has' if held else 'lacks'} it"
                    )
                if t < self.ntiers - 1 and bool(e.tiers & bit) != (key in self._lru[t]):
                    problems.append(f"block {name}: LRU list of {tier_names[t]} disagrees with its tier bits")
            if pending_needed(e) and e.pending is None:
                problems.append(f"block {name}: not on nvme and its record (tokens) is not kept")
        for t, keys in enumerate(tier_keys):
            stray = [k for k in keys if k not in self._entries]
            if stray:
                problems.append(
                    f"{tier_names[t]} holds {len(stray)} block(s) the index does not know, "
                    f"e.g. {stray[0].hex()[:16]}"
                )
        for t in range(self.ntiers - 1):
            if len(self._lru[t]) != sum(1 for e in self._entries.values() if e.tiers & bits[t]):
                problems.append(f"LRU list of {tier_names[t]} has stray keys")
        counted: dict[str, list[int]] = {}
        for e in self._entries.values():
            row = counted.setdefault(e.ns, [0] * (self.ntiers + 1))
            for t in e.tier_list():
                row[t] += 1
            row[-1] += 1
        if counted != {ns: c for ns, c in self._counts.items() if any(c)}:
            problems.append("per-namespace block counts disagree with the entries")
        return problems
