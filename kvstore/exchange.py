"""One exchange of a Connection: requests sent, replies awaited, and what each kind of failure
costs (kvstore.connection tells the rules: time-outs and retries on a fresh socket, ``starting``
polled, ``busy`` waited out, a forgotten namespace greeted again, the caller's deadline).

The connection owns the socket, the protocol's bookkeeping and the deferred requests; an Exchange
is the state of one ``pipeline`` call over them (what is left to send, what is in flight, the
attempts spent, the daemon's latest refusal), made and run once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from kvstore.errors import DaemonStarting
from kvstore.wire.errors import DeadlinePassed, RemoteProtocolError, error_for_reply
from kvstore.wire.messages import ErrorReply, Message

if TYPE_CHECKING:
    from kvstore.connection import Connection

# Error codes after which the same request may succeed on a (re)started daemon.
TRANSIENT = frozenset({"shutting_down"})
BACKOFF = 0.05  # seconds before the first re-send after a transient error; doubles each time
STARTING_POLL = 0.2  # seconds between re-sends to a daemon that answers "starting"
BUSY_WAIT_MAX = 1.0  # longest pause between re-sends of a request the daemon answered "busy"


class SendCut(zmq.Again):
    """A send that could not leave before the caller's deadline (``until``): nothing was sent."""


class Exchange:
    """Requests ``make(0) .. make(n-1)`` on ``conn``, at most ``window`` in flight, each answer handed
    to ``on_reply(i, reply)`` (see Connection.pipeline)."""

    def __init__(
        self,
        conn: Connection,
        n: int,
        make: Callable[[int], Message],
        on_reply: Callable[[int, Message], Any],
        *,
        idempotent: bool,
        window: int,
        greet: bool,
        budget: int,
    ) -> None:
        self.conn = conn
        self.make, self.on_reply = make, on_reply
        self.idempotent, self.window, self.greet, self.budget = idempotent, window, greet, budget
        self.todo: deque[int] = deque(range(n))
        self.inflight: dict[int, int] = {}  # request id -> index
        self.attempts = 0
        self.starting_since: float | None = None  # first "starting" answer
        self.busy_since: float | None = None  # first "busy" answer since the last reply that did the work
        self.busy_count = 0
        self.forgotten = False  # the daemon said it does not know the namespace: said hello again once
        self.refused: ErrorReply | None = None  # the last busy or starting answer, while it is sent again

    def run(self, lapsed: bool) -> int:
        """The exchange, to its end; returns the retries it spent. ``lapsed``: what was deferred before
        it went unanswered within the time-out (that wait was this exchange's first attempt)."""
        conn = self.conn
        if lapsed:  # (on the fresh socket the wait left)
            self.again("timeout of a reply due before it", fresh_socket=False, unsent=True)
        try:
            while self.todo or self.inflight:
                self.out_of_time()
                if (
                    self.greet
                ):  # the hello a reconnect needs spends this call's retries, not retries of its own
                    self.attempts += conn.ensure_hello(retries=self.budget - self.attempts)
                if not self._send_window():
                    continue  # on a fresh socket, from the first unanswered request
                try:
                    got = conn._recv(conn._due(conn.timeout))
                except RemoteProtocolError as e:
                    self.again("garbled reply", fresh_socket=True, cause=e)
                    continue
                if got is None:
                    self.out_of_time()
                    self.again("timeout", fresh_socket=True)
                    continue
                rid, reply = got
                if conn._deferred.pop(rid, None) is not None:  # deferred by make or on_reply: dropped
                    continue
                i = self.inflight.pop(rid)
                if isinstance(reply, ErrorReply):
                    self._refused(rid, i, reply)
                    continue
                self.busy_since, self.busy_count, self.refused = None, 0, None
                self.on_reply(i, reply)
        except BaseException:  # make or on_reply raised: replies still due are dropped when they come,
            self._forget_inflight()  # not read as the answer to this connection's next request
            raise
        return self.attempts

    def _send_window(self) -> bool:
        """Send what the window lets; False when a send could not leave (on a fresh socket now)."""
        while self.todo and len(self.inflight) < self.window:
            i = self.todo.popleft()
            try:
                self.inflight[self.conn._send(self.make(i))] = i
            except zmq.Again as e:  # not queued: nothing takes what is queued on this socket
                self.todo.appendleft(i)
                if isinstance(e, SendCut):  # the send waited out the caller's time
                    self.conn.reconnect()  # (what is queued goes with the socket)
                    self.out_of_time(now=True)
                self.again("no connection to send on", fresh_socket=True)
                return False
        return True

    def _refused(self, rid: int, i: int, reply: ErrorReply) -> None:
        """An error reply to request ``i``: sent again (starting, busy, a forgotten namespace, a
        transient error) or raised."""
        conn = self.conn
        if reply.code in ("starting", "busy"):
            self.refused = reply
        if reply.code == "starting":  # nothing was done: send it again once the daemon is up
            self.inflight[rid] = i
            now = time.monotonic()
            self.starting_since = now if self.starting_since is None else self.starting_since
            if now - self.starting_since >= conn.timeout:
                self._forget_inflight()
                raise DaemonStarting(
                    f"the daemon at {conn.endpoint} is still starting after {conn.timeout:g}s "
                    f"({reply.message}); wait for it (its log shows progress) or give "
                    "the client a longer timeout"
                )
            self._resend_inflight()
            time.sleep(max(0.0, conn._due(STARTING_POLL) - time.monotonic()))
            return
        if reply.code == "busy":  # over a budget, nothing was done: back-pressure, not failure
            now = time.monotonic()
            self.busy_since = now if self.busy_since is None else self.busy_since
            pause = min(BUSY_WAIT_MAX, BACKOFF * 2**self.busy_count)
            # waited out: its time-out, or the caller's deadline before the next try
            waited = now - self.busy_since >= conn.timeout or conn._due(pause) < now + pause
            if not conn.wait_when_busy or waited:
                self._forget_inflight()
                raise error_for_reply(reply.code, reply.message)
            self.todo.appendleft(i)  # sent again after a pause; the others in flight go on
            time.sleep(pause)
            self.busy_count += 1
            return
        if reply.code == "unknown_namespace" and self.greet:
            # nothing was done (a restarted daemon, or a registration it gave up): hello again and
            # re-send, once per call whatever the retries, and the next call says hello in any case
            conn._greeted = False
            self.inflight[rid] = i
            if not self.forgotten:
                self.forgotten = True
                self._resend_inflight()
                return
            self.again("daemon forgot the namespace", fresh_socket=False)
            return
        if reply.code in TRANSIENT:
            self.inflight[rid] = i
            self.again(
                reply.code,
                fresh_socket=reply.code == "shutting_down",
                backoff=True,
                cause=error_for_reply(reply.code, reply.message),
            )
            return
        self._forget_inflight()
        raise error_for_reply(reply.code, reply.message)

    def _forget_inflight(self) -> None:
        for rid in self.inflight:
            self.conn.proto.forget(rid)

    def _resend_inflight(self) -> None:
        """What is in flight is sent again, first, in order (its replies, if they come, are dropped)."""
        self._forget_inflight()
        self.todo.extendleft(sorted(self.inflight.values(), reverse=True))
        self.inflight = {}

    def again(
        self,
        reason: str,
        *,
        fresh_socket: bool,
        backoff: bool = False,
        cause: Exception | None = None,
        unsent: bool = False,
    ) -> None:
        """Another attempt, or the call's error when none is left (or the request is not idempotent
        and was sent: ``unsent``, it was not)."""
        conn = self.conn
        if conn._absent:  # nothing listens on the socket file: no retry can be answered
            conn._absent = False
            self._forget_inflight()
            conn.reconnect()  # what is queued on the socket is dropped: never run by a daemon started later
            raise conn.nobody_listens()
        if (not self.idempotent and not unsent) or self.attempts >= self.budget:
            self._forget_inflight()
            if cause is not None:
                raise cause
            raise conn.unanswered(reason, self.attempts + 1)
        self.attempts += 1
        self.todo.extendleft(sorted(self.inflight.values(), reverse=True))
        if fresh_socket:
            conn.reconnect()
        else:
            self._forget_inflight()
            conn._greeted = False
        self.inflight = {}
        if backoff:
            pause = BACKOFF * 2 ** (self.attempts - 1)
            time.sleep(max(0.0, conn._due(pause) - time.monotonic()))

    def out_of_time(self, *, now: bool = False) -> None:
        """The caller's deadline passed (``now``: it is spent, whatever the clock reads): the call
        ends now (replies still due are dropped), with the daemon's own answer when it was turning
        the request away (busy, starting)."""
        conn = self.conn
        if not now and not conn._overdue():
            return
        self._forget_inflight()
        refused = self.refused
        if refused is not None and refused.code == "starting":
            raise DaemonStarting(
                f"the daemon at {conn.endpoint} was still starting when the caller's time ran out "
                f"({refused.message})"
            )
        if refused is not None:
            raise error_for_reply(refused.code, refused.message)
        raise DeadlinePassed(
            f"the caller's time ran out before {conn.endpoint} answered "
            f"({self.attempts + 1} attempt(s), {len(self.todo) + len(self.inflight)} request(s) unanswered)"
        )


__all__ = ["Exchange", "SendCut"]
