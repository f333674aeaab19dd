"""A disk that refuses writes (I/O errors) while memory fills up: no block a flush still owes is lost.

::

    nvme fails a write (TierIOError)          for DISK_BACKOFF (1 s), or until it takes a block:
      -> blocks not on disk yet ("owed")        not pushed out of memory for room, and no block on
                                                disk with one of them below it is dropped either
      -> room comes from copies already on disk; a put that finds none is refused (tier_io)
      -> flush answers not durable; once the disk takes writes, every owed block is written

A full disk is not a refusal: it acts as a smaller capacity (old blocks make way, see
tests/hardening/test_disk.py). The failures are injected into a real NvmeTier (its ``put``
replaced), the one thing here that is not as it runs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch

from kvstore.keys import block_keys
from kvstore.results import EvictFilter
from kvstore.store.engine import Store
from kvstore.tiers.base import TierIOError
from tests.store.conftest import StoreFactory
from tests.store.storekit import NS, Clock, T, close_to, kv, tokens


class Disk:
    """The store's nvme tier refusing every write from ``refuse()`` until ``recover()``."""

    def __init__(self, s: Store) -> None:
        self.nvme = s.tiers[-1]
        self._put = self.nvme.put

    def refuse(self) -> None:
        def refusing(*a: Any, **kw: Any) -> Any:
            raise TierIOError("injected: the disk refuses every write")

        self.nvme.put = refusing  # type: ignore[method-assign]

    def recover(self) -> None:
        self.nvme.put = self._put  # type: ignore[method-assign]


def durable_again(s: Store) -> bool:
    """Whether a flush is durable once the disk is back. The first may not be: a write that failed
    just before (the writer was on it) leaves its block owed from before that flush began, and that
    flush says so; the blocks are written, and the next one is durable."""
    return any(s.flush(10) for _ in range(3))


def nvme_keys(s: Store) -> set[bytes]:
    return set(s.tiers[-1].keys())


def where(s: Store, toks: list[int]) -> list[str]:
    """Each block's tiers by initial ("hn": hbm and nvme), "-" for a block not held."""
    out = []
    for k in block_keys(NS, toks):
        e = s._index.get(k)
        out.append("-" if e is None else "".join(s.tiers.names[t][0] for t in e.tier_list()))
    return out


def written_then_refusing(s: Store) -> tuple[Disk, list[int]]:
    """A 4-block prefix put and flushed, then a disk that refuses every write: (the disk, the prefix)."""
    a = tokens(4, seed=1)
    s.put(NS, a, kv(4 * T, 1))
    assert s.flush(10)
    disk = Disk(s)
    disk.refuse()
    return disk, a


def full_of_two_conversations(s: Store) -> tuple[list[int], torch.Tensor, list[int], torch.Tensor, int]:
    """nvme filled as it runs: first block 0 of conversation p (oldest of all), then conversation x,
    each block written, until nvme has no room for another. Returns p's tokens and K/V (2 blocks:
    block 1 not stored), x's (400 blocks' worth) and how many blocks of x are stored."""
    nvme = s.tiers.nvme
    assert nvme is not None
    p, p_kv = tokens(2, seed=3), kv(2 * T, 3)
    s.put(NS, p[:T], p_kv[:, :, :T])
    assert s.flush(10)
    x, x_kv = tokens(400, seed=7), kv(400 * T, 7)
    n = 0
    while nvme.can_put(kv(T, 0), 5):
        s.put(NS, x[: (n + 1) * T], x_kv[:, :, n * T : (n + 1) * T], start_block=n)
        assert s.flush(10)
        n += 1
    return p, p_kv, x, x_kv, n


def test_a_block_the_disk_refuses_stays_in_memory_and_is_written_once_it_recovers(make_store) -> None:
    # the disk refuses every write while hbm and ram fill up: pushing a block down to nvme fails.
    # Dropping it there (as eviction for room would) lost it, and once the disk was back flush called
    # the store durable without it. Kept instead: the put that needs its room is refused, flush says not
    # durable, and once the disk takes writes again every block whose put was answered is on it
    s = make_store(hbm_blocks=4, ram_blocks=4)
    disk = Disk(s)
    disk.refuse()
    held = [tokens(4, seed=1), tokens(4, seed=2)]
    for i, toks in enumerate(held):
        assert s.put(NS, toks, kv(4 * T, i)).stored == 4  # hbm, then ram
    r = s.put(NS, tokens(4, seed=3), kv(4 * T, 3))  # needs room that only the disk could give
    assert r.stored == 0 and [f.code for f in r.failed] == ["tier_io"] * 4
    assert not s.flush(1.0)
    assert s.stats().write_failures > 0
    for toks in held:
        assert s.lookup(NS, toks).matched_blocks == 4
    assert s.check_integrity() == []
    disk.recover()
    assert durable_again(s)
    for i, toks in enumerate(held):
        assert set(block_keys(NS, toks)) <= nvme_keys(s)
        got = s.get(NS, toks)
        assert got.matched_tokens == 4 * T and close_to(got.kv, kv(4 * T, i))
    # the disk took blocks again: no back-off left, blocks go down to it, and puts find room at once
    assert s.put(NS, tokens(4, seed=3), kv(4 * T, 3)).stored == 4
    assert s.check_integrity() == []


def test_while_the_disk_refuses_room_comes_from_copies_already_on_it(make_store: StoreFactory) -> None:
    # memory holds blocks not yet on disk and copies of blocks that are on disk: new blocks find room
    # by letting those copies go (the blocks stay on disk), never by dropping the others, and a put
    # is not refused while such a copy is left
    s = make_store(hbm_blocks=4, ram_blocks=4)
    disk, a = written_then_refusing(s)
    first = tokens(1, seed=2)
    assert s.put(NS, first, kv(T, 2)).stored == 1
    assert not s.flush(0.5)  # its write failed: the store knows the disk refuses
    later = [first] + [tokens(2, seed=i) for i in (3, 4, 5)]
    for i, toks in enumerate(later[1:]):
        assert s.put(NS, toks, kv(2 * T, i)).stored == 2
    assert s.lookup(NS, a).matched_blocks == 4  # a's memory copies went; a stays, on disk
    for toks in later:
        assert "-" not in where(s, toks) and "n" not in "".join(where(s, toks))  # held, none on disk
    assert s.check_integrity() == []
    disk.recover()
    assert durable_again(s)
    for toks in later:
        assert set(block_keys(NS, toks)) <= nvme_keys(s)


def test_while_the_disk_refuses_a_block_on_it_with_one_not_yet_written_below_stays(
    make_store: StoreFactory,
) -> None:
    # nvme full (as it runs), then the disk fails: conversations on disk go on with blocks held in
    # memory only. Room made on nvme for other blocks must not drop a block on disk that one of those
    # continues: the continuation would go with it (a lookup walks from the first block)
    s = make_store(hbm_blocks=4, ram_blocks=4, nvme_capacity=1 << 20)
    p, p_kv, x, x_kv, n = full_of_two_conversations(s)
    disk = Disk(s)
    disk.refuse()
    assert s.put(NS, p, p_kv[:, :, T:], start_block=1).stored == 1
    # its write failed: the store knows the disk refuses (before that, room is made as at any time)
    assert not s.flush(0.5)
    assert s.put(NS, x[: (n + 1) * T], x_kv[:, :, n * T : (n + 1) * T], start_block=n).stored == 1
    for i in range(8):  # other clients' puts, needing room in memory and so on nvme
        s.put(NS, tokens(1, seed=1000 + i), kv(T, 1000 + i))
    assert where(s, p)[1] != "-" and where(s, x[: (n + 1) * T])[n] != "-"
    assert s.lookup(NS, p).matched_blocks == 2 and s.lookup(NS, x[: (n + 1) * T]).matched_blocks == n + 1
    assert not s.flush(1.0)
    assert s.check_integrity() == []


def test_the_writer_never_makes_room_by_dropping_the_block_it_writes(make_store: StoreFactory) -> None:
    # nvme full of one long conversation and, oldest of all, the first block of another. That one
    # goes on (a put from block 1): writing its block 1 needs room, and the least recently used
    # block is its own parent. Dropping it for room dropped block 1 with it, and flush said durable
    s = make_store(nvme_capacity=1 << 20)
    p, p_kv, x, x_kv, n = full_of_two_conversations(s)
    assert s.put(NS, p, p_kv[:, :, T:], start_block=1).stored == 1
    # the room came from x: the disk copies of its last blocks, which memory still holds. So a flush
    # is not durable (said durable, they were lost with the process), and x keeps its head on disk
    assert not s.flush(10)
    assert set(block_keys(NS, p)) <= nvme_keys(s)
    xs = block_keys(NS, x[: n * T])
    gone = [i for i, k in enumerate(xs) if k not in nvme_keys(s)]
    assert 1 <= len(gone) <= 2 and gone == list(range(n - len(gone), n))
    got = s.get(NS, p)
    assert got.matched_blocks == 2 and got.kv is not None and close_to(got.kv, p_kv)
    assert s.lookup(NS, x[: n * T]).matched_blocks == n
    assert s.check_integrity() == []


def test_evict_of_a_tier_reports_only_what_left_it(make_store: StoreFactory) -> None:
    # evict --tier ram while the disk refuses: blocks not yet on disk cannot move down and stay;
    # the reply counts only the copies that went
    s = make_store(hbm_blocks=4, ram_blocks=4)
    disk, a = written_then_refusing(s)
    b = tokens(4, seed=2)
    s.put(NS, b, kv(4 * T, 2))
    s.put(NS, tokens(2, seed=3), kv(2 * T, 3))  # pushes blocks of a and b down to ram
    in_ram = [e.key for e in s._index.entries() if e.tiers & 0b10]
    on_disk = [k for k in in_ram if k in nvme_keys(s)]
    assert on_disk and len(on_disk) < len(in_ram)  # both kinds in ram
    r = s.evict(EvictFilter(tier="ram"))
    assert sorted(r.keys) == sorted(on_disk) and r.blocks == len(on_disk) and r.moved == 0
    assert s.tiers[1].usage().blocks == len(in_ram) - len(on_disk)
    assert s.check_integrity() == []


def test_one_refused_write_is_logged_once_and_forgotten_when_the_disk_takes_the_next(
    make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    s = make_store(hbm_blocks=4, ram_blocks=4)
    disk = Disk(s)
    disk.refuse()
    with caplog.at_level(logging.WARNING, logger="kvstore.store"):
        for i in range(6):
            s.put(NS, tokens(1, seed=i), kv(T, i))
            assert not s.flush(0.2)
        refused = [r for r in caplog.records if "nvme refused block" in r.getMessage()]
        assert len(refused) == 1
        disk.recover()
        assert durable_again(s)
        assert any("takes writes again" in r.getMessage() for r in caplog.records)
    # nothing held back: new blocks go to hbm as always, old ones down to ram and nvme
    for i in range(6, 14):
        assert s.put(NS, tokens(1, seed=i), kv(T, i)).stored == 1
        assert where(s, tokens(1, seed=i))[0][0] == "h"


def test_records_the_disk_refuses_are_said_once_and_flush_is_not_durable_until_they_are_written(
    make_store: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # a read moves blocks' access times to another slot: their nvme records are rewritten at the
    # next tick. A disk that refused them logged a traceback every tick, and flush said durable with
    # the access times (which decide what expires after a restart) not on disk
    clock = Clock()
    s = make_store(clock=clock)
    toks = tokens(3, seed=4)
    s.put(NS, toks, kv(3 * T, 4))
    assert s.flush(10)
    nvme = s.tiers.nvme
    assert nvme is not None
    update = nvme.update_records

    def refusing(*a: Any, **kw: Any) -> Any:
        raise TierIOError("injected: the disk refuses every write")

    nvme.update_records = refusing  # type: ignore[method-assign]
    clock.advance(3600)
    with caplog.at_level(logging.WARNING):
        assert s.get(NS, toks).matched_blocks == 3
        assert not s.flush(10)
        time.sleep(0.3)  # six ticks
        assert not s.flush(10)
    said = [r for r in caplog.records if "refused the records of" in r.getMessage()]
    assert len(said) == 1 and not any(r.exc_info for r in caplog.records)
    nvme.update_records = update  # type: ignore[method-assign]
    assert s.flush(10)
    assert nvme.record(block_keys(NS, toks)[2]).last_access >= clock.now - 600
    # refused again, and the blocks leave the disk before it takes records: nothing is owed
    nvme.update_records = refusing  # type: ignore[method-assign]
    clock.advance(3600)
    assert s.get(NS, toks).matched_blocks == 3 and not s.flush(10)
    s.evict(EvictFilter(all=True))
    nvme.update_records = update  # type: ignore[method-assign]
    assert s.flush(10)


def test_a_delete_the_disk_refuses_halfway_leaves_the_index_naming_only_what_is_on_disk(
    make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a long prefix leaves nvme in batches of deletes; the second batch refused: the first batch's
    # blocks were gone from the disk while the index still said nvme held them (flush: durable)
    import kvstore.tiers.nvme as nvme_module

    monkeypatch.setattr(nvme_module, "DROP_BATCH", 2)
    s = make_store(hbm_blocks=8, ram_blocks=8)
    toks = tokens(6, seed=9)
    s.put(NS, toks, kv(6 * T, 9))
    assert s.flush(10)
    nvme = s.tiers.nvme
    assert nvme is not None
    write, calls = nvme._write, []

    def second_refused(fn: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise TierIOError("injected: the disk refuses this delete")
        return write(fn, **kw)

    nvme._write = second_refused
    with pytest.raises(TierIOError):
        s.evict(EvictFilter(all=True))
    nvme._write = write
    held = s.lookup(NS, toks).matched_blocks
    assert held == 4  # the last two blocks (the first batch: leaves first) went whole
    assert set(block_keys(NS, toks)[:held]) <= nvme_keys(s) and s.check_integrity() == []
    assert s.flush(10)
