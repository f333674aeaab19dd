"""Store with its hbm tier on a GPU: blocks live on the device, demotion encodes there."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs import get_codec
from kvstore.store.engine import Store
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.ram import RamTier
from tests.store.storekit import HBM_PAGE, NS, RAM_PAGE, T, kv, same, tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_blocks_in_gpu_hbm_demote_to_ram_and_come_back() -> None:
    s = Store(
        HbmTier(4 * HBM_PAGE, device="cuda", page_bytes=HBM_PAGE),
        RamTier(4 * RAM_PAGE, get_codec("raw"), page_bytes=RAM_PAGE, pin_memory=True),
        None,
    )
    try:
        toks, data = tokens(6), kv(6 * T)
        assert s.put(NS, toks, data.cuda()).stored == 6
        assert s.lookup(NS, toks).tiers == ["ram", "ram", "hbm", "hbm", "hbm", "hbm"]
        got = s.get(NS, toks, device="cuda")
        assert got.kv is not None and got.kv.is_cuda
        assert same(got.kv.cpu(), data)
        cpu = s.get(NS, toks).kv  # default device: the CPU
        assert cpu is not None and same(cpu, data)
        assert s.check_integrity() == []
    finally:
        s.close()
