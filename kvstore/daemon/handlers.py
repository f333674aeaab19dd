"""What the daemon does for each request: one store call, turned into a reply.

``Handlers.handle`` runs on a worker thread (never on the event loop: store
calls may wait on LMDB and codecs). It never raises: every exception becomes
an ErrorReply with a stable code, so no request can take the daemon down.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvstore.daemon.pin_quota import PinLedger, PinQuota
from kvstore.daemon.shared_ops import SharedOps
from kvstore.daemon.tenancy import SHARED_OPS, TenantOps
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, block_keys
from kvstore.results import EvictFilter
from kvstore.store.adoption import Adoption
from kvstore.tiers.base import TierName
from kvstore.wire.errors import ProtocolError, wire_code
from kvstore.wire.messages import (
    DataOk,
    ErrorReply,
    Evict,
    EvictOk,
    Flush,
    FlushOk,
    Get,
    GetOk,
    Inspect,
    Locate,
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
    Stats,
)
from kvstore.wire.protocol import Request, payload_tensor, tensor_payload

if TYPE_CHECKING:
    from kvstore.shm.plane import SharedPlane
    from kvstore.store.engine import Store

log = logging.getLogger("kvstore.daemon.server")

PREFETCH_TARGETS = (TierName.RAM.value, TierName.HBM.value)  # nvme holds everything already
MAX_FLUSH_WAIT = 60.0  # seconds one flush request may hold a worker; the client asks again
FLUSH_SLACK = 0.05  # seconds: a flush that ended this close to its time ran out of it
# Longest lookup answered on the event loop (blocks): about 0.6 us a block hashed and found (16384 in 10 ms),
# so about a ms at most; longer ones (block_tokens = 1 makes a block of every token) go to a worker
INLINE_BLOCKS = 2048
# Longest locate answered there (blocks, from its start): a block located and put in the reply costs
# about 5 us more than one looked up (its pin, its pages' generations, its row)
INLINE_LOCATE_BLOCKS = 256


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
        self.pins = PinLedger(pin_quota or PinQuota())
        self.failed_blocks = 0  # blocks put replies named as not stored (stats: server.put_failed_blocks)
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
        self.shared = SharedOps(store, plane, self.pins, self._put)  # the same-host data plane

    def handle(self, request: Request) -> Message:
        """The reply to ``request``: its op's result, or an ErrorReply. Never raises.

        A request with a ``tenant`` (an authenticated CURVE client) goes through
        TenantOps, which limits it to that tenant's sessions and blocks.
        """
        try:
            if isinstance(request.msg, SHARED_OPS):
                return self.shared.handle(request)
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
        """The reply to a lookup, or a same-host locate of blocks the shared pools hold, when the
        store can answer this instant without waiting, else None.

        Both only walk the in-memory index (a locate pins what it finds); run on the event loop
        they skip two thread hand-offs. Whenever the store is busy (a put moving blocks, a codec at
        work) the request goes to a worker like everything else.
        """
        if not isinstance(request.msg, (Lookup, Locate)) or request.namespace is None:
            return None
        if request.msg.chain.blocks(request.namespace.layout.block_tokens) > INLINE_BLOCKS:
            return None  # a long walk (block_tokens = 1: a key per token) would hold every client up
        if isinstance(request.msg, Locate):
            return self.shared.try_inline(request, INLINE_LOCATE_BLOCKS)
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
        keys = block_keys(ns, msg.tokens)[:matched]
        hid, handle = self.pins.pin(ns.tenant, matched, lease, lambda: self.store.pin(keys, lease))
        return PinOk(handle=hid, blocks=len(handle.keys), lease=lease)

    def _release(self, msg: Release, ns: Namespace | None) -> Message:
        handle = self.pins.release(msg.handle)
        return ReleaseOk(released=handle is not None and bool(self.store.release(handle)))
