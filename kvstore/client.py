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

import os
import threading
import time
from dataclasses import fields
from typing import Any

import torch
import zmq

from kvstore.connection import Connection
from kvstore.daemon.auth import ClientKeys
from kvstore.errors import InvalidNamespace
from kvstore.keys import Namespace, TokenInput, as_tokens
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
from kvstore.wire.errors import LocalProtocolError
from kvstore.wire.messages import (
    DataOk,
    Evict,
    EvictOk,
    Flush,
    FlushOk,
    Get,
    GetOk,
    Inspect,
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
    Stats,
)
from kvstore.wire.protocol import payload_tensor, tensor_payload

CHUNK_BYTES = 128 * 2**20  # K/V bytes per message: a 4K-token SmolLM2 prefix (94 MB) goes in one
WINDOW = 2  # get chunks in flight


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
    ) -> None:
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
        self._conn = Connection(
            self.endpoint,
            timeout=timeout,
            retries=retries,
            namespace=self.namespace,
            context=context,
            curve=curve,
        )
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ plumbing

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _ns(self) -> Namespace:
        if self.namespace is None:
            raise InvalidNamespace("this client has no namespace; pass model= and layout= to KVStoreClient")
        return self.namespace

    def _tokens(self, token_ids: TokenInput) -> Any:
        tokens = as_tokens(token_ids)
        limits = self._conn.limits
        if limits is not None and len(tokens) > limits.max_tokens:
            raise LocalProtocolError(
                "too_many_tokens",
                f"{len(tokens)} token ids, over the daemon's max_tokens_per_request {limits.max_tokens}",
            )
        return tokens

    def _call(self, msg: Message, *, idempotent: bool = True) -> Message:
        with self._lock:
            return self._conn.call(msg, idempotent=idempotent)

    def _chunk(self, ntokens: int) -> int:
        """Blocks per message: ``chunk_blocks`` (or CHUNK_BYTES worth), fewer if the daemon's limit says so."""
        limits, layout = self._conn.limits, self._ns().layout
        blocks = self.chunk_blocks or max(1, CHUNK_BYTES // layout.block_nbytes)
        if limits is None:
            return blocks
        room = (limits.max_message_bytes - 4 * ntokens - 4096) // layout.block_nbytes  # 4096: header fields
        return max(1, min(blocks, room))

    # ------------------------------------------------------------------ data path

    def ping(self) -> dict[str, Any]:
        """The daemon's identity and the round trip in seconds."""
        t0 = time.perf_counter()
        reply = self._call(Ping())
        assert isinstance(reply, Pong)
        return {"server": reply.server, "pid": reply.pid, "rtt": time.perf_counter() - t0}

    def lookup(self, token_ids: TokenInput) -> LookupResult:
        """How many leading tokens of ``token_ids`` the daemon holds (whole blocks). Changes nothing."""
        ns = self._ns()
        with self._lock:
            self._conn.ensure_hello()
            reply = self._conn.call(Lookup(ns=ns.id, tokens=self._tokens(token_ids)), idempotent=True)
        assert isinstance(reply, LookupOk)
        return LookupResult(reply.matched_blocks, reply.matched_tokens, list(reply.tiers))

    def get(self, token_ids: TokenInput, *, device: torch.device | str = "cpu") -> GetResult:
        """The K/V of the longest stored prefix of ``token_ids``: ``kv`` is ``[L, 2, matched, H, D]`` or None.

        A prefix longer than one chunk is looked up first, then fetched chunk
        by chunk into one tensor on ``device``. A block evicted between the
        lookup and its chunk shortens the result to the blocks before it.
        """
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        with self._lock:
            self._conn.ensure_hello()
            tokens = self._tokens(token_ids)
            chunk = self._chunk(len(tokens))
            total = len(tokens) // T
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
                return Get(ns=ns.id, tokens=tokens[: (s + n) * T], start_block=s, max_blocks=n)

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

    def put(self, token_ids: TokenInput, kv: torch.Tensor, session: str | None = None) -> PutResult:
        """Store the full blocks of ``token_ids`` whose K/V ``kv`` (``[L, 2, T, H, D]``, T >= their tokens) holds.

        Returns how many blocks were stored, were already present, and which
        failed and why (block index, code, message). A trailing partial block is
        not stored: the engine recomputes it.
        """
        ns = self._ns()
        layout, T = ns.layout, ns.layout.block_tokens
        tokens = as_tokens(token_ids)
        layout.check_tensor(kv)
        total = min(len(tokens), kv.shape[2]) // T
        if total == 0:
            return PutResult(0, 0, [])
        stored = present = deferred = 0
        failed: list[FailedBlock] = []
        with self._lock:
            self._conn.ensure_hello()
            tokens = self._tokens(tokens[: total * T])
            chunk = self._chunk(len(tokens))
            starts = list(range(0, total, chunk))

            def make(i: int) -> Message:
                s, e = starts[i], min(starts[i] + chunk, total)
                part = kv[:, :, s * T : e * T]
                return Put(
                    ns=ns.id,
                    tokens=tokens[: e * T],
                    start_block=s,
                    shape=tuple(part.shape),
                    dtype=layout.dtype,
                    kv=tensor_payload(part),
                    session=session,
                )

            def on_reply(i: int, reply: Message) -> None:
                nonlocal stored, present, deferred
                assert isinstance(reply, PutOk)
                stored, present, deferred = (
                    stored + reply.stored,
                    present + reply.present,
                    deferred + reply.deferred,
                )
                failed.extend(FailedBlock(int(b), str(c), str(m)) for b, c, m in reply.failed)

            # one chunk at a time: the store refuses a chunk whose parent block is not stored yet
            self._conn.pipeline(len(starts), make, on_reply, idempotent=True, window=1)
        return PutResult(stored, present, sorted(failed), deferred)

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
                reply = self._call(Inspect(ns=self._ns().id, tokens=self._tokens(token_ids)))
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
                Pin(ns=ns.id, tokens=self._tokens(token_ids), lease=lease), idempotent=False
            )
        assert isinstance(reply, PinOk)
        return reply.handle, reply.blocks

    def release(self, handle: int) -> bool:
        """End a pin from ``pin``; False when its lease had already ended (or the handle is unknown)."""
        reply = self._call(Release(handle=handle))
        assert isinstance(reply, ReleaseOk)
        return reply.released
