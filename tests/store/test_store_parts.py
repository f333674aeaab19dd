"""The store's parts on their own: the index tree, pin leases, the write-through queue, sessions."""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.store.index import BlockIndex, Entry
from kvstore.store.pins import PinTable
from kvstore.store.sessions import SessionTable
from kvstore.store.writer import WriteThrough
from tests.store.storekit import Clock


def entry(key: int, parent: Entry | None) -> Entry:
    return Entry(key.to_bytes(32, "big"), parent, "ns", (), 0.0, 0.0)


def test_index_keeps_a_prefix_closed_tree() -> None:
    idx = BlockIndex(3)
    root = entry(0, None)
    idx.add(root, 0)
    a, b = entry(1, root), entry(2, root)
    idx.add(a, 0)
    idx.add(b, 1)
    c = entry(3, a)
    idx.add(c, 2)
    # subtree lists descendants before their ancestors: a safe removal order
    order = [e.key[-1] for e in idx.subtree(root)]
    assert order.index(3) < order.index(1) < order.index(0) and order.index(2) < order.index(0)
    assert [e.key[-1] for e in idx.chain(c)] == [0, 1, 3]
    assert c.position() == 2 and root.highest() == 0 and c.highest() == 2
    # a child can only join an indexed parent, and a parent only leaves after its children
    with pytest.raises(KeyError):
        idx.add(entry(9, entry(8, None)), 0)
    with pytest.raises(ValueError, match="children"):
        idx.remove(a)
    for e in idx.subtree(a):
        idx.remove(e)
    assert len(idx) == 2 and root.child_list() == [b]
    # LRU order per tier, least recent first; touching moves to the end
    idx.touch(root, 5.0)
    assert [e.key[-1] for e in idx.lru(0)] == [0]
    assert [e.key[-1] for e in idx.entries()] == [2, 0]


def test_any_below_asks_each_block_once_for_a_whole_chain() -> None:
    # evict --session asks it of every block of a chain: one walk per block was quadratic under the lock
    idx = BlockIndex(1)
    chain = [entry(0, None)]
    idx.add(chain[0], 0)
    for i in range(1, 2000):
        chain.append(entry(i, chain[-1]))
        idx.add(chain[-1], 0)
    side = entry(5000, chain[1500])  # another conversation leaves the chain at block 1500
    idx.add(side, 0)
    asked: list[int] = []

    def is_side(e: Entry) -> bool:
        asked.append(int.from_bytes(e.key, "big"))
        return e is side

    memo: dict[bytes, bool] = {}
    found = [idx.any_below(e, is_side, memo) for e in chain]
    assert found == [True] * 1501 + [False] * 499
    assert sorted(asked) == sorted(range(2000)) + [5000]  # each block once, whatever the order of questions
    assert idx.any_below(chain[3], lambda e: True, memo)  # answered from memo
    assert not idx.any_below(chain[1999], lambda e: False, {}) and idx.any_below(
        chain[1999], lambda e: True, {}
    )


def test_index_check_reports_disagreement_with_the_tiers() -> None:
    idx = BlockIndex(2)
    root = entry(0, None)
    idx.add(root, 0)
    names = ["hbm", "ram"]
    assert idx.check([{root.key}, set()], names, lambda e: False) == []
    problems = idx.check([set(), {b"x" * 32}], names, lambda e: False)
    assert any("tier lacks it" in p for p in problems)
    assert any("does not know" in p for p in problems)


def test_pins_are_leases() -> None:
    clock = Clock()
    pins = PinTable(clock)
    h1 = pins.pin([b"a", b"b"], 10)
    h2 = pins.pin([b"b"], 30)
    assert pins.is_pinned(b"a") and pins.pinned_keys() == 2
    assert pins.release(h1) and not pins.is_pinned(b"a") and pins.is_pinned(b"b")
    clock.advance(31)  # h2's holder died: the lease runs out
    assert not pins.is_pinned(b"b") and pins.pinned_keys() == 0
    assert not pins.release(h2)
    with pytest.raises(ValueError):
        pins.pin([b"c"], 0)


def test_lapsed_leases_are_swept_as_pins_are_taken() -> None:
    # without nvme no writer thread purges: leases of clients that died stayed, each key they named too
    clock = Clock()
    pins = PinTable(clock)
    for i in range(200):
        pins.pin([i.to_bytes(4, "big")], 10)
    clock.advance(11)
    for _ in range(100):
        pins.release(pins.pin([b"live"], 10))
    assert len(pins._handles) == 0 and len(pins._by_key) == 0


def test_write_queue_applies_back_pressure_and_drains() -> None:
    gate = threading.Event()
    written: list[bytes] = []

    def write(key: bytes) -> None:
        gate.wait(5)
        written.append(key)

    w = WriteThrough(maxsize=2, tick=0.05)
    w.start(write, lambda: None)
    try:
        # the first key is taken by the (stalled) thread, two wait in the queue, the fourth waits for room
        assert w.submit([b"1"], timeout=1) == []
        deadline = time.monotonic() + 5
        while w.depth() and time.monotonic() < deadline:
            time.sleep(0.01)
        t = time.monotonic()
        refused = w.submit([b"2", b"3", b"4"], timeout=0.2)
        assert refused == [b"4"] and time.monotonic() - t >= 0.2
        assert not w.drain(0.05)
        gate.set()
        assert w.drain(5)
        assert written == [b"1", b"2", b"3"] and w.depth() == 0
    finally:
        gate.set()
        assert w.close(5)


def test_a_session_tail_follows_its_blocks_out() -> None:
    table = SessionTable()
    table.record_put("conv", "ns", b"k3", 16, now=1.0)
    (changed,) = table.tail_gone(b"k3", b"k2", 4)
    assert changed.tail == b"k2" and changed.tokens == 12
    assert table.tail_gone(b"k3", b"k2", 4) == []  # no session ends at k3 any more
    assert table.remove("conv") and len(table) == 0
