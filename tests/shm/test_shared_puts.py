"""Puts through a client's staging in many chunks against real daemons: stored whole, ranges reused only
once committed, and a daemon that stops answering or a staging that goes away mid-put cost one
time-out at most, never a block."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.wire.errors import RequestTimeout
from kvstore.wire.messages import Commit, ErrorReply
from tests.hardening.conftest import (
    Background,
    T,
    endpoint_of,
    prefix_kv,
    random_tokens,
    wait_until,
    write_config,
)
from tests.shm.clients import SHM, assert_served, attached, shm_stats, socket_client

# staging for 64 blocks of 1 KiB: a put of 100 blocks goes in four chunks through two ranges
CHUNKED = {**SHM, "shm_staging_per_client": "64KiB"}


def flood(ep: str, stop: Any) -> int:
    """Stats from a socket client of ``ep`` as fast as answered, until ``stop``: the daemon's queue
    kept full. Returns how many were answered."""
    n = 0
    with socket_client(ep) as s:
        while not stop.is_set():
            s.stats()
            n += 1
    return n


def test_a_put_in_many_chunks_is_stored_whole_while_the_daemon_turns_requests_away(
    daemons: Any, tmp_path: Path
) -> None:
    # one worker and one request queued at most: other clients' stats keep the daemon answering busy.
    # A put's chunks are committed two at a time, in order; a commit turned away while the next was
    # taken would leave that next chunk without its parent block (refused, not stored)
    cfg = write_config(
        tmp_path,
        server={**CHUNKED, "workers": 1, "max_queued_requests": 1},
    )
    ep = endpoint_of(cfg)
    daemons(cfg)

    rng = np.random.default_rng(12)
    with attached(ep) as c:
        floods = [Background(lambda stop: flood(ep, stop)) for _ in range(3)]
        try:
            for _ in range(4):
                toks = random_tokens(rng, 100)  # 100 KiB: four chunks of 32 blocks in 64 KiB of staging
                r = c.put(toks, prefix_kv(toks))
                assert r.stored == 100 and not r.failed, r
        finally:
            served = [f.join() for f in floods]
        assert all(served)
        assert_served(c, toks)


def test_a_staging_range_is_written_again_only_once_its_commit_is_answered(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # commit 0 turned away busy (a client at its in-flight bound, max_inflight_per_client <= 2) while
    # commit 1 is taken: 0 goes again after 1, and 1's answer comes first. Chunk 2 must not be written
    # into the range that the commit of chunk 0 sent again still reads (by their turns, it was: the
    # daemon could store chunk 2's K/V as chunk 0's)
    cfg = write_config(tmp_path, server=CHUNKED)
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(14)
    toks = random_tokens(rng, 100)  # four chunks, two staging ranges
    with attached(ep) as c:
        conn = c._conn
        send, recv, stage = conn._send, conn._recv, c._shm._stage
        refused: list[tuple[int, ErrorReply]] = []  # the refusal, until it is read
        turned: list[bool] = []
        reading: dict[int, int] = {}  # commits sent and not answered: request id -> staging range
        overwritten: list[int] = []

        def turn_away_the_first_commit(msg: Any) -> int:
            if isinstance(msg, Commit) and not turned:
                turned.append(True)
                refused.append((-1, ErrorReply(code="busy", message="over max_inflight_per_client")))
                return -1  # as if the daemon had refused it: never sent
            rid = send(msg)
            if isinstance(msg, Commit):
                reading[rid] = msg.handle
            return rid

        def answers(deadline: float) -> Any:
            got = refused.pop() if refused else recv(deadline)
            if got is not None:
                reading.pop(got[0], None)
            return got

        def write(m: Any, r: Any, *args: Any, **kw: Any) -> Any:
            if r.handle in reading.values():
                overwritten.append(args[3])  # the first block of the chunk written over a commit's bytes
            return stage(m, r, *args, **kw)

        monkeypatch.setattr(conn, "_send", turn_away_the_first_commit)
        monkeypatch.setattr(conn, "_recv", answers)
        monkeypatch.setattr(c._shm, "_stage", write)
        r = c.put(toks, prefix_kv(toks))
        assert not overwritten, f"chunks starting at blocks {overwritten} overwrote a commit not answered"
        # commit 1 ran before chunk 0 was stored: its blocks and those after them are refused, and say so
        assert r.stored == 32 and {f.block for f in r.failed} == set(range(32, 100)), r
        assert {f.code for f in r.failed} == {"missing_parent"}
        monkeypatch.undo()
        assert_served(c, toks[: 32 * T])  # what was stored is chunk 0's own K/V, bit for bit
        r = c.put(toks, prefix_kv(toks))
        assert r.stored == 68 and r.present == 32 and not r.failed
        assert_served(c, toks)


def test_a_put_cut_short_by_a_daemon_that_stops_answering_costs_one_timeout(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path, server=CHUNKED)
    ep = endpoint_of(cfg)
    d = daemons(cfg)
    rng = np.random.default_rng(13)
    toks = random_tokens(rng, 100)  # four chunks, two staging ranges
    with attached(ep, timeout=2.0, retries=0) as c:
        stage = c._shm._stage

        def stop_after_the_first_chunk(*args: Any, **kw: Any) -> Any:
            if args[5] > 0 and not stopped:  # the daemon answered the reserves and took chunk 0
                os.kill(d.proc.pid, signal.SIGSTOP)
                stopped.append(True)
            return stage(*args, **kw)

        stopped: list[bool] = []
        monkeypatch.setattr(c._shm, "_stage", stop_after_the_first_chunk)
        t0 = time.monotonic()
        try:
            with pytest.raises(RequestTimeout):
                c.put(toks, prefix_kv(toks))
            took = time.monotonic() - t0
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert stopped
        # the ranges were given back without waiting: one time-out, not one more per range
        assert took < 3.0, f"{took:.2f} s"  # awaited, each would add 2 s
        monkeypatch.undo()
        assert wait_until(lambda: shm_stats(c)["leases"] == 0, 10)  # the finishes arrived
        r = c.put(toks, prefix_kv(toks))
        assert r.stored + r.present == 100 and not r.failed
        assert_served(c, toks)


def test_staging_that_cannot_be_mapped_mid_put_sends_the_rest_over_the_socket(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstore.shm.segment import ShmUnavailable

    cfg = write_config(tmp_path, server=CHUNKED)
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(14)
    toks = random_tokens(rng, 100)  # four chunks
    with attached(ep) as c:
        m = c._shm.mapping()
        assert m is not None
        view, calls = m.staging_view, []

        def second_chunk_fails(*args: Any) -> Any:
            calls.append(args)
            if len(calls) == 2:
                raise ShmUnavailable("the staging segment went away")
            return view(*args)

        monkeypatch.setattr(m, "staging_view", second_chunk_fails)
        r = c.put(toks, prefix_kv(toks))
        # chunk 0's commit was in flight: its blocks are stored or present, the rest stored by the socket
        assert r.stored + r.present == 100 and r.stored >= 68 and not r.failed, r
        assert len(calls) == 2 and not c.shared_memory  # the socket from now on, for this daemon
        assert c.ping()  # the connection is in step: no late commit answer read as the ping's
        assert_served(c, toks)


def test_a_put_interrupted_while_staging_gives_its_range_back_at_once(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path, server=SHM, policy={"pin_lease": "60s"})
    daemons(cfg)
    rng = np.random.default_rng(11)
    toks = random_tokens(rng, 3)
    with attached(endpoint_of(cfg)) as c:

        def interrupted(*_: Any, **__: Any) -> None:
            raise KeyboardInterrupt  # Ctrl-C while the blocks are copied into staging

        monkeypatch.setattr(c._shm._copier, "copy", interrupted)
        with pytest.raises(KeyboardInterrupt):
            c.put_from(toks, prefix_kv(toks))
        assert wait_until(lambda: shm_stats(c)["staging_used"] == 0, 5)  # not in 60 s, at the lease's end
        monkeypatch.undo()
        assert c.put_from(toks, prefix_kv(toks)).stored == 3


def test_a_commit_the_daemon_cannot_read_gives_its_range_back_at_once(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a commit refused as it is parsed never reaches the code that takes the range back: the client
    # gives it back, or the range stayed taken until its lease's end
    import dataclasses

    from kvstore.shm import client_path
    from kvstore.wire.errors import ServerError

    cfg = write_config(tmp_path, server=SHM, policy={"pin_lease": "60s"})
    daemons(cfg)
    toks = random_tokens(np.random.default_rng(12), 3)
    stage = client_path.SharedPath._stage
    with attached(endpoint_of(cfg)) as c:

        def unreadable(*a: Any, **kw: Any) -> Commit:
            return dataclasses.replace(stage(*a, **kw), dtype="no-such-dtype")

        monkeypatch.setattr(client_path.SharedPath, "_stage", unreadable)
        with pytest.raises(ServerError):
            c.put_from(toks, prefix_kv(toks))
        assert wait_until(lambda: shm_stats(c)["staging_used"] == 0, 5)  # not in 60 s, at the lease's end
        monkeypatch.undo()
        assert c.put_from(toks, prefix_kv(toks)).stored == 3


def test_a_read_s_finish_gets_through_a_busy_daemon(daemons: Any, tmp_path: Path) -> None:
    # reads of pool blocks (no staging): each ends with a finish that gives the pins back. The daemon
    # turns requests away busy while other clients keep its one queue place; a finish must get
    # through (taken past the budget; else sent again), or the pins stay until the lease runs out
    # (30 s) and count against the client
    cfg = write_config(tmp_path, server={**SHM, "workers": 1, "max_queued_requests": 1})
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(15)
    toks = random_tokens(rng, 8)
    with attached(ep) as c:
        assert c.put(toks, prefix_kv(toks)).stored == 8

        floods = [Background(lambda stop: flood(ep, stop)) for _ in range(3)]
        try:
            for _ in range(40):
                assert c.get(toks).matched_blocks == 8
        finally:
            assert all(f.join() for f in floods)
        c.ping()  # the last read's finish is answered before this goes
        shm = shm_stats(c)
        assert shm["leases"] == 0 and c.stats()["store"]["pinned"] == 0, shm


def test_a_pipelined_put_writes_no_staging_once_a_hello_names_another_daemon(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a put's next chunk, after a reconnect whose hello came from a restarted daemon: the ranges it
    # reserved were the old daemon's (removed, their memory freed); written now, they would take
    # memory back in a file no daemon counts. The put goes on against the new daemon's segments
    cfg = write_config(tmp_path, server=CHUNKED)
    ep = endpoint_of(cfg)
    daemons(cfg)
    toks = random_tokens(np.random.default_rng(16), 100)  # four chunks, two staging ranges
    with attached(ep) as c:
        conn, stage = c._conn, c._shm._stage
        written_stale: list[int] = []
        restarted: list[bool] = []

        def write(m: Any, r: Any, *args: Any, **kw: Any) -> Any:
            offer = conn.shm_offer
            assert offer is not None
            if offer["instance"] == "restarted":
                written_stale.append(args[3])  # the chunk's first block
            out = stage(m, r, *args, **kw)
            if not restarted:  # after the first chunk: a hello from another daemon, as a reconnect's
                restarted.append(True)
                conn.shm_offer = {**offer, "instance": "restarted"}
            return out

        monkeypatch.setattr(c._shm, "_stage", write)
        r = c.put(toks, prefix_kv(toks))
        assert not written_stale, f"chunks from blocks {written_stale} written into the old daemon's staging"
        assert r.stored + r.present == 100 and not r.failed, r
        monkeypatch.undo()
        assert_served(c, toks)


def test_blocks_over_half_a_client_s_staging_go_through_it_one_range_at_a_time(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 40 KiB blocks, 64 KiB of staging per client: two ranges of a block each never fit at once
    import torch

    import kvstore.socket_path as socket_path
    from kvstore.client import KVStoreClient
    from kvstore.layout import KVLayout

    cfg = write_config(
        tmp_path, server=CHUNKED, hbm={"device": "cpu", "capacity": "1MiB"}, ram={"capacity": "1MiB"}
    )
    ep = endpoint_of(cfg)
    daemons(cfg)
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=160)
    assert 64 << 10 < 2 * layout.block_nbytes <= 2 * (64 << 10)
    over_socket: list[int] = []
    real = socket_path.SocketPath.put_from

    def counted(self: Any, *args: Any, **kw: Any) -> Any:
        over_socket.append(kw.get("first", 0))
        return real(self, *args, **kw)

    monkeypatch.setattr(socket_path.SocketPath, "put_from", counted)
    toks = np.arange(3 * 160, dtype=np.uint32)
    kv = torch.randn(layout.shape(3 * 160)).half()
    with KVStoreClient(ep, model="big-blocks", layout=layout, timeout=10.0) as c:
        r = c.put(toks, kv)
        assert r.stored == 3 and not r.failed, r
        assert c.shared_memory and over_socket == []  # staged, a block at a time, not the socket
        got = c.get(toks)
        assert got.kv is not None and torch.equal(got.kv, kv)
        assert wait_until(lambda: shm_stats(c)["leases"] == 0, 5)
