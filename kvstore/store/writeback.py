"""Write-back to nvme: what the writer thread does, and the durable acknowledgement.

::

    write(key)   lock: find the block's best copy, build its record
                 no lock: read + decode it, encode int4, LMDB put        <- the expensive part
                 lock: mark it on nvme; if it was dropped meanwhile, drop the new copy again
    idle()       every tick: expire blocks past the TTL (expiry.py), requeue deferred keys,
                 persist changed session tags / access times into the nvme records, purge lapsed pins
    flush()      requeue deferred keys (with write-through off or admission on second use: every block
                 without an nvme copy, parents first), wait until the queue is empty, fsync: the
                 durable acknowledgement

Keys the queue refused (back-pressure) or whose write failed are *deferred*:
kept, retried at the next tick or flush, and never called durable until written.
A deferred key leaves the set only when it is written (or its block is gone):
one queued again is still deferred while it waits and while it is written, so
that a flush never finds it gone while such a write may still fail. Each carries
the writer's queue number it owes its write to (kvstore.store.writer's marks):
a flush answers for the blocks stored before it, not for those other clients
put while it waits.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

from kvstore.codecs.frame import Buffer, read_header
from kvstore.errors import CodecError, FrameError, KVStoreError
from kvstore.record import BlockRecord
from kvstore.store.expiry import Expiry
from kvstore.store.index import TIER_MASK, Entry
from kvstore.store.movement import PLACE_TRIES, Mover
from kvstore.store.parts import StoreParts
from kvstore.store.writer import WriteThrough
from kvstore.tiers.base import TierFull, TierIOError
from kvstore.tiers.nvme import NvmeTier

log = logging.getLogger(__name__)

_RECORD_BATCH = 4096
_READY = 4096  # frames offered ahead of their write, at most
_READY_BYTES = 256 << 20  # and at most this many bytes of them


def access_slot(ttl: float) -> float:
    """How far a block's access time on disk may lag its last access: it is written when it moves
    to another slot of this many seconds (10 minutes, or a tenth of the TTL when that is shorter),
    not on every read. ``restore`` takes each as the end of its slot: a block used within its TTL
    does not expire after a restart (it may outlive its TTL by up to one slot)."""
    return min(600.0, ttl / 10) if math.isfinite(ttl) else 600.0


class WriteBack:
    """The write-through to nvme, and record upkeep, over one store's index; its ticks run TTL
    expiry (expiry.py).

    ``writer`` is started here with this object's ``write`` and ``idle``. Every
    method takes ``lock`` itself unless its docstring says the caller holds it.
    """

    def __init__(
        self,
        parts: StoreParts,
        mover: Mover,
        nvme: NvmeTier,
        writer: WriteThrough,
        *,
        ttl: float,
        backpressure: float,
        sweep: bool,
    ) -> None:
        """``sweep``: blocks are not all queued as they are stored (write-through off, or admission on
        second use), so ``flush`` writes every block that has no nvme copy yet."""
        self._lock, self._clock, self._tiers, self._index = parts.lock, parts.clock, parts.tiers, parts.index
        self._pins, self._counts = parts.pins, parts.counts
        self._nvme = nvme
        self._t = parts.tiers.last  # nvme is the last tier
        self._mover = mover
        self._writer = writer
        self._expiry = Expiry(
            parts, ttl, pinned=mover.pinned, drop=mover.drop_block, record_changed=self.record_changed
        )
        self._slot = access_slot(ttl)
        self._backpressure = backpressure
        self._sweep = sweep
        self._closed = False
        # keys to write that the queue refused or that failed -> the earliest queue number they owe
        self.deferred: dict[bytes, int] = {}
        self._requeued: set[bytes] = set()  # deferred keys queued again, not yet through ``write``
        # deferred keys nvme had no room for -> its evictions count then: the ticks retry them only
        # once nvme has let go of something since (a flush, always), not with a full encode each tick
        self._roomless: dict[bytes, int] = {}
        self._records_failing = False  # the last update of block records failed (logged once a run)
        self._dirty: set[bytes] = set()  # blocks whose nvme record lags their tags / access time
        self._strays: set[bytes] = set()  # nvme copies of blocks the index dropped, whose delete failed
        self.writing: set[bytes] = set()  # being written: the nvme copy may lead the index a moment
        self._waiting: Counter[bytes] = Counter()  # times queued by ``submit``, not yet taken by ``write``
        self._ready: dict[bytes, Buffer] = {}  # frames in nvme's codec already (from the cluster tier)
        self._ready_bytes = 0
        # puts that indexed new blocks and have not queued them yet (``expect``): flush waits for them
        self._expected = 0
        self._queued = threading.Condition(parts.lock)
        writer.start(self.write, self.idle)

    # -- callers' side ----------------------------------------------------------------
    def expect(self, keys: list[bytes]) -> None:
        """(Lock held.) The caller indexed new blocks (or found blocks ``owed``) under this hold of
        the lock and queues ``keys`` after it (``submit(keys, expected=True)``): a flush meanwhile
        waits for them, or it would call durable blocks that other clients already find and that no
        queue holds yet; and a put meanwhile does not queue them again."""
        self._expected += 1
        self._waiting.update(keys)

    def submit(self, keys: list[bytes], wait: float | None = None, *, expected: bool = False) -> int:
        """Queue keys for write-through (no lock held); those refused are deferred. Returns how many.
        ``expected``: the keys ``expect()`` announced."""
        refused: list[bytes] = []
        if keys and not expected:
            with self._lock:  # before the writer can take them: ``write`` lets each go
                self._waiting.update(keys)
        try:
            if keys:
                refused = self._writer.submit(keys, self._backpressure if wait is None else wait)
        finally:
            with self._lock:
                self._unwait(refused)
                self._owe(refused)
                if expected:
                    self._expected -= 1
                    self._queued.notify_all()
        return len(refused)

    def owed(self, e: Entry) -> bool:
        """(Lock held.) Whether a put that finds ``e`` stored must queue it again: its nvme copy went
        (dropped to make room, or ``evict --tier nvme``) while a copy above stayed, and no write of it
        waits. Without this the put answered ``present`` and a flush ``durable`` with the block on no
        disk."""
        return (
            not e.tiers & (1 << self._t)
            and e.pending is not None
            and e.highest() >= 0
            and e.key not in self.deferred
            and e.key not in self.writing
            and e.key not in self._waiting
        )

    def _unwait(self, keys: list[bytes]) -> None:
        """(Lock held.) One queueing of each of ``keys`` is over (taken by the writer, or refused)."""
        for k in keys:
            if self._waiting[k] > 1:
                self._waiting[k] -= 1
            else:
                self._waiting.pop(k, None)

    def defer(self, keys: list[bytes]) -> None:
        """(Lock held.) Write ``keys`` from the writer's next tick, never on the caller's thread."""
        self._owe(keys)

    def _owe(self, keys: list[bytes], number: int | None = None) -> None:
        """(Lock held.) Defer ``keys``, owed since queue number ``number`` (default: the next one; a
        key deferred already keeps its earlier number)."""
        n = self._writer.mark() + 1 if number is None else number
        for k in keys:
            self.deferred[k] = min(self.deferred.get(k, n), n)

    def offer(self, frames: dict[bytes, Buffer]) -> None:
        """Frames of blocks about to be stored (read from the cluster tier): a block whose frame is in
        the codec nvme would use is written as it is, neither decoded nor encoded again (and never
        quantized twice). At most ``_READY`` are kept, and ``_READY_BYTES``; the oldest go first (then
        they are encoded). None without write-through of every block (``sweep``): nothing would take
        them soon, and a frame of a block the put did not store new would be kept for nothing."""
        if self._sweep:  # blocks are not queued as they are stored: a frame would wait for nothing
            return
        with self._lock:
            for key, frame in frames.items():
                self._ready_bytes += _size(frame) - _size(self._ready.pop(key, b""))
                self._ready[key] = frame
            while len(self._ready) > _READY or self._ready_bytes > _READY_BYTES:
                self._ready_bytes -= _size(self._ready.pop(next(iter(self._ready))))

    def record_changed(self, e: Entry, now: float) -> None:
        """(Lock held.) ``e`` is being touched at ``now``: its nvme record follows at the next idle
        tick when its access time moves to another slot (10 minutes, or a tenth of the TTL)."""
        if e.tiers & (1 << self._t) and int(e.last_access // self._slot) != int(now // self._slot):
            self._dirty.add(e.key)

    def depth(self) -> int:
        return self._writer.depth()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the write-through queue is empty (no sweep, no fsync). False on timeout."""
        return self._writer.drain(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every stored block has reached nvme and LMDB is synced: the durable
        acknowledgement. False when ``timeout`` passed first (nothing is lost; a later flush goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        with self._lock:
            if not self._queued.wait_for(lambda: not self._expected, left()):
                return False
            snapshot = list(self._index.entries()) if self._sweep else []  # a C-level copy: brief
            # blocks whose disk copy went for room: written again now (room may have come back),
            # parents first; with none, the disk holds what it can and flush says so
            held = [e for e in map(self._index.get, self._mover.displaced()) if e is not None]
            again = [e.key for e in sorted(held, key=lambda e: self._mover.position(e) or 0)]
        wait = left()
        self._requeue(None, wait=math.inf if wait is None else wait)
        if snapshot:
            self.submit(self._unwritten(snapshot), wait=math.inf if wait is None else left())
        if again:
            self.submit(again, wait=math.inf if wait is None else left())
        self._writer.run_soon(self.persist_dirty)
        mark = self._writer.mark()  # what was queued by now, and no more: puts go on meanwhile
        if not self._writer.drain(left(), upto=mark):
            return False
        with self._lock:
            if any(n <= mark for n in self.deferred.values()) or self._mover.displaced():
                return False
            if self._records_failing:  # session tags or access times that are not on disk
                return False
        self._nvme.sync()
        return True

    def _unwritten(self, entries: list[Entry]) -> list[bytes]:
        """(No lock.) The blocks among ``entries`` with no nvme copy, parents before children (a flush
        cut short by its timeout leaves no orphan on disk). Read without the lock: ``write`` checks
        each block again under it."""
        bit = 1 << self._t
        order = [e for e in entries if e.parent is None]
        for e in order:  # grows as it goes: breadth first from the roots
            order.extend(e.child_list())
        return [e.key for e in order if not e.tiers & bit]

    def close(self) -> None:
        """Stop writing (what is queued is skipped) and stop the thread. Flush first to keep it."""
        with self._lock:
            self._closed = True
        self._writer.close()

    # -- the writer thread --------------------------------------------------------------
    def write(self, key: bytes) -> None:
        """Write one block through to nvme. Holds no pin: an explicit evict may drop the block
        meanwhile, and then the fresh nvme copy is dropped again."""
        with self._lock:
            self.writing.add(key)  # check_integrity: the nvme copy may lead the index for a moment
            self._unwait([key])
        try:
            self._write(key)
        except Exception:  # whatever it was, the block is not on disk: counted, kept, never called durable
            log.exception("write-through of block %s failed; it stays queued", key.hex()[:16])
            with self._lock:
                self._failed(key)
        finally:
            with self._lock:
                self.writing.discard(key)
                self._queued.notify_all()  # (settle waits for it)
                self._requeued.discard(key)
                if self._settled(key):
                    self.deferred.pop(key, None)
                if key not in self.deferred:
                    self._roomless.pop(key, None)

    def settle(self, keys: Iterable[bytes], timeout: float) -> list[bytes]:
        """Wait (up to ``timeout`` seconds; lock not held) until none of ``keys``, dropped from the
        index, is being written. A write under way commits its nvme copy before it learns of the drop,
        then deletes it again (``_written``): a kill in between would bring the block back at the
        next start. Returns those whose nvme copy may be there still: being written at the timeout,
        or kept to delete again (the disk refused; tried each tick)."""
        want = set(keys)
        with self._queued:
            self._queued.wait_for(lambda: not want & self.writing, timeout)
            return [k for k in want if k in self.writing or k in self._strays]

    def _settled(self, key: bytes) -> bool:
        """(Lock held.) Nothing is owed of ``key``: written, gone, or with nothing to write it from."""
        e = self._index.get(key)
        return e is None or bool(e.tiers & (1 << self._t)) or e.pending is None or self._closed

    def _write(self, key: bytes) -> None:
        t_n, nvme = self._t, self._nvme
        with self._lock:
            frame = self._ready.pop(key, None)
            if frame is not None:
                self._ready_bytes -= _size(frame)
        if frame is not None and self._write_frame(key, frame):
            return
        block = None
        for _ in range(3):  # a demotion may move the copy between finding and reading it
            with self._lock:
                e = self._index.get(key)
                if e is None or e.tiers & (1 << t_n) or self._closed or e.highest() < 0:
                    return
                t = e.highest()
                try:
                    rec = self._mover.record(e)
                except KVStoreError:
                    return
            try:
                block = self._tiers[t].get(key)
                break
            except KeyError:
                continue
            except FrameError:
                with self._lock:
                    self._mover.corrupt(e, t)
                return
        if block is None:  # moved under every try: not written now, not forgotten either
            with self._lock:
                self._failed(key)
            return
        for _ in range(PLACE_TRIES):
            try:
                nvme.put(key, block, rec)
                break
            except TierFull:  # room is made as the estimate says, and one more block goes (Mover.place)
                with self._lock:
                    # the block itself is as good as pinned meanwhile: room for it is never made by
                    # dropping one of its ancestors (with it, all below)
                    self._mover.busy.add(key)
                    try:
                        room = self._mover.make_room(
                            t_n, block, position=rec.position
                        ) and self._mover.push_out_one(t_n, key)
                    finally:
                        self._mover.busy.discard(key)
                    if not room:
                        self._no_room(key, ever=nvme.could_hold(block, rec.position))
                        return
            except CodecError as err:  # inf or NaN in the block: it never reaches the disk
                with self._lock:
                    self._unwritable(key, err)
                return
            except TierIOError as err:  # a disk error
                with self._lock:
                    self._mover.disk_refused(key, err)
                    self._failed(key)
                return
            except KVStoreError:  # a record that cannot be stored, ...
                with self._lock:
                    self._failed(key)
                return
        else:
            with self._lock:
                self._no_room(key)
            return
        self._written(key, rec)

    def _write_frame(self, key: bytes, frame: Buffer) -> bool:
        """Store ``frame`` on nvme as it is when it is in the codec nvme picks for the block. False: it
        was not (another codec, no room, an error): the caller writes the block the usual way."""
        nvme = self._nvme
        with self._lock:
            e = self._index.get(key)
            if e is None or e.tiers & (1 << self._t) or self._closed:
                return True  # nothing to write
            try:
                rec = self._mover.record(e)
            except KVStoreError:
                return True
        try:
            if read_header(frame, verify=False).codec_id != nvme.codec_for(rec.position).codec_id:
                return False
            nvme.put_frame(key, frame, rec)
        except (FrameError, TierFull, TierIOError, KVStoreError):
            return False
        self._written(key, rec)
        return True

    def _written(self, key: bytes, rec: BlockRecord) -> None:
        """``key`` is on nvme now (``rec`` its record): tell the index, unless it went meanwhile."""
        t_n, nvme = self._t, self._nvme
        with self._lock:
            self._mover.disk_took()
            now = self._index.get(key)
            if now is None or not now.tiers & TIER_MASK:
                self._drop_stray(key)  # dropped while it was being written: do not resurrect it
                return
            if not now.tiers & (1 << t_n) and key not in nvme:
                # its nvme copy was written (a demotion) and dropped again meanwhile: not on nvme
                self._failed(key)
                return
            self._index.set_tier(now, t_n)
            now.pending = None
            self._counts.written += 1
            if now.sessions != rec.sessions or now.last_access != rec.last_access:
                self._dirty.add(key)

    def _drop_stray(self, key: bytes) -> None:
        """(Lock held.) Delete nvme's copy of ``key``, a block the index dropped; when the disk refuses,
        kept and tried again each tick: it would take room no eviction frees, and be read back as a
        block at the next start (an evicted block back)."""
        try:
            self._nvme.drop(key)
        except KVStoreError as e:
            if not self._strays:
                log.warning(
                    "nvme could not delete block %s the store dropped (%s); retrying", key.hex()[:16], e
                )
            self._strays.add(key)
        else:
            self._strays.discard(key)

    def _drop_strays(self) -> None:
        with self._lock:
            for k in list(self._strays):
                e = self._index.get(k)
                if e is not None and e.tiers & (1 << self._t):  # stored and written again meanwhile
                    self._strays.discard(k)
                elif k not in self.writing:  # (being written: _written decides)
                    self._drop_stray(k)

    def _requeue(self, most: int | None, *, wait: float) -> None:
        """Queue (up to ``most`` of) the deferred keys that are not queued already; they stay deferred
        until written."""
        with self._lock:
            drops = self._drops()
            # those nvme had no room for wait for a drop (not requeued): the ones gone meanwhile (an
            # evict, their TTL) are owed no more, and must not keep the next no-room from being logged
            idle = [k for k in self._roomless if k not in self.writing and k not in self._requeued]
            for k in [k for k in idle if self._settled(k)]:
                self.deferred.pop(k, None)
                self._roomless.pop(k)
            keys = [
                k
                for k in self.deferred
                if k not in self._requeued and (most is None or self._roomless.get(k, -1) != drops)
            ][:most]
            self._requeued.update(keys)
        refused = self._writer.submit(keys, wait) if keys else []
        if refused:
            with self._lock:
                self._requeued.difference_update(refused)

    def _failed(self, key: bytes) -> None:
        """(Lock held.) ``key`` did not reach nvme (full disk, I/O error): counted, and kept among the
        deferred keys, retried at the next tick or flush, so that flush does not call it durable."""
        self._counts.write_failures += 1
        if key in self._index:
            self._owe([key], self._writer.running)

    def unwritten(self) -> int:
        """The blocks a flush would find not on nvme: deferred, or whose disk copy went for room."""
        with self._lock:
            return len(self.deferred.keys() | self._mover.displaced())

    def _no_room(self, key: bytes, *, ever: bool = True) -> None:
        """(Lock held.) nvme could not make room for ``key`` (full of pinned blocks or of blocks it
        keeps, or, not ``ever``, smaller than the block's frame): failed, and not tried again until
        nvme lets go of a block (or a flush asks). The first of a run is logged."""
        self._failed(key)
        if key not in self.deferred:
            return
        if not self._roomless:
            usage = self._nvme.usage()
            why = (
                f"{usage.used_bytes} of {usage.capacity_bytes} bytes are used, by blocks it keeps"
                if ever
                else f"its frame is larger than an empty nvme of {usage.capacity_bytes} bytes holds"
            )
            log.warning(
                "nvme has no room for block %s (%s): it stays in memory only, and a flush is not "
                "durable, until nvme has room; raise [nvme] capacity to keep every block on disk. "
                "Later ones are not logged",
                key.hex()[:16],
                why,
            )
        self._roomless[key] = self._drops()

    def _drops(self) -> int:
        """(Lock held.) How many blocks (or copies) nvme has let go of so far."""
        return self._mover.counters[self._t].evictions

    def _unwritable(self, key: bytes, err: CodecError) -> None:
        """(Lock held.) nvme's codec refuses block ``key`` (inf or NaN in it). Write-through promises
        that every block stored reaches the disk, and flush says so: the block (and what follows
        it, computed over it) is dropped, as a demotion would drop it, once nothing pins it; pinned,
        it stays deferred (flush not durable) until then."""
        e = self._index.get(key)
        if e is None:
            return
        self._mover.refused(e, self._t, err)
        if self._mover.subtree_pinned(e):
            self._owe([key], self._writer.running)
            return
        self.deferred.pop(key, None)
        self._mover.drop_block(e)

    def idle(self) -> None:
        """Periodic upkeep on the writer thread; pins lapse whatever the disk does."""
        try:
            self._expiry.expire()
            self._drop_strays()
            self._requeue(1024, wait=0.0)
            self.persist_dirty()
        finally:
            with self._lock:
                self._pins.purge()

    def persist_dirty(self) -> None:
        """Write changed session tags and access times into the blocks' nvme records."""
        t_n, nvme = self._t, self._nvme
        while True:
            with self._lock:
                keys = [self._dirty.pop() for _ in range(min(len(self._dirty), _RECORD_BATCH))]
                items = []
                for k in keys:
                    e = self._index.get(k)
                    if e is not None and e.tiers & (1 << t_n):
                        items.append((k, e.sessions, e.last_access))
            if not keys:  # every change is on disk, or its block left nvme: none is owed
                with self._lock:
                    self._records_failing = False
                return
            records = []
            for k, sessions, accessed in items:
                try:
                    rec = nvme.record(k)
                except (KeyError, FrameError):
                    continue
                records.append(replace(rec, sessions=sessions, last_access=accessed))
            if records:
                try:
                    nvme.update_records(records)
                except (TierFull, TierIOError) as err:
                    with self._lock:  # written again next time: an access time lost would expire
                        self._dirty.update(k for k, _, _ in items)  # the block early after a restart
                        if not self._records_failing:
                            log.warning(
                                "nvme refused the records of %d blocks (their session tags and access "
                                "times): %s; retried every tick, a flush is not durable meanwhile",
                                len(records),
                                err,
                            )
                        self._records_failing = True
                    return
                with self._lock:
                    if self._records_failing:
                        log.warning("nvme takes block records again")
                    self._records_failing = False


def _size(frame: Buffer) -> int:
    return memoryview(frame).nbytes
