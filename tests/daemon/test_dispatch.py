"""Requests handed to workers, as the daemon's loop does it: charged until their replies leave, and a
client's same-host commits run one at a time, in the order it sent them (each needs the blocks of the
one before), even past a spent budget."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.daemon.budget import InflightBudget
from kvstore.daemon.dispatch import MAX_QUEUED_FINISHES, MAX_WAITING_COMMITS, Dispatch
from kvstore.wire.messages import Commit, Finish, Stats
from kvstore.wire.protocol import Limits, Request, ServerProtocol


class Workers:
    """Stands in for the loop's worker pool: records what is submitted, in order."""

    def __init__(self) -> None:
        self.ran: list[tuple[bytes, int, int]] = []  # (peer, request id, number)
        self.shut = False

    def submit(self, request: Request, arrived: float, number: int) -> None:
        if self.shut:
            raise RuntimeError("cannot schedule new futures after shutdown")
        self.ran.append((request.peer, request.id, number))


def commit(peer: bytes, rid: int) -> Request:
    msg = Commit(ns="n", shape=(1,), dtype="bfloat16", handle=1, tokens=np.arange(64, dtype=np.uint32))
    return Request(peer=peer, id=rid, msg=msg, tenant="t")


def stats(peer: bytes, rid: int) -> Request:
    return Request(peer=peer, id=rid, msg=Stats(), tenant="t")


def finish(peer: bytes, rid: int) -> Request:
    return Request(peer=peer, id=rid, msg=Finish(handle=rid, used=0), tenant="t")


def dispatch(total: int = 1000) -> tuple[Dispatch, InflightBudget, Workers]:
    budget = InflightBudget(total=total, per_tenant=total, max_queued=64)
    w = Workers()
    return Dispatch(budget, ServerProtocol(Limits()), w.submit), budget, w


def test_a_clients_commits_run_one_at_a_time_in_the_order_sent() -> None:
    d, budget, w = dispatch()
    # commits 1, 2, 3 of client a; 1 of client b: a's first and b's run, a's others wait
    for rid in (1, 2, 3):
        assert d.take(b"a", commit(b"a", rid), [b"x" * 10], 0.0) is None
    assert d.take(b"b", commit(b"b", 1), [b"x" * 10], 0.0) is None
    assert [(p, r) for p, r, _ in w.ran] == [(b"a", 1), (b"b", 1)]
    assert d.outstanding == 4 and budget.held == 40  # the waiting ones are charged too
    # a's first is answered and leaves: its second starts, then its third
    n = w.ran[0][2]
    d.sent(n, b"a")(False)
    d.answered(n, parked=False)
    assert [(p, r) for p, r, _ in w.ran[2:]] == [(b"a", 2)]
    n = w.ran[2][2]
    d.answered(n, parked=False)
    assert [(p, r) for p, r, _ in w.ran[3:]] == [(b"a", 3)]
    assert d.outstanding == 2


def test_past_a_spent_budget_commits_queue_up_to_a_bound_and_other_requests_are_busy() -> None:
    d, budget, w = dispatch(total=100)
    assert d.take(b"a", commit(b"a", 1), [b"x" * 100], 0.0) is None  # the budget is spent
    assert d.take(b"a", stats(b"a", 2), [b"x"], 0.0) is not None  # not a commit: busy
    for rid in range(2, 2 + MAX_WAITING_COMMITS):  # behind the running one, taken anyway
        assert d.take(b"a", commit(b"a", rid), [b"x" * 100], 0.0) is None
    refusal = d.take(b"a", commit(b"a", 99), [b"x" * 100], 0.0)
    assert refusal is not None and f"{MAX_WAITING_COMMITS} commits of this client wait" in refusal
    assert d.outstanding == 1 + MAX_WAITING_COMMITS and len(w.ran) == 1  # the refused one changed nothing


def test_a_reply_left_unread_keeps_its_bytes_charged_until_it_leaves() -> None:
    d, budget, w = dispatch(total=100)
    assert d.take(b"a", stats(b"a", 1), [b"x" * 60], 0.0) is None
    n = w.ran[0][2]
    sent = d.sent(n, b"a")
    d.answered(n, parked=True)  # the client does not read: the reply waits
    assert d.outstanding == 0 and budget.queued == 0 and budget.held == 60
    assert d.take(b"b", stats(b"b", 1), [b"x" * 60], 0.0) is not None  # its bytes count
    sent(True)  # it left at last
    assert budget.held == 0
    assert d.take(b"b", stats(b"b", 1), [b"x" * 60], 0.0) is None


def test_commits_waiting_when_the_workers_are_gone_are_let_go() -> None:
    d, budget, w = dispatch()
    for rid in (1, 2, 3):
        d.take(b"a", commit(b"a", rid), [b"x" * 10], 0.0)
    w.shut = True  # the daemon is stopping: the waiting ones get no answer (their clients retry)
    n = w.ran[0][2]
    d.sent(n, b"a")(False)
    d.answered(n, parked=False)
    assert d.outstanding == 0 and budget.held == 0 and budget.queued == 0
    # and a new commit of that client is not queued behind one that will never run
    w.shut = False
    assert d.take(b"a", commit(b"a", 4), [b"x"], 0.0) is None
    assert w.ran[-1][1] == 4


@pytest.mark.parametrize("peer_reads", [True, False])
def test_every_charge_comes_back_whatever_the_client_does(peer_reads: bool) -> None:
    d, budget, w = dispatch()
    for rid in range(1, 6):
        d.take(b"a", commit(b"a", rid) if rid % 2 else stats(b"a", rid), [b"x" * 7], 0.0)
    done: set[int] = set()
    while len(done) < len(w.ran):
        for _, _, n in list(w.ran):
            if n not in done:
                done.add(n)
                sent = d.sent(n, b"a")
                d.answered(n, parked=not peer_reads)
                sent(not peer_reads)
    assert len(w.ran) == 5 and d.outstanding == 0 and budget.held == 0 and budget.queued == 0


def test_a_request_the_workers_refuse_leaves_nothing_charged_or_queued() -> None:
    # the daemon is stopping: its workers take nothing more. The request is answered with an error by
    # the loop, and the client's next commit is not queued behind one that will never run
    d, budget, w = dispatch()
    w.shut = True
    for rid, request in ((1, commit(b"a", 1)), (2, stats(b"a", 2))):
        with pytest.raises(RuntimeError):
            d.take(b"a", request, [b"x" * 10], 0.0)
        assert d.outstanding == 0 and budget.held == 0, rid
    w.shut = False
    assert d.take(b"a", commit(b"a", 3), [b"x" * 10], 0.0) is None
    assert [(p, r) for p, r, _ in w.ran] == [(b"a", 3)]


def test_past_a_spent_budget_finishes_are_taken_up_to_a_bound_per_client() -> None:
    # a finish gives pins and staging back: turned away, they would stay held (an engine's client
    # does not send it again); one client's finishes not yet answered are bounded by its leases'
    d, budget, w = dispatch(total=100)
    assert d.take(b"a", stats(b"a", 1), [b"x" * 100], 0.0) is None  # the budget is spent
    assert d.take(b"a", stats(b"a", 2), [b"x"], 0.0) is not None
    for rid in range(10, 10 + MAX_QUEUED_FINISHES):
        assert d.take(b"a", finish(b"a", rid), [b"x"], 0.0) is None
    assert d.take(b"a", finish(b"a", 99), [b"x"], 0.0) is not None  # past the bound: busy
    assert d.take(b"b", finish(b"b", 1), [b"x"], 0.0) is None  # another client's own bound
    # one of a's is answered: the next is taken
    n = w.ran[1][2]
    d.sent(n, b"a")(False)
    d.answered(n, parked=False)
    assert d.take(b"a", finish(b"a", 100), [b"x"], 0.0) is None
    assert d.outstanding == 2 + MAX_QUEUED_FINISHES
