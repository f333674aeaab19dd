"""Header maps with bytes keys (a hand-written client's), and requests that break the daemon's loop:
each is answered with an error carrying the request's id, and the daemon serves on."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from kvstore.daemon.endpoint import probe
from kvstore.wire.errors import RemoteProtocolError
from kvstore.wire.protocol import PROTOCOL_VERSION, Limits, ServerProtocol
from tests.daemon.conftest import StartDaemon, start_daemon, write_config  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[2]


def packed(op: str, rid: int, extra: dict[str | bytes, object] | None = None) -> bytes:
    """A request's frame 0 with ``extra`` fields (their keys text or bytes)."""
    header: dict[str | bytes, object] = {"v": PROTOCOL_VERSION, "op": op, "id": rid}
    header.update(extra or {})
    return msgpack.packb(header, use_bin_type=True)


class Raw:
    """A bare DEALER socket: frames by hand."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)

    def ask(self, frame: bytes, timeout_ms: int = 10000) -> dict:
        self.sock.send_multipart([frame])
        assert self.sock.poll(timeout_ms), "no reply from the daemon"
        got = msgpack.unpackb(self.sock.recv_multipart()[0], raw=False)
        assert isinstance(got, dict)
        return got

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_unknown_text_and_bytes_keys_together_are_a_bad_header() -> None:
    proto = ServerProtocol(Limits())
    frame = msgpack.packb(
        {"v": PROTOCOL_VERSION, "op": "ping", "id": 5, "zz": 1, b"x": 2, b"\xff": 3}, use_bin_type=True
    )
    with pytest.raises(RemoteProtocolError) as err:
        proto.receive(b"peer", [frame])
    e = err.value
    assert (e.code, e.request_id) == ("bad_header", 5)
    assert "b'x'" in e.message and "'zz'" in e.message and "text keys" in e.message
    assert proto.inflight == {}  # nothing counted


def test_a_daemon_answers_a_header_with_a_bytes_key_and_serves_on(
    start_daemon: StartDaemon,  # noqa: F811 - the fixture imported above
) -> None:
    d = start_daemon()
    r = Raw(d.endpoint)
    try:
        reply = r.ask(packed("lookup", 41, {"ns": "x", "tokens": b"", "zz": 1, b"tokens": b""}))
        assert reply["op"] == "error" and reply["id"] == 41 and reply["code"] == "bad_header", reply
        assert "b'tokens'" in reply["message"], reply
        for rid in (42, 43):  # and again: the daemon is still there, and answers what follows
            again = r.ask(packed("ping", rid, {b"a": 1, "b": 2}))
            assert (again["op"], again["id"], again["code"]) == ("error", rid, "bad_header"), again
        pong = r.ask(packed("ping", 44))
        assert (pong["op"], pong["id"]) == ("ping", 44), pong
    finally:
        r.close()
    assert d.proc.poll() is None
    assert d.stop() == 0, d.output()[-3000:]


# A daemon whose request checks have a bug: what the loop's last guard answers.
BROKEN = """
import sys
from kvstore.daemon.process import main
from kvstore.wire.protocol import ServerProtocol

real = ServerProtocol.receive

def receive(self, peer, frames, **kw):
    if b"explode" in bytes(frames[0]):
        raise RuntimeError("a bug in the checks")
    request = real(self, peer, frames, **kw)
    if request.id >= 1000:  # counted in flight first
        raise RuntimeError("a bug after the count")
    return request

ServerProtocol.receive = receive
raise SystemExit(main(["--config", sys.argv[1]]))
"""


def test_a_request_that_breaks_the_loop_is_answered_with_its_id(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    endpoint = f"ipc://{tmp_path / 'run' / 'kv.sock'}"
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", BROKEN, str(cfg)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        ctx = zmq.Context()
        deadline = time.monotonic() + 90
        while probe(ctx, endpoint, timeout_ms=200) is None:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
            time.sleep(0.1)
        ctx.destroy(linger=0)
        r = Raw(endpoint)
        try:
            reply = r.ask(packed("ping", 77, {"explode": 1}))
            assert (reply["op"], reply["id"], reply["code"]) == ("error", 77, "internal"), reply
            assert "RuntimeError: a bug in the checks" in reply["message"], reply
            pong = r.ask(packed("ping", 78))
            assert (pong["op"], pong["id"]) == ("ping", 78), pong
            # more broken requests than a client may have in flight (64): none stays counted
            for rid in range(1000, 1100):
                reply = r.ask(packed("ping", rid))
                assert (reply["id"], reply["code"]) == (rid, "internal"), reply
            pong = r.ask(packed("ping", 79))
            assert (pong["op"], pong["id"]) == ("ping", 79), pong
        finally:
            r.close()
        assert proc.poll() is None
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, (tmp_path / "daemon.log").read_text()[-3000:]
        log.close()
