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
cluster_connection.py)

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

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgpack

from kvstore.codecs import Codec
from kvstore.tiers.cluster_client import (
    ClusterUnavailable,
    by_node,
    open_client,
    out_of_memory,
    wrong_type,
)
from kvstore.tiers.cluster_connection import ClusterConnection
from kvstore.tiers.cluster_format import RECORD_READ, SESSION_VERSION, ClusterNodes, record_span, session_of
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


class ClusterTier:
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
        px = _px(self.ttl)  # None (ttl "never"): made persistent, as a value written now would be
        expiry: dict[str, Any] = {"persist": True} if px is None else {"px": px}
        values = self._call("get", lambda c: self._pipeline(c, "getex", keys, tails=tails, **expiry))
        return [v if isinstance(v, (bytes, memoryview, Received)) else None for v in values]

    def refresh(self, keys: Sequence[bytes]) -> list[bytes]:
        """Set the TTL of the values of ``keys`` anew (PEXPIRE; absent keys are left absent): blocks
        served from a host's own tiers, whose cluster copies no read refreshes. Returns the keys
        that were absent. ClusterUnavailable on an outage."""
        px = _px(self.ttl)
        if not keys or px is None:
            return []
        found = self._call("refresh", lambda c: self._pipeline(c, "pexpire", keys, time=px))
        return [k for k, f in zip(keys, found, strict=True) if not (f is True or f == 1)]

    def store(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """SET each ``(key, value)`` with the TTL, and clear its evicted mark (a block written after
        an evict is the fleet's again); returns how many were stored. A refusal for
        memory (maxmemory) is counted in ``write_refused``; ClusterUnavailable on an outage, also
        when a node failed its part alone (a time-out in the pipeline: the caller's blocks are then
        not written, and must be taken for dropped)."""

        def run(c: Any) -> int:
            pipe = c.pipeline(transaction=False)
            for k, v in items:
                pipe.set(self.block_key(k), v, px=_px(self.ttl))
                pipe.delete(self.evicted_key(k))
            answers = list(pipe.execute(raise_on_error=False))
            results, cleared = answers[0::2], answers[1::2]
            ok = sum(1 for r in results if r is True)
            refused = sum(1 for r in results if out_of_memory(r))
            with self._lock:
                self.counters.written += ok
                self.counters.write_refused += refused
            failed = [r for r in results if r is not True and not out_of_memory(r)]
            failed += [r for r in cleared if isinstance(r, Exception)]
            if failed:  # counted in errors, and the tier marked down, by _call
                err = failed[0]
                raise err if isinstance(err, Exception) else RuntimeError(f"SET answered {err!r}")
            return ok

        return int(self._call("write", run))

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete the blocks under ``keys`` (an operator's evict), leaving each an evicted mark that
        lives as long as a block would (``ttl``): a host that holds a copy and finds the cluster's
        gone takes it for evicted, not lost, and does not write it back (``evicted``); a put that
        brings the block to a host that did not hold it writes it, and clears the mark. A mark the
        cluster refuses for memory is left out (the blocks go all the same). Returns how many
        blocks existed. ClusterUnavailable on an outage."""
        if not keys:
            return 0

        def run(c: Any) -> list[Any]:
            found = self._pipeline(c, "delete", keys)
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.set(self.evicted_key(k), b"", px=_px(self.ttl))
            marked = list(pipe.execute(raise_on_error=False))
            failed = [r for r in marked if isinstance(r, Exception) and not out_of_memory(r)]
            if failed:  # a node down or moving: as any failed call (the evict is reported not done)
                raise failed[0]
            return found

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

    def _foreign_index(self, client: Any) -> None:
        """The sorted set of sessions held another type (not kvstore's doing): deleted, and the records
        are listed in it again as each is next written (said once)."""
        client.delete(self.sessions_key())
        if not self._foreign_index_logged:
            self._foreign_index_logged = True
            log.warning("the cluster held another type under %s: deleted", self.sessions_key())

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

    # -- sessions ---------------------------------------------------------------------
    def session_key(self, name: str) -> str:
        return f"{self.prefix}:s:{hashlib.sha256(name.encode()).hexdigest()}"

    def sessions_key(self) -> str:
        """The sorted set of the session keys, each scored by when its record expires (Unix time)."""
        return f"{self.prefix}:session-expiry"

    def _legacy_sessions_key(self) -> str:
        """The set of session keys that builds before the sorted set wrote (read, and emptied as
        its records expire, while such hosts may still write it)."""
        return f"{self.prefix}:sessions"

    def put_session(self, name: str, info: dict[str, Any]) -> bool:
        """Record a session (its namespace, token ids or block keys); False when the cluster refused
        it for memory (the caller counts it in ``session_dropped``), or holds a record of the name whose namespace is
        another tenant's (a conversation another host stored: a host refuses a put that continues
        another tenant's session, and the cluster keeps the first one's record alike; one read more
        per write). ClusterUnavailable on an outage. Members of expired records leave the sorted set
        as this runs: it holds the live sessions."""
        value = msgpack.packb({"v": SESSION_VERSION, "name": name, **info}, use_bin_type=True)
        px = _px(self.ttl)
        key = self.session_key(name)
        tenant = _tenant_of(info)

        def write(c: Any) -> list[Any] | None:
            held = session_of(_string(c, key))  # (another type there is overwritten: not a record)
            if held is not None and held.get("name") == name and _tenant_of(held) != tenant:
                return None  # another tenant's conversation of this name, stored from another host
            now = time.time()  # wall time: the score is read by every host
            pipe = c.pipeline(transaction=False)  # one round trip
            pipe.set(key, value, px=px)
            pipe.zadd(self.sessions_key(), {key: math.inf if px is None else now + px / 1000})
            pipe.zremrangebyscore(self.sessions_key(), "-inf", f"({now - CLOCK_SLACK}")
            results = list(pipe.execute(raise_on_error=False))
            if wrong_type(results[1]):  # the sorted set of sessions is another type (not kvstore's
                self._foreign_index(c)  # doing): replaced, this record listed in it anew
                results[1:] = [
                    c.zadd(self.sessions_key(), {key: math.inf if px is None else now + px / 1000}),
                    0,
                ]
            errors = [r for r in results if isinstance(r, Exception) and not out_of_memory(r)]
            if errors:  # a node down or moving: as any failed call (_call marks the tier down)
                raise errors[0]
            return results

        results = self._call("session write", write)
        if results is None:
            if not self._foreign_logged:
                self._foreign_logged = True
                log.warning(
                    "session %r is another tenant's conversation in the cluster (stored from another "
                    "host): this host's record of it is not written there (further such are not logged)",
                    name,
                )
            return False
        # the cluster is full: refused, not an outage (counted by the caller, as a session record
        # not written: write_refused counts blocks)
        return not any(out_of_memory(r) for r in results)

    def refresh_sessions(self, names: Sequence[str]) -> None:
        """Set the TTL of the records of sessions ``names`` anew (absent ones are left absent), and
        their expiry in the sorted set with it. A cluster at its maxmemory refuses the sorted set's
        update (the records' TTL is set all the same; no block was refused): not an outage.
        ClusterUnavailable on an outage."""
        px = _px(self.ttl)
        if not names or px is None:
            return

        def run(c: Any) -> None:
            keys = [self.session_key(n) for n in names]
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.pexpire(k, px)
            found = list(pipe.execute(raise_on_error=False))
            live = [k for k, f in zip(keys, found, strict=True) if f is True or f == 1]
            if live:  # only members still there: one whose record went leaves the set as it should
                expires = time.time() + px / 1000
                pipe = c.pipeline(transaction=False)
                pipe.zadd(self.sessions_key(), dict.fromkeys(live, expires), xx=True)
                (result,) = pipe.execute(raise_on_error=False)
                if wrong_type(result):  # the sorted set is another type: replaced, listed anew as written
                    self._foreign_index(c)
                elif out_of_memory(result):  # even ZADD XX: refused (the records' TTL is set: their
                    pass  # expiry in the set is older, and they leave it late; no block was refused)
                elif isinstance(result, Exception):  # a node down or moving: as any failed call
                    raise result

        self._call("session refresh", run)

    def get_session(self, name: str) -> dict[str, Any] | None:
        """The session recorded under ``name`` (None when absent or not a session of this name).
        ClusterUnavailable on an outage."""
        d = session_of(self._call("session read", lambda c: _string(c, self.session_key(name))))
        return d if d is not None and d.get("name") == name else None

    def drop_session(self, name: str) -> bool:
        key = self.session_key(name)

        def drop(c: Any) -> bool:
            for index, remove in ((self.sessions_key(), c.zrem), (self._legacy_sessions_key(), c.srem)):
                try:
                    remove(index, key)
                except Exception as e:  # another type there: it lists nothing of kvstore's
                    if not wrong_type(e):
                        raise
            return bool(c.delete(key))

        return bool(self._call("session delete", drop))

    def sessions(self, visit: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Every session recorded and not expired (members whose record is gone are removed as they
        are met). With ``visit``, each record is passed to it as read, a batch of ``SESSION_BATCH``
        at a time, and none is kept (the answer is empty): a fleet's records need not fit in memory
        at once. ClusterUnavailable on an outage."""

        def read(c: Any) -> list[dict[str, Any]]:
            # another type under either set (not kvstore's doing) lists nothing: no outage
            live = _or_empty(lambda: c.zrangebyscore(self.sessions_key(), time.time() - CLOCK_SLACK, "+inf"))
            older = _or_empty(lambda: c.smembers(self._legacy_sessions_key()))  # builds before the sorted set
            members = sorted(set(live) | set(older))
            out, gone = [], []
            for at in range(0, len(members), SESSION_BATCH):
                batch = members[at : at + SESSION_BATCH]
                pipe = c.pipeline(transaction=False)
                for m in batch:
                    pipe.get(m)
                answers = pipe.execute(raise_on_error=False)
                failed = [r for r in answers if isinstance(r, Exception) and not wrong_type(r)]
                if failed:  # a node down or moving: as any failed call
                    raise failed[0]
                for m, raw in zip(batch, answers, strict=True):
                    d = None if wrong_type(raw) else session_of(raw)  # another type: no record
                    if d is None:
                        gone.append(m)
                    elif visit is not None:
                        try:
                            visit(d)
                        except Exception:  # the caller's failure on one record is no cluster outage
                            log.exception("a session record from the cluster could not be used; skipped")
                    else:
                        out.append(d)
            if gone:
                c.zrem(self.sessions_key(), *gone)
                if older:
                    c.srem(self._legacy_sessions_key(), *gone)
            return out

        return list(self._call("session list", read))

    # -- reporting --------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "state": self.state,
                "nodes": self.nodes.describe(),
                "last_error": self.last_error,
                **asdict(self.counters),
            }


def _tenant_of(info: dict[str, Any]) -> Any:
    """The tenant a session record's namespace names (None when it names none readable)."""
    ns = info.get("ns")
    return ns.get("tenant") if isinstance(ns, dict) else None


def _string(client: Any, key: str) -> Any:
    """GET ``key``; None where it holds another type (not a string: not kvstore's)."""
    try:
        return client.get(key)
    except Exception as e:
        if wrong_type(e):
            return None
        raise


def _or_empty(read: Callable[[], Any]) -> Any:
    """``read()``, or () where the key it reads holds another type."""
    try:
        return read()
    except Exception as e:
        if wrong_type(e):
            return ()
        raise


def _px(seconds: float) -> int | None:
    """A TTL in milliseconds; None for no expiry (``ttl = "never"``)."""
    return None if math.isinf(seconds) else max(1, int(seconds * 1000))


# Hosts' clocks disagree: a member is taken for expired only this long after its score (the record's
# own TTL, kept by the cluster, is what expires a session; a member whose record is gone is removed).
CLOCK_SLACK = 600.0
SESSION_BATCH = 256  # session records read in one round trip by ``sessions``

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
