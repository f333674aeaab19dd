"""Where shared memory cannot serve (tcp, shared_memory off, segments that cannot be mapped or held, no
staging room), the socket does: the same answers, nothing lost; and restarts and kills with clients
attached (real daemons, as in test_shared_daemon.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.layout import KVLayout
from tests.hardening.conftest import (
    LAYOUT,
    MODEL,
    NS,
    Raw,
    T,
    assert_exact,
    client,
    endpoint_of,
    header,
    prefix_kv,
    random_tokens,
    wait_until,
    write_config,
)
from tests.shm.clients import SHM, assert_served, attached, shm_stats, socket_client


def test_tcp_clients_and_a_daemon_with_shared_memory_off_use_the_socket(daemons: Any, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "tcp").mkdir()
    (tmp_path / "off").mkdir()
    tcp = write_config(
        tmp_path / "tcp", server={**SHM, "endpoint": f"tcp://127.0.0.1:{port}", "allow_insecure_tcp": True}
    )
    off = write_config(tmp_path / "off", server={**SHM, "shared_memory": "off"})
    rng = np.random.default_rng(7)
    a = random_tokens(rng, 3)
    for cfg in (tcp, off):
        ep = endpoint_of(cfg)
        daemons(cfg)
        with client(ep) as c:
            assert c.put(a, prefix_kv(a)).stored == 3
            got = c.get(a)
            assert_exact(a, got.kv, got.matched_tokens)
            assert not c.shared_memory and c.stats()["server"]["shm"] is None
        raw = Raw(ep)  # asking for it explicitly gets nothing either, and the shm ops are refused
        try:
            hello = raw.ask(header("hello", namespace=NS.to_dict(), shm=True))
            assert hello["op"] == "hello" and hello.get("shm") is None
            r = raw.ask(header("reserve", rid=2, nbytes=4096))
            assert r["op"] == "error" and r["code"] == "no_shared_memory"
        finally:
            raw.close()


def test_clients_survive_a_restart_and_a_kill_and_dead_segments_are_removed(
    daemons: Any, tmp_path: Path
) -> None:
    cfg = write_config(tmp_path, server=SHM)
    ep = endpoint_of(cfg)
    d = daemons(cfg)
    rng = np.random.default_rng(8)
    a, b = random_tokens(rng, 5), random_tokens(rng, 5)
    with attached(ep, retries=5) as c:
        assert c.put(a, prefix_kv(a)).stored == 5
        first = c._shm.mapping()
        assert first is not None
        segments = [Path(p) for p in shm_stats(c)["segments"]]
        assert c.flush(30)
        d.stop()  # a clean stop removes its segments
        assert not any(p.exists() for p in segments)
        d = daemons(cfg)
        got = c.get(a)  # the same client: a new hello, the new daemon's segments mapped
        assert got.matched_blocks == 5
        assert_exact(a, got.kv, got.matched_tokens)
        second = c._shm.mapping()
        assert second is not None and second.instance != first.instance
        # the new daemon's first answer (pins, on segments not mapped yet) was let go, not left to lapse
        assert wait_until(lambda: shm_stats(c)["leases"] == 0, 5)
        segments = [Path(p) for p in shm_stats(c)["segments"]]
        assert c.put(b, prefix_kv(b)).stored == 5
        assert c.flush(30)
        d.stop(signal.SIGKILL)  # a crash leaves its segments behind ...
        assert all(p.exists() for p in segments)
        daemons(cfg)  # ... and the next daemon removes them
        assert not any(p.exists() for p in segments)
        for toks in (a, b):
            got = c.get(toks)
            assert got.matched_blocks == 5
            assert_exact(toks, got.kv, got.matched_tokens)
        assert c.shared_memory


def test_a_daemon_started_without_shared_memory_removes_what_a_killed_one_left(
    daemons: Any, tmp_path: Path
) -> None:
    cfg = write_config(tmp_path, server=SHM)
    d = daemons(cfg)
    with attached(endpoint_of(cfg)) as c:
        segments = [Path(p) for p in shm_stats(c)["segments"]]
    d.stop(signal.SIGKILL)  # its pools (GBs of RAM on a real host) stay in the directory
    assert segments and all(p.exists() for p in segments)
    off = write_config(tmp_path, server={**SHM, "shared_memory": "off"})
    daemons(off)  # the same shm_dir, shared memory off: nothing of its own there, the dead one's removed
    assert not any(p.exists() for p in segments)


def test_segments_that_cannot_be_mapped_mean_the_socket(daemons: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, server=SHM)
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(9)
    a = random_tokens(rng, 3)
    with socket_client(ep) as s:
        assert s.put(a, prefix_kv(a)).stored == 3
        for path in s.stats()["server"]["shm"]["segments"]:
            os.chmod(path, 0o644)  # not a private segment any more: a client must not trust it
    with client(ep) as c:
        got = c.get(a)
        assert got.matched_blocks == 3
        assert_exact(a, got.kv, got.matched_tokens)
        assert not c.shared_memory


def test_a_mapping_the_client_s_address_space_cannot_hold_means_the_socket(
    daemons: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mmap itself failing in the client (an address-space limit, vm.max_map_count: ENOMEM), for the
    pools on the first get and for staging on a put: the call is served over the socket, and once
    the cause has passed, shared memory is used again (tried again after REFUSED_FOR seconds)."""
    import errno
    import mmap

    from kvstore.shm import client_path, segment

    monkeypatch.setattr(client_path, "REFUSED_FOR", 0.5)

    cfg = write_config(tmp_path, server=SHM)
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(15)
    a, b = random_tokens(rng, 3), random_tokens(rng, 3)
    with socket_client(ep) as s:
        assert s.put(a, prefix_kv(a)).stored == 3
    real = mmap.mmap

    def no_room(fd: int, size: int, **kw: Any) -> Any:
        if not kw.get("prot", mmap.PROT_WRITE) & mmap.PROT_WRITE or "staging" in os.readlink(
            f"/proc/self/fd/{fd}"
        ):
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(fd, size, **kw)

    monkeypatch.setattr(segment.mmap, "mmap", no_room)
    with client(ep) as c:  # the pools: mapped read-only
        got = c.get(a)
        assert got.matched_blocks == 3 and not c.shared_memory
        assert_exact(a, got.kv, got.matched_tokens)
    monkeypatch.setattr(segment.mmap, "mmap", real)
    with attached(ep) as c:  # the pools are mapped; the staging segment, on the first put, is not
        monkeypatch.setattr(segment.mmap, "mmap", no_room)
        assert c.put(b, prefix_kv(b)).stored == 3
        assert not c.shared_memory
        assert_served(c, b)
        monkeypatch.setattr(segment.mmap, "mmap", real)  # the address space has room again
        assert wait_until(lambda: c.shared_memory, 5)
        d = random_tokens(rng, 3)
        assert c.put(d, prefix_kv(d)).stored == 3 and shm_stats(c)["staging_clients"] == 1
        assert_served(c, d)


def test_a_hello_for_shared_memory_over_the_raw_socket_is_answered_with_the_offer(
    daemons: Any, tmp_path: Path
) -> None:
    cfg = write_config(tmp_path, server=SHM)
    ep = endpoint_of(cfg)
    daemons(cfg)
    raw = Raw(ep)
    try:
        hello = raw.ask(header("hello", namespace=NS.to_dict(), shm=True))
        offer = hello["shm"]
        assert [s["role"] for s in offer["segments"]] == ["hbm", "ram"]
        assert offer["per_client"] == 512 * 1024
        plain = raw.ask(header("hello", rid=2, namespace=NS.to_dict()))
        assert plain.get("shm") is None  # only for a client that asks
        big = raw.ask(header("reserve", rid=3, nbytes=2**20))
        assert big["code"] == "invalid_argument" and "shm_staging_per_client" in big["message"]
        ok = raw.ask(header("reserve", rid=4, nbytes=4096))
        assert ok["op"] == "reserve" and ok["nbytes"] == 4096
        commit = raw.ask(
            header(
                "commit",
                rid=5,
                ns=hello["ns"],
                tokens=list(range(T)),
                shape=list(LAYOUT.shape(2 * T)),
                dtype="float16",
                handle=ok["handle"],
            )
        )
        assert commit["code"] == "invalid_argument"  # 2 blocks of tokens needed: nothing stored
        done = raw.ask(header("finish", rid=6, handle=ok["handle"], used=0))
        assert done["op"] == "finish" and done["released"] is True
        unknown = raw.ask(header("finish", rid=7, handle=12345, used=3))
        assert unknown["released"] is False
    finally:
        raw.close()


def test_a_client_without_staging_room_puts_and_reads_nvme_blocks_over_the_socket(
    daemons: Any, tmp_path: Path
) -> None:
    # room for one client's 64 KiB staging segment: the second client finds none
    cfg = write_config(tmp_path, server={"shm_staging": "64KiB", "shm_staging_per_client": "64KiB"})
    ep = endpoint_of(cfg)
    d = daemons(cfg)
    rng = np.random.default_rng(10)
    a, b = random_tokens(rng, 150), random_tokens(rng, 20)  # a: 150 KiB, more than one staging segment
    with attached(ep) as first, attached(ep) as second:
        r = first.put(a, prefix_kv(a), session="a")
        assert (r.stored, r.failed) == (150, [])
        r = second.put(b, prefix_kv(b), session="b")
        assert (r.stored, r.failed) == (20, [])  # over the socket
        assert shm_stats(first)["staging_clients"] == 1
        assert first.flush(30)
    d.stop()
    daemons(cfg)
    with attached(ep) as first, attached(ep) as second:
        got = first.get(a)  # nvme blocks, staged 64 at a time
        assert got.matched_blocks == 150 and got.tiers == ["nvme"] * 150
        assert_exact(a, got.kv, got.matched_tokens)
        got = second.get(b)  # no staging room left: the socket brings them
        assert got.matched_blocks == 20
        assert_exact(b, got.kv, got.matched_tokens)


def test_a_shared_memory_filesystem_too_small_for_the_pools_means_the_socket(
    daemons: Any, tmp_path: Path
) -> None:
    from tests.hardening.conftest import mounted

    small = tmp_path / "small"
    with mounted(small, "size=128k", "mode=0700") as ok:
        if not ok:
            pytest.skip("needs root to mount a small tmpfs")
        cfg = write_config(tmp_path, server={**SHM, "shm_dir": str(small)})
        ep = endpoint_of(cfg)
        d = daemons(cfg)
        rng = np.random.default_rng(11)
        a = random_tokens(rng, 4)
        with client(ep) as c:
            assert c.put(a, prefix_kv(a)).stored == 4
            got = c.get(a)
            assert got.matched_blocks == 4
            assert_exact(a, got.kv, got.matched_tokens)
            assert not c.shared_memory and c.stats()["server"]["shm"] is None
        assert "shared memory off" in d.output() and "cannot be allocated" in d.output()
        assert not [p for p in small.iterdir() if p.name.startswith("kvs-")]


def test_a_staging_segment_the_filesystem_cannot_hold_now_means_the_socket(
    daemons: Any, tmp_path: Path
) -> None:
    """Staging segments are made when a client first needs one. Where the filesystem holds the pools
    but not that segment, the client's put and its get of nvme blocks go over the socket; the blocks
    the get located stay pinned no longer than the request."""
    from tests.hardening.conftest import mounted

    small = tmp_path / "small"
    with mounted(small, "size=800k", "mode=0700") as ok:
        if not ok:
            pytest.skip("needs root to mount a small tmpfs")
        cfg = write_config(tmp_path, server={**SHM, "shm_dir": str(small)})
        ep = endpoint_of(cfg)
        daemons(cfg)
        rng = np.random.default_rng(12)
        a, b = random_tokens(rng, 4), random_tokens(rng, 6)
        with socket_client(ep) as s:
            assert s.put(b, prefix_kv(b)).stored == 6 and s.flush(30)
            for tier in ("hbm", "ram"):
                s.evict(tier=tier)
            assert s.lookup(b).tiers == ["nvme"] * 6
        with attached(ep) as c:
            assert c.put(a, prefix_kv(a)).stored == 4
            got = c.get(b)
            assert got.matched_blocks == 6
            assert_exact(b, got.kv, got.matched_tokens)
            assert c.stats()["store"]["pinned"] == 0 and shm_stats(c)["staging_clients"] == 0


def test_a_block_larger_than_a_client_s_staging_is_put_over_the_socket(daemons: Any, tmp_path: Path) -> None:
    """Blocks of 256 KiB, staging of 128 KiB a client: a put goes as a get of them does, whole."""
    big = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", block_tokens=64)
    cfg = write_config(
        tmp_path,
        server={"shm_staging": "1MiB", "shm_staging_per_client": "128KiB"},
        hbm={"capacity": "4MiB"},
        ram={"capacity": "4MiB"},
    )
    ep = endpoint_of(cfg)
    daemons(cfg)
    toks = np.arange(3 * 64, dtype=np.uint32)
    kv = torch.randn(big.shape(3 * 64), generator=torch.Generator().manual_seed(13)).half()
    with KVStoreClient(ep, model=MODEL, layout=big, timeout=10.0) as c:
        c.ping()
        r = c.put(toks, kv)
        assert c.shared_memory and (r.stored, r.failed) == (3, [])
        got = c.get(toks)
        assert got.matched_blocks == 3 and got.kv is not None and torch.equal(got.kv, kv)
