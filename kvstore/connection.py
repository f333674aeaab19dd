"""The client's connection to a daemon: one DEALER socket, timeouts, retries, reconnects.

Requests are pipelined (up to ``window`` in flight) and replies are handed to
a callback as they arrive, in whatever order the daemon finishes them, so a
long prefix streams through without either side holding all of it twice. One call's sends,
waits and retries are an Exchange (kvstore/exchange.py); the socket, the protocol's bookkeeping
and the deferred requests are the connection's.

When a reply does not come within ``timeout`` (daemon restarted, killed, or
stopping), an idempotent exchange closes the socket, opens a fresh one,
says hello again and re-sends what was unanswered, up to ``retries`` times.
A reply saying the namespace is unknown (the daemon restarted and came back
on the same socket) triggers a hello and a re-send, without a new socket.

A daemon still building its store answers ``starting``: the request is sent
again every STARTING_POLL seconds, up to ``timeout`` after the first such
answer, then DaemonStarting is raised (retries are not spent on it). A
``busy`` answer (the daemon is over an in-flight budget or a quota; nothing
was done) is back-pressure: that request is sent again after a pause that
doubles up to BUSY_WAIT_MAX, for up to ``timeout``, then its error is raised.
A request sent with ``defer`` (a same-host read's finish, which frees staging) is
not waited for: its reply is received before the connection's next request
leaves (or the connection closes), so the daemon has done it before anything
sent after it, and the caller does not spend its round trip.

A connection made with ``wait_when_busy=False`` (an engine's lookups and loads: a
busy store is a miss, recomputed, never a stalled step) raises it at once instead.

Within ``until(deadline)`` every call the thread makes ends by that deadline whatever the
above would wait, a send that cannot leave included (an engine hook with a budget of its own for
all its calls, a put of many chunks included): DeadlinePassed (a RequestTimeout), not retried.

On an ``ipc://`` endpoint a wait for a reply looks, once a second has passed, whether anything
listens on the socket file; nothing there for ABSENT_GRACE seconds (no daemon, or a killed one's
file) ends the call with RequestTimeout at once, its retries unspent, saying no daemon runs there,
not after ``timeout`` times each attempt. A daemon restarting within that grace is waited for.

With ``curve`` (kvstore.daemon.auth.ClientKeys) every socket is a CURVE client of the
daemon. A daemon that refuses the key sends nothing at all, so a refused key
shows up as a RequestTimeout (its message says to check the allow-list).
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from kvstore.config_values import ipc_socket_path
from kvstore.daemon.auth import ClientKeys
from kvstore.errors import ClientClosed
from kvstore.exchange import BACKOFF, BUSY_WAIT_MAX, Exchange, SendCut
from kvstore.keys import Namespace
from kvstore.wire.errors import (
    DeadlinePassed,
    RemoteProtocolError,
    RequestTimeout,
    ServerError,
)
from kvstore.wire.messages import ErrorReply, Hello, HelloOk, Message
from kvstore.wire.protocol import ClientProtocol, Limits

CLOSE_WAIT = 1.0  # seconds close() waits at most for the replies of deferred requests
ABSENT_AFTER = 1.0  # seconds a reply is waited for before looking whether a daemon listens (ipc)
ABSENT_POLL = 0.25  # seconds between those looks
ABSENT_GRACE = 5.0  # seconds nothing listens before a call ends (a restart binds again sooner)
ABORT_POLL = 0.1  # seconds a wait for a reply goes without looking whether another thread aborted it


def _release(live: list[zmq.Socket | None], ctx: zmq.Context | None) -> None:
    """A dropped connection's socket, closed, then the context it owned, ended."""
    sock = live[0]
    if sock is not None and not sock.closed:
        sock.close(linger=0)
    if ctx is not None and not ctx.closed:
        ctx.term()


class Connection:
    """A DEALER socket to ``endpoint`` speaking the kvstore protocol. Not thread-safe."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float,
        retries: int,
        namespace: Namespace | None,
        context: zmq.Context | None = None,
        curve: ClientKeys | None = None,
        shared_memory: bool = False,
        wait_when_busy: bool = True,
    ) -> None:
        """``shared_memory``: ask for the daemon's shared-memory offer in every hello (``shm_offer``).
        ``wait_when_busy``: False raises a ``busy`` answer at once (see the module's doc)."""
        self.endpoint = endpoint
        self.shared_memory = shared_memory
        self.shm_offer: dict[str, Any] | None = None  # from the latest hello reply
        self.curve = curve
        self.timeout = timeout
        self.retries = retries
        self.wait_when_busy = wait_when_busy
        self.namespace = namespace
        self.limits: Limits | None = None  # learnt from the hello reply
        self._own_ctx = context is None
        self.ctx = context or zmq.Context()
        self.sock: zmq.Socket | None = None
        # A connection dropped without close() (a client never closed, in a reference cycle) lets go
        # of its socket, then its context: pyzmq's own clean-up of a context collected in the same
        # cycle as its socket terminates it first and blocks for ever on the socket still open.
        self._live: list[zmq.Socket | None] = [None]
        self._finalizer = weakref.finalize(self, _release, self._live, self.ctx if self._own_ctx else None)
        self.proto = ClientProtocol()
        self.reconnects = 0
        self._greeted = False
        self._closed = False
        self._deferred: dict[int, Message] = {}  # requests sent by ``defer`` whose replies are due
        self._socket_file = ipc_socket_path(endpoint)
        self._absent = False  # the last wait ended because nothing listened on the socket file
        self._file_at_send = False  # the socket file was there when the last request was sent
        self._aborting = False  # set by another thread (``abort``): the wait under way ends
        self._until = threading.local()  # ``at``: the deadline of the calls the thread makes (``until``)

    def _open(self) -> zmq.Socket:
        if self._closed:
            raise ClientClosed(f"this client of {self.endpoint} was closed; make a new KVStoreClient")
        if self.sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            try:
                sock.linger = 0  # never block close on requests nobody will answer
                # a DEALER with no usable peer (a refused CURVE key, a daemon never reached) blocks on send
                sock.sndtimeo = _ms(self.timeout)
                if self.curve is not None:
                    self.curve.apply(sock)  # before connect: the handshake starts with it
                sock.connect(self.endpoint)
            except BaseException:  # a socket left open would hang the context's term for ever
                sock.close(linger=0)
                raise
            self.sock = sock
            self._live[0] = sock
        return self.sock

    @contextlib.contextmanager
    def until(self, deadline: float) -> Iterator[None]:
        """Calls this thread makes meanwhile end by ``deadline`` (``time.monotonic()``), however long
        their time-outs, retries and waits on a busy or starting daemon would run: a reply not in by
        then ends the call with RequestTimeout (not retried). Within another, the earlier holds."""
        before = getattr(self._until, "at", None)
        self._until.at = deadline if before is None else min(before, deadline)
        try:
            yield
        finally:
            self._until.at = before

    def _due(self, seconds: float) -> float:
        """When a wait of ``seconds`` from now ends: at the caller's deadline, if that comes first."""
        end = time.monotonic() + seconds
        at = getattr(self._until, "at", None)
        return end if at is None else min(end, at)

    def _overdue(self) -> bool:
        """Whether the caller's deadline has passed."""
        left = self.left()
        return left is not None and left <= 0

    def left(self) -> float | None:
        """Seconds to the calling thread's deadline (``until``; negative once passed), None without one."""
        at = getattr(self._until, "at", None)
        return None if at is None else at - time.monotonic()

    def reconnect(self) -> None:
        """Drop the socket and everything awaited on it; the next exchange opens a fresh one."""
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
            self._live[0] = None
        self.proto = ClientProtocol()
        self._greeted = False
        self._deferred.clear()
        self.reconnects += 1

    @property
    def closed(self) -> bool:
        return self._closed

    def abort(self) -> None:
        """(From another thread.) End the wait for a reply that this connection's call runs now, if
        any, within ABORT_POLL seconds: that call raises ClientClosed. The caller closes it next."""
        self._aborting = True

    def close(self) -> None:
        self._aborting = False  # the aborted call is over: close's own wait for deferred replies runs
        if self._deferred and self.sock is not None:  # sent, maybe not yet gone: linger 0 drops it
            with contextlib.suppress(Exception):  # closing goes on whatever the socket does
                self._await_deferred(min(self.timeout, CLOSE_WAIT))
        self._closed = True
        self.shm_offer = None  # nothing is mapped from a closed client again
        self._finalizer.detach()
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
            self._live[0] = None
        if self._own_ctx:
            self.ctx.term()

    def _send(self, msg: Message) -> int:
        rid, frames = self.proto.send(msg)
        sock = self._open()
        left = self.left()
        cut = left is not None and left < self.timeout  # a send with no peer waits by the deadline too
        try:
            if cut:
                sock.sndtimeo = _ms(max(0.0, left or 0.0))
            # payload frames go without copying; a lone header is cheaper copied than wrapped in a zmq.Frame
            sock.send_multipart(frames, copy=len(frames) == 1)
        except zmq.Again:  # not even queued within the time: nothing was sent
            self.proto.forget(rid, sent=False)
            if cut:
                raise SendCut from None
            raise
        finally:
            if cut:
                with contextlib.suppress(zmq.ZMQError):  # (a socket failing otherwise: its error stands)
                    sock.sndtimeo = _ms(self.timeout)
        if self._socket_file is not None:  # (see _recv)
            self._file_at_send = self._socket_file.exists()
        return rid

    def notify(self, msg: Message) -> None:
        """Send ``msg`` without waiting for its reply (dropped when it comes): for a request whose
        outcome changes nothing for the caller (a lease given back early lapses anyway if lost)."""
        try:
            rid = self._send(msg)
        except zmq.Again:
            return
        self.proto.forget(rid)

    def defer(self, msg: Message) -> None:
        """Send ``msg`` and go on; its reply is awaited before this connection sends its next request,
        so the daemon has done it before anything sent after it (a lease given back, whose staging the
        next request may need), without the round trip now; ``close`` waits for it too (CLOSE_WAIT at
        most). Its reply is dropped (an error included: nothing the caller could do), except ``busy``,
        which sends it again (not on a connection that does not wait when busy: an engine's step is
        never held up; it lapses); not sent (no connection), or not answered within the time-out, it
        lapses as ``notify``'s would."""
        try:
            rid = self._send(msg)
        except zmq.Again:
            return
        self._deferred[rid] = msg

    def _await_deferred(self, timeout: float | None = None) -> bool:
        """Receive the replies ``defer`` left due (usually here already), for up to ``timeout`` (default:
        the connection's) in all. One answered ``busy`` (nothing was done) is sent again after a
        pause, as ``call`` would. None within the time: the daemon is gone or stuck, and what is sent
        next goes on a fresh socket (what was deferred lapses); returns False then."""
        wait = self.timeout if timeout is None else timeout
        own = time.monotonic() + wait  # the daemon's time to answer; ``deadline``: the caller's too
        deadline = self._due(wait)
        pause = BACKOFF
        try:
            while self._deferred:
                got = self._recv(deadline)
                if got is None:
                    if time.monotonic() < own:  # the caller's deadline, not the daemon's silence:
                        return True  # kept, for the next call to wait for
                    self.reconnect()
                    return False
                rid, reply = got
                msg = self._deferred.pop(rid, None)
                busy = isinstance(reply, ErrorReply) and reply.code == "busy"
                if msg is not None and busy and self.wait_when_busy and time.monotonic() + pause < deadline:
                    time.sleep(pause)
                    pause = min(BUSY_WAIT_MAX, pause * 2)
                    self.defer(msg)
        except RemoteProtocolError:  # garbled: this socket is not trusted further, as in pipeline
            self.reconnect()
        return True

    def _recv(self, deadline: float) -> tuple[int, Message] | None:
        """The next awaited reply, or None at ``deadline`` (or once nothing has listened on an ipc
        socket file for ABSENT_GRACE: ``_absent``). Raises RemoteProtocolError for a malformed one."""
        sock = self._open()
        self._absent = False
        look_at = time.monotonic() + ABSENT_AFTER if self._socket_file is not None else None
        # a file removed since the request was sent may be a live daemon's (a tmp cleaner): its
        # connection is open still, and its reply awaited to the time-out as before; one not there
        # when the request was sent, nor now, is no daemon
        missing_before = (
            self._socket_file is not None and not self._file_at_send and not self._socket_file.exists()
        )
        absent_since: float | None = None
        while True:
            if self._aborting:
                raise ClientClosed(f"this client of {self.endpoint} was closed while it waited for a reply")
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                return None
            if look_at is not None and now >= look_at:
                look_at = now + ABSENT_POLL
                if not self._listened(missing_before):
                    absent_since = now if absent_since is None else absent_since
                    if now - absent_since >= ABSENT_GRACE:
                        self._absent = True
                        return None
                else:
                    absent_since = None
            wait = (
                min(left, ABORT_POLL) if look_at is None else min(left, ABORT_POLL, max(0.0, look_at - now))
            )
            sock.rcvtimeo = _ms(wait)
            try:
                frames: list[Any] = [sock.recv()]  # the header: small, copying is cheapest
            except zmq.Again:
                continue
            while sock.rcvmore:
                frames.append(sock.recv(copy=False))  # payloads: kept as zmq frames, never copied
            got = self.proto.receive(frames)
            if self.proto.unclaimed:
                self._give_back_late()
            if got is not None:
                return got

    def _give_back_late(self) -> None:
        """Give back what replies read after their callers stopped waiting held (a locate's lease, a
        reserved range, a pin: ClientProtocol.unclaimed), now rather than when their leases lapse.
        Deferred, as a read's own finish of staging is: done before this connection's next request,
        which may need the staging. (A reply never read here, on a socket since replaced or by a
        client that makes no further call, lapses with its lease.)"""
        late, self.proto.unclaimed = self.proto.unclaimed, []
        for msg in late:
            self.defer(msg)

    def _listened(self, missing_before: bool) -> bool:
        """Whether something accepts connections on the ipc socket file (a unix-socket connect: a file
        nobody listens on is refused); a missing file counts as nobody only if it was missing when
        the wait began (``missing_before``)."""
        assert self._socket_file is not None
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(ABSENT_POLL)
            probe.connect(str(self._socket_file))
            return True
        except FileNotFoundError:
            return not missing_before
        except ConnectionRefusedError:
            return False
        except OSError:  # anything else (a permission, a full backlog): not known to be absent
            return True
        finally:
            probe.close()

    def ensure_hello(self, retries: int | None = None) -> int:
        """Register the namespace (once per socket); a no-op for a client without one. ``retries``: at most
        this many of the client's (a call that must say hello again spends its own). Returns the retries spent."""
        if self._greeted or self.namespace is None:
            return 0
        self._greeted = True  # set first: the exchange below must not recurse
        out: list[Message] = []
        hello = Hello(namespace=self.namespace, shm=self.shared_memory)
        try:
            spent = self.pipeline(
                1, lambda _: hello, lambda _, r: out.append(r), idempotent=True, greet=False, retries=retries
            )
            reply = out[0]
        except BaseException:
            self._greeted = False  # a refused hello (forbidden tenant, timeout) is tried again next call
            raise
        assert isinstance(reply, HelloOk)
        self.limits = Limits.from_dict(reply.limits)
        self.shm_offer = reply.shm
        return spent

    def hello_again(self) -> None:
        """Say hello now on this socket (a reply showed the daemon is not the one greeted: it
        restarted), refreshing ``limits`` and ``shm_offer``; a no-op for a client without a namespace."""
        self._greeted = False
        self.ensure_hello()

    def call(self, msg: Message, *, idempotent: bool, greet: bool = True) -> Message:
        """Send one request and return its reply (error replies raise)."""
        out: list[Message] = []
        self.pipeline(1, lambda _: msg, lambda _, r: out.append(r), idempotent=idempotent, greet=greet)
        return out[0]

    def pipeline(
        self,
        n: int,
        make: Callable[[int], Message],
        on_reply: Callable[[int, Message], Any],
        *,
        idempotent: bool,
        window: int = 1,
        greet: bool = True,
        retries: int | None = None,
    ) -> int:
        """Send requests ``make(0) .. make(n-1)``, at most ``window`` in flight; ``on_reply(i, reply)`` per answer.

        ``make`` may be called again for the same index after a reconnect. ``retries``: at most this
        many of the client's ``retries`` (a hello saying again shares its call's); returns how many it spent.
        Raises the library exception of the first error reply, RequestTimeout
        when retries run out, RemoteProtocolError for a garbled reply that a
        retry did not cure.
        """
        if self._overdue():
            raise DeadlinePassed(f"the caller's time ran out before a request to {self.endpoint} was sent")
        # a daemon that did not answer what was deferred within the time-out has had this call's
        # first wait: the call's retries, and so its time, count it (the call is not sent yet)
        lapsed = bool(self._deferred) and not self._await_deferred()
        budget = self.retries if retries is None else retries
        exchange = Exchange(
            self, n, make, on_reply, idempotent=idempotent, window=window, greet=greet, budget=budget
        )
        return exchange.run(lapsed)

    def nobody_listens(self) -> RequestTimeout:
        """The error of a call that found nothing listening on the ipc socket file (``_absent``)."""
        return RequestTimeout(
            f"no kvstore daemon is running at {self.endpoint}: nothing has listened on "
            f"{self._socket_file} for {ABSENT_GRACE:g}s; start one (kvstore serve --config FILE)"
        )

    def unanswered(self, reason: str, attempts: int) -> RequestTimeout:
        """The error of a call whose ``attempts`` went unanswered (the last for ``reason``)."""
        if self.curve:
            hint = (  # a CURVE handshake that fails is dropped unanswered, either way
                " (and does its curve_allowed_keys list this client's public key, and is "
                "KVSTORE_CURVE_SERVER_KEY the daemon's public key?)"
            )
        elif self.endpoint.startswith("tcp://"):  # a CURVE daemon drops a plain client unanswered
            hint = (
                " (a daemon on tcp:// with CURVE answers only clients with keys: set "
                "KVSTORE_CURVE_SERVER_KEY and KVSTORE_CURVE_SECRET_KEY)"
            )
        else:
            hint = ""
        return RequestTimeout(
            f"no reply from {self.endpoint} within {self.timeout}s ({reason}) after "
            f"{attempts} attempt(s); is the daemon running{hint}?"
        )


__all__ = ["Connection", "ServerError"]


def _ms(seconds: float) -> int:
    """A socket time-out in milliseconds, rounded up (a wait ends at or after its time): at least 1, at
    most what the option holds (int32, ~24 days; longer is as good as for ever)."""
    return max(1, min(math.ceil(seconds * 1000), 2**31 - 1))
