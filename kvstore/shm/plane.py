"""The daemon's side of the same-host data plane: shared pools, staging, and the leases on them.

::

    SharedPlane ─┬─ pools.memory("hbm"|"ram") arenas + page generations in segments (pools.py)
                 ├─ a staging segment per client (a socket identity), made on its first need:
                 │     ranges leased to one request each
                 │       reserve -> client writes K/V -> commit (a put)
                 │       locate  -> daemon decodes nvme blocks -> client copies -> finish
                 └─ offer()                    what a hello reply tells a same-host client to map

Staging is per client so that no client can ever write into a range another
client's commit reads: a range that lapsed goes back to the same client only.
A lease ends at ``take`` or when it lapses, so a client that dies between
reserve and commit, or in the middle of a get, leaks nothing: ``sweep`` (run
by every staging call and by ``stats``) takes back what lapsed, and removes
the staging segment of a client that holds no lease and has been idle for
IDLE seconds (a later request makes a new one), or after PRESSED_IDLE, least
recently used first, when a new client's segment would not fit otherwise: its memory is freed
as it is removed, so a client that still maps it holds no pages of it (and reads
zeros there). Each client's segment is ``per_client`` bytes (rounded down to whole
pages: every range takes whole pages); all of them together stay within
``staging_bytes``.

The offer is made on x86_64 only (``offered``): a client's generation check
after a copy relies on x86's memory order (see kvstore.shm.mapping), and
Python has no portable fence to give it elsewhere. On other machines the
daemon's clients use the socket.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
import platform
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstore.errors import KVStoreError
from kvstore.shm.pools import SharedPools
from kvstore.shm.segment import ALIGN, NoRoom, Segment, private_dir, sweep
from kvstore.wire.errors import ProtocolError

log = logging.getLogger("kvstore.shm")

IDLE = 60.0  # seconds a client's unused staging segment is kept
# ... or, when a new client's segment would not fit the budget otherwise, this many: a client that
# closed (it tells nothing) does not keep a new one on the socket for a minute, and live clients
# between two calls do not take each other's segments (each would make its own again, and map it)
PRESSED_IDLE = 5.0
MIN_RESERVE_LEASE = 1.0  # a put's reservation lasts at least this long, whatever the pin lease
MAX_LEASES_PER_CLIENT = 64  # live leases one client holds at once (a client pipelines two or three)
MAX_LEASES = 4096  # live leases of all clients: each holds pins, and a sweep looks at the lapsed ones
ORDERED_MACHINES = frozenset({"x86_64", "amd64"})  # loads are not reordered with older loads (TSO)


class StagingFull(KVStoreError):
    """No staging room for this client now (all clients' segments are made, or its own ranges are
    held): nothing was done; the client uses the socket for this request."""

    code = "no_staging"


@dataclass
class Lease:
    """One request's hold: a staging range (``nbytes`` may be 0) and what else it keeps (``held``)."""

    handle: int
    peer: bytes
    offset: int
    nbytes: int
    expires: float
    held: Any = None  # a get's located blocks (kvstore.store.reads.Located)
    staging: Segment | None = None  # the client's staging segment the range is in
    readers: int = 0  # the daemon reading the range now (``hold`` or ``reading`` .. ``done_reading``)
    ended: bool = False  # taken or lapsed while read: given back when the last reader is done
    copied: threading.Event = field(default_factory=threading.Event)  # set when taken or lapsed


@dataclass
class _Staging:
    """One client's staging segment, its ranges and its leases."""

    segment: Segment
    tensor: torch.Tensor
    ranges: RangeAllocator
    leases: int = 0
    last_used: float = 0.0


class RangeAllocator:
    """First-fit byte ranges of a segment, ALIGN-aligned. Not thread-safe (the plane locks)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size else []  # (offset, length), sorted
        self.used = 0

    def alloc(self, nbytes: int) -> int | None:
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                self.used += need
                return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        self.used -= need
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, need))
        # merge with the neighbours
        if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
            self._free[i] = (offset, self._free[i][1] + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]


@dataclass
class SharedPlane:
    """Segments for the pools and a staging area in ``directory``; leases on staging and reads."""

    directory: Path
    staging_bytes: int
    per_client: int
    lease: float
    clock: Callable[[], float] = time.monotonic
    instance: str = field(default_factory=lambda: secrets.token_hex(16))

    def __post_init__(self) -> None:
        whole = max(ALIGN, self.per_client // ALIGN * ALIGN)
        if whole != self.per_client:
            log.info(
                "[server] shm_staging_per_client rounded down to %d bytes (whole %d-byte pages)", whole, ALIGN
            )
            self.per_client = whole
        machine = platform.machine()
        self.offered = machine.lower() in ORDERED_MACHINES
        if not self.offered:
            log.warning(
                "shared memory is not offered to clients on %s (only x86_64): a client's check that a "
                "block was not reused while it copied needs x86's memory order; clients use the socket",
                machine or "this machine",
            )
        private_dir(self.directory)
        gone = sweep(self.directory)
        if gone:
            log.info("removed %d shared-memory segment(s) left by a daemon that is gone", gone)
        self.pools = SharedPools(self.directory)
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._per_peer: dict[bytes, int] = {}  # live leases by client
        self._clock_heap: list[tuple[float, int]] = []  # (expires, handle) as set; stale rows skipped
        self._clients: dict[bytes, _Staging] = {}
        self._making: dict[bytes, threading.Event] = {}  # staging segments made now, outside the lock
        self._closed = False
        self.lapsed = 0  # leases taken back because they ran out

    # -- pools ------------------------------------------------------------------------
    def offer(self) -> dict[str, Any] | None:
        """What a hello reply tells a same-host client: the segments to map and how to read them
        (``pools.segments``); None where none is offered (not ``offered``: not x86_64)."""
        if not self.offered:
            return None
        return {
            "instance": self.instance,
            "segments": self.pools.segments(),
            "per_client": self.per_client,
            "lease": self.lease,
        }

    # -- leases -----------------------------------------------------------------------
    def reserve(
        self, peer: bytes, nbytes: int, lease: float | None = None, held: Any = None, *, armed: bool = True
    ) -> Lease:
        """A staging range of ``nbytes`` (0: none, a lease only) in ``peer``'s staging segment.
        StagingFull when there is no room now; ProtocolError (invalid_argument) when it could never
        fit. ``armed=False``: the lease does not run until ``arm`` (the daemon fills the range first)."""
        if nbytes > self.per_client:
            raise ProtocolError(
                "invalid_argument",
                f"{nbytes} bytes of staging asked for; a client may hold {self.per_client} "
                "([server] shm_staging_per_client): reserve less at a time",
            )
        if nbytes:
            self._make_staging(peer)
        now = self.clock()
        with self._lock:
            self._sweep(now)
            mine = self._admit(peer)
            offset, staging = 0, None
            if nbytes:
                staging = self._client(peer, now)
                got = staging.ranges.alloc(nbytes)
                if got is None:
                    raise StagingFull(
                        f"no staging room for {nbytes} bytes now: this client's requests hold "
                        f"{staging.ranges.used} of its {self.per_client}; retry shortly"
                    )
                offset = got
                staging.leases += 1
            lease_s = self.lease if lease is None else min(lease, self.lease)
            if held is None:
                lease_s = max(lease_s, MIN_RESERVE_LEASE)
            got_lease = Lease(
                secrets.randbits(63), peer, offset, nbytes, now + lease_s if armed else math.inf, held, None
            )
            if staging is not None:
                got_lease.staging = staging.segment
            self._keep(got_lease, mine)
            return got_lease

    def try_lease(self, peer: bytes, held: Any, admit: Callable[[], bool] = lambda: True) -> Lease | None:
        """``reserve(peer, 0, held=held)`` if the plane's lock is free this instant, ``peer`` is within
        its lease bounds and ``admit()`` (the caller's own check, made under the lock once the bounds
        are met; it must not wait) says yes; else None, nothing taken. No sweep: for the daemon's
        event loop, which must not wait on another thread's work under the lock, nor do a sweep's (a
        staging segment removed is unmapped and its memory freed)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            mine = self._per_peer.get(peer, 0)
            if mine >= MAX_LEASES_PER_CLIENT or len(self._leases) >= MAX_LEASES or not admit():
                return None
            got = Lease(secrets.randbits(63), peer, 0, 0, self.clock() + self.lease, held, None)
            self._keep(got, mine)
            return got
        finally:
            self._lock.release()

    def _keep(self, lease: Lease, mine: int) -> None:
        """(Lock held.) Hold ``lease``, ``peer``'s ``mine + 1``-th; its clock runs if it is armed."""
        self._leases[lease.handle] = lease
        self._per_peer[lease.peer] = mine + 1
        if lease.expires != math.inf:
            heapq.heappush(self._clock_heap, (lease.expires, lease.handle))

    def admit(self, peer: bytes) -> None:
        """ProtocolError (too_many_leases) when ``peer`` may take no lease now: checked before a
        locate pins anything."""
        with self._lock:
            self._sweep(self.clock())
            self._admit(peer)

    def _admit(self, peer: bytes) -> int:
        """The leases ``peer`` holds (lock held); ProtocolError (too_many_leases) at a bound."""
        mine = self._per_peer.get(peer, 0)
        if mine >= MAX_LEASES_PER_CLIENT or len(self._leases) >= MAX_LEASES:
            raise ProtocolError(
                "too_many_leases",
                f"this client holds {mine} shared-memory leases (at most {MAX_LEASES_PER_CLIENT}; "
                f"{MAX_LEASES} for all clients): finish the requests it located or reserved; "
                "meanwhile use get and put",
            )
        return mine

    def _make_staging(self, peer: bytes) -> None:
        """Make ``peer``'s staging segment if it has none, outside the lock: making one makes its pages
        (huge ones may wait for the kernel to compact memory), and every client's lease, take and
        sweep waits on the lock. Another request of ``peer`` meanwhile waits for that segment.
        StagingFull as ``_client``."""
        with self._lock:
            self._sweep(self.clock())  # idle segments go first: they count against the budget
            if peer in self._clients or self._closed:
                return
            making = self._making.get(peer)
            if making is None:
                self._check_room()
                making = self._making[peer] = threading.Event()
                ours = True
            else:
                ours = False
        if not ours:
            making.wait()  # set once that segment is made or failed (then _client says why)
            return
        seg: Segment | None = None
        try:
            seg = self._new_staging()
        finally:
            with self._lock:
                del self._making[peer]
                if seg is not None and (self._closed or peer in self._clients):
                    seg.close(free=True)  # (or another request of peer's made one meanwhile: _client)
                elif seg is not None:
                    self._clients[peer] = _Staging(
                        seg,
                        torch.from_numpy(seg.array(0, self.per_client)),
                        RangeAllocator(self.per_client),
                        last_used=self.clock(),
                    )
            making.set()

    def _check_room(self) -> None:
        """(Lock held.) Room for one more client's segment within ``staging_bytes``: the least recently
        used segment no lease has held for PRESSED_IDLE seconds goes now if need be; else StagingFull."""
        held = len(self._clients) + len(self._making)
        if (held + 1) * self.per_client > self.staging_bytes:
            now = self.clock()
            idle = [
                (s.last_used, peer)
                for peer, s in self._clients.items()
                if s.leases == 0 and now - s.last_used > PRESSED_IDLE
            ]
            if idle:
                self._drop_staging(min(idle)[1])
                return
            raise StagingFull(
                f"{held} clients hold staging segments of {self.per_client} bytes, all "
                f"[server] shm_staging ({self.staging_bytes}) allows; retry shortly"
            )

    def _new_staging(self) -> Segment:
        try:
            return Segment.create(self.directory, "staging", self.per_client)
        except (NoRoom, OSError) as e:  # the filesystem is full now: this request uses the socket
            raise StagingFull(f"no staging segment can be made now ({e}); retry shortly") from None

    def _client(self, peer: bytes, now: float) -> _Staging:
        """``peer``'s staging segment (lock held): made by ``_make_staging`` before the lock was taken,
        else (it failed, or went meanwhile) made now. StagingFull when all the clients' segments
        together would pass ``staging_bytes``."""
        staging = self._clients.get(peer)
        if staging is None:
            if self._closed:
                raise StagingFull("the daemon is stopping; no staging now")
            self._check_room()
            seg = self._new_staging()
            staging = _Staging(
                seg, torch.from_numpy(seg.array(0, self.per_client)), RangeAllocator(self.per_client)
            )
            self._clients[peer] = staging
        staging.last_used = now
        return staging

    def take(self, handle: int, peer: bytes | None = None) -> Lease | None:
        """End the lease ``handle`` and give back its staging; None when unknown, lapsed or another
        client's (``peer``: the client asking; None: the daemon itself).

        A range a commit reads now (``hold``) is given back when that commit is done
        (``done_reading``), not before: a client's finish can overtake its own commit (one that gave
        up waiting for the answer), and the range must not go to the client's next reserve while
        the daemon still copies blocks out of it."""
        now = self.clock()
        with self._lock:
            self._sweep(now)
            lease = self._leases.get(handle)
            if lease is None or lease.ended or (peer is not None and lease.peer != peer):
                return None
            lease.copied.set()
            if lease.readers:  # ended, not lapsed: given back by the last reader (the sweep skips it)
                lease.ended, lease.expires = True, math.inf
            else:
                self._end(lease)
            return lease

    def hold(self, handle: int, peer: bytes | None = None) -> Lease | None:
        """The live reservation ``handle`` for a commit to read: kept from lapsing and from being given
        back until ``done_reading``; None when unknown, lapsed, taken or another client's (``peer``).
        ProtocolError (invalid_argument) for a read's lease (a locate's), left as it was: its clock
        runs on (a commit naming it must not keep its blocks pinned past their lease)."""
        now = self.clock()
        with self._lock:
            self._sweep(now)
            lease = self._leases.get(handle)
            if lease is None or lease.ended or (peer is not None and lease.peer != peer):
                return None
            if lease.held is not None:
                raise ProtocolError(
                    "invalid_argument",
                    "commit: the handle is a locate's (a read's), not a reservation; nothing was stored "
                    "and the read is left as it was. Commit with the handle reserve returned",
                )
            lease.expires = math.inf
            lease.readers += 1
            return lease

    def reading(self, lease: Lease) -> None:
        """The daemon reads ``lease``'s range after its reply (a get's blocks from the cluster, stored
        here from the client's staging): the range is not given back, not even when the lease is
        taken or lapses, until ``done_reading``. The lease's clock is left as it is."""
        with self._lock:
            lease.readers += 1

    def done_reading(self, lease: Lease, *, keep: bool) -> None:
        """The daemon is done with ``lease``'s range: kept (``keep``; a commit's range for the client's
        next chunk has its clock started again) or given back (not ``keep``, or taken or lapsed
        meanwhile)."""
        with self._lock:
            lease.readers -= 1
            if lease.readers:
                return
            if keep and not lease.ended:
                if lease.expires == math.inf:  # held by a commit (or not armed yet)
                    self._start_clock(lease, None)
            elif self._leases.get(lease.handle) is lease:
                self._end(lease)

    def arm(self, lease: Lease, seconds: float | None = None) -> None:
        """Start ``lease``'s clock now (one taken with ``reserve(..., armed=False)``)."""
        with self._lock:
            self._start_clock(lease, seconds)

    def _start_clock(self, lease: Lease, seconds: float | None) -> None:
        span = self.lease if seconds is None else min(seconds, self.lease)
        if lease.held is None:  # a put's reservation
            span = max(span, MIN_RESERVE_LEASE)
        lease.expires = self.clock() + span
        heapq.heappush(self._clock_heap, (lease.expires, lease.handle))

    def staging_tensor(self, lease: Lease) -> torch.Tensor:
        """The lease's staging range as uint8 (empty for a lease without one)."""
        staging = self._clients.get(lease.peer)
        if staging is None or staging.segment is not lease.staging:
            return torch.empty(0, dtype=torch.uint8)
        return staging.tensor[lease.offset : lease.offset + lease.nbytes]

    def sweep(self) -> int:
        with self._lock:
            return self._sweep(self.clock())

    def _sweep(self, now: float) -> int:
        """Take back the leases that ran out (the clock heap's due rows: a row whose lease ended or
        whose clock was set again since is stale and skipped) and remove idle staging segments."""
        heap, lapsed = self._clock_heap, 0
        while heap and heap[0][0] <= now:
            expires, handle = heapq.heappop(heap)
            lease = self._leases.get(handle)
            if lease is None or lease.expires != expires:
                continue
            lapsed += 1
            lease.copied.set()
            if lease.readers:  # the daemon still reads its range: given back when it is done
                lease.ended, lease.expires = True, math.inf
                continue
            self._end(lease)
        self.lapsed += lapsed
        for peer, staging in list(self._clients.items()):
            if staging.leases == 0 and now - staging.last_used > IDLE:
                self._drop_staging(peer)
        return lapsed

    def _drop_staging(self, peer: bytes) -> None:
        """(Lock held.) Remove ``peer``'s staging segment, which no lease holds; its next request makes
        another."""
        staging = self._clients.pop(peer)
        staging.tensor = torch.empty(0, dtype=torch.uint8)
        # freed, not only removed: the client keeps its mapping (it is not told), and with it the
        # segment's memory, for as long as it lives
        staging.segment.close(free=True)

    def _end(self, lease: Lease) -> None:
        """Forget ``lease`` (lock held) and give its range back."""
        del self._leases[lease.handle]
        left = self._per_peer.get(lease.peer, 1) - 1
        if left > 0:
            self._per_peer[lease.peer] = left
        else:
            self._per_peer.pop(lease.peer, None)
        self._give_back(lease)

    def _give_back(self, lease: Lease) -> None:
        staging = self._clients.get(lease.peer)
        if lease.nbytes and staging is not None and staging.segment is lease.staging:
            staging.ranges.free(lease.offset, lease.nbytes)
            staging.leases -= 1
            staging.last_used = self.clock()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._sweep(self.clock())
            staging = list(self._clients.values())
            return {
                "directory": str(self.directory),
                "segments": [
                    *self.pools.paths(),
                    *(str(c.segment.path) for c in staging),
                ],
                "staging_bytes": self.staging_bytes,
                "staging_clients": len(staging),
                "staging_used": sum(c.ranges.used for c in staging),
                "leases": len(self._leases),
                "lapsed": self.lapsed,
            }

    def close(self, *, free: bool = True) -> None:
        """Remove the segments, and with ``free`` give their memory back now, whoever maps them.

        Every page's generation moves first: a client still copying (a get located just before the
        stop) reads its blocks as missing. A GPU arena is freed with this process while clients
        still hold its IPC handle, and what they would copy from it then is anyone's. Host segments
        are removed, then freed (read as zeros in clients' mappings: no generation is 0), so that an
        idle client's mapping does not hold a pool's memory past the stop, where the next daemon
        needs it (a host's page-locked mapping, on a GPU host, holds it until the client lets go).
        Not ``free`` where the tiers may still read the pools (their close failed): a block encoded
        from freed memory would be zeros."""
        self.pools.retire()
        with self._lock:
            self._closed = True  # a staging segment made meanwhile is removed as it is done
            for c in self._clients.values():
                c.tensor = torch.empty(0, dtype=torch.uint8)
                c.segment.close(free=True)
            self._clients.clear()
        self.pools.close(free=free)
