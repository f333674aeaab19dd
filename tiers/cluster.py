"""The cluster tier: codec frames and block records on a Redis Cluster (or Valkey) shared by many hosts.

::

    <prefix>:b:<key hex>    block value: b"KVC1" | key (32) | record length (u32 LE) | record | frame
    <prefix>:e:<key hex>    an evicted block's mark (empty), for as long as a block lives: no host
                            writes the block back as a lost copy meanwhile; a write of it clears it
    <prefix>:s:<sha256>     a session (msgpack map): namespace, block keys, token ids, time
    <prefix>:session-expiry the session keys, a sorted set scored by expiry (what evict --session must
                            leave alone); the expired leave it as sessions are written
    <prefix>:sessions       the same as a plain set, as earlier builds wrote it: read too

(the values and the seed nodes are written and parsed in cluster_format.py; the redis-py client
and the wording of its errors are in cluster_client.py; the connection, down and back up, in
cluster_connection.py; the session records in cluster_sessions.py)

The block key is the store's chained key (namespace, tenant and prefix hashed
in), so a cluster key names no token in the clear, and a session's key is the
SHA-256 of its name. Every value carries its own key, its record (parent,
namespace, position) and a self-checking frame: a value read is served only
when all three agree with what was asked (``unpack``), else the caller deletes
it and counts a miss. TTL: set on write, refreshed on every read (GETEX).

Unlike the local tiers this one has no index in the daemon: the cluster is the
index, asked in one pipelined round trip per request: the commands grouped by
node and written to every node before any answer is read (reads by
``cluster_client.by_node``, writes and redirected reads by redis-py's
ClusterPipeline, which does the same with more work per command). It is
also shared and can fail, so every call is guarded (``_call``): an error or a
time-out marks the cluster *down*: calls return at once as misses (the daemon
keeps serving from its local tiers) while a thread of the tier's own reconnects
every ``retry_after`` seconds, so no request ever waits on a reconnect. A write
the cluster refuses (``maxmemory``) is counted, not an outage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvstore.codecs import Codec
from kvstore.tiers.cluster_client import (
    ClusterUnavailable,
    by_node,
    open_client,
    out_of_memory,
    ttl_ms,
    wrong_type,
)
from kvstore.tiers.cluster_connection import ClusterConnection
from kvstore.tiers.cluster_format import RECORD_READ, ClusterNodes, record_span
from kvstore.tiers.cluster_sessions import ClusterSessions
from kvstore.tiers.cluster_values import Received

log = logging.getLogger(__name__)


@dataclass
class ClusterCounters:
    """What the cluster tier did since start (``stats`` and the metrics)."""

    written: int = 0  # blocks stored
    write_dropped: int = 0  # blocks not written: the write queue was full, the cluster down, or inf/NaN
    session_dropped: int = 0  # session records not written: too many waiting, the cluster down or full
    write_refused: int = 0  # refused by the cluster (maxmemory)
    hits: int = 0  # blocks served from the cluster
    misses: int = 0  # blocks asked for and not there
    corrupt: int = 0  # values that failed a check (deleted)
    errors: int = 0  # calls that failed (connection, time-out, cluster down)
    deleted: int = 0  # values deleted on request (evict)
    kept_evicted: int = 0  # write-backs not sent, or deleted again: an operator evicted the block


class ClusterTier(ClusterSessions):
    """Blocks and sessions on a Redis Cluster. Thread-safe; every call bounded by the time-outs.

    ``client_factory(nodes)`` builds the redis-py client (a ``RedisCluster``
    unless given), connecting as it is built; it is called again to reconnect.
    """

    name = "cluster"

    def __init__(
        self,
        nodes: ClusterNodes,
        codec: Codec,
        *,
        head_codec: Codec | None = None,
        head_blocks: int = 1,
        ttl: float = 7 * 86400.0,
        timeout: float = 0.5,
        retry_after: float = 5.0,
        prefix: str = "kvstore",
        client_factory: Callable[[ClusterNodes, float], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nodes = nodes
        self.codec = codec
        self.head_codec = head_codec
        self.head_blocks = head_blocks
        self.ttl = ttl
        self.timeout = timeout
        self.retry_after = retry_after
        self.prefix = prefix
        self.counters = ClusterCounters()
        self._foreign_logged = False  # a session record of another tenant left alone was logged
        self._foreign_index_logged = False  # the sorted set of sessions held another type (said once)
        self._lock = threading.Lock()  # guards the counters
        self._conn = ClusterConnection(
            nodes, timeout, retry_after, client_factory or open_client, clock, on_error=self._count_error
        )

    # -- connection (cluster_connection.py) ----------------------------------------------
    def connect(self) -> None:
        """Connect now; ClusterUnavailable (saying why) when the cluster cannot be used. A failure
        starts the reconnector, so the tier becomes usable by itself once the cluster is back."""
        self._conn.connect()

    def available(self) -> bool:
        """Whether a call would be tried now (False while the cluster is down or being reconnected)."""
        return self._conn.available()

    def close(self) -> None:
        """Close the client and stop reconnecting; later calls raise ClusterUnavailable."""
        self._conn.close()

    @property
    def state(self) -> str:
        """ "connecting", "up", "down" or "closed"."""
        return self._conn.state

    @property
    def last_error(self) -> str:
        return self._conn.last_error

    @property
    def reconnects(self) -> int:
        """Times the tier came back after it was down (a failover may have lost writes)."""
        return self._conn.reconnects

    def _call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        return self._conn.call(what, fn)

    def _failed(self, err: Exception, what: str = "connect", client: Any = None) -> None:
        self._conn.failed(err, what, client)

    def _count_error(self) -> None:
        with self._lock:
            self.counters.errors += 1

    # -- blocks -----------------------------------------------------------------------
    def block_key(self, key: bytes) -> str:
        return f"{self.prefix}:b:{key.hex()}"

    def evicted_key(self, key: bytes) -> str:
        """The mark an operator's evict of the block leaves (see ``delete``)."""
        return f"{self.prefix}:e:{key.hex()}"

    def codec_for(self, position: int | None) -> Codec:
        """``head_codec`` for the first ``head_blocks`` blocks of a prefix, ``codec`` otherwise."""
        if self.head_codec is not None and position is not None and position < self.head_blocks:
            return self.head_codec
        return self.codec

    def codecs(self) -> tuple[Codec, ...]:
        return (self.codec,) if self.head_codec is None else (self.codec, self.head_codec)

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the cluster holds: one pipelined round trip.
        0 while the cluster is down or on any error (counted)."""
        if not keys:
            return 0
        try:
            found = self._call("lookup", lambda c: self._pipeline(c, "exists", keys))
        except ClusterUnavailable:
            return 0
        n = 0
        for f in found:
            if f != 1:
                break
            n += 1
        return n

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` the cluster holds. ClusterUnavailable on an outage."""
        return (
            [f == 1 for f in self._call("exists", lambda c: self._pipeline(c, "exists", keys))]
            if keys
            else []
        )

    def peek(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys`` (None where absent), TTL left alone (for operator calls)."""
        if not keys:
            return []
        values = self._call("read", lambda c: self._pipeline(c, "get", keys))
        return [v if isinstance(v, bytes) else None for v in values]

    def records(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The start of each value of ``keys``, through its record (what ``record_of`` reads; None
        where absent), without the frame: for operator calls, TTL left alone. One round trip, two
        when a record is longer than ``RECORD_READ``."""
        if not keys:
            return []
        heads = self._call(
            "read", lambda c: self._pipeline(c, "getrange", keys, start=0, end=RECORD_READ - 1)
        )
        out = [h if isinstance(h, bytes) and h else None for h in heads]
        longer = [i for i, h in enumerate(out) if h is not None and record_span(h) > len(h) == RECORD_READ]
        for i, v in zip(longer, self.peek([keys[i] for i in longer]), strict=True):
            out[i] = v
        return out

    def fetch(
        self, keys: Sequence[bytes], tails: Sequence[memoryview | None] = ()
    ) -> list[memoryview | bytes | Received | None]:
        """The values of ``keys`` (None where absent), TTL refreshed; one pipelined round trip.
        ClusterUnavailable when the cluster is down or the call fails. A value is bytes or (read
        straight off a node's socket) a memoryview of memory of its own, or Received: its last bytes
        went into ``tails[i]`` (``by_node``; that memory may be written whatever comes)."""
        if not keys:
            return []
        px = ttl_ms(self.ttl)  # None (ttl "never"): made persistent, as a value written now would be
        expiry: dict[str, Any] = {"persist": True} if px is None else {"px": px}
        values = self._call("get", lambda c: self._pipeline(c, "getex", keys, tails=tails, **expiry))
        return [v if isinstance(v, (bytes, memoryview, Received)) else None for v in values]

    def refresh(self, keys: Sequence[bytes]) -> list[bytes]:
        """Set the TTL of the values of ``keys`` anew (PEXPIRE; absent keys are left absent): blocks
        served from a host's own tiers, whose cluster copies no read refreshes. Returns the keys
        that were absent. ClusterUnavailable on an outage."""
        px = ttl_ms(self.ttl)
        if not keys or px is None:
            return []
        found = self._call("refresh", lambda c: self._pipeline(c, "pexpire", keys, time=px))
        return [k for k, f in zip(keys, found, strict=True) if not (f is True or f == 1)]

    def store(self, items: Sequence[tuple[bytes, bytes]], *, again: bool = False) -> int:
        """SET each ``(key, value)`` with the TTL; returns how many were stored. A block written
        afresh (a put brought it to a host that did not hold it) clears its evicted mark: it is the
        fleet's again. One written ``again`` (a copy a host holds, sent back because the cluster lost
        it; the caller checked its mark just before) leaves a mark alone: one an evict set since
        keeps the fleet from writing it back for good. A refusal for memory (maxmemory) is counted in
        ``write_refused``; ClusterUnavailable on an outage, also when a node failed its part alone
        (a time-out in the pipeline: the caller's blocks are then not written, and must be taken for
        dropped)."""

        def run(c: Any) -> int:
            pipe = c.pipeline(transaction=False)
            for k, v in items:
                pipe.set(self.block_key(k), v, px=ttl_ms(self.ttl))
                if not again:
                    pipe.delete(self.evicted_key(k))
            answers = list(pipe.execute(raise_on_error=False))
            results, cleared = (answers, []) if again else (answers[0::2], answers[1::2])
            failed = [r for r in results if r is not True and not out_of_memory(r)]
            failed += [r for r in cleared if isinstance(r, Exception)]
            if failed:  # counted in errors, and the tier marked down, by _call; nothing counted as
                err = failed[0]  # written: the caller takes the blocks for dropped
                raise err if isinstance(err, Exception) else RuntimeError(f"SET answered {err!r}")
            ok = sum(1 for r in results if r is True)
            with self._lock:
                self.counters.written += ok
                self.counters.write_refused += len(results) - ok
            return ok

        return int(self._call("write", run))

    def delete(self, keys: Sequence[bytes], *, mark: bool = False) -> int:
        """Delete the blocks under ``keys``; returns how many existed. ClusterUnavailable on an outage.

        ``mark`` (an operator's evict): each first gets an evicted mark that lives as long as a block
        would (``ttl``; MARK_TTL_NEVER when blocks never expire), so that a host that holds a copy and
        finds the cluster's gone takes it for evicted, not lost, and does not write it back
        (``evicted``); a put that brings the block to a host that did not hold it writes it, and
        clears the mark. The marks go first: an evict that fails half-way has marked what it
        deleted, and a host that finds a block gone finds its mark too. A mark the cluster refuses
        for memory is left out (its block goes all the same). A damaged value is deleted unmarked:
        a host that holds the block writes it back."""
        if not keys:
            return 0

        def run(c: Any) -> list[Any]:
            if mark:
                px = ttl_ms(self.ttl) or ttl_ms(MARK_TTL_NEVER)
                pipe = c.pipeline(transaction=False)
                for k in keys:
                    pipe.set(self.evicted_key(k), b"", px=px)
                marked = list(pipe.execute(raise_on_error=False))
                failed = [r for r in marked if isinstance(r, Exception) and not out_of_memory(r)]
                if failed:  # a node down or moving: as any failed call (nothing deleted yet)
                    raise failed[0]
            return self._pipeline(c, "delete", keys)

        found = self._call("delete", run)
        return sum(int(f) for f in found if isinstance(f, int))

    def evicted(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` an operator's evict deleted from the cluster within the TTL (their marks
        are there). ClusterUnavailable on an outage."""
        if not keys:
            return []
        found = self._call("lookup", lambda c: self._pipeline(c, "exists", keys, name=self.evicted_key))
        return [f == 1 for f in found]

    def _pipeline(
        self,
        client: Any,
        op: str,
        keys: Sequence[bytes],
        tails: Sequence[memoryview | None] = (),
        name: Callable[[bytes], str] | None = None,
        **kw: Any,
    ) -> list[Any]:
        """``op`` on every key (under ``name(key)``, the block's key unless given) in one round trip:
        reads straight to the nodes (``by_node``, ``tails`` for its values), anything else (and reads
        a node redirected) through redis-py's cluster pipeline."""
        name = name or self.block_key
        read = _READS.get(op)
        answers = None
        if read is not None:
            values = op in _VALUES  # (their answers end in time, however they trickle in)
            answers = by_node(
                client,
                [read(name(k), **kw) for k in keys],
                values=values,
                tails=tails,
                # (four time-outs: a batch of large blocks on a slow link may take more than one, and a
                # missed deadline marks the tier down)
                deadline=time.monotonic() + 4 * self.timeout if values else None,
            )
        if answers is None:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                getattr(pipe, op)(name(k), **kw)
            answers = list(pipe.execute(raise_on_error=False))
        results: list[Any] = answers
        wrong = [i for i, r in enumerate(results) if wrong_type(r)]
        if wrong:  # a value of another type under a block's key (not one kvstore wrote): a miss, the
            if op == "getex":  # rest of the answer stands (an outage would take every host down);
                self._drop_foreign(client, [keys[i] for i in wrong])  # a read that serves deletes it
            for i in wrong:  # as damaged (an operator's look, a dry run, changes nothing)
                results[i] = None
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:  # a node of the slot is down or moving: the whole answer is not to be trusted
            raise errors[0]
        return results

    def _drop_foreign(self, client: Any, keys: Sequence[bytes]) -> None:
        """Delete the values of another type found under ``keys`` (counted damaged), as far as the
        cluster lets: one that stays is found again, a miss again."""
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.delete(self.block_key(k))
        pipe.execute(raise_on_error=False)
        self.count(corrupt=len(keys))
        log.warning(
            "the cluster held %d values of another type under block keys (the first: %s): deleted",
            len(keys),
            self.block_key(keys[0]),
        )

    def count(self, **changes: int) -> None:
        with self._lock:
            for name, n in changes.items():
                setattr(self.counters, name, getattr(self.counters, name) + n)

    # -- reporting --------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "state": self.state,
                "nodes": self.nodes.describe(),
                "last_error": self.last_error,
                **asdict(self.counters),
            }


MARK_TTL_NEVER = 7 * 86400.0  # an evicted mark's TTL where blocks never expire (ttl = "never")

# The single-key commands ``_pipeline`` sends with ``by_node``: op -> the command for one key.
_READS: dict[str, Callable[..., tuple[Any, ...]]] = {
    "exists": lambda key: ("EXISTS", key),
    "pexpire": lambda key, time: ("PEXPIRE", key, time),
    "get": lambda key: ("GET", key),
    "getrange": lambda key, start, end: ("GETRANGE", key, start, end),
    "getex": lambda key, px=None, persist=False: (
        ("GETEX", key, "PERSIST") if persist else ("GETEX", key, "PX", px)
    ),
}
# those whose values are read off the socket into memory of their own (by_node's ``values``): the
# blocks a read fetches (operator calls' GETs stay bytes)
_VALUES = frozenset({"getex"})
