"""The store engine: an index over the tiers, composed of the parts that move, write and report.

::

    put(ns, tokens, kv)  keys = block_keys(ns, tokens)          (hashing, checks: no lock)
                         per chunk of 32 blocks: encode the ram frames of the hbm blocks it will
                         likely push down (no lock), then store it (lock): new blocks -> hbm,
                         room made by demotion hbm -> ram -> nvme -> gone
                         new keys -> write-through queue -> writer thread -> nvme (int4, LMDB)
    lookup(ns, tokens)   walk keys from block 0 while indexed, each hashed as the walk reaches it
                         (lock, one SHA-256 and one dict lookup a block; a miss ends the hashing)
    get(ns, tokens)      pin the chain (lease) -> read + decode each block (no lock) -> encode
                         frames for promotion (no lock) -> touch, promote one tier up, unpin (lock)

    Store ─┬─ TierSet      hbm, ram, nvme                  (tierset.py)
           ├─ BlockIndex   blocks, prefix tree, LRU        (index.py)
           ├─ Mover        room, demotion, promotion       (movement.py)
           ├─ DataPath     placing and reading blocks      (datapath.py)
           ├─ WriteBack    write-through, TTL, flush       (writeback.py, writer.py; with nvme)
           ├─ AdminOps     evict, prefetch, stats          (admin.py)
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

import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch

from kvstore.chains import Chain, KeyChain, as_chain
from kvstore.errors import KVStoreError, LayoutError
from kvstore.keys import Namespace
from kvstore.kvbuffers import empty_kv
from kvstore.results import (
    MISSING_PARENT,
    NO_ROOM,
    EvictFilter,
    EvictResult,
    FailedBlock,
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
from kvstore.store.datapath import DataPath, Read
from kvstore.store.index import BlockIndex, Entry, Pending
from kvstore.store.journal import Journal
from kvstore.store.movement import Frames, Mover
from kvstore.store.namespaces import NamespaceTable
from kvstore.store.parts import StoreParts
from kvstore.store.pins import PinHandle, PinTable
from kvstore.store.restore import restore
from kvstore.store.sessions import SessionState, SessionTable, check_session_name
from kvstore.store.tierset import TierSet
from kvstore.store.writeback import WriteBack
from kvstore.store.writer import Admission, WriteThrough
from kvstore.tiers.base import Tier
from kvstore.tiers.cluster import ClusterTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.paged import PagedTier, Place

if TYPE_CHECKING:
    from kvstore.config import Config, PolicyConfig
    from kvstore.memcopy import Copier
    from kvstore.tiers.pool import PoolMemory


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
        tick: float = 1.0,
        backpressure: float = 2.0,
        cluster: ClusterTier | None = None,
        cluster_queue: int = 1024,
    ) -> None:
        """On an nvme path that already holds blocks, the index, namespaces and sessions are
        rebuilt from it. ``admit``: see Admission. ``backpressure``: the longest a put waits for
        room in the write-through queue (see writer.py). ``cluster``: the shared tier below the
        local ones (cluster.py), written through from a queue of ``cluster_queue`` blocks."""
        try:
            self._admit = Admission(admit)
        except ValueError:
            raise InvalidRequest(f"admit must be 'always' or 'second_use', got {admit!r}") from None
        self._lease = 30.0 if policy is None else policy.pin_lease
        self._lock = threading.RLock()
        self._clock = clock
        self._closed = False
        self.tiers = TierSet(hbm, ram, nvme)
        self._index = BlockIndex(len(self.tiers))
        self._pins = PinTable(clock)
        self._sessions = SessionTable()
        self._namespaces = NamespaceTable()
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
        queue = 1024 if policy is None else policy.write_queue
        writer = None if nvme is None else WriteThrough(maxsize=queue, tick=tick)
        self._journal = Journal(writer, nvme)
        self._mover = Mover(parts, self._journal.session)
        self._write_through = write_through and nvme is not None
        self._writeback: WriteBack | None = None
        if nvme is not None and writer is not None:
            report = restore(self._index, nvme, self.tiers.last, self._namespaces)
            self._mover.counters[self.tiers.last].corrupt += report.damaged
            for name, d in nvme.iter_sessions():
                self._sessions.set(self._restored_session(SessionState.from_dict(name, d)))
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
            self._writeback,
            lease=self._lease,
            cluster=self._cluster_admin,
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
        from it, and are not sent back).
        """
        T = ns.layout.block_tokens
        chain = as_chain(tokens)
        start = _index_arg("start_block", start_block)
        if session is not None:
            check_session_name(session)
        if isinstance(kv, torch.Tensor):
            ns.layout.check_tensor(kv)
            n = kv.shape[2] // T
        else:
            kv = list(kv)
            for b in kv:
                ns.layout.check_tensor(b, tokens=T, what="put block")
            n = len(kv)
        if start + n > chain.blocks(T):
            raise LayoutError(
                f"kv holds {n * T} tokens for blocks from {start}, but the request names only "
                f"{chain.blocks(T)} full blocks: pass the whole prefix"
            )
        keys = chain.keys(ns, start + n)
        tail = keys[start - 1] if start > 0 else chain.parent_key(ns)
        job = _PutJob(ns, keys, chain, kv, start, start + n, session, tail=tail)
        hold: PinHandle | None = None  # keeps the last chunk's last block in place for the next chunk
        try:
            for c0 in range(start, job.end, _CHUNK):  # chunks bound how long the lock is held
                c1 = min(c0 + _CHUNK, job.end)
                ready = self._data.prepare_demotions(ns, job.keys[c0:c1])  # codec work: before the lock
                with self._lock:
                    self._check_open()
                    fresh = [k for k in job.keys[c0:c1] if k not in self._index]
                    try:
                        with self.tiers.batched_writes():  # landed before the lock is let go
                            new = self._put_chunk(job, c0, c1, ready)
                    except BaseException:
                        # a batched copy failed: the chunk's new blocks are indexed, their bytes not
                        # all written; none of them may be served
                        self._withdraw(fresh)
                        raise
                    if hold is not None:
                        self._pins.release(hold)
                    more = not job.failed and c1 < job.end and job.tail is not None
                    hold = self._pins.pin([job.tail], self._lease) if more and job.tail is not None else None
                if self._write_through and self._admit is Admission.ALWAYS and self._writeback is not None:
                    job.deferred += self._writeback.submit(new)
                if self._cluster is not None and not _adopted:
                    self._cluster.submit(new)
                if job.failed:
                    break
        finally:
            if hold is not None:
                with self._lock:
                    self._pins.release(hold)
        if self._cluster is not None and session is not None and job.last >= job.start:
            last = job.last + 1
            tokens = chain.head(last, T).fields().get("tokens")
            self._cluster.session(
                session, ns, job.keys[:last], None if tokens is None else tokens.tobytes(), self._clock()
            )
        return PutResult(stored=job.stored, present=job.present, failed=job.failed, deferred=job.deferred)

    def lookup(self, ns: Namespace, tokens: Any) -> LookupResult:
        """How many leading blocks of ``tokens`` are held (and the uppermost tier of each). Reads nothing.

        Where the local tiers end, the cluster tier (if any) is asked about the blocks after, in one
        round trip; those it holds are reported as tier ``cluster``."""
        self.settle()
        r = self._lookup(ns, tokens, remote=True)
        assert r is not None
        return r

    def try_lookup(self, ns: Namespace, tokens: Any) -> LookupResult | None:
        """``lookup`` if the store's lock is free this instant and the answer needs no cluster round
        trip, else None (nothing done, nothing counted).

        For the daemon's event loop, which must never wait behind a put's tier or codec work."""
        if self._cluster is not None and self._cluster.adopting():
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._lookup(ns, tokens, remote=False)
        finally:
            self._lock.release()

    def _lookup(self, ns: Namespace, tokens: Any, *, remote: bool) -> LookupResult | None:
        T = ns.layout.block_tokens
        chain = as_chain(tokens)
        keys = chain.iter_keys(ns)
        tiers: list[str] = []
        missed: bytes | None = None
        with self._lock:
            self._check_open()
            for k in keys:  # hashed as the walk goes: a miss at block i costs i + 1 hashes, not one per block
                e = self._index.get(k)
                if e is None:
                    missed = k
                    break
                tiers.append(self.tiers.names[e.highest()])
            if missed is not None and self._cluster is not None and self._cluster.cluster.available():
                if not remote:
                    return None
            else:
                missed = None
                self._count_lookup(chain.tokens_named(T), len(tiers) * T)
        if missed is not None and self._cluster is not None:  # no lock held during the round trip
            held = self._cluster.leading([missed, *islice(keys, chain.blocks(T) - len(tiers) - 1)])
            tiers += ["cluster"] * held
            with self._lock:
                self._count_lookup(chain.tokens_named(T), len(tiers) * T)
        return LookupResult(len(tiers), len(tiers) * T, tiers)

    def _count_lookup(self, asked: int, matched: int) -> None:
        self._counts.lookups += 1
        self._counts.tokens_asked += asked
        self._counts.tokens_matched += matched

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
        blocks to be stored (``settle``).
        """
        later = [] if adopted is None else [adopted]  # fill takes it out; else it is done here
        try:
            return self._get(ns, tokens, start_block, max_blocks, device, out, later)
        finally:
            if later:
                later.pop().done()

    def _get(
        self,
        ns: Namespace,
        tokens: Any,
        start_block: int,
        max_blocks: int | None,
        device: torch.device | str | None,
        out: torch.Tensor | Sequence[torch.Tensor] | None,
        later: list[Adoption],
    ) -> GetResult:
        self.settle()
        T = ns.layout.block_tokens
        start = _index_arg("start_block", start_block)
        names = as_chain(tokens)
        want = max(0, names.blocks(T) - start)
        if max_blocks is not None:
            want = min(want, _index_arg("max_blocks", max_blocks))
        blocks_out: Sequence[torch.Tensor] | None = None
        if out is not None and not isinstance(out, torch.Tensor):
            blocks_out, out = out, None
            for b in blocks_out:
                ns.layout.check_tensor(b, tokens=T, what="get out block")
            want = min(want, len(blocks_out))
        if out is not None:
            ns.layout.check_tensor(out, what="get out")
            want = min(want, out.shape[2] // T)
        keys = names.iter_keys(
            ns, start if want else 0
        )  # the chain up to start_block: hashed before the lock
        dev = torch.device("cpu" if device is None else device)
        if out is not None:
            dev = out.device
        elif blocks_out:
            dev = blocks_out[0].device
        missed: bytes | None = None
        with self._lock:
            self._check_open()
            chain: list[Entry] = []
            for k in islice(keys, want):  # hashed as the walk goes, like lookup
                e = self._index.get(k)
                if e is None:
                    missed = k
                    break
                chain.append(e)
            handle = self._pins.pin([e.key for e in chain], self._lease)
            self._counts.lookups += 1
            self._counts.tokens_asked += max(0, names.tokens_named(T) - start * T)
        # each block is decoded or copied straight into its place in the result: one copy, not two
        given = out is not None
        remote = missed is not None and self._cluster is not None and self._cluster.cluster.available()
        if out is None and blocks_out is None and (chain or remote):
            out = empty_kv(ns.layout.shape((want if remote else len(chain)) * T), ns.layout.torch_dtype, dev)
        read: list[Read] = []
        try:
            for j, e in enumerate(chain):
                if blocks_out is not None:
                    dst = blocks_out[j]
                else:
                    assert out is not None
                    dst = out[:, :, j * T : (j + 1) * T]
                got = self._data.read(e, dev, dst)
                if got is None:
                    break
                block, t = got  # block: a view of out (what promotion copies up)
                read.append((e, block, t))
        finally:
            ready = self._data.prepare_promotions(read)
            with self._lock:
                self._pins.release(handle)  # before promoting: the chain itself may need to make room
                self._data.after_get(read, len(read) < want, self._clock(), ready)
                self._counts.tokens_served += len(read) * T
        tiers = [self.tiers.names[t] for _, _, t in read]
        if remote and missed is not None and len(read) == len(chain):
            assert self._cluster is not None
            n = self._cluster.fill(
                ns,
                names,
                start,
                len(read),
                want,
                missed,
                keys,
                out,
                blocks_out,
                later.pop() if later else None,
            )
            tiers += ["cluster"] * n
        blocks = len(tiers)
        if out is not None and out.shape[2] != blocks * T:
            out = out[:, :, : blocks * T] if given else out[:, :, : blocks * T].contiguous()
        return GetResult(blocks, blocks * T, out if blocks else None, tiers)

    def locate(
        self,
        ns: Namespace,
        tokens: Any,
        tiers: Collection[int],
        *,
        start_block: int = 0,
        max_blocks: int | None = None,
        lease: float | None = None,
    ) -> Located:
        """Pin the held blocks ``start_block ..`` of ``tokens`` (at most ``max_blocks``) whose uppermost
        copy is in one of ``tiers`` (paged tiers another process can read: kvstore.shm) and say where
        their bytes are, for ``lease`` seconds (default and cap: the pin lease). The walk stops at the
        first block not held; ``rest`` counts the held blocks after the located ones (whose uppermost
        copy is elsewhere, the cluster tier included: read them with ``get``). End it with ``finish``."""
        self.settle()
        T = ns.layout.block_tokens
        start = _index_arg("start_block", start_block)
        names = as_chain(tokens)
        want = max(0, names.blocks(T) - start)
        if max_blocks is not None:
            want = min(want, _index_arg("max_blocks", max_blocks))
        keys = names.iter_keys(ns, start if want else 0)
        lease = self._lease if lease is None else min(lease, self._lease)
        places: list[tuple[Entry, int, Place]] = []
        rest = 0
        missed: bytes | None = None
        with self._lock:
            self._check_open()
            for k in islice(keys, want):
                e = self._index.get(k)
                if e is None:
                    missed = k
                    break
                t = e.highest()
                tier = self.tiers[t]
                if rest or t not in tiers or not isinstance(tier, PagedTier):
                    rest += 1
                    continue
                places.append((e, t, tier.locate(k)))
            handle = self._pins.pin([e.key for e, _, _ in places], lease)
            self._counts.lookups += 1
            self._counts.tokens_asked += max(0, names.tokens_named(T) - start * T)
        if missed is not None and self._cluster is not None and self._cluster.cluster.available():
            held = len(places) + rest
            rest += self._cluster.leading([missed, *islice(keys, want - held - 1)])
        return Located(ns, start, handle, places, rest)

    def finish(self, located: Located, used: int) -> None:
        """A located read is over: ``used`` leading blocks were served (the rest came back moved or
        were not wanted). Unpins, counts hits, touches what was used and promotes it (``promote_on_hit``;
        a block from a frame tier is decoded here for that)."""
        T = located.ns.layout.block_tokens
        used = max(0, min(used, len(located.places)))
        read: list[Read] = []
        for e, t, _ in located.places[:used]:
            block = None
            if t > 0 and self._data.promotes:
                got = self._data.read(e, torch.device("cpu"))
                block = None if got is None else got[0]
            read.append((e, block, t))
        ready = self._data.prepare_promotions(read)
        with self._lock:
            self._pins.release(located.handle)
            if self._closed:
                return
            self._data.after_get(read, used < len(located.places), self._clock(), ready)
            self._counts.tokens_served += used * T

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

    # -- operator operations (admin.py) --------------------------------------------------
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

    def sessions(self, tenant: str | None = None) -> list[SessionInfo]:
        """See AdminOps.sessions."""
        self.settle()
        return self._admin.sessions(tenant)

    def usage(self, tenant: str | None = None) -> list[NamespaceUsage]:
        """See AdminOps.usage."""
        self.settle()
        return self._admin.usage(tenant)

    def session(self, name: str) -> SessionDetail:
        self.settle()
        return self._admin.session(name)

    def stats(self) -> StoreStats:
        self.settle()
        return self._admin.stats()

    def check_integrity(self) -> list[str]:
        return self._admin.check_integrity()

    # -- durability and state --------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every stored block has reached nvme and LMDB is synced: the durable acknowledgement.

        With write-through off or admission on second use, the blocks not yet on nvme are written now
        (parents first). False when ``timeout`` passed first or a block could not be written (it stays
        queued: a later flush goes on)."""
        self.settle(timeout)
        return True if self._writeback is None else self._writeback.flush(timeout)

    def settle(self, timeout: float | None = ADOPT_WAIT) -> bool:
        """Wait (up to ``timeout`` seconds) until the blocks earlier gets read from the cluster with
        ``adopted`` are stored here, so that what follows sees them (every call that reads or changes
        the index does). False when some are still being stored."""
        return True if self._cluster is None else self._cluster.settle(timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the blocks queued for nvme are written; not a durability point (nothing else is
        written and nothing synced: that is ``flush``). False when ``timeout`` passed first."""
        return True if self._writeback is None else self._writeback.drain(timeout)

    def close(self) -> None:
        """Flush, stop the writer threads and close the tiers. Further calls raise StoreClosed.
        What waits for the cluster is written for up to 5 s more (it is a copy: nothing is lost)."""
        with self._lock:
            if self._closed:
                return
        self.flush()
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
    def _put_chunk(self, job: _PutJob, c0: int, c1: int, ready: Frames) -> list[bytes]:
        """(Lock held.) Store blocks ``c0 .. c1-1`` of ``job``; returns the keys stored new. On the
        first block that cannot be stored, ``job.failed`` names it and every block after it."""
        now = self._clock()
        if self._namespaces.add(job.ns):
            self._journal.namespace(job.ns)
        parent = self._index.get(job.tail) if job.tail is not None else None
        if job.tail is not None and parent is None:
            job.fail(
                c0,
                MISSING_PARENT,
                f"block {c0 - 1} before block {c0} is not stored; put from "
                "block 0 (or the first missing block) instead"
                if c0 > 0
                else "the page before the first engine key (its parent) is not stored; put it first",
            )
            return []
        if job.base is None:  # an engine chain's positions continue its parent's (the tree depth)
            job.base = parent.position() + 1 - c0 if isinstance(job.chain, KeyChain) and parent else 0
        new: list[bytes] = []
        T = job.ns.layout.block_tokens
        for i in range(c0, c1):
            e = self._index.get(job.keys[i])
            if e is not None:
                self._touch(e, now)
                job.present += 1
            else:
                keeps_record = self.tiers.nvme is not None or self._cluster is not None  # both store records
                pending = Pending(job.base + i, *job.chain.identity(i, T)) if keeps_record else None
                e = Entry(job.keys[i], parent, job.ns.id, job.tags, now, now, pending)
                block = job.block(i)
                try:
                    stored = self._data.store_new(e, block, ready)
                except KVStoreError as err:  # a tier failed while room was made (an LMDB delete, say)
                    job.fail(i, err.code or "tier_io", f"block {i} was not stored: {err}")
                    break
                if not stored:
                    job.fail(i, NO_ROOM, "every tier is full of pinned blocks; retry when reads finish")
                    break
                job.stored += 1
                new.append(e.key)
            parent, job.last, job.tail = e, i, e.key
        if job.session is not None and job.tail is not None and job.last >= job.start:
            if job.failed or c1 == job.end:
                s = self._sessions.record_put(
                    job.session, job.ns.id, job.tail, (job.base + job.last + 1) * T, now
                )
                self._journal.session(s)
        return new

    def _withdraw(self, keys: list[bytes]) -> None:
        """(Lock held.) Drop the blocks ``keys`` (with what hangs below them) wherever they are."""
        for k in keys:
            e = self._index.get(k)
            if e is not None:
                self._mover.drop_block(e)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed; open a new Store on the same nvme path")

    def _touch(self, e: Entry, now: float) -> None:
        """(Lock held.) ``e`` was used now: LRU order, and its nvme record's access time in time."""
        if self._writeback is not None:
            self._writeback.record_changed(e, now)
        self._index.touch(e, now)

    def _restored_session(self, s: SessionState) -> SessionState:
        if s.tail is not None and s.tail not in self._index:
            return replace(s, tail=None, tokens=0)
        return s


@dataclass(frozen=True)
class Located:
    """Blocks ``start ..`` of a prefix, pinned by ``handle``: each located block's entry, tier and
    place; ``rest``: held blocks after them whose uppermost copy is not in a located tier."""

    ns: Namespace
    start: int
    handle: PinHandle
    places: list[tuple[Entry, int, Place]]
    rest: int


@dataclass
class _PutJob:
    """One put's blocks and its progress through them (``tail``: the last block stored or present)."""

    ns: Namespace
    keys: list[bytes]
    chain: Chain  # what names the blocks (what each record keeps: tokens or engine key)
    kv: torch.Tensor | list[torch.Tensor]  # [L, 2, n*T, H, D], or n blocks [L, 2, T, H, D]
    start: int
    end: int
    session: str | None
    tail: bytes | None  # the key of the block before block ``start`` (None: the namespace root)
    base: int | None = None  # block i's position is base + i (set at the first chunk)
    tags: tuple[str, ...] = ()  # the new blocks' tags: the session that stores them (one tuple for all)
    stored: int = 0
    present: int = 0
    deferred: int = 0
    failed: list[FailedBlock] = field(default_factory=list)
    last: int = -1

    def __post_init__(self) -> None:
        self.last = self.start - 1
        self.tags = () if self.session is None else (self.session,)

    def block(self, i: int) -> torch.Tensor:
        """Block ``i`` of the prefix (``start <= i < end``), a view of ``kv``."""
        if isinstance(self.kv, list):
            return self.kv[i - self.start]
        T = self.ns.layout.block_tokens
        return self.kv[:, :, (i - self.start) * T : (i - self.start + 1) * T]

    def fail(self, i: int, code: str, message: str) -> None:
        """Blocks ``i ..`` of the put are not stored, for ``code``."""
        self.failed = [FailedBlock(k, code, message) for k in range(i, self.end)]


_CHUNK = 32  # blocks a put stores per hold of the lock


def _index_arg(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidRequest(f"{name} must be a non-negative integer, got {v!r}")
    return v
