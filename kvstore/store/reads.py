"""Reads: how much of a prefix is held, its blocks read out, or located for a same-host client.

::

    lookup(ns, tokens)   walk keys from block 0 while indexed, each hashed as the walk reaches it
                         (lock, one SHA-256 and one dict lookup a block; a miss ends the hashing);
                         past the local tiers, the cluster is asked in one round trip (no lock)
    get(ns, tokens)      pin the chain (lease) -> read + decode each block into its place in the
                         result (no lock) -> encode frames for promotion (no lock) -> touch,
                         promote one tier up, unpin (lock) -> the cluster fills what follows
    locate / finish      the same pin, the blocks' places in shared pools instead of their bytes;
                         finish counts, touches and promotes what the client used

The contracts are Store's (engine.py); the walks and the pins are here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch

from kvstore.chains import as_chain
from kvstore.keys import Namespace
from kvstore.kvbuffers import empty_kv
from kvstore.results import GetResult, LookupResult, check_index
from kvstore.store.adoption import Adoption
from kvstore.store.cluster import ClusterLink
from kvstore.store.datapath import DataPath, Read
from kvstore.store.index import Entry
from kvstore.store.movement import NO_FRAMES, Frames
from kvstore.store.parts import StoreParts
from kvstore.store.pins import PinHandle
from kvstore.tiers.paged import PagedTier, Place


class Reader:
    """Lookups, gets and located reads over one store's parts. ``cluster``: the shared tier's link
    (None: none); ``check_open`` raises once the store is closed and ``closed`` says whether it is
    (both called with the lock held)."""

    def __init__(
        self,
        parts: StoreParts,
        data: DataPath,
        cluster: ClusterLink | None,
        *,
        lease: float,
        check_open: Callable[[], None],
        closed: Callable[[], bool],
    ) -> None:
        self._lock, self._clock, self._tiers = parts.lock, parts.clock, parts.tiers
        self._index, self._pins, self._counts = parts.index, parts.pins, parts.counts
        self._data, self._cluster = data, cluster
        self._lease = lease
        self._check_open, self._closed = check_open, closed

    def lookup(self, ns: Namespace, tokens: Any, *, remote: bool, count: bool = True) -> LookupResult | None:
        """See Store.lookup; with ``remote`` False, None (nothing counted) where the answer needs
        the cluster."""
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
                tiers.append(self._tiers.names[e.highest()])
            if missed is not None and self._cluster is not None and self._cluster.cluster.available():
                if not remote:
                    return None
            else:
                missed = None
                if count:
                    self._count(chain.blocks(T) * T, len(tiers) * T)
        if missed is not None and self._cluster is not None:  # no lock held during the round trip
            held = self._cluster.reads.leading([missed, *islice(keys, chain.blocks(T) - len(tiers) - 1)])
            tiers += ["cluster"] * held
            if count:
                with self._lock:
                    self._count(chain.blocks(T) * T, len(tiers) * T)
        return LookupResult(len(tiers), len(tiers) * T, tiers)

    def _count(self, asked: int, matched: int) -> None:
        self._counts.lookups += 1
        self._counts.tokens_asked += asked
        self._counts.tokens_matched += matched

    def get(
        self,
        ns: Namespace,
        tokens: Any,
        start_block: int,
        max_blocks: int | None,
        device: torch.device | str | None,
        out: torch.Tensor | Sequence[torch.Tensor] | None,
        later: list[Adoption],
        *,
        lookup: bool = True,
    ) -> GetResult:
        """See Store.get; ``later`` holds its Adoption, taken out by the cluster's fill."""
        T = ns.layout.block_tokens
        start = check_index("start_block", start_block)
        names = as_chain(tokens)
        want = max(0, names.blocks(T) - start)
        if max_blocks is not None:
            want = min(want, check_index("max_blocks", max_blocks))
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
            self._counts.lookups += lookup
            self._counts.tokens_asked += want * T  # what this call could serve (max_blocks, out)
        # each block is decoded or copied straight into its place in the result: one copy, not two
        given = out is not None
        remote = missed is not None and self._cluster is not None and self._cluster.cluster.available()
        read: list[Read] = []
        try:  # from here on the pin is released whatever fails (the result's allocation too)
            if out is None and blocks_out is None and (chain or remote):
                out = empty_kv(
                    ns.layout.shape((want if remote else len(chain)) * T), ns.layout.torch_dtype, dev
                )
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
            ready: Frames = NO_FRAMES
            try:  # (a codec that raises what no codec should: the pin still ends here, not at its lease)
                ready = self._data.prepare_promotions(read)
            finally:
                with self._lock:
                    self._pins.release(handle)  # before promoting: the chain itself may need to make room
                    self._data.after_get(read, want - len(read), self._clock(), ready)
                    self._counts.tokens_served += len(read) * T
        tiers = [self._tiers.names[t] for _, _, t in read]
        if self._cluster is not None and read:
            self._cluster.touch([e.key for e, _, _ in read])
        if remote and missed is not None and len(read) == len(chain):
            assert self._cluster is not None
            n = self._cluster.reads.fill(
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
        count: bool = True,
        remote: bool = True,
    ) -> Located:
        T = ns.layout.block_tokens
        start = check_index("start_block", start_block)
        names = as_chain(tokens)
        want = max(0, names.blocks(T) - start)
        if max_blocks is not None:
            want = min(want, check_index("max_blocks", max_blocks))
        keys = names.iter_keys(ns, start if want else 0)
        lease = self._lease if lease is None else min(lease, self._lease)
        found: list[tuple[Entry, int]] = []
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
                if rest or t not in tiers or not isinstance(self._tiers[t], PagedTier):
                    rest += 1
                    continue
                found.append((e, t))
            places = self._places(found)
            handle = self._pins.pin([e.key for e, _ in found], lease, located=True)
        if remote and missed is not None and self._cluster is not None and self._cluster.cluster.available():
            held = len(places) + rest
            rest += self._cluster.reads.leading([missed, *islice(keys, want - held - 1)])
        # blocks asked for and not held: misses in every tier, counted with the hits by finish
        missing = want - len(places) - rest
        located = Located(ns, start, handle, places, rest, missing)
        if count:
            self.count_located(located)
        return located

    def try_locate(
        self,
        ns: Namespace,
        tokens: Any,
        tiers: Collection[int],
        *,
        start_block: int,
        max_blocks: int | None,
        lease: float | None,
        keep: Callable[[Located], bool],
    ) -> Located | None:
        """See Store.try_locate."""
        cluster = self._cluster
        if cluster is not None and cluster.reads.adopting():
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            located = self.locate(
                ns,
                tokens,
                tiers,
                start_block=start_block,
                max_blocks=max_blocks,
                lease=lease,
                count=False,
                remote=False,
            )
            try:
                asks_cluster = located.missing > 0 and cluster is not None and cluster.cluster.available()
                if located.rest or asks_cluster or not keep(located):
                    self.unlocate(located)
                    return None
                self.count_located(located)
            except BaseException:
                self.unlocate(located)
                raise
            return located
        finally:
            self._lock.release()

    def count_located(self, located: Located) -> None:
        """Count ``located`` as a lookup (``locate`` does, unless told not to)."""
        T = located.ns.layout.block_tokens
        with self._lock:
            # the blocks held but not located are read by a get (the daemon's, or the client's over
            # the socket), which counts them; the blocks not held after them are counted by the round
            # that reads the last of them (``missed``), or by this one: asked once, not once a round
            self._counts.lookups += 1
            asked = len(located.places) if located.rest else len(located.places) + located.missing
            self._counts.tokens_asked += asked * T

    def unlocate(self, located: Located) -> None:
        """Let go of ``located``'s pins, counting nothing: a locate not counted, and not read."""
        with self._lock:
            self._pins.release(located.handle)

    def renew(self, located: Located, lease: float) -> bool:
        """Keep ``located``'s pins ``lease`` seconds from now (the client's lease starts only once
        the daemon has read the blocks after them into staging). False when they had run out."""
        with self._lock:
            return self._pins.renew(located.handle, lease)

    def missed(self, located: Located) -> None:
        """The rest of ``located`` was read (into staging) to its end: the blocks not held after it
        are counted now, asked and missed, once."""
        with self._lock:
            self._counts.tokens_asked += located.missing * located.ns.layout.block_tokens
            self._data.after_get([], located.missing, self._clock())

    def _places(self, found: list[tuple[Entry, int]]) -> list[tuple[Entry, int, Place]]:
        """(Lock held.) Each found block with its tier and its place there, in order: each tier asked
        once for all of its blocks."""
        by_tier: dict[int, list[int]] = {}
        for j, (_, t) in enumerate(found):
            by_tier.setdefault(t, []).append(j)
        places: list[Place | None] = [None] * len(found)
        for t, rows in by_tier.items():
            tier = self._tiers[t]
            assert isinstance(tier, PagedTier)
            for j, place in zip(rows, tier.locate_many([found[j][0].key for j in rows]), strict=True):
                places[j] = place
        return [(e, t, p) for (e, t), p in zip(found, places, strict=True) if p is not None]

    def finish(self, located: Located, used: int) -> None:
        T = located.ns.layout.block_tokens
        used = max(0, min(used, len(located.places)))
        read: list[Read] = []
        try:
            for e, t, _ in located.places[:used]:
                block = None
                if t > 0 and self._data.promotes:
                    got = self._data.read(e, torch.device("cpu"), layout=located.ns.layout)
                    block = None if got is None else got[0]
                read.append((e, block, t))
            ready = self._data.prepare_promotions(read)
        except BaseException:  # (what no tier or codec should raise): the pin ends now, not at its lease
            with self._lock:
                self._pins.release(located.handle)
            raise
        with self._lock:
            self._pins.release(located.handle)
            if self._closed():
                return
            missing = 0 if located.rest else located.missing  # with a rest: see missed
            self._data.after_get(read, len(located.places) - used + missing, self._clock(), ready)
            self._counts.tokens_served += used * T
        if self._cluster is not None and read:
            self._cluster.touch([e.key for e, _, _ in read])


@dataclass(frozen=True)
class Located:
    """Blocks ``start ..`` of a prefix, pinned by ``handle``: each located block's entry, tier and
    place; ``rest``: held blocks after them whose uppermost copy is not in a located tier."""

    ns: Namespace
    start: int
    handle: PinHandle
    places: list[tuple[Entry, int, Place]]
    rest: int
    missing: int = 0  # blocks asked for and not held (after the located ones and ``rest``)
