"""A client of an ipc:// endpoint where no daemon listens: told so within seconds, not after its time-out
on every attempt; a daemon that comes up within the grace is waited for.

    no socket file           ── call ── 1 s ── looks: refused ... ABSENT_GRACE later: RequestTimeout
    a killed daemon's file   ── the same (a connect to it is refused)
    a daemon starting        ── call ── (file appears, it answers) ── the reply
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore import connection
from kvstore.client import KVStoreClient
from kvstore.connection import ABSENT_AFTER, ABSENT_GRACE, Connection
from kvstore.wire.errors import RequestTimeout
from kvstore.wire.messages import Finish, FinishOk
from tests.daemon.conftest import Daemon
from tests.hardening.conftest import LAYOUT, MODEL, endpoint_of, write_config
from tests.wire.test_connection_defer import ScriptedDaemon, call_in_thread

SOON = ABSENT_AFTER + ABSENT_GRACE + 2.0  # seconds: told well before one time-out of 60 s


def client(endpoint: str) -> KVStoreClient:
    return KVStoreClient(endpoint, model=MODEL, layout=LAYOUT, timeout=60, retries=3)


@pytest.mark.parametrize("socket_file", ["missing", "left by a killed daemon"])
def test_a_call_where_no_daemon_listens_says_so_within_seconds(tmp_path: Path, socket_file: str) -> None:
    path = tmp_path / "kv.sock"
    if socket_file != "missing":  # bound once, then its process gone: the file stays, nobody listens
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(path))
        s.close()
        assert path.exists()
    c = client(f"ipc://{path}")
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout, match="no kvstore daemon is running at"):
        c.lookup(list(range(64)))
    assert time.monotonic() - t0 < SOON
    c.close()


def test_a_daemon_that_comes_up_within_the_grace_is_waited_for(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    ep = endpoint_of(cfg)
    c = client(ep)
    started: list[Daemon] = []
    # the call goes first; the daemon starts a second later and binds within the grace
    later = threading.Timer(1.0, lambda: started.append(Daemon(cfg, ep)))
    later.start()
    try:
        assert c.lookup(list(range(64))).matched_blocks == 0
    finally:
        later.join()
        c.close()
        for d in started:
            d.proc.terminate()
            d.wait_exit()


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The looks sooner and the grace shorter, so that these stories take a second or two."""
    monkeypatch.setattr(connection, "ABSENT_AFTER", 0.2)
    monkeypatch.setattr(connection, "ABSENT_POLL", 0.05)
    monkeypatch.setattr(connection, "ABSENT_GRACE", 0.5)


@pytest.mark.parametrize("wait", ["at once", "late"])
def test_a_live_daemon_whose_socket_file_goes_away_is_still_waited_for(
    tmp_path: Path, quick: None, monkeypatch: pytest.MonkeyPatch, wait: str
) -> None:
    # a tmp cleaner removes the file while a reply is awaited: the connection is open, the reply comes;
    # "late": the call's thread begins its wait only after the file went (a busy machine)
    path = tmp_path / "d.sock"
    daemon = ScriptedDaemon(f"ipc://{path}")
    conn = Connection(f"ipc://{path}", timeout=10.0, retries=0, namespace=None)
    if wait == "late":
        recv = conn._recv

        def late(deadline: float) -> Any:
            while path.exists():
                time.sleep(0.01)
            return recv(deadline)

        monkeypatch.setattr(conn, "_recv", late)
    try:
        t, out = call_in_thread(conn, Finish(handle=1, used=0))
        got = daemon.next_request(2.0)
        assert got is not None
        path.unlink()
        time.sleep(1.5)  # three graces
        daemon.answer(got[0], got[1], FinishOk(released=True))
        t.join(5)
        assert out == [FinishOk(released=True)]
    finally:
        conn.close()
        daemon.close()


def test_a_request_nobody_answered_is_not_run_by_a_daemon_started_later(tmp_path: Path, quick: None) -> None:
    # told no daemon runs there, the operator starts one: the request queued on the old socket must
    # not reach it (an evict, a put: its answer would be dropped, its effect not)
    path = tmp_path / "d.sock"
    conn = Connection(f"ipc://{path}", timeout=10.0, retries=2, namespace=None)
    try:
        with pytest.raises(RequestTimeout, match="no kvstore daemon is running"):
            conn.call(Finish(handle=1, used=0), idempotent=False)
        daemon = ScriptedDaemon(f"ipc://{path}")
        try:
            t, out = call_in_thread(conn, Finish(handle=2, used=0))
            got = daemon.next_request(3.0)
            assert got is not None and got[2]["handle"] == 2  # the new one, not the one told about
            daemon.answer(got[0], got[1], FinishOk(released=False))
            t.join(5)
            assert out == [FinishOk(released=False)]
            assert daemon.next_request(0.3) is None
        finally:
            daemon.close()
    finally:
        conn.close()
