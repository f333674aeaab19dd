"""kvstore as SGLang's HiCache L3: the dynamic factory, the v1 calls, the real host pool, a real daemon."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
from sglang.srt.mem_cache.utils import get_hash_str

from kvstore.integrations.sglang import KVStoreHiCache
from tests.engines.sglang.conftest import PAGE, backend, host_pool, storage_config
from tests.engines.sglang.pools import attach

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def fill(pool: Any, pages: list[int], seed: int) -> list[torch.Tensor]:
    """Random K/V in host pages ``pages`` (slot p*PAGE ..); returns each page's data."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in pages:
        page = pool.get_data_page(p * PAGE, flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))
        out.append(page.clone())
    return out


def slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def page_hashes(n: int, salt: int = 0) -> list[str]:
    return get_hash_str(list(range(1000 * salt, 1000 * salt + n * PAGE)), None, page_size=PAGE)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_set_then_got_into_other_host_pages_are_identical(daemon: Any, layout: str) -> None:
    pool = host_pool(layout)
    store = backend(daemon.endpoint, pool)
    assert isinstance(store, KVStoreHiCache)
    keys = page_hashes(5)
    want = fill(pool, [0, 1, 2, 3, 4], seed=1)
    # two batches, the second after the first (SGLang passes the keys before it when asked to)
    assert store.batch_set_v1(keys[:2], slots([0, 1]), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 2
    info = HiCacheStorageExtraInfo(prefix_keys=keys[:2])
    assert store.batch_set_v1(keys[2:], slots([2, 3, 4]), info) == [True] * 3
    assert store.batch_exists(keys) == 5
    # into other host pages, shuffled: every byte comes back
    dst = [9, 7, 12, 8, 10]
    assert store.batch_get_v1(keys, slots(dst)) == [True] * 5
    for p, w in zip(dst, want, strict=True):
        assert torch.equal(pool.get_data_page(p * PAGE, flat=False).view(torch.int16), w.view(torch.int16))
    assert store.client is not None and store.client.shared_memory


def test_batch_exists_counts_leading_hits_and_get_stops_at_a_miss(daemon: Any) -> None:
    pool = host_pool("page_first")
    store = backend(daemon.endpoint, pool)
    keys = page_hashes(4)
    fill(pool, [0, 1, 2, 3], seed=2)
    assert store.batch_set_v1(keys[:2], slots([0, 1])) == [True, True]
    assert store.batch_set_v1(keys[3:], slots([3])) == [True]  # page 2 never stored
    assert store.batch_exists(keys) == 2
    assert store.batch_exists(keys[3:]) == 1
    assert store.batch_exists([]) == 0
    assert store.batch_get_v1(keys, slots([10, 11, 12, 13])) == [True, True, False, False]
    assert store.exists(keys[0]) and not store.exists(keys[2])


def test_another_engine_process_sees_the_pages(daemon: Any) -> None:
    writer_pool, reader_pool = host_pool("page_first"), host_pool("layer_first")
    writer = backend(daemon.endpoint, writer_pool)
    keys = page_hashes(3, salt=3)
    want = fill(writer_pool, [0, 1, 2], seed=3)
    assert all(writer.batch_set_v1(keys, slots([0, 1, 2])))
    # another instance, another host pool layout: the same pages by the same hashes
    reader = backend(daemon.endpoint, reader_pool)
    assert reader.batch_exists(keys) == 3
    assert reader.batch_get_v1(keys, slots([5, 6, 7])) == [True] * 3
    for p, w in zip([5, 6, 7], want, strict=True):
        got = reader_pool.get_data_page(p * PAGE, flat=False)  # [2, L, PAGE, H, D] in layer_first
        assert torch.equal(got.view(torch.int16), w.transpose(1, 2).view(torch.int16))


def test_another_tp_rank_or_model_gets_no_hit(daemon: Any) -> None:
    pool = host_pool("page_first")
    store = backend(daemon.endpoint, pool)
    keys = page_hashes(2, salt=4)
    fill(pool, [0, 1], seed=4)
    assert all(store.batch_set_v1(keys, slots([0, 1])))
    for other in (backend(daemon.endpoint, pool, tp_rank=1), backend(daemon.endpoint, pool, model="other")):
        assert other.batch_exists(keys) == 0
        assert other.batch_get_v1(keys, slots([4, 5])) == [False, False]


def test_evicted_or_corrupt_pages_are_false_never_wrong_data(daemon: Any) -> None:
    pool = host_pool("page_first")
    store = backend(daemon.endpoint, pool)
    keys = page_hashes(3, salt=5)
    fill(pool, [0, 1, 2], seed=5)
    assert all(store.batch_set_v1(keys, slots([0, 1, 2])))
    store.clear()  # this namespace's pages, evicted
    assert store.batch_exists(keys) == 0
    before = pool.get_data_page(8 * PAGE, flat=False).clone()
    assert store.batch_get_v1(keys, slots([8, 9, 10])) == [False] * 3
    assert torch.equal(pool.get_data_page(8 * PAGE, flat=False).view(torch.int16), before.view(torch.int16))
    # pages whose bytes were never stored under a key: a key SGLang never wrote is a miss
    forged = [hashlib.sha256(b"forged").hexdigest()]
    assert store.batch_get_v1(forged, slots([8])) == [False]


def test_legacy_calls_say_to_set_interface_v1_and_mla_is_refused(daemon: Any) -> None:
    pool = host_pool("page_first")
    store = backend(daemon.endpoint, pool)
    with pytest.raises(NotImplementedError, match="interface_v1"):
        store.get("k")
    with pytest.raises(NotImplementedError, match="interface_v1"):
        store.batch_set(["k"], [torch.zeros(1)])
    from tests.engines.sglang.conftest import storage_config

    cfg = storage_config(daemon.endpoint)
    cfg.is_mla_model = True
    with pytest.raises(ValueError, match="MLA"):
        KVStoreHiCache(cfg, {})
    # a misspelt option of ours is refused (a tenant typo would share the default tenant's pages);
    # SGLang's own keys in extra_config are left alone
    for typo, meant in (("tennant", "tenant"), ("timout", "timeout")):
        cfg = storage_config(daemon.endpoint)
        cfg.extra_config[typo] = "acme"
        with pytest.raises(ValueError, match=f"did you mean '{meant}'"):
            KVStoreHiCache(cfg, {})
    cfg = storage_config(daemon.endpoint)
    cfg.extra_config["hicache_storage_pass_prefix_keys"] = True
    assert KVStoreHiCache(cfg, {}).tenant == "default"


def test_a_daemon_that_is_not_there_costs_one_timeout_and_then_nothing(tmp_path: Any) -> None:
    import time

    pool = host_pool("page_first")
    config = storage_config(f"ipc://{tmp_path}/nobody.sock", layout=pool.layout)
    config.extra_config["timeout"] = 0.3
    store = attach(config, pool)
    assert isinstance(store, KVStoreHiCache)
    keys = page_hashes(3)
    t0 = time.monotonic()
    assert store.batch_exists(keys) == 0
    assert store.batch_set_v1(keys, slots([0, 1, 2])) == [False] * 3
    assert store.batch_get_v1(keys, slots([3, 4, 5])) == [False] * 3
    assert store.backoff.timeouts == 1 and time.monotonic() - t0 < 2.0


def test_a_page_damaged_on_disk_is_false_and_the_pages_before_it_are_served(
    daemons: Any, tmp_path: Any
) -> None:
    import lmdb

    from kvstore.chains import KeyChain
    from kvstore.tiers.lmdb_env import DB_NAMES
    from tests.hardening.conftest import write_config

    cfg = write_config(
        tmp_path,
        hbm={"device": "cpu", "capacity": "4MiB"},
        ram={"capacity": "4MiB", "codec": "raw"},
        policy={"page_bytes": "1KiB"},
    )
    d = daemons(cfg)
    pool = host_pool("layer_first")
    store = backend(d.endpoint, pool)
    keys = page_hashes(4, salt=7)
    want = fill(pool, [0, 1, 2, 3], seed=7)
    assert all(store.batch_set_v1(keys, slots([0, 1, 2, 3])))
    assert store.client is not None and store.client.flush(30)
    ns = store.client.namespace
    assert ns is not None
    store.close()
    assert d.stop() == 0
    env = lmdb.open(str(tmp_path / "nvme"), max_dbs=len(DB_NAMES), map_size=1 << 30)
    with env.begin(write=True) as txn:
        frames = env.open_db(b"blocks", txn=txn)
        key = KeyChain.of(keys).keys(ns, 4)[2]
        frame = txn.get(key, db=frames)
        assert frame is not None
        damaged = bytearray(frame)
        damaged[len(damaged) // 2] ^= 0xFF
        txn.put(key, bytes(damaged), db=frames)
    env.close()
    d = daemons(cfg)
    store = backend(d.endpoint, pool)
    before = [pool.get_data_page(p * PAGE, flat=False).clone() for p in (10, 11)]
    got = store.batch_get_v1(keys, slots([8, 9, 10, 11]))
    assert got == [True, True, False, False]
    for p, w in zip([8, 9], want[:2], strict=True):
        assert torch.equal(pool.get_data_page(p * PAGE, flat=False).view(torch.int16), w.view(torch.int16))
    for p, b in zip([10, 11], before, strict=True):  # never filled with the damaged page
        assert torch.equal(pool.get_data_page(p * PAGE, flat=False).view(torch.int16), b.view(torch.int16))
    assert store.batch_exists(keys) == 2
