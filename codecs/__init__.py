"""Block codecs: ``get_codec(name, **params)`` and ``decode_frame(frame)``.

======  ===================================================  =================
name    what it keeps                                        bits per value
======  ===================================================  =================
raw     the block's own bytes (optional byte shuffle + zstd) 16 (bf16/fp16), 32
fp8     E4M3 with scales from the block itself               ~8
int8    8-bit integers with per-(token, head) scales         ~8
int4    KIVI-style 4-bit codes, two a byte                   ~4-5
======  ===================================================  =================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvstore.codecs.base import Codec, bytes_tensor
from kvstore.codecs.fp8 import Fp8Codec
from kvstore.codecs.frame import FrameHeader, check_frame, read_header, read_split, verify_checksum
from kvstore.codecs.int4 import Int4Codec
from kvstore.codecs.int8 import Int8Codec
from kvstore.codecs.raw import RawCodec
from kvstore.errors import CodecError, FrameError, UnsupportedVersion
from kvstore.layout import KVLayout

CODECS: dict[str, type[Codec]] = {c.name: c for c in (RawCodec, Fp8Codec, Int8Codec, Int4Codec)}


def register(cls: type[Codec]) -> type[Codec]:
    """Add a codec class to the registry (by its ``name`` and ``codec_id``)."""
    for other in CODECS.values():
        if other is not cls and (other.name == cls.name or other.codec_id == cls.codec_id):
            raise CodecError(f"codec {cls.name} (id {cls.codec_id}) clashes with {other.name}")
    CODECS[cls.name] = cls
    return cls


def get_codec(name: str, **params: Any) -> Codec:
    """A codec instance by name; unknown names or parameters raise CodecError."""
    cls = CODECS.get(name)
    if cls is None:
        raise CodecError(f"unknown codec {name!r}; available: {', '.join(sorted(CODECS))}")
    try:
        return cls(**params)
    except TypeError as e:
        raise CodecError(f"codec {name}: {e}") from e


def codec_for_frame(header: FrameHeader) -> type[Codec]:
    for cls in CODECS.values():
        if cls.codec_id == header.codec_id:
            return cls
    # a codec of a later build (this one is older): not understood, not damaged
    raise UnsupportedVersion(
        f"frame was written by codec id {header.codec_id}, which this build does not know"
    )


def decode_frame(
    frame: Any,
    *,
    layout: KVLayout | None = None,
    device: torch.device | str | None = None,
    out: torch.Tensor | None = None,
    codecs: Sequence[Codec] = (),
) -> torch.Tensor:
    """Decode any kvstore frame, whichever codec wrote it (its parameters travel in the frame).

    The one decode dispatch: the header is read and checked once, then the
    codec its id names decodes it; an instance among ``codecs`` with that id
    is used as it is (it may hold scratch state), else a default one (every
    parameter is read from the frame). ``layout``, ``device`` and ``out`` as
    in ``Codec.decode``. FrameError for any damage; ``out`` is unchanged then.
    """
    header = read_header(frame, expect=layout)
    codec = next((c for c in codecs if c.codec_id == header.codec_id), None)
    if codec is None:
        codec = codec_for_frame(header)()
    return codec._decode_checked(frame, header, device, out)


def decode_placed(head: Any, payload: Any, *, layout: KVLayout) -> bool:
    """A frame whose payload was received straight into ``payload`` (the bytes of a contiguous block of
    ``layout``, where the block goes) and whose header and parameters are ``head``: True when the
    frame is whole and sound and its payload is the block as it lies (``Codec.payload_is_block``),
    so ``payload`` holds the block now; False when the two pieces are not the frame cut at its
    payload, or the payload needs decoding (join them and ``decode_frame`` the whole). FrameError
    for a damaged frame."""
    header = read_split(head, payload, expect=layout)
    return header is not None and codec_for_frame(header).payload_is_block(header)


def decode_frames(
    frames: Sequence[Any], *, layout: KVLayout, device: torch.device | str, batch: bool | None = None
) -> tuple[torch.Tensor, int]:
    """The frames of consecutive blocks decoded into one new tensor ``[n, L, 2, T, H, D]`` on ``device``.

    Returns (blocks, good): ``good`` leading frames decoded; a damaged frame ends the run there and
    rows from it on are undefined. Frames of one codec and parameters, none zstd-packed, go to the
    codec's batch decoder where it has one for ``device`` (fp8 on a GPU: one set of kernels for them
    all, where one frame at a time costs a dozen launches and several waits on the device each);
    any other frame is decoded alone, as ``decode_frame`` does. ``batch``: whether to use a batch
    decoder; by default only off the CPU (there one block at a time, straight into its destination,
    is faster).
    """
    dev = torch.device(device)
    if batch is None:
        batch = dev.type != "cpu"
    out = torch.empty((len(frames), *layout.shape()), dtype=layout.torch_dtype, device=dev)
    if not frames:
        return out, 0
    # a batch's checksums are checked while the device copies and decodes its frames (the host's
    # CRC-32 of a 94 MB prefix's fp8 frames: 4.3 of a 13.8 ms get on an H200 host, before it did)
    defer = batch and len(frames) > 1
    headers: list[FrameHeader] = []
    for f in frames:
        try:
            headers.append(read_header(f, expect=layout, verify=not defer))
        except FrameError:
            if not headers:
                raise
            break
    first = headers[0]
    if (
        defer
        and len(headers) > 1
        and all(h.codec_id == first.codec_id and h.params == first.params and not h.zstd for h in headers)
    ):
        payloads = [
            bytes_tensor(memoryview(f).cast("B")[h.payload_offset : h.frame_len])
            for f, h in zip(frames, headers, strict=False)
        ]

        def sound() -> int:
            return _leading_sound(frames, headers)

        good = codec_for_frame(first)().decode_batch(payloads, layout, first.params, dev, out, sound)
        if good is not None:
            return out, good
    for i, (f, h) in enumerate(zip(frames, headers, strict=False)):
        try:
            if defer:
                verify_checksum(f, h)
            codec_for_frame(h)()._decode_checked(f, h, dev, out[i])
        except FrameError:
            if not i:
                raise
            return out, i
    return out, len(headers)


def _leading_sound(frames: Sequence[Any], headers: list[FrameHeader]) -> int:
    """How many of the leading frames pass their checksum; ChecksumMismatch when the first fails."""
    for i, (f, h) in enumerate(zip(frames, headers, strict=False)):
        try:
            verify_checksum(f, h)
        except FrameError:
            if not i:
                raise
            return i
    return len(headers)


__all__ = [
    "CODECS",
    "Codec",
    "FrameHeader",
    "check_frame",
    "decode_frame",
    "decode_placed",
    "decode_frames",
    "get_codec",
    "read_header",
    "register",
]
