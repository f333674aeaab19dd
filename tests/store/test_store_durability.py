"""Store: write-through to nvme, flush as the durable acknowledgement, restart, admission policies."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.codecs import get_codec
from kvstore.keys import Namespace, block_keys
from kvstore.layout import KVLayout
from kvstore.results import EvictFilter
from kvstore.store.engine import Store
from kvstore.tiers.base import TierIOError
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.ram import RamTier
from tests.store.storekit import NS, Clock, T, close_to, kv, tokens


def nvme_keys(s) -> set[bytes]:
    return set(s.tiers[-1].keys())


def test_every_stored_block_is_written_through_to_nvme(make_store) -> None:
    s = make_store()
    toks = tokens(6)
    s.put(NS, toks, kv(6 * T))
    # flush() returns once the queue drained and LMDB synced: every block is on nvme, with its record
    assert s.flush(10)
    keys = block_keys(NS, toks)
    assert nvme_keys(s) == set(keys)
    rec = s.tiers[-1].record(keys[1])
    assert rec.position == 1 and rec.parent == keys[0] and list(rec.token_ids()) == toks[T : 2 * T]
    st = s.stats()
    assert st.written == 6 and st.write_queue == 0
    assert s.check_integrity() == []


def test_restart_finds_every_flushed_block_and_session(make_store, tmp_path: Path) -> None:
    path = tmp_path / "lmdb"
    s = make_store(path=path)
    a, b = tokens(6, seed=1), tokens(3, seed=2)
    s.put(NS, a, kv(6 * T, 1), session="conv-a")
    s.put(NS, b, kv(3 * T, 2), session="conv-b")
    s.close()
    # reopen: the index, namespaces and sessions come back from LMDB
    s2 = make_store(path=path)
    assert s2.lookup(NS, a).matched_blocks == 6
    assert s2.lookup(NS, b).matched_blocks == 3
    got = s2.get(NS, a)
    assert got.tiers[0] == "nvme" and close_to(got.kv, kv(6 * T, 1))
    info = {i.name: i for i in s2.sessions()}
    assert info["conv-a"].tokens == 6 * T and info["conv-a"].blocks == 6 and info["conv-a"].model == NS.model
    assert info["conv-b"].tokens == 3 * T
    assert s2.stats().namespaces == 1
    assert s2.check_integrity() == []


def test_a_damaged_session_or_namespace_row_is_skipped_and_the_rest_comes_back(
    make_store, tmp_path: Path
) -> None:
    from kvstore.codecs import get_codec
    from kvstore.tiers.nvme import NvmeTier

    path = tmp_path / "lmdb"
    s = make_store(path=path)
    a, b, c = tokens(3, seed=1), tokens(2, seed=2), tokens(2, seed=3)
    s.put(NS, a, kv(3 * T, 1), session="cut")
    s.put(NS, b, kv(2 * T, 2), session="odd")
    s.put(NS, c, kv(2 * T, 3), session="fine")
    s.close()
    tier = NvmeTier(path, 1 << 22, get_codec("int4"))
    rows = dict(tier.iter_sessions())
    cut = tier._read(lambda txn: bytes(txn.get(b"cut", db=tier._sessions) or b""))
    tier._write(lambda txn: txn.put(b"cut", cut[:-3], db=tier._sessions))  # torn: does not unpack
    odd = {**rows["odd"], "tokens": "many"}  # unpacks, but not as a session
    tier.put_session("odd", odd)
    # a number where a key goes: skipped, not taken as 2**50 zero bytes
    tier.put_session("num", {**rows["fine"], "tail": 1 << 50})
    tier.put_namespace("bogus", {"model": 7})  # a namespace row this build cannot read
    tier.close()
    s2 = make_store(path=path)  # opens: the damaged rows are logged and dropped
    assert [i.name for i in s2.sessions()] == ["fine"]
    assert s2.stats().sessions_forgotten >= 2  # "odd" and "num" (a torn row never unpacks)
    for toks in (a, b, c):
        assert s2.lookup(NS, toks).matched_blocks == len(toks) // T
    assert s2.check_integrity() == []


def test_restart_after_flush_without_close_keeps_the_blocks(tmp_path: Path) -> None:
    # a separate process puts, flushes, and dies without closing (os._exit: no cleanup at all)
    path = tmp_path / "lmdb"
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from tests.store.storekit import NS, T, kv, tokens
        from kvstore.codecs import get_codec
        from kvstore.store.engine import Store
        from kvstore.tiers.hbm import HbmTier
        from kvstore.tiers.nvme import NvmeTier
        from kvstore.tiers.ram import RamTier
        s = Store(HbmTier(4096, page_bytes=1024), RamTier(8192, get_codec("raw"), page_bytes=2048, pin_memory=False),
                  NvmeTier({str(path)!r}, 1 << 22, get_codec("int4")))
        s.put(NS, tokens(5), kv(5 * T), session="killed")
        assert s.flush(30)
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    from kvstore.codecs import get_codec
    from kvstore.store.engine import Store
    from kvstore.tiers.hbm import HbmTier
    from kvstore.tiers.nvme import NvmeTier
    from kvstore.tiers.ram import RamTier
    from tests.store.storekit import HBM_PAGE, RAM_PAGE  # noqa: F401 - same tiers as the fixture

    s = Store(
        HbmTier(4096, page_bytes=1024),
        RamTier(8192, get_codec("raw"), page_bytes=2048, pin_memory=False),
        NvmeTier(path, 1 << 22, get_codec("int4")),
    )
    try:
        assert s.lookup(NS, tokens(5)).matched_blocks == 5
        assert s.session("killed").info.tokens == 5 * T
        got = s.get(NS, tokens(5)).kv
        assert got is not None and close_to(got, kv(5 * T))
    finally:
        s.close()


@pytest.mark.parametrize(
    ("shared", "turns", "landed"),
    [(False, 1, 4), (True, 1, 4), (True, 2, 4), (True, 2, 6)],
    ids=[
        "own-blocks",
        "blocks-another-session-stored",
        "two-puts-before-the-disk-caught-up",
        "the-first-of-two-puts-reached-the-disk",
    ],
)
def test_a_crash_before_a_session_s_new_blocks_are_written_keeps_what_flush_made_durable(
    tmp_path: Path, shared: bool, turns: int, landed: int
) -> None:
    """The session's row (its tail: the put's last block) is journalled ahead of the put's blocks.
    A crash between the two leaves a row naming a block that is not on disk: the session then ends
    where its last flush left it (the row keeps its tail before the put). ``shared``: turn 1's
    blocks were stored by another session first (so they carry no tag of this one). ``turns``: puts
    after the flush; ``landed``: the blocks that reached the disk before the crash (the session
    resumes at the last of them: the row keeps the tail that did, or the blocks' tags show it)."""
    path = tmp_path / "lmdb"
    first = 's.put(NS, toks[: 4 * T], kv(4 * T, 3), session="other")' if shared else "pass"
    script = textwrap.dedent(f"""
        import os, sys, threading, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from tests.store.storekit import NS, T, kv, tokens
        from kvstore.codecs import get_codec
        from kvstore.keys import block_keys
        from kvstore.store.engine import Store
        from kvstore.tiers.hbm import HbmTier
        from kvstore.tiers.nvme import NvmeTier
        from kvstore.tiers.ram import RamTier
        s = Store(HbmTier(4096, page_bytes=1024), RamTier(8192, get_codec("raw"), page_bytes=2048, pin_memory=False),
                  NvmeTier({str(path)!r}, 1 << 22, get_codec("int4")), tick=0.05)
        toks = tokens(8, seed=3)
        {first}
        s.put(NS, toks[: 4 * T], kv(4 * T, 3), session="conv")  # turn 1, durable
        assert s.flush(30)
        nvme = s.tiers[2]
        put = nvme.put
        late = set(block_keys(NS, toks)[{landed}:])
        def slow(key, *a, **k):  # a disk that cannot keep up: the blocks from `landed` on never land
            if threading.current_thread().name == "kvstore-writer" and key in late:
                raise OSError("the disk is behind")
            return put(key, *a, **k)
        nvme.put = slow
        if {turns} == 2:
            s.put(NS, toks[: 6 * T], kv(6 * T, 3), session="conv")  # blocks 4..5
        s.put(NS, toks, kv(8 * T, 3), session="conv")  # turn 2 (or 3): blocks .. 7
        tail = block_keys(NS, toks)[7]
        deadline = time.monotonic() + 30
        landed = block_keys(NS, toks)[{landed} - 1]
        while dict(nvme.iter_sessions()).get("conv", {{}}).get("tail") != tail or landed not in nvme:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os._exit(0)  # the row names block 7, which never reached the disk
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    from kvstore.codecs import get_codec
    from kvstore.store.engine import Store
    from kvstore.tiers.hbm import HbmTier
    from kvstore.tiers.nvme import NvmeTier
    from kvstore.tiers.ram import RamTier

    s = Store(
        HbmTier(4096, page_bytes=1024),
        RamTier(8192, get_codec("raw"), page_bytes=2048, pin_memory=False),
        NvmeTier(path, 1 << 22, get_codec("int4")),
    )
    try:
        toks = tokens(8, seed=3)
        assert s.lookup(NS, toks).matched_blocks == landed
        assert s.session("conv").info.tokens == landed * T
        assert s.prefetch("conv", "ram").blocks == landed
    finally:
        s.close()


def test_restart_drops_blocks_whose_parent_never_reached_disk(make_store, tmp_path: Path) -> None:
    path = tmp_path / "lmdb"
    s = make_store(path=path)
    toks = tokens(4)
    s.put(NS, toks, kv(4 * T))
    assert s.flush(10)
    keys = block_keys(NS, toks)
    s.tiers[-1].drop(keys[1])  # as if block 1's write had been lost: 2 and 3 are orphans on disk
    s.close()
    s2 = make_store(path=path)
    assert s2.lookup(NS, toks).matched_blocks == 1
    assert nvme_keys(s2) == {keys[0]}
    assert s2.check_integrity() == []


def test_write_through_off_writes_only_on_demotion(make_store) -> None:
    s = make_store(write_through=False)
    toks = tokens(4)
    s.put(NS, toks, kv(4 * T))
    assert s.drain(10) and nvme_keys(s) == set()
    # 6 more blocks push the older prompt down through ram, tail first: its [2, 3] reach nvme
    other = tokens(6, seed=9)
    s.put(NS, other, kv(6 * T, 9))
    assert s.drain(10)
    assert nvme_keys(s) == set(block_keys(NS, toks)[2:])
    assert s.lookup(NS, toks).tiers == ["ram", "ram", "nvme", "nvme"]
    assert s.check_integrity() == []
    # the durable acknowledgement writes what has no nvme copy yet
    assert s.flush(10)
    assert nvme_keys(s) == set(block_keys(NS, toks)) | set(block_keys(NS, other))
    assert s.check_integrity() == []


def test_second_use_admits_blocks_on_their_second_hit(make_store) -> None:
    s = make_store(admit="second_use")
    toks = tokens(2)
    s.put(NS, toks, kv(2 * T))
    assert s.drain(10) and nvme_keys(s) == set()
    s.get(NS, toks)  # first hit: remembered
    assert s.drain(10) and nvme_keys(s) == set()
    s.get(NS, toks)  # second hit: admitted (from the writer's next tick)
    deadline = time.monotonic() + 10
    while nvme_keys(s) != set(block_keys(NS, toks)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert nvme_keys(s) == set(block_keys(NS, toks))
    assert s.check_integrity() == []


def test_flush_writes_blocks_not_yet_admitted(make_store) -> None:
    s = make_store(admit="second_use")
    toks = tokens(3)
    s.put(NS, toks, kv(3 * T))
    assert s.drain(10) and nvme_keys(s) == set()  # not admitted yet
    assert s.flush(10)  # the durable acknowledgement: what was put is on disk
    assert nvme_keys(s) == set(block_keys(NS, toks))


def test_a_full_write_queue_defers_and_flush_still_writes_everything(make_store) -> None:
    from kvstore.config import PolicyConfig

    # a queue of 1 and no patience: most keys are deferred, none is lost
    s = make_store(policy=PolicyConfig(write_queue=1), backpressure=0.0, hbm_blocks=16, ram_blocks=16)
    toks = tokens(12)
    r = s.put(NS, toks, kv(12 * T))
    assert r.stored == 12 and r.deferred >= 1
    assert s.flush(30)
    assert nvme_keys(s) == set(block_keys(NS, toks))
    assert s.stats().write_deferred == 0


def test_a_block_keeps_the_tag_of_the_session_that_stored_it(make_store, tmp_path: Path) -> None:
    path = tmp_path / "lmdb"
    s = make_store(path=path)
    toks = tokens(2)
    s.put(NS, toks, kv(2 * T), session="a")
    assert s.flush(10)
    s.put(NS, toks, kv(2 * T), session="b")  # present: b's prefix now ends there too, no tag is added
    s.close()
    s2 = make_store(path=path)
    rec = s2.tiers[-1].record(block_keys(NS, toks)[0])
    assert rec.sessions == ("a",)
    assert s2.session("b").info.blocks == 2  # b knows its own chain
    # a stored them, but b's conversation ends on them: evicting a's own blocks leaves them
    assert s2.evict(EvictFilter(session="a")).blocks == 0
    assert s2.lookup(NS, toks).matched_blocks == 2


def test_a_session_row_whose_write_failed_is_written_again_and_flush_waits_for_it(
    make_store, tmp_path: Path
) -> None:

    path = tmp_path / "lmdb"
    s = make_store(path=path)
    nvme = s.tiers[-1]
    real = nvme.put_session
    failures = [2]  # the disk refuses the row twice (EIO), then takes it

    def flaky(name: str, info: dict) -> None:
        if failures[0]:
            failures[0] -= 1
            raise TierIOError("injected: the disk refused the write")
        real(name, info)

    nvme.put_session = flaky
    toks = tokens(3)
    s.put(NS, toks, kv(3 * T), session="conv")
    assert not s.flush(10)  # the row failed at the put and again at this flush's retry
    assert "conv" not in dict(nvme.iter_sessions())
    assert s.flush(10)  # written now: durable
    assert dict(nvme.iter_sessions())["conv"]["tokens"] == 3 * T
    s.close()
    s2 = make_store(path=path)
    assert s2.session("conv").info.tokens == 3 * T


def test_a_disk_reopened_with_a_smaller_capacity_gives_up_its_least_recently_used_blocks(
    make_store, tmp_path: Path
) -> None:
    path = tmp_path / "lmdb"
    clock = Clock()
    s = make_store(path=path, nvme_capacity=8 << 20, clock=clock)
    prompts = [tokens(8, seed=seed) for seed in range(60)]
    for seed, toks in enumerate(prompts):
        s.put(NS, toks, kv(8 * T, seed))
        clock.advance(1)
    clock.advance(3600)  # access times reach the disk in 10-minute slots
    s.get(NS, prompts[0])  # the oldest prompt, used last
    assert s.flush(30)
    full = s.tiers[-1].usage().used_bytes
    s.close()
    s2 = make_store(path=path, nvme_capacity=full // 2, clock=clock)
    u = s2.tiers[-1].usage()
    assert u.used_bytes <= u.capacity_bytes and s2.check_integrity() == []
    held = [s2.lookup(NS, toks).matched_blocks for toks in prompts]
    assert held[0] == 8  # used last: kept
    assert held[1] < 8  # put first after it, never used since: given up first
    assert 0 < sum(held) < 8 * len(prompts)
    assert s2.put(NS, tokens(8, seed=99), kv(8 * T, 99)).stored == 8  # and it takes new blocks
    assert s2.flush(30)


def test_a_full_disk_makes_room_for_long_conversations_and_reopens_smaller(tmp_path: Path) -> None:
    # nvme full: room is made by dropping a whole conversation of 100 blocks, whose keys are spread
    # over the B-trees (one LMDB transaction of them needed more pages than the full map had, and
    # the blocks left the index before the disk refused: forgotten while on disk, flush stuck)
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
    ns, n, nb = Namespace("m", layout), 100, layout.block_nbytes  # int4 frames of ~5 KiB: overflow pages
    clock = Clock()

    def store(capacity: int) -> Store:
        hbm = HbmTier(8 * nb, page_bytes=nb)
        ram = RamTier(8 * (nb + 8192), get_codec("raw"), page_bytes=nb + 8192, pin_memory=False)
        nvme = NvmeTier(tmp_path / "lmdb", capacity, get_codec("int4"))
        return Store(hbm, ram, nvme, tick=0.05, clock=clock)

    def conversation(seed: int) -> tuple[list[int], torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        toks = [seed * 1_000_000 + i for i in range(n * 16)]
        return toks, torch.randn(layout.shape(n * 16), generator=g).to(torch.bfloat16)

    s = store(4 << 20)
    for seed in range(12):
        toks, data = conversation(seed)
        r = s.put(ns, toks, data, session=f"conv-{seed}")
        assert r.stored == n and not r.failed, (seed, r)
        clock.advance(1)
        assert s.flush(30), seed
    held = s.tiers[-1].usage().blocks
    assert 2 * n < held < 12 * n  # the oldest conversations went, from their tails: the disk stays full
    last = [s.lookup(ns, conversation(seed)[0]).matched_blocks for seed in (10, 11)]
    assert last == [n, n] and s.check_integrity() == []
    s.close()
    s = store(2 << 20)  # the full file, reopened with a smaller capacity: trimmed, not stuck
    u = s.tiers[-1].usage()
    assert u.used_bytes <= u.capacity_bytes and s.check_integrity() == []
    toks, data = conversation(99)
    assert s.put(ns, toks, data).stored == n
    assert s.flush(30) and s.check_integrity() == []
    s.close()


@pytest.mark.parametrize("stop", ["flush", "close"])
def test_a_flush_between_a_put_indexing_its_blocks_and_queueing_them_waits_for_them(
    make_store, tmp_path: Path, stop: str
) -> None:
    """A put indexes a chunk under the lock and queues it for nvme after: a flush (or close, whose
    flush is the clean stop) in that gap saw an empty queue, and called durable blocks that other
    clients already found (close: never written at all)."""
    s = make_store(path=tmp_path / "nvme")
    wb = s._writeback
    assert wb is not None
    real_submit, entered = wb.submit, threading.Event()

    def slow_submit(keys: list[bytes], wait: float | None = None, **kw: Any) -> int:
        entered.set()
        time.sleep(0.3)  # indexed, not queued yet
        return real_submit(keys, wait, **kw)

    wb.submit = slow_submit
    a = tokens(2, seed=1)
    put = threading.Thread(target=s.put, args=(NS, a, kv(2 * T, 1)))
    put.start()
    assert entered.wait(10)
    if stop == "flush":
        assert s.flush(10)
        assert set(block_keys(NS, a)) <= nvme_keys(s)
    else:
        s.close()
    put.join(10)
    if stop == "close":
        reopened = make_store(path=tmp_path / "nvme")
        assert reopened.lookup(NS, a).matched_blocks == 2


def test_a_block_whose_nvme_copy_went_is_written_again_when_put_again(make_store) -> None:
    # put + flush: on disk. evict --tier nvme: the disk copies go, hbm and ram keep theirs. The client
    # puts the same prefix again (answered present) and flushes: durable must mean on disk again
    s = make_store(hbm_blocks=8, ram_blocks=8)
    toks = tokens(4, seed=5)
    keys = block_keys(NS, toks)
    s.put(NS, toks, kv(4 * T, 5), session="conv")
    assert s.flush(10) and set(keys) <= nvme_keys(s)
    s.evict(EvictFilter(tier="nvme"))
    assert not set(keys) & nvme_keys(s) and s.lookup(NS, toks).matched_blocks == 4
    assert s.flush(10)  # an operator's evict gave those copies up: not owed until put again
    r = s.put(NS, toks, kv(4 * T, 5), session="conv")
    assert r.present == 4 and r.stored == 0
    assert s.flush(10)
    assert set(keys) <= nvme_keys(s)
    rec = s.tiers[-1].record(keys[2])
    assert rec.position == 2 and rec.parent == keys[1] and list(rec.token_ids()) == toks[2 * T : 3 * T]
    assert s.check_integrity() == []
    # and a put of blocks on disk already queues nothing
    before = s.stats().written
    s.put(NS, toks, kv(4 * T, 5))
    assert s.flush(10) and s.stats().written == before


def test_a_disk_smaller_than_memory_keeps_the_head_of_a_conversation_and_flush_says_not_durable(
    tmp_path: Path,
) -> None:
    # nvme holds a few dozen blocks, memory all 300 of one conversation. Each new block's write made
    # room by dropping the disk copy of the oldest block still in memory: the head went first, flush
    # answered durable, and a restart found orphans only: nothing. Now the disk keeps the head (no
    # ancestor of the block being written goes for it), flush says not durable, the blocks left out
    # are not written again every tick (an int4 encode each), and a restart serves the head
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
    ns, n, nb = Namespace("m", layout), 300, layout.block_nbytes

    def store() -> Store:
        hbm = HbmTier((n + 8) * nb, page_bytes=nb)
        ram = RamTier(4 * (nb + 8192), get_codec("raw"), page_bytes=nb + 8192, pin_memory=False)
        return Store(hbm, ram, NvmeTier(tmp_path / "lmdb", 1 << 20, get_codec("int4")), tick=0.02)

    toks = list(range(n * 16))
    data = torch.randn(layout.shape(n * 16), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    s = store()
    assert s.put(ns, toks, data, session="long").stored == n
    assert not s.flush(30)
    keys = block_keys(ns, toks)
    on_disk = [i for i, k in enumerate(keys) if k in nvme_keys(s)]
    assert 10 < len(on_disk) < n and on_disk == list(range(len(on_disk)))
    failures = s.stats().write_failures
    time.sleep(0.5)  # 25 ticks: nvme let go of nothing meanwhile, so nothing is tried again
    assert s.stats().write_failures == failures and not s.flush(5)
    assert s.check_integrity() == []
    s.close()
    s = store()
    assert s.lookup(ns, toks).matched_blocks == len(on_disk)
    got = s.get(ns, toks[: len(on_disk) * 16])
    assert got.kv is not None and close_to(got.kv, data[:, :, : len(on_disk) * 16])
    assert [(i.name, i.tokens) for i in s.sessions()] == [("long", len(on_disk) * 16)]
    s.close()


def disk_smaller_than_a_block(tmp_path: Path) -> tuple[Store, Namespace]:
    """A store whose nvme (1 MiB) is smaller than one block's int4 frame (2 MiB blocks)."""
    layout = KVLayout(num_layers=16, num_kv_heads=4, head_dim=128, dtype="bfloat16", block_tokens=64)
    nb = layout.block_nbytes
    s = Store(
        HbmTier(8 * nb, page_bytes=nb),
        RamTier(4 * (nb + 8192), get_codec("raw"), page_bytes=nb + 8192, pin_memory=False),
        NvmeTier(tmp_path / "lmdb", 1 << 20, get_codec("int4")),
        tick=0.02,
    )
    return s, Namespace("m", layout)


def test_a_disk_too_small_for_one_block_is_said_once_and_not_retried_every_tick(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a 2 MiB block's int4 frame does not fit an nvme of 1 MiB: its write was encoded again every
    # tick (1024 a second at most), forever, with nothing logged but "the disk refused them" at close
    s, ns = disk_smaller_than_a_block(tmp_path)
    layout = ns.layout
    with caplog.at_level(logging.WARNING, logger="kvstore.store"):
        assert (
            s.put(ns, list(range(4 * 64)), torch.randn(layout.shape(4 * 64)).to(torch.bfloat16)).stored == 4
        )
        assert not s.flush(10)
        failures = s.stats().write_failures
        time.sleep(0.5)
        assert s.stats().write_failures == failures
    said = [r.getMessage() for r in caplog.records if "no room for block" in r.getMessage()]
    assert len(said) == 1 and "its frame is larger than an empty nvme of 1048576 bytes" in said[0]
    assert "raise [nvme] capacity" in said[0]
    s.close()


def test_a_block_nvme_had_no_room_for_and_then_evicted_does_not_silence_the_next_no_room(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the blocks nvme had no room for wait for nvme to let go of something before they are tried
    # again; evicted from memory meanwhile they were still owed, so the next block without room (of
    # another conversation, long after) was not logged: "later ones are not logged" of a run long over
    s, ns = disk_smaller_than_a_block(tmp_path)
    layout = ns.layout

    def said(n: int) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if len([r for r in caplog.records if "no room for block" in r.getMessage()]) == n:
                return True
            time.sleep(0.02)
        return False

    with caplog.at_level(logging.WARNING, logger="kvstore.store"):
        kv = torch.randn(layout.shape(64)).to(torch.bfloat16)
        assert s.put(ns, list(range(64)), kv, session="a").stored == 1
        assert said(1)
        assert s.evict(EvictFilter(session="a")).blocks == 1
        time.sleep(0.2)  # ticks: the evicted block is owed no more
        assert s.stats().write_deferred == 0
        assert s.put(ns, list(range(100, 164)), kv, session="b").stored == 1
        assert said(2)
    s.close()


def test_an_evict_is_synced_to_the_disk_before_it_answers(make_store, monkeypatch) -> None:
    # "balanced" (the default) does not sync a commit's meta page: an evict answered done, with no
    # commit after it, would come back after a power loss, which no test can cut here; the evict
    # syncs its deletes, and says so when the disk refuses
    s = make_store()
    s.put(NS, tokens(4), kv(4 * T), session="conv")
    assert s.flush(10)
    nvme = s.tiers[-1]
    syncs: list[float] = []
    real = nvme.sync

    def counted() -> None:
        syncs.append(time.monotonic())
        real()

    monkeypatch.setattr(nvme, "sync", counted)
    assert s.evict(EvictFilter(session="conv"), dry_run=True).blocks == 4 and not syncs
    assert s.evict(EvictFilter(tier="hbm", all=True)).blocks > 0 and not syncs  # nothing left the disk
    r = s.evict(EvictFilter(session="conv"))
    assert r.blocks == 4 and r.not_done == "" and len(syncs) == 1 and nvme_keys(s) == set()

    s.put(NS, tokens(4, seed=5), kv(4 * T, seed=5), session="other")
    assert s.flush(10)

    def refused() -> None:
        raise TierIOError("fsync: input/output error")

    monkeypatch.setattr(nvme, "sync", refused)
    r = s.evict(EvictFilter(session="other"))
    assert r.blocks == 4 and "could not be synced to disk (fsync: input/output error)" in r.not_done


def test_a_namespace_s_row_is_on_disk_before_any_block_of_it(make_store) -> None:
    # queued behind other rows, the row could land after the namespace's first blocks, and a kill
    # between the two left blocks whose model and tenant no filter (and no confined tenant's evict)
    # matches: the row is written as the put registers the namespace, whatever the writer is doing
    s = make_store()
    nvme = s.tiers[-1]
    stalled, go = threading.Event(), threading.Event()

    def stall() -> None:
        stalled.set()
        go.wait(10)

    s._journal._writer.run_soon(stall)
    assert stalled.wait(10)
    try:
        other = Namespace("another-model", NS.layout, tenant="t")
        s.put(other, tokens(2), kv(2 * T))
        assert other.id in dict(nvme.iter_namespaces())  # before its blocks, still queued
        assert nvme_keys(s) == set()
    finally:
        go.set()
    assert s.flush(10) and len(nvme_keys(s)) == 2
