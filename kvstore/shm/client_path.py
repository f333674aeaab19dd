"""The client's K/V through the daemon's shared memory (an ``ipc://`` daemon of the same user).

::

    read   Locate (the daemon pins the blocks by lease, says where they are) --> copy raw blocks or
           decode frames from the mapped pools into the destination, check the pages' generations
           --> Finish. Blocks only nvme holds come through this client's staging segment; blocks
           held but without staging room now come over the socket (``rest``).
    put    Reserve a staging range --> write the blocks there --> Commit (the daemon stores them).
           More than one chunk: two ranges taken in turn, the next chunk written while the daemon
           stores the last (its commits run in order).

A block whose pages were reused meanwhile ends the read (a miss, never a wrong block). A reply
naming another daemon instance (it restarted) gives back what it leased, says hello again, maps the
new segments and starts over, up to STALE_RETRIES times; a daemon that answers ``no_shared_memory``
(restarted with ``shared_memory = "off"``) gets a hello too, its offer of none unmaps the old
segments and the call goes over the socket. Segments that cannot be mapped (or fail a read) send this
client to the socket for REFUSED_FOR seconds. The caller (KVStoreClient) holds its lock and has said hello.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from kvstore.chains import Chain
from kvstore.connection import Connection
from kvstore.keys import Namespace
from kvstore.kvbuffers import KVTarget, PagedKV
from kvstore.memcopy import Copier
from kvstore.results import FailedBlock, PutResult
from kvstore.shm.mapping import SharedMapping
from kvstore.shm.plane import ALIGN
from kvstore.shm.segment import ShmUnavailable
from kvstore.socket_path import PutTally, SocketPath
from kvstore.wire.errors import ServerError
from kvstore.wire.messages import Commit, Finish, Locate, LocateOk, Message, Reserve, ReserveOk

log = logging.getLogger("kvstore.client")

STALE_RETRIES = 2  # times a shared-memory call starts over on a restarted daemon's new segments
# seconds a daemon's segments that failed to map or read are left alone before they are tried again:
# a cause may pass (this process out of file descriptors or address space for a while)
REFUSED_FOR = 60.0

_T = TypeVar("_T")


class _Stale(Exception):
    """A reply refers to segments other than the ones mapped (the daemon restarted meanwhile)."""


class SharedPath:
    """Reads and puts through the segments the daemon offered in its hello; ``socket`` for what
    cannot go this way."""

    def __init__(self, conn: Connection, socket: SocketPath) -> None:
        self._conn = conn
        self._socket = socket
        self._mapping: SharedMapping | None = None
        self._refused: dict[str, float] = {}  # instance -> until when its segments are not tried
        self._warned: set[str] = set()  # instances whose failure was logged as a warning
        self._copier = Copier()  # at the thread count this process gives torch

    def close(self) -> None:
        self._unmap()
        self._copier.close()

    def _unmap(self) -> None:
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def mapping(self) -> SharedMapping | None:
        """The mapping of the daemon's current segments (mapped on first use), or None: the daemon
        offers none (tcp, ``shared_memory = "off"``) or they could not be mapped (use the socket)."""
        for asked in (False, True):
            offer = self._conn.shm_offer
            if offer is None or self._conn.closed:
                self._unmap()  # a daemon that offers none now (restarted with shared_memory = "off")
                return None
            instance = str(offer.get("instance"))
            if time.monotonic() < self._refused.get(instance, 0.0):  # its segments failed a moment ago
                self._unmap()
                return None
            m = self._mapping
            if m is not None and m.instance == instance:
                return m
            self._unmap()
            try:
                self._mapping = SharedMapping(offer, self._copier)
                return self._mapping
            except ShmUnavailable as e:
                if not asked:
                    # the offer may be a daemon's that restarted since the hello (a client that said
                    # hello long before its first read): the current daemon's is asked for once
                    self._conn.hello_again()
                    if str((self._conn.shm_offer or {}).get("instance")) != instance:
                        continue
                self._refuse(instance, "shared memory offered but not usable", e)
                return None
        return None

    def _mapped(self, what: str, run: Callable[[SharedMapping], _T]) -> _T | None:
        """``run(mapping)``, started over on the new segments of a daemon that restarted meanwhile (up
        to STALE_RETRIES times); None: use the socket (no mapping, a daemon that offers none now, or
        it failed now: that instance's segments are not used again)."""
        for _ in range(STALE_RETRIES + 1):
            m = self.mapping()
            if m is None:
                return None
            try:
                return run(m)
            except _Stale:
                self._hello_again(m)
                continue
            except ServerError as e:
                if e.code == "too_many_leases":  # this call uses the socket
                    log.info("shared-memory %s refused now (%s); using the socket", what, e)
                    return None
                if e.code != "no_shared_memory":
                    raise
                log.info("the daemon offers no shared memory now (it restarted); using the socket")
                self._hello_again(m)  # its reply offers none: mapping() unmaps the old segments
                continue
            except ShmUnavailable as e:
                self._refuse(m.instance, f"shared-memory {what} failed", e)
                return None
        return None

    def _refuse(self, instance: str, what: str, err: Exception) -> None:
        """The daemon ``instance``'s segments failed: the socket carries everything for REFUSED_FOR
        seconds, then they are tried again (a warning the first time, a debug line after)."""
        self._refused[instance] = time.monotonic() + REFUSED_FOR
        if instance in self._warned:
            log.debug("%s (%s); using the socket for %.0f s", what, err, REFUSED_FOR)
        else:
            self._warned.add(instance)
            log.warning("%s (%s); using the socket, trying again every %.0f s", what, err, REFUSED_FOR)

    def _hello_again(self, m: SharedMapping) -> None:
        """A reply contradicted the offer ``m`` was mapped from (the daemon restarted): hello again,
        unless a hello since (a request that carries the namespace makes one) brought a new offer.
        Shared ops without a namespace (reserve, finish) never cause one by themselves."""
        offer = self._conn.shm_offer
        if offer is not None and str(offer.get("instance")) == m.instance:
            self._conn.hello_again()

    # -- reads --------------------------------------------------------------------------
    def read_into(
        self, ns: Namespace, tokens: Chain, out: KVTarget, total: int, first: int = 0
    ) -> tuple[int, list[str]] | None:
        """Blocks ``first .. total-1`` into ``out``: the blocks matched from block 0 and the tiers of
        those from ``first``. None: use the socket (no mapping, or it failed now)."""
        return self._mapped("read", lambda m: self._locate_loop(m, ns, tokens, out, total, first))

    def _locate_loop(
        self, m: SharedMapping, ns: Namespace, tokens: Chain, out: KVTarget, total: int, first: int
    ) -> tuple[int, list[str]]:
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
            if reply.instance != m.instance:  # a new daemon pinned these: let them go now, not at the
                self._finish(reply, 0)  # lease's end, and read again on its segments
                raise _Stale
            good, read = 0, False
            try:
                good = m.read_blocks(reply.blocks, ns.layout, out, start * T, reply.staging)
                read = True
            finally:
                self._finish(reply, good, wait=read)
            tiers.extend(str(t) for t in reply.tiers[:good])
            start += good
            if good < len(reply.blocks):
                break  # a block moved: the result ends here
            if reply.blocks and not reply.rest and start < total:
                break  # the prefix ends here (asking again would only count a second lookup)
            if not reply.blocks:
                if reply.rest:  # held, but no staging room for them now: the socket brings them
                    n, more = self._socket.read_into(ns, tokens, out, min(total, start + reply.rest), start)
                    return n, tiers + more
                break  # the prefix ends here
        return start, tiers

    def _finish(self, reply: LocateOk, used: int, *, wait: bool = True) -> None:
        """Give the lease of ``reply`` back; done before this client's next request (``wait``) when it
        holds staging, which that request may need. A finish of pool blocks only is sent and
        forgotten: awaited, it would hold the next request up behind other clients' work on the
        daemon's workers (the daemon takes finishes past a spent budget, so none is turned away)."""
        _give_back(
            self._conn, Finish(handle=reply.handle, used=used), wait=wait and reply.staging is not None
        )

    # -- puts ---------------------------------------------------------------------------
    def put(
        self, ns: Namespace, tokens: Chain, src: KVTarget, total: int, session: str | None, first: int = 0
    ) -> PutResult | None:
        """Blocks ``first .. total-1`` of ``src`` through staging; None: use the socket (no mapping, or
        it failed now). Without staging room (or a lapsed range) the rest goes over the socket."""
        return self._mapped("put", lambda m: self._commit_loop(m, ns, tokens, src, total, session, first))

    def _commit_loop(
        self,
        m: SharedMapping,
        ns: Namespace,
        tokens: Chain,
        src: KVTarget,
        total: int,
        session: str | None,
        first: int,
    ) -> PutResult:
        nb = ns.layout.block_nbytes
        tally = PutTally()
        if nb > m.per_client:  # a block larger than this client's staging: it goes as a get of it does
            tally.add(self._socket.put_from(ns, tokens, src, total, session, first=first))
            return tally.result()
        # a range takes whole pages (RangeAllocator): sized so that one, or two taken in turn, fit
        chunk = max(1, min(self._socket.chunk(ns, tokens), _pages(m.per_client) // nb))
        if total - first > chunk:
            chunk = max(1, min(chunk, _pages(m.per_client // 2) // nb))
        starts = list(range(first, total, chunk))
        answered: set[int] = set()  # the chunks whose commit was answered
        # two ranges in turn need room for two: a block over half the staging goes one range at a time
        two = 2 * -(-chunk * nb // ALIGN) * ALIGN <= m.per_client
        try:
            if len(starts) > 1 and two:
                self._pipelined_commits(m, ns, tokens, src, starts, chunk, total, session, tally, answered)
            else:
                for i, s in enumerate(starts):
                    tally.add(self._commit_chunk(m, ns, tokens, src, s, min(s + chunk, total), session))
                    answered.add(i)
        except (ServerError, ShmUnavailable) as err:
            if isinstance(err, ShmUnavailable):  # this client's staging cannot be mapped: the socket
                self._refuse(m.instance, "shared-memory put failed", err)
            elif err.code not in ("no_staging", "not_found", "too_many_leases"):
                raise  # no_shared_memory among them: a daemon that restarted, which holds none of it
            # no staging room or lease now, or a range lapsed under a paused client: the rest one way
            # or another, the chunks stored so far counted as stored. From the first chunk not answered:
            # replies may come out of order (a commit refused busy is sent again after the next one),
            # and a later chunk answered before it goes again too (found present)
            s = next((starts[i] for i in range(len(starts)) if i not in answered), total)
            if s < total and not tally.failed:
                log.debug("shared-memory put stopped at block %d (%s); the rest goes over the socket", s, err)
                tally.add(self._socket.put_from(ns, tokens, src, total, session, first=s))
            elif s < total:  # blocks were refused before: the rest is not stored either, and says so
                named = {f.block for f in tally.failed}
                tally.failed.extend(
                    FailedBlock(b, err.code or "internal", f"not stored: {err}")
                    for b in range(s, total)
                    if b not in named
                )
        return tally.result()

    def _pipelined_commits(
        self,
        m: SharedMapping,
        ns: Namespace,
        tokens: Chain,
        src: KVTarget,
        starts: list[int],
        chunk: int,
        total: int,
        session: str | None,
        tally: PutTally,
        answered: set[int],
    ) -> None:
        """The chunks at ``starts`` staged and committed, two at a time; each answered chunk's index is
        added to ``answered`` and its reply to ``tally``."""
        ranges = []
        committed = False
        try:
            for _ in range(2):
                ranges.append(self._reserve(m, chunk * ns.layout.block_nbytes))

            # the chunk each range holds for its commit: a range is written again only once that
            # commit is answered, or by the same chunk's commit sent again (refused "busy", or a reset:
            # the same bytes). Replies may come in another order than the commits went (a commit refused
            # and sent again after the next one): a range is never picked by its turn.
            owner: list[int | None] = [None, None]

            def make(i: int) -> Message:
                offer = self._conn.shm_offer  # this call's hello (a reconnect's) came from another
                if offer is None or offer.get("instance") != m.instance:  # daemon: these ranges are
                    raise _Stale  # gone with the old one, and written now they would only take memory
                s, e = starts[i], min(starts[i] + chunk, total)
                r = next((r for r in (0, 1) if owner[r] == i), None)
                if r is None:  # free: with two commits at most in flight, one range's commit is answered
                    r = next(r for r in (0, 1) if owner[r] is None or owner[r] in answered)
                    owner[r] = i
                return self._stage(m, ranges[r], ns, tokens, src, s, e, session, keep=True)

            def on_reply(i: int, reply: Message) -> None:
                answered.add(i)
                tally.add(reply)

            self._conn.pipeline(len(starts), make, on_reply, idempotent=True, window=2)
            committed = True
        finally:
            for r in ranges:
                _give_back(self._conn, Finish(handle=r.handle, used=0), wait=committed)

    def _commit_chunk(
        self,
        m: SharedMapping,
        ns: Namespace,
        tokens: Chain,
        src: KVTarget,
        s: int,
        e: int,
        session: str | None,
    ) -> Message:
        """Blocks ``s .. e-1``: reserve staging, write them there, commit. A reservation that lapsed
        before the commit (a paused client) is made again."""
        nbytes = (e - s) * ns.layout.block_nbytes
        for attempt in range(STALE_RETRIES + 1):
            r = self._reserve(m, nbytes)
            try:
                commit = self._stage(m, r, ns, tokens, src, s, e, session)
            except BaseException:
                # an interrupt, a device's error: the range goes back now, not at its lease's end (every
                # copy into it has ended: the Copier waits for its helpers, interrupted or not)
                with contextlib.suppress(Exception):
                    _give_back(self._conn, Finish(handle=r.handle, used=0), wait=False)
                raise
            try:
                return self._conn.call(commit, idempotent=True)
            except ServerError as err:
                if err.code != "not_found" or attempt == STALE_RETRIES:
                    # a commit refused before the daemon took its range back (one it could not read):
                    # the range goes back now, not at its lease's end
                    if err.code != "not_found":
                        with contextlib.suppress(Exception):
                            _give_back(self._conn, Finish(handle=r.handle, used=0), wait=False)
                    raise
        raise AssertionError("unreachable")

    def _reserve(self, m: SharedMapping, nbytes: int) -> ReserveOk:
        """A staging range of ``nbytes`` in this client's segment (_Stale: the daemon restarted)."""
        r = self._conn.call(Reserve(nbytes=nbytes), idempotent=True)
        assert isinstance(r, ReserveOk)
        if r.instance != m.instance:  # a new daemon's range: given back now, not at its lease's end
            _give_back(self._conn, Finish(handle=r.handle, used=0), wait=True)
            raise _Stale
        return r

    def _stage(
        self,
        m: SharedMapping,
        r: ReserveOk,
        ns: Namespace,
        tokens: Chain,
        src: KVTarget,
        s: int,
        e: int,
        session: str | None,
        *,
        keep: bool = False,
    ) -> Commit:
        """Write blocks ``s .. e-1`` of ``src`` into the staging range ``r``; the commit that stores them."""
        layout, T = ns.layout, ns.layout.block_tokens
        view = m.staging_view(r.path, r.size, r.offset, (e - s) * layout.block_nbytes)
        view = view.view(layout.torch_dtype).view(layout.shape((e - s) * T))
        if isinstance(src, PagedKV):
            src.read(s * T, view)
        else:
            self._copier.copy(view, src[:, :, s * T : e * T])
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


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded down to whole staging pages (ALIGN)."""
    return nbytes // ALIGN * ALIGN


def _give_back(conn: Connection, done: Finish, *, wait: bool) -> None:
    """Send ``done`` and go on. ``wait``: its reply is awaited before the connection's next request
    (Connection.defer), so the staging it frees is free for that request; else never: a lost finish
    only lets the lease run out, and on the way out of a failure (a daemon that does not answer) an
    awaited one would cost its own time-outs on top of the failure's."""
    if wait:
        conn.defer(done)
    else:
        conn.notify(done)
