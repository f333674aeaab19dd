"""NvmeTier's head-block policy: a prefix's first blocks (the attention sink's) get their own codec."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.codecs import CODECS, get_codec, read_header
from kvstore.errors import ConfigError
from kvstore.record import BlockRecord
from kvstore.tiers import NvmeTier

SHAPE = (2, 2, 16, 2, 64)
INT4, INT8 = CODECS["int4"].codec_id, CODECS["int8"].codec_id


def block(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(torch.bfloat16)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def record(i: int) -> BlockRecord:
    return BlockRecord(
        key=key(i),
        parent=key(i - 1) if i else bytes(32),
        namespace="ns0",
        position=i,
        tokens=bytes(64),
        created=1.0,
        last_access=2.0,
    )


def open_tier(
    path: Path, head: str | None = "int8", head_blocks: int = 1, capacity: int = 8 << 20
) -> NvmeTier:
    return NvmeTier(
        path,
        capacity,
        get_codec("int4", rotate=True, zstd=3),
        head_codec=get_codec(head, zstd=3) if head else None,
        head_blocks=head_blocks,
    )


def codec_id(tier: NvmeTier, i: int) -> int:
    return read_header(tier.get_frame(key(i))).codec_id


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_first_blocks_get_the_head_codec_and_both_decode(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "nvme", head_blocks=2)
    for i in range(4):
        tier.put(key(i), block(i), record(i))
    # positions 0 and 1 -> int8; 2 and 3 -> int4 (rotated)
    assert [codec_id(tier, i) for i in range(4)] == [INT8, INT8, INT4, INT4]
    assert read_header(tier.get_frame(key(2))).params["rotate"] is True
    errs = [rel_err(tier.get(key(i)), block(i)) for i in range(4)]
    assert max(errs[:2]) < 0.01 < min(errs[2:]) < 0.2  # int8 is much closer than int4
    # decoding into a caller's tensor works for either codec
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    for i in (0, 3):
        assert tier.get(key(i), out=out) is out and torch.equal(out, tier.get(key(i)))
    tier.close()
    # a restart reads both kinds of frame (the codec comes from each frame, not from the tier)
    plain = NvmeTier(tmp_path / "nvme", 8 << 20, get_codec("int4"))
    assert all(rel_err(plain.get(key(i)), block(i)) == errs[i] for i in range(4))
    plain.close()


def test_position_comes_from_the_stored_record_when_none_is_given(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "nvme")
    tier.put(key(0), block(0), record(0))
    tier.put(key(0), block(5))  # frame replaced, record kept: still the head block
    assert codec_id(tier, 0) == INT8 and tier.record(key(0)) == record(0)
    tier.put(key(9), block(9))  # no record at all: position unknown -> the tier codec
    assert codec_id(tier, 9) == INT4
    tier.close()


def test_policy_off_stores_every_block_with_the_tier_codec(tmp_path: Path) -> None:
    for path, head, n in ((tmp_path / "a", None, 1), (tmp_path / "b", "int8", 0)):
        tier = open_tier(path, head=head, head_blocks=n)
        assert tier.head_codec is None and tier.codec_for(0) is tier.codec
        tier.put(key(0), block(0), record(0))
        assert codec_id(tier, 0) == INT4
        tier.close()


def test_can_put_sizes_the_block_by_its_codec(tmp_path: Path) -> None:
    # a raw head block (16 KiB) needs ~3x the room of an int4 block
    tier = open_tier(tmp_path / "nvme", head="raw", capacity=1 << 20)
    tier.put(key(0), block(0), record(0))
    i = 1
    while tier.can_put(block(i), position=0):  # fill while even a head block would fit
        tier.put(key(i), block(i), record(i))
        i += 1
    # now: no room for a head block, none when the position is unknown (judged as the larger),
    # but an int4 block still fits -- and really does
    assert not tier.can_put(block(i), position=0)
    assert not tier.can_put(block(i))
    assert tier.can_put(block(i), position=i)
    tier.put(key(i), block(i), record(i))
    assert tier.usage().used_bytes <= tier.capacity_bytes
    tier.close()


def test_bad_head_blocks_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="head_blocks"):
        open_tier(tmp_path / "nvme", head_blocks=-1)
