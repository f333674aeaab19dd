"""The store's side of the cluster tier: blocks written through to it, read from it on a local miss.

::

    put()    new keys --> [ bounded queue ([cluster] write_queue) ] --> cluster thread: write(key)
             (full: dropped, counted; never a wait)                      read best copy, encode (int4),
                                                                         SET key value PX ttl
             session --> the cluster thread's task list ---------------> SET session record
    lookup   local walk ends at block i --> leading(keys i..)           one pipelined EXISTS round trip
    get      local blocks read --> read(keys i.., outs)                 pipelined GETEX in batches,
                                                                         checked and decoded into ``outs``
             --> the store adopts what came back (hbm; write-through to nvme as any put)

A block the cluster sent is not written back to it (the store's put of it says
so). The store calls in here without its lock held; ``write`` takes it only to
find a block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import takewhile
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvstore.codecs import decode_frame
from kvstore.errors import ConfigError, FrameError, KVStoreError
from kvstore.keys import KEY_BYTES, Namespace
from kvstore.record import BlockRecord
from kvstore.results import BlockInfo, EvictResult, InvalidRequest, SessionDetail, SessionInfo
from kvstore.store.parts import StoreParts
from kvstore.store.writer import WriteThrough
from kvstore.tiers.cluster import (
    ClusterNodes,
    ClusterTier,
    ClusterUnavailable,
    TlsFiles,
    pack_value,
    record_of,
    unpack_value,
)

if TYPE_CHECKING:
    from kvstore.config import Config

log = logging.getLogger(__name__)

FETCH_BATCH = 16  # blocks per pipelined GETEX: bounds the memory one read holds in flight
LOOKUP_LIMIT = 4096  # blocks one lookup asks the cluster about at most


class ClusterLink:
    """Write-through to ``cluster`` on a thread of its own, and reads from it for the store."""

    def __init__(
        self, parts: StoreParts, cluster: ClusterTier, *, queue: int = 1024, tick: float = 1.0
    ) -> None:
        self._lock, self._tiers, self._index, self._namespaces = (
            parts.lock,
            parts.tiers,
            parts.index,
            parts.namespaces,
        )
        self.cluster = cluster
        self._writer = WriteThrough(maxsize=queue, tick=tick, name="kvstore-cluster")
        self._writer.start(self._write, self._idle)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-cluster-fetch")
        self._decoders = ThreadPoolExecutor(2, thread_name_prefix="kvstore-cluster-decode")

    # -- writes -----------------------------------------------------------------------
    def submit(self, keys: list[bytes]) -> None:
        """Queue new blocks for the cluster without waiting: what does not fit, or arrives while the
        cluster is down, is dropped and counted (the local tiers keep every block regardless)."""
        if not keys:
            return
        if not self.cluster.available():
            self.cluster.count(write_dropped=len(keys))
            return
        refused = self._writer.submit(keys, 0.0)
        if refused:
            self.cluster.count(write_dropped=len(refused))

    def session(self, name: str, ns: Namespace, keys: list[bytes], tokens: bytes | None, now: float) -> None:
        """Record session ``name`` in the cluster (from the cluster thread): its namespace, the keys of
        its blocks from block 0 and, for a token chain, its token ids, so another host can find it."""
        info: dict[str, Any] = {
            "ns": ns.to_dict(),
            "keys": b"".join(keys),
            "tokens": tokens,
            "updated": now,
        }

        def write() -> None:
            try:
                self.cluster.put_session(name, info)
            except ClusterUnavailable:
                self.cluster.count(write_dropped=1)

        self._writer.run_soon(write)

    def _write(self, key: bytes) -> None:
        """Write one block: its best local copy, encoded for the cluster, with its record."""
        for _ in range(3):  # a demotion may move the copy between finding and reading it
            with self._lock:
                e = self._index.get(key)
                if e is None or e.highest() < 0:
                    return
                t = e.highest()
            try:
                rec = self._record(key)
                block = self._tiers[t].get(key)
                break
            except KeyError:
                continue
            except (FrameError, KVStoreError):  # damaged or recordless: the local read path deals with it
                return
        else:
            return
        frame = self.cluster.codec_for(rec.position).encode(block)
        try:
            self.cluster.store([(key, pack_value(rec, frame))])
        except ClusterUnavailable:
            self.cluster.count(write_dropped=1)

    def _record(self, key: bytes) -> BlockRecord:
        """The block's record: from memory while it has no nvme copy, else nvme's."""
        from kvstore.store.movement import Mover

        with self._lock:
            e = self._index.get(key)
            if e is None:
                raise KeyError(key)
            if e.pending is not None:
                return Mover.record_of(e, self._namespaces.root(e.ns))
        nvme = self._tiers.nvme
        if nvme is None:
            raise KVStoreError("no record of the block")
        return nvme.record(key)

    def _idle(self) -> None:
        pass

    def depth(self) -> int:
        return self._writer.depth()

    def drain(self, timeout: float | None = None) -> bool:
        return self._writer.drain(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued for up to ``timeout`` seconds, then stop (the cluster is a copy)."""
        self._writer.drain(timeout)
        self._writer.close()
        self._pool.shutdown(wait=True)
        self._decoders.shutdown(wait=True)
        self.cluster.close()

    # -- reads ------------------------------------------------------------------------
    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (the blocks after the local ones) the cluster holds, from the first."""
        return self.cluster.leading(keys[:LOOKUP_LIMIT])

    def read(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        parents: tuple[bytes, ...],
        outs: Sequence[torch.Tensor],
        frames: dict[bytes, Any] | None = None,
    ) -> int:
        """Fetch blocks ``keys`` from the cluster into ``outs`` (one ``[L, 2, T, H, D]`` tensor each),
        stopping at the first absent or damaged one; returns how many were written.

        The first block's record must name one of ``parents`` as its parent (the key before it, or the
        namespace root); each later one the key before it. A value that fails a check (its key,
        record, namespace, parent, CRC or layout) is deleted from the cluster and ends the read.
        ``frames`` (if given) receives each served block's frame, by key (for nvme: WriteBack.offer).
        """
        codecs = self.cluster.codecs()
        want = min(len(keys), len(outs))
        batches = [range(b0, min(b0 + FETCH_BATCH, want)) for b0 in range(0, want, FETCH_BATCH)]

        def check_decode(j: int, value: bytes) -> Any:
            """Block ``j``: checked against its key, namespace and parent, decoded into ``outs[j]``."""
            _, frame = _unpack(keys[j], value, ns.id, parents if j == 0 else (keys[j - 1],))
            decode_frame(frame, layout=ns.layout, out=outs[j], codecs=codecs)
            return frame

        # the next batch is fetched while this one is checked and decoded, two blocks at a time: the
        # round trip hides behind the codec work, which runs outside the GIL for the most part
        fetch = self._pool.submit
        ahead = fetch(self.cluster.fetch, [keys[j] for j in batches[0]]) if batches else None
        n = 0
        try:
            for i, batch in enumerate(batches):
                assert ahead is not None
                try:
                    values = ahead.result()
                except ClusterUnavailable:
                    return n
                nxt = [keys[j] for j in batches[i + 1]] if i + 1 < len(batches) else None
                ahead = fetch(self.cluster.fetch, nxt) if nxt else None
                present = [
                    v for v in takewhile(lambda v: v is not None, values) if v is not None
                ]  # to a miss
                held = len(present)
                work = [
                    self._decoders.submit(check_decode, j, v) for j, v in zip(batch, present, strict=False)
                ]
                for j, job in zip(batch, work, strict=False):
                    try:
                        frame = job.result()
                    except FrameError as err:
                        for rest in work:  # wait for the others: none may write into outs after this
                            rest.exception()
                        k = keys[j]
                        log.warning("cluster block %s failed its check (%s); deleted", k.hex()[:16], err)
                        self.cluster.count(corrupt=1)
                        try:
                            self.cluster.delete([k])
                        except ClusterUnavailable:
                            pass
                        return n
                    self.cluster.count(hits=1)
                    if frames is not None:
                        frames[keys[j]] = frame
                    n += 1
                if held < len(values):
                    self.cluster.count(misses=1)
                    return n
            return n
        finally:
            if ahead is not None:  # a read cut short: its prefetch is waited for, not left running
                try:
                    ahead.result()
                except ClusterUnavailable:
                    pass

    # -- operator calls (admin.py) ------------------------------------------------------
    def find_session(self, name: str) -> dict[str, Any] | None:
        """Session ``name`` as another host recorded it: ``ns`` (a Namespace), ``keys`` (its block keys
        from block 0), ``tokens`` (uint32 token ids, or None for an engine-key chain), ``updated``.
        None when the cluster has no such session or cannot be asked."""
        try:
            d = self.cluster.get_session(name)
        except ClusterUnavailable:
            return None
        return None if d is None else _session(d)

    def session_detail(self, name: str) -> SessionDetail | None:
        """Session ``name`` from the cluster, with the leading blocks the cluster still holds."""
        d = self.find_session(name)
        if d is None:
            return None
        ns, keys = d["ns"], d["keys"]
        held = self.cluster.leading(keys)
        info = SessionInfo(
            name=name,
            namespace=ns.id,
            model=ns.model,
            tenant=ns.tenant,
            tokens=len(keys) * ns.layout.block_tokens,
            blocks=held,
            tiers={"cluster": held},
            created=d["updated"],
            last_access=d["updated"],
        )
        blocks = [BlockInfo(i, k.hex(), ["cluster"], d["updated"]) for i, k in enumerate(keys[:held])]
        return SessionDetail(info=info, blocks=blocks)

    def evict(self, keys: list[bytes], session: str | None, *, dry_run: bool) -> EvictResult:
        """Delete the cluster's copies of ``keys`` and, with ``session``, the blocks that session stored
        there (its record names them; blocks other sessions stored stay) and its record. InvalidRequest
        when the cluster cannot be reached (nothing is deleted then)."""
        try:
            if session is not None:
                d = self.find_session(session)
                theirs = [] if d is None else d["keys"]
                others: set[bytes] = set()  # blocks another session's prefix runs through stay
                for o in self.cluster.sessions():
                    found = _session(o)
                    if found is not None and o.get("name") != session:
                        others.update(found["keys"])
                values = self.cluster.peek(theirs)
                for k, v in zip(theirs, values, strict=True):
                    rec = None if v is None else record_of(k, v)
                    if rec is not None and rec.sessions[:1] == (session,) and k not in others:
                        keys.append(k)
            keys = list(dict.fromkeys(keys))
            present = [k for k, there in zip(keys, self.cluster.exists(keys), strict=True) if there]
            if not dry_run:
                self.cluster.count(deleted=self.cluster.delete(present))
                if session is not None:
                    self.cluster.drop_session(session)
        except ClusterUnavailable as e:
            raise InvalidRequest(f"evict from the cluster tier: {e}") from None
        return EvictResult(blocks=len(present), bytes_freed={}, moved=0, keys=present, dry_run=dry_run)

    def status(self) -> dict[str, Any]:
        return {**self.cluster.status(), "queue": self.depth()}


def _session(d: dict[str, Any]) -> dict[str, Any] | None:
    """A session record as ``find_session`` gives it; None (logged) when damaged."""
    try:
        raw = bytes(d["keys"])
        return {
            "ns": Namespace.from_dict(d["ns"]),
            "keys": [raw[i : i + KEY_BYTES] for i in range(0, len(raw) - len(raw) % KEY_BYTES, KEY_BYTES)],
            "tokens": None if d.get("tokens") is None else np.frombuffer(bytes(d["tokens"]), dtype="<u4"),
            "updated": float(d.get("updated") or 0.0),
        }
    except (KVStoreError, KeyError, TypeError, ValueError) as e:
        log.warning("cluster record of session %r is damaged (%s); ignored", d.get("name"), e)
        return None


def _unpack(key: bytes, value: bytes, ns_id: str, parents: tuple[bytes, ...]) -> tuple[BlockRecord, Any]:
    err: FrameError | None = None
    for p in parents:
        try:
            return unpack_value(key, value, ns_id, p)
        except FrameError as e:
            err = e
    assert err is not None
    raise err


def cluster_from_config(config: Config) -> ClusterTier | None:
    """The cluster tier ``[cluster]`` describes, connected; None when it is off.

    A cluster that cannot be used now (unreachable, wrong credentials) is logged in one line and
    retried in the background: the daemon starts local-only. With ``required = true`` it raises
    ConfigError instead."""
    c = config.cluster
    if not c.enabled:
        return None
    files = (c.tls_ca_file, c.tls_cert_file, c.tls_key_file)
    tls = TlsFiles(*(None if f is None else str(f) for f in files))
    nodes = ClusterNodes.parse(c.nodes, c.username, c.resolved_password(), tls)
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
            raise ConfigError(f"[cluster] required = true, but the cluster cannot be used: {e}") from None
    return tier
