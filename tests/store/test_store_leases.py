"""Store: pins are leases; TTL expiry on the writer thread."""

from __future__ import annotations

import time

import pytest
import torch

from kvstore.keys import block_keys
from kvstore.store import reads
from tests.store.storekit import NS, Clock, T, kv, tokens


def test_pinned_blocks_are_never_demoted_until_released(make_store) -> None:
    s = make_store(nvme=False)
    a = tokens(2, seed=1)
    s.put(NS, a, kv(2 * T, 1))
    handle = s.pin(block_keys(NS, a))
    # hbm holds 4: two more prompts of 2 push everything unpinned out of hbm, never a
    s.put(NS, tokens(2, seed=2), kv(2 * T, 2))
    s.put(NS, tokens(2, seed=3), kv(2 * T, 3))
    assert s.lookup(NS, a).tiers == ["hbm", "hbm"]
    assert s.stats().pinned == 2
    # released: a is the least recently used and goes down next
    assert s.release(handle)
    s.put(NS, tokens(2, seed=4), kv(2 * T, 4))
    assert s.lookup(NS, a).tiers == ["ram", "ram"]
    assert s.check_integrity() == []


def test_a_pin_lapses_when_its_lease_ends(make_store) -> None:
    clock = Clock()
    s = make_store(clock=clock)
    a = tokens(2, seed=1)
    s.put(NS, a, kv(2 * T, 1))
    handle = s.pin(block_keys(NS, a), lease=30.0)
    s.put(NS, tokens(2, seed=2), kv(2 * T, 2))
    s.put(NS, tokens(2, seed=3), kv(2 * T, 3))
    assert s.lookup(NS, a).tiers == ["hbm", "hbm"]
    # the client died: 31 s later its pin no longer protects anything
    clock.advance(31)
    assert s.stats().pinned == 0
    s.put(NS, tokens(4, seed=4), kv(4 * T, 4))
    assert s.lookup(NS, a).tiers == ["ram", "ram"]
    assert not s.release(handle)  # already gone


def test_a_located_read_s_pins_are_renewed_while_they_hold_never_after(make_store) -> None:
    # the daemon locates the pool blocks, then decodes the blocks after them into staging (which can
    # wait: earlier gets' blocks being stored, a slow disk); the client's lease starts after that,
    # and the located blocks must stay pinned that long, not lapse a lease after the locate
    clock = Clock()
    s = make_store(clock=clock)
    a = tokens(2, seed=1)
    s.put(NS, a, kv(2 * T, 1))
    located = s.locate(NS, a, {0}, lease=5.0, count=False)
    assert len(located.places) == 2 and s.stats().pinned == 2
    clock.advance(4)
    assert s.renew(located, 5.0)
    clock.advance(4)  # 8 s after the locate, 4 s after the renewal
    assert s.stats().pinned == 2
    assert s.renew(located, 1.0) and s.stats().pinned == 2  # never shortened
    clock.advance(1.5)
    assert s.stats().pinned == 0 and not s.renew(located, 5.0)  # lapsed: it is not taken again
    s.finish(located, 0)
    assert s.stats().pinned == 0


def test_a_pin_lasts_its_lease_whatever_the_wall_clock_does(make_store) -> None:
    # pins ran on the wall clock (the access times' clock): set back an hour (an NTP step), every
    # pin then held its blocks an hour past its lease. Leases run on their own monotonic clock
    wall, leases = Clock(), Clock()
    s = make_store(clock=wall, lease_clock=leases)
    a = tokens(2, seed=1)
    s.put(NS, a, kv(2 * T, 1))
    s.pin(block_keys(NS, a), lease=30.0)
    wall.advance(-3600)
    leases.advance(31)
    assert s.stats().pinned == 0
    wall.advance(7200)
    s.pin(block_keys(NS, a), lease=30.0)
    assert s.stats().pinned == 2


def test_a_pin_covers_only_blocks_that_are_held(make_store) -> None:
    s = make_store(nvme=False)
    toks = tokens(3)
    s.put(NS, toks[: 2 * T], kv(2 * T))
    assert len(s.pin(block_keys(NS, toks)).keys) == 2


def test_blocks_past_their_ttl_expire_in_the_background_with_descendants(make_store) -> None:
    clock = Clock()
    s = make_store(clock=clock, ttl=7 * 86400.0, tick=0.02)
    old, new = tokens(3, seed=1), tokens(2, seed=2)
    s.put(NS, old, kv(3 * T, 1), session="old")
    clock.advance(6 * 86400)
    s.put(NS, new, kv(2 * T, 2))
    assert s.flush(10)
    # a day later the first prompt is 7 days old: the writer thread's tick drops it (all tiers)
    clock.advance(86400 + 1)
    deadline = time.monotonic() + 10
    while s.lookup(NS, old).matched_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.lookup(NS, old).matched_blocks == 0
    assert s.lookup(NS, new).matched_blocks == 2
    assert s.stats().expired == 3
    assert not set(block_keys(NS, old)) & set(s.tiers[-1].keys())
    # the session's tail followed its blocks out
    assert s.session("old").info.blocks == 0
    assert s.check_integrity() == []


def test_an_access_renews_the_ttl(make_store) -> None:
    clock = Clock()
    s = make_store(clock=clock, ttl=100.0, tick=0.02)
    toks = tokens(2)
    s.put(NS, toks, kv(2 * T))
    clock.advance(90)
    s.get(NS, toks)
    clock.advance(90)  # 180 s after the put, 90 s after the get
    time.sleep(0.2)  # several ticks
    assert s.lookup(NS, toks).matched_blocks == 2


def test_an_access_within_a_short_ttl_survives_a_restart(make_store, tmp_path) -> None:
    # ttl 300 s: a block used 290 s after it was stored, the store closed and opened 20 s later,
    # is 20 s old, not 310 (access times reach disk every tenth of the TTL, not every 10 minutes)
    clock = Clock(1_000_200.0)  # the start of a 10-minute slot
    path = tmp_path / "lmdb"
    s = make_store(path=path, clock=clock, ttl=300.0, tick=0.02)
    toks = tokens(2)
    s.put(NS, toks, kv(2 * T))
    assert s.flush(10)
    clock.advance(290)
    assert s.get(NS, toks).matched_blocks == 2
    assert s.flush(10)
    s.close()
    clock.advance(20)
    s2 = make_store(path=path, clock=clock, ttl=300.0, tick=0.02)
    time.sleep(0.2)  # several ticks, each a TTL sweep
    assert s2.lookup(NS, toks).matched_blocks == 2


def test_an_access_in_the_slot_its_record_was_written_survives_a_restart(make_store, tmp_path) -> None:
    # a record's access time is written when it moves to another slot (30 s: a tenth of a 300 s
    # TTL): a read 20 s after the put leaves it at the put's time. After a restart 290 s after that
    # read, the block is 290 s old (the record is taken as the end of its slot), not 310; a block
    # idle since a slot before is past its TTL and goes
    clock = Clock(1_000_140.0)  # the start of a slot
    path = tmp_path / "lmdb"
    s = make_store(path=path, clock=clock, ttl=300.0, tick=0.02)
    used, idle = tokens(2, seed=1), tokens(2, seed=2)
    s.put(NS, idle, kv(2 * T, 2))  # t = -60
    clock.advance(60)
    s.put(NS, used, kv(2 * T, 1))  # t = 0, the start of another slot
    assert s.flush(10)
    clock.advance(20)
    assert s.get(NS, used).matched_blocks == 2  # t = 20, the same slot: its record keeps t = 0
    assert s.flush(10)
    s.close()
    clock.advance(290)  # t = 310
    s2 = make_store(path=path, clock=clock, ttl=300.0, tick=0.02)
    deadline = time.monotonic() + 10
    while s2.lookup(NS, idle).matched_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s2.lookup(NS, idle).matched_blocks == 0  # last used at t = -60: 370 s ago
    assert s2.lookup(NS, used).matched_blocks == 2  # last used at t = 20: 290 s ago
    s2.close()


def test_a_prefix_continued_later_lives_as_long_as_its_new_blocks(make_store) -> None:
    # an engine saves as it computes: a put from block 2 never touches blocks 0-1; past their TTL
    # they went, and the blocks stored after them went too (a lookup starts at block 0); kept for
    # them, they then stayed up to a TTL longer than the blocks they were kept for
    clock = Clock()
    s = make_store(clock=clock, ttl=3600.0, tick=0.02)
    toks, x = tokens(4), kv(4 * T)
    s.put(NS, toks, x[:, :, : 2 * T])  # t = 0
    clock.advance(10)
    assert s.put(NS, toks, x[:, :, 2 * T :], start_block=2).stored == 2  # t = 10
    clock.advance(2990)
    s.put(NS, tokens(1, seed=5), kv(T, 5))  # t = 3000: another prompt
    clock.advance(605)  # t = 3605: blocks 0-1 are past the TTL, 2-3 not
    time.sleep(0.2)  # several ticks, each a TTL sweep
    assert s.lookup(NS, toks).matched_blocks == 4 and s.stats().expired == 0
    clock.advance(10)  # t = 3615: blocks 2-3 are past it too: all four go, the other prompt stays
    deadline = time.monotonic() + 10
    while s.lookup(NS, toks).matched_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    assert s.lookup(NS, toks).matched_blocks == 0 and s.stats().expired == 4
    assert s.lookup(NS, tokens(1, seed=5)).matched_blocks == 1
    assert s.check_integrity() == []


def test_a_get_whose_result_cannot_be_made_leaves_no_pin(make_store, monkeypatch) -> None:
    s = make_store(nvme=False)
    toks = tokens(2)
    s.put(NS, toks, kv(2 * T))

    def no_memory(*_: object) -> None:
        raise torch.cuda.OutOfMemoryError("out of memory")  # what a full device answers

    monkeypatch.setattr(reads, "empty_kv", no_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        s.get(NS, toks)
    assert s.stats().pinned == 0


def test_a_restart_with_a_shorter_ttl_keeps_a_block_read_within_it(make_store, tmp_path) -> None:
    # records written under a TTL of 10 minutes lag their last read by up to a minute (its slot);
    # restored under a TTL of 30 s (a slot of 3 s), a block read 20 s before the restart was taken as
    # read a minute before, and expired at once
    clock = Clock(1_000_200.0)  # the start of a minute
    path = tmp_path / "lmdb"
    s = make_store(path=path, clock=clock, ttl=600.0, tick=0.02)
    toks = tokens(2)
    s.put(NS, toks, kv(2 * T))
    assert s.flush(10)
    clock.advance(20)
    assert s.get(NS, toks).matched_blocks == 2  # in the put's slot: its record keeps the put's time
    assert s.flush(10)
    s.close()
    clock.advance(16)  # 16 s after the read, 36 after the put
    s2 = make_store(path=path, clock=clock, ttl=30.0, tick=0.02)
    time.sleep(0.3)  # several ticks, each a TTL sweep
    assert s2.lookup(NS, toks).matched_blocks == 2
    s2.close()
