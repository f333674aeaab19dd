"""The write-through to nvme against blocks that move while it writes them: flush never calls a
block durable that is not on nvme.

Each test hooks a tier call of the writer thread to run another client's calls in one gap of the
write: a timing that can happen on its own, forced so that it happens every time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.keys import block_keys
from kvstore.results import EvictFilter
from kvstore.tiers.base import TierIOError
from kvstore.tiers.nvme import NvmeTier
from tests.store.conftest import StoreFactory
from tests.store.storekit import NS, T, kv, tokens


def on_writer() -> bool:
    return threading.current_thread().name == "kvstore-writer"


def elsewhere(fn: Callable[[], Any]) -> None:
    """Run ``fn`` on another thread (another client's request) and wait for it."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            failed.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if failed:
        raise failed[0]


def test_a_block_that_moves_under_every_read_is_written_later_not_dropped(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    path = tmp_path / "nvme"
    s = make_store(path=path)
    hot = tokens(1, seed=9)
    key = block_keys(NS, hot)[0]
    hbm, ram = s.tiers[0], s.tiers[1]
    moves = [0]
    seed = [100]

    def churn() -> None:  # four new blocks: hbm is full, the hot block goes down to ram
        seed[0] += 1
        s.put(NS, tokens(4, seed=seed[0]), kv(4 * T, seed[0]))

    def hooked(orig: Callable[..., Any], move: Callable[[], Any]) -> Callable[..., Any]:
        def get(k: bytes, *a: Any, **kw: Any) -> Any:
            if k == key and on_writer() and moves[0] < 3:
                moves[0] += 1
                elsewhere(move)  # between the writer finding the block and reading it
            return orig(k, *a, **kw)

        return get

    hbm.get = hooked(hbm.get, churn)  # type: ignore[method-assign]
    ram.get = hooked(ram.get, lambda: s.get(NS, hot))  # type: ignore[method-assign]  # a hit: back up
    s.put(NS, hot, kv(T, 9))
    s.flush(10)  # False when the write it waited for was the one given up: not durable yet, not lost
    assert s.flush(10)
    assert moves[0] == 3 and key in s.tiers[2]
    assert s.check_integrity() == []
    s.close()
    assert make_store(path=path).lookup(NS, hot).matched_blocks == 1


def test_a_block_whose_nvme_copy_came_and_went_during_its_write_is_not_marked_on_nvme(
    make_store: StoreFactory,
) -> None:
    s = make_store()
    toks = tokens(1, seed=9)
    key = block_keys(NS, toks)[0]
    nvme = s.tiers[2]
    put = nvme.put
    done: list[bool] = []

    def come_and_go() -> None:
        s.evict(EvictFilter(tier="hbm"))  # hbm -> ram
        s.evict(EvictFilter(tier="ram"))  # ram -> nvme: a copy of its own, the index's nvme bit set
        s.get(NS, toks)  # a hit: promoted into ram
        s.evict(EvictFilter(tier="nvme"))  # the nvme copy goes, the ram copy stays

    def hooked(k: bytes, *a: Any, **kw: Any) -> Any:
        r = put(k, *a, **kw)
        if k == key and on_writer() and not done:
            done.append(True)
            elsewhere(come_and_go)  # after the writer's LMDB put, before it tells the index
        return r

    nvme.put = hooked  # type: ignore[method-assign,assignment]
    s.put(NS, toks, kv(T, 9))
    s.flush(10)
    e = s._index.get(key)
    assert e is not None and done
    on_nvme = bool(e.tiers & (1 << s.tiers.last))
    assert on_nvme == (key in nvme)  # the index says nvme only where LMDB holds it
    assert s.check_integrity() == []
    assert s.flush(10) and key in nvme  # written again once it could be


def test_flush_never_says_durable_while_a_failed_block_is_written_again(make_store: StoreFactory) -> None:
    """A write that failed is retried by the writer's idle tick; a flush that finds the queue empty
    while that retry runs must not answer True."""
    s = make_store(tick=0.05)
    toks = tokens(1, seed=9)
    key = block_keys(NS, toks)[0]
    nvme = s.tiers[2]
    put = nvme.put
    attempts = [0]

    def failing(k: bytes, *a: Any, **kw: Any) -> Any:
        if k == key:
            attempts[0] += 1
            if attempts[0] % 2 == 0:
                time.sleep(0.5)  # a disk error slow to come
            raise TierIOError("injected: the disk refuses this block")
        return put(k, *a, **kw)

    nvme.put = failing  # type: ignore[method-assign,assignment]
    writer = s._writeback._writer  # type: ignore[union-attr]
    drain = writer.drain

    def late(timeout: float | None = None, **kw: Any) -> bool:
        r = drain(timeout, **kw)
        time.sleep(0.1)  # the flushing thread is descheduled after the queue drained
        return r

    writer.drain = late  # type: ignore[method-assign]
    s.put(NS, toks, kv(T, 9))
    assert [s.flush(5) for _ in range(4)] == [False] * 4
    assert key not in nvme and s.stats().write_failures >= 4
    nvme.put = put  # type: ignore[method-assign]  # the disk recovers
    assert s.flush(10) and key in nvme


def test_a_flush_answers_for_the_blocks_stored_before_it_while_other_clients_go_on(
    make_store: StoreFactory,
) -> None:
    """two clients put new blocks without pause onto a disk slower than they are (the queue never empties)
    ->  each flush is durable within its timeout, and every block put before it is on nvme
    Before, flush waited for an empty queue: with puts coming faster than the disk, never."""
    s = make_store(hbm_blocks=64, ram_blocks=64, nvme_capacity=1 << 26)
    nvme = s.tiers[2]
    put = nvme.put

    def slow(*a: Any, **kw: Any) -> Any:
        time.sleep(0.002)  # a disk a little slower than the putters
        return put(*a, **kw)

    nvme.put = slow  # type: ignore[method-assign]
    stop = threading.Event()
    seeds = iter(range(1000, 10**6))
    lock = threading.Lock()
    stored: list[bytes] = []

    def putter() -> None:
        while not stop.is_set():
            with lock:
                seed = next(seeds)
            toks = tokens(2, seed=seed)
            s.put(NS, toks, kv(2 * T, seed), session=f"conv-{seed % 7}")
            with lock:
                stored.extend(block_keys(NS, toks))

    threads = [threading.Thread(target=putter) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        results = []
        for _ in range(3):
            with lock:
                before = list(stored)
            results.append(s.flush(10))
            missing = [k for k in before if k not in nvme]
            assert not missing, f"{len(missing)} blocks stored before a durable flush are not on nvme"
            assert s._writeback is not None and s._writeback.depth() > 0  # the load went on
        assert results == [True] * 3
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_session_put_faster_than_the_disk_holds_one_row_write(make_store: StoreFactory) -> None:
    """one client puts a prefix it holds again and again under one session, the disk slow to commit
    ->  the session's row waits as one task (written once, as it is last), not one task per put,
        and block writes are not held back behind them
    Before, each put queued a row write: 57,000 in 5 s here, starving blocks and flush."""
    s = make_store(hbm_blocks=64, ram_blocks=64)
    nvme = s.tiers[2]
    assert isinstance(nvme, NvmeTier)
    put_session = nvme.put_session

    def slow(*a: Any, **kw: Any) -> Any:
        time.sleep(0.01)
        return put_session(*a, **kw)

    nvme.put_session = slow  # type: ignore[method-assign]
    toks = tokens(2, seed=5)
    data = kv(2 * T, 5)
    for _ in range(500):
        s.put(NS, toks, data, session="conv")
    # at most: the session's row, the namespace's, the prefix's 2 blocks if not written yet (not 500 rows)
    assert s._writeback is not None and s._writeback.depth() <= 4
    other = tokens(1, seed=6)
    s.put(NS, other, kv(T, 6))  # a block put now reaches the disk while rows keep coming
    for _ in range(100):
        s.put(NS, toks, data, session="conv")
    assert s.flush(10) and block_keys(NS, other)[0] in nvme
    assert dict(nvme.iter_sessions())["conv"]["tokens"] is not None


def test_two_puts_of_one_new_prefix_queue_its_blocks_once(make_store: StoreFactory) -> None:
    """put A indexes a new prefix and lets go of the lock before queueing it; put B of the same prefix
    runs in that gap and finds every block present
    ->  B queues none of them again: each block is handed to the writer once and written once
    (before, B saw blocks on no disk and in no queue yet, and queued each a second time)"""
    s = make_store(hbm_blocks=8, ram_blocks=8)
    wb = s._writeback
    assert wb is not None
    queued: list[bytes] = []
    handed = wb._writer.submit

    def counting(keys: list[bytes], timeout: float) -> list[bytes]:
        queued.extend(keys)
        return handed(keys, timeout)

    wb._writer.submit = counting  # type: ignore[method-assign]
    in_gap, b_done = threading.Event(), threading.Event()
    submit = wb.submit

    def a_waits_in_the_gap(keys: list[bytes], wait: float | None = None, *, expected: bool = False) -> int:
        if threading.current_thread().name == "put-A":
            in_gap.set()
            b_done.wait(5)
        return submit(keys, wait, expected=expected)

    wb.submit = a_waits_in_the_gap  # type: ignore[method-assign]
    toks, data = tokens(4, seed=7), kv(4 * T, 7)
    results: dict[str, Any] = {}
    a = threading.Thread(target=lambda: results.update(A=s.put(NS, toks, data)), name="put-A")
    a.start()
    assert in_gap.wait(5)
    results["B"] = s.put(NS, toks, data)
    b_done.set()
    a.join()
    assert results["A"].stored == 4 and results["B"].present == 4
    assert s.flush(10)
    keys = block_keys(NS, toks)
    assert sorted(queued) == sorted(keys)
    assert s.stats().written == 4


def _paused_writes(nvme: NvmeTier, key: bytes) -> tuple[threading.Event, threading.Event]:
    """The writer's LMDB commit of ``key`` pauses right after it commits, until the second event is
    set; the first is set when it pauses."""
    committed, go_on = threading.Event(), threading.Event()
    for name in ("put", "put_frame"):
        orig = getattr(nvme, name)

        def hooked(k: bytes, *a: Any, _orig: Any = orig, **kw: Any) -> Any:
            r = _orig(k, *a, **kw)
            if k == key and on_writer():
                committed.set()
                assert go_on.wait(10)
            return r

        setattr(nvme, name, hooked)
    return committed, go_on


def _in_background(fn: Callable[[], Any]) -> tuple[threading.Event, list[Any]]:
    done, out = threading.Event(), []

    def run() -> None:
        out.append(fn())
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, out


def test_an_evict_of_a_block_being_written_returns_once_its_disk_copy_is_gone_too(
    make_store: StoreFactory, tmp_path: Path
) -> None:
    """the writer has committed block K to LMDB and not yet told the index; an operator evicts K
    ->  the evict answers only once the writer has deleted that copy again: a daemon killed after the
        answer finds no K on disk at its next start (before, K came back)"""
    s = make_store(path=tmp_path / "nvme")
    toks = tokens(1, seed=11)
    key = block_keys(NS, toks)[0]
    nvme = s.tiers[2]
    assert isinstance(nvme, NvmeTier)
    committed, go_on = _paused_writes(nvme, key)
    s.put(NS, toks, kv(T, 11))
    assert committed.wait(10) and key in nvme
    replied, result = _in_background(lambda: s.evict(EvictFilter(all=True)))
    assert not replied.wait(0.3)  # K's copy is on the disk still: the evict waits for it
    go_on.set()
    assert replied.wait(10)
    assert result[0].blocks == 1 and result[0].not_done == ""
    assert key not in nvme  # what a kill now would leave on disk
    assert s.lookup(NS, toks).matched_tokens == 0


def test_an_evicted_session_s_row_is_off_the_disk_when_the_evict_answers(make_store: StoreFactory) -> None:
    """the writer is in the middle of another block's write; an operator evicts session S
    ->  the evict answers once S's row is deleted from disk too (the writer deletes it next): a daemon
        killed after the answer does not bring S back at its next start (before, the row's delete
        was still queued)"""
    s = make_store()
    nvme = s.tiers[2]
    assert isinstance(nvme, NvmeTier)
    s.put(NS, tokens(2, seed=12), kv(2 * T, 12), session="S")
    assert s.flush(10) and "S" in dict(nvme.iter_sessions())
    other = tokens(1, seed=13)
    committed, go_on = _paused_writes(nvme, block_keys(NS, other)[0])
    s.put(NS, other, kv(T, 13))
    assert committed.wait(10)  # the writer is busy with it
    replied, result = _in_background(lambda: s.evict(EvictFilter(session="S")))
    assert not replied.wait(0.3)
    go_on.set()
    assert replied.wait(10)
    assert result[0].blocks == 2 and result[0].not_done == ""
    assert "S" not in dict(nvme.iter_sessions())


def test_an_evicted_session_s_row_the_disk_would_not_delete_is_said_not_done(
    make_store: StoreFactory,
) -> None:
    """the disk refuses to delete session S's row
    ->  the evict says so (a daemon killed before a later flush deletes it would bring S back)"""
    s = make_store()
    nvme = s.tiers[2]
    assert isinstance(nvme, NvmeTier)
    s.put(NS, tokens(2, seed=14), kv(2 * T, 14), session="S")
    assert s.flush(10)

    def refuse(name: str) -> bool:
        raise TierIOError("injected: the disk refuses the delete")

    nvme.drop_session = refuse  # type: ignore[method-assign]
    t0 = time.monotonic()
    r = s.evict(EvictFilter(session="S"))
    assert r.blocks == 2 and "could not be deleted from disk (injected" in r.not_done
    assert time.monotonic() - t0 < 1.0  # said at once, not after the wait
    assert "S" in dict(nvme.iter_sessions())


def test_an_evicted_session_made_again_before_its_row_was_deleted_ends_the_evicts_wait(
    make_store: StoreFactory,
) -> None:
    """the writer is busy; an operator evicts session S, and a client puts under S again before the
    row's delete ran: the new row replaces the delete, and the evict answers at once (its wait for
    the delete ends: S is a session again, on disk as it should be)"""
    s = make_store()
    nvme = s.tiers[2]
    assert isinstance(nvme, NvmeTier)
    s.put(NS, tokens(2, seed=15), kv(2 * T, 15), session="S")
    assert s.flush(10)
    other = tokens(1, seed=16)
    committed, go_on = _paused_writes(nvme, block_keys(NS, other)[0])
    s.put(NS, other, kv(T, 16))
    assert committed.wait(10)
    t0 = time.monotonic()
    replied, result = _in_background(lambda: s.evict(EvictFilter(session="S")))
    time.sleep(0.2)
    s.put(NS, tokens(1, seed=17), kv(T, 17), session="S")  # S again: its row is written anew
    assert replied.wait(5) and time.monotonic() - t0 < 1.5
    assert result[0].blocks == 2 and result[0].not_done == ""
    go_on.set()
    assert s.flush(10) and "S" in dict(nvme.iter_sessions())
