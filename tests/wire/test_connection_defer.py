"""Connection.defer: a request sent now whose reply is awaited before the connection's next request.

A scripted ROUTER stands for the daemon: the test decides when (and whether) each request is answered
and sees when each request arrives.

    client   defer(finish A) ──────────────── call(B): waits for A's reply, then sends B
    daemon        A arrives ... answers A ──► B arrives ... answers B ──► call(B) returns B's reply
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvstore.connection import CLOSE_WAIT, Connection
from kvstore.wire.errors import RequestTimeout
from kvstore.wire.messages import ErrorReply, Finish, FinishOk, Message
from kvstore.wire.protocol import encode, read_header


class ScriptedDaemon:
    """A ROUTER on ``endpoint`` that answers only when told (``answer``)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(endpoint)

    def next_request(self, timeout: float) -> tuple[bytes, int, dict] | None:
        """(peer, request id, header) of the next request, or None when none comes within ``timeout``."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        peer, *frames = self.sock.recv_multipart()
        header, rid = read_header(frames[0], 1 << 20)
        assert rid is not None
        return peer, rid, header

    def answer(self, peer: bytes, rid: int, reply: Message) -> None:
        self.sock.send_multipart([peer, *encode(rid, reply)])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Connection, ScriptedDaemon]]:
    endpoint = f"ipc://{tmp_path}/d.sock"
    daemon = ScriptedDaemon(endpoint)
    conn = Connection(endpoint, timeout=1.5, retries=0, namespace=None)
    try:
        yield conn, daemon
    finally:
        conn.close()
        daemon.close()


def call_in_thread(conn: Connection, msg: Message) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(conn.call(msg, idempotent=False))
        except Exception as e:  # reported to the test through ``out``
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_the_next_request_leaves_only_once_the_deferred_one_is_answered(pair) -> None:
    conn, daemon = pair
    conn.defer(Finish(handle=7, used=3))
    peer, rid_a, header = daemon.next_request(2.0)
    assert header["handle"] == 7

    t, out = call_in_thread(conn, Finish(handle=8, used=0))
    assert daemon.next_request(0.4) is None  # B waits behind A's reply
    daemon.answer(peer, rid_a, FinishOk(released=True))
    got = daemon.next_request(2.0)
    assert got is not None and got[2]["handle"] == 8
    daemon.answer(got[0], got[1], FinishOk(released=False))
    t.join(5)
    assert out == [FinishOk(released=False)]  # B's reply, not A's


def test_a_deferred_request_answered_with_an_error_changes_nothing_for_the_next(pair) -> None:
    conn, daemon = pair
    conn.defer(Finish(handle=1, used=0))
    peer, rid_a, _ = daemon.next_request(2.0)
    daemon.answer(peer, rid_a, ErrorReply(code="not_found", message="no such lease"))
    t, out = call_in_thread(conn, Finish(handle=2, used=0))
    got = daemon.next_request(2.0)
    assert got is not None and got[2]["handle"] == 2
    daemon.answer(got[0], got[1], FinishOk(released=True))
    t.join(5)
    assert out == [FinishOk(released=True)]


def test_a_deferred_request_never_answered_is_the_next_call_s_first_wait(tmp_path: Path) -> None:
    """A daemon that does not answer what was deferred within the time-out has had the next call's
    first attempt: with a retry left, the call goes on a fresh socket (within (retries + 1) time-outs
    in all, as documented); without one, it times out after one time-out, never sent."""
    endpoint = f"ipc://{tmp_path}/d.sock"
    daemon = ScriptedDaemon(endpoint)
    retrying = Connection(endpoint, timeout=1.5, retries=1, namespace=None)
    once = Connection(endpoint, timeout=1.0, retries=0, namespace=None)
    try:
        retrying.defer(Finish(handle=1, used=0))
        first = daemon.next_request(2.0)
        assert first is not None
        peer, rid_a, _ = first
        t0 = time.monotonic()
        t, out = call_in_thread(retrying, Finish(handle=2, used=0))
        got = daemon.next_request(3.0)  # sent once the connection's time-out (1.5 s) has passed
        assert got is not None and got[2]["handle"] == 2
        daemon.answer(peer, rid_a, FinishOk(released=True))  # late: dropped, not taken for B's reply
        daemon.answer(got[0], got[1], FinishOk(released=False))
        t.join(5)
        assert out == [FinishOk(released=False)] and time.monotonic() - t0 < 3.0
        assert retrying.reconnects == 1  # B went on a fresh socket: the old one's daemon did not answer

        once.defer(Finish(handle=3, used=0))
        assert daemon.next_request(2.0) is not None
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout, match="timeout of a reply due before it"):
            once.call(Finish(handle=4, used=0), idempotent=False)
        assert time.monotonic() - t0 < 1.8  # one time-out, not two
        assert daemon.next_request(0.3) is None  # never sent
    finally:
        retrying.close()
        once.close()
        daemon.close()


def test_a_reconnect_drops_what_was_deferred_on_the_old_socket(pair) -> None:
    conn, daemon = pair
    conn.defer(Finish(handle=1, used=0))
    assert daemon.next_request(2.0) is not None
    conn.reconnect()  # the old socket's replies can never come
    t, out = call_in_thread(conn, Finish(handle=2, used=0))
    got = daemon.next_request(0.5)  # at once, not after a time-out
    assert got is not None and got[2]["handle"] == 2
    daemon.answer(got[0], got[1], FinishOk(released=True))
    t.join(5)
    assert out == [FinishOk(released=True)]


def test_a_deferred_request_answered_busy_is_sent_again(pair) -> None:
    conn, daemon = pair
    conn.defer(Finish(handle=5, used=2))
    peer, rid_a, _ = daemon.next_request(2.0)
    t, out = call_in_thread(conn, Finish(handle=6, used=0))
    daemon.answer(peer, rid_a, ErrorReply(code="busy", message="over the in-flight budget"))
    again = daemon.next_request(2.0)  # nothing was done: the same request, before B
    assert again is not None and again[2]["handle"] == 5 and again[2]["used"] == 2
    daemon.answer(again[0], again[1], FinishOk(released=True))
    got = daemon.next_request(2.0)
    assert got is not None and got[2]["handle"] == 6
    daemon.answer(got[0], got[1], FinishOk(released=True))
    t.join(5)
    assert out == [FinishOk(released=True)]


def test_close_waits_briefly_for_what_was_deferred(pair) -> None:
    conn, daemon = pair
    conn.defer(Finish(handle=9, used=1))
    closing = threading.Thread(target=conn.close, daemon=True)
    closing.start()
    peer, rid_a, header = daemon.next_request(2.0)  # it left before the socket closed
    assert header["handle"] == 9
    closing.join(0.3)
    assert closing.is_alive()  # waiting for the answer
    daemon.answer(peer, rid_a, FinishOk(released=True))
    closing.join(2.0)
    assert not closing.is_alive() and conn.closed


def test_close_does_not_wait_longer_than_close_wait_for_a_daemon_that_never_answers(pair) -> None:
    conn, daemon = pair
    conn.defer(Finish(handle=9, used=1))
    assert daemon.next_request(2.0) is not None
    t0 = time.monotonic()
    conn.close()
    assert time.monotonic() - t0 < CLOSE_WAIT + 0.5


def test_a_connection_that_does_not_wait_when_busy_lets_a_busy_deferred_request_lapse(
    tmp_path: Path,
) -> None:
    # an engine's connection: its next request is not held up behind a deferred finish turned away
    endpoint = f"ipc://{tmp_path}/d.sock"
    daemon = ScriptedDaemon(endpoint)
    conn = Connection(endpoint, timeout=3.0, retries=0, namespace=None, wait_when_busy=False)
    try:
        conn.defer(Finish(handle=5, used=2))
        first = daemon.next_request(2.0)
        assert first is not None
        peer, rid_a, _ = first
        t0 = time.monotonic()
        t, out = call_in_thread(conn, Finish(handle=6, used=0))
        daemon.answer(peer, rid_a, ErrorReply(code="busy", message="over the in-flight budget"))
        got = daemon.next_request(2.0)
        assert got is not None and got[2]["handle"] == 6  # B, not A sent again
        daemon.answer(got[0], got[1], FinishOk(released=True))
        t.join(5)
        assert out == [FinishOk(released=True)] and time.monotonic() - t0 < 1.0
        assert daemon.next_request(0.3) is None  # A lapses: never sent again
    finally:
        conn.close()
        daemon.close()
