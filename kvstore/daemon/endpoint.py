"""Claiming the daemon's endpoint safely before binding it.

An ``ipc://`` socket lives in a directory only the daemon's user may enter
(created 0700; refused when it exists with looser permissions or another
owner). A socket file already there is probed with a ping: a live daemon
means refusal (its socket is never unlinked); no answer means a stale file
left by a crash, which is removed. ``tcp://`` endpoints need CURVE keys unless
``allow_insecure_tcp`` says the network is trusted.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgpack
import zmq

from kvstore.errors import KVStoreError

PROBE_TIMEOUT_MS = 500


class EndpointInUse(KVStoreError):
    """Another daemon already serves the endpoint; this one must not start."""

    code = "endpoint_in_use"


class UnsafeEndpoint(KVStoreError):
    """The endpoint's directory or transport would let others reach the daemon."""

    code = "config"


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


def secure_dir(directory: Path) -> None:
    """Create ``directory`` 0700 if missing; raise UnsafeEndpoint unless it is ours and closed to others."""
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)  # mkdir's mode is filtered through the umask
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeEndpoint(
            f"{directory} is not a directory (a symlink or file?); point the endpoint elsewhere"
        )
    if st.st_uid != os.getuid():
        raise UnsafeEndpoint(
            f"socket directory {directory} belongs to uid {st.st_uid}, not to this user "
            f"({os.getuid()}); use a directory of your own"
        )
    if st.st_mode & 0o077:
        raise UnsafeEndpoint(
            f"socket directory {directory} has mode {oct(st.st_mode & 0o777)}; others could reach "
            f"the socket. Run: chmod 700 {directory}"
        )


def probe(ctx: zmq.Context, endpoint: str, timeout_ms: int = PROBE_TIMEOUT_MS) -> dict | None:
    """Ping ``endpoint``; the pong's fields when a daemon answers, else None. Sends nothing else."""
    from kvstore.wire.protocol import PROTOCOL_VERSION

    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(endpoint)
        sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "id": 1}))
        if not sock.poll(timeout_ms, zmq.POLLIN):
            return None
        reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
        return reply if isinstance(reply, dict) else {}
    except (zmq.ZMQError, ValueError):
        return None
    finally:
        sock.close()


def claim(ctx: zmq.Context, endpoint: str, *, insecure_tcp_ok: bool, curve: bool) -> None:
    """Make ``endpoint`` ready to bind, or raise (EndpointInUse, UnsafeEndpoint) saying why not."""
    path = ipc_path(endpoint)
    if path is None:
        if endpoint.startswith("tcp://") and not (curve or insecure_tcp_ok):
            raise UnsafeEndpoint(
                f"{endpoint} would accept anyone who can reach the port; set [server] "
                "curve_secret_key (see `kvstore keygen`) or allow_insecure_tcp = true "
                "on a trusted network"
            )
        return
    secure_dir(path.parent)
    if not (path.exists() or path.is_symlink()):
        return
    pong = probe(ctx, endpoint)
    if pong is not None:
        raise EndpointInUse(
            f"another kvstore daemon (pid {pong.get('pid', '?')}) already serves {endpoint}; "
            "stop it first or configure another [server] endpoint"
        )
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise UnsafeEndpoint(f"{path} exists and is not a socket; remove it or choose another endpoint")
    path.unlink()  # a stale socket: nothing answers on it
