"""Store: new blocks enter hbm, LRU demotion hbm -> ram -> nvme, leaf-first drops, promotion on hit."""

from __future__ import annotations

import torch

from kvstore.keys import block_keys
from kvstore.results import NO_ROOM, EvictFilter
from tests.store.storekit import NS, Clock, T, close_to, kv, same, tokens


def tiers_of(s, toks) -> list[str]:
    return s.lookup(NS, toks).tiers


def test_hbm_full_moves_the_least_recently_used_block_to_ram(make_store) -> None:
    s = make_store(nvme=False)
    a, b = tokens(2, seed=1), tokens(2, seed=2)
    s.put(NS, a, kv(2 * T, 1))
    s.put(NS, b, kv(2 * T, 2))
    # hbm holds 4: [a0 a1 b0 b1]; touch a so that b is the least recently used
    s.get(NS, a)
    c = tokens(1, seed=3)
    # put [c0] -> b's leaf b1 moves to ram (leaf-first among the LRU), c0 enters hbm
    s.put(NS, c, kv(T, 3))
    assert tiers_of(s, c) == ["hbm"]
    assert tiers_of(s, b) == ["hbm", "ram"]
    assert tiers_of(s, a) == ["hbm", "hbm"]
    assert s.stats().tiers["hbm"].demotions == 1
    # ram is raw here: the demoted block reads back bit-exact (and is promoted back to hbm)
    assert same(s.get(NS, b).kv, kv(2 * T, 2))
    assert s.stats().tiers["ram"].hits == 1
    assert s.check_integrity() == []


def test_put_of_a_fifth_block_moves_block_0_down(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(5)
    # hbm full: put [4] -> [0] moves to ram (every older block has a child in hbm: plain LRU)
    s.put(NS, toks, kv(5 * T))
    assert tiers_of(s, toks) == ["ram", "hbm", "hbm", "hbm", "hbm"]


def test_hits_promote_blocks_one_tier_up(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(5)
    s.put(NS, toks, kv(5 * T))
    assert tiers_of(s, toks)[0] == "ram"
    # get reads [0] from ram -> a copy goes up to hbm (some other block goes down to make room)
    got = s.get(NS, toks)
    assert got.tiers[0] == "ram" and same(got.kv, kv(5 * T))
    assert tiers_of(s, toks)[0] == "hbm"
    assert s.stats().tiers["hbm"].promotions == 1
    # between memory tiers a promotion is a move: block 0 no longer takes room in ram
    assert block_keys(NS, toks)[0] not in s.tiers[1]
    assert s.check_integrity() == []


def test_promotion_from_nvme_keeps_the_nvme_copy(make_store, tmp_path) -> None:
    s = make_store(path=tmp_path / "lmdb")
    toks = tokens(2)
    s.put(NS, toks, kv(2 * T))
    s.close()
    s = make_store(path=tmp_path / "lmdb")
    assert tiers_of(s, toks) == ["nvme", "nvme"]
    s.get(NS, toks)
    assert tiers_of(s, toks) == ["ram", "ram"]
    assert set(block_keys(NS, toks)) <= set(s.tiers[-1].keys())


def test_promotion_can_be_switched_off(make_store) -> None:
    from kvstore.config import PolicyConfig

    s = make_store(nvme=False, policy=PolicyConfig(promote_on_hit=False))
    toks = tokens(5)
    s.put(NS, toks, kv(5 * T))
    s.get(NS, toks)
    assert tiers_of(s, toks)[0] == "ram"
    assert s.stats().tiers["hbm"].promotions == 0


def test_last_tier_full_drops_whole_prefixes_leaf_first(make_store) -> None:
    s = make_store(nvme=False)  # 4 hbm + 4 ram, nothing below
    a, b, c = (tokens(4, seed=i) for i in (1, 2, 3))
    for i, t in enumerate((a, b, c), 1):
        assert s.put(NS, t, kv(4 * T, i)).stored == 4
    # c pushed b down to ram and a out of the store: a's blocks went leaf first, none is left orphaned
    assert tiers_of(s, c) == ["hbm"] * 4
    assert tiers_of(s, b) == ["ram"] * 4
    assert tiers_of(s, a) == []
    assert s.stats().blocks == 8
    assert s.check_integrity() == []


def test_a_prefix_longer_than_every_tier_stores_what_fits(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(10)
    # 8 blocks fit; dropping [0] would take its whole chain, so [8, 9] are refused instead
    r = s.put(NS, toks, kv(10 * T))
    assert r.stored == 8 and [(i, c) for i, c, _ in r.failed] == [(8, NO_ROOM), (9, NO_ROOM)]
    assert s.lookup(NS, toks).matched_blocks == 8
    assert s.check_integrity() == []


def test_ram_full_demotes_to_nvme_reencoded(make_store) -> None:
    s = make_store(write_through=False)
    toks, data = tokens(10), kv(10 * T)
    # 10 blocks: [0, 1] end up on nvme (int4), [2..5] in ram, [6..9] in hbm
    assert s.put(NS, toks, data).stored == 10
    assert tiers_of(s, toks) == ["nvme"] * 2 + ["ram"] * 4 + ["hbm"] * 4
    assert s.stats().tiers["ram"].demotions == 2
    got = s.get(NS, toks, device="cpu")
    assert got.matched_blocks == 10
    assert close_to(got.kv[:, :, : 2 * T], data[:, :, : 2 * T])
    assert same(got.kv[:, :, 2 * T :], data[:, :, 2 * T :])
    assert s.check_integrity() == []


def test_nvme_full_drops_least_recently_used_prefixes(make_store) -> None:
    # an nvme of 1 MiB holds a few hundred tiny int4 blocks: fill it well past that
    s = make_store(nvme_capacity=1 << 20)
    prompts = [tokens(8, seed=i) for i in range(60)]
    for i, p in enumerate(prompts):
        s.put(NS, p, kv(8 * T, i))
        assert s.flush(10)
    st = s.stats()
    assert st.tiers["nvme"].used <= st.tiers["nvme"].capacity
    assert st.tiers["nvme"].evictions > 0
    # the newest prompt is whole; the oldest went first
    assert s.lookup(NS, prompts[-1]).matched_blocks == 8
    assert s.lookup(NS, prompts[0]).matched_blocks == 0
    assert s.check_integrity() == []


def test_get_pins_nothing_after_it_returns(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(2)
    s.put(NS, toks, kv(2 * T))
    s.get(NS, toks)
    assert s.stats().pinned == 0
    assert block_keys(NS, toks)[0] in {k for k in s.tiers[0].keys()}


def test_demotion_frames_are_encoded_outside_the_lock(tmp_path) -> None:
    from typing import Any, cast

    from kvstore.codecs.raw import RawCodec
    from kvstore.store.engine import Store
    from kvstore.tiers.hbm import HbmTier
    from kvstore.tiers.ram import RamTier
    from tests.store.storekit import HBM_PAGE, RAM_PAGE

    class Watching(RawCodec):
        """A raw codec that notes, at each encode, whether the store's lock was held."""

        locked: list[bool] = []

        def encode(self, block: torch.Tensor) -> bytearray:
            # store._lock is a threading.RLock: both its C and Python versions have _is_owned at
            # runtime, but typeshed does not declare it
            self.locked.append(cast(Any, store._lock)._is_owned())
            return super().encode(block)

    store = Store(
        HbmTier(4 * HBM_PAGE, page_bytes=HBM_PAGE),
        RamTier(8 * RAM_PAGE, Watching(), page_bytes=RAM_PAGE, pin_memory=False),
        None,
    )
    try:
        store.put(NS, tokens(4, seed=1), kv(4 * T, 1))
        # hbm full: put 4 more -> the first prompt's 4 blocks are encoded for ram before the lock
        store.put(NS, tokens(4, seed=2), kv(4 * T, 2))
        assert store.lookup(NS, tokens(4, seed=1)).tiers == ["ram"] * 4
        assert Watching.locked == [False] * 4
    finally:
        store.close()


def test_a_promotion_that_finds_no_room_leaves_the_block_where_it_was_read(make_store) -> None:
    # the ram copy stays until hbm holds the block: a promotion to a full (pinned) hbm never drops it,
    # and a read meanwhile finds it (the copy dropped first, a read in the gap took it for lost)
    s = make_store(hbm_blocks=2, ram_blocks=6, nvme=False)
    a, b = tokens(2, seed=1), tokens(2, seed=2)
    s.put(NS, a, kv(2 * T, 1))
    s.put(NS, b, kv(2 * T, 2))
    assert s.lookup(NS, a).tiers == ["ram", "ram"]
    s.pin(block_keys(NS, b), lease=100)  # another client reads b: hbm has no room to make
    ram = s.tiers[1]
    e0 = s._index.get(block_keys(NS, a)[0])
    drops: list[bytes] = []
    real_drop = ram.drop

    def drop(key: bytes) -> int:
        drops.append(key)
        return real_drop(key)

    ram.drop = drop
    with s._lock:
        assert s._mover.promote(e0, ram.get(e0.key), 0, 1) is False
    ram.drop = real_drop
    assert drops == [] and s._data.read(e0, torch.device("cpu")) is not None
    assert s.lookup(NS, a).tiers == ["ram", "ram"]
    assert same(s.get(NS, a).kv, kv(2 * T, 1))
    assert s.check_integrity() == []


def test_a_hit_never_loses_a_block_that_fits_neither_tier_after_its_promotion_made_room() -> None:
    # blocks of two layouts in one pool: making room in hbm for a 3-page block pushes a 1-page block
    # into the ram its move would free; with the copy dropped first, the block fit neither tier and
    # was dropped, pinned by another client as it was
    from kvstore.codecs import get_codec
    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout
    from kvstore.store.engine import Store
    from kvstore.tiers.hbm import HbmTier
    from kvstore.tiers.ram import RamTier

    small = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_tokens=4)
    big = KVLayout(num_layers=6, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_tokens=4)
    ns_s, ns_b = Namespace("small", small), Namespace("big", big)

    def block(layout: KVLayout, n: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(layout.shape(n), generator=g).to(torch.bfloat16)

    s = Store(
        HbmTier(4 * 1024, page_bytes=1024),  # 4 pages: the big block takes 3
        RamTier(2 * 2048, get_codec("raw"), page_bytes=2048, pin_memory=False),  # one big frame
        None,
    )
    try:
        e_tokens, a_tokens, c_tokens = list(range(4)), list(range(1000, 1008)), list(range(2000, 2004))
        s.put(ns_b, e_tokens, block(big, 4, 1))
        s.put(ns_s, a_tokens, block(small, 8, 2))  # pushes the big block down to ram
        s.put(ns_s, c_tokens, block(small, 4, 3))
        assert s.lookup(ns_b, e_tokens).tiers == ["ram"]
        s.pin(block_keys(ns_b, e_tokens), lease=60)  # another client holds the big block
        s.pin([block_keys(ns_s, a_tokens)[1], *block_keys(ns_s, c_tokens)], lease=60)
        got = s.get(ns_b, e_tokens)
        assert got.matched_blocks == 1 and got.kv is not None and same(got.kv, block(big, 4, 1))
        assert s.lookup(ns_b, e_tokens).tiers == ["ram"]  # hbm had no room: it stays where it was
        assert s.check_integrity() == []
    finally:
        s.close()


def test_a_located_block_is_not_moved_up_under_its_reader(make_store) -> None:
    # a shared-memory reader holds a's ram pages by lease; another client's get of a promoted them
    # to hbm, freed the ram pages, and the located read came back a miss
    s = make_store(hbm_blocks=2, ram_blocks=6, nvme=False)
    a, b = tokens(2, seed=1), tokens(2, seed=2)
    s.put(NS, a, kv(2 * T, 1))
    s.put(NS, b, kv(2 * T, 2))
    located = s.locate(NS, a, tiers={1})
    pool = s.tiers[1].pool
    before = [pool.gens[p.pages].copy() for _, _, p in located.places]
    assert s.get(NS, a).matched_blocks == 2
    assert all((pool.gens[p.pages] == g).all() for (_, _, p), g in zip(located.places, before, strict=True))
    s.finish(located, 0)
    s.pin(block_keys(NS, a))  # another client's plain pin (a get, a put continuing a): moved up
    assert s.get(NS, a).tiers == ["ram", "ram"]
    assert s.lookup(NS, a).tiers == ["hbm", "hbm"]
    assert s.check_integrity() == []


def test_a_block_ram_has_no_room_for_goes_on_to_nvme_not_away(make_store) -> None:
    """hbm [2]  ram [3, every block pinned by a read]  nvme (write-through off: nothing there yet)

    put A (2 blocks) -> hbm holds A;  put B (2 blocks) -> A must leave hbm, ram cannot take it:
    A goes on to nvme (re-encoded there), not out of every tier, and a flush is durable with it."""
    s = make_store(hbm_blocks=2, ram_blocks=3, write_through=False)
    c = tokens(3, seed=7)
    s.put(NS, c, kv(3 * T, 7))
    s.evict(EvictFilter(tier="hbm"))  # C in ram, filling it
    assert s.lookup(NS, c).tiers == ["ram"] * 3
    handle = s.pin(block_keys(NS, c))  # a reader holds C's pages
    a, b = tokens(2, seed=1), tokens(2, seed=2)
    assert s.put(NS, a, kv(2 * T, 1)).stored == 2
    assert s.put(NS, b, kv(2 * T, 2)).stored == 2
    assert s.lookup(NS, a).tiers == ["nvme", "nvme"]  # moved past the full tier, not dropped
    assert s.lookup(NS, b).tiers == ["hbm", "hbm"] and s.lookup(NS, c).tiers == ["ram"] * 3
    got = s.get(NS, a)
    assert got.matched_blocks == 2 and close_to(got.kv, kv(2 * T, 1))
    s.release(handle)
    assert s.flush(10) and s.check_integrity() == []


def test_an_operator_evicting_hbm_past_a_full_ram_moves_blocks_to_nvme(make_store) -> None:
    s = make_store(hbm_blocks=2, ram_blocks=3, write_through=False)
    c = tokens(3, seed=7)
    s.put(NS, c, kv(3 * T, 7))
    s.evict(EvictFilter(tier="hbm"))
    handle = s.pin(block_keys(NS, c))
    a = tokens(2, seed=1)
    s.put(NS, a, kv(2 * T, 1))
    r = s.evict(EvictFilter(tier="hbm"))
    assert r.blocks == 2 and s.lookup(NS, a).tiers == ["nvme", "nvme"]  # "moved" is what happened
    s.release(handle)


def test_nvme_drops_a_cold_prefix_it_alone_holds_before_the_disk_copy_of_one_in_memory(make_store) -> None:
    """nvme: [A0 .. A68 | A69 also in ram]  [B0 B1]     (A older than B; a get read A69 alone)

    A's head is the oldest on nvme, but the tail a drop of it starts from is held in memory: nvme lets
    go of B, which it alone holds, before A69's disk copy (whose loss leaves a flush not durable)."""
    clock = Clock()
    s = make_store(clock=clock)
    a, b = tokens(70), tokens(2, seed=5)
    s.put(NS, a, kv(70 * T))
    clock.advance(10)
    s.put(NS, b, kv(2 * T, 5))
    assert s.flush(10)
    s.evict(EvictFilter(tier="hbm"))
    s.evict(EvictFilter(tier="ram"))
    clock.advance(10)
    assert s.get(NS, a, start_block=69).matched_blocks == 1  # A69 read: promoted to ram
    assert s.lookup(NS, a).tiers == ["nvme"] * 69 + ["ram"]
    with s._lock:
        victim = s._mover.victims.victim(2, set())
    assert victim is not None and victim.key == block_keys(NS, b)[1]


def test_a_put_continuing_a_prefix_keeps_its_head_as_warm_as_its_tail(make_store) -> None:
    clock = Clock()
    s = make_store(clock=clock)
    a, full = tokens(4), kv(4 * T)
    s.put(NS, a[: 2 * T], full[:, :, : 2 * T])
    clock.advance(100)
    s.put(NS, a, full[:, :, 2 * T :], start_block=2)  # an engine stores only the new blocks
    with s._lock:
        times = [s._index.get(k).last_access for k in block_keys(NS, a)]
    assert times == [clock()] * 4
