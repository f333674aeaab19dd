"""The cluster tier's session records: a conversation as one host recorded it, for inspect,
prefetch and evict on the others (``ClusterTier`` is made of this and cluster.py; the keys are
listed there).

A record lives as long as its blocks (its TTL set anew with theirs), is listed in a sorted set by
when it expires (what ``sessions`` walks), and is never overwritten by another tenant's host, nor
by an earlier turn of the conversation (one host's record written late, after another host's of a
later turn, whose block keys start with all of its own). The read and the write are two round
trips, not one transaction: two hosts writing the same name within one round trip of each other
leave the last write's record.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from kvstore.tiers.cluster_client import out_of_memory, ttl_ms, wrong_type
from kvstore.tiers.cluster_format import SESSION_VERSION, session_of

log = logging.getLogger("kvstore.tiers.cluster")

# Hosts' clocks disagree: a member is taken for expired only this long after its score (the record's
# own TTL, kept by the cluster, is what expires a session; a member whose record is gone is removed).
CLOCK_SLACK = 600.0
SESSION_BATCH = 256  # session records read in one round trip by ``sessions``


class ClusterSessions:
    """Session records on the cluster (see the module)."""

    if TYPE_CHECKING:
        prefix: str
        ttl: float
        _foreign_logged: bool
        _foreign_index_logged: bool

        def _call(self, what: str, fn: Callable[[Any], Any]) -> Any: ...

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
        per write). A record held of a later turn (its block keys start with all of this one's) is
        left as it is, and this one is not written (True: nothing was refused). ClusterUnavailable on an
        outage. Members of expired records leave the sorted set
        as this runs: it holds the live sessions."""
        value = msgpack.packb({"v": SESSION_VERSION, "name": name, **info}, use_bin_type=True)
        px = ttl_ms(self.ttl)
        key = self.session_key(name)
        tenant = _tenant_of(info)

        def write(c: Any) -> list[Any] | None:
            held = session_of(_string(c, key))  # (another type there is overwritten: not a record)
            if held is not None and held.get("name") == name:
                if _tenant_of(held) != tenant:
                    return None  # another tenant's conversation of this name, stored from another host
                if _extends(held, info):  # a later turn of the conversation, from another host whose
                    return []  # record was written first: this earlier one must not replace it
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
        px = ttl_ms(self.ttl)
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

    def _foreign_index(self, client: Any) -> None:
        """The sorted set of sessions held another type (not kvstore's doing): deleted, and the records
        are listed in it again as each is next written (said once)."""
        client.delete(self.sessions_key())
        if not self._foreign_index_logged:
            self._foreign_index_logged = True
            log.warning("the cluster held another type under %s: deleted", self.sessions_key())


def _extends(held: dict[str, Any], info: dict[str, Any]) -> bool:
    """Whether the record ``held`` names the conversation ``info`` names and more: its block keys
    start with all of ``info``'s (a later turn). Hosts' clocks disagree, so no time decides it."""
    mine, theirs = info.get("keys"), held.get("keys")
    return (
        isinstance(mine, bytes)
        and isinstance(theirs, bytes)
        and len(theirs) > len(mine)
        and theirs.startswith(mine)
    )


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
