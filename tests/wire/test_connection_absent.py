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

import pytest

from kvstore.client import KVStoreClient
from kvstore.connection import ABSENT_AFTER, ABSENT_GRACE
from kvstore.wire.errors import RequestTimeout
from tests.daemon.conftest import Daemon
from tests.hardening.conftest import LAYOUT, MODEL, endpoint_of, write_config

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
