"""decode_frames: a run of consecutive blocks' frames decoded at once, as each decodes alone."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs import decode_frame, decode_frames, get_codec, read_header
from kvstore.codecs import frame as framing
from kvstore.errors import FrameError
from kvstore.layout import KVLayout
from tests.codecs.codec_blocks import DTYPES, structured_block

SHAPE = (3, 2, 64, 3, 64)
KINDS = ["normal", "heavy", "wide", "huge", "constant"]


def blocks_of(dtype: torch.dtype) -> list[torch.Tensor]:
    return [structured_block(kind, SHAPE, dtype, seed=i) for i, kind in enumerate(KINDS)]


def forged(frame: bytearray, payload: bytes) -> bytearray:
    """``frame`` with another payload and a checksum that fits it: damage only a decoder can see."""
    h = read_header(frame)
    return framing.pack(h.codec_id, h.layout, h.params, [payload])


@pytest.mark.parametrize("k_fix", [8, 0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_of_fp8_frames_decodes_bit_for_bit_as_each_frame_alone(
    dtype: torch.dtype, k_fix: int
) -> None:
    codec = get_codec("fp8", k_fix=k_fix)
    frames = [codec.encode(b) for b in blocks_of(dtype)]
    blocks, good = decode_frames(
        frames, layout=KVLayout.of_block(blocks_of(dtype)[0]), device="cpu", batch=True
    )
    assert good == len(frames) and blocks.dtype == dtype
    for i, f in enumerate(frames):
        assert torch.equal(blocks[i], decode_frame(f)), i


def test_frames_of_several_codecs_are_decoded_one_by_one() -> None:
    blocks = blocks_of(torch.bfloat16)[:3]
    frames = [get_codec(name).encode(b) for name, b in zip(["fp8", "int8", "raw"], blocks, strict=True)]
    got, good = decode_frames(frames, layout=KVLayout.of_block(blocks[0]), device="cpu", batch=True)
    assert good == 3
    for i, f in enumerate(frames):
        assert torch.equal(got[i], decode_frame(f))


@pytest.mark.parametrize("batch", [True, False])
def test_a_damaged_frame_ends_the_run_before_it(batch: bool) -> None:
    blocks = blocks_of(torch.bfloat16)
    layout = KVLayout.of_block(blocks[0])
    codec = get_codec("fp8")
    frames = [codec.encode(b) for b in blocks]
    torn = bytearray(frames[2])
    torn[-1] ^= 1  # fails its checksum
    got, good = decode_frames([*frames[:2], torn, *frames[3:]], layout=layout, device="cpu", batch=batch)
    assert good == 2
    assert all(torch.equal(got[i], decode_frame(frames[i])) for i in range(2))
    # a checksum that fits, and a scale of 0 (no fp8 frame holds one): the batch decoder's own checks
    h = read_header(frames[3])
    payload = bytearray(memoryview(frames[3])[h.payload_offset : h.frame_len])
    payload[0:2] = b"\x00\x00"
    got, good = decode_frames(
        [*frames[:3], forged(frames[3], bytes(payload))], layout=layout, device="cpu", batch=batch
    )
    assert good == 3
    # an fp8 frame's K corrections name a channel past the head (the checks a scatter must not miss)
    L, _, _, H, D = SHAPE
    index_at = h.payload_offset + 2 * L * 2 * 64 * H + 2 * L * H * 8  # scales, then the corrections' scales
    payload = bytearray(memoryview(frames[1])[h.payload_offset : h.frame_len])
    payload[index_at - h.payload_offset : index_at - h.payload_offset + 2] = D.to_bytes(2, "little")
    got, good = decode_frames(
        [frames[0], forged(frames[1], bytes(payload))], layout=layout, device="cpu", batch=batch
    )
    assert good == 1
    with pytest.raises(FrameError):
        decode_frames([torn, *frames], layout=layout, device="cpu", batch=batch)


def test_an_fp8_nan_code_ends_a_batch_and_nothing_is_nan() -> None:
    blocks = blocks_of(torch.bfloat16)[:3]
    layout = KVLayout.of_block(blocks[0])
    frames = [get_codec("fp8").encode(b) for b in blocks]
    h = read_header(frames[1])
    payload = bytearray(memoryview(frames[1])[h.payload_offset : h.frame_len])
    payload[-1] = 0x7F  # E4M3's NaN, which no encoder writes
    got, good = decode_frames(
        [frames[0], forged(frames[1], bytes(payload)), frames[2]], layout=layout, device="cpu", batch=True
    )
    assert good == 1 and not bool(got[0].isnan().any())


def test_no_frames_decode_to_nothing() -> None:
    layout = KVLayout.of_block(blocks_of(torch.bfloat16)[0])
    got, good = decode_frames([], layout=layout, device="cpu")
    assert good == 0 and got.shape[0] == 0


def test_checksums_checked_beside_the_device_end_a_batch_at_the_first_damaged_frame() -> None:
    # a batch reads its frames' headers without their checksums and checks those while the device
    # decodes: the first frame that fails either check ends the result
    blocks = blocks_of(torch.bfloat16)
    layout = KVLayout.of_block(blocks[0])
    frames = [get_codec("fp8").encode(b) for b in blocks]
    torn = bytearray(frames[1])
    torn[-2] ^= 0x10  # a code byte: only the checksum sees it
    h = read_header(frames[3])
    payload = bytearray(memoryview(frames[3])[h.payload_offset : h.frame_len])
    payload[0:2] = b"\x00\x00"  # a scale of 0, with a checksum that fits: only the device sees it
    got, good = decode_frames(
        [frames[0], torn, frames[2], forged(frames[3], bytes(payload))],
        layout=layout,
        device="cpu",
        batch=True,
    )
    assert good == 1 and torch.equal(got[0], decode_frame(frames[0]))
    # frames of two codecs go one by one: each one's checksum is checked before it is decoded
    odd = bytearray(get_codec("int8").encode(blocks[2]))
    odd[-2] ^= 0x10  # a code byte: it would decode, slightly wrong
    got, good = decode_frames([frames[0], frames[1], odd, frames[3]], layout=layout, device="cpu", batch=True)
    assert good == 2 and all(torch.equal(got[i], decode_frame(frames[i])) for i in range(2))
