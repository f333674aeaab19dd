"""The Outbox against a real ROUTER and DEALER (inproc, no daemon): replies that do not fit wait, leave in
order once the client reads, and a gone client's are dropped with their charges released."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvstore.daemon.outbox import MAX_PARKED_BYTES, Outbox

HWM = 2


@pytest.fixture
def pair() -> Iterator[tuple[Outbox, zmq.Socket, bytes]]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    outbox = Outbox(router, hwm=HWM)
    router.bind("inproc://outbox")
    dealer = ctx.socket(zmq.DEALER)
    dealer.rcvhwm = 1  # what the client does not read stays on the router's side
    dealer.connect("inproc://outbox")
    dealer.send(b"hi")
    peer = router.recv_multipart()[0]
    try:
        yield outbox, dealer, peer
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def drain(dealer: zmq.Socket, outbox: Outbox, n: int) -> list[bytes]:
    """Read ``n`` replies, letting the outbox retry as a daemon's loop would."""
    got: list[bytes] = []
    deadline = time.monotonic() + 5
    while len(got) < n and time.monotonic() < deadline:
        outbox.retry()
        while dealer.poll(1):
            got.append(dealer.recv())
    return got


def test_replies_past_the_pipe_wait_and_leave_in_order_once_the_client_reads(
    pair: tuple[Outbox, zmq.Socket, bytes],
) -> None:
    outbox, dealer, peer = pair
    released: list[tuple[int, bool]] = []

    def releases(i: int) -> Callable[[bool], None]:
        return lambda parked: released.append((i, parked))

    now = [outbox.send(peer, [b"%d" % i], sent=releases(i)) for i in range(20)]
    assert now[0] and not all(now)  # the first fit, some had to wait
    waiting = now.count(False)
    assert outbox.parked == waiting
    # a charged reply's charge is released as it leaves; those that waited say so
    assert [i for i, _ in released] == list(range(20 - waiting))
    assert all(not p for _, p in released)
    assert drain(dealer, outbox, 20) == [b"%d" % i for i in range(20)]  # all of them, in order
    assert outbox.parked == 0 and [i for i, _ in released] == list(range(20))
    assert all(p for i, p in released if not now[i])


def test_a_gone_clients_replies_are_dropped_and_their_charges_released(
    pair: tuple[Outbox, zmq.Socket, bytes],
) -> None:
    outbox, dealer, peer = pair
    released: list[bool] = []
    for i in range(20):
        outbox.send(peer, [b"%d" % i], sent=released.append)
    assert outbox.parked > 0
    dealer.close(linger=0)
    deadline = time.monotonic() + 5
    while outbox.parked and time.monotonic() < deadline:
        outbox.retry()
        time.sleep(0.01)
    assert outbox.parked == 0 and len(released) == 20 and outbox.gone > 0


def test_uncharged_replies_for_a_client_that_reads_nothing_are_bounded_in_bytes(
    pair: tuple[Outbox, zmq.Socket, bytes],
) -> None:
    outbox, _, peer = pair
    big = b"x" * (64 * 1024)
    for _ in range(2 * MAX_PARKED_BYTES // len(big)):
        outbox.send(peer, [big])
    assert outbox.dropped > 0
    assert outbox.parked * len(big) <= MAX_PARKED_BYTES + len(big)


def test_a_client_that_reads_nothing_is_tried_less_and_less_often(
    pair: tuple[Outbox, zmq.Socket, bytes],
) -> None:
    outbox, _, peer = pair
    for i in range(20):
        outbox.send(peer, [b"%d" % i])
    waits = []
    for _ in range(8):
        time.sleep(outbox.wait(1.0))
        outbox.retry()
        waits.append(outbox.wait(1.0))
    assert waits[-1] > 10 * waits[0]  # backed off: hundreds of such clients cost the loop little
    assert outbox.wait(0.005) <= 0.005
