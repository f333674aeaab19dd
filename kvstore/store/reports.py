"""What the store reports to operators, changing nothing: sessions, usage, stats, the integrity check.

Each takes the store's lock for what it reads; a session's chain is walked after it is released (an
entry's parent link never changes).
"""

from __future__ import annotations

from kvstore.results import BlockInfo, NamespaceUsage, SessionDetail, SessionInfo, StoreStats, TierStats
from kvstore.store.cluster_admin import ClusterAdmin
from kvstore.store.index import Entry
from kvstore.store.movement import Mover
from kvstore.store.parts import StoreParts
from kvstore.store.sessions import SessionState
from kvstore.store.writeback import WriteBack


class Reports:
    """Sessions, usage, stats and the integrity check over one store's parts. ``writeback`` is None
    without nvme, ``cluster`` without a cluster tier."""

    def __init__(
        self, parts: StoreParts, mover: Mover, writeback: WriteBack | None, cluster: ClusterAdmin | None
    ) -> None:
        self._lock, self._tiers, self._index = parts.lock, parts.tiers, parts.index
        self._pins, self._sessions, self._namespaces = parts.pins, parts.sessions, parts.namespaces
        self._counts = parts.counts
        self._mover = mover
        self._writeback = writeback
        self._cluster = cluster

    def sessions(self, tenant: str | None = None) -> list[SessionInfo]:
        """Every session (or ``tenant``'s), by name.

        Under the lock only the sessions and their tail blocks are looked up;
        their chains are counted after it is released (an entry's parent link
        never changes, so the walk is safe; a block dropped meanwhile may
        still be counted once)."""
        with self._lock:
            if tenant is None:
                states = self._sessions.all()
            else:
                mine = [i for i, ns in self._namespaces.items() if ns.tenant == tenant]
                states = self._sessions.in_namespaces(mine)
            found = [(s, self._index.get(s.tail) if s.tail is not None else None) for s in states]
        return [self._session_info(s, tail)[0] for s, tail in found]

    def usage(self, tenant: str | None = None) -> list[NamespaceUsage]:
        """Blocks per tier and sessions of every namespace (or ``tenant``'s), from counters kept as
        blocks come and go: O(namespaces) under the lock, whatever the number of blocks."""
        with self._lock:
            counts = self._index.namespace_counts()
            sessions = self._sessions.count_by_namespace()
            out = []
            for ns_id, c in sorted(counts.items()):
                ns = self._namespaces.get(ns_id)
                if tenant is not None and (ns is None or ns.tenant != tenant):
                    continue
                out.append(
                    NamespaceUsage(
                        namespace=ns_id,
                        model=ns.model if ns else "",
                        tenant=ns.tenant if ns else "",
                        blocks=c[-1],
                        tiers={name: c[t] for t, name in enumerate(self._tiers.names)},
                        sessions=sessions.get(ns_id, 0),
                        tier_bytes={
                            name: c[t] * self._tiers[t].block_cost(ns.layout) if ns else 0
                            for t, name in enumerate(self._tiers.names)
                        },
                    )
                )
            return out

    def session(self, name: str) -> SessionDetail:
        """One session and its cached blocks, root first; a session this host does not know but the
        cluster recorded (another host stored it) with the blocks the cluster holds. KeyError when unknown."""
        with self._lock:
            known = self._sessions.get(name) is not None
        if not known and self._cluster is not None:  # the round trip without the lock
            detail = self._cluster.session_detail(name)
            if detail is not None:
                return detail
        with self._lock:
            s = self._sessions.get(name)
            if s is None:
                raise KeyError(f"unknown session {name!r}")
            info, chain = self._session_info(s, self._index.get(s.tail) if s.tail is not None else None)
            blocks = [
                BlockInfo(
                    position=i,
                    key=e.key.hex(),
                    tiers=[self._tiers.names[t] for t in e.tier_list()],
                    last_access=e.last_access,
                )
                for i, e in enumerate(chain)
            ]
            return SessionDetail(info=info, blocks=blocks)

    def stats(self) -> StoreStats:
        with self._lock:
            tiers = {}
            for t, tier in enumerate(self._tiers):
                u, c = tier.usage(), self._mover.counters[t]
                tiers[self._tiers.names[t]] = TierStats(
                    self._tiers.names[t],
                    u.blocks,
                    u.used_bytes,
                    u.capacity_bytes,
                    c.hits,
                    c.misses,
                    c.evictions,
                    c.demotions,
                    c.promotions,
                    c.corrupt,
                )
            cluster = None if self._cluster is None else self._cluster.status()
            if cluster is not None:  # shared by every host: no count or capacity of its own to report
                tiers["cluster"] = TierStats(
                    "cluster",
                    0,
                    0,
                    0,
                    cluster["hits"],
                    cluster["misses"],
                    cluster["deleted"],
                    0,
                    0,
                    cluster["corrupt"],
                )
            return StoreStats(
                tiers=tiers,
                blocks=len(self._index),
                sessions=len(self._sessions),
                namespaces=len(self._namespaces),
                pinned=self._pins.pinned_keys(),
                write_queue=self._writeback.depth() if self._writeback else 0,
                write_deferred=len(self._writeback.deferred) if self._writeback else 0,
                written=self._counts.written,
                expired=self._counts.expired,
                lookups=self._counts.lookups,
                tokens_asked=self._counts.tokens_asked,
                tokens_matched=self._counts.tokens_matched,
                tokens_served=self._counts.tokens_served,
                write_failures=self._counts.write_failures,
                unencodable=self._mover.unencodable,
                sessions_forgotten=self._sessions.dropped_dead + self._sessions.dropped_idle,
                cluster=cluster,
            )

    def check_integrity(self) -> list[str]:
        """Every broken invariant (orphans, index/tier disagreement, capacity overrun); empty when sound."""
        with self._lock:
            keys = [set(t.keys()) for t in self._tiers]
            if self._tiers.nvme_t is not None and self._writeback is not None:
                # a block the writer is writing may be on nvme a moment before the index says so
                for k in self._writeback.writing:
                    e = self._index.get(k)
                    keys[self._tiers.nvme_t].discard(k)
                    if e is not None and e.tiers & (1 << self._tiers.nvme_t):
                        keys[self._tiers.nvme_t].add(k)
            problems = self._index.check(keys, self._tiers.names, self._mover.owed)
            for tier in self._tiers:
                u = tier.usage()
                if u.used_bytes > u.capacity_bytes:
                    problems.append(
                        f"{tier.name} uses {u.used_bytes} bytes, over its capacity {u.capacity_bytes}"
                    )
            return problems

    # -- internals (lock held) ----------------------------------------------------------
    def _session_info(self, s: SessionState, tail: Entry | None) -> tuple[SessionInfo, list[Entry]]:
        chain = self._index.chain(tail) if tail is not None else []
        per_tier = dict.fromkeys(self._tiers.names, 0)
        for e in chain:
            for t in e.tier_list():
                per_tier[self._tiers.names[t]] += 1
        ns = self._namespaces.get(s.namespace)
        info = SessionInfo(
            name=s.name,
            namespace=s.namespace,
            model=ns.model if ns else "",
            tenant=ns.tenant if ns else "",
            tokens=s.tokens,
            blocks=len(chain),
            tiers=per_tier,
            created=s.created,
            last_access=s.last_access,
        )
        return info, chain
