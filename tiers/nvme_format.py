"""How a block's entry in the nvme tier's ``records`` database is laid out.

::

    offset size  field
       0     1   entry format (1)
       1     1   flags (bit 0: a record follows)
       2     2   reserved (0)
       4     4   frame length (the frame itself is in the blocks db)
       8     4   CRC-32 of bytes [12, end)
    -- record (only with flag bit 0) --
      12    32   parent key
      44     4   position
      48     8   created (float64)       56  8  last access (float64)
      64     2   namespace length N      66  2  sessions length S     68  2  extra length E
      70     2   reserved (0)
      72     N   namespace id (utf-8)
    72+N     S   sessions (msgpack list of str)
    ...      E   extra (msgpack map; 0 bytes when empty)
    ...          token ids (little-endian uint32), to the end

A fixed struct instead of the record's msgpack form: rebuilding the index
after a restart reads every entry, and a struct is parsed with one call,
without copying the token ids (index entries do not need them). Every entry
carries a CRC, so a damaged one is reported, never half-believed.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import msgpack

from kvstore.errors import FrameError
from kvstore.record import BlockRecord

try:  # the same CRC-32 as zlib's, several times faster (see codecs/frame.py)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32

HEAD = struct.Struct("<BBxxII")
FIXED = struct.Struct("<32sIddHHHxx")
ENTRY_FORMAT = 1
_HAS_RECORD = 1
_EMPTY_LIST = msgpack.packb([])
_ALL = struct.Struct(HEAD.format + FIXED.format.lstrip("<"))
_EMPTY_CRC = crc32(b"")


class IndexEntry(NamedTuple):
    """A record without its token ids: what rebuilding the index needs (see ``NvmeTier.iter_index``)."""

    key: bytes
    parent: bytes
    namespace: str
    position: int
    sessions: tuple[str, ...]
    created: float
    last_access: float
    nbytes: int


def pack_entry(frame_len: int, record: BlockRecord | None) -> bytes:
    """The records-db value of a block whose frame has ``frame_len`` bytes."""
    if record is None:
        return HEAD.pack(ENTRY_FORMAT, 0, frame_len, crc32(b""))
    ns = record.namespace.encode()
    sessions = msgpack.packb(list(record.sessions), use_bin_type=True)
    extra = msgpack.packb(record.extra, use_bin_type=True) if record.extra else b""
    body = b"".join((FIXED.pack(record.parent, record.position, record.created, record.last_access,
                                len(ns), len(sessions), len(extra)), ns, sessions, extra, record.tokens))
    return HEAD.pack(ENTRY_FORMAT, _HAS_RECORD, frame_len, crc32(body)) + body


def frame_len(value: bytes | memoryview) -> int:
    """The frame length an entry records (no checks: sizes only)."""
    return int(HEAD.unpack_from(value)[2])


def has_record(value: bytes | memoryview) -> bool:
    return bool(HEAD.unpack_from(value)[1] & _HAS_RECORD)


def with_frame_len(value: bytes | memoryview, new_len: int) -> bytes:
    """The same entry (same record) for a frame of ``new_len`` bytes (the CRC does not cover the length)."""
    fmt, flags, _, crc = HEAD.unpack_from(value)
    return HEAD.pack(fmt, flags, new_len, crc) + bytes(value[HEAD.size :])


def _damaged(key: bytes, why: str) -> FrameError:
    return FrameError(f"records entry of block {key.hex()[:16]}: {why}")


class EntryDecoder:
    """Decodes entries; namespace ids and session tuples are shared between entries (memory, speed).

    One decoder serves one pass (it caches what it has seen); it is not thread-safe.
    """

    def __init__(self) -> None:
        self._strings: dict[bytes, str] = {}
        self._sessions: dict[bytes, tuple[str, ...]] = {_EMPTY_LIST: ()}

    def _parse(self, key: bytes, value: bytes) -> tuple[Any, ...] | None:
        """(parent, position, created, accessed, ns, sessions, n, s, e), None without a record."""
        if len(value) < _ALL.size:
            fmt, flags, _, crc = HEAD.unpack_from(value) if len(value) >= HEAD.size else (0, 0, 0, 0)
            if fmt != ENTRY_FORMAT or flags & _HAS_RECORD or crc != _EMPTY_CRC or len(value) != HEAD.size:
                raise _damaged(key, f"{len(value)} bytes is no valid entry")
            return None
        fmt, flags, _, crc, parent, position, created, accessed, n, s, e = _ALL.unpack_from(value)
        if fmt != ENTRY_FORMAT:
            raise _damaged(key, f"entry format {fmt}; this build reads {ENTRY_FORMAT}")
        if crc32(memoryview(value)[HEAD.size :]) != crc:
            raise _damaged(key, "fails its checksum")
        if not flags & _HAS_RECORD:
            raise _damaged(key, "has record bytes but no record flag")
        at = _ALL.size
        raw_ns = value[at : at + n]
        ns = self._strings.get(raw_ns)
        if ns is None:
            ns = self._strings[raw_ns] = raw_ns.decode(errors="replace")
        raw_s = value[at + n : at + n + s]
        sessions = self._sessions.get(raw_s)
        if sessions is None:
            try:
                sessions = tuple(str(x) for x in msgpack.unpackb(raw_s, raw=False))
            except Exception as err:  # msgpack raises many types; the CRC passed, so this is a bug
                raise _damaged(key, f"sessions do not decode: {err}") from err
            self._sessions[raw_s] = sessions
        return parent, position, created, accessed, ns, sessions, n, s, e

    def index_entry(self, key: bytes, value: bytes, nbytes: int) -> IndexEntry | None:
        """The index part of an entry (None when it holds no record); FrameError when damaged."""
        p = self._parse(key, value)
        if p is None:
            return None
        return IndexEntry(key, p[0], p[4], p[1], p[5], p[2], p[3], nbytes)

    def record(self, key: bytes, value: bytes) -> BlockRecord | None:
        """The whole record (None when the entry holds none); FrameError when damaged."""
        p = self._parse(key, value)
        if p is None:
            return None
        parent, position, created, accessed, ns, sessions, n, s, e = p
        at = _ALL.size + n + s
        extra: dict[str, Any] = {}
        if e:
            try:
                extra = dict(msgpack.unpackb(value[at : at + e], raw=False))
            except Exception as err:
                raise _damaged(key, f"extra does not decode: {err}") from err
        tokens = bytes(value[at + e :])
        if len(tokens) % 4:
            raise _damaged(key, f"holds {len(tokens)} token bytes, not a multiple of 4")
        return BlockRecord(key=key, parent=parent, namespace=ns, position=position, tokens=tokens,
                           sessions=sessions, created=created, last_access=accessed, extra=extra)
