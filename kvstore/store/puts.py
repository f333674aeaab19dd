"""A put: a prefix's new blocks stored after their parent, chunk by chunk.

::

    put(ns, tokens, kv)  keys = block_keys(ns, tokens)          (hashing, checks: no lock)
                         per chunk of 32 blocks: encode the ram frames of the hbm blocks it will
                         likely push down (no lock), then store it (lock): new blocks -> hbm,
                         room made by demotion hbm -> ram -> nvme -> gone; the chunk's last block
                         stays pinned until the next chunk is stored after it
                         new keys -> write-through queue (nvme), the cluster's queue
                         the session's tail moves to the last block; the cluster records the session

A block already held is not rewritten (its access time updates); a block whose
parent is not held is refused (``missing_parent``), never stored as an orphan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.chains import Chain, KeyChain, as_chain
from kvstore.errors import Forbidden, KVStoreError, LayoutError
from kvstore.keys import Namespace
from kvstore.results import MISSING_PARENT, NO_ROOM, FailedBlock, PutResult, check_index
from kvstore.store.cluster import ClusterLink
from kvstore.store.datapath import DataPath
from kvstore.store.index import Entry, Pending
from kvstore.store.journal import Journal
from kvstore.store.movement import Frames, Mover
from kvstore.store.parts import StoreParts
from kvstore.store.pins import PinHandle
from kvstore.store.sessions import check_session_name
from kvstore.store.writeback import WriteBack


class Putter:
    """Puts into one store's parts. ``through``: the write-through to nvme a put feeds (None: off,
    or blocks reach nvme later: admission on second use, demotion); ``cluster``: the shared tier's
    link (None: none). ``touch(e, now)`` marks a block used; ``check_open(adopted)`` raises once the
    store is closed, or closing for a put not ``adopted`` (called with the lock held)."""

    def __init__(
        self,
        parts: StoreParts,
        data: DataPath,
        mover: Mover,
        journal: Journal,
        through: WriteBack | None,
        cluster: ClusterLink | None,
        *,
        lease: float,
        touch: Callable[[Entry, float], None],
        check_open: Callable[[bool], None],
    ) -> None:
        self._lock, self._clock, self._tiers = parts.lock, parts.clock, parts.tiers
        self._index, self._pins, self._sessions = parts.index, parts.pins, parts.sessions
        self._namespaces, self._on_disk = parts.namespaces, parts.on_disk
        self._session_namespace = parts.session_namespace
        self._data, self._mover, self._journal = data, mover, journal
        self._through, self._cluster = through, cluster
        self._lease = lease
        self._touch, self._check_open = touch, check_open

    def put(
        self,
        ns: Namespace,
        tokens: Any,
        kv: torch.Tensor | Sequence[torch.Tensor],
        *,
        session: str | None = None,
        start_block: int = 0,
        adopted: bool = False,
    ) -> PutResult:
        """See Store.put (``adopted``: the blocks came from the cluster, and are not sent back)."""
        T = ns.layout.block_tokens
        chain = as_chain(tokens)
        start = check_index("start_block", start_block)
        if session is not None:
            with self._lock:  # a session stored under an older build's rules goes on under its name
                known = self._sessions.get(session) is not None
                owner = self._session_namespace(session)
            check_session_name(session, allow_control=known)
            if owner is not None and owner.tenant != ns.tenant:  # (not named: a confined client's
                raise Forbidden(  # name is stored qualified, tenancy.py)
                    "the session named is a conversation of another tenant; a put cannot continue it: "
                    "store this one under another session name"
                )
        if isinstance(kv, torch.Tensor):
            ns.layout.check_tensor(kv)
            n = kv.shape[2] // T
        else:
            kv = list(kv)
            for b in kv:
                ns.layout.check_tensor(b, tokens=T, what="put block")
            n = len(kv)
        self._tiers.check_holds(ns.layout, position=start)  # the put's first block: the largest frame
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
            for c0 in range(start, job.end, CHUNK):  # chunks bound how long the lock is held
                c1 = min(c0 + CHUNK, job.end)
                ready = self._data.prepare_demotions(ns, job.keys[c0:c1])  # codec work: before the lock
                with self._lock:
                    self._check_open(adopted)
                    fresh = [k for k in job.keys[c0:c1] if k not in self._index]
                    known = self._namespaces.get(ns.id) is not None
                    try:
                        with self._tiers.batched_writes():  # landed before the lock is let go
                            new = self._chunk(job, c0, c1, ready)
                    except BaseException:
                        # a batched copy failed, or a tier or codec raised what no tier should: the
                        # chunk's new blocks are indexed, their bytes not all written; none of them
                        # may be served, and a namespace they registered has no block left
                        self._withdraw(fresh)
                        if not known:
                            self._namespaces.discard(ns.id)
                        raise
                    if hold is not None:
                        self._pins.release(hold)
                    more = not job.failed and c1 < job.end and job.tail is not None
                    hold = self._pins.pin([job.tail], self._lease) if more and job.tail is not None else None
                    queue, job.queue = job.queue, []  # in the chunk's order: parents first
                    if self._through is not None and queue:
                        self._through.expect(queue)  # found by others now: a flush waits until queued
                if self._through is not None and queue:
                    job.deferred += self._through.submit(queue, expected=True)
                if self._cluster is not None and not adopted:
                    self._cluster.submit(new, job.keys[c0:c1])  # and those dropped before (an outage)
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

    # -- internals (lock held) ---------------------------------------------------------
    def _chunk(self, job: _PutJob, c0: int, c1: int, ready: Frames) -> list[bytes]:
        """(Lock held.) Store blocks ``c0 .. c1-1`` of ``job``; returns the keys stored new. On the
        first block that cannot be stored, ``job.failed`` names it and every block after it."""
        now = self._clock()
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
            if parent is not None:  # a put continuing a prefix used it, root first as a get does:
                for a in self._index.chain(parent):  # its head must not look colder than its tail
                    self._touch(a, now)
        new: list[bytes] = []
        T = job.ns.layout.block_tokens
        added = False  # this put registered the namespace
        for i in range(c0, c1):
            e = self._index.get(job.keys[i])
            if e is not None:
                self._touch(e, now)
                job.present += 1
                if self._through is not None and self._through.owed(e):
                    job.queue.append(e.key)
            else:
                keeps_record = self._tiers.nvme is not None or self._cluster is not None  # both store records
                pending = Pending(job.base + i, *job.chain.identity(i, T)) if keeps_record else None
                e = Entry(job.keys[i], parent, job.ns.id, job.tags, now, now, pending)
                block = job.block(i)
                if self._namespaces.add(job.ns):  # with its first block (its record names the root):
                    added = True  # kept, and journaled, once a block is stored (below)
                try:
                    stored = self._data.store_new(e, block, ready)
                except KVStoreError as err:  # a tier failed while room was made (an LMDB delete, say)
                    job.fail(i, err.code or "tier_io", f"block {i} was not stored: {err}")
                    break
                if not stored and self._mover.disk_refusing():
                    job.fail(
                        i,
                        "tier_io",
                        f"block {i} was not stored: memory is full of blocks not yet on disk, and nvme "
                        "refuses writes (see the daemon's log)",
                    )
                    break
                if not stored:
                    job.fail(i, NO_ROOM, "every tier is full of pinned blocks; retry when reads finish")
                    break
                job.stored += 1
                new.append(e.key)
                job.queue.append(e.key)
            parent, job.last, job.tail = e, i, e.key
        if added and job.stored:
            self._journal.namespace(job.ns)
        elif added:  # a put that stores nothing registers nothing
            self._namespaces.discard(job.ns.id)
        if job.session is not None and job.tail is not None and job.last >= job.start:
            if job.failed or c1 == job.end:
                s = self._sessions.record_put(
                    job.session, job.ns.id, job.tail, (job.base + job.last + 1) * T, now, self._on_disk
                )
                self._journal.session(s)
        return new

    def _withdraw(self, keys: list[bytes]) -> None:
        """(Lock held.) Drop the blocks ``keys`` (with what hangs below them) wherever they are."""
        for k in keys:
            e = self._index.get(k)
            if e is not None:
                self._mover.drop_block(e)


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
    queue: list[bytes] = field(default_factory=list)  # this chunk's keys for nvme: new, or owed again
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


CHUNK = 32  # blocks a put stores per hold of the lock
