"""What the daemon does for each request: one store call, turned into a reply.

``Handlers.handle`` runs on a worker thread (never on the event loop: store
calls may wait on LMDB and codecs). It never raises: every exception becomes
an ErrorReply with a stable code, so no request can take the daemon down.
"""

from __future__ import annotations

import logging
import math
import secrets
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.daemon.tenancy import SHARED_OPS, TenantOps
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, block_keys
from kvstore.results import EvictFilter
from kvstore.shm.plane import StagingFull
from kvstore.store.adoption import Adoption
from kvstore.store.reads import Located
from kvstore.tiers.base import TierName
from kvstore.wire.errors import ProtocolError, wire_code
from kvstore.wire.messages import (
    Commit,
    DataOk,
    ErrorReply,
    Evict,
    EvictOk,
    Finish,
    FinishOk,
    Flush,
    FlushOk,
    Get,
    GetOk,
    Inspect,
    Locate,
    LocateOk,
    Lookup,
    LookupOk,
    Message,
    Pin,
    PinOk,
    Prefetch,
    Put,
    PutOk,
    Release,
    ReleaseOk,
    Reserve,
    ReserveOk,
    Stats,
)
from kvstore.wire.protocol import Request, payload_tensor, tensor_payload

if TYPE_CHECKING:
    from kvstore.shm.plane import SharedPlane
    from kvstore.store.engine import Store

STAGING = -1  # a located block's segment index when it is in the client's staging segment

_EXTENT = struct.Struct("<qq")  # one (offset, length) run of a located block, as the client reads it
log = logging.getLogger("kvstore.daemon.server")

PREFETCH_TARGETS = (TierName.RAM.value, TierName.HBM.value)  # nvme holds everything already
# Pins held through the protocol at once, and the block references they hold in all (each costs the
# store's pin table an entry): bounds what clients pinning in a loop can make the daemon keep. Each
# tenant holds at most its quota of them (PinQuota), so one tenant cannot fill the table for all.
MAX_PINS = 4096
MAX_PINNED_KEYS = 1 << 18
MAX_FLUSH_WAIT = 60.0  # seconds one flush request may hold a worker; the client asks again
FLUSH_SLACK = 0.05  # seconds: a flush that ended this close to its time ran out of it
# Longest lookup answered on the event loop (blocks): about 0.6 us a block hashed and found (16384 in 10 ms),
# so about a ms at most; longer ones (block_tokens = 1 makes a block of every token) go to a worker
INLINE_BLOCKS = 2048


@dataclass(frozen=True)
class PinQuota:
    """What one tenant (its namespaces' ``tenant``) may hold pinned through the protocol at once."""

    pins: int = 1024
    blocks: int = 65536


class Handlers:
    """Maps each request op to its store call. Thread-safe as far as the store is."""

    def __init__(
        self,
        store: Store,
        server_info: Callable[[], dict[str, Any]],
        *,
        max_lease: float = 30.0,
        pin_quota: PinQuota | None = None,
        plane: SharedPlane | None = None,
    ) -> None:
        """``plane``: the shared-memory data plane, when this daemon offers one (ipc endpoints)."""
        self.store = store
        self.server_info = server_info
        self.max_lease = max_lease  # a client's pin never outlives this (the store's pin lease)
        self.pin_quota = pin_quota or PinQuota()
        self.failed_blocks = 0  # blocks put replies named as not stored (stats: server.put_failed_blocks)
        # pin handles given to clients: a random id (unguessable by other clients) ->
        # (store handle, expiry, tenant)
        self._pins: dict[int, tuple[Any, float, str]] = {}
        # same-host reads' pins (a locate's blocks, until its finish or its lease's end), counted in the
        # same quota: id of the Located -> (blocks, expiry, tenant)
        self._located: dict[int, tuple[int, float, str]] = {}
        self._pins_lock = threading.Lock()
        self._ops: dict[type[Message], Callable[[Any, Namespace | None], Message]] = {
            Lookup: self._lookup,
            Get: self._get,
            Put: self._put,
            Evict: self._evict,
            Stats: self._stats,
            Inspect: self._inspect,
            Prefetch: self._prefetch,
            Flush: self._flush,
            Pin: self._pin,
            Release: self._release,
        }
        self.tenant_ops = TenantOps(store, server_info)  # requests of CURVE clients confined to a tenant
        self.plane = plane

    def handle(self, request: Request) -> Message:
        """The reply to ``request``: its op's result, or an ErrorReply. Never raises.

        A request with a ``tenant`` (an authenticated CURVE client) goes through
        TenantOps, which limits it to that tenant's sessions and blocks.
        """
        try:
            if isinstance(request.msg, SHARED_OPS):
                return self._shared(request)
            if request.tenant is not None:
                return self.tenant_ops.handle(request.msg, request.namespace, request.tenant, self._run)
            return self._run(request.msg, request.namespace)
        except (KVStoreError, ProtocolError) as e:
            return ErrorReply(code=wire_code(getattr(e, "code", None)), message=str(e))
        except Exception as e:  # the daemon must survive anything a request triggers
            log.exception("request %s (%s) failed", request.id, request.msg.op)
            return ErrorReply(
                code="internal",
                message=f"{request.msg.op} failed inside the daemon: "
                f"{type(e).__name__}: {e} (see the daemon log)",
            )

    def _run(self, msg: Message, ns: Namespace | None) -> Message:
        return self._ops[type(msg)](msg, ns)

    def try_inline(self, request: Request) -> Message | None:
        """The reply to a lookup when the store can answer this instant without waiting, else None.

        Lookups only walk the in-memory index; run on the event loop they skip
        two thread hand-offs. Whenever the store is busy (a put moving blocks,
        a codec at work) the lookup goes to a worker like everything else.
        """
        if not isinstance(request.msg, Lookup) or request.namespace is None:
            return None
        if request.msg.chain.blocks(request.namespace.layout.block_tokens) > INLINE_BLOCKS:
            return None  # a long walk (block_tokens = 1: a key per token) would hold every client up
        try:
            r = self.store.try_lookup(request.namespace, request.msg.chain)
        except Exception:
            return None  # let a worker run it and turn the error into a reply
        if r is None:
            return None
        return LookupOk(matched_blocks=r.matched_blocks, matched_tokens=r.matched_tokens, tiers=list(r.tiers))

    def _lookup(self, msg: Lookup, ns: Namespace | None) -> Message:
        assert ns is not None
        r = self.store.lookup(ns, msg.chain)
        return LookupOk(matched_blocks=r.matched_blocks, matched_tokens=r.matched_tokens, tiers=list(r.tiers))

    def _get(self, msg: Get, ns: Namespace | None) -> Message:
        assert ns is not None
        r = self.store.get(  # blocks from the cluster are stored here after the reply (they stay in r)
            ns,
            msg.chain,
            start_block=msg.start_block,
            max_blocks=msg.max_blocks,
            device="cpu",
            adopted=Adoption.now(),
        )
        if r.kv is None or r.matched_blocks == 0:
            return GetOk(start_block=msg.start_block, blocks=0, tiers=[])
        ns.layout.check_tensor(
            r.kv, tokens=r.matched_blocks * ns.layout.block_tokens, what="store get result"
        )
        return GetOk(
            start_block=msg.start_block, blocks=r.matched_blocks, tiers=list(r.tiers), kv=tensor_payload(r.kv)
        )

    def _put(self, msg: Put, ns: Namespace | None, kv: Any = None) -> Message:
        assert ns is not None
        if kv is None:
            kv = payload_tensor(msg.kv, msg.shape, ns.layout.torch_dtype)
        end = msg.start_block + msg.shape[2] // ns.layout.block_tokens
        chain = msg.chain.head(end, ns.layout.block_tokens)
        r = self.store.put(ns, chain, kv, session=msg.session, start_block=msg.start_block)
        if r.failed:
            log.warning(
                "put of blocks %d..%d failed from block %d: %s",
                msg.start_block,
                end - 1,
                r.failed[0].block,
                r.failed[0].message,
            )
        self.failed_blocks += len(r.failed)
        return PutOk(
            stored=r.stored, present=r.present, failed=[list(f) for f in r.failed], deferred=r.deferred
        )

    def _evict(self, msg: Evict, ns: Namespace | None) -> Message:
        flt = EvictFilter(
            session=msg.session,
            older_than=msg.older_than,
            tier=msg.tier,
            namespace=msg.namespace,
            model=msg.model,
            tenant=msg.tenant,
            all=msg.all,
        )
        r = self.store.evict(flt, dry_run=msg.dry_run)
        return EvictOk(
            blocks=r.blocks,
            bytes_freed=dict(r.bytes_freed),
            moved=r.moved,
            keys=list(r.keys),
            not_done=r.not_done or None,
            displaced=r.displaced or None,
        )

    def _stats(self, msg: Stats, ns: Namespace | None) -> Message:
        return DataOk(data={"store": self.store.stats().to_dict(), "server": self.server_info()})

    def _inspect(self, msg: Inspect, ns_unused: Namespace | None) -> Message:
        if msg.tokens is not None:
            if msg.ns is None:
                raise ProtocolError("bad_header", "inspect of tokens needs the ns field")
            ns = ns_unused
            assert ns is not None
            r = self.store.lookup(ns, msg.tokens, count=False)  # an operator's look: not traffic
            keys = block_keys(ns, msg.tokens)[: r.matched_blocks]
            blocks = [
                {"position": i, "key": k.hex(), "tier": t}
                for i, (k, t) in enumerate(zip(keys, r.tiers, strict=False))
            ]
            return DataOk(
                data={
                    "namespace": ns.id,
                    "tokens": len(msg.tokens),
                    "matched_tokens": r.matched_tokens,
                    "blocks": blocks,
                }
            )
        if msg.session is not None:
            try:
                return DataOk(data=asdict(self.store.session(msg.session)))
            except KeyError:
                raise ProtocolError(
                    "not_found", f"no session {msg.session!r}; list them with inspect"
                ) from None
        return DataOk(data=[asdict(s) for s in self.store.sessions()])

    def _prefetch(self, msg: Prefetch, ns: Namespace | None) -> Message:
        if msg.to not in PREFETCH_TARGETS:
            raise ProtocolError("invalid_argument", f"prefetch to {msg.to!r}: use one of {PREFETCH_TARGETS}")
        try:
            return DataOk(
                data=asdict(
                    self.store.prefetch(
                        msg.session, to=msg.to, start_block=msg.start_block, max_blocks=msg.max_blocks
                    )
                )
            )
        except KeyError:
            raise ProtocolError("not_found", f"no session {msg.session!r} to prefetch") from None

    def _flush(self, msg: Flush, ns: Namespace | None) -> Message:
        wait = MAX_FLUSH_WAIT if msg.timeout is None else min(msg.timeout, MAX_FLUSH_WAIT)
        began = time.monotonic()
        durable = bool(self.store.flush(wait))
        # not durable with time left: it did not run out of time, something could not be written
        settled = durable or time.monotonic() - began < wait - FLUSH_SLACK
        return FlushOk(durable=durable, settled=settled)

    def _pin(self, msg: Pin, ns: Namespace | None) -> Message:
        assert ns is not None
        if msg.lease is not None and msg.lease <= 0:
            raise ProtocolError("invalid_argument", "pin lease must be positive seconds (or absent)")
        lease = self.max_lease if msg.lease is None else min(msg.lease, self.max_lease)
        matched = self.store.lookup(ns, msg.tokens, count=False).matched_blocks  # the get after counts
        if matched == 0:  # nothing to hold: a handle that release() will not know, and no table slot
            return PinOk(handle=secrets.randbits(63), blocks=0, lease=lease)
        now = time.monotonic()
        quota = self.pin_quota
        with self._pins_lock:
            pins, blocks = self._held(ns.tenant, now)
            if pins >= quota.pins or blocks + matched > quota.blocks:
                # the caller's own figures only: nothing about other tenants' pins
                raise ProtocolError(
                    "busy",
                    f"tenant {ns.tenant!r} holds {pins} pins of {blocks} blocks (same-host reads' "
                    f"included); its quota is {quota.pins} pins and {quota.blocks} blocks ([server] "
                    f"max_pins_per_tenant, max_pinned_blocks_per_tenant), and this pin needs {matched} "
                    "more blocks. Release some or wait for their leases to end",
                )
            if not self._daemon_room(matched):
                raise ProtocolError(
                    "busy", "the daemon holds all the pins it can; release yours or wait for leases to end"
                )
            handle = self.store.pin(block_keys(ns, msg.tokens)[:matched], lease)
            hid = secrets.randbits(63)
            self._pins[hid] = (handle, now + lease, ns.tenant)
        return PinOk(handle=hid, blocks=len(handle.keys), lease=lease)

    def _held(self, tenant: str, now: float) -> tuple[int, int]:
        """(``_pins_lock`` held.) The pins and pinned blocks ``tenant`` holds, its same-host reads'
        included; lapsed ones are forgotten first (the store has let go of them already)."""
        for hid in [h for h, (_, exp, _) in self._pins.items() if exp <= now]:
            del self._pins[hid]
        for lid in [i for i, (_, exp, _) in self._located.items() if exp <= now]:
            del self._located[lid]
        mine = [len(h.keys) for h, _, t in self._pins.values() if t == tenant]
        located = [n for n, _, t in self._located.values() if t == tenant]
        return len(mine) + len(located), sum(mine) + sum(located)

    def _daemon_room(self, blocks: int) -> bool:
        """(``_pins_lock`` held, after ``_held``.) Whether the daemon-wide tables take one more pin of
        ``blocks`` blocks."""
        held = sum(len(h.keys) for h, _, _ in self._pins.values()) + sum(
            n for n, _, _ in self._located.values()
        )
        return len(self._pins) + len(self._located) < MAX_PINS and held + blocks <= MAX_PINNED_KEYS

    def _charge_located(self, located: Located, tenant: str, lease: float) -> bool:
        """Count a locate's pinned blocks in ``tenant``'s pin quota; False (nothing counted) when they
        do not fit it, or the daemon's tables."""
        n = len(located.places)
        if not n:
            return True
        now = time.monotonic()
        quota = self.pin_quota
        with self._pins_lock:
            pins, blocks = self._held(tenant, now)
            if pins >= quota.pins or blocks + n > quota.blocks or not self._daemon_room(n):
                return False
            self._located[id(located)] = (n, now + lease, tenant)
        return True

    def _finish_located(self, located: Located, used: int) -> None:
        """A same-host read is over: its pins are let go, in the store and in the quota."""
        with self._pins_lock:
            self._located.pop(id(located), None)
        self.store.finish(located, used)

    # -- the same-host data plane (kvstore.shm) ------------------------------------------
    def _shared(self, request: Request) -> Message:
        plane = self.plane
        if plane is None or not plane.offered or request.tenant is not None:  # (a CURVE client: tcp)
            raise ProtocolError(
                "no_shared_memory",
                f"{request.msg.op}: this daemon offers no shared memory on this endpoint "
                '(tcp, [server] shared_memory = "off", or not on this machine); use get and put',
            )
        msg, ns = request.msg, request.namespace
        if isinstance(msg, Locate):
            assert ns is not None
            return self._locate(plane, request.peer, msg, ns)
        if isinstance(msg, Finish):
            lease = plane.take(msg.handle, request.peer)
            if lease is not None and lease.held is not None:
                self._finish_located(lease.held, msg.used)
            return FinishOk(released=lease is not None)
        if isinstance(msg, Reserve):
            if msg.nbytes < 1:  # a lease of nothing holds no staging, only the daemon's bookkeeping
                raise ProtocolError("invalid_argument", f"reserve of {msg.nbytes} bytes: reserve at least 1")
            got = plane.reserve(request.peer, msg.nbytes)
            seg = got.staging
            return ReserveOk(
                handle=got.handle,
                instance=plane.instance,
                offset=got.offset,
                nbytes=got.nbytes,
                path="" if seg is None else str(seg.path),
                size=0 if seg is None else seg.size,
                lease=max(0.0, got.expires - plane.clock()),
            )
        assert isinstance(msg, Commit) and ns is not None
        return self._commit(plane, request.peer, msg, ns)

    def _locate(self, plane: SharedPlane, peer: bytes, msg: Locate, ns: Namespace) -> Message:
        plane.admit(peer)  # before anything is pinned: a client at its lease bound pins nothing
        names = self.store.tiers.names
        shared = {t for t, name in enumerate(names) if name in msg.tiers and plane.shares(name)}

        def locate(tiers: set[int], count: bool) -> Located:
            return self.store.locate(
                ns,
                msg.chain,
                tiers,
                start_block=msg.start_block,
                max_blocks=msg.max_blocks,
                lease=plane.lease,
                count=count,
            )

        located = locate(shared, False)
        if self._charge_located(located, ns.tenant, plane.lease):
            self.store.count_located(located)
        else:  # past the tenant's pin quota: nothing stays pinned, the blocks are copied into staging
            self.store.unlocate(located)
            located = locate(set(), True)
        blocks: list[list[Any]] = []
        tiers: list[str] = []
        segments = {t: plane.segment_index(names[t]) for t in {t for _, t, _ in located.places}}
        for _, t, place in located.places:
            blocks.append(
                [
                    segments[t],
                    _EXTENT.pack(*place.extents[0])
                    if len(place.extents) == 1
                    else np.asarray(place.extents, dtype="<i8").tobytes(),
                    place.pages.astype("<i8", copy=False).tobytes(),
                    place.gens.astype("<u8", copy=False).tobytes(),
                ]
            )
            tiers.append(names[t])
        layout = ns.layout
        nb = layout.block_nbytes
        k = min(located.rest, plane.per_client // nb)
        rest = located.rest
        try:
            try:
                lease = plane.reserve(peer, k * nb, held=located, armed=False)
            except (ProtocolError, StagingFull):  # no staging room now: the client reads these next time
                k = 0
                lease = plane.reserve(peer, 0, held=located, armed=False)
        except BaseException:
            self._finish_located(located, 0)  # the located blocks' pins, at once: not at their lease's end
            raise
        try:
            if k:  # blocks no shared pool holds (nvme): decoded by the daemon into staging
                buf = plane.staging_tensor(lease).view(layout.torch_dtype)
                shape = layout.shape(layout.block_tokens)
                per = nb // layout.torch_dtype.itemsize
                outs = [buf[b * per : (b + 1) * per].view(shape) for b in range(k)]  # block-major
                # blocks from the cluster are stored here from staging after the client copied them
                # (its finish, or the lease's end): the range is kept for that, whatever the client does
                plane.reading(lease)
                r = self.store.get(
                    ns,
                    msg.chain,
                    start_block=msg.start_block + len(located.places),
                    max_blocks=k,
                    out=outs,
                    adopted=Adoption(lambda: plane.done_reading(lease, keep=True), lease.copied, plane.lease),
                    lookup=False,  # the locate's own, counted once
                )
                for j in range(r.matched_blocks):
                    extent = np.asarray([[lease.offset + j * nb, nb]], dtype="<i8").tobytes()
                    blocks.append([STAGING, extent, b"", b""])
                tiers.extend(r.tiers)
                rest = located.rest - k if r.matched_blocks == k else 0  # short: the chain broke there
                if not rest:  # the last round of this read: what is not held after it is counted now
                    self.store.missed(located)
        except BaseException:
            plane.take(lease.handle)
            self._finish_located(located, 0)
            raise
        plane.arm(lease)
        seg = lease.staging
        return LocateOk(
            handle=lease.handle,
            instance=plane.instance,
            start_block=msg.start_block,
            blocks=blocks,
            tiers=tiers,
            lease=plane.lease,
            staging=None if seg is None else [str(seg.path), seg.size],
            rest=rest,
        )

    def _commit(self, plane: SharedPlane, peer: bytes, msg: Commit, ns: Namespace) -> Message:
        lease = plane.hold(msg.handle, peer)
        if lease is None:
            raise ProtocolError(
                "not_found",
                "commit: the staging lease is unknown or lapsed (nothing was stored); reserve again",
            )
        try:
            need = math.prod(msg.shape) * ns.layout.torch_dtype.itemsize
            if need > lease.nbytes:
                raise ProtocolError(
                    "invalid_argument",
                    f"commit of shape {list(msg.shape)} needs {need} bytes; the reservation holds {lease.nbytes}",
                )
            kv = plane.staging_tensor(lease)[:need].view(ns.layout.torch_dtype).view(msg.shape)
            return self._put(
                Put(
                    ns=msg.ns,
                    tokens=msg.tokens,
                    keys=msg.keys,
                    parent=msg.parent,
                    shape=msg.shape,
                    dtype=msg.dtype,
                    start_block=msg.start_block,
                    session=msg.session,
                ),
                ns,
                kv=kv,
            )
        finally:  # kept: the client writes its next chunk there
            plane.done_reading(lease, keep=msg.keep)

    def _release(self, msg: Release, ns: Namespace | None) -> Message:
        with self._pins_lock:
            got = self._pins.pop(msg.handle, None)
        return ReleaseOk(released=got is not None and bool(self.store.release(got[0])))
