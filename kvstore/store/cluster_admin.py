"""Operator calls that reach the cluster tier: sessions other hosts stored, evict, prefetch; and the
tier built from ``[cluster]``.

::

    session(S) on host B     S unknown here -> its record in the cluster -> its blocks, here or in the cluster
    prefetch(S) on host B    S unknown here -> get(S's tokens): read from the cluster, put here; S known here
    evict --tier cluster     the cluster's copies of the blocks selected on this host
    evict --session S        S's own blocks in the cluster (not those another session builds on), its record
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.errors import ConfigError
from kvstore.keys import KEY_BYTES, Namespace
from kvstore.results import (
    BlockInfo,
    EvictResult,
    GetResult,
    InvalidRequest,
    PrefetchResult,
    SessionDetail,
    SessionInfo,
)
from kvstore.store.cluster import ClusterLink
from kvstore.store.journal import Journal
from kvstore.store.parts import StoreParts
from kvstore.tiers.cluster import ClusterTier, ClusterUnavailable
from kvstore.tiers.cluster_format import ClusterNodes, TlsFiles, record_of

if TYPE_CHECKING:
    from kvstore.config import Config

log = logging.getLogger(__name__)


class ClusterAdmin:
    """The operator calls of one store on its cluster tier. ``get``: the store's get (it reads from the
    cluster what this host lacks and keeps it)."""

    def __init__(
        self, parts: StoreParts, link: ClusterLink, journal: Journal, get: Callable[..., GetResult]
    ) -> None:
        self._lock, self._clock, self._index, self._tiers = parts.lock, parts.clock, parts.index, parts.tiers
        self._sessions, self._namespaces = parts.sessions, parts.namespaces
        self._on_disk = parts.on_disk
        self.cluster = link.cluster
        self.status = link.status  # the tier's state and counters, and the write queue
        self._forget = link.forget  # copies an operator deleted: not this host's to write again
        self._unforget = link.unforget
        self._journal = journal
        self._get = get

    def find_session(self, name: str) -> dict[str, Any] | None:
        """Session ``name`` as another host recorded it: ``ns`` (a Namespace), ``keys`` (its block keys
        from block 0), ``tokens`` (uint32 token ids, or None for an engine-key chain), ``updated``.
        None when the cluster has no such session; InvalidRequest when it cannot be asked (not "no
        such session": it may well be there)."""
        try:
            d = self.cluster.get_session(name)
        except ClusterUnavailable as e:
            raise InvalidRequest(
                f"session {name!r} is not on this host, and the cluster tier, which may hold it, cannot be "
                f"asked now ({e}); try again once it is back"
            ) from None
        return None if d is None else _session(d)

    def session_detail(self, name: str) -> SessionDetail | None:
        """Session ``name`` as another host recorded it in the cluster: each of its blocks from the
        first, with where it is (this host's tiers, for a prefix this host holds too, and the
        cluster), up to the first block held nowhere (lookups are prefix-closed)."""
        d = self.find_session(name)
        if d is None:
            return None
        ns, keys = d["ns"], d["keys"]
        try:
            there = self.cluster.exists(keys)
        except ClusterUnavailable:  # gone since find_session answered: this host's copies alone
            there = [False] * len(keys)
        blocks = []
        with self._lock:
            for i, (k, held) in enumerate(zip(keys, there, strict=True)):
                e = self._index.get(k)
                tiers = [] if e is None else [self._tiers.names[t] for t in e.tier_list()]
                tiers += ["cluster"] if held else []
                if not tiers:
                    break
                blocks.append(BlockInfo(i, k.hex(), tiers, d["updated"] if e is None else e.last_access))
        counts: dict[str, int] = {}
        for b in blocks:
            for t in b.tiers:
                counts[t] = counts.get(t, 0) + 1
        info = SessionInfo(
            name=name,
            namespace=ns.id,
            model=ns.model,
            tenant=ns.tenant,
            tokens=len(keys) * ns.layout.block_tokens,
            blocks=len(blocks),
            tiers=counts,
            created=d["updated"],
            last_access=max([d["updated"], *(b.last_access for b in blocks)]),
        )
        return SessionDetail(info=info, blocks=blocks)

    def evict(
        self,
        keys: list[bytes],
        session: str | None,
        *,
        dry_run: bool,
        continued: Callable[[list[bytes], str], set[bytes]],
        tenant: str | None = None,
        within: set[bytes] | None = None,
    ) -> EvictResult:
        """Delete the cluster's copies of ``keys`` and, with ``session``, the blocks that session stored
        there (its record names them) and its record; with ``within`` too, only those of its blocks
        among ``within``, and the record stays (evict --session S with another criterion).
        With ``session`` a block is deleted only when
        nothing known continues it: not in another session's record, and not among
        ``continued(candidates, session)`` (the blocks this host knows something else builds on; a
        deleted block would orphan what follows it, lookups being prefix-closed). InvalidRequest when
        the cluster cannot be reached (nothing is deleted then). ``tenant``: whose conversation the
        session is on this host; a record of the name that another tenant's host wrote is left alone
        (None: this host does not know the session, and the record is taken as it is)."""
        foreign = False
        untagged = 0  # blocks the session's record names that carry no session tag in the cluster
        not_done = ""
        try:
            if session is not None:
                raw = self.cluster.get_session(session)  # ClusterUnavailable when down: nothing is deleted
                d = None if raw is None else _session(raw)
                # another tenant's conversation of the same name: neither its blocks nor its record go
                foreign = d is not None and tenant is not None and d["ns"].tenant != tenant
                d = None if foreign else d
                theirs = [] if d is None else d["keys"]
                if within is not None:
                    theirs = [k for k in theirs if k in within]
                others: set[bytes] = set()  # blocks another session's prefix runs through stay

                def other(o: dict[str, Any]) -> None:
                    found = _session(o) if o.get("name") != session else None
                    if found is not None:
                        others.update(k for k in found["keys"] if k in candidates)

                candidates = set(theirs) | set(keys)
                if candidates:
                    self.cluster.sessions(other)
                values = self.cluster.records(theirs)  # the records alone, not the frames
                for k, v in zip(theirs, values, strict=True):
                    rec = None if v is None else record_of(k, v)
                    if rec is not None and rec.sessions[:1] == (session,):
                        keys.append(k)
                    elif rec is not None and not rec.sessions:
                        # stored before it was named (an engine saving as it computes; a put of a
                        # block the cluster holds writes no new record): maybe a prefix others share
                        # unnamed, which no record here says: left, with the session's record
                        untagged += 1
                keys = list(dict.fromkeys(keys))
                kept = others | continued(keys, session)
                keys = [k for k in keys if k not in kept]
            keys = list(dict.fromkeys(keys))
            present = [k for k, there in zip(keys, self.cluster.exists(keys), strict=True) if there]
            # a record whose blocks all stay, untagged, is kept: dropped, the conversation would stay
            # in the cluster with no name left to find or evict it by
            keep_record = untagged > 0 and not present
            if keep_record:
                not_done = (
                    f"{untagged} blocks of session {session!r} in the cluster were stored before it was "
                    "named (maybe a prefix others share): they stay, and so does its record; evict them "
                    "on the host that stored them"
                )
            if not dry_run:
                self._forget(present)  # first: a write of them queued here meanwhile is not sent
                try:
                    self.cluster.count(deleted=self.cluster.delete(present, mark=True))
                except ClusterUnavailable:
                    self._unforget(present)  # (marks set before the failure are found by write-backs)
                    raise
                if session is not None and not foreign and within is None and not keep_record:
                    self.cluster.drop_session(session)
        except ClusterUnavailable as e:
            raise InvalidRequest(f"evict from the cluster tier: {e}") from None
        return EvictResult(
            blocks=len(present), bytes_freed={}, moved=0, keys=present, dry_run=dry_run, not_done=not_done
        )

    def prefetch(
        self, session: str, found: dict[str, Any], to: str, start_block: int, max_blocks: int | None
    ) -> PrefetchResult:
        """Read session ``session`` (``found``: find_session's answer) from the cluster into this host's
        tiers (blocks ``start_block ..``, at most ``max_blocks``) and, once its whole chain is here,
        record it here. The blocks are stored as a put stores them (in the top tier, making room), so
        ``moved`` counts those now held at ``to`` or above; one the put could not keep there is
        ``failed``. InvalidRequest for a session stored by engine page keys (no tokens to read), or
        for ``start_block`` past blocks this host does not hold yet (they come first: the chain is
        stored from its root)."""
        ns, keys, tokens = found["ns"], found["keys"], found["tokens"]
        if tokens is None:
            raise InvalidRequest(
                f"session {session!r} was stored by engine page keys on another host; the engine's own "
                "lookups read it from the cluster, prefetch cannot"
            )
        if 0 < start_block <= len(keys):
            with self._lock:
                held = keys[start_block - 1] in self._index
            if not held:
                raise InvalidRequest(
                    f"session {session!r} is not on this host yet and its block {start_block - 1} is not "
                    "here: prefetch it from block 0 (start_block 0) first"
                )
        T = ns.layout.block_tokens
        r = self._get(ns, tokens[: len(keys) * T], start_block=start_block, max_blocks=max_blocks)
        end = start_block + r.matched_blocks
        target = self._tiers.names.index(to)
        came = [k for k, t in zip(keys[start_block:end], r.tiers, strict=False) if t == "cluster"]
        with self._lock:
            entries = [self._index.get(k) for k in came]
            moved = sum(1 for e in entries if e is not None and e.highest() <= target)
            whole = r.matched_blocks > 0 and end == len(keys) and keys[end - 1] in self._index
            if whole:  # its tail is here, and with it the whole chain
                if self._namespaces.add(ns):
                    self._journal.namespace(ns)
                s = self._sessions.record_put(
                    session, ns.id, keys[end - 1], end * T, self._clock(), self._on_disk
                )
                self._journal.session(s)
        present = r.matched_blocks - len(came)
        want = len(keys) - start_block if max_blocks is None else min(max_blocks, len(keys) - start_block)
        want = max(0, want)
        failed = want - present - moved
        return PrefetchResult(
            session=session,
            to=to,
            moved=moved,
            present=present,
            failed=failed,
            start_block=start_block,
            blocks=len(keys),
            remaining=0 if failed else max(0, len(keys) - end),  # start_block past the end: none
            bytes_moved=moved * ns.layout.block_nbytes,
        )


def _session(d: dict[str, Any]) -> dict[str, Any] | None:
    """A session record as ``find_session`` gives it; None (logged) when damaged."""
    try:
        raw, tokens, updated = d["keys"], d.get("tokens"), d.get("updated") or 0.0
        # checked by type first: bytes(n) of a number n is n zero bytes (a record another build, or
        # anyone with the cluster's password, wrote)
        if (
            not isinstance(raw, bytes)
            or not isinstance(tokens, (bytes, type(None)))
            or len(tokens or b"") % 4
        ):
            raise TypeError("its keys or tokens are not bytes of whole keys and token ids")
        if isinstance(updated, bool) or not isinstance(updated, (int, float)) or not math.isfinite(updated):
            raise TypeError(f"its time is {updated!r:.40}")
        return {
            "ns": Namespace.from_dict(d["ns"]),
            "keys": [raw[i : i + KEY_BYTES] for i in range(0, len(raw) - len(raw) % KEY_BYTES, KEY_BYTES)],
            "tokens": None if tokens is None else np.frombuffer(tokens, dtype="<u4"),
            "updated": float(updated),
        }
    except Exception as e:  # noqa: BLE001 - any damage: the record is ignored, never the caller's error
        log.warning("cluster record of session %r is damaged (%s); ignored", d.get("name"), e)
        return None


def cluster_nodes(config: Config) -> ClusterNodes:
    """The seed nodes and credentials ``[cluster]`` names; ConfigError saying what is wrong (no
    node, a bad URL, a password variable not set). Reads the environment, connects to nothing."""
    c = config.cluster
    files = (c.tls_ca_file, c.tls_cert_file, c.tls_key_file)
    tls = TlsFiles(*(None if f is None else str(f) for f in files))
    return ClusterNodes.parse(c.nodes, c.username, c.resolved_password(), tls)


def cluster_from_config(config: Config) -> ClusterTier | None:
    """The cluster tier ``[cluster]`` describes, connected; None when it is off.

    A cluster that cannot be used now (unreachable, wrong credentials) is logged in one line and
    retried in the background: the daemon starts local-only. With ``required = true`` it raises
    ConfigError instead."""
    c = config.cluster
    if not c.enabled:
        return None
    nodes = cluster_nodes(config)
    codec, head = c.codecs(config.nvme)
    tier = ClusterTier(
        nodes,
        codec,
        head_codec=head,
        head_blocks=config.nvme.head_blocks,
        ttl=config.nvme.ttl if c.ttl is None else c.ttl,
        timeout=c.timeout,
        retry_after=c.retry_after,
        prefix=c.prefix,
    )
    try:
        tier.connect()
    except ClusterUnavailable as e:
        if c.required:
            tier.close()  # its reconnector stops: the daemon does not start
            raise ConfigError(f"[cluster] required = true, but the cluster cannot be used: {e}") from None
    return tier
