"""The cluster tier's connection: one redis-py client, and what happens when the cluster fails.

::

    up --(a call fails)--> down: calls miss at once --(retry_after)--> reconnector thread tries
     ^                                                                   |  fails: down again
     +------------------------- connected ------------------------------+

Reconnecting is never on a request's path: the reconnector (one thread, started by the failure)
keeps the connection down while it tries. Only a connection never connected (no ``connect()``)
connects on its first call, once: concurrent callers miss meanwhile. A reconnect starts from the
configured seeds, then the nodes the last client learnt (replicas promoted since, among them).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvstore.tiers.cluster_client import ClusterUnavailable, reason
from kvstore.tiers.cluster_format import ClusterNodes

log = logging.getLogger("kvstore.tiers.cluster")


class ClusterConnection:
    """The client of ``nodes`` (``factory(nodes, timeout)`` builds and connects one), guarded: every
    call through ``call``. Thread-safe. ``on_error`` is called for every failed call (the tier
    counts them), a failure on a client replaced since included."""

    def __init__(
        self,
        nodes: ClusterNodes,
        timeout: float,
        retry_after: float,
        factory: Callable[[ClusterNodes, float], Any],
        clock: Callable[[], float],
        *,
        on_error: Callable[[], None],
    ) -> None:
        self.nodes, self.timeout, self.retry_after = nodes, timeout, retry_after
        self._factory, self._clock, self._on_error = factory, clock, on_error
        self._lock = threading.Lock()  # guards the client and the state
        self._client: Any = None
        # nodes the last client learnt from the cluster (replicas promoted since the config was
        # written among them): a reconnect asks them after the seeds, which may all have died
        self._learnt: tuple[tuple[str, int], ...] = ()
        self._down_until = 0.0
        self._closed = False
        self._stop = threading.Event()  # set by close: the reconnector ends
        self._reconnecting = False  # the reconnector thread owns getting a new client
        self.state = "connecting"
        self.last_error = ""
        self.reconnects = 0  # times it came back after it was down

    def connect(self) -> None:
        """Connect now; ClusterUnavailable (saying why) when the cluster cannot be used. A failure
        starts the reconnector, so the tier becomes usable by itself once the cluster is back."""
        try:
            client = self._open()
        except Exception as e:  # redis-py raises many types; all mean "not usable now"
            self.failed(e)
            raise ClusterUnavailable(self.last_error) from None
        self._up(client)

    def available(self) -> bool:
        """Whether a call would be tried now (False while the cluster is down or being reconnected)."""
        return not self._reconnecting and self._clock() >= self._down_until

    def _open(self) -> Any:
        """A new client, answering a PING; raises redis-py's error (or ClusterUnavailable). It starts
        from the configured seeds, then the nodes the last client learnt."""
        learnt = tuple(h for h in self._learnt if h not in self.nodes.hosts)
        nodes = replace(self.nodes, hosts=(*self.nodes.hosts, *learnt)) if learnt else self.nodes
        client = self._factory(nodes, self.timeout)
        try:
            client.ping()
        except BaseException:
            _close_quietly(client)
            raise
        return client

    def call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)``, or ClusterUnavailable at once while down; any failure marks it down."""
        with self._lock:
            if self._reconnecting or self._clock() < self._down_until:
                raise ClusterUnavailable(f"the cluster is down ({self.last_error}); retrying soon")
            if self._closed:
                raise ClusterUnavailable("the cluster tier is closed")
            client = self._client
            if client is None:  # never connected: this caller connects, the others miss meanwhile
                self._down_until = math.inf
        if client is None:
            try:
                client = self._open()
            except Exception as e:
                self.failed(e, "connect")
                raise ClusterUnavailable(self.last_error) from None
            if not self._up(client):
                raise ClusterUnavailable("the cluster tier is closed")
        try:
            return fn(client)
        except ClusterUnavailable:
            raise
        except Exception as e:
            self.failed(e, what, client)
            raise ClusterUnavailable(self.last_error) from None

    def _up(self, client: Any) -> bool:
        """Use ``client`` from now on; False (and it is closed) when the tier was closed meanwhile."""
        with self._lock:
            closed, was = self._closed, self.state
            if not closed:
                self._client, self.state, self.last_error, self._down_until = client, "up", "", 0.0
                self._reconnecting = False  # (its thread ends now)
                self.reconnects += was == "down"
        if closed:
            _close_quietly(client)
        elif was == "down":
            log.warning("cluster %s is reachable again; reads and writes resume", self.nodes.describe())
        return not closed

    def failed(self, err: Exception, what: str = "connect", client: Any = None) -> None:
        """Mark the tier down for ``retry_after`` seconds and make sure the reconnector runs. A call
        that failed on ``client``, a client replaced since (a reconnect happened meanwhile), only
        counts its error: the new client is not thrown away for the old one's failure."""
        why = reason(err)
        learnt = _nodes_of(client)
        self._on_error()
        with self._lock:
            if client is not None and client is not self._client:
                return
            self._learnt = learnt or self._learnt
            was = self.state
            self.state, self.last_error = "down", why
            self._down_until = self._clock() + self.retry_after
            stale, self._client = self._client, None  # a new client: the topology may have moved
            if not self._closed and not self._reconnecting:
                self._reconnecting = True
                threading.Thread(
                    target=self._reconnect, name="kvstore-cluster-reconnect", daemon=True
                ).start()
        if was != "down":
            log.warning(
                "cluster %s failed (%s: %s); serving from the local tiers, retrying every %g s",
                self.nodes.describe(),
                what,
                why,
                self.retry_after,
            )
        if stale is not None:
            _close_quietly(stale)

    def _reconnect(self) -> None:
        """(The reconnector thread.) Once ``retry_after`` has passed, a new client, until one connects
        or the tier is closed. While it tries, the tier stays down: calls miss at once."""
        while True:
            with self._lock:
                wait = self._down_until - self._clock()
            if wait > 0 and self._stop.wait(min(wait, self.retry_after)):
                return
            with self._lock:
                if self._closed:
                    return
                if self._clock() < self._down_until:
                    continue
            try:  # calls miss meanwhile (``_reconnecting``): none waits on this connect
                client = self._open()
            except Exception as e:  # noqa: BLE001 - every failure means "still down"
                self.failed(e, "reconnect")
                continue
            self._up(client)
            return

    def close(self) -> None:
        """Close the client and stop reconnecting; later calls raise ClusterUnavailable."""
        with self._lock:
            client, self._client = self._client, None
            self.state, self._closed = "closed", True
        self._stop.set()
        if client is not None:
            client.close()


def _nodes_of(client: Any) -> tuple[tuple[str, int], ...]:
    """The nodes ``client`` (a RedisCluster) knows, from its map of the cluster (no round trip);
    () for any other client."""
    try:
        return tuple((str(n.host), int(n.port)) for n in client.get_nodes())
    except Exception:  # noqa: BLE001 - not a RedisCluster, or no map: nothing learnt
        return ()


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a broken client may fail too; nothing to do
        pass
