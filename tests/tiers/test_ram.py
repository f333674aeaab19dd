"""RamTier: codec frames in a host page pool; damaged frames fail closed."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs import get_codec
from kvstore.errors import ChecksumMismatch, FrameError
from kvstore.layout import KVLayout
from kvstore.tiers import RamTier, TierFull

SHAPE = (2, 2, 4, 2, 8)  # 512 bytes in bf16; a raw frame adds a header and params


def block(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(torch.bfloat16)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def raw_tier(capacity: int = 1 << 16, page_bytes: int = 256) -> RamTier:
    return RamTier(capacity, get_codec("raw"), page_bytes=page_bytes, pin_memory=False)


def test_raw_round_trip_is_bit_exact() -> None:
    ram = raw_tier()
    for i in range(5):
        ram.put(key(i), block(i))
    for i in range(5):
        out = ram.get(key(i))
        assert torch.equal(out.view(torch.int16), block(i).view(torch.int16))
    assert ram.usage().blocks == 5


def test_get_never_aliases_the_pool() -> None:
    ram = raw_tier()
    ram.put(key(1), block(1))
    out = ram.get(key(1))
    out.zero_()
    assert torch.equal(ram.get(key(1)), block(1))


def test_frame_size_sets_the_pages_taken() -> None:
    ram = raw_tier(page_bytes=256)
    frame = get_codec("raw").encode(block(0))
    used = ram.put(key(0), block(0))
    assert used == -(-len(frame) // 256) * 256 == ram.nbytes(key(0))
    assert ram.get_frame(key(0)) == bytes(frame)


def test_full_tier_raises_and_changes_nothing() -> None:
    frame_pages = -(-len(get_codec("raw").encode(block(0))) // 256)
    ram = raw_tier(capacity=256 * (2 * frame_pages + 1))
    ram.put(key(0), block(0))
    ram.put(key(1), block(1))
    before = ram.usage()
    # ram full: put [2] -> TierFull; can_put agrees beforehand
    assert not ram.can_put(block(2))
    with pytest.raises(TierFull, match="ram"):
        ram.put(key(2), block(2))
    assert ram.usage() == before and key(2) not in ram
    # drop [0] -> pages reused by [2]
    ram.drop(key(0))
    assert ram.can_put(block(2))
    ram.put(key(2), block(2))
    assert torch.equal(ram.get(key(2)), block(2))
    assert ram.usage().used_bytes <= ram.usage().capacity_bytes


@pytest.mark.parametrize("offset", [0, 20, 50, 70, 300, -1])
def test_corrupt_frame_raises_frame_error(offset: int) -> None:
    ram = raw_tier()
    ram.put(key(1), block(1))
    n = len(ram.get_frame(key(1)))
    # one flipped byte anywhere (magic, header, params, payload, last byte) -> FrameError
    ram._debug_corrupt(key(1), offset % n)
    with pytest.raises(FrameError):
        ram.get(key(1))


def test_corrupt_frame_in_scattered_pages_is_detected_too() -> None:
    ram = raw_tier(capacity=256 * 12)
    frame_pages = -(-len(get_codec("raw").encode(block(0))) // 256)
    # fill, free every other entry, then store one that must take scattered pages
    for i in range(12 // frame_pages):
        ram.put(key(i), block(i))
    for i in range(0, 12 // frame_pages, 2):
        ram.drop(key(i))
    ram.put(key(99), torch.cat([block(5), block(6)], dim=2))  # a bigger block: 8 tokens
    assert torch.equal(ram.get(key(99)), torch.cat([block(5), block(6)], dim=2))
    ram._debug_corrupt(key(99), 600)
    with pytest.raises(ChecksumMismatch):
        ram.get(key(99))


def test_put_frame_moves_frames_without_reencoding_and_checks_them() -> None:
    ram = raw_tier()
    frame = get_codec("raw").encode(block(3))
    ram.put_frame(key(3), frame)
    assert ram.get_frame(key(3)) == bytes(frame)
    assert torch.equal(ram.get(key(3)), block(3))
    assert ram.layout(key(3)) == KVLayout.of_block(block(3))
    damaged = bytearray(frame)
    damaged[-1] ^= 0x01
    with pytest.raises(FrameError):
        ram.put_frame(key(4), damaged)
    assert key(4) not in ram


def test_frames_of_another_codec_still_decode() -> None:
    # a frame moved up from nvme may carry zstd: the frame says how to decode it
    ram = raw_tier()
    ram.put_frame(key(1), get_codec("raw", shuffle=True, zstd=3).encode(block(1)))
    assert torch.equal(ram.get(key(1)), block(1))


def test_pin_memory_is_off_without_cuda() -> None:
    ram = RamTier(1024, get_codec("raw"), page_bytes=256, pin_memory=None)
    assert ram.pool.pinned == torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_block_is_encoded_on_the_gpu_and_decodes_onto_it() -> None:
    ram = RamTier(1 << 20, get_codec("raw"), page_bytes=256)
    assert ram.pool.pinned
    b = block(2).cuda()
    ram.put(key(2), b)
    out = ram.get(key(2), device="cuda:0")
    assert out.is_cuda and torch.equal(out, b)
