"""int4: KIVI-style 4-bit codes -- K per channel over tokens, V per token over channels."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs import decode_frame, get_codec, int4
from kvstore.codecs import frame as framing
from kvstore.codecs.frame import read_header
from kvstore.codecs.int4 import Int4Codec
from kvstore.codecs.rotation import bf16_matmul_fast, hadamard, none_tiny, rotate
from kvstore.errors import CodecError, FrameError
from kvstore.layout import KVLayout
from tests.codecs.codec_blocks import DTYPES, rel_l2, structured_block, subnormal_unit

SHAPE = (2, 2, 64, 2, 64)
SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_tokens=64)


def roundtrip(block: torch.Tensor, **params: object) -> torch.Tensor:
    return decode_frame(get_codec("int4", **params).encode(block))


def group_range(t: torch.Tensor, dim: int, g: int) -> torch.Tensor:
    """max - min of each group of ``g`` along ``dim`` of ``t``, broadcast back to ``t`` (g divides the dim)."""
    shape = list(t.shape)
    grouped = t.double().reshape(*shape[:dim], shape[dim] // g, g, *shape[dim + 1 :])
    r = grouped.amax(dim + 1, keepdim=True) - grouped.amin(dim + 1, keepdim=True)
    return r.expand_as(grouped).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["normal", "heavy", "onesided", "wide", "constant", "tiny"])
def test_each_value_within_a_step_of_its_group(dtype: torch.dtype, kind: str) -> None:
    # K groups: one channel over 32 tokens; V groups: one token over 32 channels.
    # A code is at most half a step off; a step is (max - min) / 15 plus the rounding of the stats.
    block = structured_block(kind, SHAPE, dtype, seed=11, log2_scale=-2)
    out = roundtrip(block)
    assert out.dtype == dtype and out.shape == block.shape and bool(torch.isfinite(out).all())
    err = (out.double() - block.double()).abs()
    eps = torch.finfo(dtype).eps
    absmax = block.double().abs().amax()
    for i, (dim, g) in enumerate([(1, 32), (3, 32)]):
        bound = group_range(block[:, i], dim, g) * (1 / 30) * (1 + 2 * eps) + 2 * eps * absmax
        assert bool((err[:, i] <= bound + subnormal_unit(dtype)).all()), (
            "KV"[i],
            float((err[:, i] - bound).max()),
        )


def test_default_costs_five_bits_per_value_and_zstd_shaves_more() -> None:
    # 4-bit codes + a 16-bit centre and scale per 32 values, for K and for V alike
    block = structured_block("normal", SMOLLM2.shape(), torch.bfloat16, seed=1)
    codec = get_codec("int4")
    frame = codec.encode(block)
    assert codec.payload_bytes(SMOLLM2) == SMOLLM2.block_numel * 5 // 8
    assert len(frame) * 8 / SMOLLM2.block_numel == pytest.approx(5.0, abs=0.01)
    # groups of 64 -> 4.5 bits; zstd on top never grows a frame by more than its bound
    assert len(get_codec("int4", k_group=64, v_group=64).encode(block)) * 8 / SMOLLM2.block_numel < 4.51
    assert len(get_codec("int4", zstd=3).encode(block)) <= codec.max_frame_bytes(SMOLLM2)


@pytest.mark.parametrize(
    "params",
    [
        {"k_group": 16, "v_group": 64},
        {"k_axis": "token", "k_group": 8},
        {"rotate": True},
        {"k_group": 48, "v_group": 24, "zstd": 5},  # groups that do not divide the block
    ],
)
def test_parameters_travel_in_the_frame(params: dict) -> None:
    # whoever encoded it, a default-built int4 (and decode_frame) decodes the frame the same way
    block = structured_block("heavy", SHAPE, torch.bfloat16, seed=2)
    codec = get_codec("int4", **params)
    frame = codec.encode(block)
    header = read_header(frame)
    assert {k: v for k, v in codec.params().items() if k != "zstd"}.items() <= header.params.items()
    mine = codec.decode(frame)
    assert torch.equal(Int4Codec().decode(frame), mine)
    assert torch.equal(decode_frame(frame), mine)
    assert rel_l2(mine, block) < 0.12


def test_groups_change_the_error_the_way_the_design_says() -> None:
    # smaller groups -> smaller error; K per channel beats K per token when K has outlier channels
    block = structured_block("heavy", SHAPE, torch.float32, seed=3)
    k = block[:, 0]
    e32 = rel_l2(roundtrip(block)[:, 0], k)
    e8 = rel_l2(roundtrip(block, k_group=8)[:, 0], k)
    per_token = rel_l2(roundtrip(block, k_axis="token")[:, 0], k)
    assert e8 < e32 < per_token
    assert per_token > 1.5 * e32  # measured 1.75x


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_and_zero_groups_decode_exactly(dtype: torch.dtype) -> None:
    # constant groups have scale 0: no division by zero, no NaN, the value comes back exactly
    zeros = torch.zeros(SHAPE, dtype=dtype)
    assert torch.equal(roundtrip(zeros), zeros)
    const = torch.full(SHAPE, -3.25, dtype=dtype)
    assert torch.equal(roundtrip(const), const)
    # K constant along tokens per channel, V constant along channels per token
    block = torch.zeros(SHAPE, dtype=dtype)
    block[:, 0] = torch.randn(SHAPE[0], 1, SHAPE[3], SHAPE[4]).to(dtype)
    block[:, 1] = torch.randn(SHAPE[0], SHAPE[2], SHAPE[3], 1).to(dtype)
    assert torch.equal(roundtrip(block), block)


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_next_to_the_dtype_limit_stay_finite(dtype: torch.dtype) -> None:
    limit = torch.finfo(dtype).max
    block = structured_block("normal", (2, 2, 8, 1, 16), torch.float64, seed=4)
    block = (block / block.abs().amax() * limit).to(dtype)
    out = roundtrip(block)
    assert bool(torch.isfinite(out).all())
    assert read_header(get_codec("int4").encode(block)).params["clamp"] is True
    assert rel_l2(out, block) < 0.1


@pytest.mark.parametrize("shape", [(1, 2, 1, 1, 1), (3, 2, 5, 2, 3), (1, 2, 17, 1, 96)])
def test_odd_shapes_round_trip(shape: tuple[int, ...]) -> None:
    # odd code counts (a half-used last byte), groups longer than the block, a head dim of 3 * 32
    block = structured_block("normal", shape, torch.float16, seed=5)
    for params in ({}, {"rotate": True}, {"k_axis": "token"}):
        out = roundtrip(block, **params)
        assert out.shape == block.shape
        assert rel_l2(out, block) < 0.15


def test_non_finite_blocks_are_refused() -> None:
    block = structured_block("normal", SHAPE, torch.bfloat16, seed=6)
    block[1, 1, 5, 1, 7] = float("nan")
    with pytest.raises(CodecError, match="inf or NaN"):
        get_codec("int4").encode(block)


def test_hadamard_rotation_is_orthonormal_and_its_own_inverse() -> None:
    h = hadamard(64, torch.device("cpu"))
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    x = torch.randn(5, 96)  # 96 = 3 x 32: rotated in blocks of 32
    assert torch.allclose(rotate(rotate(x)), x, atol=1e-5)
    assert torch.allclose(rotate(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


@pytest.mark.parametrize("kind", ["normal", "heavy", "wide"])
def test_a_rotated_bfloat16_block_decodes_alike_in_either_precision(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rotated back in bfloat16 where its products are fast, else in float32 (an AVX2-only CPU):
    # the value rounded to bfloat16 before rotating back moves a result by about a unit of
    # bfloat16 at the slice's scale (sqrt(n)/2 at worst, n = 64 here), the same promise either way
    codec = Int4Codec(rotate=True)
    block = structured_block(kind, SHAPE, torch.bfloat16, seed=11)
    frame = codec.encode(block)
    assert read_header(frame).params["rotate"] is True
    monkeypatch.setattr(int4, "bf16_matmul_fast", lambda _device: True)
    fast = decode_frame(frame).double()
    monkeypatch.setattr(int4, "bf16_matmul_fast", lambda _device: False)
    wide = decode_frame(frame).double()
    absmax = block.double().abs().amax(dim=(2, 4), keepdim=True)
    unit = absmax * float(torch.finfo(torch.bfloat16).eps)
    assert bool(((fast - wide).abs() <= 4 * unit).all())
    assert float(((fast - wide).abs() / unit).mean()) < 0.5
    assert rel_l2(fast, block.double()) <= 1.01 * rel_l2(wide, block.double())  # the same quality
    promise = codec.error_bound(KVLayout.of_block(block))
    assert promise is not None
    assert float((fast - block.double()).abs().max()) <= promise * float(absmax.max())


@pytest.mark.parametrize("head_dim", [8, 64])
def test_a_rotated_block_of_subnormal_values_keeps_the_promise(head_dim: int) -> None:
    # oneDNN's bfloat16 products flush values under 2^-126 to zero: rotated back that way, such a
    # block decoded to all zeros (an error of its whole absmax, past the promise of 8/14 at D = 8)
    g = torch.Generator().manual_seed(3)
    block = (torch.randn(1, 2, 256, 2, head_dim, generator=g, dtype=torch.float64) * 2.0**-128).to(
        torch.bfloat16
    )
    codec = Int4Codec(rotate=True)
    frame = codec.encode(block)
    assert read_header(frame).params["rotate"] is True
    got = decode_frame(frame).double()
    absmax = block.double().abs().amax(dim=(2, 4), keepdim=True)
    promise = codec.error_bound(KVLayout.of_block(block))
    assert promise is not None
    assert bool(((got - block.double()).abs() <= promise * absmax).all())
    assert rel_l2(got, block) < 0.2  # not zeros


@pytest.mark.parametrize(
    "values,expected",
    [([0.0, -0.0], True), ([1.0, -3.5, 2.0**-99], True), ([1.0, 2.0**-101], False), ([-(2.0**-110)], False)],
)
def test_groups_under_2_to_the_minus_100_are_found_in_the_stats(values: list[float], expected: bool) -> None:
    stats = torch.tensor(values).to(torch.bfloat16).view(torch.uint8)
    assert none_tiny(stats) is expected


def test_bfloat16_products_count_as_fast_on_a_gpu_never_without_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert bf16_matmul_fast(torch.device("cuda"))
    assert not bf16_matmul_fast(torch.device("meta"))
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert not torch.backends.mkldnn.enabled
    assert not bf16_matmul_fast(torch.device("cpu"))


@pytest.mark.parametrize(
    "params,match",
    [
        ({"k_group": 0}, "k_group"),
        ({"v_group": 1.5}, "v_group"),
        ({"k_axis": "head"}, "k_axis"),
        ({"rotate": "yes"}, "rotate"),
        ({"zstd": 99}, "zstd"),
    ],
)
def test_bad_parameters_are_refused_by_name(params: dict, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        get_codec("int4", **params)


@pytest.mark.parametrize("params", [{"k_group": 0}, {"k_axis": 7}, {"bogus": 1}, {"clamp": "no"}])
def test_frames_with_unusable_parameters_do_not_decode(params: dict) -> None:
    # a well-formed frame (valid checksum) whose parameters make no sense is a FrameError
    block = structured_block("normal", (1, 2, 4, 1, 8), torch.bfloat16, seed=7)
    good = read_header(get_codec("int4").encode(block))
    frame = get_codec("int4").encode(block)
    payload = bytes(frame[good.payload_offset : good.frame_len])
    forged = framing.pack(Int4Codec.codec_id, good.layout, {**good.params, **params}, [payload])
    with pytest.raises(FrameError):
        decode_frame(forged)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotation_near_the_dtype_limit_falls_back_to_an_unrotated_frame(dtype: torch.dtype) -> None:
    # rotated, a block near the dtype's largest value would overflow (|y| <= sqrt(64) x absmax):
    # the frame is written unrotated, says so, and keeps the unrotated promise
    codec = Int4Codec(rotate=True)
    huge = structured_block("huge", (1, 2, 8, 2, 64), dtype, seed=3)
    frame = codec.encode(huge)
    assert read_header(frame).params["rotate"] is False
    out = decode_frame(frame)
    assert bool(torch.isfinite(out).all())
    bound = codec.max_error * huge.double().abs().amax(dim=(2, 4), keepdim=True) + subnormal_unit(dtype)
    assert bool(((out.double() - huge.double()).abs() <= bound).all())
    # an ordinary block is rotated, and its error stays within the rotated bound
    normal = structured_block("normal", (1, 2, 8, 2, 64), dtype, seed=3)
    frame = codec.encode(normal)
    assert read_header(frame).params["rotate"] is True
    promise = codec.error_bound(KVLayout.of_block(normal))
    assert promise == 64 / 14
    assert (
        float((decode_frame(frame).double() - normal.double()).abs().max())
        <= float(normal.double().abs().max()) * promise
    )
