"""Replies on their way out of the daemon's ROUTER, to clients that may not be reading them.

A ROUTER queues replies per connection up to its send high-water mark, and ZeroMQ's default (1000)
let a client that sends requests and never reads the answers hold up to 1000 replies in the
daemon's memory, each up to ``max_message_bytes``, outside every budget. Here the router is
``ROUTER_MANDATORY`` with a high-water mark of SNDHWM replies per connection: a reply that does not
fit is parked in the Outbox, and its request's charge (kvstore.daemon.budget) is released only when
it leaves, so replies nobody reads count against the tenant's budget until the tenant is answered
``busy``::

    worker reply ──► Outbox.send ──► ROUTER pipe (SNDHWM replies) ──► socket ──► client
                        │ pipe full                  ▲
                        └──► parked, by peer ────────┘ retry: on every loop turn

Replies to one peer leave in the order they were sent. A reply to a peer that is gone is dropped
(``gone`` counts them), and so are small uncharged replies (busy, errors) past MAX_PARKED waiting for
one peer (``dropped``): a client with that many unread is not reading. What a connection can hold
outside the budget is SNDHWM replies in the pipe, the one being written, and the kernel's buffer.

Not thread-safe: the loop thread alone sends.
"""

from __future__ import annotations

import errno
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("kvstore.daemon.outbox")

SNDHWM = 2  # replies queued in ZeroMQ per connection; the rest wait here
MAX_PARKED = 1024  # uncharged replies waiting for one peer beyond which new ones are dropped

Sent = Callable[[], None]


class Outbox:
    """Sends replies on ``router`` (which it sets to ROUTER_MANDATORY and SNDHWM), parking those that do
    not fit until ``retry`` can send them."""

    def __init__(self, router: zmq.Socket) -> None:
        router.setsockopt(zmq.SNDHWM, SNDHWM)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router = router
        self._parked: dict[bytes, deque[tuple[list[Any], bool, Sent | None]]] = {}
        self.parked = 0  # replies waiting, all peers
        self.gone = 0  # replies dropped because their peer disconnected
        self.dropped = 0  # uncharged replies dropped past MAX_PARKED for one peer
        self._warned: set[bytes] = set()

    def send(self, peer: bytes, frames: list[Any], *, copy: bool = True, sent: Sent | None = None) -> None:
        """Send ``frames`` to ``peer`` now, or park them behind what already waits for it. ``sent`` is
        called once the reply has left or been dropped (a charged reply: it is never dropped for
        waiting, only when its peer is gone)."""
        waiting = self._parked.get(peer)
        if waiting is None:
            if self._try(peer, frames, copy, sent):
                return
            waiting = self._parked[peer] = deque()
        elif sent is None and len(waiting) >= MAX_PARKED:
            self.dropped += 1
            if peer not in self._warned:
                self._warned.add(peer)
                log.warning(
                    "client %s reads no replies (%d waiting for it); dropping its small ones",
                    peer.hex(),
                    MAX_PARKED,
                )
            return
        waiting.append((frames, copy, sent))
        self.parked += 1

    def retry(self) -> int:
        """Send what waits, each peer's replies in order until its pipe is full; returns how many left."""
        left = 0
        for peer in list(self._parked):
            waiting = self._parked[peer]
            while waiting:
                frames, copy, sent = waiting[0]
                if not self._try(peer, frames, copy, sent):
                    break
                waiting.popleft()
                self.parked -= 1
                left += 1
            if not waiting:
                del self._parked[peer]
                self._warned.discard(peer)
        return left

    def _try(self, peer: bytes, frames: list[Any], copy: bool, sent: Sent | None) -> bool:
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
            sent()
        return True
