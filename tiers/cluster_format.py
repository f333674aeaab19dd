"""What the cluster tier writes and where it connects: block values, session records, seed nodes.

::

    block value      b"KVC1" | key (32) | record length (u32 LE) | record (msgpack) | frame
    session record   msgpack map {"v": 1, "name": ..., "ns", "keys", "tokens", "updated"}
    ClusterNodes     redis:// / rediss:// seed URLs, credentials, TLS files (never a password in a repr or log)

No I/O: tiers/cluster.py moves these to and from the cluster.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import msgpack

from kvstore.config import redact_url
from kvstore.errors import ConfigError, FrameError, UnsupportedVersion
from kvstore.record import BlockRecord

MAGIC = b"KVC1"
_HEAD = struct.Struct("<4s32sI")
SESSION_VERSION = 1


@dataclass(frozen=True)
class TlsFiles:
    """For ``rediss://`` nodes: the CA that signed the nodes' certificates (None: the system's), and
    this client's certificate and key when the nodes ask for one (``tls-auth-clients``)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def given(self) -> bool:
        return any((self.ca, self.cert, self.key))


@dataclass(frozen=True)
class ClusterNodes:
    """Seed nodes and credentials parsed from ``redis://`` / ``rediss://`` URLs (``valkey://`` alike)."""

    hosts: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None
    password: str | None = field(repr=False)
    tls_files: TlsFiles = field(default_factory=lambda: TlsFiles())

    @classmethod
    def parse(
        cls, urls: Sequence[str], username: str | None, password: str | None, tls: TlsFiles | None = None
    ) -> ClusterNodes:
        """ConfigError for a URL of another scheme, without a host, mixing TLS and plain nodes, or TLS
        files for plain nodes. Credentials in a URL are used when the config gives none."""
        hosts: list[tuple[str, int]] = []
        schemes = set()
        for url in urls:
            u = urlsplit(url.strip())
            if u.scheme not in ("redis", "rediss", "valkey", "valkeys") or not u.hostname:
                raise ConfigError(
                    f"[cluster] nodes: {redact_url(url)!r} is not a cluster node; expected "
                    "'redis://host:port' or 'rediss://host:port' (TLS)"
                )
            try:
                port = 6379 if u.port is None else u.port
                if port == 0:
                    raise ValueError("port 0")
            except ValueError:
                raise ConfigError(
                    f"[cluster] nodes: {redact_url(url)!r} has a port that is not a number 1-65535"
                ) from None
            schemes.add(u.scheme in ("rediss", "valkeys"))
            hosts.append((u.hostname, port))
            username = username or (unquote(u.username) if u.username else None)
            password = password or (unquote(u.password) if u.password else None)
        if len(schemes) > 1:
            raise ConfigError("[cluster] nodes: mix of TLS (rediss://) and plain (redis://) nodes")
        if not hosts:
            raise ConfigError("[cluster] nodes: give at least one seed node, like 'redis://cache-1:7000'")
        tls = tls or TlsFiles()
        if tls.given() and schemes != {True}:
            raise ConfigError("[cluster] tls_* files are for TLS nodes: write them as rediss://host:port")
        return cls(tuple(hosts), schemes == {True}, username, password, tls)

    def describe(self) -> str:
        """The nodes for logs: never the password."""
        scheme = "rediss" if self.tls else "redis"
        who = f"{self.username}@" if self.username else ""
        return ", ".join(f"{scheme}://{who}{h}:{p}" for h, p in self.hosts)


def pack_value(record: BlockRecord, frame: Any) -> bytes:
    """A block's value in the cluster: its key, its record, its frame."""
    rec = record.pack()
    return b"".join((_HEAD.pack(MAGIC, record.key, len(rec)), rec, memoryview(frame).cast("B")))


RECORD_READ = 4096  # bytes read first for a value's record alone (a record is about 4 bytes per token)


def record_span(head: bytes) -> int:
    """How many bytes from its start a value needs for its record (``record_of``), read from its first
    bytes ``head``; 0 when ``head`` is not the start of a block value."""
    if len(head) < _HEAD.size or head[:4] != MAGIC:
        return 0
    return int(_HEAD.size + _HEAD.unpack_from(head)[2])


def record_of(key: bytes, value: bytes) -> BlockRecord | None:
    """The record in ``value`` (a block value, or its first ``record_span`` bytes or more) if it is a
    well-formed value of block ``key``, else None."""
    try:
        magic, k, n = _HEAD.unpack_from(value)
        if magic != MAGIC or k != key:
            return None
        rec = BlockRecord.unpack(memoryview(value)[_HEAD.size : _HEAD.size + n])
    except (struct.error, FrameError):
        return None
    return rec if rec.key == key else None


def unpack_value(
    key: bytes, value: bytes | memoryview, namespace: str, parent: bytes | None
) -> tuple[BlockRecord, memoryview]:
    """The record and frame of ``value`` read under ``key``; FrameError unless the value names
    ``key``, its record names ``key``, ``namespace`` and ``parent`` (any parent: None). The frame
    is checked on decode."""
    if len(value) < _HEAD.size:
        raise FrameError(f"cluster value of block {key.hex()[:16]} is truncated ({len(value)} bytes)")
    magic, k, n = _HEAD.unpack_from(value)
    if magic != MAGIC:
        if magic[:3] == MAGIC[:3]:  # a later format's (KVC2, ...): not understood, not damaged
            raise UnsupportedVersion(f"cluster value of block {key.hex()[:16]} is in format {magic!r}")
        raise FrameError(f"cluster value of block {key.hex()[:16]} has no kvstore header")
    if k != key:
        raise FrameError(f"cluster value under {key.hex()[:16]} names block {k.hex()[:16]}")
    view = memoryview(value)
    if _HEAD.size + n > len(value):
        raise FrameError(f"cluster value of block {key.hex()[:16]} is truncated")
    rec = BlockRecord.unpack(view[_HEAD.size : _HEAD.size + n])
    if rec.key != key or rec.namespace != namespace or (parent is not None and rec.parent != parent):
        raise FrameError(f"cluster value of block {key.hex()[:16]} belongs to another prefix or namespace")
    return rec, view[_HEAD.size + n :]


def session_of(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        d = msgpack.unpackb(raw, raw=False)
    except Exception:  # noqa: BLE001 - a damaged value is no session
        return None
    return d if isinstance(d, dict) and d.get("v") == SESSION_VERSION else None
