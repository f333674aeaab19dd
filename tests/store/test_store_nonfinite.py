"""Store: K/V holding inf or NaN is kept as given where no codec is in the way; a block a codec below cannot
take is dropped, never wedging room-making."""

from __future__ import annotations

import time

import pytest
import torch

from tests.store.storekit import NS, T, kv, same, tokens


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_put_holding_inf_or_nan_is_kept_raw_and_dropped_where_a_codec_cannot_take_it(
    make_store, bad: float
) -> None:
    """hbm keeps what it was given (a get returns it as put); the fp8 tier below cannot encode it: a
    demotion drops it rather than picking it again and again (every later put failing on it)."""
    s = make_store(hbm_blocks=2, ram_codec="fp8", nvme=False)
    b = tokens(2, seed=2)
    x = kv(2 * T, 2)
    x[1, 1, T + 2, 0, 5] = bad
    assert s.put(NS, b, x, session="b").stored == 2
    got = s.get(NS, b).kv
    assert torch.equal(got.isnan(), x.isnan()) and same(got.nan_to_num(), x.nan_to_num())
    # puts go on: b0 (finite) moves down to ram; b1 cannot, and is dropped
    for seed in (3, 4, 5):
        c = tokens(1, seed=seed)
        r = s.put(NS, c, kv(T, seed))
        assert (r.stored, r.failed) == (1, []), r
    assert s.lookup(NS, b).tiers == ["ram"]
    assert s.stats().unencodable == 1
    assert s.check_integrity() == []


def test_a_put_into_a_lossy_first_tier_refuses_the_block_it_cannot_encode(make_store) -> None:
    s = make_store(hbm_blocks=0, ram_blocks=4, ram_codec="fp8", nvme=False)
    b = tokens(2, seed=2)
    x = kv(2 * T, 2)
    x[0, 0, T, 0, 0] = float("nan")
    r = s.put(NS, b, x)
    # the block is refused with the codec's reason, not "every tier is full"
    assert r.stored == 1 and [(f.block, f.code) for f in r.failed] == [(1, "codec")], r
    assert s.lookup(NS, b).matched_blocks == 1
    assert s.put(NS, tokens(1, seed=3), kv(T, 3)).stored == 1


def test_a_block_the_ram_codec_cannot_encode_is_dropped_not_demoted_forever(
    make_store, caplog: pytest.LogCaptureFixture
) -> None:
    # fp8 refuses NaN: the block can never move down
    s = make_store(hbm_blocks=2, ram_codec="fp8", nvme=False)
    bad = tokens(1, seed=1)
    x = kv(T, 1)
    x[0, 0, 0, 0, 0] = float("nan")
    assert s.put(NS, bad, x).stored == 1
    c = tokens(1, seed=2)
    assert s.put(NS, c, kv(T, 2)).stored == 1  # hbm full: [bad0 c0]
    # put [d0] -> bad0, the LRU block, cannot be encoded for ram: dropped, and d0 goes in
    d = tokens(1, seed=3)
    r = s.put(NS, d, kv(T, 3))
    assert (r.stored, r.failed) == (1, []), r
    assert s.lookup(NS, bad).matched_blocks == 0
    assert s.lookup(NS, c).tiers == ["hbm"] and s.lookup(NS, d).tiers == ["hbm"]
    # later puts go on, and demote as usual: c0 and d0 move down to ram
    for seed in (4, 5):
        r = s.put(NS, tokens(1, seed=seed), kv(T, seed))
        assert (r.stored, r.failed) == (1, []), r
    assert s.lookup(NS, c).tiers == ["ram"] and s.lookup(NS, d).tiers == ["ram"]
    assert s.stats().tiers["hbm"].demotions == 2
    # counted, and logged once
    assert s._mover.unencodable == 1
    assert sum("cannot encode block" in r.getMessage() for r in caplog.records) == 1
    assert s.check_integrity() == []


def test_a_block_nvme_cannot_encode_is_dropped_from_the_write_through_and_flush_stays_honest(
    make_store,
) -> None:
    """Write-through promises every block reaches the disk, and int4 refuses NaN: the block is
    dropped (and what follows it), so flush answers durable again, not False for good while the
    write is retried every tick (a failure counted each time)."""
    s = make_store(hbm_blocks=4, nvme=True)
    good = tokens(2, seed=1)
    assert s.put(NS, good, kv(2 * T, 1)).stored == 2
    assert s.flush(10)
    b = tokens(2, seed=2)
    x = kv(2 * T, 2)
    x[0, 0, 1, 0, 0] = float("nan")  # block 0: block 1 was computed over it
    assert s.put(NS, b, x).stored == 2
    assert s.flush(10)
    assert s.lookup(NS, b).matched_blocks == 0 and s.lookup(NS, good).matched_blocks == 2
    failures = s.stats().write_failures
    time.sleep(0.3)  # ticks of 0.05 s: nothing is retried
    assert s.stats().write_failures == failures and s.stats().unencodable == 1
    assert s.check_integrity() == []
