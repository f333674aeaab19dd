"""Every registered codec (kvstore.codecs.CODECS) against the codec contract, by property.

A codec registered later is covered here without a change: lossless codecs must
round-trip bit for bit, lossy ones within their declared ``max_error`` times the
absmax of the value's (layer, K/V, head) slice, and any damage to a frame must
raise a FrameError instead of decoding.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.codecs import CODECS, decode_frame, read_header
from kvstore.errors import FrameError, TruncatedFrame
from kvstore.layout import KVLayout
from tests.codecs.codec_blocks import (
    blocks,
    codec_variants,
    make_codec,
    slice_absmax,
    structured_block,
    subnormal_unit,
    variant_id,
)

VARIANTS = codec_variants()
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_every_codec_is_registered_once_with_a_promise() -> None:
    # names and ids are unique; each lossy codec states how far it may stray
    assert len({c.codec_id for c in CODECS.values()}) == len(CODECS)
    assert {"raw", "fp8", "int8"} <= set(CODECS)
    for name, cls in CODECS.items():
        assert cls.name == name
        assert cls.lossless or (cls.max_error is not None and 0 < cls.max_error < 0.5), (
            f"codec {name} is lossy but declares no max_error (see Codec.max_error)"
        )


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@SETTINGS
@given(block=blocks())
def test_round_trip_within_the_promise(variant: tuple[str, dict], block: torch.Tensor) -> None:
    codec = make_codec(variant)
    frame = codec.encode(block)
    # the frame describes the block, and any reader decodes it without knowing the codec
    header = read_header(frame, expect=KVLayout.of_block(block))
    assert header.codec_id == codec.codec_id
    assert len(frame) <= codec.max_frame_bytes(header.layout)
    out = decode_frame(frame, layout=header.layout)
    assert out.shape == block.shape and out.dtype == block.dtype
    assert out.is_contiguous()
    if codec.lossless:
        assert torch.equal(out.view(torch.uint8), block.view(torch.uint8))
        return
    assert bool(torch.isfinite(out).all()), "a finite block never decodes to inf or NaN"
    # the codec's promise for this layout (max_error, but for int4 rotated: see Int4Codec.error_bound)
    promise = codec.error_bound(header.layout)
    assert promise is not None and promise >= (codec.max_error or 0)
    err = (out.double() - block.double()).abs()
    bound = promise * slice_absmax(block) + subnormal_unit(block.dtype)
    worst = float((err - bound).max())
    assert worst <= 0, f"{codec!r}: error exceeds error_bound x slice absmax by {worst}"


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_decoded_block_owns_its_memory(variant: tuple[str, dict]) -> None:
    # writing into the decoded block must not change the frame (a RAM tier decodes from its arena)
    codec = make_codec(variant)
    block = structured_block("normal", (2, 2, 4, 2, 8), torch.bfloat16, seed=1)
    frame = codec.encode(block)
    before = bytes(frame)
    out = codec.decode(frame)
    out.fill_(7)
    assert bytes(frame) == before
    assert not torch.equal(codec.decode(frame), out)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@SETTINGS
@given(data=st.data())
def test_any_single_bit_flip_is_detected(variant: tuple[str, dict], data: st.DataObject) -> None:
    codec = make_codec(variant)
    block = data.draw(blocks())
    frame = codec.encode(block)
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    # damage anywhere (header, checksum, reserved bytes, params, payload) is an error, never a block
    with pytest.raises(FrameError):
        codec.decode(frame)
    with pytest.raises(FrameError):
        decode_frame(frame)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@SETTINGS
@given(data=st.data())
def test_any_truncation_is_detected(variant: tuple[str, dict], data: st.DataObject) -> None:
    codec = make_codec(variant)
    frame = codec.encode(data.draw(blocks()))
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(TruncatedFrame):
        decode_frame(frame[:cut])


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_frame_of_another_layout_is_refused(variant: tuple[str, dict]) -> None:
    from kvstore.errors import LayoutMismatch

    codec = make_codec(variant)
    block = structured_block("normal", (2, 2, 4, 2, 8), torch.float16, seed=2)
    frame = codec.encode(block)
    other = KVLayout(2, 2, 8, "bfloat16", 4)  # same shape, other dtype
    with pytest.raises(LayoutMismatch):
        codec.decode(frame, layout=other)
    with pytest.raises(LayoutMismatch):
        decode_frame(frame, layout=KVLayout(2, 2, 8, "float16", 8))


@pytest.mark.parametrize("name", sorted(CODECS))
def test_non_finite_input_is_refused_or_kept(name: str) -> None:
    # lossless codecs keep inf/NaN bit for bit; lossy ones refuse them at encode (CodecError)
    from kvstore.errors import CodecError

    codec = make_codec((name, {}))
    for bad in (float("inf"), float("-inf"), float("nan")):
        block = structured_block("normal", (1, 2, 2, 1, 8), torch.bfloat16, seed=3)
        block[0, 1, 1, 0, 5] = bad
        if codec.lossless:
            out = codec.decode(codec.encode(block))
            assert torch.equal(out.view(torch.int16), block.view(torch.int16))
        else:
            with pytest.raises(CodecError):
                codec.encode(block)


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("stat", [float("nan"), float("inf")])
def test_a_frame_whose_scales_are_not_finite_is_refused_though_its_checksum_holds(
    name: str, stat: float
) -> None:
    # no encoder writes such a frame: a faulty writer on another host (the cluster tier) would, with
    # a checksum computed over it; decoded, the block would hold NaN or inf
    block = structured_block("normal", (2, 2, 4, 2, 8), torch.bfloat16, seed=3)
    codec = CODECS[name]()
    frame = codec.encode(block)
    h = read_header(frame)
    payload = torch.frombuffer(bytearray(frame), dtype=torch.uint8)[h.payload_offset :].clone()
    first = torch.tensor([stat], dtype=torch.float32 if name == "int8" else torch.bfloat16)
    payload[: first.element_size()] = first.view(torch.uint8)  # the frame's first scale or centre
    with pytest.raises(FrameError, match="not a (positive )?finite"):
        codec._decode(payload, KVLayout.of_block(block), h.params)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_decode_into_a_slice_of_a_longer_sequence(variant: tuple[str, dict]) -> None:
    # out= writes the block into a caller's (strided) view, same values as a plain decode;
    # a damaged frame leaves out untouched
    codec = make_codec(variant)
    block = structured_block("heavy", (2, 2, 4, 2, 8), torch.bfloat16, seed=4)
    frame = codec.encode(block)
    seq = torch.zeros(2, 2, 12, 2, 8, dtype=torch.bfloat16)
    got = codec.decode(frame, out=seq[:, :, 4:8])
    assert got.data_ptr() == seq[:, :, 4:8].data_ptr()
    assert torch.equal(seq[:, :, 4:8], codec.decode(frame))
    assert not seq[:, :, :4].any() and not seq[:, :, 8:].any()
    frame[-1] ^= 1
    before = seq.clone()
    with pytest.raises(FrameError):
        codec.decode(frame, out=seq[:, :, :4])
    assert torch.equal(seq, before)
