"""Blocks read from the cluster tier on a local miss, for the store (its link: cluster.py).

::

    lookup   local walk ends at block i --> leading(keys i..)     one pipelined EXISTS round trip
    get      local blocks read --> fill(): read(keys i.., outs)   pipelined GETEX in batches of 8, the
             next batch fetched while this one is checked, each value received into its block's place
             where that is host memory (a same-host client's staging) and checked there (a raw frame)
             or joined and decoded; then what came is put here (hbm; nvme gets the frames as they
             are), for the daemon after its client has copied them (adoption.py)

A value that fails a check is deleted from the cluster and ends the read; one that failed where it
landed (memory a same-host client maps) is read again into the daemon's own memory, which decides.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice, takewhile
from typing import Any

import torch

from kvstore.chains import Chain, KeyChain
from kvstore.codecs import decode_frame, decode_placed
from kvstore.errors import FrameError, UnsupportedVersion
from kvstore.keys import Namespace
from kvstore.record import BlockRecord
from kvstore.results import PutResult, StoreClosed
from kvstore.store.adoption import ADOPT_WAIT, Adopter, Adoption
from kvstore.store.counts import StoreCounts
from kvstore.tiers.cluster import ClusterTier, ClusterUnavailable
from kvstore.tiers.cluster_format import unpack_value
from kvstore.tiers.cluster_values import Received

log = logging.getLogger(__name__)

FETCH_BATCH = 8  # blocks per pipelined GETEX: bounds the memory one read holds in flight
FETCHERS = 4  # reads fetching their next batch at once
LOOKUP_LIMIT = 4096  # blocks one lookup asks the cluster about at most


class ClusterReads:
    """Reads from ``cluster`` for the store: lookups past the local tiers, and gets whose blocks are
    then stored here."""

    def __init__(
        self,
        cluster: ClusterTier,
        lock: threading.RLock,
        counts: StoreCounts,
        put: Callable[..., PutResult],
        offer: Callable[[dict[bytes, Any]], None] | None,
        served: Callable[[Sequence[bytes], Sequence[str]], None],
    ) -> None:
        """``put``: the store's put (``_adopted=True``); ``offer``: frames nvme may store as they are
        (WriteBack.offer; None without nvme); ``served(keys, sessions)``: blocks read, and the sessions
        the last of them names (their TTLs were set anew; the records' are due)."""
        self.cluster = cluster
        self._unreadable_logged = False  # a block of a later build's format was read (said once)
        self._lock, self._counts = lock, counts
        self._put, self._offer, self._served = put, offer, served
        # a read's next batch is fetched on one of these while the read decodes the last: one slow read
        # holds one, the others go on
        self._pool = ThreadPoolExecutor(FETCHERS, thread_name_prefix="kvstore-cluster-fetch")
        self._decoders = ThreadPoolExecutor(2, thread_name_prefix="kvstore-cluster-decode")
        self._adopter = Adopter()

    def stop_adopting(self) -> None:
        """Store what was read and waits to be; nothing read after this is stored here."""
        self._adopter.close()

    def close(self) -> None:
        """Stop the fetchers and decoders (after ``stop_adopting``)."""
        self._pool.shutdown(wait=True)
        self._decoders.shutdown(wait=True)

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (the blocks after the local ones) the cluster holds, from the first."""
        return self.cluster.leading(keys[:LOOKUP_LIMIT])

    def read(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        parents: tuple[bytes, ...] | None,
        outs: Sequence[torch.Tensor],
        frames: dict[bytes, Any] | None = None,
    ) -> int:
        """Fetch blocks ``keys`` from the cluster into ``outs`` (one ``[L, 2, T, H, D]`` tensor each),
        stopping at the first absent or damaged one; returns how many were written.

        The first block's record must name one of ``parents`` as its parent (the key before it, or the
        namespace root); each later one the key before it. ``parents`` None: no record is held to a
        parent (an engine's page key names its page whatever it was stored after). A value that fails a check (its key,
        record, namespace, parent, CRC or layout) is deleted from the cluster and ends the read.
        ``frames`` (if given) receives each served block's frame, by key (for nvme: WriteBack.offer).
        Counted per block: ``hits`` those served, ``misses`` the others asked for. ``outs`` past the
        count may have been written (values are received straight into their places).

        A value received into its place is checked there, in memory others may write (a same-host
        client maps its staging; two ``outs`` may overlap): one that fails the check there is read
        again into the daemon's own memory, and that copy decides whether it is damaged.
        """
        codecs = self.cluster.codecs()
        want = min(len(keys), len(outs))
        batches = [range(b0, min(b0 + FETCH_BATCH, want)) for b0 in range(0, want, FETCH_BATCH)]

        # each value's last block_nbytes go straight into its block's place (where that is host memory
        # laid out as the block): a raw frame's payload is then the block itself, checked and not copied
        tails = _receivable(outs[:want])

        def decode(j: int, value: bytes | memoryview) -> tuple[Any, tuple[str, ...]]:
            rec, frame = _unpack(
                keys[j], value, ns.id, parents if parents is None or j == 0 else (keys[j - 1],)
            )
            decode_frame(frame, layout=ns.layout, out=outs[j], codecs=codecs)
            return frame, rec.sessions

        def check_decode(j: int, value: bytes | memoryview | Received) -> tuple[Any, tuple[str, ...]]:
            """Block ``j``: checked against its key, namespace and parent, decoded into ``outs[j]``;
            its frame (None: it was received in place, and is not kept) and the sessions its record
            names. FrameError: damaged; _Landed: failed where it was received (see ``again``)."""
            if not isinstance(value, Received):
                return decode(j, value)
            try:
                try:
                    rec, head = _unpack(
                        keys[j], value.head, ns.id, parents if parents is None or j == 0 else (keys[j - 1],)
                    )
                except FrameError:  # cut inside the record, or damaged: the whole value says which
                    rec = None
                if rec is not None and decode_placed(head, value.tail, layout=ns.layout):
                    return None, rec.sessions
                return decode(j, value.joined())
            except FrameError as err:
                raise _Landed(j) from err

        def again(j: int) -> tuple[Any, tuple[str, ...]]:
            """Block ``j`` failed its check where it was received, in memory others may write (a
            same-host client maps its staging): read again into the daemon's own memory (on the read's
            thread: the decoders do no I/O), that copy decides. _Doubted when it cannot be had."""
            try:
                own = self.cluster.peek([keys[j]])[0]
            except ClusterUnavailable:
                own = None
            if own is None:
                raise _Doubted(keys[j])
            return decode(j, own)

        # the next batch is fetched while this one is checked and decoded, two blocks at a time: the
        # round trip hides behind the codec work, which runs outside the GIL for the most part
        # A read takes about one time-out at most: a node slow enough to answer each batch just within
        # it never marks the cluster down, so no batch is asked for once the time-out has passed
        # since the read began (what came is served, the rest is a miss).
        fetch = self._pool.submit
        deadline = time.monotonic() + self.cluster.timeout
        ahead = (
            fetch(self.cluster.fetch, [keys[j] for j in batches[0]], tails[:FETCH_BATCH]) if batches else None
        )
        n = 0
        last: tuple[str, ...] = ()  # the sessions the last block served names
        work: list[Future[tuple[Any, tuple[str, ...]]]] = []  # this batch's checks, as submitted
        try:
            for i, batch in enumerate(batches):
                if ahead is None:
                    return n
                try:
                    values = ahead.result()
                except ClusterUnavailable:
                    return n
                late = time.monotonic() > deadline
                nxt = batches[i + 1] if i + 1 < len(batches) and not late else None
                ahead = (
                    fetch(self.cluster.fetch, [keys[j] for j in nxt], tails[nxt.start : nxt.stop])
                    if nxt
                    else None
                )
                present = [
                    v for v in takewhile(lambda v: v is not None, values) if v is not None
                ]  # to a miss
                held = len(present)
                work = []
                for j, v in zip(batch, present, strict=False):
                    work.append(self._decoders.submit(check_decode, j, v))
                for j, job in zip(batch, work, strict=False):
                    try:
                        try:
                            frame, last = job.result()
                        except _Landed:
                            frame, last = again(j)
                    except _Doubted:
                        log.warning(
                            "cluster block %s failed its check where it was received and could not be "
                            "read again; a miss",
                            keys[j].hex()[:16],
                        )
                        return n
                    except UnsupportedVersion as err:  # written by a later build (a rolling upgrade):
                        # a miss here, and left for the hosts that read it
                        if not self._unreadable_logged:
                            self._unreadable_logged = True
                            log.warning(
                                "cluster block %s was written by a later kvstore (%s): read as a miss "
                                "and left in place (later ones are not logged)",
                                keys[j].hex()[:16],
                                err,
                            )
                        return n
                    except FrameError as err:
                        k = keys[j]
                        log.warning("cluster block %s failed its check (%s); deleted", k.hex()[:16], err)
                        self.cluster.count(corrupt=1)
                        try:
                            self.cluster.delete([k])
                        except ClusterUnavailable:
                            pass
                        return n
                    self.cluster.count(hits=1)
                    if frames is not None and frame is not None:
                        frames[keys[j]] = frame
                    n += 1
                if held < len(values):
                    return n
            return n
        finally:
            # a read cut short (a damaged block, a failure): nothing it started may write into outs
            # after it returns, neither this batch's checks nor the next batch's prefetch
            for job in work:
                job.exception()
            if ahead is not None:
                try:
                    ahead.result()
                except ClusterUnavailable:
                    pass
            self.cluster.count(misses=want - n)  # per block: those asked for and not served
            self._served(keys[:n], last)

    def fill(
        self,
        ns: Namespace,
        names: Chain,
        start: int,
        local: int,
        want: int,
        missed: bytes,
        keys: Iterator[bytes],
        out: torch.Tensor | None,
        blocks_out: Sequence[torch.Tensor] | None,
        later: Adoption | None = None,
    ) -> int:
        """(No lock held.) Blocks ``start + local ..`` (at most ``want - local``; ``missed`` is the first's
        key, ``keys`` yields the rest) from the cluster into ``out`` or ``blocks_out``, then stored here
        as a put of them would (best effort: a block before them that went meanwhile stops that), and
        nvme is offered their frames. Returns how many came.

        ``later``: they are stored here on the link's own thread after this has returned, once
        ``later.start`` is set (the caller answers its client meanwhile and leaves ``out`` as it is),
        and ``later.done()`` is called when that is over; ``settle`` waits for it. Without it they
        are stored before this returns."""
        T = ns.layout.block_tokens
        try:
            first = start + local
            rest = [missed, *islice(keys, want - local - 1)]
            parents: tuple[bytes, ...] | None
            if isinstance(names, KeyChain):
                # a page key is the engine's hash of the page and all before it: the same page read
                # on its own, after another run of pages, or after none, is the same block
                parents = None
            elif first > 0:
                parents = (names.keys(ns, first)[-1],)
            else:
                root = names.parent_key(ns)
                parents = (ns.root(),) if root is None else (root, ns.root())
            if blocks_out is not None:
                dsts = list(blocks_out[local:want])
            else:
                assert out is not None
                dsts = [out[:, :, j * T : (j + 1) * T] for j in range(local, want)]
            frames: dict[bytes, Any] = {}
            n = self.read(ns, rest, parents, dsts, frames)
        except BaseException:
            if later is not None:
                later.done()
            raise
        if not n:
            if later is not None:
                later.done()
            return n
        with self._lock:
            self._counts.tokens_served += n * T
        src = out[:, :, local * T : (local + n) * T] if out is not None else dsts[:n]

        def adopt() -> None:
            try:
                if self._offer is not None:
                    self._offer(frames)  # nvme takes the cluster's frames as they are
                self._put(ns, names, src, start_block=first, _adopted=True)
            except StoreClosed:
                pass

        if later is None:
            adopt()
        else:
            self._adopter.submit(adopt, later)
        return n

    def adopting(self) -> bool:
        """Whether blocks read from the cluster (``fill(later=...)``) are still to be stored here."""
        return self._adopter.pending()

    def settle(self, timeout: float | None = ADOPT_WAIT) -> bool:
        """Store the blocks read from the cluster before this call now (those waiting for their
        ``start`` too), and wait up to ``timeout`` seconds until they are; False when some still are not."""
        return self._adopter.settle(timeout)


class _Landed(Exception):
    """A value failed its check where it was received (ClusterReads.read's ``again`` reads it anew)."""


class _Doubted(Exception):
    """A value failed its check where it was received, and the daemon's own copy could not be had."""


def _receivable(outs: Sequence[torch.Tensor]) -> list[memoryview | None]:
    """Each of ``outs`` as bytes a socket can receive into (None where it cannot): host memory,
    contiguous, and overlapping no other of ``outs`` (a value received there would land on another's)."""
    spans = sorted(
        (o.data_ptr(), o.data_ptr() + o.nbytes, j)
        for j, o in enumerate(outs)
        if o.device.type == "cpu" and o.is_contiguous() and o.nbytes
    )
    over: set[int] = set()
    reach, last = 0, -1  # the furthest end of the spans so far, and whose it is
    for start, end, j in spans:
        if start < reach:
            over.update((j, last))
        if end > reach:
            reach, last = end, j
    alone = {j for _, _, j in spans} - over
    return [o.view(torch.uint8).reshape(-1).numpy().data if j in alone else None for j, o in enumerate(outs)]


def _unpack(
    key: bytes, value: bytes | memoryview, ns_id: str, parents: tuple[bytes, ...] | None
) -> tuple[BlockRecord, Any]:
    if parents is None:
        return unpack_value(key, value, ns_id, None)
    err: FrameError | None = None
    for p in parents:
        try:
            return unpack_value(key, value, ns_id, p)
        except FrameError as e:
            err = e
    assert err is not None
    raise err
