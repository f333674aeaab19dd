"""Claiming the daemon's endpoint safely before binding it, and letting go of it.

An endpoint belongs to the daemon holding an exclusive ``flock`` on its lock
file, taken first thing at start (before the pools are allocated and the
index rebuilt, which take seconds) and held until the process ends::

    ipc:///run/user/1000/kvstore/kv.sock   ->  /run/user/1000/kvstore/kv.sock.lock
    tcp://0.0.0.0:5555                     ->  <runtime dir>/tcp-0.0.0.0-5555.lock
    tcp://host:0, tcp://host:*, inproc://  ->  none (an ephemeral port or an in-process name)

A second daemon on the endpoint fails to take it and refuses to start, naming
the pid written in the file. The kernel drops a lock when its holder dies, so
a crash never leaves the endpoint claimed; the lock file itself stays (removing
it would let two daemons lock two different files of the same name).

An ``ipc://`` socket lives in a directory only the daemon's user may enter
(created 0700; refused when it exists with looser permissions or another
owner). A socket file found by the lock's holder is probed with a ping (a
daemon of an older version, which takes no lock, means refusal); no answer
means a stale file left by a crash, which is removed. At stop a daemon
removes the socket file only if it is still the one it bound (same device
and inode). ``tcp://`` endpoints need CURVE keys unless ``allow_insecure_tcp``
says the network is trusted.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import msgpack
import zmq

from kvstore import pidlock
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


def lock_path(endpoint: str, run_dir: Path) -> Path | None:
    """The lock file that stands for ``endpoint`` (see the module's table); None when none is needed."""
    path = ipc_path(endpoint)
    if path is not None:
        return path.with_name(path.name + ".lock")
    m = re.fullmatch(r"tcp://(.+):(\d+)", endpoint)
    if m is None or m.group(2) == "0":
        return None
    return run_dir / f"tcp-{re.sub(r'[^A-Za-z0-9.-]', '_', m.group(1))}-{m.group(2)}.lock"


@dataclass
class EndpointLock:
    """The exclusive lock on an endpoint; the endpoint is this process's until ``release``."""

    endpoint: str
    path: Path
    fd: int

    def release(self) -> None:
        """Let another daemon take the endpoint (the lock file stays: see the module docstring)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock(endpoint: str, run_dir: Path) -> EndpointLock | None:
    """Take ``endpoint``'s lock without waiting, and write this pid into its file.

    Raises EndpointInUse (naming the holder's pid) when another process holds
    it, UnsafeEndpoint when its directory is not private. Returns None for an
    endpoint that needs no lock.
    """
    path = lock_path(endpoint, run_dir)
    if path is None:
        return None
    secure_dir(path.parent)
    try:
        fd = pidlock.take(path, follow_symlinks=False)
    except pidlock.LockHeld as e:
        raise EndpointInUse(
            f"another kvstore daemon (pid {e.holder}) already serves {endpoint} (it holds {path}); "
            "stop it first or configure another [server] endpoint"
        ) from None
    return EndpointLock(endpoint, path, fd)


def socket_identity(path: Path) -> tuple[int, int]:
    """(device, inode) of the socket file just bound, to recognise it at stop."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def remove_socket(path: Path, identity: tuple[int, int] | None) -> bool:
    """Unlink ``path`` if it is still the file with ``identity``; True when it was removed.

    A file of another identity belongs to whoever bound it since (never expected
    while the lock is held, but then it is theirs to remove).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if identity is None or (st.st_dev, st.st_ino) != identity:
        return False
    path.unlink(missing_ok=True)
    return True


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
        # a folder others use too (/tmp, a home): not to be closed to them; one of the socket's own
        # is created 0700 by the daemon
        raise UnsafeEndpoint(
            f"socket directory {directory} has mode {oct(st.st_mode & 0o7777)}: others could reach "
            f"the socket. Give the socket a folder of its own, which the daemon creates 0700 (e.g. "
            f"ipc://{directory / 'kvstore'}/kvstore.sock), or close this folder to others if it is "
            f"the socket's alone (chmod 700 {directory})"
        )


def probe(ctx: zmq.Context, endpoint: str, timeout_ms: int = PROBE_TIMEOUT_MS) -> dict | None:
    """Ping ``endpoint``; the reply's fields when a daemon answers, else None. Sends nothing else.

    A daemon still starting (error reply ``starting``) counts as no answer yet: callers
    waiting for a daemon to serve go on waiting.
    """
    from kvstore.wire.protocol import PROTOCOL_VERSION

    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(endpoint)
        sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "ping", "id": 1}))
        if not sock.poll(timeout_ms, zmq.POLLIN):
            return None
        reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
        if isinstance(reply, dict) and reply.get("code") == "starting":
            return None
        return reply if isinstance(reply, dict) else {}
    except (zmq.ZMQError, ValueError):
        return None
    finally:
        sock.close()


def claim(
    ctx: zmq.Context, endpoint: str, *, insecure_tcp_ok: bool, curve: bool, run_dir: Path
) -> EndpointLock | None:
    """Lock ``endpoint`` and make it ready to bind, or raise (EndpointInUse, UnsafeEndpoint) saying why not.

    Quick (no pool, no index): call it before any slow start-up work. The
    returned lock (None for an endpoint that needs none) must be held, and
    released only after the socket is closed and its file removed.
    """
    path = ipc_path(endpoint)
    if path is None and endpoint.startswith("tcp://") and not (curve or insecure_tcp_ok):
        raise UnsafeEndpoint(
            f"{endpoint} would accept anyone who can reach the port; set [server] "
            "curve_secret_key (see `kvstore keygen`) or allow_insecure_tcp = true "
            "on a trusted network"
        )
    held = lock(endpoint, run_dir)
    if path is None or not (path.exists() or path.is_symlink()):
        return held
    try:
        pong = probe(ctx, endpoint)  # a daemon of a version that takes no lock may serve it
        if pong is not None:
            raise EndpointInUse(
                f"another kvstore daemon (pid {pong.get('pid', '?')}) already serves {endpoint}; "
                "stop it first or configure another [server] endpoint"
            )
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise UnsafeEndpoint(f"{path} exists and is not a socket; remove it or choose another endpoint")
        path.unlink()  # a stale socket: nothing answers on it
    except BaseException:
        if held is not None:
            held.release()
        raise
    return held
