"""The self-describing frame every codec writes.

::

    offset size  field
       0     4   magic  b"KVSF"
       4     1   format version (1)
       5     1   codec id
       6     1   dtype code of the decoded block
       7     1   flags (bit 0: payload is zstd-compressed; any other bit: refused)
       8     2   num_layers          10  2  num_kv_heads       12  2  head_dim
      14     2   reserved (0; anything else: refused)
      16     4   tokens in the block
      20     4   params length P     24  8  payload length N
      32    16   layout fingerprint (KVLayout.fingerprint())
      48     4   CRC-32 of bytes [0, 48) + params + payload
      52    12   reserved (0)
      64     P   codec parameters (msgpack map)
    64+P     N   payload

A frame that is truncated, carries the wrong magic or version, fails its
checksum, or names another layout than the reader expects raises a specific
FrameError: a damaged block is never decoded into something plausible.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgpack

from kvstore.errors import (
    BadMagic,
    ChecksumMismatch,
    FrameError,
    LayoutMismatch,
    TruncatedFrame,
    UnsupportedVersion,
)
from kvstore.layout import KVLayout

try:  # ISA-L's crc32 is zlib's CRC-32 bit for bit, ~10x faster: checking a frame costs about a memcpy
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values, slower
    from zlib import crc32

MAGIC = b"KVSF"
VERSION = 1
HEADER = struct.Struct("<4sBBBBHHHHIIQ16sI12x")
HEADER_SIZE = HEADER.size
_CRC_AT = 48
_SIZES = struct.Struct("<4sB15xIQ16xI12s")  # magic, version, params length, payload length, CRC, reserved
_ZEROS = bytes(12)
_FIXED = struct.Struct("<BBBHHHHI16s")  # header bytes 5..19 and 32..47: what one layout and codec share
FLAG_ZSTD = 1
KNOWN_FLAGS = FLAG_ZSTD  # a frame with another bit set is refused (UnsupportedVersion)
DTYPE_CODES = {"float16": 1, "bfloat16": 2, "float32": 3}
_DTYPE_BY_CODE = {v: k for k, v in DTYPE_CODES.items()}
MAX_PARAMS = 4096

assert HEADER_SIZE == 64


@dataclass(frozen=True)
class FrameHeader:
    """The decoded fixed header of a frame (plus its parameters)."""

    codec_id: int
    flags: int
    layout: KVLayout
    params: dict[str, Any]
    payload_offset: int
    payload_len: int
    checksum: int

    @property
    def zstd(self) -> bool:
        return bool(self.flags & FLAG_ZSTD)

    @property
    def frame_len(self) -> int:
        return self.payload_offset + self.payload_len


Buffer = bytes | bytearray | memoryview


def pack(
    codec_id: int, layout: KVLayout, params: dict[str, Any], payload: Sequence[Buffer], *, flags: int = 0
) -> bytearray:
    """Assemble a frame from the payload's pieces (written back to back)."""
    if flags & ~KNOWN_FLAGS:
        raise ValueError(f"frame flags {flags:#04x}: only {KNOWN_FLAGS:#04x} are defined")
    p = msgpack.packb(params, use_bin_type=True)
    n = sum(memoryview(b).nbytes for b in payload)
    head = HEADER.pack(
        MAGIC,
        VERSION,
        codec_id,
        DTYPE_CODES[layout.dtype],
        flags,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        0,
        layout.block_tokens,
        len(p),
        n,
        layout.fingerprint(),
        0,
    )
    crc = crc32(head[:_CRC_AT])
    crc = crc32(p, crc)
    for b in payload:
        crc = crc32(b, crc)
    out = bytearray(HEADER_SIZE + len(p) + n)
    out[:HEADER_SIZE] = head
    struct.pack_into("<I", out, _CRC_AT, crc)
    pos = HEADER_SIZE
    out[pos : pos + len(p)] = p
    pos += len(p)
    for b in payload:
        m = memoryview(b).cast("B")
        out[pos : pos + m.nbytes] = m
        pos += m.nbytes
    return out


def read_header(frame: Buffer, *, expect: KVLayout | None = None, verify: bool = True) -> FrameHeader:
    """Parse and check a frame's header; with ``verify`` also its checksum.

    Raises TruncatedFrame, BadMagic, UnsupportedVersion, ChecksumMismatch or
    LayoutMismatch (when ``expect`` is given and differs).
    """
    mv = memoryview(frame).cast("B")
    plen, nlen, crc = _sizes(mv)
    end = HEADER_SIZE + plen + nlen
    if mv.nbytes < end:
        raise TruncatedFrame(f"frame of {mv.nbytes} bytes, header says {end}")
    if verify:
        _verify(mv, end, crc)
    return _header(mv, plen, nlen, crc, expect)


def read_split(head: Buffer, payload: Buffer, *, expect: KVLayout | None = None) -> FrameHeader | None:
    """The header of a frame that lies in two pieces: ``head`` (its header and parameters) and
    ``payload`` (received straight into where the block goes), its checksum checked over both.
    None when the frame does not end its head where ``head`` ends or its payload is not
    ``payload``'s length (the pieces were cut elsewhere: join them and read the whole frame).
    Raises what ``read_header`` raises for a damaged frame."""
    mv, data = memoryview(head).cast("B"), memoryview(payload).cast("B")
    try:
        plen, nlen, crc = _sizes(mv)
    except TruncatedFrame:  # cut inside the header or the parameters
        return None
    if mv.nbytes != HEADER_SIZE + plen or data.nbytes != nlen:
        return None
    got = crc32(data, crc32(mv[HEADER_SIZE:], crc32(mv[:_CRC_AT])))
    if got != crc:
        raise ChecksumMismatch(f"frame checksum {got:08x} does not match the stored {crc:08x}")
    return _header(mv, plen, nlen, crc, expect)


def _sizes(mv: memoryview) -> tuple[int, int, int]:
    """A frame header's parameter and payload lengths and CRC, the header's own checks made."""
    if mv.nbytes < HEADER_SIZE:
        raise TruncatedFrame(f"frame of {mv.nbytes} bytes is shorter than its {HEADER_SIZE}-byte header")
    magic, version, plen, nlen, crc, reserved = _SIZES.unpack_from(mv)
    if magic != MAGIC:
        raise BadMagic(f"not a kvstore frame (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise UnsupportedVersion(f"frame format version {version}; this build reads version {VERSION}")
    if plen > MAX_PARAMS or mv.nbytes < HEADER_SIZE + plen:
        raise TruncatedFrame(f"frame of {mv.nbytes} bytes, header says {HEADER_SIZE + plen + nlen}")
    if reserved != _ZEROS:  # reserved bytes sit outside the checksum: they must be 0
        raise ChecksumMismatch(
            f"frame header bytes {_CRC_AT + 4}..{HEADER_SIZE - 1} are reserved and not zero: "
            f"the frame was damaged"
        )
    return plen, nlen, crc


def _header(mv: memoryview, plen: int, nlen: int, crc: int, expect: KVLayout | None) -> FrameHeader:
    # Frames of one layout and codec share these bytes, so their checks and decode are done once
    # (the checksum above covers them; any damaged byte makes another cache key and a fresh parse).
    codec_id, flags, layout, params = _parse_fixed(
        bytes(mv[5:20]) + bytes(mv[32:_CRC_AT]), bytes(mv[HEADER_SIZE : HEADER_SIZE + plen])
    )
    if expect is not None and layout != expect:
        raise LayoutMismatch(
            f"frame holds a block of layout {layout.canonical().decode()}, "
            f"expected {expect.canonical().decode()}"
        )
    return FrameHeader(codec_id, flags, layout, dict(params), HEADER_SIZE + plen, nlen, crc)


def verify_checksum(frame: Buffer, header: FrameHeader) -> None:
    """The checksum check ``read_header(verify=True)`` makes, for a header read without it (a batch
    checks its frames while the device decodes them). Raises ChecksumMismatch."""
    _verify(memoryview(frame).cast("B"), header.frame_len, header.checksum)


def _verify(mv: memoryview, end: int, crc: int) -> None:
    got = crc32(mv[:_CRC_AT])
    got = crc32(mv[HEADER_SIZE:end], got)
    if got != crc:
        raise ChecksumMismatch(f"frame checksum {got:08x} does not match the stored {crc:08x}")


def stored_checksum(frame: Buffer) -> int | None:
    """The CRC-32 a frame's header records, unchecked (None when shorter than a header): what binds
    the frame to the nvme entry written with it."""
    mv = memoryview(frame).cast("B")
    return int.from_bytes(mv[_CRC_AT : _CRC_AT + 4], "little") if mv.nbytes >= HEADER_SIZE else None


def check_frame(frame: Buffer) -> FrameHeader:
    """The header of a whole, undamaged frame, before a tier stores it as it is: FrameError when
    the header or checksum fails or ``frame`` is longer or shorter than its header says."""
    header = read_header(frame)
    n = memoryview(frame).nbytes
    if n != header.frame_len:
        raise FrameError(f"frame is {n} bytes, its header says {header.frame_len}")
    return header


@lru_cache(maxsize=256)
def _parse_fixed(head: bytes, raw_params: bytes) -> tuple[int, int, KVLayout, dict[str, Any]]:
    """(codec id, flags, layout, params) from header bytes 5..19 and 32..47 and the params bytes.

    A pure function, cached: the params dict it returns is shared and must not be changed
    (read_header hands out copies)."""
    codec_id, dcode, flags, L, H, D, reserved, tokens, fp = _FIXED.unpack(head)
    if flags & ~KNOWN_FLAGS or reserved:  # a newer format's frame: its payload means something else
        raise UnsupportedVersion(
            f"frame sets flags {flags:#04x} and reserved field {reserved:#06x}; this build knows "
            f"flags {KNOWN_FLAGS:#04x} and a reserved field of 0"
        )
    if dcode not in _DTYPE_BY_CODE:
        raise ChecksumMismatch(f"frame names unknown dtype code {dcode}")
    try:
        layout = KVLayout(L, H, D, _DTYPE_BY_CODE[dcode], tokens)
    except ValueError as e:
        raise ChecksumMismatch(f"frame header holds an impossible layout: {e}") from e
    if layout.fingerprint() != bytes(fp):
        raise LayoutMismatch("frame's layout fingerprint does not match its own header")
    try:
        params = msgpack.unpackb(raw_params, raw=False) if raw_params else {}
    except Exception as e:  # msgpack raises several types for damaged input
        raise ChecksumMismatch(f"frame parameters do not decode: {e}") from e
    if not isinstance(params, dict):
        raise ChecksumMismatch("frame parameters are not a map")
    return codec_id, flags, layout, params
