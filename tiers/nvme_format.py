"""How a block's entry in the nvme tier's ``records`` database is laid out.

::

    offset size  field
       0     1   entry format (2)
       1     1   flags (bit 0: a record follows)
       2     2   reserved (0)
       4     4   frame length (the frame itself is in the blocks db)
       8     4   the frame's own CRC-32 (its header's, bytes 48..51)
      12     4   CRC-32 of the block's key followed by bytes [16, end)
    -- record (only with flag bit 0) --
      16    32   parent key
      48     4   position
      52     8   created (float64)       60  8  last access (float64)
      68     2   namespace length N      70  2  sessions length S     72  2  extra length E
      74     2   reserved (0)
      76     N   namespace id (utf-8)
    76+N     S   sessions (msgpack list of str)
    ...      E   extra (msgpack map; 0 bytes when empty)
    ...          token ids (little-endian uint32), to the end

A fixed struct instead of the record's msgpack form: rebuilding the index
after a restart reads every entry, and a struct is parsed with one call,
without copying the token ids (index entries do not need them). Every entry
carries a CRC, so a damaged one is reported, never half-believed.

An entry is bound to its block twice (``check_binding``, on every get): its
CRC starts from the key, so an entry moved under another key fails it; and
it records the length and CRC of the frame written with it, so another
block's frame under the key (sound in itself) is caught even when both
frames have one length. Entry format 1 (a 12-byte head: no frame CRC, a CRC
of the record alone) is still read; such an entry is checked by its frame's
length only, and is rewritten in format 2 when its record next changes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from kvstore.codecs.frame import stored_checksum
from kvstore.errors import FrameError, KVStoreError
from kvstore.record import BlockRecord

try:  # the same CRC-32 as zlib's, several times faster (see codecs/frame.py)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32


class RecordTooLarge(KVStoreError):
    """A record field is longer than the entry format can hold; nothing was written."""

    code = "tier_io"


HEAD = struct.Struct("<BBxxIII")  # format, flags, frame length, frame CRC, entry CRC
FIXED = struct.Struct("<32sIddHHHxx")
ENTRY_FORMAT = 2
_V1 = 1  # the format before entries were bound to their key and frame
_HEAD_V1 = struct.Struct("<BBxxII")  # format, flags, frame length, record CRC
_HAS_RECORD = 1
_EMPTY_LIST = msgpack.packb([])
_MAX_PART = 0xFFFF
_ALL = struct.Struct(HEAD.format + FIXED.format.lstrip("<"))
_ALL_V1 = struct.Struct(_HEAD_V1.format + FIXED.format.lstrip("<"))
_LENGTH = struct.Struct("<I")  # the frame length, at offset 4 in both formats
_META_AT = _ALL.size - 8  # the lengths N, S, E: with the namespace and sessions, what entries share
# HEAD + FIXED as one numpy record, to read the fixed part of many entries at once
_ALL_DTYPE = np.dtype(
    [
        ("fmt", "u1"),
        ("flags", "u1"),
        ("_r", "V2"),
        ("flen", "<u4"),
        ("fcrc", "<u4"),
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
_FORMATS = {ENTRY_FORMAT: (HEAD, _ALL, 5), _V1: (_HEAD_V1, _ALL_V1, 4)}  # head, head + FIXED, head fields


def _entry_crc(key: bytes, value: bytes | memoryview, fmt: int = ENTRY_FORMAT) -> int:
    """The CRC an entry of format ``fmt`` must carry: format 2's starts from the key."""
    if fmt == _V1:
        return crc32(memoryview(value)[_HEAD_V1.size :])
    return crc32(memoryview(value)[HEAD.size :], crc32(key))


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


def pack_entry(key: bytes, frame_len: int, frame_crc: int, record: BlockRecord | None) -> bytes:
    """The records-db value of block ``key``, whose frame has ``frame_len`` bytes and header CRC
    ``frame_crc`` (``stored_checksum`` of the frame)."""
    if record is None:
        return HEAD.pack(ENTRY_FORMAT, 0, frame_len, frame_crc, crc32(key))
    if record.key != key:
        raise KVStoreError("the record's key differs from the key it is stored under")
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
    return HEAD.pack(ENTRY_FORMAT, _HAS_RECORD, frame_len, frame_crc, crc32(body, crc32(key))) + body


def frame_len(value: bytes | memoryview) -> int:
    """The frame length an entry records (no checks: sizes only; 0 for an entry too short to say)."""
    return int(_LENGTH.unpack_from(value, 4)[0]) if len(value) >= 8 else 0


def frame_crc(value: bytes | memoryview) -> int | None:
    """The frame CRC an entry records (no checks); None for a format-1 entry, which records none."""
    return int(HEAD.unpack_from(value)[3]) if len(value) >= HEAD.size and value[0] == ENTRY_FORMAT else None


def has_record(value: bytes | memoryview) -> bool:
    return len(value) > 1 and bool(value[1] & _HAS_RECORD)


def with_frame(key: bytes, value: bytes | memoryview, new_len: int, new_crc: int) -> bytes:
    """The same entry (same record) for a new frame of ``new_len`` bytes and header CRC ``new_crc``;
    the entry's CRC does not cover them. A format-1 entry comes back in format 2, its CRC started
    from the key only when the old one held: a damaged entry stays damaged."""
    if len(value) < HEAD.size and not (len(value) >= _HEAD_V1.size and value[0] == _V1):
        return pack_entry(key, new_len, new_crc, None)  # too short to hold a record: damaged, none kept
    if value[0] == _V1 and len(value) >= _HEAD_V1.size:
        fmt, flags, _, crc = _HEAD_V1.unpack_from(value)
        body = bytes(value[_HEAD_V1.size :])
        if _entry_crc(key, value, _V1) == crc:
            crc = crc32(body, crc32(key))
        return HEAD.pack(ENTRY_FORMAT, flags, new_len, new_crc, crc) + body
    fmt, flags, _, _, crc = HEAD.unpack_from(value)
    return HEAD.pack(fmt, flags, new_len, new_crc, crc) + bytes(value[HEAD.size :])


def check_binding(key: bytes, entry: bytes | memoryview | None, frame: bytes | memoryview) -> None:
    """FrameError unless ``entry`` (the records value under ``key``) was written under ``key`` with
    ``frame``: its CRC, started from the key, holds, and it records the frame's length and CRC.
    A format-1 entry is checked by the frame's length alone (it recorded nothing more)."""
    if entry is None or not len(entry):
        raise _damaged(key, "is missing, though a frame is stored")
    n = memoryview(frame).nbytes
    if entry[0] == _V1 and len(entry) >= _HEAD_V1.size:
        if frame_len(entry) != n:
            raise FrameError(
                f"the frame of block {key.hex()[:16]} is {n} bytes, its entry says {frame_len(entry)}: "
                "it is not this block's"
            )
        return
    if entry[0] != ENTRY_FORMAT or len(entry) < HEAD.size:
        raise _damaged(
            key, f"{len(entry)} bytes of format {entry[0] if len(entry) else None} is no valid entry"
        )
    _, _, flen, fcrc, crc = HEAD.unpack_from(entry)
    if _entry_crc(key, entry) != crc:
        raise _damaged(key, "fails its checksum: damaged, or written under another key")
    got = stored_checksum(frame)
    if flen != n or fcrc != got:
        raise FrameError(
            f"the frame of block {key.hex()[:16]} ({n} bytes, CRC {got if got is None else f'{got:08x}'}) "
            f"is not the one its entry records ({flen} bytes, CRC {fcrc:08x}): it is not this block's"
        )


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
        """(parent, position, created, accessed, ns, sessions, n, s, e, record start), None without a
        record; FrameError when damaged. Reads both entry formats."""
        fmt = value[0] if value else None
        if fmt not in _FORMATS:
            raise _damaged(
                key, f"{len(value)} bytes of entry format {fmt}; this build reads {_V1} and {ENTRY_FORMAT}"
            )
        head, whole, nh = _FORMATS[fmt]
        if len(value) < whole.size:
            if len(value) != head.size or value[1] & _HAS_RECORD:
                raise _damaged(key, f"{len(value)} bytes is no valid entry")
            if head.unpack_from(value)[-1] != _entry_crc(key, value, fmt):
                raise _damaged(key, "fails its checksum: damaged, or written under another key")
            return None
        fields = whole.unpack_from(value)
        flags, crc = fields[1], fields[nh - 1]  # the entry CRC: the head's last field
        parent, position, created, accessed, n, s, e = fields[nh:]
        if _entry_crc(key, value, fmt) != crc:
            raise _damaged(key, "fails its checksum: damaged, or written under another key")
        if not flags & _HAS_RECORD:
            raise _damaged(key, "has record bytes but no record flag")
        at = whole.size
        if len(value) < at + n + s + e:
            raise _damaged(key, "holds lengths that overrun the entry")
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
        return parent, position, created, accessed, ns, sessions, n, s, e, at

    def index_columns(self, keys: Sequence[bytes], values: Sequence[bytes]) -> IndexColumns:
        """What ``index_entry`` gives of each (key, value), for a run of entries at once, in their
        order: the fixed fields are read as one numpy array, every entry's CRC is checked, and
        entries sharing a namespace and sessions share one decode. Entries without a record are
        left out; damaged ones are listed, with the FrameError ``index_entry`` would raise, and
        left out too. Format-1 entries are parsed one by one."""
        n = len(values)
        damaged: list[tuple[bytes, FrameError]] = []
        legacy: list[tuple[int, tuple[Any, ...]]] = []  # (row, _parse's tuple) of sound format-1 entries

        def one_by_one(i: int) -> None:
            try:
                p = self._parse(keys[i], values[i])
            except FrameError as err:
                damaged.append((keys[i], err))
                return
            if p is not None:
                legacy.append((i, p))

        lens = np.fromiter(map(len, values), dtype=np.int64, count=n)
        short = lens < _ALL.size  # entries without a record, or too short to hold one in format 2
        for i in np.flatnonzero(short).tolist():
            one_by_one(i)
        rows = np.flatnonzero(~short)
        vals = [values[i] for i in rows.tolist()]
        lens = lens[rows]
        fixed = np.frombuffer(b"".join([v[: _ALL.size] for v in vals]), dtype=_ALL_DTYPE)
        crcs = np.fromiter(
            [crc32(v[HEAD.size :], crc32(keys[i])) for i, v in zip(rows.tolist(), vals, strict=True)],
            dtype=np.uint32,
            count=len(vals),
        )
        meta_end = _ALL.size + fixed["n"].astype(np.int64) + fixed["s"]
        bad = (
            (fixed["fmt"] != ENTRY_FORMAT)
            | (crcs != fixed["crc"])
            | ((fixed["flags"] & _HAS_RECORD) == 0)
            | (lens < meta_end + fixed["e"])
        )
        metas = [v[_META_AT:end] for v, end in zip(vals, meta_end.tolist(), strict=True)]
        shared = self._shared
        for m in set(metas).difference(shared):
            shared[m] = self._meta(m)
        pairs = [shared[m] for m in metas]
        bad |= np.fromiter([p is None for p in pairs], dtype=bool, count=len(pairs))
        if bad.any():
            for j in np.flatnonzero(bad).tolist():
                one_by_one(int(rows[j]))
            good = np.flatnonzero(~bad)
            rows, fixed, pairs = rows[good], fixed[good], [pairs[j] for j in good.tolist()]
        parents, positions = fixed["parent"].copy(), fixed["position"].copy()
        created, accessed = fixed["created"].copy(), fixed["accessed"].copy()
        namespaces = [p[0] for p in pairs]  # type: ignore[index]
        sessions = [p[1] for p in pairs]  # type: ignore[index]
        if legacy:  # merged back into key order
            order = np.argsort(np.concatenate([rows, np.array([i for i, _ in legacy], dtype=rows.dtype)]))
            rows = np.concatenate([rows, np.array([i for i, _ in legacy], dtype=rows.dtype)])[order]
            parents = np.concatenate(
                [parents, np.frombuffer(b"".join(p[0] for _, p in legacy), dtype=parents.dtype)]
            )[order]
            positions = np.concatenate([positions, np.array([p[1] for _, p in legacy], dtype=np.uint32)])[
                order
            ]
            created = np.concatenate([created, np.array([p[2] for _, p in legacy], dtype=np.float64)])[order]
            accessed = np.concatenate([accessed, np.array([p[3] for _, p in legacy], dtype=np.float64)])[
                order
            ]
            all_ns, all_sessions = (
                namespaces + [p[4] for _, p in legacy],
                sessions + [p[5] for _, p in legacy],
            )
            namespaces = [all_ns[j] for j in order.tolist()]
            sessions = [all_sessions[j] for j in order.tolist()]
        return IndexColumns(
            keys=[keys[i] for i in rows.tolist()],
            parents=parents,
            positions=positions,
            namespaces=namespaces,
            sessions=sessions,
            created=created,
            last_access=accessed,
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
        parent, position, created, accessed, ns, sessions, n, s, e, start = p
        at = start + n + s
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
