"""HbmTier: native blocks in a page pool, bit-exact, capacity hard."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.tiers import HbmTier, TierFull

# 2 layers, 4 tokens, 2 heads, head_dim 8, bf16 -> 512 bytes a block = 2 pages of 256
SHAPE = (2, 2, 4, 2, 8)


def block(seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_round_trip_is_bit_exact_and_never_aliases() -> None:
    hbm = HbmTier(4096, page_bytes=256)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        b = block(1, dtype)
        hbm.put(key(1), b)
        out = hbm.get(key(1))
        assert out.dtype == dtype and out.shape == b.shape
        assert torch.equal(out.view(torch.uint8), b.view(torch.uint8))
        # writing to the result leaves the stored block alone
        out.zero_()
        assert torch.equal(hbm.get(key(1)), b)


def test_non_contiguous_input_is_stored_by_value() -> None:
    hbm = HbmTier(4096, page_bytes=256)
    wide = torch.randn(2, 2, 8, 2, 8).to(torch.bfloat16)
    b = wide[:, :, ::2]  # a strided view
    hbm.put(key(1), b)
    assert torch.equal(hbm.get(key(1)), b)


def test_full_tier_raises_and_changes_nothing() -> None:
    hbm = HbmTier(256 * 5, page_bytes=256)  # room for 2 blocks (4 pages), 1 page spare
    hbm.put(key(0), block(0))
    hbm.put(key(1), block(1))
    before = hbm.usage()
    assert before.blocks == 2 and before.used_bytes == 1024
    # hbm full: put [2] -> TierFull, [0] and [1] untouched
    assert not hbm.can_put(block(2))
    with pytest.raises(TierFull, match="hbm"):
        hbm.put(key(2), block(2))
    assert hbm.usage() == before and key(2) not in hbm
    assert torch.equal(hbm.get(key(0)), block(0))
    # drop [0] -> its pages take [2]
    assert hbm.drop(key(0)) == 512
    assert hbm.can_put(block(2))
    hbm.put(key(2), block(2))
    assert sorted(hbm.keys()) == [key(1), key(2)]
    assert hbm.usage().used_bytes <= hbm.usage().capacity_bytes


def test_replace_may_reuse_its_own_room() -> None:
    hbm = HbmTier(512, page_bytes=256)  # exactly one block
    hbm.put(key(0), block(0))
    # same key again: the old entry's pages make room for the new one
    assert hbm.put(key(0), block(9)) == 512
    assert torch.equal(hbm.get(key(0)), block(9))
    assert hbm.usage().blocks == 1 and hbm.usage().used_bytes == 512


def test_a_replace_while_the_old_entry_is_read_is_tier_full_and_keeps_it() -> None:
    # its own room is held by the reader: the old entry was unpublished, then the alloc failed
    hbm = HbmTier(512, page_bytes=256)
    hbm.put(key(0), block(0))
    with hbm._reading(key(0)):
        with pytest.raises(TierFull):
            hbm.put(key(0), block(9))
        assert key(0) in hbm
    assert torch.equal(hbm.get(key(0)), block(0))
    assert hbm.put(key(0), block(9)) == 512  # no reader: its room is had


def test_missing_keys_and_drop_of_absent_key() -> None:
    hbm = HbmTier(1024, page_bytes=256)
    with pytest.raises(KeyError):
        hbm.get(key(7))
    with pytest.raises(KeyError):
        hbm.nbytes(key(7))
    assert hbm.drop(key(7)) == 0
    hbm.put(key(7), block(7))
    assert hbm.nbytes(key(7)) == 512 and key(7) in hbm and len(hbm) == 1


def test_get_onto_another_device_string() -> None:
    hbm = HbmTier(1024, page_bytes=256, device="cpu")
    hbm.put(key(1), block(1))
    assert hbm.get(key(1), device="cpu").device.type == "cpu"


def test_drop_while_reading_defers_freeing_pages_to_the_reader() -> None:
    hbm = HbmTier(512, page_bytes=256)
    hbm.put(key(0), block(0))
    with hbm._reading(key(0)):
        # dropped while a reader holds it: gone from the index, pages still held
        assert hbm.drop(key(0)) == 512
        assert key(0) not in hbm
        assert hbm.pool.free_pages == 0
        assert not hbm.can_put(block(1))
    assert hbm.pool.free_pages == 2
    hbm.put(key(1), block(1))


def test_concurrent_put_get_drop_keep_blocks_intact() -> None:
    hbm = HbmTier(256 * 20, page_bytes=256)
    errors: list[BaseException] = []

    def worker(base: int) -> None:
        try:
            for i in range(200):
                k = key(base + i % 5)
                b = block(base + i % 5)
                try:
                    hbm.put(k, b)
                except TierFull:
                    pass
                try:
                    assert torch.equal(hbm.get(k), b)
                except KeyError:
                    pass  # our put found no room; each thread owns its keys, so no one else drops them
                if i % 3 == 0:
                    hbm.drop(k)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert hbm.usage().used_bytes == 512 * hbm.usage().blocks <= hbm.usage().capacity_bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="needs CUDA"):
        HbmTier(1024, device="cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_takes_cpu_blocks_and_returns_either_device() -> None:
    hbm = HbmTier(1 << 20, device="cuda:0", page_bytes=256)
    b = block(3)
    hbm.put(key(3), b)
    on_gpu = hbm.get(key(3))
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), b)
    assert torch.equal(hbm.get(key(3), device="cpu"), b)
    hbm.put(key(4), b.cuda())
    assert torch.equal(hbm.get(key(4), device="cpu"), b)


def test_locate_many_places_each_block_where_it_is_in_the_order_asked() -> None:
    hbm = HbmTier(4096, page_bytes=256)
    for i in range(4):
        hbm.put(key(i), block(i))
    hbm.drop(key(1))
    hbm.put(key(4), block(4))  # takes key 1's freed pages: generation 2 there (they start at 1)
    places = hbm.locate_many([key(4), key(0), key(3)])
    arena = hbm.pool._flat
    for i, place in zip([4, 0, 3], places, strict=True):
        data = torch.cat([arena[o : o + n] for o, n in place.extents])
        assert torch.equal(data.view(torch.bfloat16).view(SHAPE), block(i))
        assert place.nbytes == 512 and len(place.pages) == 2
        assert list(place.gens) == list(hbm.pool.gens[place.pages])
    assert list(places[0].gens) == [2, 2] and list(places[1].gens) == [1, 1]
    assert [p.extents for p in places] == [hbm.locate(key(i)).extents for i in (4, 0, 3)]
    with pytest.raises(KeyError):  # one absent: none located
        hbm.locate_many([key(0), key(1)])
    assert hbm.locate_many([]) == []
