"""The frame header: what read_header returns, and the specific error for each kind of damage."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from kvstore.codecs import decode_frame, decode_placed, get_codec, read_header
from kvstore.codecs.frame import HEADER_SIZE, MAGIC, MAX_PARAMS, VERSION, pack, read_split
from kvstore.errors import (
    BadMagic,
    ChecksumMismatch,
    FrameError,
    LayoutMismatch,
    TruncatedFrame,
    UnsupportedVersion,
)
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=4)


def reseal(frame: bytearray) -> bytearray:
    """Recompute the checksum after a deliberate edit, so a later check is the one that fires."""
    plen, nlen = struct.unpack_from("<IQ", frame, 20)
    crc = zlib.crc32(bytes(frame[:48]))
    crc = zlib.crc32(bytes(frame[HEADER_SIZE : HEADER_SIZE + plen + nlen]), crc)
    struct.pack_into("<I", frame, 48, crc)
    return frame


def test_header_fields_round_trip() -> None:
    payload = bytes(range(200))
    frame = pack(7, LAYOUT, {"answer": 42, "name": "x"}, [payload[:50], payload[50:]], flags=1)
    h = read_header(frame, expect=LAYOUT)
    # magic, version, codec, flags, layout, params and payload position all come back
    assert bytes(frame[:4]) == MAGIC and frame[4] == VERSION
    assert h.codec_id == 7 and h.flags == 1 and h.zstd
    assert h.layout == LAYOUT
    assert h.params == {"answer": 42, "name": "x"}
    assert h.payload_len == 200 and h.frame_len == len(frame)
    assert bytes(frame[h.payload_offset : h.frame_len]) == payload
    assert h.checksum == struct.unpack_from("<I", frame, 48)[0]


def test_header_reads_from_any_buffer_and_ignores_trailing_bytes() -> None:
    # a RAM-tier slot may be longer than its frame
    frame = pack(1, LAYOUT, {}, [b"abc"])
    for buf in (bytes(frame), memoryview(frame), bytearray(frame) + b"\0" * 100):
        h = read_header(buf)
        assert h.frame_len == len(frame) and h.params == {}


def test_short_frames_are_truncated() -> None:
    frame = pack(1, LAYOUT, {"a": 1}, [b"x" * 100])
    with pytest.raises(TruncatedFrame, match="shorter than its 64-byte header"):
        read_header(frame[: HEADER_SIZE - 1])
    with pytest.raises(TruncatedFrame, match="header says"):
        read_header(frame[:-1])
    with pytest.raises(TruncatedFrame):
        read_header(b"")


def test_wrong_magic_and_version() -> None:
    frame = pack(1, LAYOUT, {}, [b"x"])
    bad = bytearray(frame)
    bad[0:4] = b"KVSX"
    with pytest.raises(BadMagic):
        read_header(bad)
    newer = bytearray(frame)
    newer[4] = VERSION + 1
    with pytest.raises(UnsupportedVersion, match=f"version {VERSION + 1}"):
        read_header(reseal(newer))


def test_flags_and_fields_a_newer_format_would_set_are_refused() -> None:
    # a bit this build does not know may change what the payload means: never decoded as if unset
    frame = pack(get_codec("raw").codec_id, LAYOUT, {}, [bytes(LAYOUT.block_nbytes)])
    for offset, value in ((7, 0x02), (7, 0x81), (14, 1), (15, 0x80)):
        newer = bytearray(frame)
        newer[offset] |= value
        with pytest.raises(UnsupportedVersion, match="this build knows flags 0x01"):
            decode_frame(reseal(newer), layout=LAYOUT)
    with pytest.raises(ValueError, match="only 0x01 are defined"):
        pack(1, LAYOUT, {}, [b"x"], flags=2)


def test_checksum_covers_header_params_and_payload() -> None:
    frame = pack(1, LAYOUT, {"k": "v"}, [b"payload bytes"])
    for offset in (5, 16, 47, 48, HEADER_SIZE, len(frame) - 1):
        bad = bytearray(frame)
        bad[offset] ^= 0x10
        with pytest.raises(FrameError):
            read_header(bad)
    # the payload is covered: a flip there is a checksum mismatch, unless verification is off
    bad = bytearray(frame)
    bad[-1] ^= 1
    with pytest.raises(ChecksumMismatch):
        read_header(bad)
    assert read_header(bad, verify=False).payload_len == len(b"payload bytes")


def test_reserved_bytes_must_be_zero() -> None:
    frame = bytearray(pack(1, LAYOUT, {}, [b"x"]))
    frame[60] = 1  # outside the checksum, so checked on its own
    with pytest.raises(ChecksumMismatch, match="reserved"):
        read_header(frame)


def test_layout_checks() -> None:
    frame = pack(1, LAYOUT, {}, [b"x"])
    # a reader expecting another model's layout is told which layouts differ
    other = KVLayout(3, 2, 8, "bfloat16", 8)
    with pytest.raises(LayoutMismatch, match="T=8"):
        read_header(frame, expect=other)
    # a header whose fields disagree with its own fingerprint is refused even with a valid checksum
    forged = bytearray(frame)
    struct.pack_into("<H", forged, 8, 4)  # num_layers 3 -> 4
    with pytest.raises(LayoutMismatch, match="fingerprint"):
        read_header(reseal(forged))
    # an impossible layout or an unknown dtype code is damage, not a layout
    zero = bytearray(frame)
    struct.pack_into("<H", zero, 12, 0)
    with pytest.raises(ChecksumMismatch, match="impossible layout"):
        read_header(reseal(zero))
    dtype = bytearray(frame)
    dtype[6] = 99
    with pytest.raises(ChecksumMismatch, match="dtype code 99"):
        read_header(reseal(dtype))


def test_params_must_be_a_small_map() -> None:
    huge = bytearray(pack(1, LAYOUT, {}, [b"x"]))
    struct.pack_into("<I", huge, 20, MAX_PARAMS + 1)
    with pytest.raises(TruncatedFrame):
        read_header(huge)
    not_map = bytearray(pack(1, LAYOUT, [1, 2], [b"x"]))  # type: ignore[arg-type]
    with pytest.raises(ChecksumMismatch, match="not a map"):
        read_header(not_map)


def test_codec_ids_are_checked() -> None:
    block = torch.randn(LAYOUT.shape()).to(torch.bfloat16)
    frame = get_codec("fp8").encode(block)
    # a codec refuses another codec's frame; decode_frame picks the right one by id
    with pytest.raises(FrameError, match="codec id 2, not int8"):
        get_codec("int8").decode(frame)
    assert decode_frame(frame).shape == block.shape
    unknown = bytearray(frame)
    unknown[5] = 200
    with pytest.raises(UnsupportedVersion, match="codec id 200, which this build does not know"):
        decode_frame(reseal(unknown))  # a later build's codec: not understood (a FrameError still)


def _block() -> torch.Tensor:
    return torch.randn(LAYOUT.shape()).to(torch.bfloat16)


def _cut(frame: bytearray, at: int | None = None) -> tuple[bytes, bytearray]:
    """A frame in two pieces, as a value received straight into a block's place arrives: the piece
    before ``at`` (default: where a whole block's bytes from the end begin) and the rest."""
    at = len(frame) - LAYOUT.block_nbytes if at is None else at
    return bytes(frame[:at]), bytearray(frame[at:])


def test_a_raw_frame_received_in_place_is_checked_and_needs_no_decoding() -> None:
    block = _block()
    head, payload = _cut(get_codec("raw").encode(block))
    assert read_split(head, payload, expect=LAYOUT) is not None
    assert decode_placed(head, payload, layout=LAYOUT)
    placed = torch.frombuffer(payload, dtype=torch.bfloat16).view(LAYOUT.shape())
    assert torch.equal(placed, block)  # the payload is the block, byte for byte


@pytest.mark.parametrize("at", [-1, 1])
def test_a_damaged_piece_fails_the_checksum(at: int) -> None:
    head, payload = _cut(get_codec("raw").encode(_block()))
    if at < 0:
        payload[at] ^= 1  # the last byte of the block
    else:
        head = head[:-1] + bytes([head[-1] ^ 1])  # the parameters
    with pytest.raises(FrameError):
        decode_placed(head, payload, layout=LAYOUT)
    with pytest.raises(LayoutMismatch):  # a sound frame of another layout is refused too
        other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
        h, p = _cut(get_codec("raw").encode(torch.zeros(other.shape(), dtype=torch.float16)))
        decode_placed(h, p, layout=LAYOUT)


@pytest.mark.parametrize(
    ("codec", "params"),
    [("raw", {"shuffle": True}), ("raw", {"zstd": 1}), ("int8", {}), ("fp8", {})],
)
def test_a_frame_whose_payload_is_not_the_block_is_joined_and_decoded(codec: str, params: dict) -> None:
    block = _block()
    frame = get_codec(codec, **params).encode(block)
    for at in (len(frame) - LAYOUT.block_nbytes, HEADER_SIZE + 2, HEADER_SIZE - 5, len(frame) - 7):
        if not 0 < at < len(frame):
            continue
        head, payload = _cut(frame, at)
        # cut anywhere but at a whole block's payload: not placed (False), never an error
        assert not decode_placed(head, payload, layout=LAYOUT)
    whole = decode_frame(bytes(frame), layout=LAYOUT)
    assert torch.equal(whole, block) or codec != "raw"


def test_a_raw_frame_cut_elsewhere_is_not_placed() -> None:
    frame = get_codec("raw").encode(_block())
    for at in (HEADER_SIZE - 1, HEADER_SIZE + 1, len(frame) - LAYOUT.block_nbytes + 1):
        head, payload = _cut(frame, at)
        assert read_split(head, payload, expect=LAYOUT) is None
        assert not decode_placed(head, payload, layout=LAYOUT)
