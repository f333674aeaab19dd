"""Full disk: LMDB on a filesystem of a few MB (a tmpfs this test mounts; root only).

What a full filesystem does to the nvme tier::

    free space  >  DISK_HEADROOM (1 MiB)   the store grows into it, up to [nvme] capacity
    free space  <= DISK_HEADROOM            the store keeps to the pages data.mdb already has:
                                            old blocks make way for new ones (LRU), as at capacity
    no pages at all to keep to              blocks stay in memory tiers only; flush says not durable

Puts are always answered, gets and lookups go on, nothing served is wrong,
the store stays sound, and once space is freed the store grows again.
Without root (no mount) the same story runs against a small [nvme] capacity.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import KVStoreError
from kvstore.store.engine import Store
from kvstore.tiers.lmdb_env import DISK_HEADROOM
from tests.hardening.conftest import (
    NS,
    assert_exact,
    client,
    fill,
    loaded,
    mounted,
    prefix_kv,
    random_tokens,
    write_config,
)

MiB = 2**20


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path | None]:
    """A 4 MiB tmpfs, or None where it cannot be mounted."""
    with mounted(tmp_path / "fs", "size=4m") as ok:
        yield tmp_path / "fs" if ok else None


def free(fs: Path) -> int:
    st = os.statvfs(fs)
    return st.f_bavail * st.f_frsize


def put_many(c, rng: np.random.Generator, n: int, blocks: int = 32) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        tokens = random_tokens(rng, blocks)
        r = c.put(tokens, prefix_kv(tokens))
        assert r.stored == blocks and not r.failed, r.failed[:3]  # answered, and held (memory tiers at least)
        out.append(tokens)
    return out


def check_served(c, prefixes: list[np.ndarray]) -> int:
    """Every prefix is served exact or not at all; returns how many came back whole."""
    whole = 0
    for tokens in prefixes:
        got = c.get(tokens)
        assert_exact(tokens, got.kv, got.matched_tokens)
        whole += got.matched_tokens == len(tokens)
    return whole


@pytest.mark.slow
def test_a_filesystem_smaller_than_the_capacity_acts_as_the_capacity(
    daemons, tmp_path: Path, small_fs: Path | None
) -> None:
    # [nvme] capacity 64 MiB on a 4 MiB filesystem (without a mount: a 4 MiB capacity on the big disk)
    nvme = {"path": str(small_fs / "nvme"), "capacity": "64MiB"} if small_fs else {"capacity": "4MiB"}
    cfg = write_config(tmp_path, nvme=nvme)
    d = daemons(cfg)
    rng = np.random.default_rng(11)
    with client(d.endpoint) as c:
        prefixes = put_many(c, rng, 60)  # ~7.5 MiB of blocks in LMDB terms: twice what fits
        assert c.flush()
        stats = c.stats()["store"]
        assert check_served(c, prefixes[-3:]) == 3  # the newest are all there
        check_served(c, prefixes)
    nvme_stats = stats["tiers"]["nvme"]
    assert nvme_stats["evictions"] > 0 and nvme_stats["used"] <= 4 * MiB
    if small_fs:
        assert free(small_fs) > 0  # the filesystem itself never ran out
    assert "No space left" not in d.output()
    assert d.stop() == 0
    with Store.from_config(loaded(cfg)) as store:
        assert store.check_integrity() == []
        whole = 0
        for tokens in prefixes:
            got = store.get(NS, tokens)
            assert_exact(tokens, got.kv, got.matched_tokens)
            whole += got.matched_tokens == len(tokens)
        assert whole >= 3  # the newest survived the restart


@pytest.mark.slow
def test_a_disk_filled_by_someone_else(daemons, tmp_path: Path, small_fs: Path | None) -> None:
    if small_fs is None:
        pytest.skip("needs root to mount a small tmpfs")
    cfg = write_config(tmp_path, nvme={"path": str(small_fs / "nvme"), "capacity": "64MiB"})
    d = daemons(cfg)
    rng = np.random.default_rng(12)
    with client(d.endpoint) as c:
        early = put_many(c, rng, 8)
        assert c.flush()
        filler = fill(small_fs)  # another program takes every free byte
        assert free(small_fs) == 0
        # puts are answered: a block is held, or named as failed with the reason
        late, failed = [], []
        for _ in range(30):
            tokens = random_tokens(rng, 32)
            r = c.put(tokens, prefix_kv(tokens))
            assert r.stored + r.present + len(r.failed) == 32
            for block, code, message in r.failed:
                assert code in ("tier_io", "tier_full") and "nvme store" in message, (block, code, message)
            failed += r.failed
            late.append(tokens)
        stats = c.stats()
        assert stats["server"]["put_failed_blocks"] == len(failed)  # the metric
        print(
            f"\ndisk full: {len(failed)} of {30 * 32} blocks refused; {stats['store']['tiers']['nvme']['blocks']} "
            "on nvme"
        )
        # lookups and gets go on, and never serve a wrong byte
        check_served(c, early + late)
        for tokens in early + late:
            assert c.lookup(tokens).matched_tokens == c.get(tokens).matched_tokens
        # space comes back: storing resumes, durably
        filler.unlink()
        assert free(small_fs) > DISK_HEADROOM
        more = put_many(c, rng, 6)
        assert c.flush()
        assert check_served(c, more) == len(more)
    assert d.proc.poll() is None
    assert d.stop() == 0
    with Store.from_config(loaded(cfg)) as store:
        assert store.check_integrity() == []
        for tokens in more:  # what was flushed after the disk had room again survived the restart
            got = store.get(NS, tokens)
            assert got.matched_tokens == len(tokens)
            assert_exact(tokens, got.kv, got.matched_tokens)
        for tokens in early + late:
            got = store.get(NS, tokens)
            assert_exact(tokens, got.kv, got.matched_tokens)


def test_flush_is_not_durable_when_nothing_can_reach_the_disk(
    daemons, tmp_path: Path, small_fs: Path | None
) -> None:
    if small_fs is None:
        pytest.skip("needs root to mount a small tmpfs")
    cfg = write_config(tmp_path, nvme={"path": str(small_fs / "nvme"), "capacity": "64MiB"})
    d = daemons(cfg)
    rng = np.random.default_rng(13)
    with client(d.endpoint) as c:
        c.ping()
        fill(small_fs)  # a fresh store, then the disk fills: LMDB has no page to put a block in
        tokens = put_many(c, rng, 2, blocks=8)
        assert check_served(c, tokens) == 2  # held in memory, served exact
        assert c.flush(timeout=5.0) is False  # but never called durable
        assert c.stats()["store"]["write_failures"] > 0


def test_the_store_stays_sound_while_the_disk_is_full(tmp_path: Path, small_fs: Path | None) -> None:
    if small_fs is None:
        pytest.skip("needs root to mount a small tmpfs")
    rng = np.random.default_rng(14)
    cfg = loaded(write_config(tmp_path, nvme={"path": str(small_fs / "nvme"), "capacity": "64MiB"}))
    with Store.from_config(cfg) as store:
        early = [random_tokens(rng, 32) for _ in range(8)]
        for tokens in early:
            store.put(NS, tokens, prefix_kv(tokens))
        assert store.flush()
        fill(small_fs)
        refused = 0
        for _ in range(30):
            tokens = random_tokens(rng, 32)
            try:
                r = store.put(NS, tokens, prefix_kv(tokens))
                refused += len(r.failed)
            except KVStoreError:  # the daemon turns this into a put reply naming the blocks
                refused += 1
            # while the disk is full, what the index says and what the tiers hold still agree
            assert store.check_integrity() == []
        for tokens in early:
            got = store.get(NS, tokens)
            assert_exact(tokens, got.kv, got.matched_tokens)
        # the disk cannot hold every block put since: some were refused (``refused``), or room on
        # disk was made by giving up the disk copies of blocks memory holds; either way a flush is
        # not durable
        assert not store.flush(5.0)
