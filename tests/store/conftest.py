"""Small stores for the store's stories: 1 KiB blocks, a few blocks per tier, real LMDB in tmp_path."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.codecs import get_codec
from kvstore.store.engine import Store
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.ram import RamTier
from tests.store.storekit import HBM_PAGE, RAM_PAGE

StoreFactory = Callable[..., Store]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[StoreFactory]:
    """``make_store(hbm_blocks=4, ram_blocks=4, nvme=True, ...)``: a store over real tiers; closed at the end."""
    opened: list[Store] = []

    def make(
        *,
        hbm_blocks: int = 4,
        ram_blocks: int = 4,
        nvme: bool = True,
        nvme_capacity: int = 1 << 22,
        ram_codec: str = "raw",
        path: Path | None = None,
        **kw: Any,
    ) -> Store:
        hbm = HbmTier(hbm_blocks * HBM_PAGE, page_bytes=HBM_PAGE)
        # ram's first put is judged on the codec's frame bound (header + 4 KiB params + payload)
        ram = RamTier(
            max(ram_blocks, 3) * RAM_PAGE, get_codec(ram_codec), page_bytes=RAM_PAGE, pin_memory=False
        )
        tier = NvmeTier(path or tmp_path / "nvme", nvme_capacity, get_codec("int4")) if nvme else None
        kw.setdefault("tick", 0.05)
        s = Store(hbm, ram, tier, **kw)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()
