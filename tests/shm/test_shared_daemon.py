"""The same-host data plane against real daemons: same bytes as the socket, leases, leaks, privacy, restarts.

Daemons here are the hardening tests' (tests/hardening/conftest.py): small
raw tiers and 1 KiB blocks, so that served K/V is compared bit for bit.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.kvbuffers import PagedKV
from kvstore.layout import KVLayout
from kvstore.wire.errors import RequestTimeout, ServerError
from kvstore.wire.messages import Commit, ErrorReply, Finish, Locate, LocateOk, Reserve
from tests.hardening.conftest import (
    LAYOUT,
    MODEL,
    NS,
    Background,
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

REPO = Path(__file__).resolve().parents[2]
SHM = {"shm_staging": "1MiB", "shm_staging_per_client": "512KiB"}


def socket_client(endpoint: str) -> KVStoreClient:
    return KVStoreClient(endpoint, model=MODEL, layout=LAYOUT, timeout=10.0, shared_memory=False)


def attached(endpoint: str, **kw: Any) -> KVStoreClient:
    c = client(endpoint, **kw)
    c.ping()
    c.lookup([])
    assert c.shared_memory, "an ipc client of the daemon's user is offered shared memory"
    return c


def shm_stats(c: KVStoreClient) -> dict[str, Any]:
    shm = c.stats()["server"]["shm"]
    assert isinstance(shm, dict)
    return shm


def vllm_buffers(blocks: int, block_size: int = 2, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """vLLM-shaped per-layer caches ``[2, num_blocks, block_size, H, D]`` and shuffled block ids."""
    caches = [
        torch.zeros(2, 2 * blocks, block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=torch.float16)
        for _ in range(LAYOUT.num_layers)
    ]
    ids = torch.randperm(2 * blocks, generator=torch.Generator().manual_seed(seed))[:blocks]
    return caches, ids


@pytest.mark.parametrize("ram_codec", ["fp8", "int8"])
def test_shared_memory_and_socket_serve_the_same_bytes_from_every_tier(
    daemons: Any, tmp_path: Path, ram_codec: str
) -> None:
    cfg = write_config(
        tmp_path,
        server=SHM,
        ram={"codec": ram_codec},
        nvme={"codec": "int4", "head_codec": "none"},
        policy={"promote_on_hit": False},  # reads stay in the tier they are compared in
    )
    ep = endpoint_of(cfg)
    d = daemons(cfg)
    rng = np.random.default_rng(1)
    a = random_tokens(rng, 9)
    tail = np.concatenate([a, random_tokens(rng, 1)[:3]])  # a partial block at the end
    fork = np.concatenate([a[: 4 * T], random_tokens(rng, 5)])  # a miss in the middle of a's prefix
    want = prefix_kv(a)

    def compare(tier: str, exact: bool) -> None:
        with attached(ep) as shm, socket_client(ep) as sock:
            for toks, blocks in ((a, 9), (tail, 9), (fork, 4)):
                got, ref = shm.get(toks), sock.get(toks)
                assert got.matched_blocks == ref.matched_blocks == blocks
                assert got.tiers == ref.tiers == [tier] * blocks
                assert got.kv is not None and ref.kv is not None
                assert torch.equal(got.kv.view(torch.int16), ref.kv.view(torch.int16)), tier
                if exact:
                    assert_exact(toks, got.kv, got.matched_tokens)
                out = torch.full(LAYOUT.shape(len(toks)), 7.0, dtype=torch.float16)
                r = shm.get_into(toks, out)
                assert r.matched_blocks == blocks and torch.equal(out[:, :, : blocks * T], ref.kv)
                caches, ids = vllm_buffers(-(-len(toks) // 2))
                paged = PagedKV.vllm(caches, ids, len(toks))
                r = shm.get_into(toks, paged)
                assert r.matched_blocks == blocks and r.kv is None
                back = paged.read(0, torch.empty(LAYOUT.shape(blocks * T), dtype=torch.float16))
                assert torch.equal(back, ref.kv)
            assert wait_until(lambda: shm_stats(shm)["leases"] == 0, 5)  # finishes are not awaited

    with attached(ep) as c:
        assert c.put(a, want, session="a").stored == 9
        compare("hbm", exact=True)
        c.evict(tier="hbm")  # every block down to ram: re-encoded with the ram codec
        compare("ram", exact=False)
        assert c.flush(30)
    d.stop()
    daemons(cfg)  # a new daemon: every block is read back from nvme (int4) through staging
    compare("nvme", exact=False)


@pytest.mark.parametrize("where", ["hbm", "nvme"])
def test_shared_memory_and_socket_gets_count_the_same_lookups_tokens_and_misses(
    daemons: Any, tmp_path: Path, where: str
) -> None:
    # a same-host get asked again for the part not held (a second lookup, its tokens asked twice) and
    # counted no tier misses; with blocks only on nvme its staging read counted a lookup of its own
    cfg = write_config(tmp_path, server=SHM)
    d = daemons(cfg)
    tokens = random_tokens(np.random.default_rng(31), 12)
    held = 3
    with client(d.endpoint) as c:
        assert c.put(tokens[: held * T], prefix_kv(tokens, held)).stored == held
        if where == "nvme":
            assert c.flush(30) and c.evict(tier="hbm").blocks == held and c.evict(tier="ram").blocks == held

    def counted(shared: bool) -> dict[str, Any]:
        with client(d.endpoint) if shared else socket_client(d.endpoint) as c:
            before = c.stats()["store"]
            r = c.get(tokens)
            assert r.matched_blocks == held and c.shared_memory == shared
            assert_exact(tokens, r.kv, r.matched_tokens)
            after = c.stats()["store"]
            if where == "nvme":  # promoted by the read: back down for the next one
                c.evict(tier="hbm")
                c.evict(tier="ram")
                assert c.lookup(tokens).tiers == ["nvme"] * held
        tiers = after["tiers"]
        return {
            "lookups": after["lookups"] - before["lookups"],
            "tokens_asked": after["tokens_asked"] - before["tokens_asked"],
            "tokens_served": after["tokens_served"] - before["tokens_served"],
            "misses": {t: tiers[t]["misses"] - before["tiers"][t]["misses"] for t in tiers},
        }

    over_socket, shared = counted(False), counted(True)
    assert over_socket["lookups"] == 1 and over_socket["tokens_asked"] == len(tokens)
    assert shared == over_socket


def test_put_from_a_paged_source_and_get_into_a_gpu_shaped_destination(daemons: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, server=SHM)
    daemons(cfg)
    rng = np.random.default_rng(2)
    toks = random_tokens(rng, 7)
    want = prefix_kv(toks)
    caches, ids = vllm_buffers(len(toks) // 2, seed=5)
    src = PagedKV.vllm(caches, ids, len(toks))
    src.write(0, want)
    with attached(endpoint_of(cfg)) as c:
        r = c.put_from(toks, src, session="paged")
        assert (r.stored, r.failed) == (7, [])
        assert c.put_from(toks, src).present == 7
        got = c.get(toks)
        assert_exact(toks, got.kv, got.matched_tokens)
        # SGLang's shape: separate K and V buffers per layer, token indices
        k = [torch.zeros(64, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=torch.float16) for _ in range(2)]
        v = [torch.zeros_like(x) for x in k]
        idx = torch.randperm(64)[: len(toks)]
        into = c.get_into(toks, PagedKV.sglang(k, v, idx))
        assert into.matched_blocks == 7
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(k[layer][idx], want[layer, 0]) and torch.equal(v[layer][idx], want[layer, 1])
        assert wait_until(lambda: shm_stats(c)["staging_used"] == 0, 5)


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "socket"])
def test_gets_and_puts_from_a_start_leave_the_tokens_before_it_alone(
    daemons: Any, tmp_path: Path, shared: bool
) -> None:
    """What an engine does with a prefix it holds in part already: load from where its own cache
    ends, never writing the tokens before (they may be shared); save only what it just computed."""
    cfg = write_config(tmp_path, server=SHM)
    daemons(cfg)
    rng = np.random.default_rng(4)
    toks = random_tokens(rng, 6)
    want = prefix_kv(toks)
    caches, ids = vllm_buffers(len(toks) // 2, seed=9)
    src = PagedKV.vllm(caches, ids, len(toks))
    src.write(0, want)
    ep = endpoint_of(cfg)
    with attached(ep) if shared else socket_client(ep) as c:
        assert c.put_from(toks, src, start=2 * T).stored == 0  # parents missing: refused
        assert c.put_from(toks[: 2 * T], src).stored == 2
        # token 2T+3 is inside block 2: blocks 2.. are sent, blocks 0 and 1 are not read
        assert c.put_from(toks, src, start=2 * T + 3).stored == 4
        assert c.put_from(toks, src, start=2 * T).present == 4
        assert c.lookup(toks).matched_blocks == 6
        caches2, ids2 = vllm_buffers(len(toks) // 2, seed=10)
        dst = PagedKV.vllm(caches2, ids2, len(toks))
        got = c.get_into(toks, dst, start=T + 1)
        assert got.matched_blocks == 6 and got.tiers == ["hbm"] * 5  # blocks 1..5 fetched
        back = dst.read(0, torch.empty(LAYOUT.shape(6 * T), dtype=torch.float16))
        assert torch.equal(back[:, :, T + 1 :], want[:, :, T + 1 :])
        assert not back[:, :, : T + 1].any()
        out = torch.zeros(LAYOUT.shape(6 * T), dtype=torch.float16)
        assert c.get_into(toks, out, start=6 * T).matched_blocks == 6 and not out.any()
        with pytest.raises(Exception, match="multiple of"):
            c.get_into(toks, out, start=3)


def test_a_lapsed_lease_is_a_miss_never_a_wrong_block(daemons: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, server=SHM, policy={"pin_lease": "300ms"})
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(3)
    a, b = random_tokens(rng, 6), random_tokens(rng, 6)
    with attached(ep) as c, attached(ep) as other:
        assert c.put(a, prefix_kv(a)).stored == 6
        m = c._shm.mapping()
        assert m is not None
        reply = c._conn.call(Locate(ns=NS.id, tokens=a, tiers=m.tiers), idempotent=True)
        assert isinstance(reply, LocateOk) and len(reply.blocks) == 6
        time.sleep(0.6)  # the client is paused: its lease lapses
        other.evict(all=True)
        assert other.put(b, prefix_kv(b)).stored == 6  # the same pages, reused for other blocks
        out = torch.zeros(LAYOUT.shape(6 * T), dtype=torch.float16)
        good = m.read_blocks(reply.blocks, LAYOUT, out, 0)
        assert good == 0, "blocks whose pages were reused must not be served"
        c._conn.call(Finish(handle=reply.handle, used=good), idempotent=True)
        assert wait_until(lambda: shm_stats(c)["leases"] == 0, 5)


def test_reads_racing_evictions_and_reused_pages_are_exact_or_short(daemons: Any, tmp_path: Path) -> None:
    # leases far shorter than a read: pages are freed and rewritten while clients copy them
    cfg = write_config(tmp_path, server=SHM, policy={"pin_lease": "1ms"}, hbm={"capacity": "24KiB"})
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(4)
    prompts = [random_tokens(rng, 8) for _ in range(6)]

    def churn(stop: Any) -> int:
        n = 0
        with attached(ep) as w:
            while not stop.is_set():
                p = prompts[n % len(prompts)]
                w.put(p, prefix_kv(p))
                if n % 3 == 0:
                    w.evict(all=True)
                n += 1
        return n

    bg = Background(churn)
    served = short = 0
    with attached(ep) as c:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            for p in prompts:
                got = c.get(p)
                assert_exact(p, got.kv, got.matched_tokens)  # a wrong byte fails here
                served += got.matched_blocks
                short += got.matched_blocks < 8
        m = c._shm.mapping()
        assert m is not None
        print(f"served {served} blocks, {short} short reads, {m.moved} moved, {m.torn} torn")
    assert bg.join() > 10
    assert served > 0


CHILD = """
import os, signal, sys
import numpy as np
from tests.hardening.conftest import LAYOUT, MODEL, NS, T, client
from kvstore.wire.messages import Locate, Reserve
c = client(sys.argv[1])
c.lookup([])
m = c._shm.mapping()
assert m is not None
if sys.argv[2] == "reserve":
    r = c._conn.call(Reserve(nbytes=64 * 1024), idempotent=True)
    m.staging_view(r.path, r.size, r.offset, r.nbytes).fill_(1)  # written, never committed
else:
    toks = np.frombuffer(bytes.fromhex(sys.argv[3]), dtype="<u4")
    r = c._conn.call(Locate(ns=NS.id, tokens=toks, tiers=m.tiers), idempotent=True)
    assert len(r.blocks) > 0, r
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("when", ["reserve", "locate"])
def test_a_client_killed_mid_put_or_mid_get_leaks_nothing(daemons: Any, tmp_path: Path, when: str) -> None:
    cfg = write_config(tmp_path, server=SHM, policy={"pin_lease": "500ms"}, nvme={"enabled": False})
    ep = endpoint_of(cfg)
    daemons(cfg)
    rng = np.random.default_rng(5)
    a = random_tokens(rng, 40)  # 40 nvme-less blocks: some will be pushed from hbm to ram
    with attached(ep) as c:
        assert c.put(a, prefix_kv(a)).stored == 40
        before = {k: (t["used"], t["blocks"]) for k, t in c.stats()["store"]["tiers"].items()}
        p = subprocess.run(
            [sys.executable, "-c", CHILD, ep, when, np.ascontiguousarray(a, dtype="<u4").tobytes().hex()],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == -signal.SIGKILL and "ready" in p.stdout, p.stderr
        assert c.stats()["store"]["pinned"] > 0 or when == "reserve" or shm_stats(c)["leases"] > 0
        time.sleep(0.7)  # past the lease
        assert wait_until(lambda: shm_stats(c)["leases"] == 0, 5)
        shm = shm_stats(c)
        assert shm["staging_used"] == 0 and shm["lapsed"] >= 1
        store = c.stats()["store"]
        assert store["pinned"] == 0
        assert {k: (t["used"], t["blocks"]) for k, t in store["tiers"].items()} == before
        got = c.get(a)  # and everything still reads back
        assert got.matched_blocks == 40
        assert_exact(a, got.kv, got.matched_tokens)


def test_segments_are_private_and_a_mapped_pool_cannot_be_written(daemons: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, server=SHM)
    ep = endpoint_of(cfg)
    d = daemons(cfg)
    rng = np.random.default_rng(6)
    a = random_tokens(rng, 3)
    with attached(ep) as c:
        assert c.put(a, prefix_kv(a)).stored == 3
        shm = shm_stats(c)
        assert len(shm["segments"]) == 3  # hbm, ram, and this client's staging
        directory = Path(shm["directory"])
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        for path in shm["segments"]:
            st = os.stat(path)
            assert Path(path).parent == directory
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        # a client that writes into the pool it mapped faults; the daemon is unaffected
        writer = (
            "import sys; from tests.hardening.conftest import client\n"
            "c = client(sys.argv[1]); c.lookup([]); m = c._shm.mapping()\n"
            "print('mapped', flush=True); m.mapped[0].arena[0] = 1\n"
            "print('wrote', flush=True)\n"
        )
        p = subprocess.run(
            [sys.executable, "-c", writer, ep], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert p.returncode == -signal.SIGSEGV and "mapped" in p.stdout and "wrote" not in p.stdout, p.stderr
        got = c.get(a)
        assert got.matched_blocks == 3
        assert_exact(a, got.kv, got.matched_tokens)
        # a reserve of nothing (a lease that holds no staging, only bookkeeping) is refused
        before = shm_stats(c)["leases"]
        with pytest.raises(ServerError, match="at least 1"):
            c._conn.call(Reserve(nbytes=0), idempotent=True)
        assert shm_stats(c)["leases"] == before
    assert d.proc.poll() is None


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
    pools on the first get and for staging on a put: the call is served over the socket."""
    import errno
    import mmap

    from kvstore.shm import segment

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


# staging for 64 blocks of 1 KiB: a put of 100 blocks goes in four chunks through two ranges
CHUNKED = {**SHM, "shm_staging_per_client": "64KiB"}


def assert_served(c: KVStoreClient, toks: np.ndarray) -> None:
    """Every block of ``toks`` is served, bit for bit."""
    got = c.get(toks)
    assert got.matched_blocks == len(toks) // T
    assert_exact(toks, got.kv, got.matched_tokens)


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

    def flood(stop: Any) -> int:
        n = 0
        with socket_client(ep) as s:
            while not stop.is_set():
                s.stats()
                n += 1
        return n

    rng = np.random.default_rng(12)
    with attached(ep) as c:
        floods = [Background(flood) for _ in range(3)]
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
