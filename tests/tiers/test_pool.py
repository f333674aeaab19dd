"""PagePool: a fixed arena, pages handed out and taken back, reads that never alias."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError
from kvstore.memcopy import Copier
from kvstore.tiers import PagePool, PageSpan, TierFull


def data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_arena_is_exactly_the_capacity_and_pages_round_down() -> None:
    pool = PagePool(1000, page_bytes=256)
    # 1000 bytes -> 3 whole pages, 232 bytes of slack that no entry ever gets
    assert pool._arena.numel() == 1000
    assert pool.num_pages == 3 and pool.free_pages == 3
    assert pool.pages_for(0) == 1 and pool.pages_for(256) == 1 and pool.pages_for(257) == 2


def test_alloc_write_read_round_trip_and_read_is_a_copy() -> None:
    pool = PagePool(4096, page_bytes=256)
    span = pool.alloc(600)
    assert span.count == 3 and span.contiguous
    src = data(600)
    pool.write(span, src)
    out = pool.read(span, 600)
    assert torch.equal(out, src)
    # the result is a copy: scribbling on it leaves the arena alone
    out.zero_()
    assert torch.equal(pool.read(span, 600), src)


def test_can_alloc_changes_nothing_and_alloc_past_capacity_raises_tier_full() -> None:
    pool = PagePool(1024, page_bytes=256)
    assert pool.can_alloc(1024) and not pool.can_alloc(1025)
    assert pool.free_pages == 4
    pool.alloc(700)  # 3 pages
    with pytest.raises(TierFull, match="1 of 4 free"):
        pool.alloc(300)
    # nothing was taken by the failed alloc
    assert pool.free_pages == 1
    pool.alloc(200)
    assert pool.free_pages == 0


def test_freed_pages_are_reused_and_non_contiguous_spans_work() -> None:
    pool = PagePool(256 * 6, page_bytes=256)
    a, b, c = pool.alloc(512), pool.alloc(512), pool.alloc(512)  # pages 0-1, 2-3, 4-5
    assert (a.pages, b.pages, c.pages) == ((0, 1), (2, 3), (4, 5))
    # free [a] and [c] -> a 4-page entry gets their pages, which are not contiguous
    pool.free(a)
    pool.free(c)
    d = pool.alloc(1000)
    assert sorted(d.pages) == [0, 1, 4, 5] and not d.contiguous
    src = data(1000, seed=1)
    pool.write(d, src)
    assert torch.equal(pool.read(d, 1000), src)
    assert pool.view(d, 1000) is None  # no in-place view of scattered pages
    # [b] was never touched
    assert pool.free_pages == 0


def test_same_size_entry_gets_the_freed_contiguous_run_back() -> None:
    pool = PagePool(256 * 8, page_bytes=256)
    spans = [pool.alloc(512) for _ in range(4)]
    pool.free(spans[1])
    again = pool.alloc(512)
    assert again.pages == spans[1].pages and again.contiguous


def test_double_free_is_refused() -> None:
    pool = PagePool(512, page_bytes=256)
    span = pool.alloc(10)
    pool.free(span)
    # every page is free again: one more free cannot be right
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(span)
    assert pool.free_pages == 2


def test_bad_sizes_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="page_bytes"):
        PagePool(1024, page_bytes=0)
    with pytest.raises(ConfigError, match="page_bytes must be a multiple of 256"):
        PagePool(8194, page_bytes=4097)  # a float16 block on page 1 would start at an odd byte
    with pytest.raises(ConfigError, match="capacity_bytes"):
        PagePool(-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="needs CUDA"):
        PagePool(1024, device="cuda:0")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 2000)), max_size=40))
def test_random_allocs_never_exceed_capacity_and_data_survives(ops: list[tuple[bool, int]]) -> None:
    pool = PagePool(256 * 16, page_bytes=256)
    live: list[tuple[PageSpan, torch.Tensor]] = []
    for i, (grow, n) in enumerate(ops):
        if grow or not live:
            if not pool.can_alloc(n):
                with pytest.raises(TierFull):
                    pool.alloc(n)
                continue
            span = pool.alloc(n)
            src = data(n, seed=i)
            pool.write(span, src)
            live.append((span, src))
        else:
            span, _ = live.pop(n % len(live))
            pool.free(span)
        used = sum(s.count for s, _ in live)
        assert pool.used_pages == used <= pool.num_pages
        # no two live entries share a page
        pages = [p for s, _ in live for p in s.pages]
        assert len(pages) == len(set(pages))
    for span, src in live:
        assert torch.equal(pool.read(span, src.numel()), src)


def test_concurrent_alloc_and_free_keep_the_free_list_consistent() -> None:
    pool = PagePool(256 * 64, page_bytes=256)

    def churn() -> None:
        for _ in range(300):
            try:
                span = pool.alloc(700)
            except TierFull:
                continue
            pool.free(span)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.free_pages == 64
    assert sorted(int(p) for p in pool._free[: pool._top]) == list(range(64))


def _arena_bytes(pool: PagePool, span: PageSpan, n: int) -> torch.Tensor:
    """What the arena holds now, looked at without the pool (as a client mapping it would)."""
    start = span.first * pool.page_bytes
    return pool._flat[start : start + n].clone()


PAGE, BLOCK = 1 << 16, 100_000  # big enough to be batched (kvstore.memcopy copies smaller ones at once)


def test_batched_writes_land_by_the_end_and_every_read_through_the_pool_sees_them() -> None:
    # one thread (no helpers): the copies wait for the end, so what the arena holds meanwhile shows it
    pool = PagePool(PAGE * 16, page_bytes=PAGE, copier=Copier(1))
    spans = [pool.alloc(BLOCK) for _ in range(4)]
    srcs = [data(BLOCK, seed=i) for i in range(4)]
    with pool.batched():
        for span, src in zip(spans, srcs, strict=True):
            pool.write_tensor(span, src)
        assert not _arena_bytes(pool, spans[0], BLOCK).any()  # pending: not copied yet
        assert torch.equal(pool.read(spans[0], BLOCK), srcs[0])  # a read waits for the pending copies
        pool.write_tensor(spans[1], srcs[3])
        assert not torch.equal(_arena_bytes(pool, spans[1], BLOCK), srcs[3])
        view = pool.view(spans[2], BLOCK)
        assert view is not None and torch.equal(view, srcs[2])
        pool.write_tensor(spans[3], srcs[0])
    assert torch.equal(_arena_bytes(pool, spans[1], BLOCK), srcs[3])
    assert torch.equal(_arena_bytes(pool, spans[3], BLOCK), srcs[0])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_batch_copied_on_helper_threads_holds_every_block_and_the_later_of_two_writes(threads: int) -> None:
    pool = PagePool(PAGE * 64, page_bytes=PAGE, copier=Copier(threads))
    spans = [pool.alloc(BLOCK) for _ in range(20)]
    srcs = [data(BLOCK, seed=i) for i in range(21)]
    with pool.batched():
        for span, src in zip(spans, srcs, strict=False):
            pool.write_tensor(span, src)
        pool.write_tensor(spans[7], srcs[20])  # the same pages again in one batch: this copy wins
    for i, span in enumerate(spans):
        assert torch.equal(_arena_bytes(pool, span, BLOCK), srcs[20 if i == 7 else i])
    pool.copier.close()


def test_a_page_freed_in_a_batch_and_taken_again_holds_the_later_write() -> None:
    # block a is written, evicted (its pages freed) and block b takes the same pages, all in one
    # batch: a's late copy must not land over b's
    pool = PagePool(PAGE * 8, page_bytes=PAGE, copier=Copier(1))
    a, b = data(BLOCK, seed=1), data(BLOCK, seed=2)
    with pool.batched():
        span = pool.alloc(BLOCK)
        pool.write_tensor(span, a)
        pool.free(span)  # waits for a's copy: none may land in pages that can be taken again
        assert torch.equal(_arena_bytes(pool, span, BLOCK), a)
        again = pool.alloc(BLOCK)
        assert again.pages == span.pages
        pool.write_tensor(again, b)
    assert torch.equal(_arena_bytes(pool, again, BLOCK), b)


def test_only_the_batching_thread_s_writes_wait() -> None:
    pool = PagePool(PAGE * 16, page_bytes=PAGE, copier=Copier(1))
    mine, theirs = pool.alloc(BLOCK), pool.alloc(BLOCK)
    with pool.batched():
        with pool.batched():  # nested: part of the outer batch
            pool.write_tensor(mine, data(BLOCK, seed=1))
        assert not _arena_bytes(pool, mine, BLOCK).any()
        other = threading.Thread(target=pool.write_tensor, args=(theirs, data(BLOCK, seed=2)))
        other.start()
        other.join()
        assert torch.equal(_arena_bytes(pool, theirs, BLOCK), data(BLOCK, seed=2))  # written at once
        # another thread's batch meanwhile is not its own: its writes land at once too
        done = threading.Event()

        def batch_elsewhere() -> None:
            with pool.batched():
                pool.write_tensor(theirs, data(BLOCK, seed=3))
                assert torch.equal(_arena_bytes(pool, theirs, BLOCK), data(BLOCK, seed=3))
                done.set()

        t = threading.Thread(target=batch_elsewhere)
        t.start()
        t.join()
        assert done.is_set()
        assert not _arena_bytes(pool, mine, BLOCK).any()
    assert torch.equal(_arena_bytes(pool, mine, BLOCK), data(BLOCK, seed=1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_round_trip() -> None:
    pool = PagePool(256 * 8, page_bytes=256, device="cuda:0")
    span = pool.alloc(700)
    src = data(700).cuda()
    pool.write(span, src)
    out = pool.read(span, 700)
    assert out.is_cuda and torch.equal(out, src)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_host_pool_is_page_locked() -> None:
    pool = PagePool(3 * 256, page_bytes=256, pin_memory=True)  # locked as it is: not rounded up to 1024
    assert pool.pinned and pool._arena.is_pinned() and pool._arena.numel() == 3 * 256


def test_a_readers_flush_cannot_come_between_a_batched_write_and_its_mark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the span is written twice in one batch (x, then y): the later write must win. A reader on
    # another thread flushes just as x is queued; were its flush to run between x's mark and x's
    # queueing, the mark would be cleared with x still queued, y would not wait for x, and a slow
    # x could land last
    import time

    import kvstore.memcopy as memcopy

    page = 1 << 17
    pool = PagePool(page * 4, page_bytes=page, copier=Copier(2, part_bytes=1))
    span = pool.alloc(page)
    x = torch.full((page // 2,), 1, dtype=torch.int16)
    y = torch.full((page // 2,), 2, dtype=torch.int16)
    real_add, real_copy = pool._batch.add, memcopy._memcpy
    readers: list[threading.Thread] = []

    def add_while_a_reader_flushes(d: torch.Tensor, s: torch.Tensor) -> None:
        if not readers:
            readers.append(threading.Thread(target=pool.flush))
            readers[0].start()
            readers[0].join(0.1)  # it may run now, if it can
        real_add(d, s)

    def slow_x(d: torch.Tensor, s: torch.Tensor) -> None:
        if s is x:
            time.sleep(0.2)
        real_copy(d, s)

    monkeypatch.setattr(pool._batch, "add", add_while_a_reader_flushes)
    monkeypatch.setattr(memcopy, "_memcpy", slow_x)
    try:
        with pool.batched():
            pool.write_tensor(span, x)
            pool.write_tensor(span, y)
        readers[0].join()
        assert torch.equal(pool.read(span, page).view(torch.int16), y)
    finally:
        pool.copier.close()


def test_a_failed_batched_copy_is_raised_to_the_batch_and_a_free_elsewhere_still_frees(monkeypatch) -> None:
    # another thread's free flushed the batch first: the failure was raised there (its pages never
    # returned) and the batch ended as if its copy had landed (its block served unwritten)
    import kvstore.memcopy as memcopy

    page = 1 << 16
    pool = PagePool(page * 4, page_bytes=page)
    theirs, mine = pool.alloc(page), pool.alloc(page)
    queued, freed = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def fails(d: torch.Tensor, s: torch.Tensor) -> None:
        raise OSError("a bus error on the source")

    def batch() -> None:
        try:
            with pool.batched():
                pool.write_tensor(mine, torch.full((page // 2,), 1, dtype=torch.int16))  # queued
                queued.set()
                freed.wait(5)
            outcome["batch"] = "ended"
        except OSError as e:
            outcome["batch"] = e

    def free() -> None:
        queued.wait(5)
        try:
            pool.free(theirs)  # runs the pending copy first
            outcome["free"] = "freed"
        except OSError as e:
            outcome["free"] = e
        freed.set()

    monkeypatch.setattr(memcopy, "_memcpy", fails)
    threads = [threading.Thread(target=batch), threading.Thread(target=free)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert outcome["free"] == "freed"
    assert isinstance(outcome["batch"], OSError)
    assert pool.used_pages == 1


def test_a_pool_whose_shared_memory_cannot_be_had_allocates_its_own() -> None:
    # memory() answering None (no cupy for a GPU pool): the pool is private, and works as one
    asked = []

    def memory(capacity: int, page_bytes: int, pages: int, device: torch.device) -> None:
        asked.append((capacity, page_bytes, pages, device.type))
        return None

    pool = PagePool(8 * 1024, page_bytes=1024, memory=memory)
    assert asked == [(8 * 1024, 1024, 8, "cpu")] and pool.num_pages == 8
    span = pool.alloc(2048)
    pool.write(span, torch.arange(2048, dtype=torch.int16).view(torch.uint8)[:2048])
    assert torch.equal(pool.read(span, 2048), torch.arange(2048, dtype=torch.int16).view(torch.uint8)[:2048])


def test_a_private_pinned_pool_locks_exactly_its_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's pinned allocator rounds up to a power of two (a 33 GiB tier locked 64 GiB): the pool
    # registers its own mapping instead, of exactly its size, and unregisters it before it is unmapped.
    # CUDA's registration stands in here (no GPU); tests/tiers/test_pool.py's gpu tests do it for real.
    import kvstore.shm.cuda as cuda

    calls: list[tuple[str, int, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("kvstore.tiers.pool._registers_exactly", lambda: True)

    def register(ptr: int, n: int, *, read_only: bool, device: int = 0) -> bool:
        calls.append(("reg", ptr, n))
        return True

    monkeypatch.setattr(cuda, "host_register", register)
    monkeypatch.setattr(cuda, "host_unregister", lambda ptr: calls.append(("unreg", ptr, 0)))
    capacity = 3 * 1024 * 1024 + 4096  # not a power of two
    pool = PagePool(capacity, page_bytes=4096, pin_memory=True)
    assert pool.pinned and pool._arena.numel() == capacity
    assert calls == [("reg", pool._arena.data_ptr(), capacity)]
    span = pool.alloc(8192)
    pool.write(span, torch.full((8192,), 7, dtype=torch.uint8))
    assert torch.equal(pool.read(span, 8192), torch.full((8192,), 7, dtype=torch.uint8))
    kept = pool.read(span, 8192)  # a copy: nothing of the arena outlives the pool here
    ptr = pool._arena.data_ptr()
    del pool, span
    import gc

    gc.collect()
    assert calls[-1] == ("unreg", ptr, 0) and kept[0] == 7


def test_a_pinned_pool_whose_registration_fails_is_pageable_and_zeroed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvstore.shm.cuda as cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("kvstore.tiers.pool._registers_exactly", lambda: True)
    monkeypatch.setattr(cuda, "host_register", lambda ptr, n, *, read_only, device=0: False)
    monkeypatch.setattr(cuda, "host_unregister", lambda ptr: pytest.fail("nothing was registered"))
    pool = PagePool(64 * 1024, page_bytes=4096, pin_memory=True)
    assert not pool.pinned and pool._arena.numel() == 64 * 1024 and not pool._arena.any()
