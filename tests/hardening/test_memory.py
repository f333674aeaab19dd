"""Memory bounds: under a load far larger than every tier, the daemon's RSS stays within its capacities.

    peak RSS (VmHWM) of the loaded daemon  <=  base + hbm + ram + nvme capacity + OVERHEAD

``base`` is the RSS of the same daemon idle with 1 MiB tiers (interpreter,
torch, zmq). hbm and ram are arenas allocated (and zeroed) at start; the LMDB
map counts as its pages are read or written (file-backed, at most the nvme
capacity). OVERHEAD is all the rest: the index and records of the blocks
held, messages being received and sent (1 MiB puts here), codec scratch,
allocator caches, code pages first run under load. Measured here (640 MiB put through 64 MiB of tiers):
about 80-85 MiB; the bound states 96 MiB.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.layout import KVLayout
from tests.hardening.conftest import endpoint_of, rss_bytes, write_config

MiB = 2**20
HBM, RAM, NVME = 16 * MiB, 16 * MiB, 32 * MiB
OVERHEAD = 96 * MiB
LOAD = 10 * (HBM + RAM + NVME)  # bytes of K/V put over the test
# 64 KiB blocks: realistic enough, and few enough that Python's per-block costs stay small
BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", block_tokens=16)


def status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[k] = int(v.split()[0]) * 1024
    return out


@pytest.mark.stress
@pytest.mark.slow
def test_rss_stays_within_the_capacities_plus_overhead(daemons, tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path,
        hbm={"capacity": f"{HBM // MiB}MiB"},
        ram={"capacity": f"{RAM // MiB}MiB"},
        nvme={"capacity": f"{NVME // MiB}MiB"},
        policy={"page_bytes": "64KiB"},
    )
    (tmp_path / "base").mkdir()
    small = daemons(
        write_config(
            tmp_path / "base",
            hbm={"capacity": "1MiB"},
            ram={"capacity": "1MiB"},
            nvme={"capacity": "1MiB"},
            policy={"page_bytes": "64KiB"},
        )
    )
    base = rss_bytes(small.proc.pid)
    assert small.stop() == 0
    d = daemons(cfg)
    idle = rss_bytes(d.proc.pid)
    rng = np.random.default_rng(0)
    per_put = 16  # blocks, 1 MiB of K/V
    puts = LOAD // (per_put * BIG.block_nbytes)
    kv = torch.randn(BIG.shape(per_put * BIG.block_tokens)).to(torch.float16)
    peak = idle
    history: list[np.ndarray] = []
    start = time.monotonic()
    with KVStoreClient(endpoint_of(cfg), model="big", layout=BIG, timeout=30.0) as c:
        for i in range(puts):
            tokens = rng.integers(0, 50000, per_put * BIG.block_tokens, dtype=np.uint32)
            r = c.put(tokens, kv)
            assert r.stored == per_put and not r.failed
            history.append(tokens)
            if i % 4 == 0:  # reads too: promotions, nvme pages mapped in
                old = history[int(rng.integers(len(history)))]
                got = c.get(old)
                if got.kv is not None:
                    assert got.kv.shape[2] == got.matched_tokens
            if i % 16 == 0:
                peak = max(peak, rss_bytes(d.proc.pid))
        assert c.flush()
        stats = c.stats()["store"]
    end = status(d.proc.pid)
    peak = max(peak, end["VmRSS"], end["VmHWM"])
    tiers = stats["tiers"]
    for name, cap in (("hbm", HBM), ("ram", RAM), ("nvme", NVME)):
        assert tiers[name]["used"] <= cap  # the tiers keep their own promise
    assert tiers["nvme"]["evictions"] > 0  # the load really overflowed every tier
    growth = peak - base
    print(
        f"\n{puts} puts ({puts * per_put * BIG.block_nbytes / MiB:.0f} MiB) in {time.monotonic() - start:.1f}s; "
        f"RSS base {base / MiB:.1f} MiB, idle {idle / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB: growth "
        f"{growth / MiB:.1f} MiB = capacities {(HBM + RAM + NVME) / MiB:.0f} MiB + overhead "
        f"{(growth - HBM - RAM - NVME) / MiB:.1f} MiB; end { ({k: round(v / MiB, 1) for k, v in end.items()}) }"
    )
    assert growth <= HBM + RAM + NVME + OVERHEAD
