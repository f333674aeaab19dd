"""Prometheus metrics of the daemon: the store's own figures read at scrape time, and request latencies.

::

    GET /metrics (127.0.0.1:<port>, its own thread) ─► Metrics.registry
        ├─ StoreCollector: store.stats() (+ store.usage()) read at every scrape -> gauges and counters
        ├─ kvstore_requests_total{op,code}, kvstore_request_duration_seconds{op}   <- Metrics.observe()
        └─ process_* (resident memory, CPU, open fds) of the daemon

Store figures are never copied into counters of our own: the collector reads
the store at scrape time, so what Prometheus sees cannot drift from what
``kvstore stats`` shows. Request figures exist only here: the daemon's
workers call ``observe`` once per request (thread-safe, no store lock taken).
Each Metrics owns its CollectorRegistry (no globals), so several daemons or
tests in one process never mix figures. The HTTP endpoint binds to loopback
only: the figures name tenants and models.

Longer than most modules: the metric tables (names, help, labels) are the module, and they
read best in one place.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, is_dataclass
from typing import Any, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.errors import ConfigError, KVStoreError
from kvstore.results import MISSING_PARENT, NO_ROOM, NamespaceUsage
from kvstore.wire.errors import ERROR_CODES
from kvstore.wire.messages import REQUESTS, ErrorReply, PutOk

# 50 µs (a lookup answered from the index) .. 10 s (a long prefix read back from nvme)
LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# Label values are bounded so that a misbehaving client cannot blow up the series count.
OPS = frozenset(REQUESTS)
PUT_FAILURES = frozenset({MISSING_PARENT, NO_ROOM}) | frozenset(ERROR_CODES)
OTHER = "other"

# (stats field, metric name, help) per tier
_TIER_GAUGES = (
    ("blocks", "kvstore_tier_blocks", "Blocks held in the tier"),
    ("used", "kvstore_tier_used_bytes", "Bytes of the tier's capacity in use"),
    ("capacity", "kvstore_tier_capacity_bytes", "Configured capacity of the tier (a hard limit)"),
)
_TIER_COUNTERS = (
    ("hits", "kvstore_tier_hits", "Blocks read from this tier (the highest tier holding them)"),
    ("misses", "kvstore_tier_misses", "Reads that found the block only below this tier, or nowhere"),
    (
        "evictions",
        "kvstore_tier_evictions",
        "Copies that left this tier: moved down, dropped, expired or evicted on request (a demotion counts here too)",
    ),
    (
        "demotions",
        "kvstore_tier_demotions",
        "Copies moved down from this tier (to make room, or evicted from it)",
    ),
    ("promotions", "kvstore_tier_promotions", "Blocks copied up into this tier on a hit or prefetch"),
    (
        "corrupt",
        "kvstore_tier_corrupt_blocks",
        "Frames of this tier that failed their checks, deleted and served as misses",
    ),
)
_STORE_GAUGES = (
    ("blocks", "kvstore_blocks", "Distinct blocks indexed (a block may be held in several tiers)"),
    ("sessions", "kvstore_sessions", "Sessions known to the store"),
    ("namespaces", "kvstore_namespaces", "Namespaces (model, layout, tenant) known to the store"),
    ("pinned", "kvstore_pinned_blocks", "Blocks pinned by a read or prefetch in flight"),
    ("write_queue", "kvstore_write_queue_blocks", "Blocks waiting in the write-through queue to nvme"),
    (
        "write_deferred",
        "kvstore_write_deferred_blocks",
        "Blocks whose write-through waits for room in the queue",
    ),
)
_STORE_COUNTERS = (
    ("written", "kvstore_written_blocks", "Blocks written through to nvme"),
    ("expired", "kvstore_expired_blocks", "Blocks dropped after the nvme TTL"),
    (
        "sessions_forgotten",
        "kvstore_sessions_forgotten",
        "Sessions the store let go: dead ones (no block left) past their bound or at a restart, or past "
        "a tenant's cap",
    ),
    (
        "unencodable",
        "kvstore_unencodable_blocks",
        "Blocks dropped on their way down a tier: its codec refused them (inf or NaN K/V)",
    ),
    ("lookups", "kvstore_lookups", "Lookups and gets served by the store (a long get: one a chunk)"),
    ("tokens_asked", "kvstore_tokens_asked", "Tokens (full blocks) asked for by lookups and gets"),
    ("tokens_matched", "kvstore_tokens_matched", "Tokens a lookup found cached"),
    ("tokens_served", "kvstore_tokens_served", "Tokens a get returned"),
)
_NS_LABELS = ["namespace", "model", "tenant"]


class StatsSource(Protocol):
    """What Metrics reads: a Store (or anything with the same ``stats``)."""

    def stats(self) -> Any: ...


UsageSource = Callable[[], Iterable[NamespaceUsage]]  # Store.usage: per-namespace counters, O(namespaces)


class StoreCollector(Collector):
    """Turns one ``store.stats()`` (and ``store.usage()``) into metric families, at every scrape.

    ``stats`` may be a StoreStats or its ``to_dict()`` form. Figures the store does not report are
    left out rather than shown as 0. When the store cannot answer (closed, failing), only
    ``kvstore_up 0`` is exported: a scrape never fails because of the store.
    """

    def __init__(
        self, store: StatsSource, started: float, clock: Callable[[], float], usage: UsageSource | None
    ) -> None:
        self._store = store
        self._started = started
        self._clock = clock
        self._usage = usage

    def describe(self) -> list[Metric]:
        return []  # families depend on what the store reports; describing would call the store at registration

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("kvstore_up", "1 when the store answered this scrape, 0 when it did not")
        try:
            stats = _plain(self._store.stats())
        except KVStoreError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        uptime = GaugeMetricFamily("kvstore_uptime_seconds", "Seconds since the daemon started")
        uptime.add_metric([], max(0.0, self._clock() - self._started))
        yield uptime
        yield from _tier_families(stats.get("tiers", {}))
        for field, name, doc in _STORE_GAUGES:
            if field in stats:
                yield GaugeMetricFamily(name, doc, value=stats[field])
        for field, name, doc in _STORE_COUNTERS:
            if field in stats:
                yield CounterMetricFamily(name, doc, value=stats[field])
        if "tokens_asked" in stats:
            yield GaugeMetricFamily(
                "kvstore_token_hit_ratio",
                "Lifetime (tokens matched + tokens served) / tokens asked; "
                "prefer rate() of the counters for a recent ratio",
                value=_hit_ratio(stats),
            )
        if "write_failures" in stats:
            yield _write_failures(stats["write_failures"])
        if stats.get("cluster"):
            yield from _cluster_families(stats["cluster"])
        if self._usage is not None:
            try:
                yield from _usage_families(list(self._usage()))
            except KVStoreError:
                pass  # the store closed between the two calls: the next scrape shows kvstore_up 0


class Metrics:
    """The daemon's metrics: a registry, its store collector, request counters, the HTTP endpoint.

    ``started`` (a ``clock()`` reading) is when the daemon started, default now. ``usage``: the
    store's per-namespace counters (``Store.usage``), exported per namespace when given.
    """

    def __init__(
        self,
        store: StatsSource,
        *,
        started: float | None = None,
        clock: Callable[[], float] = time.time,
        usage: UsageSource | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(store, clock() if started is None else started, clock, usage))
        ProcessCollector(registry=self.registry)
        self._requests = Counter(
            "kvstore_requests",
            "Requests answered, by op and result code (ok or an error code)",
            ["op", "code"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "kvstore_request_duration_seconds",
            "Time from a request's arrival to its reply, by op",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._put_failed = Counter(
            "kvstore_put_failed_blocks",
            "Blocks a put refused, by reason (missing_parent, no_room)",
            ["reason"],
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self._http: tuple[WSGIServer, threading.Thread] | None = None

    # -- per request (worker threads) -------------------------------------------------
    def observe(self, op: str, seconds: float, code: str = "ok") -> None:
        """Count one request of ``op`` answered with ``code`` ("ok" or an error code) after ``seconds``.
        Unknown ops and codes are counted as "other". Thread-safe."""
        op = op if op in OPS else OTHER
        self._requests.labels(op, code if code == "ok" or code in ERROR_CODES else OTHER).inc()
        self._latency.labels(op).observe(max(0.0, seconds))

    def observe_reply(self, op: str, seconds: float, reply: object) -> None:
        """``observe`` with the code taken from the reply message (ErrorReply -> its code), and the
        blocks a put refused (PutOk.failed) counted by reason."""
        self.observe(op, seconds, reply.code if isinstance(reply, ErrorReply) else "ok")
        if isinstance(reply, PutOk):
            self.count_put_failures(reply.failed)

    def count_put_failures(self, failed: Iterable[Sequence[Any]]) -> None:
        """Count ``(block index, code, message)`` entries (PutResult.failed / PutOk.failed) by code."""
        for entry in failed:
            reason = str(entry[1]) if len(entry) > 1 else OTHER
            self._put_failed.labels(reason if reason in PUT_FAILURES else OTHER).inc()

    # -- HTTP endpoint ----------------------------------------------------------------
    def start(self, port: int | None, host: str = "127.0.0.1") -> str | None:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns its URL, or None when
        ``port`` is 0/None (metrics off). Raises ConfigError for a host that is not loopback or a
        port that cannot be bound, KVStoreError when already started."""
        if not port:
            return None
        _check_loopback(host)
        with self._lock:
            if self._http is not None:
                raise KVStoreError(f"metrics already served at {self._url()}; stop() before starting again")
            try:
                self._http = start_http_server(port, addr=host, registry=self.registry)
            except OSError as e:
                raise ConfigError(
                    f"cannot serve metrics on {host}:{port}: {e.strerror or e}; pick another "
                    f"[server] metrics_port (KVSTORE_SERVER_METRICS_PORT), or 0 to turn "
                    f"metrics off"
                ) from None
            return self._url()

    def stop(self) -> None:
        """Stop serving (idempotent); the registry keeps its figures."""
        with self._lock:
            http, self._http = self._http, None
        if http is not None:
            server, thread = http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5.0)

    @property
    def url(self) -> str | None:
        """Where ``/metrics`` is served, None when not started."""
        with self._lock:
            return self._url() if self._http is not None else None

    def _url(self) -> str:
        assert self._http is not None
        host, port = self._http[0].server_address[:2]
        h = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{f'[{h}]' if ':' in h else h}:{port}/metrics"


def _check_loopback(host: str) -> None:
    if host == "localhost":
        return
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"metrics host {host!r} is not a loopback address: metrics name tenants and models, "
            f"so they are served on 127.0.0.1, ::1 or localhost only; to scrape from another "
            f"host, run an exporter or reverse proxy with authentication beside the daemon"
        )


def _plain(stats: Any) -> dict[str, Any]:
    """A StoreStats (dataclass) or its dict form, as a dict."""
    if isinstance(stats, Mapping):
        return dict(stats)
    to_dict = getattr(stats, "to_dict", None)
    if to_dict is not None:
        return dict(to_dict())
    if is_dataclass(stats) and not isinstance(stats, type):
        return asdict(stats)
    raise TypeError(f"store.stats() returned {type(stats).__name__}; expected StoreStats or a dict")


def _hit_ratio(stats: Mapping[str, Any]) -> float:
    # a lookup adds to tokens_matched, a get to tokens_served; both add what they asked for
    asked = stats.get("tokens_asked", 0)
    return (stats.get("tokens_matched", 0) + stats.get("tokens_served", 0)) / asked if asked else 0.0


def _tier_families(tiers: Mapping[str, Any]) -> Iterator[Metric]:
    rows = [(name, _plain(t)) for name, t in tiers.items()]
    for field, metric, doc in _TIER_GAUGES:
        g = GaugeMetricFamily(metric, doc, labels=["tier"])
        for name, t in rows:
            if field in t:
                g.add_metric([name], t[field])
        yield g
    for field, metric, doc in _TIER_COUNTERS:
        c = CounterMetricFamily(metric, doc, labels=["tier"])
        for name, t in rows:
            if field in t:
                c.add_metric([name], t[field])
        yield c


_CLUSTER_COUNTERS = (
    ("written", "kvstore_cluster_written_blocks", "Blocks written to the cluster tier"),
    (
        "write_dropped",
        "kvstore_cluster_dropped_blocks",
        "Blocks not written to the cluster: its queue was full, it was down, or its codec refused inf/NaN",
    ),
    (
        "session_dropped",
        "kvstore_cluster_dropped_sessions",
        "Session records not written to the cluster: too many were waiting, or it was down or full",
    ),
    ("write_refused", "kvstore_cluster_refused_blocks", "Blocks the cluster refused for memory (maxmemory)"),
    (
        "kept_evicted",
        "kvstore_cluster_kept_evicted_blocks",
        "Write-backs of blocks held here not sent: an operator evicted them from the cluster",
    ),
    (
        "errors",
        "kvstore_cluster_errors",
        "Calls to the cluster that failed (connection, time-out, cluster down)",
    ),
)


def _cluster_families(cl: Mapping[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "kvstore_cluster_up",
        "1 while the cluster tier answers, 0 while it is down",
        value=int(cl.get("state") == "up"),
    )
    yield GaugeMetricFamily(
        "kvstore_cluster_write_queue_blocks",
        "Blocks waiting to be written to the cluster",
        value=cl.get("queue", 0),
    )
    for field, name, doc in _CLUSTER_COUNTERS:
        yield CounterMetricFamily(name, doc, value=cl.get(field, 0))


def _write_failures(value: int | Mapping[str, int]) -> Metric:
    c = CounterMetricFamily(
        "kvstore_write_failures",
        "Blocks whose write-through to nvme failed (nvme full, "
        "disk full, I/O error); they stay queued and are written again later",
        labels=["reason"],
    )
    for reason, n in value.items() if isinstance(value, Mapping) else [("any", value)]:
        c.add_metric([str(reason)], n)
    return c


def _usage_families(usages: list[NamespaceUsage]) -> Iterator[Metric]:
    held = GaugeMetricFamily(
        "kvstore_namespace_blocks", "Blocks of the namespace held, all tiers", labels=_NS_LABELS
    )
    for u in usages:
        held.add_metric([u.namespace, u.model, u.tenant], u.blocks)
    yield held
    g = GaugeMetricFamily("kvstore_namespace_sessions", "Sessions per namespace", labels=_NS_LABELS)
    for u in usages:
        g.add_metric([u.namespace, u.model, u.tenant], u.sessions)
    yield g
    b = GaugeMetricFamily(
        "kvstore_namespace_tier_blocks",
        "Blocks of the namespace held in each tier (a block may be in several)",
        labels=[*_NS_LABELS, "tier"],
    )
    for u in usages:
        for tier, n in u.tiers.items():
            b.add_metric([u.namespace, u.model, u.tenant, tier], n)
    yield b
