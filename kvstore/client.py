"""The client library: ``KVStoreClient``.

::

    with KVStoreClient(endpoint, model="smollm2-135m-instruct", layout=layout) as c:
        c.lookup(ids).matched_tokens     # leading tokens the daemon holds, block-aligned
        c.put(ids, kv, session="conv")   # kv [L, 2, T, H, D]; the full blocks are stored
        r = c.get(ids)                   # r.kv [L, 2, r.matched_tokens, H, D]

Long prefixes stream in chunks of ``chunk_blocks`` blocks (default: as many
as fit in CHUNK_BYTES, and in the daemon's message limit): ``get`` keeps
``window`` chunks in flight and fills one preallocated tensor chunk by chunk
(a prefix that fits one message comes back as the received frame itself, not
copied); ``put`` copies one chunk at a time out of ``kv`` and sends the next
when the previous is stored (the store refuses a chunk whose parent block is
not stored yet).

Same host (an ``ipc://`` daemon of this user, by default): K/V never crosses
the socket. The hello reply offers the daemon's shared segments; ``get`` and
``get_into`` locate the blocks (the daemon pins them by lease), copy raw
blocks or decode frames from the mapped pools straight into the destination,
check the pages' generations and finish; ``put`` and ``put_from`` reserve a
staging range, write into it and commit. A block whose pages were reused
meanwhile is a miss (the result ends before it), never served. A daemon that
restarted is seen in the next hello (a new instance): the client maps the new
segments, or falls back to the socket when it cannot.

Every reply is awaited at most ``timeout`` seconds. Idempotent calls
(everything but a real evict) are then re-sent on a fresh socket after a new
hello, up to ``retries`` times, so a daemon restart is invisible to the caller;
the worst case is ``(retries + 1) * timeout``. A client may be shared by
threads: calls take turns. Error replies raise the kvstore.errors class of
their code (with ServerError mixed in); a lost daemon raises RequestTimeout.

One class, the public client API: each of its methods carries the contract users rely on,
hence the length (the connection's mechanics live in connection.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import torch
import zmq

from kvstore.chains import Chain, KeyChain, TokenChain, as_chain
from kvstore.connection import Connection
from kvstore.daemon.auth import ClientKeys
from kvstore.errors import InvalidNamespace, LayoutError
from kvstore.keys import Namespace, TokenInput
from kvstore.kvbuffers import KVTarget, PagedKV, check_target, empty_kv, target_tokens, write_target
from kvstore.layout import KVLayout
from kvstore.results import (
    BlockInfo,
    EvictResult,
    FailedBlock,
    GetResult,
    LookupResult,
    PrefetchResult,
    PutResult,
    SessionDetail,
    SessionInfo,
)
from kvstore.shm.mapping import SharedMapping
from kvstore.shm.segment import ShmUnavailable
from kvstore.wire.errors import LocalProtocolError, ServerError
from kvstore.wire.messages import (
    Commit,
    DataOk,
    Evict,
    EvictOk,
    Finish,
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
    Ping,
    PinOk,
    Pong,
    Prefetch,
    Put,
    PutOk,
    Release,
    ReleaseOk,
    Reserve,
    ReserveOk,
    Stats,
)
from kvstore.wire.protocol import payload_tensor, tensor_payload

log = logging.getLogger("kvstore.client")

CHUNK_BYTES = 128 * 2**20  # K/V bytes per message: a 4K-token SmolLM2 prefix (94 MB) goes in one
WINDOW = 2  # get chunks in flight
STALE_RETRIES = 2  # times a shared-memory call starts over on a restarted daemon's new segments


class _Tally:
    """A put's replies, added up."""

    def __init__(self) -> None:
        self.stored = self.present = self.deferred = self.replies = 0
        self.failed: list[FailedBlock] = []

    def add(self, reply: Message | PutResult) -> None:
        if isinstance(reply, PutResult):
            self.failed.extend(reply.failed)
        else:
            assert isinstance(reply, PutOk)
            self.failed.extend(FailedBlock(int(b), str(c), str(m)) for b, c, m in reply.failed)
            self.replies += 1
        self.stored += reply.stored
        self.present += reply.present
        self.deferred += reply.deferred

    def result(self) -> PutResult:
        return PutResult(self.stored, self.present, sorted(set(self.failed)), self.deferred)


class _Stale(Exception):
    """A reply refers to segments other than the ones mapped (the daemon restarted meanwhile)."""


def _default_endpoint() -> str:
    from kvstore.config import default_endpoint

    return os.environ.get("KVSTORE_ENDPOINT") or default_endpoint()


def _build(cls: type, data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


class KVStoreClient:
    """A connection to a kvstore daemon for one namespace (``model``, ``layout``, ``tenant``, ``revision``).

    ``model``/``layout`` may be left out for an operator's client (ping, stats,
    evict, sessions, inspect, prefetch). Construction does no network I/O (it
    reads key files); the first call connects and says hello.

    CURVE (tcp daemons with ``curve_secret_key``): ``curve_server_key`` is the
    daemon's public key, ``curve_secret_key`` this client's secret key
    (``curve_public_key`` is derived from it; given, it must match). Each is
    a Z85 key or the path of a key file written by ``kvstore keygen`` (secret
    files must be private: mode 0600). Without them, a ``tcp://`` client reads
    ``KVSTORE_CURVE_SERVER_KEY``, ``KVSTORE_CURVE_SECRET_KEY`` and
    ``KVSTORE_CURVE_PUBLIC_KEY`` (so the ``kvstore`` CLI works over tcp); ipc
    clients never use CURVE from the environment. The daemon confines a CURVE
    client to the tenant its key is listed with: ``tenant`` must be that
    tenant (a hello for another raises Forbidden), and evict, inspect, stats
    and prefetch see only that tenant's sessions and blocks. A key the daemon
    does not list gets no answer at all: calls raise RequestTimeout. Raises
    ConfigError for a bad key, a secret file others can read, or a server key
    without a secret key.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        model: str | None = None,
        layout: KVLayout | None = None,
        tenant: str = "default",
        timeout: float = 5.0,
        *,
        revision: str = "",
        retries: int = 2,
        chunk_blocks: int | None = None,
        window: int = WINDOW,
        context: zmq.Context | None = None,
        curve_server_key: str | bytes | None = None,
        curve_secret_key: str | bytes | None = None,
        curve_public_key: str | bytes | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        """``shared_memory``: None (default) uses the daemon's shared memory when it offers it (an
        ``ipc://`` daemon of this user); False always uses the socket."""
        if (model is None) != (layout is None):
            raise InvalidNamespace("give both model and layout (or neither, for an operator's client)")
        self.namespace = (
            None
            if model is None or layout is None
            else Namespace(model=model, layout=layout, tenant=tenant, revision=revision)
        )
        self.endpoint = endpoint or _default_endpoint()
        self.chunk_blocks = chunk_blocks if chunk_blocks is None else max(1, chunk_blocks)
        self.window = max(1, window)
        curve = ClientKeys.resolve(self.endpoint, curve_server_key, curve_secret_key, curve_public_key)
        want_shm = self.endpoint.startswith("ipc://") and curve is None and shared_memory is not False
        self._conn = Connection(
            self.endpoint,
            timeout=timeout,
            retries=retries,
            namespace=self.namespace,
            context=context,
            curve=curve,
            shared_memory=want_shm,
        )
        self._lock = threading.RLock()
        self._mapping: SharedMapping | None = None
        self._refused: set[str] = set()  # instances whose segments could not be mapped

    # ------------------------------------------------------------------ plumbing

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._conn.close()
            if self._mapping is not None:
                self._mapping.close()
                self._mapping = None

    @property
    def shared_memory(self) -> bool:
        """Whether K/V moves through shared memory (as of the last hello; False before the first call)."""
        with self._lock:
            return self._shared() is not None

    def _shared(self) -> SharedMapping | None:
        """The mapping of the daemon's current segments, or None (socket path). Lock held."""
        offer = self._conn.shm_offer
        if offer is None:
            return None
        instance = str(offer.get("instance"))
        m = self._mapping
        if m is not None and m.instance == instance:
            return m
        if m is not None:
            m.close()
            self._mapping = None
        if instance in self._refused:
            return None
        try:
            self._mapping = SharedMapping(offer)
        except ShmUnavailable as e:
            log.warning("shared memory offered but not usable (%s); using the socket", e)
            self._refused.add(instance)
            return None
        return self._mapping

    def _ns(self) -> Namespace:
        if self.namespace is None:
            raise InvalidNamespace("this client has no namespace; pass model= and layout= to KVStoreClient")
        return self.namespace

    def _names(self, token_ids: TokenInput | Chain) -> Chain:
        """Token ids (or a chain of engine keys) as a chain, within the daemon's limits."""
        names = as_chain(token_ids)
        limits = self._conn.limits
        n = names.tokens_named(self._ns().layout.block_tokens)
        if limits is not None and n > limits.max_tokens:
            what = "token ids" if isinstance(names, TokenChain) else "tokens' worth of engine keys"
            raise LocalProtocolError(
                "too_many_tokens",
                f"{n} {what}, over the daemon's max_tokens_per_request {limits.max_tokens}",
            )
        return names

    def _call(self, msg: Message, *, idempotent: bool = True) -> Message:
        with self._lock:
            return self._conn.call(msg, idempotent=idempotent)

    def _chunk(self, names: Chain) -> int:
        """Blocks per message: ``chunk_blocks`` (or CHUNK_BYTES worth), fewer if the daemon's limit says so."""
        limits, layout = self._conn.limits, self._ns().layout
        blocks = self.chunk_blocks or max(1, CHUNK_BYTES // layout.block_nbytes)
        if limits is None:
            return blocks
        named = 4 * len(names.tokens) if isinstance(names, TokenChain) else len(names.keys_raw)
        room = (limits.max_message_bytes - named - 4096) // layout.block_nbytes  # 4096: header fields
        return max(1, min(blocks, room))

    # ------------------------------------------------------------------ data path

    def ping(self) -> dict[str, Any]:
        """The daemon's identity and the round trip in seconds."""
        t0 = time.perf_counter()
        reply = self._call(Ping())
        assert isinstance(reply, Pong)
        return {"server": reply.server, "pid": reply.pid, "rtt": time.perf_counter() - t0}

    def lookup(self, token_ids: TokenInput | Chain) -> LookupResult:
        """How many leading tokens of ``token_ids`` the daemon holds (whole blocks). Changes nothing.

        Every data call takes, in place of token ids, a KeyChain: blocks named by an engine's own
        chained page keys (``lookup_keys``, ``get_into_keys``, ``put_from_keys``)."""
        ns = self._ns()
        with self._lock:
            self._conn.ensure_hello()
            reply = self._conn.call(Lookup(ns=ns.id, **self._names(token_ids).fields()), idempotent=True)
        assert isinstance(reply, LookupOk)
        return LookupResult(reply.matched_blocks, reply.matched_tokens, list(reply.tiers))

    def get(self, token_ids: TokenInput | Chain, *, device: torch.device | str = "cpu") -> GetResult:
        """The K/V of the longest stored prefix of ``token_ids``: ``kv`` is ``[L, 2, matched, H, D]`` or None.

        Same host, the blocks are copied or decoded from shared memory into one tensor on ``device``
        (``get_into`` a fresh tensor; a match shorter than the prompt is a view of it). Over the
        socket a prefix longer than one chunk is looked up first, then fetched chunk by chunk. A block
        evicted between the lookup and its read shortens the result to the blocks before it.
        """
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        with self._lock:
            self._conn.ensure_hello()
            tokens = self._names(token_ids)
            if self._shared() is not None:
                # host memory is reserved, not touched, until written: no lookup needed to size it
                on_cpu = torch.device(device).type == "cpu"
                total = tokens.blocks(T) if on_cpu else self.lookup(tokens).matched_blocks
                if total == 0:
                    return GetResult(0, 0, None, [])
                out = empty_kv(layout.shape(total * T), layout.torch_dtype, device)
                read = self._read_into(tokens, out, total)
                if read is not None:
                    matched, tiers = read
                    if matched == 0:
                        return GetResult(0, 0, None, [])
                    kv = out if matched == total else out[:, :, : matched * T]
                    return GetResult(matched, matched * T, kv, tiers)
            return self._socket_get(tokens, device)

    def _socket_get(self, tokens: Chain, device: torch.device | str) -> GetResult:
        """``get`` over the socket (lock held): chunks in flight, one tensor filled as they arrive."""
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        chunk = self._chunk(tokens)
        total = tokens.blocks(T)
        if total > chunk:
            total = self.lookup(tokens).matched_blocks
        if total == 0:
            return GetResult(0, 0, None, [])
        starts = list(range(0, total, chunk))
        out: torch.Tensor | None = None
        tiers: list[list[str]] = [[] for _ in starts]
        got = [0] * len(starts)

        def make(i: int) -> Message:
            s = starts[i]
            n = min(chunk, total - s)
            return Get(ns=ns.id, **tokens.head(s + n, T).fields(), start_block=s, max_blocks=n)

        def on_reply(i: int, reply: Message) -> None:
            nonlocal out
            assert isinstance(reply, GetOk)
            got[i], tiers[i] = reply.blocks, list(reply.tiers)
            if reply.blocks == 0:
                return
            part = payload_tensor(reply.kv, layout.shape(reply.blocks * T), layout.torch_dtype)
            if len(starts) == 1 and torch.device(device).type == "cpu":
                out = part  # one chunk: the tensor is the received frame, no copy
                return
            if out is None:
                out = torch.empty(layout.shape(total * T), dtype=layout.torch_dtype, device=device)
            s = starts[i] * T
            out[:, :, s : s + reply.blocks * T].copy_(part)

        self._conn.pipeline(len(starts), make, on_reply, idempotent=True, window=self.window)
        matched = 0
        for i, s in enumerate(starts):  # the result ends at the first chunk that came back short
            matched = s + got[i]
            if got[i] < min(chunk, total - s):
                break
        if matched == 0 or out is None:
            return GetResult(0, 0, None, [])
        kv = out if out.shape[2] == matched * T else out[:, :, : matched * T]
        if kv.device != torch.device(device):
            kv = kv.to(device)
        return GetResult(matched, matched * T, kv, [t for ts in tiers for t in ts][:matched])

    def get_into(self, token_ids: TokenInput | Chain, out: KVTarget, *, start: int = 0) -> GetResult:
        """Fill ``out`` with the K/V of the longest stored prefix of ``token_ids`` (at most as many
        tokens as ``out`` holds): a tensor ``[L, 2, T, H, D]`` on any device, or a PagedKV (an
        engine's paged buffers and the slots of this sequence's tokens). Returns the match; ``kv`` is
        the filled part of a tensor ``out`` (None for a PagedKV). Tokens past the match may have been
        written and hold nothing meaningful.

        ``start``: the caller holds tokens before it already; they are neither fetched (whole blocks)
        nor written, and the match counts them as held (it is never shorter than the block holding
        ``start``). A tensor ``out`` needs a block-aligned ``start``.

        Same host, the blocks are copied or decoded straight from shared memory into ``out`` (on a GPU
        ``out``, frames cross PCIe compressed and are decoded there); otherwise they come over the
        socket chunk by chunk, each written into ``out`` as it arrives."""
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        check_target(out, layout, "get_into out")
        if start < 0 or (start % T and not isinstance(out, PagedKV)):
            raise LayoutError(f"start {start} must be >= 0, and a multiple of {T} for a tensor out")
        first = start // T
        if isinstance(out, PagedKV) and start > out.floor:
            out = out.above(start)
        with self._lock:
            self._conn.ensure_hello()
            tokens = self._names(token_ids)
            total = min(tokens.blocks(T), target_tokens(out) // T)
            if total <= first:
                return GetResult(min(first, total), min(first, total) * T, None, [])
            got = self._read_into(tokens, out, total, first) if self._shared() is not None else None
            if got is None:
                got = self._socket_read_into(tokens, out, total, first)
        matched, tiers = got
        kv = out[:, :, : matched * T] if isinstance(out, torch.Tensor) and matched else None
        return GetResult(matched, matched * T, kv, tiers)

    def _read_into(
        self, tokens: Chain, out: KVTarget, total: int, first: int = 0
    ) -> tuple[int, list[str]] | None:
        """Blocks ``first .. total-1`` through shared memory into ``out`` (lock held); None: use the socket."""
        for _ in range(STALE_RETRIES + 1):
            m = self._shared()
            if m is None:
                return None
            try:
                return self._locate_loop(m, tokens, out, total, first)
            except _Stale:
                continue  # the daemon restarted: map its new segments and start over
            except ShmUnavailable as e:
                log.warning("shared-memory read failed (%s); using the socket", e)
                self._refused.add(m.instance)
                return None
        return None

    def _locate_loop(
        self, m: SharedMapping, tokens: Chain, out: KVTarget, total: int, first: int
    ) -> tuple[int, list[str]]:
        ns = self._ns()
        T = ns.layout.block_tokens
        start = first
        tiers: list[str] = []
        while start < total:
            msg = Locate(
                ns=ns.id,
                **tokens.head(total, T).fields(),
                start_block=start,
                max_blocks=total - start,
                tiers=m.tiers,
            )
            reply = self._conn.call(msg, idempotent=True)
            assert isinstance(reply, LocateOk)
            if reply.instance != m.instance:
                raise _Stale
            good = 0
            try:
                good = m.read_blocks(reply.blocks, ns.layout, out, start * T, reply.staging)
            finally:
                done = Finish(handle=reply.handle, used=good)
                if reply.staging is None:  # not awaited: a lost finish only lets the lease run out
                    self._conn.notify(done)
                else:  # awaited: the staging range must be free for this client's next request
                    self._conn.call(done, idempotent=True)
            tiers.extend(str(t) for t in reply.tiers[:good])
            start += good
            if good < len(reply.blocks):
                break  # a block moved: the result ends here
            if not reply.blocks:
                if reply.rest:  # held, but no staging room for them now: the socket brings them
                    n, more = self._socket_read_into(tokens, out, min(total, start + reply.rest), start)
                    return n, tiers + more
                break  # the prefix ends here
        return start, tiers

    def _socket_read_into(
        self, tokens: Chain, out: KVTarget, total: int, first: int = 0
    ) -> tuple[int, list[str]]:
        """Blocks ``first .. total-1`` over the socket, each chunk written into ``out`` (lock held).
        Returns the blocks matched from block 0 and the tiers of those from ``first``."""
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        chunk = self._chunk(tokens)
        if total - first > chunk:
            total = min(total, self.lookup(tokens).matched_blocks)
        if total <= first:
            return first, []
        starts = list(range(first, total, chunk))
        got = [0] * len(starts)
        tiers: list[list[str]] = [[] for _ in starts]

        def make(i: int) -> Message:
            s = starts[i]
            n = min(chunk, total - s)
            return Get(ns=ns.id, **tokens.head(s + n, T).fields(), start_block=s, max_blocks=n)

        def on_reply(i: int, reply: Message) -> None:
            assert isinstance(reply, GetOk)
            got[i], tiers[i] = reply.blocks, list(reply.tiers)
            if reply.blocks:
                part = payload_tensor(reply.kv, layout.shape(reply.blocks * T), layout.torch_dtype)
                write_target(out, starts[i] * T, part)

        self._conn.pipeline(len(starts), make, on_reply, idempotent=True, window=self.window)
        if isinstance(out, torch.Tensor) and out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
        matched = first
        for i, s in enumerate(starts):
            matched = s + got[i]
            if got[i] < min(chunk, total - s):
                break
        return matched, [t for ts in tiers for t in ts][: matched - first]

    def put_from(
        self, token_ids: TokenInput | Chain, src: KVTarget, session: str | None = None, *, start: int = 0
    ) -> PutResult:
        """Store the full blocks of ``token_ids`` whose K/V ``src`` holds: a tensor ``[L, 2, T, H, D]``
        on any device, or a PagedKV (an engine's paged buffers and this sequence's slots). Same host,
        the K/V is written once into shared staging and committed; otherwise it goes over the socket.

        ``start``: blocks wholly before it were stored already (an engine saving as it computes);
        they are neither read nor sent. Their parents must be in the store for the rest to match."""
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        check_target(src, layout, "put_from src")
        names = as_chain(token_ids)
        total = min(names.blocks(T), target_tokens(src) // T)
        first = max(0, start) // T
        if total <= first:
            return PutResult(0, 0, [])
        with self._lock:
            self._conn.ensure_hello()
            tokens = self._names(names.head(total, T))
            for _ in range(STALE_RETRIES + 1):
                m = self._shared()
                if m is None:
                    break
                try:
                    return self._commit_loop(m, tokens, src, total, session, first)
                except _Stale:
                    continue

                except ShmUnavailable as e:
                    log.warning("shared-memory put failed (%s); using the socket", e)
                    self._refused.add(m.instance)
                    break
            return self._socket_put(tokens, self._as_tensor(src, total, first), total, session, first=first)

    def _as_tensor(self, src: KVTarget, total: int, first: int = 0) -> torch.Tensor:
        """``src``'s first ``total`` blocks as a tensor (a PagedKV's blocks from ``first`` on are
        gathered into one; those before are left unset)."""
        if isinstance(src, torch.Tensor):
            return src
        layout = self._ns().layout
        T = layout.block_tokens
        out = empty_kv(layout.shape(total * T), layout.torch_dtype, "cpu")
        src.read(first * T, out[:, :, first * T :])
        return out

    def _commit_loop(
        self, m: SharedMapping, tokens: Chain, src: KVTarget, total: int, session: str | None, first: int
    ) -> PutResult:
        """Blocks ``0 .. total-1`` through staging. More than one chunk: two staging ranges taken in
        turn, and the next chunk written while the daemon stores the last (its commits run in order),
        so that this process's copy and the daemon's overlap."""
        nb = self._ns().layout.block_nbytes
        chunk = max(1, min(self._chunk(tokens), m.per_client // nb))
        if total - first > chunk:
            chunk = max(1, min(chunk, m.per_client // (2 * nb)))
        starts = list(range(first, total, chunk))
        tally = _Tally()
        try:
            if len(starts) > 1:
                self._pipelined_commits(m, tokens, src, starts, chunk, total, session, tally)
            else:
                tally.add(self._commit_chunk(m, tokens, src, first, total, session))
        except ServerError as err:
            if err.code not in ("no_staging", "not_found"):
                raise
            # no staging room now, or a range lapsed under a paused client: the rest one way or another
            s = starts[tally.replies] if tally.replies < len(starts) else total
            if s < total and not tally.failed:
                log.debug("shared-memory put stopped at block %d (%s); the rest goes over the socket", s, err)
                tally.add(self._socket_put(tokens, self._as_tensor(src, total, s), total, session, first=s))
        return tally.result()

    def _pipelined_commits(
        self,
        m: SharedMapping,
        tokens: Chain,
        src: KVTarget,
        starts: list[int],
        chunk: int,
        total: int,
        session: str | None,
        tally: _Tally,
    ) -> None:
        layout = self._ns().layout
        ranges = []
        try:
            for _ in range(2):
                r = self._conn.call(Reserve(nbytes=chunk * layout.block_nbytes), idempotent=True)
                assert isinstance(r, ReserveOk)
                if r.instance != m.instance:
                    raise _Stale
                ranges.append(r)

            def make(i: int) -> Message:
                s, e = starts[i], min(starts[i] + chunk, total)
                # free: the commit that used it two chunks ago is answered
                return self._stage(m, ranges[i % 2], tokens, src, s, e, session, keep=True)

            self._conn.pipeline(
                len(starts), make, lambda _, reply: tally.add(reply), idempotent=True, window=2
            )
        finally:
            for r in ranges:
                self._conn.call(Finish(handle=r.handle, used=0), idempotent=True)

    def _commit_chunk(
        self, m: SharedMapping, tokens: Chain, src: KVTarget, s: int, e: int, session: str | None
    ) -> Message:
        """Blocks ``s .. e-1``: reserve staging, write them there, commit. A reservation that lapsed
        before the commit (a paused client) is made again."""
        nbytes = (e - s) * self._ns().layout.block_nbytes
        for attempt in range(STALE_RETRIES + 1):
            r = self._conn.call(Reserve(nbytes=nbytes), idempotent=True)
            assert isinstance(r, ReserveOk)
            if r.instance != m.instance:
                raise _Stale
            try:
                return self._conn.call(self._stage(m, r, tokens, src, s, e, session), idempotent=True)
            except ServerError as err:
                if err.code != "not_found" or attempt == STALE_RETRIES:
                    raise
        raise AssertionError("unreachable")

    def _stage(
        self,
        m: SharedMapping,
        r: ReserveOk,
        tokens: Chain,
        src: KVTarget,
        s: int,
        e: int,
        session: str | None,
        *,
        keep: bool = False,
    ) -> Commit:
        """Write blocks ``s .. e-1`` of ``src`` into the staging range ``r``; the commit that stores them."""
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        view = m.staging_view(r.path, r.size, r.offset, (e - s) * layout.block_nbytes)
        view = view.view(layout.torch_dtype).view(layout.shape((e - s) * T))
        if isinstance(src, PagedKV):
            src.read(s * T, view)
        else:
            view.copy_(src[:, :, s * T : e * T])
        return Commit(
            ns=ns.id,
            **tokens.head(e, T).fields(),
            start_block=s,
            shape=tuple(view.shape),
            dtype=layout.dtype,
            handle=r.handle,
            session=session,
            keep=keep,
        )

    def put(self, token_ids: TokenInput | Chain, kv: torch.Tensor, session: str | None = None) -> PutResult:
        """Store the full blocks of ``token_ids`` whose K/V ``kv`` (``[L, 2, T, H, D]``, T >= their tokens) holds.

        Returns how many blocks were stored, were already present, and which
        failed and why (block index, code, message). A trailing partial block is
        not stored: the engine recomputes it.
        """
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        names = as_chain(token_ids)
        layout.check_tensor(kv)
        total = min(names.blocks(T), kv.shape[2] // T)
        if total == 0:
            return PutResult(0, 0, [])
        with self._lock:
            self._conn.ensure_hello()
            if self._shared() is not None:
                return self.put_from(names, kv, session)
            return self._socket_put(self._names(names.head(total, T)), kv, total, session)

    # ------------------------------------------------------------------ engine page keys

    def lookup_keys(self, keys: Sequence[bytes | str], prefix: Sequence[bytes | str] = ()) -> LookupResult:
        """How many leading pages of ``keys`` the daemon holds: an engine's own chained page keys
        (SGLang's page hashes: 64 hex digits or 32 bytes each), one block each, walked from the
        first and stopping at the first miss. ``prefix``: the keys of the pages before them (only the
        last matters, and only to a put: a page's identity is its key). Namespaced like token blocks:
        the same key in another namespace or tenant is another block. Raises InvalidTokens for a
        malformed key. Changes nothing."""
        return self.lookup(KeyChain.of(keys, prefix))

    def get_into_keys(
        self,
        keys: Sequence[bytes | str],
        out: KVTarget,
        prefix: Sequence[bytes | str] = (),
        *,
        start: int = 0,
    ) -> GetResult:
        """``get_into`` for the pages named by ``keys`` (see ``lookup_keys``): block ``i`` of ``out``
        gets page ``keys[i]``, as far as the leading pages are held."""
        return self.get_into(KeyChain.of(keys, prefix), out, start=start)

    def put_from_keys(
        self,
        keys: Sequence[bytes | str],
        src: KVTarget,
        prefix: Sequence[bytes | str] = (),
        session: str | None = None,
        *,
        start: int = 0,
    ) -> PutResult:
        """``put_from`` for the pages named by ``keys`` (see ``lookup_keys``): block ``i`` of ``src`` is
        stored as page ``keys[i]``, the child of page ``keys[i - 1]``, and the first the child of the
        last of ``prefix`` (which must be stored: else the put fails ``missing_parent``) or of the
        namespace root."""
        return self.put_from(KeyChain.of(keys, prefix), src, session, start=start)

    def _socket_put(
        self, tokens: Chain, kv: torch.Tensor, total: int, session: str | None, first: int = 0
    ) -> PutResult:
        """Blocks ``first .. total-1`` of ``kv`` over the socket, one chunk at a time (lock held)."""
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        tally = _Tally()
        chunk = self._chunk(tokens)
        starts = list(range(first, total, chunk))

        def make(i: int) -> Message:
            s, e = starts[i], min(starts[i] + chunk, total)
            part = kv[:, :, s * T : e * T]
            return Put(
                ns=ns.id,
                **tokens.head(e, T).fields(),
                start_block=s,
                shape=tuple(part.shape),
                dtype=layout.dtype,
                kv=tensor_payload(part),
                session=session,
            )

        # one chunk at a time: the store refuses a chunk whose parent block is not stored yet
        self._conn.pipeline(len(starts), make, lambda _, reply: tally.add(reply), idempotent=True, window=1)
        return tally.result()

    # ------------------------------------------------------------------ operator calls

    def stats(self) -> dict[str, Any]:
        """``{"store": StoreStats as a dict, "server": daemon counters}``."""
        reply = self._call(Stats())
        assert isinstance(reply, DataOk)
        return dict(reply.data)

    def evict(
        self,
        *,
        session: str | None = None,
        older_than: float | None = None,
        tier: str | None = None,
        namespace: str | None = None,
        model: str | None = None,
        tenant: str | None = None,
        all: bool = False,
        dry_run: bool = False,
    ) -> EvictResult:
        """Evict what matches every given filter (see results.EvictFilter). Not retried unless ``dry_run``."""
        msg = Evict(
            session=session,
            older_than=older_than,
            tier=tier,
            namespace=namespace,
            model=model,
            tenant=tenant,
            all=all,
            dry_run=dry_run,
        )
        reply = self._call(msg, idempotent=dry_run)
        assert isinstance(reply, EvictOk)
        return EvictResult(reply.blocks, dict(reply.bytes_freed), reply.moved, list(reply.keys), dry_run)

    def sessions(self) -> list[SessionInfo]:
        reply = self._call(Inspect())
        assert isinstance(reply, DataOk)
        return [_build(SessionInfo, d) for d in reply.data]

    def inspect(self, session: str | None = None, token_ids: TokenInput | None = None) -> Any:
        """Every session (a list of SessionInfo), one session (SessionDetail), or, given ``token_ids``,
        where each stored block of that prefix lives (a dict)."""
        if token_ids is not None:
            with self._lock:
                self._conn.ensure_hello()
                names = self._names(token_ids)
                if not isinstance(names, TokenChain):
                    raise LocalProtocolError("invalid_argument", "inspect takes token ids, not engine keys")
                reply = self._call(Inspect(ns=self._ns().id, tokens=names.tokens))
            assert isinstance(reply, DataOk)
            return reply.data
        if session is None:
            return self.sessions()
        reply = self._call(Inspect(session=session))
        assert isinstance(reply, DataOk)
        return SessionDetail(
            info=_build(SessionInfo, reply.data["info"]),
            blocks=[_build(BlockInfo, b) for b in reply.data["blocks"]],
        )

    def prefetch(
        self, session: str, to: str = "ram", *, start_block: int = 0, max_blocks: int | None = None
    ) -> PrefetchResult:
        """Bring a session's blocks up into ``to`` ("ram" or "hbm") ahead of use: the whole chain, or
        blocks ``start_block .. start_block+max_blocks-1`` of it (go on from ``start_block + max_blocks``
        while the result's ``remaining`` is positive)."""
        reply = self._call(Prefetch(session=session, to=to, start_block=start_block, max_blocks=max_blocks))
        assert isinstance(reply, DataOk)
        return _build(PrefetchResult, reply.data)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block the daemon stored before this call is on nvme and synced to disk.

        True is the durable acknowledgement: those blocks survive a daemon kill
        in every durability mode, and a power loss in ``balanced`` and ``safe``
        (in ``fast``, only until the next write: a power loss after unsynced
        commits wipes the store), unless evicted for room or expired later.
        A put reply alone is not durable. False when ``timeout`` seconds (default: no limit)
        passed first; nothing is lost, a later flush goes on. Each request
        asks the daemon to answer within half the client's timeout, so a long
        flush never looks like a dead daemon.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = self._conn.timeout / 2
            if deadline is not None:
                step = max(0.0, min(step, deadline - time.monotonic()))
            reply = self._call(Flush(timeout=step))
            assert isinstance(reply, FlushOk)
            if reply.durable:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def pin(self, token_ids: TokenInput, lease: float | None = None) -> tuple[int, int]:
        """Pin the held leading blocks of ``token_ids`` for ``lease`` seconds (default and cap: the
        daemon's pin lease). Returns (handle, blocks pinned); end it early with ``release(handle)``.
        A client that dies holding pins leaks nothing: they lapse with the lease."""
        ns = self._ns()
        with self._lock:
            self._conn.ensure_hello()
            reply = self._conn.call(
                Pin(ns=ns.id, tokens=self._pin_tokens(token_ids), lease=lease), idempotent=False
            )
        assert isinstance(reply, PinOk)
        return reply.handle, reply.blocks

    def _pin_tokens(self, token_ids: TokenInput) -> Any:
        names = self._names(token_ids)
        if not isinstance(names, TokenChain):
            raise LocalProtocolError("invalid_argument", "pin takes token ids, not engine keys")
        return names.tokens

    def release(self, handle: int) -> bool:
        """End a pin from ``pin``; False when its lease had already ended (or the handle is unknown)."""
        reply = self._call(Release(handle=handle))
        assert isinstance(reply, ReleaseOk)
        return reply.released
