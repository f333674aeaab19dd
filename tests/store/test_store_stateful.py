"""Store against a reference model: random put / get / lookup / evict / restart sequences.

The store may drop blocks for room at any time, so the model does not predict
*which* blocks are held; it checks what must hold whatever was dropped:
every block served is the one put under that key (bit-exact from hbm and a raw
ram, within int4's error from nvme), lookups only match what was put, the
index is prefix-closed and agrees with the tiers, capacities hold, and a
restart after a flush finds every block that was on nvme with its chain.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.codecs import get_codec
from kvstore.keys import block_keys
from kvstore.results import EvictFilter
from kvstore.store.engine import Store
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.ram import RamTier
from tests.store.storekit import HBM_PAGE, NS, RAM_PAGE, T, served_right

MAX_BLOCKS = 6


def prompt(p: int) -> list[int]:
    """Prompts 0..5 in three families: p and p+3 share blocks 0 and 1, then diverge."""
    family = [7_000 * (p % 3) + i for i in range(MAX_BLOCKS * T)]
    return family[: 2 * T] + [v + 1_000_000 * (p // 3) for v in family[2 * T :]]


def block_data(key: bytes) -> torch.Tensor:
    """The K/V of a block, a function of its key (so every prompt sharing a block shares its data)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:7], "little"))
    return torch.randn(NS.layout.shape(), generator=g).to(torch.bfloat16)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvstore-stateful-"))
        self.store = self.open()
        self.put_keys: set[bytes] = set()

    def open(self) -> Store:
        return Store(
            HbmTier(3 * HBM_PAGE, page_bytes=HBM_PAGE),
            RamTier(4 * RAM_PAGE, get_codec("raw"), page_bytes=RAM_PAGE, pin_memory=False),
            NvmeTier(self.dir / "nvme", 1 << 21, get_codec("int4")),
            tick=0.05,
        )

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(
        p=st.integers(0, 5),
        n=st.integers(1, MAX_BLOCKS),
        chunk=st.integers(0, 3),
        session=st.sampled_from([None, "s1", "s2"]),
    )
    def put(self, p: int, n: int, chunk: int, session: str | None) -> None:
        toks = prompt(p)[: n * T]
        keys = block_keys(NS, toks)
        start = min(chunk, n - 1)
        data = torch.cat([block_data(k) for k in keys[start:]], dim=2)
        held_before = self.store.lookup(NS, toks).matched_blocks
        r = self.store.put(NS, toks, data, session=session, start_block=start)
        if start > held_before:
            assert r.stored == 0 and len(r.failed) == n - start  # no orphans: refused as a whole
        else:
            assert r.stored + r.present + len(r.failed) == n - start
            self.put_keys.update(keys[start : start + r.stored + r.present])

    @rule(p=st.integers(0, 5), start=st.integers(0, 2))
    def get(self, p: int, start: int) -> None:
        toks = prompt(p)
        keys = block_keys(NS, toks)
        got = self.store.get(NS, toks, start_block=start)
        assert got.matched_tokens == got.matched_blocks * T
        for j, tier in enumerate(got.tiers):
            k = keys[start + j]
            assert k in self.put_keys
            assert got.kv is not None
            part = got.kv[:, :, j * T : (j + 1) * T]
            assert served_right(self.store, k, tier, part, block_data(k))

    @rule(p=st.integers(0, 5))
    def lookup(self, p: int) -> None:
        toks = prompt(p)
        look = self.store.lookup(NS, toks)
        assert set(block_keys(NS, toks)[: look.matched_blocks]) <= self.put_keys

    @rule(
        flt=st.sampled_from(
            [
                EvictFilter(session="s1"),
                EvictFilter(tier="hbm"),
                EvictFilter(tier="ram"),
                EvictFilter(tier="nvme"),
                EvictFilter(older_than=0.0),
            ]
        ),
        dry=st.booleans(),
    )
    def evict(self, flt: EvictFilter, dry: bool) -> None:
        before = self.store.stats().blocks
        r = self.store.evict(flt, dry_run=dry)
        assert len(set(r.keys)) == r.blocks
        if dry:
            assert self.store.stats().blocks == before

    @rule()
    def evict_all(self) -> None:
        self.store.evict(EvictFilter(all=True))
        assert self.store.stats().blocks == 0
        self.put_keys.clear()

    @rule()
    def restart(self) -> None:
        s = self.store
        assert s.flush(30)
        nvme = s.tiers[-1]
        on_disk = set(nvme.keys())
        # what must come back: blocks on nvme whose whole chain is on nvme too
        expect = {e.key for e in s._index.entries() if all(a.key in on_disk for a in s._index.chain(e))}
        s.close()
        self.store = self.open()
        found = {e.key for e in self.store._index.entries()}
        assert found == expect

    @invariant()
    def sound(self) -> None:
        assert self.store.check_integrity() == []
        for ts in self.store.stats().tiers.values():
            assert ts.used <= ts.capacity


StoreMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_store_against_the_model = StoreMachine.TestCase
