"""Corruption: damaged bytes are detected on read, dropped and counted; the client gets a miss, never wrong data.

::

    prefix  [b0][b1][b2][b3]        b2's frame damaged on disk
    get  -> [b0][b1]                 b2 fails its checksum: deleted (and b3 with it: prefix-closed),
                                     counted in stats corrupt; what is served is bit-exact
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
import zmq

from kvstore.codecs import get_codec
from kvstore.config import PolicyConfig
from kvstore.daemon.endpoint import probe
from kvstore.daemon.server import Server
from kvstore.keys import block_keys
from kvstore.store.engine import Store
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.lmdb_env import DB_NAMES
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.ram import RamTier
from tests.hardening.conftest import (
    NS,
    T,
    assert_exact,
    client,
    loaded,
    prefix_kv,
    random_tokens,
    write_config,
)

BLOCKS = 4


def flip(value: bytes, rng: np.random.Generator, n: int = 1, lo: int = 0, hi: int | None = None) -> bytes:
    """``value`` with ``n`` bytes in [lo, hi) changed."""
    b = bytearray(value)
    for at in rng.choice(np.arange(lo, len(b) if hi is None else hi), n, replace=False):
        b[int(at)] ^= int(rng.integers(1, 256))
    return bytes(b)


@pytest.mark.slow
def test_damaged_lmdb_values_are_misses_never_wrong_data(daemons, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    cfg = write_config(tmp_path)
    prefixes = [random_tokens(rng, BLOCKS) for _ in range(30)]
    d = daemons(cfg)
    with client(d.endpoint) as c:
        for tokens in prefixes:
            assert c.put(tokens, prefix_kv(tokens)).stored == BLOCKS
        assert c.flush()
    assert d.stop() == 0

    # damage, with the daemon stopped, at block j: frames of prefixes 0-9 (anywhere), records entries
    # of 10-14 (past the 12-byte head, where the entry's CRC covers them)
    damaged_at: dict[int, int] = {}
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=len(DB_NAMES))
    with env.begin(write=True) as txn:
        frames, records = env.open_db(b"blocks", txn=txn), env.open_db(b"records", txn=txn)
        for i in range(18):
            j = int(rng.integers(BLOCKS))
            key = block_keys(NS, prefixes[i])[j]
            db = frames if i < 10 else records
            value = txn.get(key, db=db)
            assert value is not None
            if i < 15:
                txn.put(key, flip(value, rng, n=int(rng.integers(1, 4)), lo=0 if i < 10 else 12), db=db)
                damaged_at[i] = j
            else:  # prefixes 15-17: the head's reserved bytes and frame length (sizes only, unchecked)
                txn.put(key, flip(value, rng, n=1, lo=2, hi=8), db=db)
    env.close()

    d = daemons(cfg)
    with client(d.endpoint) as c:
        for i, tokens in enumerate(prefixes):
            got = c.get(tokens)
            assert_exact(tokens, got.kv, got.matched_tokens)  # never a wrong byte
            want = damaged_at.get(i, BLOCKS) * T
            if i in (15, 16, 17):  # undetectable there, and harmless: a size estimate, never data
                want = got.matched_tokens
            assert got.matched_tokens == want, f"prefix {i}: damaged at block {damaged_at.get(i)}"
            # the damaged block stays gone: lookups agree with the get, and a second get too
            assert c.lookup(tokens).matched_tokens == want
            assert c.get(tokens).matched_tokens == want
        nvme = c.stats()["store"]["tiers"]["nvme"]
    assert nvme["corrupt"] >= 10  # each damaged frame was read once, and counted
    assert "damaged" in d.output() or "corrupt" in d.output()  # damaged records are reported at restore
    assert d.stop() == 0
    with Store.from_config(loaded(cfg)) as store:  # a third start: the damage stays gone
        for i, tokens in enumerate(prefixes):
            if i not in (15, 16, 17):
                assert store.lookup(NS, tokens).matched_tokens == damaged_at.get(i, BLOCKS) * T


def test_a_damaged_record_is_deleted_at_restart(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    cfg = loaded(write_config(tmp_path))
    prefixes = [random_tokens(rng, BLOCKS) for _ in range(6)]
    with Store.from_config(cfg) as store:
        for tokens in prefixes:
            assert store.put(NS, tokens, prefix_kv(tokens)).stored == BLOCKS
        assert store.flush()
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=len(DB_NAMES))
    with env.begin(write=True) as txn:
        records = env.open_db(b"records", txn=txn)
        for tokens in prefixes[:3]:
            key = block_keys(NS, tokens)[1]
            entry = txn.get(key, db=records)
            assert entry is not None
            txn.put(key, flip(entry, rng, lo=12), db=records)
    env.close()
    with Store.from_config(cfg) as store:
        assert [store.lookup(NS, t).matched_blocks for t in prefixes] == [1, 1, 1, 4, 4, 4]
        assert store.check_integrity() == []  # no frame or entry left behind that the index does not know


class InProcess:
    """A real daemon loop (Server: ROUTER, workers) over a Store built here, so a test can reach its tiers."""

    def __init__(self, root: Path, *, nvme: bool) -> None:
        self.config = loaded(write_config(root))
        (root / "run").mkdir(mode=0o700, exist_ok=True)  # what serve() does before binding
        self.hbm = HbmTier(4 * 1024, device="cpu", page_bytes=1024)  # 4 blocks: the rest goes down to ram
        self.ram = RamTier(256 * 1024, get_codec("raw"), page_bytes=1024)
        self.nvme = NvmeTier(root / "nvme", 64 << 20, get_codec("raw")) if nvme else None
        self.store = Store(self.hbm, self.ram, self.nvme, PolicyConfig(page_bytes=1024))
        self.server = Server(self.config, self.store)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        ctx = zmq.Context()
        try:
            for _ in range(100):
                if probe(ctx, self.config.server.endpoint, timeout_ms=200) is not None:
                    break
            else:
                raise AssertionError("in-process daemon did not answer")
        finally:
            ctx.destroy(linger=0)

    @property
    def endpoint(self) -> str:
        return self.config.server.endpoint

    def close(self) -> None:
        self.server.stop("test over")
        self.thread.join(60)
        self.store.close()


@pytest.fixture
def in_process(tmp_path: Path) -> Iterator[Any]:
    made: list[InProcess] = []

    def make(nvme: bool) -> InProcess:
        made.append(InProcess(tmp_path, nvme=nvme))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.mark.parametrize(
    "offset", [0, 5, 20, 40, 50, 60, 70, 300, -1]
)  # header fields, crc, reserved, payload
def test_a_damaged_ram_frame_is_a_miss(in_process, offset: int) -> None:
    daemon = in_process(nvme=False)
    tokens = random_tokens(np.random.default_rng(offset + 100), 12)
    keys = block_keys(NS, tokens)
    with client(daemon.endpoint) as c:
        assert c.put(tokens, prefix_kv(tokens)).stored == 12
        # hbm holds 4 blocks: blocks 0-7 went down to ram
        assert keys[2] in daemon.ram
        frame_len = len(daemon.ram.get_frame(keys[2]))
        daemon.ram._debug_corrupt(keys[2], offset % frame_len)
        got = c.get(tokens)
        assert_exact(tokens, got.kv, got.matched_tokens)
        assert got.matched_tokens == 2 * T  # block 2 and everything after it are gone
        assert c.lookup(tokens).matched_tokens == 2 * T
        ram = c.stats()["store"]["tiers"]["ram"]
    assert ram["corrupt"] == 1
    assert keys[2] not in daemon.ram
    assert daemon.store.check_integrity() == []


def test_a_damaged_ram_frame_falls_back_to_the_good_nvme_copy(in_process) -> None:
    daemon = in_process(nvme=True)
    tokens = random_tokens(np.random.default_rng(3), 12)
    keys = block_keys(NS, tokens)
    with client(daemon.endpoint) as c:
        assert c.put(tokens, prefix_kv(tokens)).stored == 12
        assert c.flush()  # every block also on nvme (raw: exact)
        daemon.ram._debug_corrupt(keys[3], 100)
        got = c.get(tokens)
        assert got.matched_tokens == 12 * T  # served whole, from the intact copy below
        assert_exact(tokens, got.kv, got.matched_tokens)
        tiers = c.stats()["store"]["tiers"]
    assert tiers["ram"]["corrupt"] == 1 and tiers["nvme"]["corrupt"] == 0
    assert daemon.store.check_integrity() == []
