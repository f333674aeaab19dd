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
