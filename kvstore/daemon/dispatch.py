"""Requests the loop hands to worker threads: what each holds of the in-flight budgets until its
reply leaves the daemon, and one client's commits run one at a time, in the order it sent them.

::

    loop ── take ──► charged (kvstore.daemon.budget), numbered ──► worker ──► reply ──► Outbox
                │  a commit while another of its client's runs                          │
                └──► waits behind it, by peer; ``answered`` starts the next      ``sent`` releases
                                                                                   the charge

A client's commits each need the blocks of the one before it, so the next chunk's commit, sent
before this one's answer, must not run ahead of it. A commit is taken past a spent budget (its K/V
is in the client's staging already, bounded by ``shm_staging``); only a client with
MAX_WAITING_COMMITS commits already waiting is told to wait. A finish is taken past a spent budget
too: it gives pins and staging back, which turning it away would hold (an engine's client does not
wait to send it again); a client with MAX_QUEUED_FINISHES (its leases' bound) not yet answered waits.

Not thread-safe: the loop thread alone calls it (a worker only carries its request's number).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from kvstore.daemon.auth import OPERATOR
from kvstore.daemon.budget import Charge, InflightBudget
from kvstore.daemon.outbox import Sent
from kvstore.shm.plane import MAX_LEASES_PER_CLIENT
from kvstore.wire.messages import Commit, Finish, Get
from kvstore.wire.protocol import Request, ServerProtocol, nbytes

MAX_WAITING_COMMITS = 8  # commits of one client queued behind its running one, taken past a spent budget
MAX_QUEUED_FINISHES = MAX_LEASES_PER_CLIENT  # finishes of one client taken and not yet answered

# runs a taken request on a worker: (request, when it arrived, its number)
Submit = Callable[[Request, float, int], Any]


class Dispatch:
    """The requests on workers (``outstanding``), their charges, and the commits waiting their turn."""

    def __init__(self, budget: InflightBudget, proto: ServerProtocol, submit: Submit) -> None:
        """``submit`` runs a request taken on a worker (RuntimeError: the workers are gone)."""
        self.budget = budget
        self.proto = proto
        self._submit = submit
        self.outstanding = 0  # taken and not yet answered by a worker
        self._charges: dict[int, Charge] = {}  # per request taken, by the number it carries
        self._number = 0
        self._waiting: dict[bytes, deque[tuple[Request, float, int]]] = {}  # peer -> commits behind
        self._running: dict[int, bytes] = {}  # number of a running commit -> its peer
        self._finishing: dict[int, bytes] = {}  # number of a finish taken -> its peer
        self._finishes: dict[bytes, int] = {}  # peer -> its finishes taken and not yet answered

    def take(self, peer: bytes, request: Request, frames: list, arrived: float) -> str | None:
        """Charge ``request`` and submit it (or queue it behind its client's running commit); or,
        changing nothing, say why it is refused ``busy``."""
        tenant, cost = cost_of(request, frames)
        refusal = self.budget.refusal(tenant, cost)
        commit = isinstance(request.msg, Commit)
        if refusal is not None and commit:
            waiting = self._waiting.get(peer)
            refusal = None
            if waiting is not None and len(waiting) >= MAX_WAITING_COMMITS:
                refusal = (
                    f"{len(waiting)} commits of this client wait for the one running; send it again shortly"
                )
        finish = isinstance(request.msg, Finish)
        if refusal is not None and finish and self._finishes.get(peer, 0) < MAX_QUEUED_FINISHES:
            refusal = None
        if refusal is not None:
            return refusal
        self._number += 1
        number = self._number
        self._charges[number] = self.budget.take(tenant, cost)
        self.outstanding += 1
        if finish:
            self._finishing[number] = peer
            self._finishes[peer] = self._finishes.get(peer, 0) + 1
        if commit:
            waiting = self._waiting.get(peer)
            if waiting is not None:  # another commit of this client runs: after it
                waiting.append((request, arrived, number))
                return None
            self._waiting[peer] = deque()
            self._running[number] = peer
        try:
            self._submit(request, arrived, number)
        except BaseException:  # the workers are gone (the daemon is stopping): as if never taken
            if commit:
                del self._running[number], self._waiting[peer]
            self._finished(number)
            self.budget.release(self._charges.pop(number))
            self.outstanding -= 1
            raise
        return None

    def sent(self, number: int, peer: bytes) -> Sent:
        """Called once the reply of request ``number`` has left (or its peer is gone): its charge and its
        client's count in flight are released only then, so replies a client leaves unread count."""

        def sent(parked: bool) -> None:
            charge = self._charges.pop(number)
            if parked:
                self.budget.unpark(charge)
            else:
                self.budget.release(charge)
            self.proto.done(peer)

        return sent

    def answered(self, number: int, *, parked: bool) -> None:
        """A worker answered request ``number``; ``parked``: its reply waits for its client to read
        (its bytes stay charged, its worker place is free). Starts its client's next commit, if any."""
        self.outstanding -= 1
        if parked:
            self.budget.park(self._charges[number])
        self._finished(number)
        peer = self._running.pop(number, None)
        while peer is not None:
            waiting = self._waiting[peer]
            if not waiting:
                del self._waiting[peer]
                return
            request, arrived, number = waiting.popleft()
            self._running[number] = peer
            try:
                self._submit(request, arrived, number)
                return
            except RuntimeError:  # the workers are gone (the daemon is stopping): no answer; it lapses
                del self._running[number]
                self.budget.release(self._charges.pop(number))
                self.proto.done(request.peer)
                self.outstanding -= 1

    def _finished(self, number: int) -> None:
        """Request ``number`` is answered (or was never run): if a finish, its client's count drops."""
        peer = self._finishing.pop(number, None)
        if peer is not None:
            left = self._finishes[peer] - 1
            if left:
                self._finishes[peer] = left
            else:
                del self._finishes[peer]


def cost_of(request: Request, frames: list) -> tuple[str, int]:
    """(tenant, bytes) a request taken holds until its reply leaves: see kvstore.daemon.budget."""
    ns = request.namespace
    tenant = request.tenant or (ns.tenant if ns is not None else OPERATOR)
    cost = sum(nbytes(f) for f in frames)
    msg = request.msg
    if isinstance(msg, Get) and ns is not None:
        blocks = max(0, msg.chain.blocks(ns.layout.block_tokens) - msg.start_block)
        if msg.max_blocks is not None:
            blocks = min(blocks, msg.max_blocks)
        cost += blocks * ns.layout.block_nbytes
    return tenant, cost
