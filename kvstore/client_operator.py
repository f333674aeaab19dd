"""``KVStoreClient``'s operator calls: stats, evict, sessions and inspect, prefetch, flush, pin and
release. They name no K/V (a client without a namespace makes them: the CLI's); each is one request
and its reply, checked (a malformed reply raises, never comes back half-read)."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from kvstore.chains import Chain, TokenChain
from kvstore.client_args import seconds_arg
from kvstore.keys import Namespace, TokenInput
from kvstore.results import BlockInfo, EvictResult, PrefetchResult, SessionDetail, SessionInfo
from kvstore.wire.errors import LocalProtocolError
from kvstore.wire.messages import (
    DataOk,
    Evict,
    EvictOk,
    Flush,
    FlushOk,
    Inspect,
    Message,
    Pin,
    PinOk,
    Prefetch,
    Release,
    ReleaseOk,
    Stats,
)
from kvstore.wire.reply_data import as_list, as_map, build, is_a, malformed

if TYPE_CHECKING:
    from kvstore.connection import Connection


class OperatorCalls:
    """The operator calls of KVStoreClient (which provides the connection and its one-call-at-a-time
    lock, ``_call``, and the namespace and token checks)."""

    if TYPE_CHECKING:
        _conn: Connection

        def _held(self) -> contextlib.AbstractContextManager[None]: ...

        def _call(self, msg: Message, *, idempotent: bool = True) -> Message: ...

        def _ns(self) -> Namespace: ...

        def _names(self, token_ids: TokenInput | Chain) -> Chain: ...

    def stats(self) -> dict[str, Any]:
        """``{"store": StoreStats as a dict, "server": daemon counters}``."""
        reply = self._call(Stats())
        assert isinstance(reply, DataOk)
        data = as_map("stats", reply.data)
        for part in ("store", "server"):
            if part in data:
                as_map("stats", data[part], repr(part))
        return dict(data)

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
        if not is_a(reply.bytes_freed, dict[str, int]) or not is_a(reply.keys, list[bytes]):
            raise malformed("evict", "bytes_freed is not a map of tier to bytes, or keys not a list of keys")
        return EvictResult(
            reply.blocks,
            dict(reply.bytes_freed),
            reply.moved,
            list(reply.keys),
            dry_run,
            reply.not_done or "",
            max(0, reply.displaced or 0),
        )

    def sessions(self) -> list[SessionInfo]:
        reply = self._call(Inspect())
        assert isinstance(reply, DataOk)
        return [build(SessionInfo, d, "inspect") for d in as_list("inspect", reply.data)]

    def inspect(self, session: str | None = None, token_ids: TokenInput | None = None) -> Any:
        """Every session (a list of SessionInfo), one session (SessionDetail), or, given ``token_ids``,
        where each stored block of that prefix lives (a dict)."""
        if token_ids is not None:
            with self._held():
                self._conn.ensure_hello()
                names = self._names(token_ids)
                if not isinstance(names, TokenChain):
                    raise LocalProtocolError("invalid_argument", "inspect takes token ids, not engine keys")
                reply = self._call(Inspect(ns=self._ns().id, tokens=names.tokens))
            assert isinstance(reply, DataOk)
            return as_map("inspect", reply.data)
        if session is None:
            return self.sessions()
        reply = self._call(Inspect(session=session))
        assert isinstance(reply, DataOk)
        data = as_map("inspect", reply.data)
        return SessionDetail(
            info=build(SessionInfo, data.get("info"), "inspect"),
            blocks=[
                build(BlockInfo, b, "inspect") for b in as_list("inspect", data.get("blocks"), "'blocks'")
            ],
        )

    def prefetch(
        self, session: str, to: str = "ram", *, start_block: int = 0, max_blocks: int | None = None
    ) -> PrefetchResult:
        """Bring a session's blocks up into ``to`` ("ram" or "hbm") ahead of use: the whole chain, or
        blocks ``start_block .. start_block+max_blocks-1`` of it (go on from ``start_block + max_blocks``
        while the result's ``remaining`` is positive)."""
        reply = self._call(Prefetch(session=session, to=to, start_block=start_block, max_blocks=max_blocks))
        assert isinstance(reply, DataOk)
        return build(PrefetchResult, reply.data, "prefetch")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block the daemon stored before this call is on nvme and synced to disk.

        True is the durable acknowledgement: those blocks survive a daemon kill
        in every durability mode, and a power loss in ``balanced`` and ``safe``
        (in ``fast``, only until the next write: a power loss after unsynced
        commits wipes the store), unless evicted for room or expired later.
        A put reply alone is not durable. False when ``timeout`` seconds (default: no limit)
        passed first, or when the daemon could not write something (nvme full of blocks it keeps,
        a disk error: asking again at once would change nothing, and with no limit would never
        end; its log says what); nothing is lost, a later flush goes on. Each request
        asks the daemon to answer within half the client's timeout, so a long
        flush never looks like a dead daemon.
        """
        deadline = None if timeout is None else time.monotonic() + seconds_arg("timeout", timeout, zero=True)
        while True:
            step = self._conn.timeout / 2
            if deadline is not None:
                step = max(0.0, min(step, deadline - time.monotonic()))
            reply = self._call(Flush(timeout=step))
            assert isinstance(reply, FlushOk)
            if reply.durable:
                return True
            if reply.settled or (deadline is not None and time.monotonic() >= deadline):
                return False

    def pin(self, token_ids: TokenInput, lease: float | None = None) -> tuple[int, int]:
        """Pin the held leading blocks of ``token_ids`` for ``lease`` seconds (default and cap: the
        daemon's pin lease). Returns (handle, blocks pinned); end it early with ``release(handle)``.
        A client that dies holding pins leaks nothing: they lapse with the lease."""
        ns = self._ns()
        with self._held():
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
        # not sent again after a time-out: a repeat would find the pin the first try ended (False)
        reply = self._call(Release(handle=handle), idempotent=False)
        assert isinstance(reply, ReleaseOk)
        return reply.released
