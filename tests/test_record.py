"""The block record's msgpack form: what it decodes, and what it refuses as damage."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvstore.errors import FrameError, UnsupportedVersion
from kvstore.record import RECORD_VERSION, BlockRecord

RECORD = BlockRecord(
    key=b"k" * 32,
    parent=b"p" * 32,
    namespace="ab12cd34ab12cd34",
    position=7,
    tokens=b"\x01\x00\x00\x00" * 4,
    sessions=("conv-1",),
    created=1.25,
    last_access=9.5,
    extra={"origin": "put"},
)


def fields(**changes: Any) -> bytes:
    d = msgpack.unpackb(RECORD.pack(), raw=False)
    d.update(changes)
    return msgpack.packb(d, use_bin_type=True)


def test_a_record_round_trips() -> None:
    assert BlockRecord.unpack(RECORD.pack()) == RECORD
    assert BlockRecord.unpack(fields(x=None, c=3)) == BlockRecord(
        **{**RECORD.__dict__, "extra": {}, "created": 3.0}
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"k": 32},  # bytes(32): 32 zero bytes, a key of the right length
        {"p": "p" * 32},
        {"t": 8},
        {"ns": 12},
        {"i": "7"},
        {"i": True},
        {"i": 7.0},
        {"s": "conv-42"},  # one session tag per character
        {"s": ["conv-1", 3]},
        {"c": "1.25"},
        {"a": None},
        {"x": [1, 2]},
        {"v": RECORD_VERSION - 1},
    ],
    ids=repr,
)
def test_a_field_of_the_wrong_type_is_damage_not_converted(changes: dict[str, Any]) -> None:
    with pytest.raises(FrameError, match="does not decode"):
        BlockRecord.unpack(fields(**changes))


def test_a_record_of_a_later_version_is_not_understood_rather_than_damaged() -> None:
    # a later build's record (a rolling upgrade): the cluster leaves such a block for the hosts that read it
    with pytest.raises(UnsupportedVersion, match="this build reads version"):
        BlockRecord.unpack(fields(v=RECORD_VERSION + 1))
