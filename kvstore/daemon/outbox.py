"""Replies on their way out of the daemon's ROUTER, to clients that may not be reading them.

A ROUTER queues replies per connection up to its send high-water mark, and ZeroMQ's default (1000)
let a client that sends requests and never reads the answers hold up to 1000 replies in the
daemon's memory, each up to ``max_message_bytes``, outside every budget. Here the router is
``ROUTER_MANDATORY`` with a high-water mark of SNDHWM replies per connection (fewer with a smaller
``max_inflight_per_client``), and a reply that does not fit is parked in the Outbox: its request's
bytes stay charged (kvstore.daemon.budget) until it leaves, so unread replies turn their tenant away
``busy`` once its budget is spent::

    worker reply ──► Outbox.send ──► ROUTER pipe (hwm replies) ──► socket ──► client
                        │ pipe full                  ▲
                        └──► parked, by peer ────────┘ retry: per peer, soon, then less often

Replies to one peer leave in the order they were sent. A reply to a peer that is gone is dropped
(``gone`` counts them), and so are small uncharged replies (busy, errors, lookups) past
MAX_PARKED_BYTES waiting for one peer (``dropped``): a client with that much unread is not reading.
What a connection can hold outside the budgets: hwm replies in the pipe, the one being written, the
kernel's buffer, and MAX_PARKED_BYTES.

ZeroMQ says a pipe has room again only by a command on the socket's mailbox (the loop watches the
socket's file descriptor while replies are parked, and ``retry`` runs the commands), not for which
peer. So a peer that took replies within HOT seconds is tried on every turn of the loop (a client
that reads is served at once), and one that did not after RETRY_MIN, then after twice as long each
time, up to RETRY_MAX: hundreds of clients that read nothing cost the loop little.

Not thread-safe: the loop thread alone sends.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvstore.wire.protocol import nbytes

log = logging.getLogger("kvstore.daemon.outbox")

# Replies ZeroMQ queues for one connection: each may be a whole get's K/V, outside the budgets, so few.
# A client pipelining more small requests than this is served by retry() at once while it reads.
SNDHWM = 8
MAX_PARKED_BYTES = 4 * 2**20  # uncharged replies waiting for one peer beyond which new ones are dropped
RETRY_MIN, RETRY_MAX = 0.001, 0.1  # seconds between tries of one peer's parked replies
HOT = 0.05  # a peer that took replies this recently (seconds) is tried on every turn of the loop

# called once a charged reply has left, or been dropped (its peer gone); True if it was parked first
Sent = Callable[[bool], None]


@dataclass
class _Waiting:
    """What waits for one peer, oldest first, and when to try it again."""

    replies: deque[tuple[list[Any], bool, Sent | None, int]] = field(default_factory=deque)
    uncharged_bytes: int = 0
    delay: float = RETRY_MIN
    due: float = 0.0
    took: float = 0.0  # when it last took a reply (or its first was parked)
    warned: bool = False


class Outbox:
    """Sends replies on ``router`` (which it sets to ROUTER_MANDATORY and a send high-water mark of
    ``hwm``), parking those that do not fit until ``retry`` can send them."""

    def __init__(self, router: zmq.Socket, hwm: int) -> None:
        router.setsockopt(zmq.SNDHWM, hwm)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router = router
        self._parked: dict[bytes, _Waiting] = {}
        self.parked = 0  # replies waiting, all peers
        self.gone = 0  # replies dropped because their peer disconnected
        self.dropped = 0  # uncharged replies dropped past MAX_PARKED_BYTES for one peer

    def send(self, peer: bytes, frames: list[Any], *, copy: bool = True, sent: Sent | None = None) -> bool:
        """Send ``frames`` to ``peer`` now, or park them behind what already waits for it; True when sent
        now (or dropped: the peer is gone). ``sent(parked)`` is called once the reply has left or been
        dropped; a charged reply (one with ``sent``) is never dropped for waiting, only when its peer
        is gone."""
        w = self._parked.get(peer)
        if w is None:
            if self._try(peer, frames, copy, sent, parked=False):
                return True
            now = time.monotonic()
            w = self._parked[peer] = _Waiting(due=now + RETRY_MIN, took=now)
        size = 0
        if sent is None:
            size = sum(nbytes(f) for f in frames)
            if w.uncharged_bytes + size > MAX_PARKED_BYTES and w.replies:
                self.dropped += 1
                if not w.warned:
                    w.warned = True
                    log.warning(
                        "client %s reads no replies (%d waiting for it); dropping its uncharged ones",
                        peer.hex(),
                        len(w.replies),
                    )
                return True
            w.uncharged_bytes += size
        w.replies.append((frames, copy, sent, size))
        self.parked += 1
        return False

    def retry(self) -> int:
        """Try the peers whose turn has come: each one's replies in order until its pipe is full.
        Returns how many replies left (or were dropped, their peer gone)."""
        now = time.monotonic()
        left = 0
        # the socket's pending commands run here: a pipe with room again, a peer gone (its pipe ends
        # only once its inbound side is read to its end, which this looks at)
        self.router.getsockopt(zmq.EVENTS)
        for peer in [p for p, w in self._parked.items() if w.due <= now or now - w.took < HOT]:
            w = self._parked[peer]
            before = left
            while w.replies:
                frames, copy, sent, size = w.replies[0]
                if not self._try(peer, frames, copy, sent, parked=True):
                    break
                w.replies.popleft()
                w.uncharged_bytes -= size
                self.parked -= 1
                left += 1
            if not w.replies:
                del self._parked[peer]
                continue
            # a peer that took some is reading: tried on every turn (and after RETRY_MIN at the
            # latest); one that took none, later and later
            if left > before:
                w.took, w.delay = now, RETRY_MIN
            else:
                w.delay = min(2 * w.delay, RETRY_MAX)
            w.due = now + w.delay
        return left

    def wait(self, most: float) -> float:
        """Seconds until the next peer's turn to be tried, at most ``most`` (0: one is due now)."""
        if not self._parked:
            return most
        return max(0.0, min(most, min(w.due for w in self._parked.values()) - time.monotonic()))

    def _try(self, peer: bytes, frames: list[Any], copy: bool, sent: Sent | None, *, parked: bool) -> bool:
        """Send one reply; False when the peer's pipe is full (nothing sent). A gone peer's is dropped."""
        try:
            self.router.send_multipart([peer, *frames], zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self.gone += 1
        if sent is not None:
            sent(parked)
        return True
