"""What the daemon does for each request: one store call, turned into a reply.

``Handlers.handle`` runs on a worker thread (never on the event loop: store
calls may wait on LMDB and codecs). It never raises: every exception becomes
an ErrorReply with a stable code, so no request can take the daemon down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvstore.errors import KVStoreError
from kvstore.keys import Namespace, block_keys
from kvstore.messages import (
    DataOk,
    ErrorReply,
    Evict,
    EvictOk,
    Get,
    GetOk,
    Inspect,
    Lookup,
    LookupOk,
    Message,
    Prefetch,
    Put,
    PutOk,
    Stats,
)
from kvstore.protocol import Request, payload_tensor, tensor_payload
from kvstore.protocol_errors import ProtocolError
from kvstore.results import EvictFilter

if TYPE_CHECKING:
    from kvstore.store import Store

log = logging.getLogger("kvstore.server")

PREFETCH_TARGETS = ("ram", "hbm")


class Handlers:
    """Maps each request op to its store call. Thread-safe as far as the store is."""

    def __init__(self, store: Store, server_info: Callable[[], dict[str, Any]]) -> None:
        self.store = store
        self.server_info = server_info
        self._ops: dict[type[Message], Callable[[Any, Namespace | None], Message]] = {
            Lookup: self._lookup, Get: self._get, Put: self._put, Evict: self._evict,
            Stats: self._stats, Inspect: self._inspect, Prefetch: self._prefetch,
        }

    def handle(self, request: Request) -> Message:
        """The reply to ``request``: its op's result, or an ErrorReply. Never raises."""
        try:
            return self._ops[type(request.msg)](request.msg, request.namespace)
        except (KVStoreError, ProtocolError) as e:
            return ErrorReply(code=getattr(e, "code", "internal") or "internal", message=str(e))
        except Exception as e:  # the daemon must survive anything a request triggers
            log.exception("request %s (%s) failed", request.id, request.msg.op)
            return ErrorReply(code="internal", message=f"{request.msg.op} failed inside the daemon: "
                              f"{type(e).__name__}: {e} (see the daemon log)")

    def try_inline(self, request: Request) -> Message | None:
        """The reply to a lookup when the store can answer this instant without waiting, else None.

        Lookups only walk the in-memory index; run on the event loop they skip
        two thread hand-offs. Whenever the store is busy (a put moving blocks,
        a codec at work) the lookup goes to a worker like everything else.
        """
        if not isinstance(request.msg, Lookup) or request.namespace is None:
            return None
        try_lookup = getattr(self.store, "try_lookup", None)
        if try_lookup is None:
            return None
        try:
            r = try_lookup(request.namespace, request.msg.tokens)
        except Exception:
            return None  # let a worker run it and turn the error into a reply
        if r is None:
            return None
        return LookupOk(matched_blocks=r.matched_blocks, matched_tokens=r.matched_tokens, tiers=list(r.tiers))

    def _lookup(self, msg: Lookup, ns: Namespace | None) -> Message:
        assert ns is not None
        r = self.store.lookup(ns, msg.tokens)
        return LookupOk(matched_blocks=r.matched_blocks, matched_tokens=r.matched_tokens, tiers=list(r.tiers))

    def _get(self, msg: Get, ns: Namespace | None) -> Message:
        assert ns is not None
        r = self.store.get(ns, msg.tokens, start_block=msg.start_block, max_blocks=msg.max_blocks, device="cpu")
        if r.kv is None or r.matched_blocks == 0:
            return GetOk(start_block=msg.start_block, blocks=0, tiers=[])
        ns.layout.check_tensor(r.kv, tokens=r.matched_blocks * ns.layout.block_tokens, what="store get result")
        return GetOk(start_block=msg.start_block, blocks=r.matched_blocks, tiers=list(r.tiers),
                     kv=tensor_payload(r.kv))

    def _put(self, msg: Put, ns: Namespace | None) -> Message:
        assert ns is not None
        kv = payload_tensor(msg.kv, msg.shape, ns.layout.torch_dtype)
        end = msg.start_block + msg.shape[2] // ns.layout.block_tokens
        tokens = msg.tokens[: end * ns.layout.block_tokens]
        r = self.store.put(ns, tokens, kv, session=msg.session, start_block=msg.start_block)
        return PutOk(stored=r.stored, present=r.present, failed=[list(f) for f in r.failed],
                     deferred=getattr(r, "deferred", 0))

    def _evict(self, msg: Evict, ns: Namespace | None) -> Message:
        flt = EvictFilter(session=msg.session, older_than=msg.older_than, tier=msg.tier,
                          namespace=msg.namespace, model=msg.model, tenant=msg.tenant, all=msg.all)
        r = self.store.evict(flt, dry_run=msg.dry_run)
        return EvictOk(blocks=r.blocks, bytes_freed=dict(r.bytes_freed), moved=r.moved, keys=list(r.keys))

    def _stats(self, msg: Stats, ns: Namespace | None) -> Message:
        return DataOk(data={"store": self.store.stats().to_dict(), "server": self.server_info()})

    def _inspect(self, msg: Inspect, ns_unused: Namespace | None) -> Message:
        if msg.tokens is not None:
            if msg.ns is None:
                raise ProtocolError("bad_header", "inspect of tokens needs the ns field")
            ns = ns_unused
            assert ns is not None
            r = self.store.lookup(ns, msg.tokens)
            keys = block_keys(ns, msg.tokens)[: r.matched_blocks]
            blocks = [{"position": i, "key": k.hex(), "tier": t} for i, (k, t) in enumerate(zip(keys, r.tiers, strict=False))]
            return DataOk(data={"namespace": ns.id, "tokens": len(msg.tokens), "matched_tokens": r.matched_tokens,
                                "blocks": blocks})
        if msg.session is not None:
            try:
                return DataOk(data=asdict(self.store.session(msg.session)))
            except KeyError:
                raise ProtocolError("not_found", f"no session {msg.session!r}; list them with inspect") from None
        return DataOk(data=[asdict(s) for s in self.store.sessions()])

    def _prefetch(self, msg: Prefetch, ns: Namespace | None) -> Message:
        if msg.to not in PREFETCH_TARGETS:
            raise ProtocolError("invalid_argument", f"prefetch to {msg.to!r}: use one of {PREFETCH_TARGETS}")
        try:
            return DataOk(data=asdict(self.store.prefetch(msg.session, to=msg.to)))
        except KeyError:
            raise ProtocolError("not_found", f"no session {msg.session!r} to prefetch") from None
