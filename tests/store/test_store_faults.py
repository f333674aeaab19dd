"""A tier that fails while a put makes room: the blocks stored before the failure are kept and written.

::

    hbm [4 blocks]  holds prompt A                      put B (6 blocks, one chunk):
                                                        B0..B3 fit after A goes down to ram,
                                                        making room for B4 fails (the hbm device errs)
    -> B0..B3 stored and queued for nvme, B4 and B5 reported failed (tier_io); flush covers B0..B3

The failure is injected into a real HbmTier (the one thing here that is not
what a daemon runs); the ram and LMDB tiers under it are real.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.codecs import get_codec
from kvstore.keys import block_keys
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
