"""A tier that fails while a put makes room: the blocks stored before the failure are kept and written.

::

    hbm [4 blocks]  holds prompt A                      put B (6 blocks, one chunk):
                                                        B0..B3 fit after A goes down to ram,
                                                        making room for B4 fails (the hbm device errs)
    -> B0..B3 stored and queued for nvme, B4 and B5 reported failed (tier_io); flush covers B0..B3

Also: a tier or codec that raises what none should (a CUDA out-of-memory) leaves no namespace
without blocks and no pin behind, and a delete the disk refuses is tried again.

The failure is injected into a real tier or codec (the one thing here that is not
what a daemon runs); the tiers around it are real.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.codecs import get_codec
from kvstore.keys import block_keys
from kvstore.results import EvictFilter
from kvstore.store.engine import Store
from kvstore.tiers.base import TierIOError
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.ram import RamTier
from tests.store.storekit import HBM_PAGE, NS, RAM_PAGE, T, kv, tokens


class FailingHbm(HbmTier):
    """An hbm tier whose ``drop`` fails after ``drops_left`` more drops (a device error while room is made)."""

    drops_left: int | None = None

    def drop(self, key: bytes) -> int:
        if self.drops_left is not None:
            if self.drops_left == 0:
                raise TierIOError("hbm device error (injected)")
            self.drops_left -= 1
        return super().drop(key)


def test_a_put_failing_part_way_keeps_and_writes_what_it_stored(tmp_path: Path) -> None:
    hbm = FailingHbm(4 * HBM_PAGE, page_bytes=HBM_PAGE)
    ram = RamTier(16 * RAM_PAGE, get_codec("raw"), page_bytes=RAM_PAGE, pin_memory=False)
    nvme = NvmeTier(tmp_path / "nvme", 1 << 22, get_codec("raw"))
    with Store(hbm, ram, nvme, tick=0.05) as s:
        a = tokens(4)
        assert s.put(NS, a, kv(4 * T)).stored == 4  # hbm is full
        assert s.flush(10)
        # one put of 6 blocks (one chunk): B0..B3 each push a block of A down to ram, then making
        # room for B4 fails in the hbm tier
        hbm.drops_left = 4
        b = tokens(6, seed=1)
        r = s.put(NS, b, kv(6 * T, 1))
        hbm.drops_left = None
        assert r.stored == 4
        assert [f.block for f in r.failed] == [4, 5] and {f.code for f in r.failed} == {"tier_io"}
        # what the put stored before the failure is indexed, queued for nvme, and covered by flush
        assert s.lookup(NS, b).matched_blocks == 4
        assert s.flush(10)
        assert set(block_keys(NS, b)[:4]) <= set(nvme.keys())
        assert s.check_integrity() == []


def test_a_put_whose_batched_copy_fails_serves_none_of_its_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # blocks of 128 KiB: a put's copies into hbm are batched and made when the chunk ends, after the
    # blocks were indexed. One copy fails (injected): the put raises, and none of the chunk's blocks is
    # left indexed with pages that were never written (hbm keeps no checksum: they would be served)
    import kvstore.memcopy as memcopy
    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout
    from kvstore.memcopy import Copier

    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, dtype="bfloat16", block_tokens=16)
    ns, bt, nb = Namespace("m", layout), layout.block_tokens, layout.block_nbytes
    ids = list(range(4 * bt))
    data = torch.randn(layout.shape(4 * bt)).to(torch.bfloat16)
    real, calls = memcopy._memcpy, [0]

    def second_copy_fails(d: torch.Tensor, s: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected copy failure")
        real(d, s)

    hbm = HbmTier(8 * nb, page_bytes=nb, copier=Copier(1))
    nvme = NvmeTier(tmp_path / "nvme", 1 << 24, get_codec("raw"))
    with Store(hbm, None, nvme, tick=0.05) as s:
        monkeypatch.setattr(memcopy, "_memcpy", second_copy_fails)
        with pytest.raises(RuntimeError, match="injected"):
            s.put(ns, ids, data)
        monkeypatch.setattr(memcopy, "_memcpy", real)
        assert s.lookup(ns, ids).matched_blocks == 0
        assert len(hbm) == 0 and hbm.pool.used_pages == 0
        assert s.flush(10) and set(nvme.keys()).isdisjoint(block_keys(ns, ids))
        # the same put again stores every block, and they read back as put
        assert s.put(ns, ids, data).stored == 4
        got = s.get(ns, ids)
        assert got.kv is not None and torch.equal(got.kv.view(torch.int16), data.view(torch.int16))
        assert s.check_integrity() == []


class RaisingHbm(HbmTier):
    """An hbm tier whose next ``fail`` puts raise what no tier should (a CUDA out-of-memory, say)."""

    fail = 0

    def put(self, key: bytes, block: torch.Tensor) -> int:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("CUDA error: out of memory (injected)")
        return super().put(key, block)


def test_a_first_put_that_raises_leaves_no_namespace_and_the_next_registers_and_journals_it(
    tmp_path: Path,
) -> None:
    def store(hbm: HbmTier) -> Store:
        ram = RamTier(4 * RAM_PAGE, get_codec("raw"), page_bytes=RAM_PAGE, pin_memory=False)
        return Store(hbm, ram, NvmeTier(tmp_path / "nvme", 1 << 22, get_codec("int4")), tick=0.05)

    hbm = RaisingHbm(4 * HBM_PAGE, page_bytes=HBM_PAGE)
    with store(hbm) as s:
        hbm.fail = 1
        with pytest.raises(RuntimeError, match="injected"):
            s.put(NS, tokens(2), kv(2 * T))
        assert s.usage() == []  # the namespace went with the put's blocks
        assert s.put(NS, tokens(2), kv(2 * T), session="conv").stored == 2
        assert [(u.model, u.tenant, u.blocks) for u in s.usage("default")] == [("tiny-model", "default", 2)]
        assert s.flush(10)
    with store(HbmTier(4 * HBM_PAGE, page_bytes=HBM_PAGE)) as s:  # restarted: the namespace was journaled
        assert [(u.model, u.tenant, u.blocks) for u in s.usage("default")] == [("tiny-model", "default", 2)]
        assert s.session_tenant("conv") == "default"


class RaisingCodec:
    """A codec that raises what no codec should once ``boom`` is set (the rest: the raw codec's)."""

    def __init__(self) -> None:
        self.codec, self.boom = get_codec("raw"), False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.codec, name)

    def encode(self, block: torch.Tensor) -> Any:
        if self.boom:
            raise RuntimeError("CUDA error: out of memory (injected)")
        return self.codec.encode(block)


def test_a_get_whose_promotion_encode_raises_ends_its_pin_at_once(tmp_path: Path) -> None:
    codec = RaisingCodec()
    ram = RamTier(4 * RAM_PAGE, codec, page_bytes=RAM_PAGE, pin_memory=False)  # type: ignore[arg-type]
    nvme = NvmeTier(tmp_path / "nvme", 1 << 22, get_codec("int4"))
    with Store(HbmTier(4 * HBM_PAGE, page_bytes=HBM_PAGE), ram, nvme, tick=0.05) as s:
        a = tokens(2)
        s.put(NS, a, kv(2 * T))
        assert s.flush(10)
        s.evict(EvictFilter(tier="hbm"))
        s.evict(EvictFilter(tier="ram"))
        codec.boom = True  # the frames of ram promotions are encoded before the lock
        with pytest.raises(RuntimeError, match="injected"):
            s.get(NS, a)
        codec.boom = False
        assert s.stats().pinned == 0  # not held for the lease (30 s) by a call that is over
        assert s.evict(EvictFilter(all=True)).blocks == 2


class RefusingDropNvme(NvmeTier):
    """An nvme tier whose ``drop`` fails while ``refuse`` is set (a disk that refuses even deletes)."""

    refuse = False

    def drop(self, key: bytes) -> int:
        if self.refuse:
            raise TierIOError("no space left on device (injected)")
        return super().drop(key)


def test_a_block_evicted_while_written_whose_delete_fails_is_deleted_at_a_later_tick(tmp_path: Path) -> None:
    nvme = RefusingDropNvme(tmp_path / "nvme", 1 << 22, get_codec("int4"))
    ram = RamTier(4 * RAM_PAGE, get_codec("raw"), page_bytes=RAM_PAGE, pin_memory=False)
    with Store(HbmTier(4 * HBM_PAGE, page_bytes=HBM_PAGE), ram, nvme, tick=0.05) as s:
        a = tokens(1)
        s.put(NS, a, kv(T))
        key = block_keys(NS, a)[0]
        wb = s._writeback
        assert wb is not None
        assert s.flush(10)
        s.evict(EvictFilter(tier="hbm"))
        s.evict(EvictFilter(tier="ram"))  # on nvme alone
        rec = nvme.record(key)
        with s._lock:  # as if an evict dropped the block while the writer wrote it: the writer finds it
            e = s._index.get(key)  # gone and deletes its copy, which the disk refuses
            assert e is not None
            for t in e.tier_list():
                s._index.clear_tier(e, t)
            s._index.remove(e)
            nvme.refuse = True
            wb._written(key, rec)
        assert key in set(nvme.keys())
        nvme.refuse = False
        deadline = time.monotonic() + 5
        while key in set(nvme.keys()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert key not in set(nvme.keys()) and s.check_integrity() == []
