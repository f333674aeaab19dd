"""int8: 8-bit codes, K per channel (or per token), V per token; asymmetric by default, symmetric on request."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs import decode_frame, get_codec
from kvstore.codecs.frame import read_header
from kvstore.codecs.int8 import Int8Codec
from kvstore.errors import CodecError, FrameError
from kvstore.layout import KVLayout
from tests.codecs.codec_blocks import DTYPES, group_absmax, rel_l2, structured_block, subnormal_unit

SHAPE = (4, 2, 16, 3, 64)


def roundtrip(block: torch.Tensor, **params: bool | str) -> torch.Tensor:
    return decode_frame(get_codec("int8", **params).encode(block))


def int8_group_absmax(block: torch.Tensor, k_axis: str) -> torch.Tensor:
    """Absmax of each value's group: V per (token, head); K per (head, channel) over tokens, or like V."""
    out = group_absmax(block).expand(block.shape).clone()
    if k_axis == "channel":
        out[:, 0] = block[:, 0].double().abs().amax(dim=1, keepdim=True)
    return out


@pytest.mark.parametrize("k_axis", ["channel", "token"])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "heavy", "onesided", "wide", "constant", "huge", "tiny"])
def test_error_within_a_hundredth_of_the_group_absmax(
    k_axis: str, symmetric: bool, dtype: torch.dtype, kind: str
) -> None:
    block = structured_block(kind, SHAPE, dtype, seed=3, log2_scale=-3)
    out = roundtrip(block, symmetric=symmetric, k_axis=k_axis)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    err = (out.double() - block.double()).abs()
    assert bool((err <= int8_group_absmax(block, k_axis) / 100 + subnormal_unit(dtype)).all())


def test_per_channel_k_keeps_small_channels_precise() -> None:
    # K with a few large channels: grouped per token they set every group's range;
    # grouped per channel each keeps its own, so K's error drops severalfold
    block = structured_block("heavy", SHAPE, torch.float32, seed=8)
    K = block[:, 0]
    by_channel = rel_l2(roundtrip(block)[:, 0], K)
    by_token = rel_l2(roundtrip(block, k_axis="token")[:, 0], K)
    assert by_channel < by_token / 2  # measured 0.0032 vs 0.0089


@pytest.mark.parametrize(
    "kind,asym_bound,sym_bound",
    [
        ("normal", 0.007, 0.0075),  # measured 0.0054 / 0.0058 in bfloat16
        ("heavy", 0.0095, 0.013),  # measured 0.0076 / 0.0104
        ("onesided", 0.002, 0.005),
    ],
)
def test_relative_l2_error(kind: str, asym_bound: float, sym_bound: float) -> None:
    block = structured_block(kind, SHAPE, torch.bfloat16, seed=5)
    assert rel_l2(roundtrip(block), block) < asym_bound
    assert rel_l2(roundtrip(block, symmetric=True), block) < sym_bound


def test_asymmetric_halves_the_error_of_one_sided_groups() -> None:
    # every group on one side of zero: symmetric codes waste half their range
    block = structured_block("onesided", SHAPE, torch.float32, seed=9)
    asym = rel_l2(roundtrip(block), block)
    sym = rel_l2(roundtrip(block, symmetric=True), block)
    assert asym < 0.6 * sym


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_and_constant_groups_decode_exactly(symmetric: bool, dtype: torch.dtype) -> None:
    zeros = torch.zeros(SHAPE, dtype=dtype)
    assert torch.equal(roundtrip(zeros, symmetric=symmetric), zeros)
    # every (token, head) constant: exact per token (asymmetric: the zero point is the constant)
    block = structured_block("constant", SHAPE, dtype, seed=4, log2_scale=5)
    out = roundtrip(block, symmetric=symmetric, k_axis="token")
    if symmetric:  # c = 127 * (c / 127): exact up to the scale's rounding
        assert torch.allclose(out.double(), block.double(), rtol=2**-7)
    else:
        assert torch.equal(out, block)
    # every K channel constant over the tokens: exact per channel
    channels = block.clone()
    channels[:, 0] = block[:, 0, :1].expand_as(block[:, 0])
    if not symmetric:
        assert torch.equal(roundtrip(channels)[:, 0], channels[:, 0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_at_the_dtype_limit_stay_finite(dtype: torch.dtype) -> None:
    limit = torch.finfo(dtype).max
    block = torch.zeros(SHAPE, dtype=dtype)
    block[..., 0] = limit
    block[..., 1] = -limit
    block[..., 2] = limit * 0.998
    for symmetric in (False, True):
        frame = get_codec("int8", symmetric=symmetric).encode(block)
        out = decode_frame(frame)
        assert bool(torch.isfinite(out).all())
        assert torch.allclose(out.double(), block.double(), rtol=0, atol=limit / 100)
        # a range wider than float32 can hold (bfloat16, float32) is coded symmetrically
        assert read_header(frame).params["symmetric"] == (symmetric or dtype != torch.float16)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_values_are_refused_at_encode(bad: float) -> None:
    block = structured_block("normal", SHAPE, torch.float16, seed=1)
    block[0, 0, 0, 0, 0] = bad
    with pytest.raises(CodecError, match="inf or NaN"):
        get_codec("int8").encode(block)


@pytest.mark.parametrize(
    "dtype,symmetric,bits",
    [(torch.bfloat16, False, 8.75), (torch.bfloat16, True, 8.5), (torch.float32, False, 9.0)],
)
def test_frame_layout_and_size(dtype: torch.dtype, symmetric: bool, bits: float) -> None:
    # float32 scales (and minimums in the block's dtype), then one code per value; at T = D
    # per-channel K has as many groups as per-token K
    block = structured_block("normal", (2, 2, 64, 3, 64), dtype, seed=1)
    h = read_header(get_codec("int8", symmetric=symmetric).encode(block))
    assert h.params == {"symmetric": symmetric, "k_axis": "channel"}
    assert h.payload_len == get_codec("int8", symmetric=symmetric).payload_bytes(KVLayout.of_block(block))
    assert h.payload_len * 8 / block.numel() == pytest.approx(bits)


def test_parameters_are_validated() -> None:
    with pytest.raises(CodecError, match="symmetric must be true or false"):
        Int8Codec(symmetric="yes")  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="k_axis must be one of"):
        Int8Codec(k_axis="layer")
    with pytest.raises(CodecError, match="unexpected keyword"):
        get_codec("int8", bits=4)
    # L=1, H=1, D=2, T=1: 2 K groups (per channel) and 1 V group: float32 scales, float16
    # minimums, 4 codes
    layout = KVLayout(1, 1, 2, "float16", 1)
    payload = torch.zeros(3 * 4 + 3 * 2 + 4, dtype=torch.uint8)
    assert torch.equal(
        Int8Codec()._decode(payload, layout, {}), torch.zeros(layout.shape(), dtype=torch.float16)
    )
    with pytest.raises(FrameError, match="symmetric=1"):
        Int8Codec()._decode(payload, layout, {"symmetric": 1})
    with pytest.raises(FrameError, match="k_axis='layer'"):
        Int8Codec()._decode(payload, layout, {"k_axis": "layer"})
    with pytest.raises(FrameError, match="payload has 22 bytes, the layout needs 16"):
        Int8Codec()._decode(payload, layout, {"symmetric": True})


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("units", [116, 300, 5000])
def test_a_group_whose_step_is_subnormal_decodes_exactly(symmetric: bool, units: int) -> None:
    # 116 units / 255 is below float32's smallest step: the scale was 0, then 1, and the value decoded
    # as 0; 300 / 255 rounded down to one unit and the codes clamped at 255 (0.15 of absmax off)
    block = torch.zeros(1, 2, 2, 1, 1)
    block[0, 0, 0, 0, 0] = units * 2.0**-149
    got = decode_frame(get_codec("int8", symmetric=symmetric).encode(block))
    assert torch.equal(got, block)


def test_a_constant_subnormal_group_decodes_exactly_when_symmetric() -> None:
    block = torch.full((1, 2, 1, 1, 1), 5 * 2.0**-149)
    assert torch.equal(decode_frame(get_codec("int8", symmetric=True).encode(block)), block)
