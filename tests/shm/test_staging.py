"""A client's staging segment: sized in whole pages, freed when the daemon removes it while idle."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.layout import KVLayout
from kvstore.shm.mapping import SharedMapping
from kvstore.shm.plane import ALIGN, IDLE, PRESSED_IDLE, SharedPlane, StagingFull
from kvstore.shm.segment import Segment, private_dir
from tests.hardening.conftest import (
    LAYOUT,
    assert_exact,
    client,
    endpoint_of,
    prefix_kv,
    random_tokens,
    write_config,
)
from tests.shm.spy import sent_ops


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    return private_dir(tmp_path / "shm")


def test_an_idle_client_s_staging_segment_is_freed_as_it_is_removed(shm_dir: Path) -> None:
    clock = Clock()
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=256 << 10, lease=5.0, clock=clock)
    try:
        lease = plane.reserve(b"a", 64 << 10)
        assert lease.staging is not None
        path, size = lease.staging.path, lease.staging.size
        mine = Segment.open(path, size, writable=True)  # the client's mapping, as a put makes it
        mine.array(0, 64 << 10)[:] = 7
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.fstat(fd).st_blocks * 512 >= size  # reserved in full when made
            assert plane.take(lease.handle) is lease
            clock.now += IDLE + 1
            plane.sweep()  # idle, no lease: removed
            assert not path.exists() and plane.stats()["staging_clients"] == 0
            # the client was not told and still maps it, but no page of it is held any more
            assert os.fstat(fd).st_blocks == 0
            assert not mine.array(0, 64 << 10).any()  # zeros, not a fault
        finally:
            os.close(fd)
            mine.close()
    finally:
        plane.close()


def test_a_new_client_takes_the_staging_of_the_least_recently_used_idle_one(shm_dir: Path) -> None:
    """staging for two clients: a and b hold one each, then finish; c asks -> a's (the older) goes
    once idle PRESSED_IDLE seconds, not IDLE (a client that closed tells the daemon nothing); one a
    lease holds never goes."""
    clock = Clock()
    plane = SharedPlane(shm_dir, staging_bytes=512 << 10, per_client=256 << 10, lease=5.0, clock=clock)
    try:
        a = plane.reserve(b"a", 64 << 10)
        clock.now += 1
        b = plane.reserve(b"b", 64 << 10)
        assert a.staging is not None and b.staging is not None
        plane.take(a.handle)
        plane.take(b.handle)
        clock.now += 1
        with pytest.raises(StagingFull):  # a and b may be between two calls: theirs stay a while
            plane.reserve(b"c", 64 << 10)
        clock.now += PRESSED_IDLE
        c = plane.reserve(b"c", 64 << 10)  # not IDLE seconds on the socket
        assert c.staging is not None and not a.staging.path.exists() and b.staging.path.exists()
        clock.now += PRESSED_IDLE + 1
        d = plane.reserve(b"a", 64 << 10)  # a comes back: b, idle, makes way
        assert d.staging is not None and not b.staging.path.exists()
        with pytest.raises(StagingFull):  # c and a hold leases: nobody makes way for b
            plane.reserve(b"b", 64 << 10)
        assert plane.stats()["staging_clients"] == 2
    finally:
        plane.close()


def test_a_block_read_from_a_staging_segment_freed_meanwhile_is_a_miss(shm_dir: Path) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=4)
    nb, T = layout.block_nbytes, layout.block_tokens
    daemon_side = Segment.create(shm_dir, "staging", ALIGN)
    want = torch.randn(layout.shape(T)).to(torch.float16)
    daemon_side.array(0, nb)[:] = want.contiguous().view(torch.uint8).flatten().numpy()
    m = SharedMapping({"instance": "test", "per_client": ALIGN, "segments": []})
    staged = [[-1, np.array([[0, nb]], "<i8").tobytes(), b"", b""]]  # segment -1: this client's staging
    where = [str(daemon_side.path), daemon_side.size]
    try:
        out = torch.zeros(layout.shape(T), dtype=torch.float16)
        assert m.read_blocks(staged, layout, out, 0, where) == 1 and torch.equal(out, want)
        daemon_side.close(free=True)  # the daemon's sweep: removed, then freed
        assert m.read_blocks(staged, layout, out, 0, where) == 0  # it read zeros: not served
        assert m.moved == 1
    finally:
        m.close()
        daemon_side.close()


def test_a_staging_size_that_is_not_whole_pages_is_rounded_down(shm_dir: Path) -> None:
    plane = SharedPlane(shm_dir, staging_bytes=1 << 20, per_client=70_000, lease=5.0)
    try:
        offer = plane.offer()
        assert offer is not None and plane.per_client == offer["per_client"] == 17 * ALIGN
        whole = plane.reserve(b"a", plane.per_client)  # as much as a client is told it may hold
        assert whole.nbytes == plane.per_client
    finally:
        plane.close()


def test_a_put_in_chunks_fits_a_staging_size_that_is_not_whole_pages(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path, server={"shm_staging": "1MiB", "shm_staging_per_client": 70_000})
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(31)
    toks = random_tokens(rng, 100)  # 100 KiB: more than one client's staging, so two ranges in turn
    with client(ep) as c:
        c.ping()
        c.lookup([])
        assert c.shared_memory
        ops = sent_ops(c, monkeypatch)
        r = c.put(toks, prefix_kv(toks))
        assert (r.stored, r.failed) == (100, [])
        # every chunk through staging: no range refused for want of room, none sent over the socket
        assert ops.count("reserve") == 2 and "put" not in ops, ops
        monkeypatch.undo()
        got = c.get(toks)
        assert got.matched_blocks == 100


def test_a_read_through_staging_leaves_it_free_for_the_client_s_next_request(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a read's finish is not waited for where it is sent, but it reaches the daemon and frees the
    # read's range for the client's next request: a put right after a read that held most of the
    # client's staging finds the room for its range, and goes through staging, not over the socket.
    # (That the daemon has done it before the next request leaves, whatever its workers' timing,
    # is tests/wire/test_connection_defer.py's: here the finish nearly always wins that race anyway.)
    cfg = write_config(
        tmp_path,
        server={"shm_staging": "1MiB", "shm_staging_per_client": "64KiB"},
        policy={"promote_on_hit": False},  # the read stays a read from nvme, through staging
    )
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(47)
    held = random_tokens(rng, 40)  # 40 KiB of the client's 64 KiB while it is read
    with client(ep) as c:
        assert c.put(held, prefix_kv(held)).stored == 40
        assert c.flush(30) and c.evict(tier="hbm").blocks == 40 and c.evict(tier="ram").blocks == 40
        assert c.shared_memory
        out = torch.zeros(LAYOUT.shape(len(held)), dtype=LAYOUT.torch_dtype)
        ops = sent_ops(c, monkeypatch)
        for _ in range(15):
            r = c.get_into(held, out)
            assert r.tiers == ["nvme"] * 40
            new = random_tokens(rng, 30)  # 30 KiB: fits only once the read's 40 KiB are given back
            assert c.put(new, prefix_kv(new)).stored == 30
        assert "put" not in ops and "get" not in ops, ops  # every range was there when asked for
        assert ops.count("reserve") == 15
        assert_exact(held, out, len(held))
