"""Sessions are bounded: a client inventing names cannot fill memory or nvme with them.

::

    tenant a, cap 3:  put s0 s1 s2, put s0 again   LRU: s1 s2 s0
                      put s3                       -> s1 forgotten (row too); its blocks stay
    dead (no block left): listed with 0 blocks, the first to go for room, at most MAX_DEAD_SESSIONS,
                          and forgotten at the next start; a session whose blocks are held survives
                          restarts however long idle
    disk failing:     the journal keeps at most MAX_FAILED_SESSION_ROWS session rows to retry, logs
                      once, and writes every session again once the disk is back

Real stores over real LMDB files (tests/store/conftest.py); the one injected part is the failing
session table of the nvme tier in the last story.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvstore.codecs import get_codec
from kvstore.keys import Namespace
from kvstore.results import EvictFilter, InvalidRequest
from kvstore.store import journal as journal_mod
from kvstore.store import sessions as sessions_mod
from kvstore.store.engine import Store
from kvstore.tiers.base import TierIOError
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.ram import RamTier
from tests.store.storekit import HBM_PAGE, LAYOUT, NS, RAM_PAGE, Clock, T, kv, tokens

A = Namespace("tiny-model", LAYOUT, tenant="a")
B = Namespace("tiny-model", LAYOUT, tenant="b")


def names(s: Store) -> set[str]:
    return {i.name for i in s.sessions()}


def rows(s: Store) -> set[str]:
    """The session rows on nvme (after a flush)."""
    nvme = s.tiers.nvme
    assert nvme is not None
    return {name for name, _ in nvme.iter_sessions()}


def test_a_tenant_past_its_cap_forgets_its_least_recently_used_session_not_the_put(
    make_store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sessions_mod, "MAX_SESSIONS_PER_TENANT", 3)
    clock = Clock()
    s = make_store(clock=clock, hbm_blocks=16, ram_blocks=16)
    for i in range(3):
        clock.advance(1)
        assert not s.put(A, tokens(1, seed=i), kv(T, i), session=f"s{i}").failed
        assert not s.put(B, tokens(1, seed=i), kv(T, i), session=f"b{i}").failed
    clock.advance(1)
    assert not s.put(A, tokens(2, seed=0), kv(2 * T, 0), session="s0").failed  # s0 used again
    # tenant a is at its cap: a new session makes its least recently used one (s1) go
    r = s.put(A, tokens(1, seed=3), kv(T, 3), session="s3")
    assert r.stored == 1 and not r.failed
    assert names(s) == {"s0", "s2", "s3", "b0", "b1", "b2"}  # tenant b keeps its own three
    assert s.lookup(A, tokens(1, seed=1)).matched_blocks == 1  # only the name went, not the blocks
    assert s.stats().sessions_forgotten == 1
    assert s.flush(10)
    assert rows(s) == {"s0", "s2", "s3", "b0", "b1", "b2"}  # its row went too
    s.close()
    again = make_store(clock=clock, hbm_blocks=16, ram_blocks=16, path=tmp_path / "nvme")
    assert names(again) == {"s0", "s2", "s3", "b0", "b1", "b2"}
    assert again.session("s0").info.blocks == 2


def test_dead_sessions_are_listed_then_go_first_and_are_bounded(
    make_store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sessions_mod, "MAX_SESSIONS_PER_TENANT", 4)
    monkeypatch.setattr(sessions_mod, "MAX_DEAD_SESSIONS", 2)
    clock = Clock()
    s = make_store(clock=clock, hbm_blocks=16, ram_blocks=16)
    other = Namespace("other-model", LAYOUT, tenant="a")
    for i in range(3):
        clock.advance(1)
        assert not s.put(other, tokens(2, seed=i), kv(2 * T, i), session=f"gone{i}").failed
    clock.advance(1)
    assert not s.put(A, tokens(1, seed=9), kv(T, 9), session="live").failed
    # every block of the other model goes: its three sessions are dead (no block left)
    assert s.evict(EvictFilter(namespace=other.id)).blocks == 6
    # the two that died last stay listed, with no block: an operator sees the conversation went
    assert names(s) == {"gone1", "gone2", "live"}
    assert s.stats().sessions_forgotten == 1
    assert s.session("gone2").info.blocks == 0
    assert s.flush(10)
    assert rows(s) == {"gone1", "gone2", "live"}
    # tenant a (cap 4) has three sessions; two new ones make a dead one go, not "live" (the oldest
    # live session would be "live" itself, used before both dead ones were)
    clock.advance(1)
    assert not s.put(A, tokens(1, seed=10), kv(T, 10), session="new1").failed
    clock.advance(1)
    assert not s.put(A, tokens(1, seed=11), kv(T, 11), session="new2").failed
    assert names(s) == {"gone2", "live", "new1", "new2"}


def test_dead_sessions_go_at_restart_and_held_ones_survive_a_day_idle(make_store, tmp_path: Path) -> None:
    clock = Clock()
    s = make_store(clock=clock, hbm_blocks=2, ram_blocks=2)  # most blocks live on nvme only
    held, lost = tokens(3, seed=1), tokens(2, seed=2)
    assert not s.put(NS, lost, kv(2 * T, 2), session="lost").failed
    clock.advance(100)
    assert not s.put(NS, held, kv(3 * T, 1), session="held").failed
    assert s.evict(EvictFilter(older_than=50)).blocks == 2  # every block of "lost"
    assert s.session("lost").info.blocks == 0  # dead, still listed until the store restarts
    assert s.flush(10)
    s.close()
    clock.advance(86400)  # a day later
    again = make_store(clock=clock, hbm_blocks=2, ram_blocks=2, path=tmp_path / "nvme")
    assert names(again) == {"held"}
    assert again.stats().sessions_forgotten == 1
    assert again.session("held").info.blocks == 3
    assert again.get(NS, held).matched_tokens == 3 * T
    assert again.flush(10)
    assert rows(again) == {"held"}  # the dead session's row went with it


class FailingRowsNvme(NvmeTier):
    """An nvme tier whose session and namespace rows fail to write while ``failing`` (a full disk)."""

    failing = False
    fail_after: int | None = None  # row writes that succeed before ``failing`` turns on by itself

    def put_session(self, name: str, info: dict) -> None:
        if self.fail_after is not None:
            self.fail_after -= 1
            self.failing = self.failing or self.fail_after < 0
        if self.failing:
            raise TierIOError("no space left on device (injected)")
        super().put_session(name, info)

    def drop_session(self, name: str) -> bool:
        if self.failing:
            raise TierIOError("no space left on device (injected)")
        return super().drop_session(name)


def test_failed_session_rows_kept_for_retry_are_bounded_and_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(journal_mod, "MAX_FAILED_SESSION_ROWS", 8)
    monkeypatch.setattr(sessions_mod, "MAX_SESSIONS_PER_TENANT", 30)
    caplog.set_level(logging.INFO, logger="kvstore")

    def store() -> tuple[Store, FailingRowsNvme]:
        hbm = HbmTier(64 * HBM_PAGE, page_bytes=HBM_PAGE)
        ram = RamTier(8 * RAM_PAGE, get_codec("raw"), page_bytes=RAM_PAGE, pin_memory=False)
        nvme = FailingRowsNvme(tmp_path / "nvme", 1 << 22, get_codec("int4"))
        return Store(hbm, ram, nvme, tick=0.05), nvme

    s, nvme = store()
    for i in range(5):  # on disk before it fails; forgotten (past the cap) while it fails
        assert not s.put(NS, tokens(1, seed=100 + i), kv(T, i), session=f"old-{i}").failed
    assert s.flush(10) and rows(s) == {f"old-{i}" for i in range(5)}
    nvme.failing = True
    for i in range(30):
        assert not s.put(NS, tokens(1, seed=i), kv(T, i), session=f"conv-{i}").failed
    assert not s.flush(10)  # the rows could not be written: not durable
    # at most 8 session rows are kept to retry; the others are given up, to be rewritten whole
    assert s._journal.pending <= 8 + 1
    assert s._journal.given_up >= 22
    failures = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(failures) <= 2, [r.getMessage() for r in failures]  # once, not once per row
    # the rewrite fails too, the disk still full: kept, and so is every row it stands for
    assert not s.flush(10)
    assert s._journal.pending >= 1
    # then it fails part way through (the disk fills again after a few rows): kept again, whole
    nvme.failing, nvme.fail_after = False, 5
    assert not s.flush(10)
    assert s._journal.pending >= 1
    nvme.failing, nvme.fail_after = False, None  # the disk has room again
    assert s.flush(10)
    assert s._journal.pending == 0
    # what is on disk is what is in memory: the rows given up written, the forgotten ones' gone
    assert names(s) == rows(s) == {f"conv-{i}" for i in range(30)}
    s.close()
    s, _ = store()
    try:
        assert names(s) == {f"conv-{i}" for i in range(30)}
        assert s.session("conv-3").info.blocks == 1
    finally:
        s.close()


def test_a_session_an_earlier_build_named_with_a_control_character_goes_on(
    make_store, tmp_path: Path
) -> None:
    # earlier builds refused only NUL and line breaks: such a conversation is continued, not refused
    s = make_store()
    first = tokens(1, seed=1)
    assert not s.put(NS, first, kv(T, 1), session="plain").failed
    assert s.flush(10)
    nvme = s.tiers.nvme
    assert nvme is not None
    row = dict(nvme.iter_sessions())["plain"]
    legacy = "conv\x1b[1m"
    if "name" in row:
        row["name"] = legacy
    nvme.put_session(legacy, row)
    nvme.drop_session("plain")
    s.close()
    again = make_store(path=tmp_path / "nvme")
    assert names(again) == {legacy}
    both = tokens(2, seed=1)
    r = again.put(NS, both, kv(2 * T, 1), session=legacy)
    assert r.stored == 1 and not r.failed, r
    assert again.session(legacy).info.blocks == 2
    # a new name is held to today's rule; the zero-width joiner of an emoji sequence is text
    with pytest.raises(InvalidRequest, match="control character U\\+001B"):
        again.put(NS, tokens(1, seed=5), kv(T, 5), session="new\x1b[1m")
    assert not again.put(NS, tokens(1, seed=6), kv(T, 6), session="\U0001f469\u200d\U0001f4bb").failed
