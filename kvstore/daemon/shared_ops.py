"""The same-host data plane's requests (kvstore.shm): a get as locate then finish, a put as reserve
then commit. Located blocks are pinned in the store and counted in their tenant's pin quota until
the finish (or the lease's end); blocks no shared pool holds are decoded into the client's staging.

    locate  -> LocateOk: per block [segment (STAGING: the client's staging), extents, pages, generations]
    finish  -> the located blocks' pins let go; promotions and counts as a get's
    reserve -> a staging range for the client to write K/V into
    commit  -> the staged K/V stored, as a put of it
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.daemon.pin_quota import PinLedger
from kvstore.keys import Namespace
from kvstore.shm.plane import StagingFull
from kvstore.store.adoption import Adoption
from kvstore.store.reads import Located
from kvstore.wire.errors import ProtocolError
from kvstore.wire.messages import (
    Commit,
    Finish,
    FinishOk,
    Locate,
    LocateOk,
    Message,
    Put,
    Reserve,
    ReserveOk,
)
from kvstore.wire.protocol import Request

if TYPE_CHECKING:
    from kvstore.shm.plane import Lease, SharedPlane
    from kvstore.store.engine import Store

STAGING = -1  # a located block's segment index when it is in the client's staging segment

_EXTENT = struct.Struct("<qq")  # one (offset, length) run of a located block, as the client reads it


class SharedOps:
    """Locate, finish, reserve and commit over ``plane``. ``put``: the daemon's put handler (a commit
    is a put of the staged K/V, counted where every put is)."""

    def __init__(
        self,
        store: Store,
        plane: SharedPlane | None,
        ledger: PinLedger,
        put: Callable[[Put, Namespace | None, Any], Message],
    ) -> None:
        self.store, self.plane, self._ledger, self._put = store, plane, ledger, put

    def handle(self, request: Request) -> Message:
        """The reply to a locate, finish, reserve or commit. Raises ProtocolError (no_shared_memory
        for a daemon that offers none, or a tcp client) and what the store raises."""
        plane = self.plane
        if plane is None or not plane.offered or request.tenant is not None:  # (a CURVE client: tcp)
            raise ProtocolError(
                "no_shared_memory",
                f"{request.msg.op}: this daemon offers no shared memory on this endpoint "
                '(tcp, [server] shared_memory = "off", or not on this machine); use get and put',
            )
        msg, ns = request.msg, request.namespace
        if isinstance(msg, Locate):
            assert ns is not None
            return self._locate(plane, request.peer, msg, ns)
        if isinstance(msg, Finish):
            lease = plane.take(msg.handle, request.peer)
            if lease is not None and lease.held is not None:
                self._finish(lease.held, msg.used)
            return FinishOk(released=lease is not None)
        if isinstance(msg, Reserve):
            if msg.nbytes < 1:  # a lease of nothing holds no staging, only the daemon's bookkeeping
                raise ProtocolError("invalid_argument", f"reserve of {msg.nbytes} bytes: reserve at least 1")
            got = plane.reserve(request.peer, msg.nbytes)
            seg = got.staging
            return ReserveOk(
                handle=got.handle,
                instance=plane.instance,
                offset=got.offset,
                nbytes=got.nbytes,
                path="" if seg is None else str(seg.path),
                size=0 if seg is None else seg.size,
                lease=max(0.0, got.expires - plane.clock()),
            )
        assert isinstance(msg, Commit) and ns is not None
        return self._commit(plane, request.peer, msg, ns)

    def _locate(self, plane: SharedPlane, peer: bytes, msg: Locate, ns: Namespace) -> Message:
        plane.admit(peer)  # before anything is pinned: a client at its lease bound pins nothing
        shared = self._shared_tiers(plane, msg)

        def locate(tiers: set[int], count: bool) -> Located:
            return self.store.locate(
                ns,
                msg.chain,
                tiers,
                start_block=msg.start_block,
                max_blocks=msg.max_blocks,
                lease=plane.lease,
                count=count,
            )

        located = locate(shared, False)
        if self._ledger.charge(located, ns.tenant, plane.lease):
            self.store.count_located(located)
        else:  # past the tenant's pin quota: nothing stays pinned, the blocks are copied into staging
            self.store.unlocate(located)
            located = locate(set(), True)
        blocks, tiers = self._places(plane, located)
        layout = ns.layout
        nb = layout.block_nbytes
        k = min(located.rest, plane.per_client // nb)
        rest = located.rest
        try:
            try:
                lease = plane.reserve(peer, k * nb, held=located, armed=False)
            except (ProtocolError, StagingFull):  # no staging room now: the client reads these next time
                k = 0
                lease = plane.reserve(peer, 0, held=located, armed=False)
        except BaseException:
            self._finish(located, 0)  # the located blocks' pins, at once: not at their lease's end
            raise
        try:
            if k:  # blocks no shared pool holds (nvme): decoded by the daemon into staging
                buf = plane.staging_tensor(lease).view(layout.torch_dtype)
                shape = layout.shape(layout.block_tokens)
                per = nb // layout.torch_dtype.itemsize
                outs = [buf[b * per : (b + 1) * per].view(shape) for b in range(k)]  # block-major
                # blocks from the cluster are stored here from staging after the client copied them
                # (its finish, or the lease's end): the range is kept for that, whatever the client does
                plane.reading(lease)
                r = self.store.get(
                    ns,
                    msg.chain,
                    start_block=msg.start_block + len(located.places),
                    max_blocks=k,
                    out=outs,
                    adopted=Adoption(lambda: plane.done_reading(lease, keep=True), lease.copied, plane.lease),
                    lookup=False,  # the locate's own, counted once
                )
                for j in range(r.matched_blocks):
                    extent = np.asarray([[lease.offset + j * nb, nb]], dtype="<i8").tobytes()
                    blocks.append([STAGING, extent, b"", b""])
                tiers.extend(r.tiers)
                rest = located.rest - k if r.matched_blocks == k else 0  # short: the chain broke there
                if not rest:  # the last round of this read: what is not held after it is counted now
                    self.store.missed(located)
                # the decode may have waited (blocks the cluster sent earlier gets being stored, a
                # slow disk or cluster): the located blocks stay pinned for the lease the reply gives
                if located.places and self.store.renew(located, plane.lease):
                    self._ledger.renew(located, plane.lease)
        except BaseException:
            plane.take(lease.handle)
            self._finish(located, 0)
            raise
        plane.arm(lease)
        return self._located_ok(plane, lease, msg, blocks, tiers, rest)

    def try_inline(self, request: Request, max_blocks: int) -> Message | None:
        """The reply to a locate when it can be made this instant without waiting: the store's lock,
        the plane's and the pin ledger's are free, and every block asked for that is held is in a
        pool the client mapped (nothing to decode into staging, nothing to ask the cluster), at most
        ``max_blocks`` of them; else None, nothing pinned, counted, leased or charged, and a worker
        runs it (its errors included).
        Run on the event loop, a locate skips two thread hand-offs: a same-host read's round trip is
        most of what it costs on a GPU."""
        plane, msg, ns = self.plane, request.msg, request.namespace
        if not isinstance(msg, Locate) or ns is None or plane is None or not plane.offered:
            return None
        want = msg.chain.blocks(ns.layout.block_tokens) - msg.start_block
        if msg.max_blocks is not None:
            want = min(want, msg.max_blocks)
        if request.tenant is not None or want > max_blocks:
            return None
        shared = self._shared_tiers(plane, msg)
        if not shared:
            return None
        made: list[tuple[Lease, list[list[Any]], list[str]]] = []

        def keep(got: Located) -> bool:  # under the store's lock, as the blocks are pinned: the
            # reply's rows, then the client's lease and the tenant's quota (both taken, or neither)
            blocks, tiers = self._places(plane, got)
            lease = plane.try_lease(
                request.peer, got, lambda: self._ledger.charge(got, ns.tenant, plane.lease, wait=False)
            )
            if lease is not None:
                made.append((lease, blocks, tiers))
            return lease is not None

        try:
            located = self.store.try_locate(
                ns,
                msg.chain,
                shared,
                start_block=msg.start_block,
                max_blocks=msg.max_blocks,
                lease=plane.lease,
                keep=keep,
            )
        except Exception:  # (none expected) nothing was taken: a worker runs it and answers the error
            return None
        if located is None:
            return None
        lease, blocks, tiers = made[0]
        return self._located_ok(plane, lease, msg, blocks, tiers, 0)

    def _shared_tiers(self, plane: SharedPlane, msg: Locate) -> set[int]:
        """The store's tiers that ``msg`` may be located in: the shared pools the client mapped."""
        names = self.store.tiers.names
        return {t for t, name in enumerate(names) if name in msg.tiers and plane.pools.shares(name)}

    def _places(self, plane: SharedPlane, located: Located) -> tuple[list[list[Any]], list[str]]:
        """The reply's rows of ``located``'s blocks (segment, extents, pages, generations) and their tiers."""
        names = self.store.tiers.names
        blocks: list[list[Any]] = []
        tiers: list[str] = []
        segments = {t: plane.pools.index(names[t]) for t in {t for _, t, _ in located.places}}
        for _, t, place in located.places:
            blocks.append(
                [
                    segments[t],
                    _EXTENT.pack(*place.extents[0])
                    if len(place.extents) == 1
                    else np.asarray(place.extents, dtype="<i8").tobytes(),
                    place.pages.astype("<i8", copy=False).tobytes(),
                    place.gens.astype("<u8", copy=False).tobytes(),
                ]
            )
            tiers.append(names[t])
        return blocks, tiers

    @staticmethod
    def _located_ok(
        plane: SharedPlane, lease: Lease, msg: Locate, blocks: list[list[Any]], tiers: list[str], rest: int
    ) -> LocateOk:
        seg = lease.staging
        return LocateOk(
            handle=lease.handle,
            instance=plane.instance,
            start_block=msg.start_block,
            blocks=blocks,
            tiers=tiers,
            lease=plane.lease,
            staging=None if seg is None else [str(seg.path), seg.size],
            rest=rest,
        )

    def _commit(self, plane: SharedPlane, peer: bytes, msg: Commit, ns: Namespace) -> Message:
        lease = plane.hold(msg.handle, peer)
        if lease is None:
            raise ProtocolError(
                "not_found",
                "commit: the staging lease is unknown or lapsed (nothing was stored); reserve again",
            )
        try:
            need = math.prod(msg.shape) * ns.layout.torch_dtype.itemsize
            if need > lease.nbytes:
                raise ProtocolError(
                    "invalid_argument",
                    f"commit of shape {list(msg.shape)} needs {need} bytes; the reservation holds {lease.nbytes}",
                )
            kv = plane.staging_tensor(lease)[:need].view(ns.layout.torch_dtype).view(msg.shape)
            return self._put(
                Put(
                    ns=msg.ns,
                    tokens=msg.tokens,
                    keys=msg.keys,
                    parent=msg.parent,
                    shape=msg.shape,
                    dtype=msg.dtype,
                    start_block=msg.start_block,
                    session=msg.session,
                ),
                ns,
                kv,
            )
        finally:  # kept: the client writes its next chunk there
            plane.done_reading(lease, keep=msg.keep)

    def _finish(self, located: Located, used: int) -> None:
        """A same-host read is over: its pins are let go, in the store and in the quota."""
        self._ledger.discharge(located)
        self.store.finish(located, used)
