"""The pins clients hold through the protocol, each tenant within its quota and all within the
daemon's tables: a client's pin handles, and the blocks each same-host read keeps pinned.

    ledger.pin(tenant, blocks, lease, make)   -> a handle for the client, or ProtocolError "busy"
    ledger.release(handle)                    -> the store's handle it held, or None
    ledger.charge(located, tenant, lease)     -> False (nothing counted) past the quota: copy instead
    ledger.discharge(located)                 -> the read is over

A pin or a read whose lease has run out is forgotten at the next count (the store let go of it then).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.wire.errors import ProtocolError

# Pins held through the protocol at once, and the block references they hold in all (each costs the
# store's pin table an entry): bounds what clients pinning in a loop can make the daemon keep. Each
# tenant holds at most its quota of them (PinQuota), so one tenant cannot fill the table for all.
MAX_PINS = 4096
MAX_PINNED_KEYS = 1 << 18
# pins and same-host reads held past which a charge that must not wait (the event loop's) is not made:
# its check walks them all (about 0.1 us each)
QUICK_HELD = 512


@dataclass(frozen=True)
class PinQuota:
    """What one tenant (its namespaces' ``tenant``) may hold pinned through the protocol at once."""

    pins: int = 1024
    blocks: int = 65536


class PinLedger:
    """Client pins and same-host reads' pins, by tenant. Thread-safe."""

    def __init__(self, quota: PinQuota) -> None:
        self.quota = quota
        # pin handles given to clients: a random id (unguessable by other clients) ->
        # (the store's handle, expiry, tenant)
        self._pins: dict[int, tuple[Any, float, str]] = {}
        # same-host reads' pins (a locate's blocks, until its finish or its lease's end), counted in the
        # same quota: the id of the Located's pin handle (unique, never reused) -> (blocks, expiry, tenant)
        self._located: dict[int, tuple[int, float, str]] = {}
        self._lock = threading.Lock()

    def pin(self, tenant: str, blocks: int, lease: float, make: Callable[[], Any]) -> tuple[int, Any]:
        """A new handle for the store pin ``make()`` takes of ``blocks`` blocks for ``tenant``, and that
        pin (the store's handle, naming the blocks it holds: those still there); the
        quota is checked and the pin taken under one lock hold (two pins at once cannot both pass
        it). ProtocolError ``busy`` (nothing pinned) past the tenant's quota or the daemon's tables."""
        now = time.monotonic()
        quota = self.quota
        with self._lock:
            pins, held = self._held(tenant, now)
            if pins >= quota.pins or held + blocks > quota.blocks:
                # the caller's own figures only: nothing about other tenants' pins
                raise ProtocolError(
                    "busy",
                    f"tenant {tenant!r} holds {pins} pins of {held} blocks (same-host reads' "
                    f"included); its quota is {quota.pins} pins and {quota.blocks} blocks ([server] "
                    f"max_pins_per_tenant, max_pinned_blocks_per_tenant), and this pin needs {blocks} "
                    "more blocks. Release some or wait for their leases to end",
                )
            if not self._daemon_room(blocks):
                raise ProtocolError(
                    "busy", "the daemon holds all the pins it can; release yours or wait for leases to end"
                )
            handle = make()
            hid = secrets.randbits(63)
            self._pins[hid] = (handle, now + lease, tenant)
        return hid, handle

    def release(self, hid: int) -> Any:
        """The store's handle the client's ``hid`` held (forgotten now), or None."""
        with self._lock:
            got = self._pins.pop(hid, None)
        return None if got is None else got[0]

    def charge(self, located: Any, tenant: str, lease: float, *, wait: bool = True) -> bool:
        """Count a same-host read's pinned blocks (``located.places``) in ``tenant``'s quota; False
        (nothing counted) when they do not fit it, or the daemon's tables, or (``wait=False``) when
        the ledger is busy this instant (a pin holds it while it waits for the store) or holds more
        than QUICK_HELD pins and reads."""
        n = len(located.places)
        if not n:
            return True
        now = time.monotonic()
        quota = self.quota
        if not wait and len(self._pins) + len(self._located) > QUICK_HELD:
            return False  # its check walks every pin and read held: not at once
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            pins, held = self._held(tenant, now)
            if pins >= quota.pins or held + n > quota.blocks or not self._daemon_room(n):
                return False
            self._located[located.handle.id] = (n, now + lease, tenant)
        finally:
            self._lock.release()
        return True

    def renew(self, located: Any, lease: float) -> None:
        """A same-host read's pins were renewed: they stay in the quota until ``lease`` from now."""
        with self._lock:
            got = self._located.get(located.handle.id)
            if got is not None:
                n, expires, tenant = got
                self._located[located.handle.id] = (n, max(expires, time.monotonic() + lease), tenant)

    def discharge(self, located: Any) -> None:
        """A same-host read is over: its blocks leave the quota."""
        with self._lock:
            self._located.pop(located.handle.id, None)

    def _held(self, tenant: str, now: float) -> tuple[int, int]:
        """(Lock held.) The pins and pinned blocks ``tenant`` holds, its same-host reads' included;
        lapsed ones are forgotten first (the store has let go of them already)."""
        for hid in [h for h, (_, exp, _) in self._pins.items() if exp <= now]:
            del self._pins[hid]
        for lid in [i for i, (_, exp, _) in self._located.items() if exp <= now]:
            del self._located[lid]
        mine = [len(h.keys) for h, _, t in self._pins.values() if t == tenant]
        located = [n for n, _, t in self._located.values() if t == tenant]
        return len(mine) + len(located), sum(mine) + sum(located)

    def _daemon_room(self, blocks: int) -> bool:
        """(Lock held, after ``_held``.) Whether the daemon-wide tables take one more pin of ``blocks``."""
        held = sum(len(h.keys) for h, _, _ in self._pins.values()) + sum(
            n for n, _, _ in self._located.values()
        )
        return len(self._pins) + len(self._located) < MAX_PINS and held + blocks <= MAX_PINNED_KEYS
