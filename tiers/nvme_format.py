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
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from kvstore.errors import FrameError, KVStoreError
from kvstore.record import BlockRecord

try:  # the same CRC-32 as zlib's, several times faster (see codecs/frame.py)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32


class RecordTooLarge(KVStoreError):
    """A record field is longer than the entry format can hold; nothing was written."""

    code = "tier_io"


HEAD = struct.Struct("<BBxxII")
FIXED = struct.Struct("<32sIddHHHxx")
ENTRY_FORMAT = 1
_HAS_RECORD = 1
_EMPTY_LIST = msgpack.packb([])
_MAX_PART = 0xFFFF
_ALL = struct.Struct(HEAD.format + FIXED.format.lstrip("<"))
_EMPTY_CRC = crc32(b"")
_META_AT = _ALL.size - 8  # the lengths N, S, E: with the namespace and sessions, what entries share
# HEAD + FIXED as one numpy record, to read the fixed part of many entries at once
_ALL_DTYPE = np.dtype(
    [
        ("fmt", "u1"),
        ("flags", "u1"),
        ("_r", "V2"),
        ("flen", "<u4"),
        ("crc", "<u4"),
        ("parent", "V32"),
        ("position", "<u4"),
        ("created", "<f8"),
        ("accessed", "<f8"),
        ("n", "<u2"),
        ("s", "<u2"),
        ("e", "<u2"),
        ("_r2", "V2"),
    ]
)
assert _ALL_DTYPE.itemsize == _ALL.size


class IndexColumns(NamedTuple):
    """The index part of a run of entries as columns, row i = the i-th good entry holding a record
    (see ``EntryDecoder.index_columns``); ``damaged`` lists the entries that failed their checks."""

    keys: list[bytes]
    parents: np.ndarray  # void32: each row's parent key (``bytes(parents[i])``)
    positions: np.ndarray  # uint32
    namespaces: list[str]
    sessions: list[tuple[str, ...]]
    created: np.ndarray  # float64
    last_access: np.ndarray  # float64
    damaged: list[tuple[bytes, FrameError]]


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
    for what, part in (("namespace id", ns), ("session tags", sessions), ("extra fields", extra)):
        if len(part) > _MAX_PART:  # its length is a 16-bit field
            raise RecordTooLarge(
                f"block {record.key.hex()[:16]}: its {what} take {len(part)} bytes, more than a record holds "
                f"({_MAX_PART})"
            )
    body = b"".join(
        (
            FIXED.pack(
                record.parent,
                record.position,
                record.created,
                record.last_access,
                len(ns),
                len(sessions),
                len(extra),
            ),
            ns,
            sessions,
            extra,
            record.tokens,
        )
    )
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
        self._shared: dict[bytes, tuple[str, tuple[str, ...]] | None] = {}  # index_columns: per meta bytes

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

    def index_columns(self, keys: Sequence[bytes], values: Sequence[bytes]) -> IndexColumns:
        """What ``index_entry`` gives of each (key, value), for a run of entries at once: the fixed
        fields are read as one numpy array, every entry's CRC is checked, and entries sharing a
        namespace and sessions share one decode. Entries without a record are left out; damaged
        ones are listed, with the FrameError ``index_entry`` would raise, and left out too."""
        n = len(values)
        damaged: list[tuple[bytes, FrameError]] = []
        lens = np.fromiter(map(len, values), dtype=np.int64, count=n)
        if n and int(lens.min()) < _ALL.size:  # entries without a record (or too short to hold one)
            for i in np.flatnonzero(lens < _ALL.size).tolist():
                try:
                    self._parse(keys[i], values[i])  # None (no record) or raises
                except FrameError as err:
                    damaged.append((keys[i], err))
            keep = np.flatnonzero(lens >= _ALL.size).tolist()
            keys, values, lens = [keys[i] for i in keep], [values[i] for i in keep], lens[keep]
        fixed = np.frombuffer(b"".join([v[: _ALL.size] for v in values]), dtype=_ALL_DTYPE)
        crcs = np.fromiter([crc32(v[HEAD.size :]) for v in values], dtype=np.uint32, count=len(values))
        meta_end = _ALL.size + fixed["n"].astype(np.int64) + fixed["s"]
        bad = (
            (fixed["fmt"] != ENTRY_FORMAT)
            | (crcs != fixed["crc"])
            | ((fixed["flags"] & _HAS_RECORD) == 0)
            | (lens < meta_end + fixed["e"])
        )
        metas = [v[_META_AT:end] for v, end in zip(values, meta_end.tolist(), strict=True)]
        shared = self._shared
        for m in set(metas).difference(shared):
            shared[m] = self._meta(m)
        pairs = [shared[m] for m in metas]
        bad |= np.fromiter([p is None for p in pairs], dtype=bool, count=len(pairs))
        if bad.any():
            for i in np.flatnonzero(bad).tolist():
                try:
                    self._parse(keys[i], values[i])
                except FrameError as e:
                    damaged.append((keys[i], e))
                else:  # fine by _parse, yet its lengths overrun it
                    damaged.append((keys[i], _damaged(keys[i], "holds lengths that overrun the entry")))
            good = np.flatnonzero(~bad)
            rows = good.tolist()
            keys, values, pairs, fixed = (
                [keys[i] for i in rows],
                [values[i] for i in rows],
                [pairs[i] for i in rows],
                fixed[good],
            )
        return IndexColumns(
            keys=list(keys),
            parents=fixed["parent"].copy(),
            positions=fixed["position"].copy(),
            namespaces=[p[0] for p in pairs],  # type: ignore[index]
            sessions=[p[1] for p in pairs],  # type: ignore[index]
            created=fixed["created"].copy(),
            last_access=fixed["accessed"].copy(),
            damaged=damaged,
        )

    def _meta(self, meta: bytes) -> tuple[str, tuple[str, ...]] | None:
        """(namespace, sessions) from an entry's bytes [_META_AT, end of sessions); None if they do not decode."""
        n, s = struct.unpack_from("<HH", meta)
        raw_ns, raw_s = meta[8 : 8 + n], meta[8 + n : 8 + n + s]
        ns = self._strings.get(raw_ns)
        if ns is None:
            ns = self._strings[raw_ns] = raw_ns.decode(errors="replace")
        sessions = self._sessions.get(raw_s)
        if sessions is None:
            try:
                sessions = tuple(str(x) for x in msgpack.unpackb(raw_s, raw=False))
            except Exception:  # msgpack raises many types; _parse words the error
                return None
            self._sessions[raw_s] = sessions
        return ns, sessions

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
        return BlockRecord(
            key=key,
            parent=parent,
            namespace=ns,
            position=position,
            tokens=tokens,
            sessions=sessions,
            created=created,
            last_access=accessed,
            extra=extra,
        )
