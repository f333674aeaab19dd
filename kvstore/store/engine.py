"""The store engine: an index over three tiers, what the daemon's workers call.

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

One RLock guards the index and what each tier holds. Hashing (but for the
lazy walks of lookup and get: under a microsecond a block), layout checks,
get()'s reads and decodes, the ram frames of demotions and promotions (encoded
ahead, see ``Mover.prepared``), and the write-through's int4 encode and LMDB
put run outside it. Under it run memory copies into hbm, LMDB deletes, and
the encodes of demotions that were not foreseen (ram -> nvme with write-through
off, or a wrong guess). Operator operations (evict, prefetch, sessions, stats)
are in admin.py; the writer thread's work (write-through, TTL, record updates,
flush, close) in background.py.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvstore.errors import LayoutError
from kvstore.keys import Namespace, as_tokens, block_keys, iter_block_keys
from kvstore.results import (
    MISSING_PARENT,
    NO_ROOM,
    GetResult,
    InvalidRequest,
    LookupResult,
    PutResult,
    StoreClosed,
)
from kvstore.store.admin import AdminOps
from kvstore.store.datapath import DataPath
from kvstore.store.index import BlockIndex, Entry
from kvstore.store.movement import Mover
from kvstore.store.pins import PinHandle, PinTable
from kvstore.store.restore import restore
from kvstore.store.sessions import SessionState, SessionTable
from kvstore.store.writer import WriteThrough
from kvstore.tiers.base import Tier

if TYPE_CHECKING:
    from kvstore.config import Config, PolicyConfig


class Store(AdminOps, DataPath):
    """Blocks of K/V cache in hbm, ram and nvme tiers. Thread-safe: every public method may be
    called from several threads at once."""

    def __init__(
        self,
        hbm: Tier,
        ram: Tier | None,
        nvme: Any = None,
        policy: PolicyConfig | None = None,
        *,
        write_through: bool = True,
        admit: str = "always",
        ttl: float = 7 * 86400.0,
        clock: Any = time.time,
        tick: float = 1.0,
        backpressure: float = 2.0,
    ) -> None:
        """``nvme``: an NvmeTier or None. On an nvme path that already holds blocks, the index,
        namespaces and sessions are rebuilt from it. ``admit``: "always" or "second_use" (written
        to nvme on a block's second hit, or when demoted). ``backpressure``: the longest a put
        waits for room in the write-through queue (see writer.py)."""
        if admit not in ("always", "second_use"):
            raise InvalidRequest(f"admit must be 'always' or 'second_use', got {admit!r}")
        self._lease = 30.0 if policy is None else policy.pin_lease
        self._promote = True if policy is None else policy.promote_on_hit
        self._tiers: list[Tier] = [t for t in (hbm, ram, nvme) if t is not None]
        self._names = [t.name for t in self._tiers]
        self._nvme = nvme
        self._nvme_t: int | None = len(self._tiers) - 1 if nvme is not None else None
        self._lock = threading.RLock()
        self._clock = clock
        self._index = BlockIndex(len(self._tiers))
        self._pins = PinTable(clock)
        self._sessions = SessionTable()
        self._namespaces: dict[str, Namespace] = {}
        self._roots: dict[str, bytes] = {}
        self._tags: dict[tuple[str, ...], tuple[str, ...]] = {(): ()}
        self._mover = Mover(
            self._tiers,
            self._nvme_t,
            self._index,
            self._pins,
            self._sessions,
            self._namespaces,
            self._roots,
            self._persist_session,
        )
        self._write_through = write_through and nvme is not None
        self._admit = admit
        self._ttl = ttl
        self._backpressure = backpressure
        self._deferred: dict[bytes, None] = {}
        self._dirty: set[bytes] = set()
        self._writing: set[bytes] = set()
        self._counts = {
            "lookups": 0,
            "tokens_asked": 0,
            "tokens_matched": 0,
            "tokens_served": 0,
            "written": 0,
            "expired": 0,
            "write_failures": 0,
        }
        self._closed = False
        self._writer: WriteThrough | None = None
        if nvme is not None:
            report = restore(self._index, nvme, self._nvme_t or 0, self._namespaces, self._roots)
            self._mover.counters[self._nvme_t or 0].corrupt += report.damaged
            for name, d in nvme.iter_sessions():
                self._sessions.set(self._restored_session(SessionState.from_dict(name, d)))
            self._writer = WriteThrough(
                self._write_one, self._idle, maxsize=1024 if policy is None else policy.write_queue, tick=tick
            )

    @classmethod
    def from_config(cls, config: Config) -> Store:
        """Build the tiers a Config describes (nvme unless ``[nvme] enabled = false``) and a store over them."""
        from kvstore.codecs import get_codec
        from kvstore.tiers.hbm import HbmTier
        from kvstore.tiers.ram import RamTier

        p = config.policy
        hbm = HbmTier(config.hbm.capacity, device=config.hbm.resolved_device(), page_bytes=p.page_bytes)
        ram = RamTier(
            config.ram.capacity,
            get_codec(config.ram.codec),
            page_bytes=p.page_bytes,
            pin_memory=config.ram.pin_memory,
        )
        nvme = None
        if config.nvme.enabled:
            from kvstore.tiers.nvme import NvmeTier

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
        )

    # -- data path --------------------------------------------------------------------
    def put(
        self,
        ns: Namespace,
        tokens: Any,
        kv: torch.Tensor,
        *,
        session: str | None = None,
        start_block: int = 0,
    ) -> PutResult:
        """Store the full blocks of ``kv`` (``[L, 2, n*T(+tail), H, D]``) as blocks ``start_block ..``.

        ``tokens`` is the whole prefix (at least up to the last full block of
        ``kv``). Blocks already held are not rewritten: their access time and
        session tags update. When block ``start_block - 1`` is not held, the
        blocks are refused (``missing_parent``) rather than stored as orphans.
        Raises LayoutError / InvalidTokens / InvalidRequest for malformed input.
        """
        T = ns.layout.block_tokens
        arr = as_tokens(tokens)
        start = _index_arg("start_block", start_block)
        if session is not None and (not isinstance(session, str) or not session):
            raise InvalidRequest(f"session must be a non-empty string or None, got {session!r}")
        ns.layout.check_tensor(kv)
        n = kv.shape[2] // T
        if start + n > len(arr) // T:
            raise LayoutError(
                f"kv holds {kv.shape[2]} tokens for blocks from {start}, but tokens has only "
                f"{len(arr) // T} full blocks ({len(arr)} ids): pass the whole prefix as tokens"
            )
        keys = block_keys(ns, arr[: (start + n) * T])
        raw = arr.tobytes()
        stored = present = deferred = 0
        failed: list[tuple[int, str, str]] = []
        last, tail = start - 1, keys[start - 1] if start > 0 else None
        hold: PinHandle | None = None  # keeps the chunk's last block in place for the next chunk
        try:
            # Chunks bound how long the lock is held; each chunk's demotion frames are encoded before it.
            for c0 in range(start, start + n, _CHUNK):
                c1 = min(c0 + _CHUNK, start + n)
                frames = self._prepare_demotions(ns, keys[c0:c1])
                new: list[bytes] = []
                with self._lock:
                    self._check_open()
                    now = self._clock()
                    self._register(ns)
                    parent = self._index.get(tail) if tail is not None else None
                    if tail is not None and parent is None:
                        failed = [
                            (
                                i,
                                MISSING_PARENT,
                                f"block {c0 - 1} before block {c0} is not stored; put from "
                                f"block 0 (or the first missing block) instead",
                            )
                            for i in range(c0, start + n)
                        ]
                        break
                    self._mover.prepared = frames
                    try:
                        for i in range(c0, c1):
                            e = self._index.get(keys[i])
                            if e is not None:
                                self._touch(e, now, session)
                                present += 1
                            else:
                                e = Entry(
                                    keys[i],
                                    parent,
                                    ns.id,
                                    self._tag((), session),
                                    now,
                                    now,
                                    (i, raw[i * T * 4 : (i + 1) * T * 4]) if self._nvme is not None else None,
                                )
                                if not self._store_new(e, kv[:, :, (i - start) * T : (i - start + 1) * T]):
                                    failed = [
                                        (
                                            k,
                                            NO_ROOM,
                                            "every tier is full of pinned blocks; retry when reads finish",
                                        )
                                        for k in range(i, start + n)
                                    ]
                                    break
                                stored += 1
                                new.append(e.key)
                            parent, last, tail = e, i, e.key
                    finally:
                        self._mover.prepared = {}
                    if hold is not None:
                        self._pins.release(hold)
                    hold = (
                        self._pins.pin([tail], self._lease) if tail is not None and c1 < start + n else None
                    )
                    if session is not None and last >= start and (failed or c1 == start + n):
                        assert tail is not None
                        self._persist_session(
                            self._sessions.record_put(session, ns.id, tail, (last + 1) * T, now)
                        )
                if self._write_through and self._admit == "always":
                    deferred += len(self._submit(new))
                if failed:
                    break
        finally:
            if hold is not None:
                with self._lock:
                    self._pins.release(hold)
        return PutResult(stored=stored, present=present, failed=failed, deferred=deferred)

    def lookup(self, ns: Namespace, tokens: Any) -> LookupResult:
        """How many leading blocks of ``tokens`` are held (and the uppermost tier of each). Reads nothing."""
        arr = as_tokens(tokens)
        keys = iter_block_keys(ns, arr)
        tiers: list[str] = []
        with self._lock:
            self._check_open()
            for k in keys:  # hashed as the walk goes: a miss at block i costs i + 1 hashes, not one per block
                e = self._index.get(k)
                if e is None:
                    break
                tiers.append(self._names[e.highest()])
            self._counts["lookups"] += 1
            self._counts["tokens_asked"] += len(arr)
            self._counts["tokens_matched"] += len(tiers) * ns.layout.block_tokens
        return LookupResult(len(tiers), len(tiers) * ns.layout.block_tokens, tiers)

    def try_lookup(self, ns: Namespace, tokens: Any) -> LookupResult | None:
        """``lookup`` if the store's lock is free this instant, else None (nothing done).

        For the daemon's event loop, which must never wait behind a put's tier or codec work."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self.lookup(ns, tokens)
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
    ) -> GetResult:
        """Read the held blocks ``start_block ..`` of ``tokens`` (at most ``max_blocks``) onto ``device``
        (default CPU) as one ``[L, 2, n*T, H, D]`` tensor.

        The blocks are pinned (a lease) while read, then touched and promoted
        one tier up (``promote_on_hit``). A block whose frame fails its checks
        is deleted and counted; the result stops before it unless another tier
        holds a good copy.
        """
        T = ns.layout.block_tokens
        start = _index_arg("start_block", start_block)
        arr = as_tokens(tokens)
        want = max(0, len(arr) // T - start)
        if max_blocks is not None:
            want = min(want, _index_arg("max_blocks", max_blocks))
        keys = iter_block_keys(ns, arr)
        for _ in islice(keys, start if want else 0):  # the chain up to start_block: hashed before the lock
            pass
        dev = torch.device("cpu" if device is None else device)
        with self._lock:
            self._check_open()
            chain: list[Entry] = []
            for k in islice(keys, want):  # hashed as the walk goes, like lookup
                e = self._index.get(k)
                if e is None:
                    break
                chain.append(e)
            handle = self._pins.pin([e.key for e in chain], self._lease)
            self._counts["lookups"] += 1
            self._counts["tokens_asked"] += max(0, len(arr) - start * T)
        # each block is decoded or copied straight into its place in the result: one copy, not two
        out = _empty(ns.layout.shape(len(chain) * T), ns.layout.torch_dtype, dev) if chain else None
        read: list[tuple[Entry, torch.Tensor, int]] = []
        try:
            for j, e in enumerate(chain):
                assert out is not None
                got = self._read(e, dev, out[:, :, j * T : (j + 1) * T])
                if got is None:
                    break
                block, t = got  # block: a view of out (what promotion copies up)
                read.append((e, block, t))
        finally:
            frames = self._prepare_promotions(read)
            with self._lock:
                self._pins.release(handle)  # before promoting: the chain itself may need to make room
                self._mover.prepared = frames
                try:
                    self._after_get(read, missed=len(read) < want)
                finally:
                    self._mover.prepared = {}
                self._counts["tokens_served"] += len(read) * T
        if out is not None and len(read) < len(chain):
            out = out[:, :, : len(read) * T].contiguous()
        return GetResult(
            len(read), len(read) * T, out if read else None, [self._names[t] for _, _, t in read]
        )

    def pin(self, keys: list[bytes], lease: float | None = None) -> PinHandle:
        """Pin the held blocks among ``keys`` for ``lease`` seconds (default: the policy's pin lease):
        they are neither evicted nor demoted until ``release`` or the lease ends."""
        with self._lock:
            self._check_open()
            return self._pins.pin(
                [k for k in keys if k in self._index], self._lease if lease is None else lease
            )

    def release(self, handle: PinHandle) -> bool:
        """End a pin early; False when it had already ended."""
        with self._lock:
            return self._pins.release(handle)

    # -- state ------------------------------------------------------------------------
    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (lock held unless said otherwise) -------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed; open a new Store on the same nvme path")

    def _register(self, ns: Namespace) -> None:
        if ns.id not in self._namespaces:
            self._namespaces[ns.id] = ns
            self._roots[ns.id] = ns.root()
            if self._writer is not None:
                nvme, d = self._nvme, ns.to_dict()
                self._writer.run_soon(lambda: nvme.put_namespace(ns.id, d))

    def _tag(self, tags: tuple[str, ...], session: str | None) -> tuple[str, ...]:
        if session is None or session in tags:
            return tags
        t = (*tags, session)
        return self._tags.setdefault(t, t)

    def _touch(self, e: Entry, now: float, session: str | None = None) -> None:
        tags = self._tag(e.sessions, session)
        on_nvme = self._nvme_t is not None and e.tiers & (1 << self._nvme_t)
        if on_nvme and (tags is not e.sessions or int(e.last_access // 600) != int(now // 600)):
            self._dirty.add(e.key)  # the nvme record follows at the next idle tick (10-minute resolution)
        e.sessions = tags
        self._index.touch(e, now)

    def _needs_record(self, e: Entry) -> bool:
        return self._nvme_t is not None and not e.tiers & (1 << self._nvme_t)

    def _restored_session(self, s: SessionState) -> SessionState:
        if s.tail is not None and s.tail not in self._index:
            return replace(s, tail=None, tokens=0)
        return s


_CHUNK = 32  # blocks a put stores per hold of the lock


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor; on the CPU its memory comes from numpy, which asks the kernel for
    huge pages for large arrays (madvise): filling a 94 MB get result then takes a third of the
    time it takes in torch.empty's memory, faulted in 4 KiB at a time."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _index_arg(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidRequest(f"{name} must be a non-negative integer, got {v!r}")
    return v
