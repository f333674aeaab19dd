"""Connection.until / KVStoreClient.within: every call a thread makes inside ends by the caller's
deadline, whatever the time-outs, retries and waits on a busy daemon would take.

An engine hook has a budget for all of its calls (SGLang joins its storage threads for 10 s): a put
of many chunks is two round trips a chunk, each within the time-out, and a daemon slow in each
(answering, but late) ran a hook far past its budget.

    client ──► DelayingProxy (ROUTER; each reply held ``delay`` s) ──► a real daemon
"""

from __future__ import annotations

import contextlib
import heapq
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvstore.client import KVStoreClient
from kvstore.connection import Connection
from kvstore.wire.errors import DeadlinePassed, RequestTimeout, ServerError
from kvstore.wire.messages import Ping, Pong
from tests.hardening.conftest import (
    LAYOUT,
    RefusingDaemon,
    daemons,  # noqa: F401 - a fixture
    prefix_kv,
    random_tokens,
    wait_until,
    write_config,
)
from tests.wire.test_connection_defer import ScriptedDaemon


class DelayingProxy:
    """A ROUTER on ``endpoint`` passing each client's requests to ``upstream`` on a DEALER of that
    client's own (the daemon tells clients apart by their sockets), and each reply back ``delay``
    seconds after it came: a daemon that answers every request, late."""

    def __init__(self, endpoint: str, upstream: str, delay: float) -> None:
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.linger = 0
        self.front.bind(endpoint)
        self.upstream, self.delay = upstream, delay
        self.backs: dict[bytes, zmq.Socket] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        held: list[tuple[float, int, bytes, list[bytes]]] = []
        n = 0
        while not self._stop:
            wait = 50 if not held else max(0, min(50, int((held[0][0] - time.monotonic()) * 1000)))
            for sock, _ in poller.poll(wait):
                if sock is self.front:
                    peer, *frames = self.front.recv_multipart()
                    back = self.backs.get(peer)
                    if back is None:
                        back = self.backs[peer] = self.ctx.socket(zmq.DEALER)
                        back.linger = 0
                        back.connect(self.upstream)
                        poller.register(back, zmq.POLLIN)
                    back.send_multipart(frames)
                else:
                    peer = next(p for p, b in self.backs.items() if b is sock)
                    n += 1
                    heapq.heappush(held, (time.monotonic() + self.delay, n, peer, sock.recv_multipart()))
            while held and held[0][0] <= time.monotonic():
                _, _, peer, frames = heapq.heappop(held)
                self.front.send_multipart([peer, *frames])

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        for sock in [self.front, *self.backs.values()]:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def silent(tmp_path: Path) -> Iterator[ScriptedDaemon]:
    daemon = ScriptedDaemon(f"ipc://{tmp_path}/d.sock")
    yield daemon
    daemon.close()


def test_a_call_that_gets_no_reply_ends_at_the_deadline_not_after_its_retries(
    tmp_path: Path, silent: ScriptedDaemon
) -> None:
    conn = Connection(f"ipc://{tmp_path}/d.sock", timeout=2.0, retries=2, namespace=None)
    try:
        t0 = time.monotonic()
        with conn.until(t0 + 0.4), pytest.raises(DeadlinePassed, match="time ran out"):
            conn.call(Ping(), idempotent=True)
        assert 0.35 < time.monotonic() - t0 < 1.0  # not three 2 s time-outs
        cut = silent.next_request(0.1)
        assert cut is not None and silent.next_request(0.2) is None  # sent once, not again

        # the deadline was the block's, on this thread: the next call waits its own time-out, and
        # gets its own reply, not the late one of the call that was cut
        def answer_late() -> None:
            silent.answer(cut[0], cut[1], Pong(server="late", pid=1, time=0.0))
            asked = silent.next_request(2.0)
            assert asked is not None
            time.sleep(0.6)  # past where the deadline was
            silent.answer(asked[0], asked[1], Pong(server="own", pid=2, time=0.0))

        t = threading.Thread(target=answer_late, daemon=True)
        t.start()
        got = conn.call(Ping(), idempotent=True)
        t.join(5)
        assert isinstance(got, Pong) and got.server == "own"
    finally:
        conn.close()


def test_a_deadline_is_the_calling_thread_s_own(tmp_path: Path, silent: ScriptedDaemon) -> None:
    conn = Connection(f"ipc://{tmp_path}/d.sock", timeout=2.0, retries=0, namespace=None)
    try:
        with conn.until(time.monotonic() + 0.2):
            got: list[object] = []
            t = threading.Thread(target=lambda: got.append(conn.call(Ping(), idempotent=True)), daemon=True)
            t.start()  # another thread's call, made while this thread's deadline stands
            asked = silent.next_request(2.0)
            assert asked is not None
            time.sleep(0.5)  # past this thread's deadline
            silent.answer(asked[0], asked[1], Pong(server="own", pid=2, time=0.0))
            t.join(5)
        assert len(got) == 1 and isinstance(got[0], Pong)
    finally:
        conn.close()


def test_nested_deadlines_keep_the_earlier(tmp_path: Path, silent: ScriptedDaemon) -> None:
    conn = Connection(f"ipc://{tmp_path}/d.sock", timeout=2.0, retries=0, namespace=None)
    try:
        t0 = time.monotonic()
        with conn.until(t0 + 0.3), conn.until(t0 + 5.0), pytest.raises(RequestTimeout):
            conn.call(Ping(), idempotent=True)
        assert time.monotonic() - t0 < 0.8
    finally:
        conn.close()


def test_a_busy_daemon_is_waited_for_until_the_deadline_only(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/busy.sock"
    busy = RefusingDaemon(endpoint)
    conn = Connection(endpoint, timeout=3.0, retries=0, namespace=None, wait_when_busy=True)
    try:
        t0 = time.monotonic()
        with conn.until(t0 + 0.4), pytest.raises(ServerError, match="over the in-flight budget"):
            conn.call(Ping(), idempotent=True)
        assert 0.2 < time.monotonic() - t0 < 1.0 and busy.requests >= 3  # asked again meanwhile
    finally:
        conn.close()
        busy.close()


def test_a_put_of_many_chunks_to_a_slow_daemon_ends_within_the_callers_budget(
    tmp_path: Path,
    daemons: object,  # noqa: F811
) -> None:
    """Each reply comes 0.15 s late, well within the 1 s time-out; a put of 512 blocks in chunks of 32
    (a 64 KiB staging segment) is a reserve and a commit a chunk, 16 chunks: seconds, where the
    caller had 1 s."""
    cfg = write_config(
        tmp_path,
        server={"shm_staging": "1MiB", "shm_staging_per_client": "64KiB"},
        hbm={"device": "cpu", "capacity": "8MiB"},
        nvme={"enabled": False},
    )
    d = daemons(cfg)  # type: ignore[operator]
    proxy = DelayingProxy(f"ipc://{tmp_path}/slow.sock", d.endpoint, 0.15)
    c = KVStoreClient(f"ipc://{tmp_path}/slow.sock", model="m", layout=LAYOUT, timeout=1.0)
    try:
        c.ping()
        assert c.shared_memory  # through the proxy: the same host's daemon
        tokens = random_tokens(np.random.default_rng(3), 512)
        kv = prefix_kv(tokens)
        t0 = time.monotonic()
        with c.within(1.0), pytest.raises(RequestTimeout, match="time ran out"):
            c.put(tokens, kv)
        took = time.monotonic() - t0
        assert took < 1.5, took
        held = c.lookup(tokens).matched_blocks  # what was committed in time is stored, the rest not
        assert 0 < held < 512
        # without a deadline the same put runs to its end
        r = c.put(tokens, kv)
        assert r.stored + r.present == 512
    finally:
        c.close()
        proxy.close()


def test_a_call_waiting_behind_another_threads_call_on_the_same_client_ends_at_its_deadline(
    tmp_path: Path,
    daemons: object,  # noqa: F811
) -> None:
    """One client, two threads: a call made under a deadline waits for the client (one call at a time)
    no longer than its deadline, while the other thread's slow call runs on to its reply."""
    cfg = write_config(tmp_path, hbm={"device": "cpu", "capacity": "8MiB"}, nvme={"enabled": False})
    d = daemons(cfg)  # type: ignore[operator]
    proxy = DelayingProxy(f"ipc://{tmp_path}/slow.sock", d.endpoint, 1.2)
    c = KVStoreClient(f"ipc://{tmp_path}/slow.sock", model="m", layout=LAYOUT, timeout=5.0)
    try:
        c.ping()  # said hello (slowly)
        slow: list[object] = []
        t = threading.Thread(target=lambda: slow.append(c.ping()), daemon=True)
        t.start()
        time.sleep(0.2)  # the other thread holds the client, waiting for its reply
        t0 = time.monotonic()
        with c.within(0.3), pytest.raises(DeadlinePassed, match="another thread's call"):
            c.lookup([1, 2, 3])
        assert time.monotonic() - t0 < 0.8
        t.join(5)
        assert len(slow) == 1 and slow[0]["pid"] == d.proc.pid  # type: ignore[index]
        assert c.lookup([1, 2, 3]).matched_blocks == 0  # the client goes on
        with c.within(math.inf):  # a budget past what a lock's wait takes is no budget
            assert c.lookup([1, 2, 3]).matched_blocks == 0
    finally:
        c.close()
        proxy.close()


def test_a_send_that_cannot_leave_waits_by_the_deadline_not_the_time_out(tmp_path: Path) -> None:
    """A DEALER blocks on send once its queue to a peer that never takes it is full (a daemon never
    reached): that wait ends with the caller's deadline, not the connection's time-out."""
    conn = Connection(f"ipc://{tmp_path}/nobody.sock", timeout=10.0, retries=0, namespace=None)
    try:
        sock = conn._open()
        sent = 0
        with contextlib.suppress(zmq.Again):
            while sent < 100_000:
                sock.send(b"", flags=zmq.NOBLOCK)  # fill the queue to its high-water mark
                sent += 1
        assert 0 < sent < 100_000
        t0 = time.monotonic()
        with conn.until(t0 + 0.3):
            conn.notify(Ping())  # not sent, by the deadline
        assert 0.25 < time.monotonic() - t0 < 1.0
        assert conn.sock is sock and sock.sndtimeo == 10_000  # the option is the time-out's again
        t0 = time.monotonic()
        with conn.until(t0 + 0.3), pytest.raises(DeadlinePassed):
            conn.call(Ping(), idempotent=True, greet=False)
        assert time.monotonic() - t0 < 1.0  # not the 10 s time-out
        assert conn.sock is None  # the full queue went with its socket
    finally:
        conn.close()


@pytest.mark.parametrize("what", ["locate", "pin"])
def test_what_a_reply_that_came_after_its_caller_stopped_waiting_holds_is_given_back_when_it_comes(
    tmp_path: Path,
    what: str,
    daemons: object,  # noqa: F811
) -> None:
    """A same-host read's locate (blocks pinned, a lease) or a pin, cut by the caller's deadline
    after the daemon did it: the late reply's lease or pin is given back as it comes (here, during
    the client's next call), not held for the minute its lease runs."""
    cfg = write_config(
        tmp_path,
        hbm={"device": "cpu", "capacity": "8MiB"},
        nvme={"enabled": False},
        policy={"pin_lease": 60},
    )
    d = daemons(cfg)  # type: ignore[operator]
    proxy = DelayingProxy(f"ipc://{tmp_path}/slow.sock", d.endpoint, 0.5)
    c = KVStoreClient(f"ipc://{tmp_path}/slow.sock", model="m", layout=LAYOUT, timeout=5.0)
    direct = KVStoreClient(d.endpoint, model="m", layout=LAYOUT, timeout=5.0)

    def held() -> tuple[int, int]:
        st = direct.stats()
        return st["store"]["pinned"], st["server"]["shm"]["leases"]

    try:
        tokens = random_tokens(np.random.default_rng(5), 128)
        blocks = c.put(tokens, prefix_kv(tokens)).stored
        assert c.shared_memory and blocks > 0 and held() == (0, 0)
        with c.within(0.2), pytest.raises(DeadlinePassed):
            if what == "locate":
                c.get(tokens)
            else:
                c.pin(tokens)
        assert wait_until(lambda: held()[0] == blocks, 2)  # the daemon did it: all pinned
        c.ping()  # the late reply comes while this call waits: what it held is given back
        assert wait_until(lambda: held() == (0, 0), 2), held()  # not after the 60 s lease
        assert c.get(tokens).matched_blocks == blocks
    finally:
        direct.close()
        c.close()
        proxy.close()
