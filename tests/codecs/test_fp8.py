"""fp8: E4M3 codes with a bfloat16 scale per (layer, K/V, token, head)."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs import decode_frame, decode_frames, get_codec
from kvstore.codecs.fp8 import Fp8Codec, fp8_decode_groups
from kvstore.codecs.frame import read_header
from kvstore.errors import CodecError, FrameError
from kvstore.layout import KVLayout
from tests.codecs.codec_blocks import DTYPES, group_absmax, rel_l2, structured_block, subnormal_unit

SHAPE = (4, 2, 16, 3, 64)
ALL_CODES = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # no NaN codes


def roundtrip(block: torch.Tensor) -> torch.Tensor:
    return decode_frame(get_codec("fp8").encode(block))


@pytest.mark.parametrize("scale", [1.0, 2.0**-10, 3e-3, 0.7, 100.0, 2.0**-22, 2.0**-133, 250.0, 300.0, 1e30])
def test_bit_placement_decodes_every_code_like_the_torch_cast(scale: float) -> None:
    # every finite E4M3 code times a bfloat16 scale, decoded by bit placement (or by the plain
    # path when the multiplier would overflow), equals torch's cast times the scale, exactly
    s = torch.tensor([[scale]], dtype=torch.bfloat16)
    codes = ALL_CODES.view(1, -1)
    got = fp8_decode_groups(codes, s, torch.finfo(torch.float32).max)  # a float32 block's
    want = codes.view(torch.float8_e4m3fn).float() * s.float()
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 stays -0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "heavy", "onesided", "wide"])
def test_error_within_a_sixteenth_of_the_group_absmax(dtype: torch.dtype, kind: str) -> None:
    block = structured_block(kind, SHAPE, dtype, seed=11)
    out = roundtrip(block)
    err = (out.double() - block.double()).abs()
    assert bool((err <= group_absmax(block) / 16 + subnormal_unit(dtype)).all())
    # in E4M3's normal range (above absmax / 2^14 of the group) the error is relative: within 2^-4
    normal = block.double().abs() >= group_absmax(block) * 2.0**-14
    rel = err[normal] / block.double().abs()[normal]
    assert float(rel.max()) <= 2.0**-4 + 2.0**-8


@pytest.mark.parametrize("kind,bound", [("normal", 0.03), ("heavy", 0.03), ("wide", 0.03)])
def test_relative_l2_error(kind: str, bound: float) -> None:
    # measured 0.025 on normal data, 0.021 (K) / 0.025 (V) on SmolLM2's real cache
    block = structured_block(kind, SHAPE, torch.bfloat16, seed=5)
    assert rel_l2(roundtrip(block), block) < bound


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_constant_and_out_of_range_groups(dtype: torch.dtype) -> None:
    # all zeros decode to zeros; constant groups and values far past 448 stay finite and close
    zeros = torch.zeros(SHAPE, dtype=dtype)
    assert torch.equal(roundtrip(zeros), zeros)
    for kind in ("constant", "huge", "tiny"):
        block = structured_block(kind, SHAPE, dtype, seed=7)
        out = roundtrip(block)
        assert bool(torch.isfinite(out).all()), kind
        err = (out.double() - block.double()).abs()
        assert bool((err <= group_absmax(block) / 16 + subnormal_unit(dtype)).all()), kind
    big = torch.full(SHAPE, 1e4, dtype=dtype)  # past E4M3's range: an unclamped cast would give NaN
    big[..., ::2] = -3e4
    assert torch.allclose(roundtrip(big).double(), big.double(), rtol=2**-4)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_values_are_refused_at_encode(bad: float) -> None:
    block = structured_block("normal", SHAPE, torch.bfloat16, seed=1)
    block[3, 1, 15, 2, 63] = bad
    with pytest.raises(CodecError, match="inf or NaN"):
        get_codec("fp8").encode(block)


@pytest.mark.parametrize("k_fix,bits", [(0, 8.25), (8, 8.25 + 0.5 + 32 * 8 / (2 * 64 * 64))])
def test_frame_size(k_fix: int, bits: float) -> None:
    # E4M3 codes + a bfloat16 scale per 64 values; with k_fix, 8 of 64 K channels carry an
    # int8 residual (+0.5 bit a value) and a scale and an index each
    block = structured_block("normal", (2, 2, 64, 3, 64), torch.bfloat16, seed=1)
    frame = get_codec("fp8", k_fix=k_fix).encode(block)
    h = read_header(frame)
    assert h.params == {"group": "token_head", "k_fix": k_fix}
    assert h.payload_len == Fp8Codec(k_fix=k_fix).payload_bytes(KVLayout.of_block(block))
    assert len(frame) == h.payload_offset + h.payload_len
    assert h.payload_len * 8 / block.numel() == pytest.approx(bits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_k_fix_corrects_the_largest_k_channels(dtype: torch.dtype) -> None:
    # heavy-tailed K: the corrected channels come back within ~1/4000 of their absmax, the others
    # as plain E4M3; V is untouched by the correction
    block = structured_block("heavy", SHAPE, dtype, seed=12)
    plain = decode_frame(get_codec("fp8", k_fix=0).encode(block)).double()
    fixed = decode_frame(get_codec("fp8", k_fix=4).encode(block)).double()
    K = block[:, 0].double()
    top = K.square().mean(1).topk(4, dim=-1).indices[:, None].expand(-1, SHAPE[2], -1, -1)
    err_top = (fixed[:, 0] - K).abs().gather(-1, top)
    chan_absmax = K.abs().amax(1, keepdim=True).expand_as(K).gather(-1, top)
    assert bool(
        (err_top <= chan_absmax / 2000 + K.abs().gather(-1, top) * float(torch.finfo(dtype).eps)).all()
    )
    assert torch.equal(fixed[:, 1], plain[:, 1])
    assert rel_l2(fixed[:, 0], K) < 0.7 * rel_l2(plain[:, 0], K)


def test_a_corrected_k_channel_at_the_dtypes_largest_value_stays_finite() -> None:
    # the plain code of float32's largest value decodes just under it; its correction, rounded up,
    # took it past, to inf (a block the round-trip contract test found). Both decoders.
    block = torch.tensor(
        [
            [
                [
                    [[3.4028e38, -5.4918e37], [-1.5608e38, 1.4706e38]],
                    [[-1.3007e38, -1.8768e38], [-9.1698e37, -1.2748e38]],
                ],
                [
                    [[-1.9063e38, 2.2418e38], [4.7622e37, 2.9688e38]],
                    [[1.6711e38, -1.8052e38], [1.0504e37, 4.9734e37]],
                ],
            ]
        ]
    )
    block[0, 0, 0, 0, 0] = torch.finfo(torch.float32).max
    frame = get_codec("fp8", k_fix=8).encode(block)
    layout = KVLayout.of_block(block)
    for out in (
        decode_frame(frame),
        decode_frames([frame, frame], layout=layout, batch=True, device="cpu")[0][1],
    ):
        assert bool(torch.isfinite(out).all())
        assert bool(((out.double() - block.double()).abs() <= group_absmax(block) / 16).all())


def test_forged_frames_are_refused() -> None:
    codec = Fp8Codec()
    layout = KVLayout(1, 1, 4, "bfloat16", 1)
    good = torch.tensor([0x80, 0x3F] * 2 + [0x38, 0x40, 0xB8, 0x00] * 2, dtype=torch.uint8)  # scales 1.0
    out = codec._decode(good, layout, {"k_fix": 0})
    assert out.flatten().tolist() == [1.0, 2.0, -1.0, 0.0] * 2
    # a zero scale, the payload of another layout, unknown parameters: refused
    zero_scale = good.clone()
    zero_scale[:2] = 0
    with pytest.raises(FrameError, match="scale"):
        codec._decode(zero_scale, layout, {"k_fix": 0})
    with pytest.raises(FrameError, match="payload has 11 bytes"):
        codec._decode(good[:-1], layout, {"k_fix": 0})
    for params in ({"group": "layer"}, {"k_fix": 5}, {"k_fix": True}, {"k_fix": "8"}):
        with pytest.raises(FrameError, match="unusable parameters"):
            codec._decode(good, layout, params)
    # a correction naming a channel outside the head
    block = structured_block("normal", (1, 2, 2, 1, 4), torch.bfloat16, seed=1)
    frame = bytearray(Fp8Codec(k_fix=1).encode(block))
    h = read_header(frame)
    payload = torch.frombuffer(frame, dtype=torch.uint8)[h.payload_offset :].clone()
    index_at = 2 * 4 + 2  # after 4 group scales and 1 residual scale
    payload[index_at] = 9
    with pytest.raises(FrameError, match="channel 9, outside 0..3"):
        Fp8Codec()._decode(payload, KVLayout.of_block(block), h.params)
    with pytest.raises(CodecError, match="k_fix must be"):
        Fp8Codec(k_fix=-1)
