"""The records-db entry layout: round trips, shared strings, damage detected."""

from __future__ import annotations

import pytest

from kvstore.errors import FrameError
from kvstore.record import BlockRecord
from kvstore.tiers.nvme_format import (
    EntryDecoder,
    IndexEntry,
    frame_len,
    has_record,
    pack_entry,
    with_frame_len,
)

KEY = bytes(range(32))


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
    value = pack_entry(123456, rec)
    assert frame_len(value) == 123456 and has_record(value)
    assert EntryDecoder().record(KEY, value) == rec


def test_index_entry_holds_all_but_the_tokens() -> None:
    value = pack_entry(10, record())
    e = EntryDecoder().index_entry(KEY, value, nbytes=4096)
    assert e == IndexEntry(KEY, bytes(32), "ab12cd34ab12cd34", 7, ("conv-1", "conv-2"), 1.25, 9.5, 4096)


def test_entry_without_record() -> None:
    value = pack_entry(99, None)
    assert frame_len(value) == 99 and not has_record(value)
    assert EntryDecoder().record(KEY, value) is None
    assert EntryDecoder().index_entry(KEY, value, 1) is None


def test_new_frame_length_keeps_the_record() -> None:
    value = with_frame_len(pack_entry(10, record()), 20)
    assert frame_len(value) == 20 and EntryDecoder().record(KEY, value) == record()


def test_decoder_shares_namespace_and_session_objects() -> None:
    d = EntryDecoder()
    a = d.index_entry(KEY, pack_entry(1, record(position=1)), 1)
    b = d.index_entry(KEY, pack_entry(1, record(position=2)), 1)
    assert a is not None and b is not None
    assert a.namespace is b.namespace and a.sessions is b.sessions


@pytest.mark.parametrize("offset", [0, 8, 12, 50, 72, 80, -1])
def test_any_flipped_byte_is_detected(offset: int) -> None:
    value = bytearray(pack_entry(10, record()))
    value[offset] ^= 0x10
    with pytest.raises(FrameError):
        EntryDecoder().record(KEY, bytes(value))


def test_flipped_frame_length_is_not_covered_but_harmless() -> None:
    # the length only sizes accounting; the frame itself carries its own checksum
    value = bytearray(pack_entry(10, record()))
    value[4] ^= 0x01
    assert EntryDecoder().record(KEY, bytes(value)) == record()


@pytest.mark.parametrize("value", [b"", b"\x01", pack_entry(10, record())[:40], pack_entry(1, None) + b"x"])
def test_truncated_or_padded_entries_are_damaged(value: bytes) -> None:
    with pytest.raises(FrameError):
        EntryDecoder().record(KEY, value)
