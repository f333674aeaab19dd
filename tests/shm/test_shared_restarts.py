"""A client with the daemon's segments mapped, across restarts: no error, no leaked lease, no stale mapping.

Daemons here are the hardening tests' (tests/hardening/conftest.py), on one
ipc endpoint, restarted under the same client.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.client import KVStoreClient
from tests.hardening.conftest import (
    LAYOUT,
    T,
    assert_exact,
    client,
    endpoint_of,
    prefix_kv,
    random_tokens,
    wait_until,
    write_config,
)
from tests.shm.spy import sent_ops

SHM = {"shm_staging": "1MiB", "shm_staging_per_client": "512KiB"}


def attached(endpoint: str) -> KVStoreClient:
    c = client(endpoint, retries=5)
    c.ping()
    c.lookup([])
    assert c.shared_memory, "an ipc client of the daemon's user is offered shared memory"
    return c


def staging_maps() -> list[str]:
    """The staging segments this process maps now."""
    return [line.split()[-1] for line in open("/proc/self/maps") if "-staging" in line]


def test_a_daemon_restarted_with_shared_memory_off_is_read_and_written_over_the_socket(
    daemons: Any, tmp_path: Path
) -> None:
    on = write_config(tmp_path, "on.toml", server=SHM)
    off = write_config(tmp_path, "off.toml", server={"shared_memory": "off"})
    ep = endpoint_of(on)
    assert endpoint_of(off) == ep
    rng = np.random.default_rng(21)
    a, b, c2 = random_tokens(rng, 4), random_tokens(rng, 4), random_tokens(rng, 4)
    d = daemons(on)
    with attached(ep) as c:
        assert c.put(a, prefix_kv(a)).stored == 4
        assert c.flush(30)
        old = c._shm.mapping()
        assert old is not None and staging_maps()
        d.stop()
        d = daemons(off)
        # the first read after the restart: the socket, not an error (its Locate is answered
        # no_shared_memory; the hello it makes offers none)
        out = torch.zeros(LAYOUT.shape(4 * T), dtype=torch.float16)
        r = c.get_into(a, out)
        assert r.matched_blocks == 4
        assert_exact(a, r.kv, r.matched_tokens)
        assert not c.shared_memory
        assert c._shm._mapping is None and not staging_maps()  # the old daemon's segments let go

        d.stop()
        d = daemons(on)
        assert c.get(a).matched_blocks == 4 and c.shared_memory  # mapped again
        d.stop()
        d = daemons(off)
        # the first put after the restart: its Reserve carries no namespace, so only its answer
        # says the daemon changed; stored over the socket, not refused
        r = c.put(b, prefix_kv(b))
        assert (r.stored, r.failed) == (4, [])
        assert not c.shared_memory and c._shm._mapping is None
        assert c.put_from(c2, prefix_kv(c2)).stored == 4
        for toks in (b, c2):
            got = c.get(toks)
            assert_exact(toks, got.kv, got.matched_tokens)
            assert got.matched_blocks == 4


def test_a_client_greeted_by_a_daemon_that_restarted_before_its_first_read_maps_the_new_one(
    daemons: Any, tmp_path: Path
) -> None:
    # the offer of the hello before the restart named segments gone since: that daemon instance was
    # refused, and the client read over the socket for the rest of its life (SGLang's lookup client)
    cfg = write_config(tmp_path, server=SHM)
    d = daemons(cfg)
    a = random_tokens(np.random.default_rng(23), 4)
    with client(endpoint_of(cfg), retries=5) as c:
        assert c.lookup(a).matched_tokens == 0  # greeted, offered shared memory, nothing mapped yet
        assert c._shm._mapping is None
        d.stop()
        d = daemons(cfg)
        assert c.put(a, prefix_kv(a)).stored == 4
        r = c.get(a)
        assert r.matched_blocks == 4
        assert_exact(a, r.kv, r.matched_tokens)
        assert c.shared_memory and not c._shm._refused


def test_a_put_first_after_a_restart_gives_back_the_new_daemon_s_range_and_maps_its_segments(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path, server=SHM, policy={"pin_lease": "30s"})
    ep = endpoint_of(cfg)
    rng = np.random.default_rng(22)
    a, b = random_tokens(rng, 5), random_tokens(rng, 5)
    d = daemons(cfg)
    with attached(ep) as c, client(ep) as other:
        assert c.put(a, prefix_kv(a)).stored == 5
        first = c._shm.mapping()
        assert first is not None
        d.stop()
        daemons(cfg)
        ops = sent_ops(c, monkeypatch)
        r = c.put(b, prefix_kv(b))
        assert (r.stored, r.failed) == (5, [])
        # reserve (the new daemon's range) -> finish (given back) -> hello (its offer) -> reserve on
        # its segments -> commit: not three reserves on the old mapping, then the socket
        assert ops[:3] == ["reserve", "finish", "hello"], ops
        assert "commit" in ops and "put" not in ops, ops
        now = c._shm.mapping()
        assert now is not None and now.instance != first.instance
        # nothing is held on the new daemon: not until the 30 s lease runs out
        shm = other.stats()["server"]["shm"]
        assert (shm["leases"], shm["staging_used"]) == (0, 0), shm
        monkeypatch.undo()
        got = c.get(b)
        assert_exact(b, got.kv, got.matched_tokens)
        assert wait_until(lambda: other.stats()["server"]["shm"]["leases"] == 0, 5)


def test_a_client_at_its_lease_bound_uses_the_socket_at_once(
    daemons: Any, tmp_path: Path, monkeypatch
) -> None:
    # the bound was answered busy: the connection re-sent for its whole time-out, each try pinning
    # the blocks again, before the call fell back
    from kvstore.shm.plane import MAX_LEASES_PER_CLIENT
    from kvstore.wire.messages import Locate, LocateOk

    cfg = write_config(tmp_path, server=SHM)
    daemons(cfg)
    rng = np.random.default_rng(5)
    a, b = random_tokens(rng, 4), random_tokens(rng, 4)
    with attached(endpoint_of(cfg)) as c:
        assert c.put(a, prefix_kv(a)).stored == 4
        m, ns = c._shm.mapping(), c.namespace
        assert m is not None and ns is not None
        for _ in range(MAX_LEASES_PER_CLIENT):  # located, never finished (a client's bug)
            assert isinstance(
                c._conn.call(Locate(ns=ns.id, tokens=a, tiers=m.tiers), idempotent=True), LocateOk
            )
        pinned = c.stats()["store"]["pinned"]
        ops = sent_ops(c, monkeypatch)
        out = torch.zeros(LAYOUT.shape(4 * T), dtype=torch.float16)
        t0 = time.monotonic()
        assert c.get_into(a, out).matched_blocks == 4
        assert_exact(a, out, 4 * T)
        assert c.put(b, prefix_kv(b)).stored == 4
        assert time.monotonic() - t0 < c._conn.timeout
        assert ops.count("locate") == 1 and ops.count("reserve") == 1  # refused once each: the socket
        assert c.stats()["store"]["pinned"] == pinned  # the refused locate pinned nothing


def segments_resident() -> int:
    """KiB of kvstore segments (removed or not) this process's mappings hold in memory (smaps' Rss)."""
    held, ours = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
            ours = "/kvs-" in line
        elif ours and head[:1] == ["Rss:"]:
            held += int(head[1])
    return held


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_an_idle_client_s_mappings_hold_no_memory_once_the_daemon_is_gone(
    daemons: Any, tmp_path: Path, stop: str
) -> None:
    # the client reads, then sleeps through a restart: its mappings of the old pools stay until its
    # next call, but their memory is given back (by the stopping daemon, or by the next one's sweep
    # after a crash), where the next daemon needs it; that next call then reads exactly
    cfg = write_config(tmp_path, server=SHM, hbm={"capacity": "4MiB"}, ram={"capacity": "4MiB"})
    ep = endpoint_of(cfg)
    d = daemons(cfg)
    rng = np.random.default_rng(25)
    a = random_tokens(rng, 64)
    with attached(ep) as c:
        assert c.put(a, prefix_kv(a)).stored == 64
        assert c.flush(30)
        assert c.get(a).matched_blocks == 64  # every page of it read through this client's mapping
        assert segments_resident() >= 64  # KiB: the blocks' pages, at least
        d.stop(getattr(signal, stop))
        if stop == "SIGTERM":
            assert segments_resident() == 0  # freed by the daemon as it stopped
        else:
            assert segments_resident() >= 64  # a killed daemon frees nothing ...
        d = daemons(cfg)
        assert segments_resident() == 0  # ... the next one's sweep does
        got = c.get(a)
        assert got.matched_blocks == 64 and c.shared_memory
        assert_exact(a, got.kv, got.matched_tokens)


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_a_restart_under_an_idle_client_needs_room_for_one_daemon_s_pools(
    daemons: Any, tmp_path: Path, stop: str
) -> None:
    # a filesystem that holds one daemon's pools and a staging segment, not two daemons' pools: the
    # old pools an idle client still maps must not keep the next daemon off shared memory
    from tests.hardening.conftest import mounted

    small = tmp_path / "small"
    with mounted(small, "size=800k", "mode=0700") as ok:
        if not ok:
            pytest.skip("needs root to mount a small tmpfs")
        server = {"shm_staging": "256KiB", "shm_staging_per_client": "64KiB", "shm_dir": str(small)}
        cfg = write_config(tmp_path, server=server)  # pools of 256 KiB each
        ep = endpoint_of(cfg)
        d = daemons(cfg)
        rng = np.random.default_rng(26)
        a = random_tokens(rng, 16)
        with attached(ep) as c:
            assert c.put(a, prefix_kv(a)).stored == 16 and c.flush(30)
            assert c.get(a).matched_blocks == 16
            d.stop(getattr(signal, stop))
            d = daemons(cfg)
            got = c.get(a)
            assert got.matched_blocks == 16
            assert_exact(a, got.kv, got.matched_tokens)
            assert c.shared_memory and c.stats()["server"]["shm"] is not None, d.output()
        d.stop()
