"""The daemon's ZAP handler (ZeroMQ RFC 27): which CURVE keys may connect, and as which tenant.

libzmq asks every handshake of a CURVE server socket over ``inproc://zeromq.zap.01``
in the socket's context; this thread answers. A key of the allow-list gets
``200`` with its tenant as User-Id (every message on that connection then
carries it: ``peer_tenant``); any other key, or any other mechanism, gets
``400`` and the connection never carries a message. The router sets
ZAP_ENFORCE_DOMAIN (kvstore.daemon.auth.ServerAuth.secure), so while no handler
answers, handshakes fail rather than pass.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import zmq
from zmq.utils import z85

log = logging.getLogger("kvstore.daemon.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by libzmq (RFC 27)
POLL_MS = 100  # how soon the ZAP thread notices a stop
_DENIALS_LOGGED = 1024  # unknown keys reported at warning level; repeats (reconnects) go to debug


class ZapHandler:
    """Answers libzmq's ZAP requests for one context: known CURVE keys pass with their tenant as User-Id."""

    def __init__(self, allowed: Mapping[bytes, str]) -> None:
        self.allowed = dict(allowed)
        self.accepted = self.denied = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket | None = None
        self._reported: set[bytes] = set()
        self._reported_all = False  # _DENIALS_LOGGED keys reported: the rest go to debug

    def start(self, ctx: zmq.Context) -> None:
        """Bind the ZAP socket (before the router binds: no handshake may pass unchecked) and start answering."""
        sock = ctx.socket(zmq.REP)
        sock.linger = 0
        sock.bind(ZAP_ENDPOINT)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="kvstore-zap", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop answering (later handshakes fail: the router enforces the ZAP domain) and close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def decide(self, mechanism: bytes, credentials: list[bytes]) -> str | None:
        """The tenant a handshake authenticates as, or None to refuse it. No I/O."""
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            return None
        return self.allowed.get(z85.encode(credentials[0]))

    def _run(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while not self._stop.is_set():
            try:
                if not sock.poll(POLL_MS):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:  # the context is being torn down
                return
            if len(frames) < 6:
                continue  # not a ZAP request; a REP socket must still answer, but libzmq never sends these
            version, request_id, _domain, address, _identity, mechanism = frames[:6]
            tenant = self.decide(mechanism, frames[6:])
            if tenant is None:
                self.denied += 1
                self._report(mechanism, frames[6:], address)
                reply = [version, request_id, b"400", b"unknown CURVE key", b"", b""]
            else:
                self.accepted += 1
                reply = [version, request_id, b"200", b"OK", tenant.encode(), b""]
            try:
                sock.send_multipart(reply)
            except zmq.ZMQError:
                return

    def _report(self, mechanism: bytes, credentials: list[bytes], address: bytes) -> None:
        key = z85.encode(credentials[0]) if len(credentials) == 1 and len(credentials[0]) == 32 else mechanism
        if key not in self._reported and len(self._reported) >= _DENIALS_LOGGED and not self._reported_all:
            self._reported_all = True  # a flood of keys: the log is not its amplifier
            log.warning(
                "refused %d distinct CURVE keys; further refusals are logged at debug level only",
                _DENIALS_LOGGED,
            )
        level = logging.DEBUG if key in self._reported or self._reported_all else logging.WARNING
        if len(self._reported) < _DENIALS_LOGGED:
            self._reported.add(key)
        log.log(
            level,
            "refused a %s client from %s: key %s is not in curve_allowed_keys",
            mechanism.decode(errors="replace"),
            address.decode(errors="replace") or "?",
            key.decode(errors="replace"),
        )


def peer_tenant(frame: zmq.Frame) -> str | None:
    """The tenant the ZAP handler gave the connection ``frame`` came on; None if it carries no User-Id."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return user if isinstance(user, str) and user else None
