"""The store's side of the cluster tier: blocks written through to it; reads from it are
cluster_reads.py's, which this link holds.

::

    put()    new keys --> [ bounded queue ([cluster] write_queue) ] --> cluster thread: write(key)
             (full: dropped, counted, remembered:                        best copy: nvme's frame as it
              the next put of the block sends it again; never a wait)    is, or encoded (int4);
                                                                          SET key value PX ttl
             session --> [ newest record per session, bounded ] -------> SET session record
    served here, or read from the cluster --> TTLs of blocks and session records set anew (batched)

The TTL refreshes and the write-backs of what the cluster lost are cluster_upkeep.py's (a part of
this link); operator calls on the cluster (sessions of other hosts, evict, prefetch) are in
cluster_admin.py.

A block the cluster sent is not written back to it (the store's put of it says
so). The store calls in here without its lock held; ``write`` takes it only to
find a block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.codecs import read_header
from kvstore.codecs.frame import Buffer
from kvstore.errors import CodecError, FrameError, KVStoreError
from kvstore.keys import Namespace
from kvstore.record import BlockRecord
from kvstore.results import PutResult
from kvstore.store.cluster_reads import ClusterReads
from kvstore.store.cluster_upkeep import REFRESH_MEMORY, UNSENT_LIMIT, ClusterUpkeep
from kvstore.store.parts import StoreParts
from kvstore.store.writer import WriteThrough
from kvstore.tiers.cluster import ClusterTier, ClusterUnavailable
from kvstore.tiers.cluster_format import pack_value

log = logging.getLogger(__name__)

RECORDS_BYTES = 64 << 20  # session records waiting hold at most this many bytes of keys and token ids


class ClusterLink(ClusterUpkeep):
    """Write-through to ``cluster`` on a thread of its own, and reads from it for the store."""

    def __init__(
        self,
        parts: StoreParts,
        cluster: ClusterTier,
        put: Callable[..., PutResult],
        offer: Callable[[dict[bytes, Any]], None] | None,
        *,
        queue: int = 1024,
        tick: float = 1.0,
    ) -> None:
        """``put``: the store's put (``_adopted=True`` for what came from the cluster); ``offer``: frames
        nvme may store as they are (WriteBack.offer; None without nvme)."""
        self._lock, self._tiers, self._index, self._namespaces = (
            parts.lock,
            parts.tiers,
            parts.index,
            parts.namespaces,
        )
        self._counts = parts.counts
        self._sessions = parts.sessions
        self._put, self._offer = put, offer
        self.cluster = cluster
        self._unencodable_logged = False
        self._reconnects = cluster.reconnects
        self._refused_codec: OrderedDict[bytes, None] = OrderedDict()  # blocks its codec cannot encode
        self._unsent_lock = threading.Lock()  # guards the two below
        # blocks dropped and not sent since (oldest first) -> whether each was a write-back (a copy
        # held here, not new to this host when it was queued)
        self._unsent: dict[bytes, bool] = {}
        self._resent: set[bytes] = set()  # blocks of _unsent queued again (their drop was counted)
        self._records: dict[str, dict[str, Any]] = {}  # session records waiting (oldest first)
        self._records_limit = queue
        self._records_bytes = 0
        self._writer = WriteThrough(maxsize=queue, tick=tick, name="kvstore-cluster")
        self._writer.start(self._write, self._idle)
        self.reads = ClusterReads(cluster, parts.lock, parts.counts, put, offer, self._served)
        # blocks served from this host's tiers, by when their cluster copy's TTL was last set (newest
        # last), and those due a refresh (see ``touch``)
        self._refreshed: OrderedDict[bytes, float] = OrderedDict()
        # blocks known to have reached the cluster (written, or read from it): a block found absent
        # there since was lost by it (_write_again), one not yet written is on its way
        self._there: OrderedDict[bytes, None] = OrderedDict()
        self._refresh_due: OrderedDict[bytes, None] = OrderedDict()
        # blocks a put found held here that are not known to be in the cluster (a restart forgot what
        # was sent, and what an outage kept from it): asked about on the cluster thread (``_verify``)
        self._unknown: OrderedDict[bytes, None] = OrderedDict()
        self._records_due: dict[str, None] = {}  # sessions whose record's TTL is due (see _touch_records)
        # blocks queued new to this host (a put brought them): written, and their marks cleared,
        # whatever an operator evicted before. Any other block queued is a write-back (held here: lost
        # by the cluster, or dropped before): written only if no evict marked it (``_write``)
        self._fresh: set[bytes] = set()
        # (the cluster thread's own) write-backs written whose check for an evict after the write
        # failed (the cluster went away): deleted again if their next write-back finds a mark
        self._unchecked: set[bytes] = set()
        # blocks an operator evicted from the cluster (newest REFRESH_MEMORY): this host writes them
        # back no more, nor asks about them, until a put brings them here afresh
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        self._records_refreshed: OrderedDict[str, float] = OrderedDict()  # when each was last due

    # -- writes -----------------------------------------------------------------------
    def submit(self, new: list[bytes], touched: Sequence[bytes] = ()) -> None:
        """Queue new blocks for the cluster without waiting: what does not fit, or arrives while the
        cluster is down, is dropped and counted (the local tiers keep every block regardless).

        ``touched``: the blocks of the put, in chain order (``new`` among them). One of them, or of the
        blocks before them (a put from a later block: an engine saving as it computes), dropped
        before and not written since goes again with them: lookups are prefix-closed, so without it
        the blocks after it would be unreachable in the cluster."""
        keys = new
        again: set[bytes] = set()
        if new:
            with self._unsent_lock:  # new here: written afresh, whatever an operator evicted before
                if self._evicted:
                    for k in new:
                        self._evicted.pop(k, None)
                self._fresh.update(new)
        self._check_held(new, touched)
        if self._unsent and touched:  # (cheap while nothing was dropped: a put costs no more than before)
            chain = self._ancestors(touched[0]) + list(touched)
            with self._unsent_lock:
                again = {k for k in chain if k in self._unsent}
                for k in again:
                    if not self._unsent.pop(k):  # new here when it was dropped: as fresh now
                        self._fresh.add(k)
                self._resent |= again
            if again:
                fresh = set(new)
                keys = [k for k in chain if k in again or k in fresh]
        if not keys:
            return
        if not self.cluster.available():
            self._dropped(keys, again)
            return
        refused = self._writer.submit(keys, 0.0)
        if refused:
            self._dropped(refused, again)

    def _unencodable(self, key: bytes, err: CodecError) -> None:
        """(The cluster thread.) Block ``key`` cannot go to the cluster (its codec refuses what the
        block holds): counted as dropped once, logged the first time, and not tried again (a bounded
        memory of such keys); the blocks after it are written all the same, and other hosts reach
        none of them (lookups are prefix-closed)."""
        with self._unsent_lock:
            self._refused_codec[key] = None
            while len(self._refused_codec) > UNSENT_LIMIT:
                self._refused_codec.popitem(last=False)
        if not self._unencodable_logged:
            self._unencodable_logged = True
            log.warning(
                "block %s cannot be written to the cluster (%s): it and the blocks after it are this "
                "host's only (later ones are counted in write_dropped, not logged)",
                key.hex()[:16],
                err,
            )
        self.cluster.count(write_dropped=1)

    def forget(self, keys: Sequence[bytes]) -> None:
        """``keys``' cluster copies are deleted on purpose (an operator's evict, here or on another
        host): not lost, so this host writes none of them again (``_write_again``), nor sends those
        it had not sent yet, or had queued, until a put brings them here afresh."""
        with self._unsent_lock:
            self._forget(keys)

    def _forget(self, keys: Sequence[bytes]) -> None:
        """(``_unsent_lock`` held.) See ``forget``."""
        for k in keys:
            self._evicted[k] = None
            self._evicted.move_to_end(k)
            self._fresh.discard(k)  # (queued by a put before the evict)
            self._there.pop(k, None)
            self._refreshed.pop(k, None)
            self._refresh_due.pop(k, None)
            self._unknown.pop(k, None)
            self._refused_codec.pop(k, None)
            self._unsent.pop(k, None)
            self._resent.discard(k)
        while len(self._evicted) > REFRESH_MEMORY:
            self._evicted.popitem(last=False)

    def _kept_evicted(self, key: bytes) -> None:
        """(The cluster thread.) A write-back of ``key`` found its evicted mark: not written, and
        known evicted here from now on (counted in ``kept_evicted``), unless a put brought the block
        here afresh meanwhile (then written as such)."""
        with self._unsent_lock:
            if key in self._fresh or self._unsent.get(key) is False:  # (queued, or dropped, afresh)
                return
            self._forget([key])
        self.cluster.count(kept_evicted=1)

    def unforget(self, keys: Sequence[bytes]) -> None:
        """An evict that ``forget`` was told of failed (the cluster went away): ``keys`` are not known
        evicted after all (their marks, where set, are found by a write-back)."""
        with self._unsent_lock:
            for k in keys:
                self._evicted.pop(k, None)

    def _set(self, keys: Sequence[bytes]) -> None:
        """``keys``' cluster copies have their TTL from now (written, or read with GETEX)."""
        with self._unsent_lock:
            self._remember(keys, time.monotonic())
            self._known_there(keys)

    def _known_there(self, keys: Sequence[bytes]) -> None:
        """(``_unsent_lock`` held.) ``keys`` are in the cluster (the newest REFRESH_MEMORY remembered):
        written, read, or found there; evicted before, they are the fleet's again."""
        for k in keys:
            self._evicted.pop(k, None)
            self._there[k] = None
            self._there.move_to_end(k)
        while len(self._there) > REFRESH_MEMORY:
            self._there.popitem(last=False)

    def _ancestors(self, key: bytes) -> list[bytes]:
        """The keys of the blocks before ``key`` in its chain, root first."""
        with self._lock:
            e = self._index.get(key)
            out = []
            p = None if e is None else e.parent
            while p is not None:
                out.append(p.key)
                p = p.parent
        return out[::-1]

    def _dropped(
        self,
        keys: Sequence[bytes],
        counted: set[bytes] | frozenset[bytes] = frozenset(),
        *,
        count: bool = True,
        back: bool | None = None,
    ) -> None:
        """``keys`` were not written: counted in ``write_dropped`` (but those of ``counted``, dropped
        before and counted then; none with ``count`` False: the cluster refused them, counted in
        ``write_refused``), and remembered so that the next put of them sends them, as write-backs
        (``back``; None: as they were queued) or as fresh writes."""
        if count:
            self.cluster.count(write_dropped=sum(1 for k in keys if k not in counted))
        with self._unsent_lock:
            for k in keys:
                self._unsent[k] = (k not in self._fresh) if back is None else back
                self._resent.discard(k)
                self._fresh.discard(k)
            while len(self._unsent) > UNSENT_LIMIT:  # the oldest are forgotten first
                del self._unsent[next(iter(self._unsent))]

    def session(self, name: str, ns: Namespace, keys: list[bytes], tokens: bytes | None, now: float) -> None:
        """Record session ``name`` in the cluster (from the cluster thread): its namespace, the keys of
        its blocks from block 0 and, for a token chain, its token ids, so another host can find it.

        One record waits per session, the newest (it names the whole chain); at most ``queue``
        sessions and ``RECORDS_BYTES`` of them wait, the oldest dropped first (counted in
        ``session_dropped``), as is a record the cluster could not take."""
        info: dict[str, Any] = {
            "ns": ns.to_dict(),
            "keys": b"".join(keys),
            "tokens": tokens,
            "updated": now,
        }
        with self._unsent_lock:
            idle = not self._records
            old = self._records.pop(name, None)  # the newest goes last
            self._records_bytes -= 0 if old is None else _size(old)
            self._records[name] = info
            self._records_bytes += _size(info)
            dropped = 0
            while len(self._records) > self._records_limit or (
                self._records_bytes > RECORDS_BYTES and len(self._records) > 1
            ):
                self._records_bytes -= _size(self._records.pop(next(iter(self._records))))
                dropped += 1
        if dropped:
            self.cluster.count(session_dropped=dropped)
        if idle:
            self._writer.run_soon(self._write_sessions)

    def _write_sessions(self) -> None:
        """(The cluster thread.) Write the waiting session records, oldest first, until none waits."""
        while True:
            with self._unsent_lock:
                if not self._records:
                    return
                name = next(iter(self._records))
                info = self._records.pop(name)
                self._records_bytes -= _size(info)
            try:
                if not self.cluster.put_session(name, info):  # refused for memory (counted there)
                    self.cluster.count(session_dropped=1)
            except ClusterUnavailable:
                self.cluster.count(session_dropped=1)
            except Exception:  # one record that cannot be written must not stop the others
                log.exception("the record of session %r could not be written to the cluster", name)
                self.cluster.count(session_dropped=1)

    def _write(self, key: bytes) -> None:
        """Write one block: its best local copy, encoded for the cluster, with its record."""
        with self._unsent_lock:  # sent again after a drop: that drop was counted
            counted = frozenset((key,)) if key in self._resent else frozenset()
            self._resent.discard(key)
            # not queued fresh (a write-back, or a stale second entry of the key): written only if
            # no evict has marked it, and an evict's mark is left alone
            fresh = key in self._fresh
            again = not fresh
            self._fresh.discard(key)
            if not fresh and key in self._evicted:  # an operator evicted it since it was queued
                return
        for _ in range(3):  # a demotion may move the copy between finding and reading it
            with self._lock:
                e = self._index.get(key)
                if e is None or e.highest() < 0:
                    return
                t = e.highest()
            try:
                rec = self._record(key)
                frame = self._frame_as_is(t, key, rec)
                if frame is None:
                    frame = self.cluster.codec_for(rec.position).encode(self._tiers[t].get(key))
                break
            except KeyError:
                continue
            except FrameError:  # damaged: the local read path deals with it
                return
            except CodecError as err:  # inf or NaN in the block: the cluster's codec cannot encode it
                self._unencodable(key, err)
                return
            except KVStoreError:  # recordless: the local read path deals with it
                return
        else:
            return
        stored = 0
        try:
            # a block written back: not if an operator evicted it (its mark, checked last thing), and
            # deleted again if an evict marked it while it was being written (the evict's delete may
            # have come first: checked after the write too)
            if again and self.cluster.evicted([key])[0]:
                if key in self._unchecked:  # written back before, and not checked after
                    self.cluster.delete([key])
                self._unchecked.discard(key)
                self._kept_evicted(key)
                return
            stored = self.cluster.store([(key, pack_value(rec, frame))], again=again)
            if again and stored and self.cluster.evicted([key])[0]:
                self.cluster.delete([key])
                self._kept_evicted(key)
                return
            self._unchecked.discard(key)
        except ClusterUnavailable:
            if again and stored and len(self._unchecked) < UNSENT_LIMIT:
                self._unchecked.add(key)
            self._dropped([key], counted, back=again)
            return
        if stored:
            self._set([key])
        else:  # refused for memory (counted in write_refused): sent again with the next put that
            # reaches it, or the blocks after it are lost
            self._dropped([key], counted, count=False, back=again)

    def _frame_as_is(self, t: int, key: bytes, rec: BlockRecord) -> Buffer | None:
        """nvme's frame of ``key`` when tier ``t`` (its best copy) is nvme and the frame goes to the
        cluster as it is: in the cluster's codec for the block (decoding and encoding it again would
        quantize it twice), or the cluster's codec is lossless (the block as it was put is gone: the
        frame holds all that is left of it, in fewer bytes). Else None (encode the block).
        FrameError when the frame is damaged; KeyError when it went meanwhile."""
        nvme = self._tiers.nvme
        if nvme is None or self._tiers[t] is not nvme:
            return None
        frame = nvme.checked_frame(key)  # sound, and this block's: a frame carries no key of its own
        codec = self.cluster.codec_for(rec.position)
        return (
            frame if read_header(frame, verify=False).codec_id == codec.codec_id or codec.lossless else None
        )

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

    def depth(self) -> int:
        return self._writer.depth()

    def drain(self, timeout: float | None = None) -> bool:
        return self._writer.drain(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued for up to ``timeout`` seconds, then stop (the cluster is a copy): what
        is still queued then is dropped and counted (``write_dropped``, ``session_dropped``); the one
        write under way ends within the tier's time-out."""
        self.reads.stop_adopting()  # what was read from the cluster is stored first
        if not self._writer.drain(timeout):
            with self._unsent_lock:
                sessions, self._records, self._records_bytes = len(self._records), {}, 0
            blocks, _ = self._writer.discard()
            self.cluster.count(write_dropped=blocks, session_dropped=sessions)
        self._writer.close(timeout)
        self.reads.close()
        self.cluster.close()

    def _served(self, keys: Sequence[bytes], sessions: Sequence[str]) -> None:
        """Blocks ``keys`` were read from the cluster (GETEX set their TTL anew), the last of them in
        ``sessions``: their records' TTLs are due too."""
        self._set(keys)
        self._touch_records(sessions)

    def status(self) -> dict[str, Any]:
        return {**self.cluster.status(), "queue": self.depth()}


def _size(info: dict[str, Any]) -> int:
    """The bytes a waiting session record holds: its keys and token ids."""
    return len(info["keys"]) + len(info["tokens"] or b"")
