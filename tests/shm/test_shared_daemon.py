"""The same-host data plane against real daemons: same bytes as the socket, leases, leaks, privacy.

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

from kvstore.kvbuffers import PagedKV
from kvstore.wire.errors import ServerError
from kvstore.wire.messages import Finish, Locate, LocateOk, Reserve
from tests.hardening.conftest import (
    LAYOUT,
    NS,
    Background,
    T,
    assert_exact,
    client,
    endpoint_of,
    prefix_kv,
    random_tokens,
    wait_until,
    write_config,
)
from tests.shm.clients import SHM, attached, shm_stats, socket_client, vllm_buffers
from tests.shm.spy import sent_ops

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ram_codec", ["fp8", "int8"])
def test_shared_memory_and_socket_serve_the_same_bytes_from_every_tier(
    daemons: Any, tmp_path: Path, ram_codec: str, monkeypatch: pytest.MonkeyPatch
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
            # each client's own path, every time: a shared-memory read that fell back to the socket
            # would compare the socket with itself
            shm_ops, sock_ops = sent_ops(shm, monkeypatch), sent_ops(sock, monkeypatch)
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
            assert "locate" in shm_ops and "get" not in shm_ops and shm.shared_memory, (tier, shm_ops)
            assert "get" in sock_ops and "locate" not in sock_ops, (tier, sock_ops)

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
        m = c._shm.mapping()
        assert m is not None
        start = time.monotonic()
        # 4 s at least, and until the race was run: a page found moved (or torn) after its copy
        while time.monotonic() < start + 4.0 or (not m.moved + m.torn and time.monotonic() < start + 60):
            for p in prompts:
                got = c.get(p)
                assert_exact(p, got.kv, got.matched_tokens)  # a wrong byte fails here
                served += got.matched_blocks
                short += got.matched_blocks < 8
        print(f"served {served} blocks, {short} short reads, {m.moved} moved, {m.torn} torn")
        assert m.moved + m.torn > 0, "no page was reused under a read: the race this test is for never ran"
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
