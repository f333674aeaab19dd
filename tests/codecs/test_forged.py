"""Frames with a sound checksum that no encoder writes (another host's faulty writer, a forged value in
the cluster): each is refused with a FrameError, never decoded to inf, NaN or gigabytes."""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest
import torch
import zstandard

from kvstore.codecs import decode_frame, get_codec, read_header
from kvstore.codecs.frame import FLAG_ZSTD, pack
from kvstore.codecs.int4 import _group_shapes, _params_of_frame
from kvstore.errors import FrameError
from kvstore.layout import KVLayout


def block(dtype: torch.dtype = torch.float16, scale: float = 100.0) -> torch.Tensor:
    return (torch.randn(2, 2, 8, 2, 16, generator=torch.Generator().manual_seed(0)) * scale).to(dtype)


def payload_of(frame: Any) -> tuple[Any, bytearray]:
    h = read_header(frame)
    return h, bytearray(memoryview(frame)[h.payload_offset : h.frame_len])


def repacked(frame: Any, edit: Any) -> bytearray:
    """``frame`` with its payload changed by ``edit`` and a checksum that fits."""
    h, payload = payload_of(frame)
    edit(payload)
    return pack(h.codec_id, h.layout, h.params, [bytes(payload)])


def half(value: float, dtype: torch.dtype) -> bytes:
    return bytes(torch.tensor([value], dtype=dtype).view(torch.uint8).tolist())


GROUPS = 2 * 2 * 8 * 2  # fp8: one scale per (layer, K/V, token, head)


@pytest.mark.parametrize(
    ("dtype", "peak", "refused"),
    [(torch.float16, 65000.0, True), (torch.float32, 1e9, True), (torch.float16, 100.0, False)],
)
@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_an_fp8_nan_code_never_decodes_to_inf_or_nan(
    dtype: torch.dtype, peak: float, refused: bool, code: int
) -> None:
    # the batch decode refused E4M3's NaN; one frame's decode served it: 480 x scale (past the range
    # an encoder clamps to: inf in float16 next to its largest value), or NaN where the scale is so
    # large that the codes are cast (a float32 block). Elsewhere it is a finite value (a pass over the
    # codes to look for it would cost 7 % of every decode)
    x = block(torch.float32, 1.0)
    frame = get_codec("fp8", k_fix=0).encode((x / x.abs().max() * peak).to(dtype))

    def nan_code(p: bytearray) -> None:
        p[2 * GROUPS + 5] = code

    if refused:
        with pytest.raises(FrameError, match="NaN code"):
            decode_frame(repacked(frame, nan_code))
    else:
        assert bool(torch.isfinite(decode_frame(repacked(frame, nan_code))).all())


def test_an_fp8_scale_past_the_block_dtype_is_refused() -> None:
    frame = get_codec("fp8", k_fix=0).encode(block())

    def huge(p: bytearray) -> None:
        p[0:2] = half(1e6, torch.bfloat16)  # finite, positive: 448 x it is past float16's range

    with pytest.raises(FrameError, match="scale larger"):
        decode_frame(repacked(frame, huge))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_an_fp8_k_correction_scale_that_is_not_positive_and_finite_is_refused(value: float) -> None:
    frame = get_codec("fp8", k_fix=4).encode(block())

    def bad(p: bytearray) -> None:
        p[2 * GROUPS : 2 * GROUPS + 2] = half(value, torch.bfloat16)  # the first K correction's scale

    with pytest.raises(FrameError, match="K correction scale"):
        decode_frame(repacked(frame, bad))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("value", [1e30, -2.0])
def test_an_int8_scale_that_is_negative_or_decodes_past_the_dtype_is_refused(
    symmetric: bool, value: float
) -> None:
    frame = get_codec("int8", symmetric=symmetric).encode(block())

    def bad(p: bytearray) -> None:
        p[0:4] = struct.pack("<f", value)  # the first K scale (float32)

    with pytest.raises(FrameError, match="negative scale|past the range"):
        decode_frame(repacked(frame, bad))


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize(("at", "value"), [("centre", 65504.0), ("scale", 65504.0), ("scale", -3.0)])
def test_an_int4_group_that_is_negative_or_decodes_past_the_dtype_is_refused(
    rotate: bool, at: str, value: float
) -> None:
    frame = get_codec("int4", rotate=rotate).encode(block())
    h, _ = payload_of(frame)
    g, _ = _params_of_frame(h.params)
    layout = h.layout
    dims = [layout.num_layers, layout.block_tokens, layout.num_kv_heads, layout.head_dim]
    dim, size = next(iter(g.specs()))
    n = math.prod(_group_shapes(dims, dim, size)[1])  # K's groups: their centres, then their scales

    def bad(p: bytearray) -> None:
        offset = 0 if at == "centre" else n * layout.itemsize
        p[offset : offset + 2] = half(value, torch.float16)

    try:
        got = decode_frame(repacked(frame, bad))
    except FrameError as e:
        assert "negative scale" in str(e) or "past the range" in str(e)
        return
    # rotated back, one group's huge value spreads over the head: finite there, never inf
    assert rotate and value > 0 and bool(torch.isfinite(got).all())


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_blocks_at_the_edge_of_their_dtype_still_decode_finite(codec: str, dtype: torch.dtype) -> None:
    # the checks above must not refuse what an encoder writes next to the dtype's largest value
    x = block(torch.float32, 1.0)
    x = (x / x.abs().max() * torch.finfo(dtype).max * 0.999).to(dtype)
    frame = get_codec(codec).encode(x)
    got = decode_frame(frame)
    assert bool(torch.isfinite(got).all())


@pytest.mark.parametrize("content_size", [True, False])
def test_a_zstd_payload_that_inflates_past_any_block_is_refused_before_it_is_inflated(
    content_size: bool,
) -> None:
    # 64 MiB of zeros in a 2 KiB payload, for a block of 128 bytes: inflated whole before the size
    # check refused it (gigabytes asked of the daemon for a frame of a few megabytes)
    layout = KVLayout(1, 1, 16, "bfloat16", 4)
    bomb = zstandard.ZstdCompressor(level=3, write_content_size=content_size).compress(bytes(64 << 20))
    frame = pack(1, layout, {"shuffle": False}, [bomb], flags=FLAG_ZSTD)
    with pytest.raises(FrameError):
        decode_frame(frame, layout=layout)
