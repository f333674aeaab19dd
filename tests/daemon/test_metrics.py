"""Metrics: a real store behind a real HTTP endpoint, scraped with urllib and parsed as Prometheus text."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvstore.codecs import get_codec
from kvstore.daemon.metrics import LATENCY_BUCKETS, Metrics
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.results import MISSING_PARENT, StoreClosed
from kvstore.store.engine import Store
from kvstore.tiers.hbm import HbmTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.ram import RamTier
from kvstore.wire.messages import ErrorReply, PutOk

# 2 layers x K/V x 4 tokens x 2 heads x 16 dims x bf16 = 1 KiB a block
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_tokens=4)
T = LAYOUT.block_tokens
NS = Namespace("tiny-model", LAYOUT)
NS_B = Namespace("tiny-model", LAYOUT, tenant="team-b")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def tokens(n_blocks: int, seed: int = 0) -> list[int]:
    return [seed * 100_000 + i for i in range(n_blocks * T)]


def kv(n_tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT.shape(n_tokens), generator=torch.Generator().manual_seed(seed)).to(
        torch.bfloat16
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> Samples:
    """Every sample of the endpoint, by (sample name, labels)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """hbm 2 blocks, ram 3 frames, nvme in tmp_path: a few puts reach every tier."""
    hbm = HbmTier(2 * 1024, page_bytes=1024)
    ram = RamTier(3 * 2048, get_codec("raw"), page_bytes=2048, pin_memory=False)
    s = Store(hbm, ram, NvmeTier(tmp_path / "nvme", 1 << 22, get_codec("int4")), tick=0.05)
    yield s
    s.close()


@pytest.fixture
def metrics(store: Store) -> Iterator[Metrics]:
    m = Metrics(store, usage=store.usage)
    yield m
    m.stop()


def test_a_scrape_shows_the_store_s_own_figures(store: Store, metrics: Metrics) -> None:
    # put 6 blocks in two sessions -> hbm holds 2, the rest demoted to ram and below; all written through
    a, b = tokens(4, seed=1), tokens(2, seed=2)
    store.put(NS, a, kv(4 * T, seed=1), session="conv-a")
    store.put(NS_B, b, kv(2 * T, seed=2), session="conv-b")
    # reads: a hits (promotions from ram/nvme), a miss, lookups with and without matches
    assert store.get(NS, a).matched_blocks == 4
    assert store.get(NS, tokens(3, seed=9)).matched_blocks == 0
    assert store.lookup(NS_B, b + tokens(1, seed=7)).matched_blocks == 2
    assert store.flush(timeout=30)
    url = metrics.start(free_port())
    assert url is not None and url.startswith("http://127.0.0.1:")

    got = scrape(url)
    stats = store.stats()
    assert value(got, "kvstore_up") == 1
    assert stats.tiers.keys() == {"hbm", "ram", "nvme"}
    for name, t in stats.tiers.items():
        assert value(got, "kvstore_tier_blocks", tier=name) == t.blocks
        assert value(got, "kvstore_tier_used_bytes", tier=name) == t.used
        assert value(got, "kvstore_tier_capacity_bytes", tier=name) == t.capacity
        for field in ("hits", "misses", "evictions", "demotions", "promotions"):
            assert value(got, f"kvstore_tier_{field}_total", tier=name) == getattr(t, field), (name, field)
        assert value(got, "kvstore_tier_corrupt_blocks_total", tier=name) == t.corrupt
    # the story moved blocks: the figures compared above are not all zero
    assert stats.tiers["hbm"].demotions > 0 and stats.tiers["nvme"].blocks == 6
    assert sum(t.hits for t in stats.tiers.values()) == 4
    assert value(got, "kvstore_blocks") == stats.blocks == 6
    assert value(got, "kvstore_sessions") == stats.sessions == 2
    assert value(got, "kvstore_namespaces") == stats.namespaces == 2
    assert value(got, "kvstore_write_queue_blocks") == stats.write_queue == 0
    # (a block demoted onto nvme before the writer reached it is not counted as written through)
    assert value(got, "kvstore_written_blocks_total") == stats.written > 0
    assert value(got, "kvstore_lookups_total") == stats.lookups == 3
    assert value(got, "kvstore_tokens_asked_total") == stats.tokens_asked == (4 + 3 + 3) * T
    assert value(got, "kvstore_tokens_matched_total") == stats.tokens_matched == 2 * T
    assert value(got, "kvstore_tokens_served_total") == stats.tokens_served == 4 * T
    assert value(got, "kvstore_token_hit_ratio") == pytest.approx(6 / 10)
    assert value(got, "kvstore_uptime_seconds") >= 0
    # per namespace, from counters the store keeps: one session each, blocks per tier
    for ns, n in ((NS, 4), (NS_B, 2)):
        labels = {"namespace": ns.id, "model": ns.model, "tenant": ns.tenant}
        assert value(got, "kvstore_namespace_sessions", **labels) == 1
        assert value(got, "kvstore_namespace_blocks", **labels) == n
        assert value(got, "kvstore_namespace_tier_blocks", **labels, tier="nvme") == n
        per_tier = {
            dict(lbl)["tier"]: v
            for (name, lbl), v in got.items()
            if name == "kvstore_namespace_tier_blocks" and ("namespace", ns.id) in lbl
        }
        assert per_tier == next(u for u in store.usage() if u.namespace == ns.id).tiers


def test_counters_follow_the_store_between_scrapes(store: Store, metrics: Metrics) -> None:
    url = metrics.start(free_port())
    assert url is not None
    # empty store: zeros, not missing
    first = scrape(url)
    assert value(first, "kvstore_lookups_total") == 0 and value(first, "kvstore_tier_blocks", tier="hbm") == 0
    assert value(first, "kvstore_token_hit_ratio") == 0
    # 2 more lookups -> the next scrape sees them, read from the store, not counted twice
    store.put(NS, tokens(1), kv(T))
    store.lookup(NS, tokens(1))
    store.lookup(NS, tokens(1))
    second = scrape(url)
    assert value(second, "kvstore_lookups_total") == store.stats().lookups == 2
    assert value(second, "kvstore_tier_blocks", tier="hbm") == 1


def test_histograms_count_every_observe_call(metrics: Metrics) -> None:
    # 5 gets, 3 puts (one failed with tier_io), 2 lookups, a request of an op no daemon serves
    for s in (0.00004, 0.0003, 0.002, 0.4, 12.0):
        metrics.observe("get", s)
    metrics.observe_reply("put", 0.01, PutOk(stored=2, present=0, failed=[]))
    metrics.observe_reply(
        "put",
        0.02,
        PutOk(
            stored=0, present=0, failed=[[3, MISSING_PARENT, "no parent"], [4, MISSING_PARENT, "no parent"]]
        ),
    )
    metrics.observe_reply("put", 0.03, ErrorReply(code="tier_io", message="disk full"))
    metrics.observe("lookup", 0.0001)
    metrics.observe("lookup", 0.0001, "busy")
    metrics.observe("frobnicate", 0.001, "made-up-code")
    url = metrics.start(free_port())
    assert url is not None
    got = scrape(url)

    for op, n in (("get", 5), ("put", 3), ("lookup", 2), ("other", 1)):
        assert value(got, "kvstore_request_duration_seconds_count", op=op) == n
        assert value(got, "kvstore_request_duration_seconds_bucket", op=op, le="+Inf") == n
    assert value(got, "kvstore_request_duration_seconds_sum", op="get") == pytest.approx(12.40234)
    # the buckets cut at 50 us .. 10 s: 40 us falls in the first, 12 s only in +Inf
    assert value(got, "kvstore_request_duration_seconds_bucket", op="get", le="5e-05") == 1
    assert value(got, "kvstore_request_duration_seconds_bucket", op="get", le="10.0") == 4
    assert (
        len(
            {
                lbl
                for name, lbl in got
                if name == "kvstore_request_duration_seconds_bucket" and ("op", "get") in lbl
            }
        )
        == len(LATENCY_BUCKETS) + 1
    )
    assert value(got, "kvstore_requests_total", op="get", code="ok") == 5
    assert value(got, "kvstore_requests_total", op="put", code="ok") == 2
    assert value(got, "kvstore_requests_total", op="put", code="tier_io") == 1
    assert value(got, "kvstore_requests_total", op="lookup", code="busy") == 1
    assert value(got, "kvstore_requests_total", op="other", code="other") == 1
    assert value(got, "kvstore_put_failed_blocks_total", reason=MISSING_PARENT) == 2


def test_blocks_a_real_put_refuses_are_counted_by_reason(store: Store, metrics: Metrics) -> None:
    # put blocks [2, 3] while [1] is absent -> both refused with missing_parent
    r = store.put(NS, tokens(4), kv(2 * T), start_block=2)
    metrics.count_put_failures(r.failed)
    url = metrics.start(free_port())
    assert url is not None
    assert value(scrape(url), "kvstore_put_failed_blocks_total", reason=MISSING_PARENT) == 2


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::", "example.com", ""])
def test_a_host_that_is_not_loopback_is_refused(metrics: Metrics, host: str) -> None:
    port = free_port()
    with pytest.raises(ConfigError, match="not a loopback address"):
        metrics.start(port, host=host)
    # nothing was bound
    assert metrics.url is None
    with socket.create_server(("127.0.0.1", port)):
        pass


def test_port_0_or_none_means_off_and_a_busy_port_is_a_config_error(metrics: Metrics) -> None:
    assert metrics.start(0) is None and metrics.start(None) is None and metrics.url is None
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}.*metrics_port"):
            metrics.start(port)


def test_stop_closes_the_endpoint_and_start_serves_again(metrics: Metrics) -> None:
    port = free_port()
    url = metrics.start(port, host="localhost")
    assert url == f"http://127.0.0.1:{port}/metrics" or url == f"http://localhost:{port}/metrics"
    assert value(scrape(url), "kvstore_up") == 1
    metrics.stop()
    metrics.stop()  # idempotent
    assert metrics.url is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)
    url2 = metrics.start(port)
    assert url2 is not None and value(scrape(url2), "kvstore_up") == 1


class ClosingStore:
    """A store that answers until it is closed, then raises StoreClosed like Store's data path does."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.closed = False

    def stats(self) -> Any:
        if self.closed:
            raise StoreClosed("the store is closed")
        return self.store.stats()


def test_a_store_that_cannot_answer_shows_up_0_and_the_scrape_still_works(store: Store) -> None:
    src = ClosingStore(store)
    m = Metrics(src)
    url = m.start(free_port())
    assert url is not None
    try:
        assert value(scrape(url), "kvstore_up") == 1
        src.closed = True
        got = scrape(url)
        assert value(got, "kvstore_up") == 0
        assert not any(name.startswith("kvstore_tier_") for name, _ in got)
        # the process figures still come
        assert any(name.startswith("process_") for name, _ in got) or not Path("/proc/self/stat").exists()
    finally:
        m.stop()


def test_two_metrics_objects_do_not_share_figures(store: Store, metrics: Metrics, tmp_path: Path) -> None:
    other_store = Store(HbmTier(2048, page_bytes=1024), None, None)
    other = Metrics(other_store)
    try:
        metrics.observe("get", 0.001)
        url = other.start(free_port())
        assert url is not None
        got = scrape(url)
        assert ("kvstore_request_duration_seconds_count", frozenset({("op", "get")})) not in got
        assert value(got, "kvstore_tier_capacity_bytes", tier="hbm") == 2048
        assert ("kvstore_tier_capacity_bytes", frozenset({("tier", "nvme")})) not in got
    finally:
        other.stop()
        other_store.close()


class DictStats:
    """A store whose stats come as a dict with the figures StoreStats does not carry yet
    (per namespace, write-through failures by reason): the shape Metrics exports when present."""

    def __init__(self, stats: dict[str, Any]) -> None:
        self._stats = stats

    def stats(self) -> dict[str, Any]:
        return self._stats


def test_write_failure_figures_when_the_store_reports_them() -> None:
    src = DictStats(
        {
            "tiers": {},
            "lookups": 7,
            "tokens_asked": 40,
            "tokens_matched": 8,
            "tokens_served": 12,
            "write_failures": {"tier_full": 3, "tier_io": 1},
        }
    )
    m = Metrics(src)
    url = m.start(free_port())
    assert url is not None
    try:
        got = scrape(url)
    finally:
        m.stop()
    assert value(got, "kvstore_write_failures_total", reason="tier_full") == 3
    assert value(got, "kvstore_write_failures_total", reason="tier_io") == 1
    assert value(got, "kvstore_token_hit_ratio") == pytest.approx(20 / 40)
    assert ("kvstore_sessions", frozenset()) not in got  # a figure the store does not report is not a 0


def test_write_failures_reported_as_one_number_are_exported_under_reason_any() -> None:
    m = Metrics(DictStats({"tiers": {}, "write_failures": 2}))
    url = m.start(free_port())
    assert url is not None
    try:
        got = scrape(url)
    finally:
        m.stop()
    assert value(got, "kvstore_write_failures_total", reason="any") == 2
    assert ("kvstore_token_hit_ratio", frozenset()) not in got  # no tokens_asked reported
