"""The store engine: an index over the tiers, composed of the parts that store, read, move,
write and report.

::

    put(ns, tokens, kv)  per chunk of 32 blocks: new blocks -> hbm, room made by demotion
                         hbm -> ram -> nvme -> gone; new keys -> write-through -> nvme (puts.py)
    lookup(ns, tokens)   walk keys from block 0 while indexed, then ask the cluster (reads.py)
    get(ns, tokens)      pin the chain -> read + decode each block (no lock) -> touch, promote
                         one tier up, unpin (lock) -> the cluster fills what follows (reads.py)

    Store ─┬─ Putter       puts, chunk by chunk           (puts.py)
           ├─ Reader       lookup, get, locate, finish    (reads.py)
           ├─ TierSet      hbm, ram, nvme                  (tierset.py)
           ├─ BlockIndex   blocks, prefix tree, LRU        (index.py)
           ├─ Mover        room, demotion, promotion       (movement.py)
           ├─ DataPath     placing and reading blocks      (datapath.py)
           ├─ WriteBack    write-through, TTL, flush       (writeback.py, writer.py; with nvme)
           ├─ AdminOps     evict, prefetch                 (admin.py)
           ├─ Reports      sessions, usage, stats          (reports.py)
           ├─ ClusterLink  the shared tier below nvme      (cluster.py, cluster_admin.py, adoption.py)
           └─ PinTable, SessionTable, NamespaceTable, Journal

One RLock, shared by the parts, guards the index and what each tier holds.
Hashing (but for the lazy walks of lookup and get: under a microsecond a
block), layout checks, get()'s reads and decodes, the ram frames of demotions
and promotions (encoded ahead: the ``ready`` frames of movement.py), and the
write-through's int4 encode and LMDB put run outside it. Under it run memory
copies into hbm, LMDB deletes, and the encodes of demotions that were not
foreseen (ram -> nvme with write-through off, or a wrong guess).

The Store's whole public surface (data path, operator calls, durability) is here, each with its
contract; the work itself is done by the parts named above.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.config import check_pools
from kvstore.keys import Namespace
from kvstore.results import (
    EvictFilter,
    EvictResult,
    GetResult,
    InvalidRequest,
    LookupResult,
    NamespaceUsage,
    PrefetchResult,
    PutResult,
    SessionDetail,
    SessionInfo,
    StoreClosed,
    StoreStats,
)
from kvstore.store.admin import AdminOps
from kvstore.store.adoption import ADOPT_WAIT, Adoption
from kvstore.store.cluster import ClusterLink
from kvstore.store.cluster_admin import ClusterAdmin
from kvstore.store.counts import StoreCounts
from kvstore.store.datapath import DataPath
from kvstore.store.index import BlockIndex, Entry
from kvstore.store.journal import Journal
from kvstore.store.movement import Mover
from kvstore.store.namespaces import NamespaceTable
from kvstore.store.parts import StoreParts
from kvstore.store.pins import PinHandle, PinTable
from kvstore.store.puts import Putter
from kvstore.store.reads import Located, Reader
from kvstore.store.reports import Reports
from kvstore.store.restore import restore, trim_disk
from kvstore.store.resume import restore_sessions
from kvstore.store.sessions import SessionState, SessionTable
from kvstore.store.tierset import TierSet
from kvstore.store.writeback import WriteBack, access_slot
from kvstore.store.writer import Admission, WriteThrough
from kvstore.tiers.base import Tier
from kvstore.tiers.cluster import ClusterTier
from kvstore.tiers.nvme import NvmeTier

if TYPE_CHECKING:
    from kvstore.config import Config, PolicyConfig
    from kvstore.memcopy import Copier
    from kvstore.tiers.pool import PoolMemory

log = logging.getLogger("kvstore.store")


class Store:
    """Blocks of K/V cache in hbm, ram and nvme tiers. Thread-safe: every public method may be
    called from several threads at once."""

    def __init__(
        self,
        hbm: Tier,
        ram: Tier | None,
        nvme: NvmeTier | None = None,
        policy: PolicyConfig | None = None,
        *,
        write_through: bool = True,
        admit: Admission | str = Admission.ALWAYS,
        ttl: float = 7 * 86400.0,
        clock: Callable[[], float] = time.time,
        lease_clock: Callable[[], float] | None = None,
        tick: float = 1.0,
        backpressure: float = 2.0,
        cluster: ClusterTier | None = None,
        cluster_queue: int = 1024,
    ) -> None:
        """On an nvme path that already holds blocks, the index, namespaces and sessions are
        rebuilt from it. ``admit``: see Admission. ``backpressure``: the longest a put waits for
        room in the write-through queue (see writer.py). ``cluster``: the shared tier below the
        local ones (cluster.py), written through from a queue of ``cluster_queue`` blocks.
        ``clock``: wall-clock time (access times, the TTL); ``lease_clock``: what pins' leases run
        on (default: monotonic; ``clock`` itself when one is given)."""
        try:
            self._admit = Admission(admit)
        except ValueError:
            raise InvalidRequest(f"admit must be 'always' or 'second_use', got {admit!r}") from None
        self._lease = 30.0 if policy is None else policy.pin_lease
        self._lock = threading.RLock()
        self._clock = clock
        self._closed = False
        self._closing = False  # close's last flush runs: only blocks read from the cluster are stored
        self.tiers = TierSet(hbm, ram, nvme)
        self._index = BlockIndex(len(self.tiers))
        # access times and the TTL are wall-clock times (kept on disk); leases run on a clock that
        # never steps back (with the wall clock, a step back held every pin that much longer)
        if lease_clock is None:
            lease_clock = time.monotonic if clock is time.time else clock
        self._pins = PinTable(lease_clock)
        self._namespaces = NamespaceTable()
        queue = 1024 if policy is None else policy.write_queue
        writer = None if nvme is None else WriteThrough(maxsize=queue, tick=tick)
        self._journal = Journal(writer, nvme, sessions=self._session_rows)
        # the table forgets dead sessions and those past their tenant's cap by itself: their rows go too
        self._sessions = SessionTable(self._journal.forget_session, self._tenant_of)
        self._counts = StoreCounts()
        parts = StoreParts(
            self._lock,
            clock,
            self.tiers,
            self._index,
            self._pins,
            self._sessions,
            self._namespaces,
            self._counts,
        )
        self._parts = parts
        self._mover = Mover(parts, self._journal.session)
        self._write_through = write_through and nvme is not None
        self._writeback: WriteBack | None = None
        if nvme is not None and writer is not None:
            # the slot records were written under may be a longer one, of a run with a longer TTL
            slot = nvme.access_slot(access_slot(ttl))
            report = restore(self._index, nvme, self.tiers.last, self._namespaces, slot=slot, now=clock())
            self._mover.counters[self.tiers.last].corrupt += report.damaged
            restore_sessions(parts, nvme.iter_sessions(), self._journal.forget_session)
            trim_disk(parts, self._mover, nvme)
            sweep = not (self._write_through and self._admit is Admission.ALWAYS)
            self._writeback = WriteBack(
                parts, self._mover, nvme, writer, ttl=ttl, backpressure=backpressure, sweep=sweep
            )
        admit_later = self._writeback.defer if self._writeback is not None else None
        second_use = self._write_through and self._admit is Admission.SECOND_USE
        promote = True if policy is None else policy.promote_on_hit
        self._data = DataPath(
            parts, self._mover, self._touch, admit_later if second_use else None, promote=promote
        )
        self._cluster: ClusterLink | None = None
        self._cluster_admin: ClusterAdmin | None = None
        if cluster is not None:
            offer = self._writeback.offer if self._writeback is not None else None
            self._cluster = ClusterLink(parts, cluster, self.put, offer, queue=cluster_queue, tick=tick)
            self._cluster_admin = ClusterAdmin(parts, self._cluster, self._journal, self.get)
        self._admin = AdminOps(
            parts,
            self._mover,
            self._data,
            self._journal,
            lease=self._lease,
            writeback=self._writeback,
            cluster=self._cluster_admin,
        )
        self._reports = Reports(parts, self._mover, self._writeback, self._cluster_admin)
        through = self._writeback if self._write_through and self._admit is Admission.ALWAYS else None
        self._puts = Putter(
            parts,
            self._data,
            self._mover,
            self._journal,
            through,
            self._cluster,
            lease=self._lease,
            touch=self._touch,
            check_open=self._check_open,
        )
        self._reads = Reader(
            parts,
            self._data,
            self._cluster,
            lease=self._lease,
            check_open=self._check_open,
            closed=lambda: self._closed,
        )

    @classmethod
    def from_config(
        cls,
        config: Config,
        memory: Callable[[str, str], PoolMemory] | None = None,
        copier: Copier | None = None,
    ) -> Store:
        """Build the tiers a Config describes (nvme unless ``[nvme] enabled = false``) and a store over them.

        ``memory(role, kind)``: where the hbm and ram pools live (kvstore.shm.plane shares them with
        same-host clients); default: private memory. ``copier``: how the pools' host copies run
        (default: on the calling thread; the daemon spreads them over the cores)."""
        from kvstore.codecs import get_codec
        from kvstore.store.cluster_admin import cluster_from_config
        from kvstore.tiers.hbm import HbmTier
        from kvstore.tiers.ram import RamTier

        p = config.policy
        check_pools(config)
        hbm = HbmTier(
            config.hbm.capacity,
            device=config.hbm.resolved_device(),
            page_bytes=p.page_bytes,
            memory=None if memory is None else memory("hbm", "raw"),
            copier=copier,
        )
        ram = RamTier(
            config.ram.capacity,
            get_codec(config.ram.codec),
            page_bytes=p.page_bytes,
            pin_memory=config.ram.pin_memory,
            memory=None if memory is None else memory("ram", "frames"),
            copier=copier,
        )
        nvme = None
        if config.nvme.enabled:
            n = config.nvme
            codec, head = n.codecs()
            nvme = NvmeTier(
                n.path, n.capacity, codec, durability=n.durability, head_codec=head, head_blocks=n.head_blocks
            )
        return cls(
            hbm,
            ram,
            nvme,
            p,
            write_through=config.nvme.write_through,
            admit=config.nvme.admit,
            ttl=config.nvme.ttl,
            cluster=cluster_from_config(config),  # connected (or retrying) before the daemon serves
            cluster_queue=config.cluster.write_queue,
        )

    # -- data path --------------------------------------------------------------------
    def put(
        self,
        ns: Namespace,
        tokens: Any,
        kv: torch.Tensor | Sequence[torch.Tensor],
        *,
        session: str | None = None,
        start_block: int = 0,
        _adopted: bool = False,
    ) -> PutResult:
        """Store the full blocks of ``kv`` (``[L, 2, n*T(+tail), H, D]``) as blocks ``start_block ..``;
        or ``kv`` a sequence of block tensors (``[L, 2, T, H, D]`` each, a block-major buffer as
        ``get`` fills), block ``j`` from ``kv[j]``.

        ``tokens`` is the whole prefix (at least up to the last full block of
        ``kv``): token ids, or a chain (kvstore.chains: a KeyChain names the
        blocks by an engine's page keys, after its ``parent`` page, which must
        be held like block ``start_block - 1``). Blocks already held are not rewritten: their access time
        updates. A new block is tagged with ``session`` (the session that
        stored it; a block other sessions reuse keeps that one tag), and the
        session's tail moves to the last block of the put. When block ``start_block - 1`` is not held, the
        blocks are refused (``missing_parent``) rather than stored as orphans.
        A block a tier fails to take is reported in ``failed`` with those after
        it; the blocks before it stay stored and queued for nvme.
        Raises LayoutError / InvalidTokens / InvalidRequest for malformed input.
        New blocks also go to the cluster tier, if any, in the background (``_adopted``: they came
        from it, and are not sent back). Like a get, a put first waits for the blocks earlier gets
        read from the cluster to be stored here (``settle``): they may be its parents.
        """
        if not _adopted:  # blocks a get read from the cluster may be this put's parents (settle)
            self.settle()
        return self._puts.put(ns, tokens, kv, session=session, start_block=start_block, adopted=_adopted)

    def lookup(self, ns: Namespace, tokens: Any, *, count: bool = True) -> LookupResult:
        """How many leading blocks of ``tokens`` are held (and the uppermost tier of each). Reads nothing.

        Where the local tiers end, the cluster tier (if any) is asked about the blocks after, in one
        round trip; those it holds are reported as tier ``cluster``. ``count``: in the lookup and
        token counters (False for an operator's look, which is no inference traffic)."""
        self.settle()
        r = self._reads.lookup(ns, tokens, remote=True, count=count)
        assert r is not None
        return r

    def try_lookup(self, ns: Namespace, tokens: Any) -> LookupResult | None:
        """``lookup`` if the store's lock is free this instant and the answer needs no cluster round
        trip, else None (nothing done, nothing counted).

        For the daemon's event loop, which must never wait behind a put's tier or codec work."""
        if self._cluster is not None and self._cluster.reads.adopting():
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._reads.lookup(ns, tokens, remote=False)
        finally:
            self._lock.release()

    def get(
        self,
        ns: Namespace,
        tokens: Any,
        *,
        start_block: int = 0,
        max_blocks: int | None = None,
        device: torch.device | str | None = None,
        out: torch.Tensor | Sequence[torch.Tensor] | None = None,
        adopted: Adoption | None = None,
        lookup: bool = True,
    ) -> GetResult:
        """Read the held blocks ``start_block ..`` of ``tokens`` (at most ``max_blocks``) onto ``device``
        (default CPU) as one ``[L, 2, n*T, H, D]`` tensor; with ``out`` (``[L, 2, >= n*T, H, D]``, the
        namespace's dtype) into ``out`` instead, at most as many blocks as it holds, and ``kv`` is a view
        of it; or with ``out`` a sequence of block tensors (``[L, 2, T, H, D]`` each, a block-major
        buffer), block ``j`` into ``out[j]``, and ``kv`` is None.

        The blocks are pinned (a lease) while read, then touched and promoted
        one tier up (``promote_on_hit``). A block whose frame fails its checks
        is deleted and counted; the result stops before it unless another tier
        holds a good copy. Blocks after the last local one are read from the
        cluster tier (if any) and stored locally as a put would (tier ``cluster``):
        before this returns, or with ``adopted`` after (a daemon answers its client
        first; see Adoption), and until ``adopted.done()`` is called (at once when
        nothing came from the cluster) ``out`` must stay as it is. A later call of
        ``lookup``, ``get``, ``locate``, ``evict`` and the like waits for those
        blocks to be stored (``settle``). ``lookup``: counted as a lookup (False: the rest of a
        ``locate``, which counted it). Blocks of ``out`` past the result may have been written
        (values from the cluster are received straight into their places) and hold nothing meaningful.
        """
        later = [] if adopted is None else [adopted]  # fill takes it out; else it is done here
        try:
            self.settle()
            return self._reads.get(ns, tokens, start_block, max_blocks, device, out, later, lookup=lookup)
        finally:
            if later:
                later.pop().done()

    def locate(
        self,
        ns: Namespace,
        tokens: Any,
        tiers: Collection[int],
        *,
        start_block: int = 0,
        max_blocks: int | None = None,
        lease: float | None = None,
        count: bool = True,
    ) -> Located:
        """Pin the held blocks ``start_block ..`` of ``tokens`` (at most ``max_blocks``) whose uppermost
        copy is in one of ``tiers`` (paged tiers another process can read: kvstore.shm) and say where
        their bytes are, for ``lease`` seconds (default and cap: the pin lease). The walk stops at the
        first block not held; ``rest`` counts the held blocks after the located ones (whose uppermost
        copy is elsewhere, the cluster tier included: read them with ``get``). End it with ``finish``,
        or with ``unlocate`` (not read). ``count``: whether it counts as a lookup now (else
        ``count_located`` does, later)."""
        self.settle()
        return self._reads.locate(
            ns, tokens, tiers, start_block=start_block, max_blocks=max_blocks, lease=lease, count=count
        )

    def try_locate(
        self,
        ns: Namespace,
        tokens: Any,
        tiers: Collection[int],
        *,
        start_block: int = 0,
        max_blocks: int | None = None,
        lease: float | None = None,
        keep: Callable[[Located], bool] = lambda _: True,
    ) -> Located | None:
        """``locate``, counted, when the store's lock is free this instant, every held block asked for
        is in ``tiers`` (``rest`` is 0: nothing to read from elsewhere), no cluster need be asked about
        a block not held here, and ``keep(located)`` agrees (called under the store's lock; it must not
        wait); else None, nothing pinned and nothing counted.

        For the daemon's event loop, which must never wait behind a put's tier or codec work."""
        return self._reads.try_locate(
            ns, tokens, tiers, start_block=start_block, max_blocks=max_blocks, lease=lease, keep=keep
        )

    def count_located(self, located: Located) -> None:
        """Count a locate made with ``count=False`` as the lookup it is."""
        self._reads.count_located(located)

    def unlocate(self, located: Located) -> None:
        """Let go of a locate's pins without reading it: neither a lookup nor hits nor misses."""
        self._reads.unlocate(located)

    def holds_namespace(self, ns_id: str) -> bool:
        """Whether a block of namespace ``ns_id`` is held in any tier. Read without the store's lock
        (one count; the daemon's event loop asks, and must not wait behind an evict or a disk
        write): a put indexing its first blocks may be missed, which costs its client a hello."""
        return self._index.namespace_blocks(ns_id) > 0

    def renew(self, located: Located, lease: float) -> bool:
        """Keep ``located``'s pins until ``lease`` seconds from now at least; False when they had run
        out (its blocks may have moved: the client's generation check makes them misses)."""
        return self._reads.renew(located, lease)

    def missed(self, located: Located) -> None:
        """The held blocks after ``located``'s (its ``rest``) were all read by ``get``: count the blocks
        not held after them (asked, and a miss in every tier), which ``finish`` leaves to this call."""
        self._reads.missed(located)

    def finish(self, located: Located, used: int) -> None:
        """A located read is over: ``used`` leading blocks were served (the rest came back moved or
        were not wanted). Unpins, counts hits, touches what was used and promotes it (``promote_on_hit``;
        a block from a frame tier is decoded here for that)."""
        self._reads.finish(located, used)

    def pin(self, keys: list[bytes], lease: float | None = None) -> PinHandle:
        """Pin the held blocks among ``keys`` for ``lease`` seconds (default: the policy's pin lease):
        they are neither evicted nor demoted until ``release`` or the lease ends."""
        self.settle()
        with self._lock:
            self._check_open()
            return self._pins.pin(
                [k for k in keys if k in self._index], self._lease if lease is None else lease
            )

    def release(self, handle: PinHandle) -> bool:
        """End a pin early; False when it had already ended."""
        with self._lock:
            return self._pins.release(handle)

    # -- operator operations (admin.py, reports.py) --------------------------------------------------
    def evict(self, flt: EvictFilter, *, dry_run: bool = False) -> EvictResult:
        """See AdminOps.evict."""
        self._check_open()
        self.settle()
        return self._admin.evict(flt, dry_run=dry_run)

    def prefetch(
        self, session: str, to: str = "ram", *, start_block: int = 0, max_blocks: int | None = None
    ) -> PrefetchResult:
        """See AdminOps.prefetch. A session this host does not know, but the cluster recorded (another
        host stored it), is read from the cluster into this host's tiers and becomes known here."""
        self._check_open()
        self.settle()
        try:
            return self._admin.prefetch(session, to, start_block=start_block, max_blocks=max_blocks)
        except KeyError:
            remote = self._cluster_admin
            found = None if remote is None else remote.find_session(session)
            if remote is None or found is None:
                raise
        return remote.prefetch(session, found, to, start_block, max_blocks)

    def session_tenant(self, name: str) -> str | None:
        """The tenant whose conversation session ``name`` is (its namespace's), here or, when this
        host does not know it, as the cluster recorded it; None when neither knows it."""
        self.settle()
        with self._lock:
            known = self._sessions.get(name) is not None
            ns = self._parts.session_namespace(name)
        if known:
            return None if ns is None else ns.tenant
        found = None if self._cluster_admin is None else self._cluster_admin.find_session(name)
        return None if found is None else found["ns"].tenant

    def sessions(self, tenant: str | None = None) -> list[SessionInfo]:
        """See Reports.sessions."""
        self.settle()
        return self._reports.sessions(tenant)

    def usage(self, tenant: str | None = None) -> list[NamespaceUsage]:
        """See Reports.usage."""
        self.settle()
        return self._reports.usage(tenant)

    def session(self, name: str) -> SessionDetail:
        self.settle()
        return self._reports.session(name)

    def stats(self) -> StoreStats:
        self.settle()
        return self._reports.stats()

    def check_integrity(self) -> list[str]:
        return self._reports.check_integrity()

    # -- durability and state --------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every stored block has reached nvme and LMDB is synced: the durable acknowledgement.

        With write-through off or admission on second use, the blocks not yet on nvme are written now
        (parents first). False when ``timeout`` passed first or a block, or a session's or namespace's
        row, could not be written (it stays queued: a later flush goes on), or when a block memory
        holds lost its nvme copy for room (a disk smaller than what memory holds; Mover.displaced)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        self.settle(timeout)
        if self._writeback is None:
            return True
        done = self._writeback.flush(left())
        if self._journal.pending:  # session or namespace rows whose write failed: once more
            self._journal.retry()
            done = self._writeback.flush(left()) and done
        return done and not self._journal.pending

    def settle(self, timeout: float | None = ADOPT_WAIT) -> bool:
        """Wait (up to ``timeout`` seconds) until the blocks earlier gets read from the cluster with
        ``adopted`` are stored here, so that what follows sees them (every call that reads or changes
        the index does). False when some are still being stored."""
        return True if self._cluster is None else self._cluster.reads.settle(timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the blocks queued for nvme are written; not a durability point (nothing else is
        written and nothing synced: that is ``flush``). False when ``timeout`` passed first."""
        return True if self._writeback is None else self._writeback.drain(timeout)

    def close(self) -> None:
        """Flush, stop the writer threads and close the tiers. Further calls raise StoreClosed.
        What waits for the cluster is written for up to 5 s more (it is a copy: nothing is lost)."""
        with self._lock:
            if self._closed or self._closing:
                return
            self._closing = True  # before the last flush: a put accepted after it would not be written
        if not self.flush() and self._writeback is not None:  # (settle: cluster reads are stored first)
            log.warning(
                "closing with %d block(s) not written to nvme (no room for them, or the disk refused them; "
                "see write_failures): "
                "they are lost with this process",
                self._writeback.unwritten(),
            )
        with self._lock:
            self._closed = True
        if self._cluster is not None:
            self._cluster.close()
        if self._writeback is not None:
            self._writeback.close()
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (lock held unless said otherwise) -------------------------------------
    def _check_open(self, adopted: bool = False) -> None:
        """StoreClosed once the store is closed, or closing (``adopted``: a put of blocks read from
        the cluster, which close's last flush waits for, goes on while it closes)."""
        if self._closed or (self._closing and not adopted):
            raise StoreClosed("the store is closed; open a new Store on the same nvme path")

    def _touch(self, e: Entry, now: float) -> None:
        """(Lock held.) ``e`` was used now: LRU order, and its nvme record's access time in time."""
        if self._writeback is not None:
            self._writeback.record_changed(e, now)
        self._index.touch(e, now)

    def _tenant_of(self, ns_id: str) -> str:
        """(Lock held.) The tenant whose session cap ``ns_id``'s sessions count against (a namespace
        whose description was lost counts as a tenant of its own)."""
        ns = self._namespaces.get(ns_id)
        return ns.tenant if ns is not None else f"namespace {ns_id}"

    def _session_rows(self) -> list[SessionState]:
        """Every session as it is now (takes the lock): what the journal writes again after it had to
        give up rows it could not write (journal.py)."""
        with self._lock:
            return self._sessions.all()
