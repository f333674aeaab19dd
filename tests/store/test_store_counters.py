"""Per-namespace figures come from counters kept as blocks come and go, never from a walk of the blocks.

::

    tenant a: 6 blocks (2 sessions)      tenant b: 3 blocks (1 session)
    stats, usage, sessions, a tenant's stats, a metrics scrape   -> the right figures,
    with the index's walk over every entry made to fail: none of them walks the blocks
"""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.core import Metric

from kvstore.daemon.metrics import Metrics
from kvstore.daemon.tenancy import TenantOps
from kvstore.keys import Namespace
from kvstore.results import EvictFilter
from tests.store.storekit import LAYOUT, T, kv, tokens

A = Namespace("tiny-model", LAYOUT, tenant="a")
B = Namespace("tiny-model", LAYOUT, tenant="b")


def test_figures_per_namespace_and_tenant_walk_no_blocks(make_store, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_store(hbm_blocks=4, ram_blocks=4)
    s.put(A, tokens(4), kv(4 * T), session="a/one")
    s.put(A, tokens(2, seed=1), kv(2 * T, 1), session="a/two")
    s.put(B, tokens(3, seed=2), kv(3 * T, 2), session="b/one")
    assert s.flush(10)
    walked = s.evict(EvictFilter(tenant="a"), dry_run=True)  # the walk these figures used to take
    assert walked.blocks == 6
    held = {  # counted the slow way, before walks are forbidden
        (ns.id, name): sum(1 for e in s._index.entries() if e.ns == ns.id and e.tiers & (1 << t))
        for ns in (A, B)
        for t, name in enumerate(s.tiers.names)
    }

    def no_walk() -> Any:
        raise AssertionError("a figure walked every block")

    monkeypatch.setattr(s._index, "entries", no_walk)
    (ua,) = s.usage("a")
    assert ua.namespace == A.id and ua.blocks == 6 and ua.sessions == 2
    assert {(u.namespace, t): n for u in s.usage() for t, n in u.tiers.items()} == held
    assert {u.namespace: u.blocks for u in s.usage()} == {A.id: 6, B.id: 3}
    assert s.stats().blocks == 9
    assert [x.name for x in s.sessions("a")] == ["a/one", "a/two"]
    assert s.sessions("a")[0].blocks == 4

    mine = TenantOps(s, dict).stats("a")
    assert mine["store"]["blocks"] == 6 and mine["store"]["sessions"] == 2
    assert mine["store"]["tiers"]["nvme"]["blocks"] == 6

    m = Metrics(s, usage=s.usage)
    families: list[Metric] = list(m.registry.collect())
    tier_blocks = {
        (x.labels["tenant"], x.labels["tier"]): x.value
        for f in families
        if f.name == "kvstore_namespace_tier_blocks"
        for x in f.samples
    }
    assert tier_blocks[("a", "nvme")] == 6 and tier_blocks[("b", "nvme")] == 3
