"""Sessions at scale, against real daemons: thousands of conversations on one system prompt.

A block is tagged with the session that stored it, and no other: the
conversations that reuse it know it through their own chains (their tails).
So a system prompt shared by thousands of sessions keeps one small record,
is written to disk like any block, and survives a restart; session names are
bounded so that each fits the session table's LMDB key.
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import KVStoreError
from kvstore.store.sessions import MAX_SESSION_BYTES
from tests.hardening.conftest import (
    NS,
    T,
    assert_exact,
    client,
    endpoint_of,
    prefix_kv,
    random_tokens,
    write_config,
)

# 4,000 names of ~60 bytes: their tags would take ~250 KB in one record, past the record's 64 KiB
# field (what used to drop the block's write and then fail every put that demoted it).
SESSIONS = 4000


def test_thousands_of_sessions_on_one_system_prompt_stay_durable(daemons, tmp_path: Path) -> None:
    # write-through off: the system prompt reaches nvme when newer blocks push it down, after all
    # 4,000 sessions have used it
    config = write_config(tmp_path, nvme={"write_through": False})
    d = daemons(config)
    rng = np.random.default_rng(1)
    system = random_tokens(rng, 1)
    names = [f"conversation-{i:05d}-" + "x" * 40 for i in range(SESSIONS)]
    with client(endpoint_of(config)) as c:
        for name in names:
            r = c.put(system, prefix_kv(system), session=name)
            assert not r.failed
        turn = np.concatenate([system, random_tokens(rng, 2)])  # one conversation goes on
        assert not c.put(turn, prefix_kv(turn), session=names[7]).failed
        for _ in range(6):  # 600 newer blocks: more than hbm and ram hold (256 + 256)
            other = random_tokens(rng, 100)
            assert not c.put(other, prefix_kv(other)).failed
        assert c.lookup(system).tiers == ["nvme"]
        assert c.flush(60)
        stats = c.stats()["store"]
        assert stats["write_failures"] == 0 and stats["sessions"] == SESSIONS
    d.stop(signal.SIGKILL)  # what flush acknowledged is on disk: no clean stop needed

    daemons(config)
    with client(endpoint_of(config)) as c:
        got = c.get(turn)
        assert got.matched_tokens == 3 * T
        assert_exact(turn, got.kv, got.matched_tokens)
        assert c.inspect(session=names[-1]).info.blocks == 1
        assert c.inspect(session=names[7]).info.blocks == 3
        # the first session stored the system prompt, but thousands of others build on it: it stays
        c.evict(session=names[0])
        assert c.lookup(system).matched_tokens == T
        assert c.lookup(turn).matched_tokens == 3 * T


def test_session_names_are_bounded(daemons, tmp_path: Path) -> None:
    config = write_config(tmp_path)
    d = daemons(config)
    toks = random_tokens(np.random.default_rng(2), 2)
    longest = "é" * (MAX_SESSION_BYTES // 2)  # 200 bytes of UTF-8
    with client(endpoint_of(config)) as c:
        with pytest.raises(KVStoreError, match="session"):
            c.put(toks, prefix_kv(toks), session=longest + "x")
        with pytest.raises(KVStoreError, match="session"):
            c.put(toks, prefix_kv(toks), session="two\nlines")
        assert c.lookup(toks).matched_tokens == 0  # a refused put stores nothing
        assert not c.put(toks, prefix_kv(toks), session=longest).failed
    d.stop()
    daemons(config)
    with client(endpoint_of(config)) as c:
        assert [s.name for s in c.sessions()] == [longest]
        assert c.inspect(session=longest).info.blocks == 2
    assert NS.layout.block_tokens == T


def test_session_names_with_control_characters_are_refused(daemons, tmp_path: Path) -> None:
    # names are printed to operators' terminals (kvstore inspect): an ESC sequence there is a
    # terminal command, a bidi override hides what the name says
    config = write_config(tmp_path)
    daemons(config)
    toks = random_tokens(np.random.default_rng(3), 1)
    with client(endpoint_of(config)) as c:
        for bad in ("conv\x1b[2J", "tab\there", "del\x7f", "c1\x85", "bidi\u202eevil", "zw\u200bsp"):
            with pytest.raises(KVStoreError, match="control character U\\+"):
                c.put(toks, prefix_kv(toks), session=bad)
        assert c.lookup(toks).matched_tokens == 0  # a refused put stores nothing
        assert not c.put(toks, prefix_kv(toks), session="chat #7 — été 🌞").failed
        assert [s.name for s in c.sessions()] == ["chat #7 — été 🌞"]
        # such a name can still be asked about (an earlier build stored them): unknown, not refused
        with pytest.raises(KVStoreError) as unknown:
            c.inspect(session="conv\x1b[2J")
        assert "control character" not in str(unknown.value), unknown.value
