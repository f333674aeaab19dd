"""The records-db entry layout: round trips, shared strings, damage detected."""

from __future__ import annotations

import struct
import zlib

import pytest

from kvstore.errors import FrameError
from kvstore.record import BlockRecord
from kvstore.tiers.nvme_format import (
    HEAD,
    EntryDecoder,
    IndexEntry,
    check_binding,
    frame_crc,
    frame_len,
    has_record,
    pack_entry,
    with_frame,
)

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
FCRC = 0x1234ABCD


def entry(rec: BlockRecord | None = None, flen: int = 100, key: bytes = KEY) -> bytes:
    return pack_entry(key, flen, FCRC, rec)


def format_1(value: bytes) -> bytes:
    """The same entry as the format before entries were bound to key and frame wrote it."""
    body = value[HEAD.size :]
    return struct.pack("<BBxxII", 1, value[1], frame_len(value), zlib.crc32(body)) + body


def a_frame(crc: int = FCRC, n: int = 100) -> bytes:
    """Bytes standing for a frame: only its length and its header's CRC (bytes 48..51) matter here."""
    frame = bytearray(n)
    frame[48:52] = crc.to_bytes(4, "little")
    return bytes(frame)


def record(**kw: object) -> BlockRecord:
    base: dict[str, object] = dict(
        key=KEY,
        parent=bytes(32),
        namespace="ab12cd34ab12cd34",
        position=7,
        tokens=bytes(range(64)),
        sessions=("conv-1", "conv-2"),
        created=1.25,
        last_access=9.5,
    )
    base.update(kw)
    return BlockRecord(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "rec",
    [
        record(),
        record(sessions=(), extra={"origin": "put", "n": 3}),
        record(tokens=b"", namespace="é-ns", sessions=("ünïcode",)),
    ],
)
def test_record_round_trips(rec: BlockRecord) -> None:
    value = pack_entry(KEY, 123456, FCRC, rec)
    assert frame_len(value) == 123456 and frame_crc(value) == FCRC and has_record(value)
    assert EntryDecoder().record(KEY, value) == rec


def test_index_entry_holds_all_but_the_tokens() -> None:
    value = entry(record())
    e = EntryDecoder().index_entry(KEY, value, nbytes=4096)
    assert e == IndexEntry(KEY, bytes(32), "ab12cd34ab12cd34", 7, ("conv-1", "conv-2"), 1.25, 9.5, 4096)


def test_entry_without_record() -> None:
    value = entry(None, 99)
    assert frame_len(value) == 99 and not has_record(value)
    assert EntryDecoder().record(KEY, value) is None
    assert EntryDecoder().index_entry(KEY, value, 1) is None


def test_a_new_frame_keeps_the_record() -> None:
    value = with_frame(KEY, entry(record()), 20, 77)
    assert frame_len(value) == 20 and frame_crc(value) == 77 and EntryDecoder().record(KEY, value) == record()


def test_decoder_shares_namespace_and_session_objects() -> None:
    d = EntryDecoder()
    a = d.index_entry(KEY, entry(record(position=1)), 1)
    b = d.index_entry(KEY, entry(record(position=2)), 1)
    assert a is not None and b is not None
    assert a.namespace is b.namespace and a.sessions is b.sessions


@pytest.mark.parametrize("offset", [0, 12, 16, 54, 76, 84, -1])
def test_any_flipped_byte_of_the_record_is_detected(offset: int) -> None:
    value = bytearray(entry(record()))
    value[offset] ^= 0x10
    with pytest.raises(FrameError):
        EntryDecoder().record(KEY, bytes(value))


@pytest.mark.parametrize("offset", [4, 8])
def test_a_flipped_frame_length_or_crc_fails_the_binding_to_the_frame(offset: int) -> None:
    # the entry's CRC does not cover them (a new frame keeps the record); the frame is their check
    value = bytearray(entry(record()))
    check_binding(KEY, bytes(value), a_frame())
    value[offset] ^= 0x01
    assert EntryDecoder().record(KEY, bytes(value)) == record()
    with pytest.raises(FrameError, match="not this block's"):
        check_binding(KEY, bytes(value), a_frame())


@pytest.mark.parametrize("rec", [record(), None])
def test_an_entry_under_another_key_fails_its_checksum(rec: BlockRecord | None) -> None:
    value = entry(rec if rec is None else record(key=OTHER), key=OTHER)
    with pytest.raises(FrameError, match="another key"):
        EntryDecoder().record(KEY, value)
    with pytest.raises(FrameError, match="another key"):
        check_binding(KEY, value, a_frame())
    assert EntryDecoder().index_columns([KEY], [value]).damaged[0][0] == KEY


def test_a_frame_of_the_same_length_but_another_crc_is_not_this_block_s() -> None:
    with pytest.raises(FrameError, match="not this block's"):
        check_binding(KEY, entry(record()), a_frame(crc=FCRC ^ 1))
    with pytest.raises(FrameError, match="missing"):
        check_binding(KEY, None, a_frame())


def test_format_1_entries_are_still_read_and_checked_by_length() -> None:
    old = format_1(entry(record()))
    assert frame_crc(old) is None
    assert EntryDecoder().record(KEY, old) == record()
    check_binding(KEY, old, a_frame(crc=12345))  # format 1 recorded no frame CRC
    with pytest.raises(FrameError, match="not this block's"):
        check_binding(KEY, old, a_frame(n=101))
    bare = format_1(entry(None))
    assert EntryDecoder().record(KEY, bare) is None


def test_a_new_frame_rewrites_a_format_1_entry_bound_and_a_damaged_one_stays_damaged() -> None:
    new = with_frame(KEY, format_1(entry(record())), 100, FCRC)
    assert new == entry(record())
    damaged = bytearray(format_1(entry(record())))
    damaged[60] ^= 0x01
    with pytest.raises(FrameError, match="checksum"):
        EntryDecoder().record(KEY, with_frame(KEY, bytes(damaged), 100, FCRC))


def test_index_columns_reads_both_formats_in_key_order() -> None:
    keys = [bytes([i]) * 32 for i in range(6)]
    values = [entry(record(key=k, position=i), key=k) for i, k in enumerate(keys)]
    for i in (1, 4):
        values[i] = format_1(values[i])
    values[2] = entry(None, key=keys[2])
    cols = EntryDecoder().index_columns(keys, values)
    assert cols.damaged == []
    assert cols.keys == [keys[i] for i in (0, 1, 3, 4, 5)]
    assert cols.positions.tolist() == [0, 1, 3, 4, 5]
    assert [bytes(p) for p in cols.parents] == [bytes(32)] * 5
    assert cols.namespaces == ["ab12cd34ab12cd34"] * 5


@pytest.mark.parametrize(
    "value", [b"", b"\x01", entry(record())[:40], entry(None) + b"x", format_1(entry(record()))[:40]]
)
def test_truncated_or_padded_entries_are_damaged(value: bytes) -> None:
    with pytest.raises(FrameError):
        EntryDecoder().record(KEY, value)
